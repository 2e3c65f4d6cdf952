"""Shared helpers for the tests: dtype families, deterministic inputs, reference reductions,
and the array kinds (numpy arrays, torch CPU tensors) the same tests run on."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from functools import reduce as _fold
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist.launch.environment import free_port  # noqa: F401 - re-exported for the tests
from mpidist.launch.rendezvous import speaks_pmi1
from mpidist.launch.run import local_command
from mpidist.testing.standin import HostCudaArray

#: the repository (the tests live in tests/<layer>/, beside helpers.py in tests/)
REPO = Path(__file__).resolve().parents[1]
#: programs the tests start as jobs of their own
PROGRAMS = REPO / "tests" / "programs"

BF16 = np.dtype(ml_dtypes.bfloat16)

#: one representative per dtype family, and every supported dtype
FAMILIES = {
    "bool": np.dtype(np.bool_),
    "int": np.dtype(np.int32),
    "uint": np.dtype(np.uint16),
    "f16": np.dtype(np.float16),
    "bf16": BF16,
    "float": np.dtype(np.float64),
    "complex": np.dtype(np.complex64),
}
ALL_DTYPES = [
    np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64, np.complex64, np.complex128,
    )
] + [BF16]  # fmt: skip


def kind(dtype: np.dtype) -> str:
    if dtype == BF16:
        return "f"
    return {"b": "b", "i": "i", "u": "u", "f": "f", "c": "c"}[dtype.kind]


def rank_input(rank: int, shape: tuple[int, ...], dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """A deterministic array for ``rank``: small values, exactly representable in every dtype."""
    n = int(np.prod(shape)) if shape else 1
    base = (np.arange(n) * 7 + rank * 3 + salt * 5) % 5 + 1  # 1..5
    if dtype.kind == "b":
        a = (np.arange(n) + rank + salt) % 3 == 0
    elif dtype.kind == "c":
        a = base + 1j * ((np.arange(n) + rank) % 3)
    elif dtype.kind == "i":
        a = base * (-1) ** ((np.arange(n) + rank) % 2)
    else:
        a = base
    return np.asarray(a).astype(dtype).reshape(shape)


def _ufunc(op, k: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    R = dist.ReduceOp
    if k == "b":
        table = {R.SUM: np.logical_or, R.PRODUCT: np.logical_and, R.MIN: np.logical_and, R.MAX: np.logical_or,
                 R.BAND: np.logical_and, R.BOR: np.logical_or, R.BXOR: np.logical_xor}  # fmt: skip
    else:
        table = {R.SUM: np.add, R.AVG: np.add, R.PRODUCT: np.multiply, R.MIN: np.minimum, R.MAX: np.maximum,
                 R.BAND: np.bitwise_and, R.BOR: np.bitwise_or, R.BXOR: np.bitwise_xor}  # fmt: skip
    return table[op]


def reference(arrays: list[np.ndarray], op) -> np.ndarray:
    """The result a reduction of ``arrays`` must give, computed with numpy.

    Low-precision floats are reduced in float64 and rounded once (mpidist
    rounds bfloat16 reductions once; the small test values make float16 exact).
    AVG truncates integer quotients toward zero.
    """
    dtype = arrays[0].dtype
    k = kind(dtype)
    premul = None
    if isinstance(op, dist.ReduceOp) and op.op == dist.ReduceOp.PREMUL_SUM:
        premul, op = op.factor, dist.ReduceOp.SUM
    wide = np.complex128 if k == "c" else (np.float64 if k == "f" else None)
    work = [a.astype(wide) if wide is not None else a.copy() for a in arrays]
    if premul is not None:
        work = [w * premul for w in work]
    out = _fold(_ufunc(op, k), work)
    if op == dist.ReduceOp.AVG:
        n = len(arrays)
        if k in "iu":
            q = np.abs(out.astype(np.int64)) // n * np.sign(out.astype(np.int64))
            out = q
        else:
            out = out / n
    return np.asarray(out).astype(dtype)


def gather_all(a: Any, comm: MPI.Comm | None = None) -> list[bytes]:
    """Collect every rank's copy of ``a`` (an array of any kind) with raw mpi4py (to compare across ranks)."""
    comm = comm or MPI.COMM_WORLD
    values = to_numpy(a) if any(k.owns(a) for k in ARRAY_KINDS.values()) else np.asarray(a)
    return comm.allgather(np.ascontiguousarray(values).tobytes())


