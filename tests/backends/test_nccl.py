"""The nccl backend without a GPU: NCCL and the CUDA runtime replaced by the fakes of ``nccl_fake``.

The fake NCCL runs each call over MPI on host memory and checks what real NCCL
requires (datatypes and ops of its version, the communication stream, in-place
layouts); fake events complete at once unless held. So every path of the backend
runs here: every collective, dtype and ReduceOp against numpy references, roots,
in-place and overlapping arguments, AVG native and emulated, PREMUL_SUM, the
unique-id forms, stream ordering, Work semantics, timeouts and errors.

Every test is SPMD, runs at world sizes 1 to 4, and collects its comparisons so
that all ranks fail together (``Checks.done``).
"""

from __future__ import annotations

import gc
import types
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import DistBackendError
from mpidist._world import world
from mpidist.backends._cuda import bfloat16_apply, make_communicator, parse_version, uid_bytes, uid_tuple
from mpidist.backends._cuda_work import CudaWork
from mpidist.backends.nccl import NCCLBackend
from mpidist.reduce_op import OP_TABLE
from mpidist.testing import HostCudaArray

from helpers import (
    ALL_DTYPES,
    BF16,
    Checks,
    assert_equal,
    filled,
    inputs_of,
    kind,
    nccl_reference,
    rank_input,
    sentinel,
)
from nccl_fake import CURRENT_STREAM, FakeNccl, FakeRuntime, dev

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
R = dist.ReduceOp
NEW, OLD = 21903, 2804  # NCCL 2.19.3 (ncclAvg, bfloat16) and 2.8.4 (neither)
VERSIONS = pytest.mark.parametrize("version", [NEW, OLD], ids=["nccl2.19", "nccl2.8"])
I16 = (np.dtype(np.int16), np.dtype(np.uint16))
SOME = [np.dtype(t) for t in (np.bool_, np.int8, np.uint16, np.int64, np.float16, np.float32, np.complex128)] + [BF16]


@pytest.fixture
def make_backend():
    """``make_backend(nccl=None, runtime kwargs..., backend kwargs...)`` -> (backend, runtime, nccl); freed after."""
    made: list[tuple[NCCLBackend, Any]] = []

    def build(nccl: FakeNccl | None = None, timeout: float = 60.0, rt: dict | None = None, **kw: Any):
        nccl = nccl or FakeNccl()
        runtime = FakeRuntime(nccl, **(rt or {}))
        comm = MPI.COMM_WORLD.Dup()
        backend = NCCLBackend(comm, timeout, "test", runtime=runtime, **kw)
        made.append((backend, comm))
        return backend, runtime, nccl

    yield build
    for backend, comm in made:
        backend.rt.release()
        backend.shutdown()
        comm.Free()


def expected_error(dtype: np.dtype, op: Any, version: int) -> tuple[type[BaseException], str] | None:
    """The error the nccl backend raises for ``op`` on ``dtype``, or None if it reduces it."""
    base = op.op if isinstance(op, R) else op
    if base in (R.BAND, R.BOR, R.BXOR):
        return ValueError, r"ReduceOp\.B.* is not supported by the nccl backend"
    if OP_TABLE[kind(dtype)][base] is None:
        return ValueError, "is not defined for"
    if dtype in I16:
        return TypeError, "cannot reduce u?int16 arrays"
    if dtype == BF16 and version == OLD:
        return TypeError, r"bfloat16 needs NCCL >= 2\.10"
    return None


def ops_for(dtype: np.dtype) -> list[Any]:
    """Every ReduceOp, PREMUL_SUM with a real factor, and with a complex one for complex arrays."""
    ops: list[Any] = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.BAND, R.BOR, R.BXOR, dist.make_premul_sum(0.5)]
    if dtype.kind == "c":
        ops.append(dist.make_premul_sum(1j))
    return ops


# -- construction --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uid_form,ctor_form", [("bytes", "bytes"), ("tuple", "tuple"), ("tuple", "bytes"), ("bytes", "tuple")]
)
def test_unique_id_forms(make_backend, uid_form, ctor_form):
    """cupy >= 14 gives and takes bytes, older cupy a tuple of chars: either works, mixed too."""
    c = Checks()
    nccl = FakeNccl(uid_form=uid_form, ctor_form=ctor_form)
    backend, _, _ = make_backend(nccl)
    c.equal("constructor got", [t.__name__ for t in nccl.uid_seen], [ctor_form])
    c.equal("get_unique_id calls", len(nccl.calls("get_unique_id")), 1 if RANK == 0 else 0)
    x = np.full(3, RANK + 1, np.float32)
    backend.all_reduce(dev(x), None, R.SUM, False)
    c.equal("all_reduce", x, np.full(3, SIZE * (SIZE + 1) / 2, np.float32))
    c.done()


def test_unique_id_helpers():
    data = bytes(range(128))
    signed = uid_tuple(data)
    c = Checks()
    c.true("signed chars", min(signed) >= -128 and max(signed) <= 127 and signed[200 - 128 - 1] == 71)
    c.equal("round trip", np.frombuffer(uid_bytes(signed), np.uint8), np.arange(128, dtype=np.uint8))
    c.equal("unsigned tuple", np.frombuffer(uid_bytes(tuple(range(128))), np.uint8), np.arange(128, dtype=np.uint8))
    c.true("bytes kept", uid_bytes(data) == data)
    c.raises(TypeError, "expected 128", uid_bytes, b"short")
    c.raises(TypeError, "expected bytes or a tuple", uid_bytes, "a string")
    c.equal("2.19.3", parse_version(21903), (2, 19, 3))
    c.equal("2.8.4", parse_version(2804), (2, 8, 4))
    c.equal("2.10.3", parse_version(21003), (2, 10, 3))

    def tuple_only(size, uid, rank):
        if not isinstance(uid, tuple):
            raise TypeError("expected tuple")
        return ("comm", size, uid, rank)

    def nothing(size, uid, rank):
        raise TypeError(f"refuses {type(uid).__name__}")

    c.equal("tuple constructor", make_communicator(tuple_only, 2, data, 1)[2], signed)
    c.raises(TypeError, "refuses bytes", make_communicator, nothing, 2, data, 1)
    c.done()


