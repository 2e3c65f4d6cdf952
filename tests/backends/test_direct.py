"""The MPI backend's direct MPI calls (backends/_direct.c) against the same calls through mpi4py.

Groups made inside ``mpidist.testing.mpi4py_calls()`` call MPI through mpi4py;
the others call it from C. Every hot collective must give both the numpy
reference and the bits the mpi4py path gives, blocking and async; whatever the C
calls do not take must reach mpi4py with the same arguments; MPI errors must
surface as mpi4py's.

The C path is required only where it was built (installing without a compiler is
valid) or where ``MPIDIST_REQUIRE_C=1`` says it must be; ``MPIDIST_C_EXTENSIONS=0``
turns every C extension off, and this module (like the rest of the suite) must
pass that way too, both groups then calling mpi4py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist._validate import C_EXTENSIONS_FLAG, c_extension_refused, env_flag
from mpidist.arrays import host as _arrays
from mpidist.backends import direct, halfops
from mpidist.backends.direct import MPI4pyCalls, direct_status, make_calls
from mpidist.backends.halfops import halfops_status
from mpidist.testing import mpi4py_calls, mpi_calls

from helpers import ALL_DTYPES, Checks, clean_env, kind, rank_input, reference

pytestmark = pytest.mark.timeout(120)

R = dist.ReduceOp


def _built(module: str) -> bool:
    """Whether the C extension ``module`` (a name under mpidist) was built: installing without a compiler is valid."""
    return importlib.util.find_spec(f"mpidist.{module}") is not None


def test_calls_go_straight_to_mpi_where_the_module_is_built():
    """Where the C module was built (or MPIDIST_REQUIRE_C=1 says it must be), it binds to MPICH and Open MPI alike."""
    required = env_flag("MPIDIST_REQUIRE_C")
    if c_extension_refused("MPIDIST_DIRECT_MPI"):
        pytest.skip(f"direct MPI calls are off: {c_extension_refused('MPIDIST_DIRECT_MPI')}")
    if not (required or _built("backends._direct")):
        pytest.skip("mpidist.backends._direct was not built (no C compiler at install): mpi4py's calls serve")
    assert direct_status() == "direct"
    assert mpi_calls() == "direct"


def test_the_c_extensions_switch_turns_every_one_off(monkeypatch):
    """MPIDIST_C_EXTENSIONS=0 runs the pure-Python paths only; with MPIDIST_REQUIRE_C=1 all three must be built."""
    if env_flag("MPIDIST_REQUIRE_C"):
        for module in ("arrays._ready", "backends._direct", "backends._halfops"):
            assert _built(module), f"MPIDIST_REQUIRE_C=1 but mpidist.{module} was not built"
    if not env_flag(C_EXTENSIONS_FLAG, default=True):  # the CI pass without C: nothing of it in use
        assert _arrays._ready is None and _arrays.prepare_input is _arrays.IN_PYTHON[0]
        assert direct_status() == f"mpi4py ({C_EXTENSIONS_FLAG} is off)"
        assert halfops_status() == f"off ({C_EXTENSIONS_FLAG} is off)"
        return
    monkeypatch.setenv(C_EXTENSIONS_FLAG, "0")
    monkeypatch.setenv("MPIDIST_DIRECT_MPI", "1")  # the general switch wins over each module's own
    assert direct._bind().module is None and halfops._make().ops == {}
    if dist.get_rank() == 0:  # the array layer decides at import: a fresh interpreter (no MPI in it)
        code = "import mpidist.arrays.host as h; print(h._ready is None and h.prepare_input is h.IN_PYTHON[0])"
        out = subprocess.run([sys.executable, "-c", code], env=clean_env(**{C_EXTENSIONS_FLAG: "0"}),
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.stdout.strip() == "True", out.stderr


def test_the_two_groups_use_the_two_paths(two_groups):
    direct, through = two_groups
    assert mpi_calls(through) == "mpi4py"
    assert mpi_calls(direct) == ("direct" if direct_status() == "direct" else "mpi4py")


def _op_for(dtype: np.dtype):
    """An op MPI computes on ``dtype`` in one call (the direct path): SUM, or BOR on bool."""
    return R.BOR if kind(dtype) == "b" else R.SUM


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_hot_collective_gives_the_same_bits_on_both_paths(two_groups, dtype, async_op, rank, world_size):
    checks = Checks()
    n = world_size
    results = []
    for g in two_groups:

        def run(work):
            if async_op:
                checks.true(f"{dtype}: async_op=True returned {work!r}, not a Work", work is not None)
                if work is not None:
                    work.wait()
            else:
                checks.true(f"{dtype}: a blocking call returned {work!r}", work is None)

        got = {}
        op = _op_for(dtype)
        x = rank_input(rank, (5,), dtype)
        run(dist.all_reduce(x, op=op, group=g, async_op=async_op))
        got["all_reduce"] = x
        for root in range(n):
            y = rank_input(rank, (3,), dtype, salt=root)
            run(dist.reduce(y, dst=root, op=op, group=g, async_op=async_op))
            got[f"reduce to {root}"] = y
            b = rank_input(rank, (2, 3), dtype, salt=root)
            run(dist.broadcast(b, src=root, group=g, async_op=async_op))
            got[f"broadcast from {root}"] = b
        out = np.zeros((n * 4,), dtype)
        run(dist.all_gather_into_tensor(out, rank_input(rank, (4,), dtype), group=g, async_op=async_op))
        got["all_gather_into_tensor"] = out
        inplace = np.zeros((n, 3), dtype)
        inplace[rank] = rank_input(rank, (3,), dtype)
        run(dist.all_gather_into_tensor(inplace, inplace[rank], group=g, async_op=async_op))
        got["all_gather_into_tensor in place"] = inplace
        rs = np.zeros(4, dtype)
        run(dist.reduce_scatter_tensor(rs, rank_input(rank, (n * 4,), dtype), op=op, group=g, async_op=async_op))
        got["reduce_scatter_tensor"] = rs
        a2a = np.zeros(n * 2, dtype)
        run(dist.all_to_all_single(a2a, rank_input(rank, (n * 2,), dtype), group=g, async_op=async_op))
        got["all_to_all_single"] = a2a
        results.append(got)

    inputs = [rank_input(r, (5,), dtype) for r in range(n)]
    expect = {
        "all_reduce": reference(inputs, _op_for(dtype)),
        "all_gather_into_tensor": np.concatenate([rank_input(r, (4,), dtype) for r in range(n)]),
        "all_gather_into_tensor in place": np.stack([rank_input(r, (3,), dtype) for r in range(n)]),
        "reduce_scatter_tensor": reference([rank_input(r, (n * 4,), dtype) for r in range(n)], _op_for(dtype))[
            rank * 4 : rank * 4 + 4
        ],
        "all_to_all_single": np.concatenate(
            [rank_input(r, (n * 2,), dtype)[rank * 2 : rank * 2 + 2] for r in range(n)]
        ),
    }
    for root in range(n):
        expect[f"broadcast from {root}"] = rank_input(root, (2, 3), dtype, salt=root)
        ys = [rank_input(r, (3,), dtype, salt=root) for r in range(n)]
        expect[f"reduce to {root}"] = reference(ys, _op_for(dtype)) if rank == root else ys[rank]
    direct, through = results
    for name, want in expect.items():
        checks.equal(f"{dtype} {name} (direct)", direct[name], want)
        checks.equal(f"{dtype} {name} (mpi4py)", through[name], want)
        checks.true(f"{dtype} {name}: the paths differ", direct[name].tobytes() == through[name].tobytes())
    checks.done()


@pytest.mark.parametrize("nbytes", [0, 4, 256 << 10])
def test_sizes_across_the_variant_limit_and_empty_arrays(two_groups, nbytes, rank, world_size):
    """reduce_scatter_tensor switches MPI calls at 256 KiB of input; zero-size arrays are valid everywhere."""
    checks = Checks()
    count = nbytes // 4
    for g in two_groups:
        inp = np.arange(count * world_size, dtype=np.float32) + rank
        out = np.full(count, -1, np.float32)
        dist.reduce_scatter_tensor(out, inp, group=g)
        base = np.arange(count * world_size, dtype=np.float64)[rank * count : (rank + 1) * count]
        checks.equal(
            f"{nbytes} B reduce_scatter_tensor", out, (base * world_size + sum(range(world_size))).astype(np.float32)
        )
        x = np.full(count, rank + 1, np.float32)
        dist.all_reduce(x, group=g)
        checks.equal(f"{nbytes} B all_reduce", x, np.full(count, world_size * (world_size + 1) / 2, np.float32))
    checks.done()


def test_an_async_call_completes_through_its_work(two_groups, rank, world_size):
    """An async call's Work holds the real request: is_completed polls it, wait finishes it, result is the array."""
    checks = Checks()
    for g in two_groups:
        x = np.full(1 << 16, float(rank))
        w = dist.all_reduce(x, group=g, async_op=True)
        while not w.is_completed():
            pass
        checks.true("is_success after completion", w.is_success())
        checks.equal("async all_reduce", x, np.full(1 << 16, float(sum(range(world_size)))))
        checks.true("result() is the array", w.result()[0] is x)
    checks.done()