def assert_identical_on_all_ranks(a: Any) -> None:
    blobs = gather_all(a)
    assert all(b == blobs[0] for b in blobs), "result differs between ranks"


def assert_equal(got: Any, expected: np.ndarray) -> None:
    """Exact equality, dtype included (NaN-free inputs); ``got`` may be an array of any kind."""
    if not isinstance(got, (np.ndarray, np.generic)):
        got = to_numpy(got)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.array_equal(got, expected), f"\n got {got}\n expected {expected}"


def fail_together(problems: list[str]) -> None:
    """Fail on every rank if any rank found a problem (so no rank runs ahead into a collective)."""
    everyone = MPI.COMM_WORLD.allgather(problems)
    bad = {r: p for r, p in enumerate(everyone) if p}
    assert not bad, f"problems by rank: {bad}"


class Checks:
    """The failed checks of one test, collected; ``done()`` fails on every rank together if any rank has one.

    Every rank must reach ``done()`` (it is a collective); loops over roots and
    cases collect here instead of asserting, so that no rank runs ahead into a
    collective its peers will not join.
    """

    def __init__(self) -> None:
        self.failures: list[str] = []

    def equal(self, what: str, got: Any, expected: Any) -> None:
        """Exact equality: arrays of any kind against a numpy array or scalar (dtype and shape included), or values."""
        if not isinstance(expected, (np.ndarray, np.generic)):
            if got != expected:
                self.failures.append(f"{what}: got {got!r}, expected {expected!r}")
            return
        try:
            assert_equal(got, expected)
        except AssertionError as exc:
            self.failures.append(f"{what}: {exc}")

    def true(self, what: str, cond: bool) -> None:
        if not cond:
            self.failures.append(what)

    def raises(self, exc: type[BaseException], match: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        self.failures.extend(check_raises(exc, match, fn, *args, **kwargs))

    def identical(self, what: str, a: Any) -> None:
        """Record whether ``a`` is bitwise identical on every rank (a collective on COMM_WORLD)."""
        blobs = gather_all(a)
        if not all(b == blobs[0] for b in blobs):
            self.failures.append(f"{what}: result differs between ranks")

    def done(self) -> None:
        fail_together(self.failures)


def raises_together(exc: type[BaseException], match: str, fn, *args, **kwargs) -> None:
    """Like ``pytest.raises`` around ``fn``, but a mismatch fails the test on every rank at once."""
    fail_together(check_raises(exc, match, fn, *args, **kwargs))


def inputs_of(n: int, shape: tuple[int, ...], dtype: Any, salt: int = 0) -> list[np.ndarray]:
    """Every rank's ``rank_input`` in a world of ``n`` ranks (what the references are built from)."""
    return [rank_input(r, shape, np.dtype(dtype), salt) for r in range(n)]


def copies() -> int:
    """How many staging copies this rank's mpidist has made so far (``world.stats.copies``)."""
    from mpidist._world import world

    return world.stats.copies


def timeout_head(op: str, seq: int, g: Any, timeout: str = "1") -> str:
    """The start of the timeout message of ``op`` (call ``seq``) on the MPI group ``g``, on this rank (a regex)."""
    return (
        rf"^{op} \(call #{seq}\) on group {re.escape(g.group_name)} \(mpi, rank {g.rank()} of {g.size()}\) "
        rf"did not complete within the timeout of {timeout} s\."
    )


def meet_outside_mpidist() -> None:
    """Meet every rank of the world without entering mpidist (a raw MPI barrier, polled).

    A test's absent rank calls this instead of sleeping a fixed time, and the others call it once
    their call has timed out: the absent rank stays outside every mpidist call (their diagnosis
    reports it as not answering) exactly as long as they need, however loaded the machine is.
    """
    import time

    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def sum_ok(c: Checks, g: Any) -> None:
    """Record whether an all_reduce of [r+1, 10 r] on ``g`` (of every rank) gives the exact sums: the group works."""
    n = MPI.COMM_WORLD.Get_size()
    x = np.array([MPI.COMM_WORLD.Get_rank() + 1.0, 10.0 * MPI.COMM_WORLD.Get_rank()])
    dist.all_reduce(x, group=g)
    c.equal("all_reduce afterwards", x, np.array([n * (n + 1) / 2, 10.0 * n * (n - 1) / 2]))


def nccl_reference(arrays: list[np.ndarray], op: Any) -> np.ndarray:
    """:func:`reference`, with complex AVG divided per component (correctly rounded, as NCCL's float pairs)."""
    if op == dist.ReduceOp.AVG and arrays[0].dtype.kind == "c":
        total = reference(arrays, dist.ReduceOp.SUM).astype(np.complex128)
        return (total.view(np.float64) / len(arrays)).view(np.complex128).astype(arrays[0].dtype)
    return reference(arrays, op)


def check_raises(exc: type[BaseException], match: str, fn, *args, **kwargs) -> list[str]:
    """Call ``fn``; return what is wrong (no exception, another type, another message) instead of raising."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        fn(*args, **kwargs)
    except exc as e:
        if not re.search(match, str(e)):
            return [f"{name}: {type(e).__name__} message {str(e)!r} does not match {match!r}"]
        return []
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        return [f"{name}: raised {type(e).__name__}: {e} instead of {exc.__name__}"]
    return [f"{name}: did not raise {exc.__name__}"]


# ---------------------------------------------------------------------------------------
# array kinds: the same tests on numpy arrays and on torch CPU tensors
# ---------------------------------------------------------------------------------------


def sentinel(dtype: Any) -> Any:
    """A value no test result holds, to fill outputs with (an unwritten output is noticed)."""
    k = kind(np.dtype(dtype))
    return {"b": True, "i": -99, "u": 99, "f": -99.0, "c": -99 - 99j}[k]


_torch_ready = False


def _torch() -> Any:
    """The torch module, set up once for tests: one intra-op thread (up to 4 ranks share 2 cores)."""
    global _torch_ready
    torch = importlib.import_module("torch")
    if not _torch_ready:
        torch.set_num_threads(1)
        _torch_ready = True
    return torch


def _shareable(a: np.ndarray) -> bool:
    """Whether torch.from_numpy can wrap ``a`` without a copy (no negative strides, writeable)."""
    return a.flags.writeable and all(s >= 0 for s in a.strides)


def _torch_from_numpy(a: np.ndarray) -> Any:
    torch = _torch()
    if not _shareable(a):  # torch has no negative strides; read-only memory must not be wrapped
        a = np.array(a, order="C", copy=True)
    if a.dtype == BF16:  # torch.from_numpy knows no bfloat16: wrap the bits, reinterpret in torch
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _torch_to_numpy(t: Any) -> np.ndarray:
    """A copy of a tensor's values as numpy, read through torch itself (not mpidist's int16 trick)."""
    torch = _torch()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.dtype == torch.bfloat16:  # bfloat16 -> float32 is exact, and so is the way back
        return t.to(torch.float32).numpy().astype(BF16)
    return np.array(t.numpy(), copy=True)


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_reverse_axes(t: Any) -> Any:
    return t.permute(*reversed(range(t.dim())))


def _quiet_staging() -> None:
    """Device-kind tests stage through host memory on purpose: no one-time warning for them."""
    os.environ.setdefault("MPIDIST_DEVICE_STAGING", "quiet")


@dataclass(frozen=True)
class ArrayKind:
    """How the tests make, read and reshape one kind of array.

    A new kind (a device stand-in, cupy, ...) is one more entry in :data:`ARRAY_KINDS`.
    """

    name: str
    requires: str | None  # the module that must import, or the kind is skipped
    setup: Callable[[], Any] | None  # run once the module imports (e.g. torch's thread count)
    from_numpy: Callable[[np.ndarray], Any]  # shares memory where it can
    to_numpy: Callable[[Any], np.ndarray]
    owns: Callable[[Any], bool]  # is this object an array of this kind
    reverse_axes: Callable[[Any], Any]  # a transposed (non-contiguous) view
    negative_strides: bool  # can views step backwards (x[::-1])
    zero_copy: bool = True  # contiguous arrays reach MPI without a copy (device arrays: staged)
    device: bool = False  # GPU memory (or its stand-in)


ARRAY_KINDS: dict[str, ArrayKind] = {
    k.name: k
    for k in (
        ArrayKind(
            name="numpy",
            requires=None,
            setup=None,
            from_numpy=lambda a: a,
            to_numpy=lambda a: a,
            owns=lambda x: isinstance(x, np.ndarray),
            reverse_axes=np.transpose,
            negative_strides=True,
        ),
        ArrayKind(
            name="torch",
            requires="torch",
            setup=_torch,
            from_numpy=_torch_from_numpy,
            to_numpy=_torch_to_numpy,
            owns=_is_torch,
            reverse_axes=_torch_reverse_axes,
            negative_strides=False,
        ),
        ArrayKind(
            name="device",  # mpidist.testing.HostCudaArray: the GPU path (staged over MPI), no GPU needed
            requires=None,
            setup=_quiet_staging,
            from_numpy=lambda a: HostCudaArray(a),
            to_numpy=lambda x: x.host.copy(),
            owns=lambda x: isinstance(x, HostCudaArray),
            reverse_axes=lambda x: HostCudaArray(x.host.T),
            negative_strides=True,
            zero_copy=False,
            device=True,
        ),
    )
}

#: the array kinds every array test runs on (the ``array_kind`` fixture's params)
KINDS: list[str] = list(ARRAY_KINDS)
#: the kinds in host memory (for APIs that take host arrays only, such as the Lightning utilities)
HOST_KINDS: list[str] = [k for k in KINDS if not ARRAY_KINDS[k].device]


def require_kind(kind_name: str) -> ArrayKind:
    """Return the kind, or skip the test when its library is not installed."""
    k = ARRAY_KINDS[kind_name]
    if k.requires is not None:
        pytest.importorskip(k.requires)
    if k.setup is not None:
        k.setup()
    return k


def kind_of(x: Any) -> ArrayKind:
    for k in ARRAY_KINDS.values():
        if k.owns(x):
            return k
    raise TypeError(f"not an array of a known kind: {type(x).__module__}.{type(x).__qualname__}")


def to_kind(a: np.ndarray, kind_name: str) -> Any:
    """``a`` as an array of kind ``kind_name``, sharing its memory where that kind can.

    numpy: ``a`` itself. torch: ``torch.from_numpy`` (bfloat16 as its int16 bits viewed
    as torch.bfloat16); arrays with negative strides or read-only memory are copied.
    Shared memory means a collective that writes the result writes ``a`` too: build
    references from fresh values (``rank_input``), or pass ``a.copy()``.
    """
    return ARRAY_KINDS[kind_name].from_numpy(np.asarray(a))


def to_numpy(x: Any) -> np.ndarray:
    """The values of an array of any kind, as numpy with the numpy dtype (bfloat16: ml_dtypes).

    A numpy array is returned as it is; a tensor is copied (without autograd).
    """
    return kind_of(x).to_numpy(x)


def reverse_axes(x: Any) -> Any:
    """The view of ``x`` with its axes reversed (``x.T``), for any kind."""
    return kind_of(x).reverse_axes(x)


def filled(shape: tuple[int, ...], dtype: Any, value: Any) -> np.ndarray:
    out = np.empty(shape, dtype)
    out[...] = value
    return out


class Maker:
    """Builds the arrays of one kind that a test passes to mpidist, from numpy values.

    ``make(a)`` converts (sharing ``a``'s memory, see :func:`to_kind`); ``make.input`` is
    :func:`rank_input` of that kind; ``make.empty`` an output filled with the :func:`sentinel`;
    ``make.strided`` a non-contiguous view of a bigger array of that kind.
    """

    def __init__(self, kind_name: str) -> None:
        self.kind = require_kind(kind_name)
        self.name = kind_name

    def __call__(self, a: Any) -> Any:
        return to_kind(np.asarray(a), self.name)

    def input(self, rank: int, shape: tuple[int, ...], dtype: Any, salt: int = 0) -> Any:
        return self(rank_input(rank, shape, np.dtype(dtype), salt))

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self(filled(shape, dtype, sentinel(dtype)))

    def zeros(self, shape: Any, dtype: Any = np.float64) -> Any:
        return self(np.zeros(shape, dtype))

    def strided(self, a: np.ndarray, fill: Any = None) -> tuple[Any, Any]:
        """``(view, base)``: a non-contiguous view holding ``a``'s values (every other element of
        the last axis of ``base``, made as this kind and sliced as this kind); the gaps hold
        ``fill`` (the sentinel by default)."""
        a = np.asarray(a)
        if a.ndim == 0:
            raise ValueError("strided: a 0-d array has no axis to stride along")
        base = filled((*a.shape[:-1], 2 * a.shape[-1]), a.dtype, sentinel(a.dtype) if fill is None else fill)
        base[..., ::2] = a
        kbase = self(base)
        return kbase[..., ::2], kbase


# -- worlds of plain processes (no MPI launcher) ----------------------------------------------

#: a world of plain processes (torchrun, env://, file:// without mpiexec) needs an MPI library that
#: speaks PMI-1 (MPICH); Open MPI's processes can only be started by its own launcher
needs_pmi1 = pytest.mark.skipif(
    not speaks_pmi1(), reason="no MPI launcher: needs PMI-1 (MPICH); Open MPI needs its launcher (docs/drop-in.md)"
)


@cache
def mpiexec_command(n: int) -> tuple[str, ...]:
    """``mpiexec -n N`` (the one beside this Python) for a job of a test's own, as mpidistrun starts it here:
    with Open MPI's ``--oversubscribe`` (and ``--allow-run-as-root`` for root), which MPICH needs not."""
    return tuple(local_command([str(Path(sys.executable).parent / "mpiexec")], n))