def test_unique_id_failure_on_rank0_fails_every_rank():
    nccl = FakeNccl()
    if RANK == 0:

        def broken() -> bytes:
            raise RuntimeError("libnccl is broken")

        nccl.get_unique_id = broken  # type: ignore[method-assign]
    comm = MPI.COMM_WORLD.Dup()
    c = Checks()
    match = "libnccl is broken" if RANK == 0 else "rank 0 of the group could not create"
    c.raises(DistBackendError, match, NCCLBackend, comm, 30.0, "t", None, FakeRuntime(nccl))
    comm.Free()
    c.done()


def test_device_choice(make_backend):
    """No device in use: node-local rank modulo the device count, made current; else the current device."""
    c = Checks()
    node_rank = dist.get_node_local_rank(fallback_rank=RANK)
    backend, rt, nccl = make_backend(rt={"devices": 3, "context": False})
    c.equal("chosen", backend.device, node_rank % 3)
    c.equal("made current", nccl.calls("set_device"), [("set_device", node_rank % 3)])
    backend2, _, nccl2 = make_backend(rt={"devices": 3, "current": 2, "context": True})
    c.equal("current device kept", backend2.device, 2)
    c.equal("not changed", nccl2.calls("set_device"), [])
    x = np.ones(2, np.float32)
    c.raises(
        ValueError,
        r"all_reduce: an array is on cuda:0 but .* uses cuda:2",
        backend2.all_reduce,
        dev(x),
        None,
        R.SUM,
        False,
    )
    comm = MPI.COMM_WORLD.Dup()
    c.raises(
        RuntimeError,
        "no CUDA device is visible",
        NCCLBackend,
        comm,
        30.0,
        "t",
        None,
        FakeRuntime(FakeNccl(), devices=0, context=False),
    )
    comm.Free()
    c.done()


def test_high_priority_stream_and_describe(make_backend):
    backend, _, nccl = make_backend(high_priority=True)
    c = Checks()
    c.equal("priority", [e[2] for e in nccl.calls("new_stream")], [True])
    c.true(f"describe: {backend.describe()}", "nccl on cuda:0" in backend.describe() and backend.name == "nccl")
    c.true("takes device arrays", backend.takes(dev(np.ones(1))) and not backend.takes(np.ones(1)))
    c.done()