class Spy:
    """Stands in for the mpi4py calls: records what the C calls hand over."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def __getattr__(self, name: str):
        def call(*args):
            self.seen.append((name, args))
            return "handed over"

        return call


def _direct_over(comm: MPI.Comm, fallback) -> object:
    if direct_status() != "direct":
        pytest.skip(f"no direct MPI calls here: {direct_status()}")
    from mpidist.backends import _direct

    return _direct.Direct(comm.handle, comm.Get_rank(), comm.Get_size(), fallback)


def test_what_the_c_calls_do_not_take_goes_to_mpi4py_unchanged():
    comm = MPI.COMM_SELF
    spy = Spy()
    calls = _direct_over(comm, spy)
    strided = np.ones(8)[::2]
    readonly = np.ones(4)
    readonly.flags.writeable = False
    cases = [
        ("allreduce", (strided, MPI.DOUBLE, MPI.SUM, 1)),  # not C-contiguous
        ("allreduce", (readonly, MPI.DOUBLE, MPI.SUM, 1)),  # an output that is read-only
        ("allreduce", (bytearray(8), MPI.DOUBLE, MPI.SUM, 1)),  # not a numpy array
        ("allreduce", (np.ones(2), "DOUBLE", MPI.SUM, 1)),  # not an MPI.Datatype
        ("allreduce", (np.ones(2), MPI.DOUBLE, MPI.SUM)),  # another number of arguments
        ("bcast", (np.ones(2), MPI.DOUBLE, 1 << 40, 1)),  # a root past int
        ("alltoall", (np.ones(2), np.ones(2), MPI.DOUBLE, 2.0)),  # spins not an int
        ("reduce_scatter_block", (np.ones(1), np.ones(1), MPI.DOUBLE, MPI.DOUBLE, 1)),  # op not an MPI.Op
    ]
    for name, args in cases:
        assert getattr(calls, name)(*args) == "handed over", (name, args)
    assert len(spy.seen) == len(cases)
    for (name, args), (seen_name, seen_args) in zip(cases, spy.seen):
        assert seen_name == name
        assert len(seen_args) == len(args) and all(a is b for a, b in zip(args, seen_args))
    # a count past INT_MAX (MPI's large-count calls, through mpi4py)
    big = np.empty(1 << 31, np.int8)  # 2 GiB of address space, never touched
    assert calls.allreduce(big, MPI.INT8_T, MPI.SUM, 1) == "handed over"
    assert spy.seen[-1][1][0] is big
    del big
    wide = np.empty((1 << 16, 1 << 15), np.int8)  # the same count in two dimensions
    assert calls.allreduce(wide, MPI.INT8_T, MPI.SUM, 1) == "handed over"
    assert spy.seen[-1][1][0] is wide


def test_a_direct_object_needs_a_rank_of_its_group():
    _direct_over(MPI.COMM_SELF, Spy())  # skips where the C calls are not in use (first: _direct may not exist)
    from mpidist.backends import _direct

    for rank, size in ((1, 1), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="0 <= rank < size"):
            _direct.Direct(MPI.COMM_SELF.handle, rank, size, Spy())


def test_a_reduce_sends_a_read_only_array_from_a_rank_that_is_not_the_root(rank, world_size):
    """Off the root the array is only read: the C call takes it; at the root it must be writeable."""
    comm = MPI.COMM_WORLD.Dup()
    try:
        spy = Spy()
        calls = _direct_over(comm, spy)
        a = np.full(2, rank + 1, np.int64)
        a.flags.writeable = False
        root = world_size - 1
        if rank == root:
            assert calls.reduce(a, MPI.INT64_T, MPI.SUM, root, 1) == "handed over"
            a = np.full(2, rank + 1, np.int64)
        handle = calls.reduce(a, MPI.INT64_T, MPI.SUM, root, 0)
        assert type(handle) is int and handle != 0  # spins=0: posted, not tested
        MPI.Request.fromhandle(handle).Wait()
        if rank == root:
            assert a.tolist() == [world_size * (world_size + 1) // 2] * 2
    finally:
        comm.Free()


def test_a_call_says_none_when_complete_and_gives_the_request_when_not_tested():
    calls = _direct_over(MPI.COMM_SELF, Spy())
    a = np.arange(3.0)
    assert calls.allreduce(a, MPI.DOUBLE, MPI.SUM, 1 << 20) is None  # one rank: complete at the first test
    handle = calls.allreduce(a, MPI.DOUBLE, MPI.SUM, 0)  # async_op=True passes 0: posted, never tested
    assert type(handle) is int
    req = MPI.Request.fromhandle(handle)
    req.Wait()
    assert req == MPI.REQUEST_NULL and a.tolist() == [0.0, 1.0, 2.0]


def test_mpi_errors_surface_as_mpi4pys(rank, world_size):
    comm = MPI.COMM_WORLD.Dup()
    try:
        direct = _direct_over(comm, MPI4pyCalls(comm))
        for calls in (direct, MPI4pyCalls(comm)):
            with pytest.raises(MPI.Exception) as err:
                calls.bcast(np.ones(2), MPI.DOUBLE, world_size + 3, 1)
            assert err.value.Get_error_class() == MPI.ERR_ROOT
    finally:
        comm.Free()


def test_make_calls_follows_the_process_decision():
    comm = MPI.COMM_WORLD.Dup()
    try:
        with mpi4py_calls():
            assert type(make_calls(comm)) is MPI4pyCalls
        assert (type(make_calls(comm)) is MPI4pyCalls) == (direct_status() != "direct")
    finally:
        comm.Free()