#: prefixes of the variables MPI launchers set (removed for processes that must not look launched)
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL", "PALS_")
#: torchrun's variables (removed too: each test sets the ones it means)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                      "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's or torchrun's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in TORCHRUN_VARIABLES}
    env.update(extra)
    return env


def run_plain_world(script: str, envs: list[dict[str, str]], args: list[list[str]], tmp_path: Any,
                    timeout: float = 120) -> list[dict]:  # fmt: skip
    """Start ``len(envs)`` plain ``python`` processes running ``script``; return each one's ``RESULT {json}`` line.

    Fails the test (killing every process) if one does not finish within ``timeout``,
    exits non-zero, or prints no result.
    """
    path = tmp_path / "child.py"
    path.write_text(script)
    procs = [
        subprocess.Popen(
            [sys.executable, str(path), *a], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for e, a in zip(envs, args)
    ]
    results = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"process {r} did not finish within {timeout} s")
        assert p.returncode == 0, f"process {r} exited with {p.returncode}:\n{err[-3000:]}"
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"process {r} printed no result:\n{out}\n{err[-3000:]}"
        results.append(json.loads(lines[0][len("RESULT ") :]))
    return results


def gloo_group(prefix: str, timeout: Any = None) -> Any:
    """A context manager for a module fixture: a gloo group over every process (rank and size from MPI).

    torch.distributed's default group on gloo through a ``file://`` rendezvous in a directory rank 0
    makes (``prefix``), or a new gloo group where torch.distributed is already initialized; destroyed,
    and the directory removed, on exit. Skips where torch has no gloo. ``timeout``: 120 s by default.
    """
    import contextlib
    import shutil
    import tempfile
    from datetime import timedelta

    torch = pytest.importorskip("torch")
    tdist = pytest.importorskip("torch.distributed")

    @contextlib.contextmanager
    def group() -> Any:
        if not tdist.is_available() or not tdist.is_gloo_available():
            pytest.skip("this torch has no gloo backend")
        torch.set_num_threads(1)  # the ranks share few cores
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        wait = timeout if timeout is not None else timedelta(seconds=120)
        owned = not tdist.is_initialized()
        tmpdir = comm.bcast(tempfile.mkdtemp(prefix=prefix) if rank == 0 else None, root=0)
        if owned:
            tdist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=size,
                                     timeout=wait)  # fmt: skip
            pg = tdist.group.WORLD
        else:  # someone else initialized torch.distributed: a gloo group of our own
            pg = tdist.new_group(backend="gloo", timeout=wait)
        try:
            yield pg
        finally:
            tdist.destroy_process_group(None if owned else pg)
            comm.barrier()
            if rank == 0:
                shutil.rmtree(tmpdir, ignore_errors=True)

    return group()


def torch_groups_with_gloo(prefix: str, timeout: Any) -> Any:
    """A generator for a module fixture: (torch's default group on "mpidist", a gloo group) over every process.

    Started through a ``file://`` rendezvous in a directory rank 0 makes; destroyed, and the directory
    removed, when the generator is closed. Skips when torch.distributed was left initialized.
    """
    import contextlib
    import shutil
    import tempfile

    import torch
    import torch.distributed as tdist

    @contextlib.contextmanager
    def groups() -> Any:
        if tdist.is_initialized():
            pytest.skip("torch.distributed was initialized by another module")
        torch.set_num_threads(1)  # the ranks share few cores
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        tmpdir = comm.bcast(tempfile.mkdtemp(prefix=prefix) if rank == 0 else None, root=0)
        tdist.init_process_group("mpidist", init_method=f"file://{tmpdir}/rdv", rank=rank, world_size=size,
                                 timeout=timeout)  # fmt: skip
        gloo = tdist.new_group(backend="gloo", timeout=timeout)
        try:
            yield tdist.group.WORLD, gloo
        finally:
            tdist.destroy_process_group()
            comm.barrier()
            if rank == 0:
                shutil.rmtree(tmpdir, ignore_errors=True)

    return groups()