def test_blocking_env_makes_blocking_calls_wait_on_the_host(make_backend, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    backend, rt, nccl = make_backend(timeout=0.3)
    c = Checks()
    x = np.ones(2, np.float32)
    rt.hold = True
    c.raises(
        DistBackendError,
        r"all_reduce \(call #1\) .* did not complete within the timeout of 0.3 s",
        backend.all_reduce,
        dev(x),
        None,
        R.SUM,
        False,
    )
    c.equal("aborted", len(nccl.calls("abort")), 1)
    c.raises(
        DistBackendError,
        r"broadcast on .*aborted after all_reduce \(call #1\) timed out: it was unfinished after 0.3 s .*; "
        r"destroy the group",
        backend.broadcast,
        dev(x),
        None,
        0,
        False,
    )
    c.done()


# -- reductions ----------------------------------------------------------------------------


@VERSIONS
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_all_reduce_every_dtype_and_op(make_backend, dtype, version):
    backend, _, nccl = make_backend(FakeNccl(version=version))
    c = Checks()
    for op in ops_for(dtype):
        err = expected_error(dtype, op, version)
        x = rank_input(RANK, (2, 3), dtype)
        calls, seq = len(nccl.log), backend.seq
        if err is not None:
            c.raises(err[0], err[1], backend.all_reduce, dev(x), None, op, False)
            c.true(f"{op}: nothing sent", len(nccl.log) == calls and backend.seq == seq)
            continue
        backend.all_reduce(dev(x), None, op, False)
        c.equal(f"all_reduce {op} {dtype}", x, nccl_reference(inputs_of(SIZE, (2, 3), dtype), op))
    used = {e[3] for e in nccl.calls("allReduce")}
    if dtype.kind in "iuf" and dtype not in I16 and not (dtype == BF16 and version == OLD):
        c.true(f"ncclAvg used iff NCCL >= 2.10: ops {used}", (4 in used) == (version == NEW))
        c.true("divide only without ncclAvg", bool(nccl.calls("divide")) == (version == OLD))
    c.done()


@pytest.mark.parametrize("dtype", [np.dtype(np.int64), np.dtype(np.int32)], ids=str)
def test_avg_without_ncclavg_is_exact_for_large_integers(make_backend, dtype):
    """NCCL < 2.10 has no ncclAvg: the sum is divided on the device, in integer arithmetic (float64 would
    round int64 sums beyond 2**53)."""
    backend, _, nccl = make_backend(FakeNccl(version=OLD))
    big = np.iinfo(dtype).max // SIZE - 10
    values = [[big - 3 * r, -(big - 3 * r) + 1, 7 + r] for r in range(SIZE)]
    sums = [sum(v[j] for v in values) for j in range(3)]
    exact = np.array([t // SIZE if t >= 0 else -((-t) // SIZE) for t in sums], dtype)
    x = np.array(values[RANK], dtype)
    backend.all_reduce(dev(x), None, R.AVG, False)
    c = Checks()
    c.equal(f"AVG {dtype}", x, exact)
    c.true("divided on the device", bool(nccl.calls("divide")))
    c.done()


@VERSIONS
@pytest.mark.parametrize("dtype", SOME, ids=str)
def test_reduce_every_root(make_backend, dtype, version):
    backend, _, _ = make_backend(FakeNccl(version=version))
    c = Checks()
    ops = [R.SUM, R.MAX, R.AVG, dist.make_premul_sum(0.5)]
    for root in range(SIZE):
        for op in ops:
            x = rank_input(RANK, (4,), dtype, salt=root)
            mine = x.copy()
            if expected_error(dtype, op, version):
                err = expected_error(dtype, op, version)
                c.raises(err[0], err[1], backend.reduce, dev(x), None, op, root, False)
                continue
            backend.reduce(dev(x), None, op, root, False)
            want = nccl_reference(inputs_of(SIZE, (4,), dtype, salt=root), op) if RANK == root else mine
            c.equal(f"reduce root={root} {op}", x, want)  # a non-root's input is never scaled
    c.done()


@VERSIONS
@pytest.mark.parametrize("dtype", SOME, ids=str)
def test_reduce_scatter_tensor(make_backend, dtype, version):
    backend, _, _ = make_backend(FakeNccl(version=version))
    c = Checks()
    for op in (R.SUM, R.MIN, R.AVG, dist.make_premul_sum(0.5)):
        err = expected_error(dtype, op, version)
        inp = rank_input(RANK, (SIZE * 3,), dtype)
        before = inp.copy()
        out = filled((3,), dtype, sentinel(dtype))
        if err:
            c.raises(err[0], err[1], backend.reduce_scatter_tensor, dev(out), None, dev(inp), op, False)
            continue
        full = nccl_reference(inputs_of(SIZE, (SIZE * 3,), dtype), op)
        backend.reduce_scatter_tensor(dev(out), None, dev(inp), op, False)
        c.equal(f"reduce_scatter_tensor {op}", out, full[RANK * 3 : RANK * 3 + 3])
        c.equal(f"{op}: input untouched", inp, before)
        # in place: the output is this rank's block of the input (NCCL's layout)
        inp = rank_input(RANK, (SIZE * 3,), dtype)
        backend.reduce_scatter_tensor(dev(inp[RANK * 3 : RANK * 3 + 3]), None, dev(inp), op, False)
        c.equal(f"in place {op}", inp[RANK * 3 : RANK * 3 + 3], full[RANK * 3 : RANK * 3 + 3])
        if SIZE > 1:  # overlapping otherwise: the input is copied first
            inp = rank_input(RANK, (SIZE * 3,), dtype)
            other = (RANK + 1) % SIZE
            backend.reduce_scatter_tensor(dev(inp[other * 3 : other * 3 + 3]), None, dev(inp), op, False)
            c.equal(f"overlapping {op}", inp[other * 3 : other * 3 + 3], full[RANK * 3 : RANK * 3 + 3])
    c.done()


@pytest.mark.parametrize("layout", ["consecutive", "separate", "uneven"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.int32), BF16, np.dtype(np.complex64)], ids=str)
def test_reduce_scatter_list(make_backend, layout, dtype):
    backend, _, nccl = make_backend()
    c = Checks()
    sizes = [j + 1 for j in range(SIZE)] if layout == "uneven" else [3] * SIZE
    offsets = np.cumsum([0, *sizes])
    for op in (R.SUM, R.AVG, dist.make_premul_sum(0.5)):
        flat = rank_input(RANK, (offsets[-1],), dtype)
        err = expected_error(dtype, op, NEW)
        if err:
            c.raises(
                err[0], err[1], backend.reduce_scatter, dev(flat[: sizes[RANK]]), None, [dev(flat)] * SIZE, op, False
            )
            continue
        if layout == "separate":
            ins = [flat[offsets[j] : offsets[j + 1]].copy() for j in range(SIZE)]
        else:
            ins = [flat[offsets[j] : offsets[j + 1]] for j in range(SIZE)]
        out = filled((sizes[RANK],), dtype, sentinel(dtype))
        backend.reduce_scatter(dev(out), None, [dev(a) for a in ins], op, False)
        full = nccl_reference(inputs_of(SIZE, (offsets[-1],), dtype), op)
        c.equal(f"{layout} {op}", out, full[offsets[RANK] : offsets[RANK + 1]])
    grouped = [e for e in nccl.log if e[0] in ("reduce", "reduceScatter")]
    c.true(
        f"uneven blocks use grouped reduces: {grouped[:2]}",
        {e[0] for e in grouped} == ({"reduce"} if layout == "uneven" and SIZE > 1 else {"reduceScatter"}),
    )
    c.done()


def test_complex_reduces_as_float_pairs_and_bool_as_uint8(make_backend):
    backend, _, nccl = make_backend()
    c = Checks()
    z = rank_input(RANK, (3,), np.dtype(np.complex64))
    backend.all_reduce(dev(z), None, R.SUM, False)
    c.equal("complex", z, nccl_reference(inputs_of(SIZE, (3,), np.dtype(np.complex64)), R.SUM))
    c.equal("as 6 float32", nccl.calls("allReduce")[-1][1:4], (7, 6, 0))
    b = rank_input(RANK, (4,), np.dtype(np.bool_))
    backend.all_reduce(dev(b), None, R.PRODUCT, False)
    c.equal("bool and", b, nccl_reference(inputs_of(SIZE, (4,), np.dtype(np.bool_)), R.PRODUCT))
    c.equal("uint8 min", nccl.calls("allReduce")[-1][1:4], (1, 4, 3))
    c.done()


def test_premul_sum_factor_errors(make_backend):
    backend, _, _ = make_backend()
    c = Checks()
    x = np.ones(2, np.float32)
    c.raises(
        ValueError,
        "factor 1j is complex but the array is float32",
        backend.all_reduce,
        dev(x),
        None,
        dist.make_premul_sum(1j),
        False,
    )
    c.raises(ValueError, "PREMUL_SUM needs a factor", backend.all_reduce, dev(x), None, R.PREMUL_SUM, False)
    c.equal("untouched", x, np.ones(2, np.float32))
    c.done()


# -- data movement ---------------------------------------------------------------------------


@VERSIONS
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_broadcast_every_dtype_and_root(make_backend, dtype, version):
    backend, _, nccl = make_backend(FakeNccl(version=version))
    c = Checks()
    for root in range(SIZE):
        x = rank_input(RANK, (2, 3), dtype) if RANK == root else filled((2, 3), dtype, sentinel(dtype))
        backend.broadcast(dev(x), None, root, False)
        c.equal(f"broadcast root={root}", x, rank_input(root, (2, 3), dtype))
    if dtype in I16 or (dtype == BF16 and version == OLD):
        c.equal("as bytes", nccl.calls("broadcast")[-1][1:3], (1, 12))
    c.done()


@pytest.mark.parametrize("dtype", SOME, ids=str)
def test_all_gather_into_tensor(make_backend, dtype):
    backend, _, _ = make_backend()
    c = Checks()
    want = np.concatenate(inputs_of(SIZE, (3,), dtype))
    inp = rank_input(RANK, (3,), dtype)
    out = filled((SIZE * 3,), dtype, sentinel(dtype))
    backend.all_gather_into_tensor(dev(out), None, dev(inp), False)
    c.equal("all_gather_into_tensor", out, want)
    out = filled((SIZE * 3,), dtype, sentinel(dtype))
    out[RANK * 3 : RANK * 3 + 3] = inp
    backend.all_gather_into_tensor(dev(out), None, dev(out[RANK * 3 : RANK * 3 + 3]), False)
    c.equal("in place", out, want)
    if SIZE > 1:
        other = (RANK + 1) % SIZE
        out = filled((SIZE * 3,), dtype, sentinel(dtype))
        out[other * 3 : other * 3 + 3] = inp
        backend.all_gather_into_tensor(dev(out), None, dev(out[other * 3 : other * 3 + 3]), False)
        c.equal("input in another rank's block", out, want)
    c.done()


@pytest.mark.parametrize("layout", ["consecutive", "separate", "in_place", "uneven", "empty"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float64), np.dtype(np.int16), np.dtype(np.bool_)], ids=str)
def test_all_gather_list(make_backend, layout, dtype):
    backend, _, nccl = make_backend()
    c = Checks()
    sizes = {"uneven": [j + 1 for j in range(SIZE)], "empty": [0] * SIZE}.get(layout, [3] * SIZE)
    want = [rank_input(j, (sizes[j],), dtype) for j in range(SIZE)]
    inp = want[RANK].copy()
    if layout in ("consecutive", "in_place"):
        big = filled((sum(sizes),), dtype, sentinel(dtype))
        outs = [big[3 * j : 3 * j + 3] for j in range(SIZE)]
        if layout == "in_place":
            outs[RANK][...] = inp
            inp = outs[RANK]
    else:
        outs = [filled((s,), dtype, sentinel(dtype)) for s in sizes]
    backend.all_gather([dev(o) for o in outs], None, dev(inp), False)
    for j in range(SIZE):
        c.equal(f"{layout} block {j}", outs[j], want[j])
    kinds = {e[0] for e in nccl.log if e[0] in ("allGather", "broadcast")}
    if SIZE > 1 and layout == "uneven":
        c.true(f"uneven: grouped broadcasts, got {kinds}", kinds == {"broadcast"})
    c.done()


@pytest.mark.parametrize("dtype", SOME, ids=str)
def test_gather_and_scatter_every_root(make_backend, dtype):
    backend, _, _ = make_backend()
    c = Checks()
    for root in range(SIZE):
        inp = rank_input(RANK, (2,), dtype, salt=root)
        outs = [filled((2,), dtype, sentinel(dtype)) for _ in range(SIZE)] if RANK == root else None
        backend.gather(dev(inp), None if outs is None else [dev(o) for o in outs], None, root, False)
        if outs is not None:
            for j in range(SIZE):
                c.equal(f"gather root={root} from {j}", outs[j], rank_input(j, (2,), dtype, salt=root))
        # in place at the root: the input is the root's own slot
        if RANK == root:
            outs = [filled((2,), dtype, sentinel(dtype)) for _ in range(SIZE)]
            outs[root][...] = inp
            backend.gather(dev(outs[root]), [dev(o) for o in outs], None, root, False)
            for j in range(SIZE):
                c.equal(f"gather in place from {j}", outs[j], rank_input(j, (2,), dtype, salt=root))
        else:
            backend.gather(dev(inp), None, None, root, False)
        # scatter: rank j gets block j of the root's list
        ins = [rank_input(root, (2,), dtype, salt=j) for j in range(SIZE)] if RANK == root else None
        out = filled((2,), dtype, sentinel(dtype))
        backend.scatter(dev(out), None, None if ins is None else [dev(a) for a in ins], root, False)
        c.equal(f"scatter root={root}", out, rank_input(root, (2,), dtype, salt=RANK))
        if RANK == root:  # the root's output is its own block of the list
            backend.scatter(dev(ins[root]), None, [dev(a) for a in ins], root, False)
            c.equal("scatter in place", ins[root], rank_input(root, (2,), dtype, salt=root))
        else:
            out = filled((2,), dtype, sentinel(dtype))
            backend.scatter(dev(out), None, None, root, False)
            c.equal("scatter again", out, rank_input(root, (2,), dtype, salt=RANK))
    c.done()


def test_list_outputs_must_not_overlap(make_backend):
    backend, _, _ = make_backend()
    x = np.zeros(4 * SIZE + 4)
    outs = [dev(x[j : j + 4]) for j in range(SIZE)]
    c = Checks()
    if SIZE > 1:
        c.raises(
            ValueError,
            r"all_gather: tensor_list\[0\] and tensor_list\[1\] overlap",
            backend.all_gather,
            outs,
            None,
            dev(np.ones(4)),
            False,
        )
    c.done()


@pytest.mark.parametrize("splits", ["equal", "uneven"])
@pytest.mark.parametrize("dtype", SOME, ids=str)
def test_all_to_all_single(make_backend, splits, dtype):
    backend, _, _ = make_backend()
    c = Checks()
    row = 2  # elements per row

    def rows(src: int, dst: int) -> int:
        return 2 if splits == "equal" else (src + 2 * dst) % 3

    in_counts = [rows(RANK, j) * row for j in range(SIZE)]
    out_counts = [rows(j, RANK) * row for j in range(SIZE)]
    mine = [rank_input(RANK, (in_counts[j],), dtype, salt=j) for j in range(SIZE)]
    inp = np.concatenate(mine)
    want = np.concatenate([rank_input(j, (rows(j, RANK) * row,), dtype, salt=RANK) for j in range(SIZE)])
    out = filled((sum(out_counts),), dtype, sentinel(dtype))
    counts = (None, None) if splits == "equal" else (out_counts, in_counts)
    backend.all_to_all_single(dev(out), None, dev(inp), counts[0], counts[1], False)
    c.equal("all_to_all_single", out, want)
    if splits == "equal":  # output and input the same memory: the input is copied first
        buf = inp.copy()
        backend.all_to_all_single(dev(buf), None, dev(buf), None, None, False)
        c.equal("in place", buf, want)
    c.done()


def test_all_to_all_single_self_block_mismatch(make_backend):
    backend, _, _ = make_backend()
    c = Checks()
    n = SIZE
    out, inp = np.zeros(n + 1), np.zeros(n)
    outc, inc = [1] * n, [1] * n
    outc[RANK] = 2
    c.raises(
        ValueError,
        r"sends 1 elements to itself but expects 2",
        backend.all_to_all_single,
        dev(out),
        None,
        dev(inp),
        outc,
        inc,
        False,
    )
    c.done()


@pytest.mark.parametrize("dtype", SOME, ids=str)
def test_all_to_all_list(make_backend, dtype):
    backend, _, _ = make_backend()
    c = Checks()
    ins = [rank_input(RANK, (j + 1,), dtype, salt=j) for j in range(SIZE)]
    outs = [filled((RANK + 1,), dtype, sentinel(dtype)) for _ in range(SIZE)]
    backend.all_to_all([dev(o) for o in outs], None, [dev(a) for a in ins], False)
    for j in range(SIZE):
        c.equal(f"from {j}", outs[j], rank_input(j, (RANK + 1,), dtype, salt=RANK))
    # outputs that are the inputs' memory: the inputs are copied first
    same = [rank_input(RANK, (2,), dtype, salt=j) for j in range(SIZE)]
    backend.all_to_all([dev(a) for a in same], None, [dev(a) for a in same], False)
    for j in range(SIZE):
        c.equal(f"in place from {j}", same[j], rank_input(j, (2,), dtype, salt=RANK))
    c.done()


# -- barrier, point-to-point ------------------------------------------------------------------


def test_barrier_blocking_and_async(make_backend):
    backend, rt, nccl = make_backend()
    c = Checks()
    c.true("blocking returns None", backend.barrier(False) is None)
    w = backend.barrier(True)
    c.true("async returns a CudaWork", isinstance(w, CudaWork) and w.wait() and w.is_completed())
    c.equal("one-element all_reduce each", [e[1:3] for e in nccl.calls("allReduce")], [(7, 1)] * 2)
    c.equal("seq", backend.seq, 2)
    c.done()


def test_barrier_timeout_aborts(make_backend):
    backend, rt, nccl = make_backend(timeout=0.2)
    c = Checks()
    rt.hold = True
    c.raises(
        DistBackendError, r"barrier \(call #1\) .* did not complete within the timeout of 0.2 s", backend.barrier, False
    )
    c.equal("aborted", len(nccl.calls("abort")), 1)
    c.true("buffers kept", backend.pending())
    x = np.ones(2)
    c.raises(DistBackendError, "aborted after barrier", backend.all_reduce, dev(x), None, R.SUM, False)
    c.done()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_send_recv_ring_in_a_batch(make_backend, dtype):
    """Sends and receives inside coalescing() run as one NCCL group (batch_isend_irecv)."""
    backend, _, nccl = make_backend()
    c = Checks()
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    x = rank_input(RANK, (2, 2), dtype)
    y = filled((2, 2), dtype, sentinel(dtype))
    with backend.coalescing():
        works = [backend.send(dev(x), nxt, 0), backend.recv(dev(y), None, prv, 0)]
    for w in works:
        w.wait()
    c.equal("received", y, rank_input(prv, (2, 2), dtype))
    c.true("completed", all(w.is_completed() and w.is_success() for w in works))
    c.equal("source rank", works[1].source_rank(), prv)
    c.equal("p2p_seq", backend.p2p_seq, 2)
    c.equal("one group", [e[0] for e in nccl.log if e[0] in ("groupStart", "groupEnd", "send", "recv")],
            ["groupStart", "send", "recv", "groupEnd"])  # fmt: skip
    c.done()


@pytest.mark.skipif(SIZE < 2, reason="needs a peer")
def test_send_recv_standalone_with_write_back(make_backend):
    backend, _, _ = make_backend()
    c = Checks()
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    x = np.arange(4.0) + RANK
    base = np.full((4, 2), -1.0)
    target = base[:, 0]  # strided: the caller stages it and passes (buffer, target)
    buf = np.empty(4)
    order = [
        (0, lambda: backend.send(dev(x), nxt, 3)),
        (1, lambda: backend.recv(dev(buf), [(dev(buf), dev(target))], prv, 3)),
    ]
    works = [f() for _, f in (order if RANK % 2 == 0 else order[::-1])]
    for w in works:
        w.wait()
    c.equal("received into the strided target", target, np.arange(4.0) + prv)
    c.equal("gaps untouched", base[:, 1], np.full(4, -1.0))
    c.done()


def test_batch_write_backs_run_after_the_group(make_backend):
    """A staged receive inside coalescing() is copied back after groupEnd; an error in the block still ends the group."""
    backend, _, nccl = make_backend()
    c = Checks()
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    base = np.full((3, 2), -1.0)
    target, buf = base[:, 0], np.empty(3)
    start = len(nccl.log)
    with backend.coalescing():
        works = [
            backend.send(dev(np.full(3, float(RANK))), nxt, 0),
            backend.recv(dev(buf), [(dev(buf), dev(target))], prv, 0),
        ]
    steps = [e[0] for e in nccl.log[start:] if e[0] in ("groupEnd", "copy", "record")]
    c.equal("order", steps[-3:], ["groupEnd", "copy", "record"])
    for w in works:
        w.wait()
    c.equal("written back", target, np.full(3, float(prv)))

    def failing_block() -> None:
        with backend.coalescing():
            backend.send(dev(np.ones(1)), RANK, 0)
            backend.recv(dev(np.ones(1)), None, RANK, 0)
            raise KeyError("user error")

    c.raises(KeyError, "user error", failing_block)
    c.equal("the group was ended", nccl.depth, 0)
    c.done()


def test_recv_from_any_source_is_refused(make_backend):
    backend, _, nccl = make_backend()
    c = Checks()
    c.raises(
        ValueError,
        r"recv: the nccl backend cannot receive from any source \(src=None\)",
        backend.recv,
        dev(np.ones(2)),
        None,
        None,
        0,
    )
    c.equal("nothing posted", nccl.calls("recv"), [])
    c.done()


def test_coalescing_rules(make_backend):
    backend, _, _ = make_backend()
    c = Checks()
    x = np.ones(2)
    with backend.coalescing():
        c.raises(RuntimeError, "only send and recv may run inside", backend.all_reduce, dev(x), None, R.SUM, False)

        def nested():
            with backend.coalescing():
                pass

        c.raises(RuntimeError, "do not nest", nested)
    c.done()


# -- streams, Work, lifetime ---------------------------------------------------------------------


def test_stream_order(make_backend):
    """The comm stream waits for every producer stream, runs the op, then the producers wait for it."""
    backend, rt, nccl = make_backend()
    comm_stream = backend.stream
    c = Checks()
    out, inp = np.zeros(SIZE * 2), np.ones(2)
    start = len(nccl.log)
    backend.all_gather_into_tensor(dev(out, stream=11), None, dev(inp, stream=12), False)
    got = [e for e in nccl.log[start:] if e[0] in ("record", "wait", "allGather")]
    c.equal(
        "order",
        [e if e[0] != "allGather" else ("allGather",) for e in got],
        [("record", 11), ("wait", comm_stream, 11), ("record", 12), ("wait", comm_stream, 12), ("allGather",),
         ("record", comm_stream), ("wait", 11, comm_stream), ("wait", 12, comm_stream)],
    )  # fmt: skip
    start = len(nccl.log)
    backend.all_reduce(dev(inp, stream=None), None, R.SUM, False)  # no producer stream: the current one
    waits = [e for e in nccl.log[start:] if e[0] == "wait"]
    c.equal("current stream", waits, [("wait", comm_stream, CURRENT_STREAM), ("wait", CURRENT_STREAM, comm_stream)])
    c.done()


def test_async_work_semantics(make_backend):
    backend, rt, nccl = make_backend()
    comm_stream = backend.stream
    c = Checks()
    x = np.full(3, RANK + 1.0)
    rt.hold = True
    w = backend.all_reduce(dev(x, stream=5), None, R.SUM, True)
    w._outputs = [x]  # what the collective sets
    c.true("a CudaWork, pending", isinstance(w, CudaWork) and not w.is_completed() and not w.is_success())
    c.equal("consumers not made to wait yet", [e for e in nccl.log if e[0] == "wait" and e[1] == 5], [])
    fut = w.get_future()
    c.true("future pending", not fut.done())
    c.true("wait returns at once", w.wait() is True)
    c.equal("consumer waits", [e for e in nccl.log if e[0] == "wait" and e[1] == 5], [("wait", 5, comm_stream)])
    c.true("still running on the GPU", not w.is_completed())
    c.true("future completed by wait", fut.done() and fut.wait()[0] is x and w.result()[0] is x)
    rt.release()
    c.true("completed", w.is_completed() and w.is_success() and w.exception() is None)
    c.equal("result", x, np.full(3, SIZE * (SIZE + 1) / 2))
    # then: a chained future
    w2 = backend.all_reduce(dev(x), None, R.SUM, True)
    w2._outputs = [x]
    c.true("then", w2.get_future().then(lambda f: f.value()[0].sum()).wait() == x.sum())
    c.done()


def test_buffers_live_until_the_gpu_is_done(make_backend):
    backend, rt, _ = make_backend()
    c = Checks()
    rt.hold = True
    x = np.ones(2)
    c.true("blocking call returns", backend.all_reduce(dev(x), None, R.SUM, False) is None)
    c.true("its buffers are kept", backend.pending())
    w = backend.all_reduce(dev(np.ones(2)), None, R.SUM, True)
    w.wait()
    del w
    gc.collect()
    c.equal("dropped work adopted", len(backend._inflight), 2)
    rt.release()
    c.true("released", not backend.pending())
    c.done()


def test_wait_with_timeout_blocks_the_host(make_backend):
    backend, rt, nccl = make_backend(timeout=60)
    c = Checks()
    w = backend.all_reduce(dev(np.ones(2)), None, R.SUM, True)
    c.true("completes", w.wait(timeout=5) and w.is_completed())
    rt.hold = True
    w = backend.all_reduce(dev(np.ones(2)), None, R.SUM, True)
    fut = w.get_future()
    c.raises(DistBackendError, r"all_reduce \(call #2\) .* within the timeout of 0.2 s", w.wait, 0.2)
    c.true("failed", w.is_completed() and not w.is_success() and isinstance(w.exception(), DistBackendError))
    c.raises(DistBackendError, "within the timeout", fut.wait)
    c.equal("aborted", len(nccl.calls("abort")), 1)
    c.done()


def test_async_nccl_error(make_backend):
    backend, rt, nccl = make_backend()
    c = Checks()
    rt.hold = True
    w = backend.all_reduce(dev(np.ones(2)), None, R.SUM, True)
    nccl.comms[-1].async_error = "a peer died"
    c.true("is_completed reports the failure", w.is_completed() and not w.is_success())
    c.raises(DistBackendError, "all_reduce .* failed: a peer died", w.wait)
    c.raises(DistBackendError, "was aborted after all_reduce", backend.barrier, False)
    c.done()


def test_write_backs_and_errors(make_backend):
    backend, _, nccl = make_backend()
    c = Checks()
    base = np.zeros((3, 2), np.float32)
    target = base[:, 1]
    target[...] = RANK + 1
    buf = np.ascontiguousarray(target)
    start = len(nccl.log)
    backend.all_reduce(dev(buf), [(dev(buf), dev(target))], R.SUM, False)
    c.equal("written back", target, np.full(3, SIZE * (SIZE + 1) / 2, np.float32))
    steps = [e[0] for e in nccl.log[start:] if e[0] in ("allReduce", "copy")]
    c.equal("copy after the op", steps, ["allReduce", "copy"])
    c.raises(TypeError, "the nccl backend takes CUDA arrays", backend.all_reduce, np.ones(2), None, R.SUM, False)
    c.raises(TypeError, "takes CUDA arrays", backend.broadcast, HostCudaArray(np.ones(2)), None, 0, False)
    empty = np.empty(0, np.float32)
    calls = len(nccl.calls("allReduce"))
    backend.all_reduce(dev(empty), None, R.SUM, False)
    c.equal("empty arrays send nothing", len(nccl.calls("allReduce")), calls)
    c.done()


def test_shutdown(make_backend):
    backend, rt, nccl = make_backend()
    c = Checks()
    backend.all_reduce(dev(np.ones(2)), None, R.SUM, False)
    backend.shutdown()
    c.equal("destroyed", len(nccl.calls("destroy")), 1)
    c.true("nothing pending", not backend.pending())
    c.raises(DistBackendError, "the group was destroyed", backend.barrier, False)
    backend.shutdown()  # twice is fine
    c.done()


def test_bfloat16_scaling_rounds_to_nearest_even():
    """The real runtime scales bfloat16 on the GPU through float32 bits (checked here with numpy as cupy)."""
    x = np.array([1.5, 3.0, -2.25, 1e30, np.nan, 0.1, 7.0, -0.0], ml_dtypes.bfloat16)
    for factor in (0.3, 1 / 3, 2.0):
        got = bfloat16_apply(np, x.view(np.uint16), lambda f, g=factor: f * np.float32(g)).view(ml_dtypes.bfloat16)
        want = (x.astype(np.float32) * np.float32(factor)).astype(ml_dtypes.bfloat16)
        assert_equal(got.view(np.uint16), want.view(np.uint16))  # bit for bit (NaN, -0.0)


# -- through the public API ----------------------------------------------------------------------


@pytest.fixture
def fake_factory(monkeypatch):
    """Groups made now get the fake runtime; returns the list of FakeNccl modules made."""
    made: list[FakeNccl] = []

    def factory() -> FakeRuntime:
        made.append(FakeNccl())
        return FakeRuntime(made[-1])

    monkeypatch.setattr(world, "cuda_runtime_factory", factory)
    return made


def test_public_api_cuda_only_group(fake_factory):
    g = dist.new_group(
        list(range(SIZE)), backend="nccl", pg_options=types.SimpleNamespace(is_high_priority_stream=True)
    )
    c = Checks()
    c.equal("backend", dist.get_backend(g), "nccl")
    x = np.full(4, RANK + 1.0)
    dist.all_reduce(HostCudaArray(x), group=g)
    c.equal("all_reduce", x, np.full(4, SIZE * (SIZE + 1) / 2))
    y = np.full(2, float(RANK))
    w = dist.broadcast(HostCudaArray(y), src=SIZE - 1, group=g, async_op=True)
    w.wait()
    c.equal("broadcast", y, np.full(2, SIZE - 1.0))
    c.true("result", w.result()[0].host is y)
    out = np.zeros(2 * SIZE)
    dist.all_gather_into_tensor(HostCudaArray(out), HostCudaArray(np.full(2, float(RANK))), group=g)
    c.equal("all_gather_into_tensor", out, np.repeat(np.arange(SIZE, dtype=float), 2))
    c.true("barrier", dist.barrier(group=g) is None)
    c.raises(TypeError, "CUDA arrays only", dist.all_reduce, np.ones(2), group=g)
    nccl = fake_factory[-1]
    c.equal("high-priority stream", [e[2] for e in nccl.calls("new_stream")], [True])
    dist.destroy_process_group(g)
    c.equal("communicator destroyed", len(nccl.calls("destroy")), 1)
    c.done()


@pytest.mark.parametrize("backend", ["nccl", "cpu:mpi,cuda:nccl"])
def test_coalesced_collectives_on_an_nccl_group(fake_factory, monkeypatch, backend):
    """*_coalesced pack on the host: on a group whose device backend is NCCL the packed host buffer
    must go to MPI (the host backend, or the group's private MPI communicator on a device-only group),
    never to NCCL."""
    import mpidist.groups

    monkeypatch.setattr(mpidist.groups, "nccl_available", lambda: True)
    g = dist.new_group(list(range(SIZE)), backend=backend)
    c = Checks()
    a, b = np.full(3, RANK + 1.0), np.full((2, 2), float(RANK))
    dist.all_reduce_coalesced([HostCudaArray(a), HostCudaArray(b)], group=g)
    c.equal("all_reduce_coalesced [0]", a, np.full(3, SIZE * (SIZE + 1) / 2))
    c.equal("all_reduce_coalesced [1]", b, np.full((2, 2), SIZE * (SIZE - 1) / 2))
    outs = [[HostCudaArray(np.zeros(2)), HostCudaArray(np.zeros(1))] for _ in range(SIZE)]
    dist.all_gather_coalesced(
        outs, [HostCudaArray(np.full(2, float(RANK))), HostCudaArray(np.full(1, -1.0 * RANK))], group=g
    )
    for r in range(SIZE):
        c.equal(f"all_gather_coalesced [{r}]", [o.host.tolist() for o in outs[r]], [[float(r)] * 2, [-1.0 * r]])
    c.equal(
        "NCCL was given no host buffer", [e for e in fake_factory[-1].log if e[0] in ("allReduce", "allGather")], []
    )
    dist.destroy_process_group(g)
    c.done()


def test_public_api_mixed_group(fake_factory, monkeypatch):
    import mpidist.groups

    monkeypatch.setattr(mpidist.groups, "nccl_available", lambda: True)
    g = dist.new_group(list(range(SIZE)), backend="cpu:mpi,cuda:nccl")
    c = Checks()
    x = np.full(3, RANK + 1.0)
    dist.all_reduce(HostCudaArray(x), group=g, op=R.AVG)
    c.equal("device array over NCCL", x, np.full(3, (SIZE + 1) / 2))
    h = np.full(3, RANK + 1.0)
    dist.all_reduce(h, group=g)
    c.equal("host array over MPI", h, np.full(3, SIZE * (SIZE + 1) / 2))
    c.equal("NCCL ran the device call only", len(fake_factory[-1].calls("allReduce")), 1)
    if SIZE > 1:
        nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
        send, recv = np.full(2, float(RANK)), np.zeros(2)
        ops = [dist.P2POp(dist.isend, HostCudaArray(send), nxt, g), dist.P2POp(dist.irecv, HostCudaArray(recv), prv, g)]
        if RANK % 2:
            ops.reverse()
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        c.equal("batch_isend_irecv", recv, np.full(2, float(prv)))
        # one batch over both backends: host arrays go over MPI, device arrays as one NCCL group
        log = fake_factory[-1].log
        before = len(log)
        hsend, hrecv, drecv = np.full(4, RANK, np.int32), np.zeros(4, np.int32), np.zeros(2)
        ops = [
            dist.P2POp(dist.isend, hsend, nxt, g),
            dist.P2POp(dist.isend, HostCudaArray(np.full(2, RANK + 0.5)), nxt, g),
            dist.P2POp(dist.irecv, hrecv, prv, g),
            dist.P2POp(dist.irecv, HostCudaArray(drecv), prv, g),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        c.equal("mixed batch: host array", hrecv, np.full(4, prv, np.int32))
        c.equal("mixed batch: device array", drecv, np.full(2, prv + 0.5))
        c.equal("mixed batch: NCCL ran the device arrays as one group",
                [e[0] for e in log[before:] if e[0] in ("groupStart", "groupEnd", "send", "recv")],
                ["groupStart", "send", "recv", "groupEnd"])  # fmt: skip
    c.done()


def test_cupy_runtime_is_required(monkeypatch):
    """Without cupy (this machine), building the backend explains what to install."""
    import builtins

    real = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    from mpidist.backends._cuda import CudaRuntime

    c = Checks()
    c.raises(RuntimeError, r"needs cupy with NCCL bindings: pip install 'mpidist\[gpu\]'", CudaRuntime.from_cupy)
    c.done()


def test_split_and_shrink_an_nccl_group_make_nccl_communicators_of_their_own(fake_factory):
    """split_group and shrink_group keep the parent's backend: a new NCCL communicator on the new MPI one."""
    g = dist.new_group(list(range(SIZE)), backend="nccl")
    made = len(fake_factory)
    c = Checks()
    half = (SIZE + 1) // 2
    splits = [list(range(half)), list(range(half, SIZE))] if SIZE > 1 else [[0]]
    sub = dist.split_group(g, [s for s in splits if s])
    mine = next(s for s in splits if RANK in s)
    c.equal("split's backend", dist.get_backend(sub), "nccl")
    x = np.full(3, RANK + 1.0)
    dist.all_reduce(HostCudaArray(x), group=sub)
    c.equal("all_reduce on the split", x, np.full(3, float(sum(r + 1 for r in mine))))
    c.true("a new NCCL communicator for the split", len(fake_factory) > made)
    if SIZE > 1 and RANK != SIZE - 1:
        small = dist.shrink_group([SIZE - 1], g)
        y = np.full(2, RANK + 1.0)
        dist.all_reduce(HostCudaArray(y), group=small)
        c.equal("all_reduce on the shrunk group", y, np.full(2, float(sum(range(1, SIZE)))))
        c.equal("shrunk group's backend", dist.get_backend(small), "nccl")
        c.raises(TypeError, "CUDA arrays only", dist.all_reduce, np.ones(2), group=small)
        dist.destroy_process_group(small)
    elif SIZE > 1:
        dist.destroy_process_group(g)  # the rank left out (its peers do not answer: a few seconds)
    dist.destroy_process_group(sub)
    c.done()
