"""Persistent operations (``*_init``, ``Persistent``) against numpy references, at any world size.

Every test is SPMD. Each operation is made once and run several times with new
input values written into the same arrays between runs: the results must follow
the new values, which shows that the operation reads the caller's memory at every
start (and writes its results back there, staged arrays included). Tests that
take the ``make`` fixture run once per array kind (numpy, torch CPU tensors, the
device stand-in, which takes the nonblocking fallback of the device backend).
Comparisons are collected in a ``Checks`` object and decided on every rank
together, so that one rank's wrong result never leaves the others waiting in the
next collective.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import DistBackendError, DistError, Persistent
from mpidist._world import world
from mpidist.backends import mpi_persistent
from mpidist.testing import calls_issued, p2p_calls_issued

from helpers import (
    ALL_DTYPES,
    BF16,
    FAMILIES,
    Maker,
    check_raises,
    fail_together,
    filled,
    kind,
    meet_outside_mpidist,
    rank_input,
    reference,
    sentinel,
    timeout_head,
    to_numpy,
)

pytestmark = pytest.mark.timeout(120)

R = dist.ReduceOp
L = dist.DebugLevel
RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
SHAPE = (2, 3)
RUNS = 3  # runs of each operation, with new input values each time

#: the timeout (seconds) of the groups whose operations are meant to time out, and the slack allowed
T = 1.0
SLACK = 2.0


@pytest.fixture
def debug_off():
    """Leave the debug level at OFF whatever the test did."""
    yield
    dist.set_debug_level(L.OFF)


def fallback(p: Persistent) -> bool:
    """Whether ``p`` runs the backend's nonblocking call at each start (no persistent MPI request)."""
    return p._plan.req is None


def value(rank: int, shape: tuple[int, ...], dtype: Any, run: int) -> np.ndarray:
    """Rank ``rank``'s input in run ``run``: small exact values (``rank_input``) that change from run to run
    (those of "rank" ``rank + 4 * run``), so a result that follows them shows the run read the new contents."""
    return rank_input(rank + 4 * run, shape, np.dtype(dtype))


def inputs_of(shape: tuple[int, ...], dtype: np.dtype, run: int) -> list[np.ndarray]:
    return [value(r, shape, dtype, run) for r in range(SIZE)]


def write(x: Any, values: np.ndarray) -> None:
    """Write ``values`` into ``x`` in place (any array kind): what a program does between runs."""
    if hasattr(x, "host"):  # the device stand-in
        x.host[...] = values
    elif isinstance(x, np.ndarray):
        x[...] = values
    else:  # a torch tensor
        x.copy_(Maker("torch")(values))


#: reductions per element kind (names), each valid there
OPS = {
    "b": ["SUM", "MAX", "BXOR"],
    "i": ["SUM", "AVG", "MIN", "BAND"],
    "u": ["SUM", "AVG", "PRODUCT", "BOR"],
    "f": ["SUM", "AVG", "MAX", "PREMUL_SUM(0.5)"],
    "c": ["SUM", "AVG", "PREMUL_SUM(1-2j)"],
}


def make_op(name: str) -> Any:
    if name == "PREMUL_SUM(0.5)":
        return dist.make_premul_sum(0.5)
    if name == "PREMUL_SUM(1-2j)":
        return dist.make_premul_sum(1 - 2j)
    return getattr(R, name)


OP_CASES = [pytest.param(fam, name, id=f"{fam}-{name}") for fam, dtype in FAMILIES.items() for name in OPS[kind(dtype)]]
DTYPE_PARAMS = [pytest.param(dt, id=dt.name) for dt in ALL_DTYPES]


# ---------------------------------------------------------------------------------------
# results: every collective, repeated runs with new contents
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fam", "opname"), OP_CASES)
def test_all_reduce_init_ops(fam, opname, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    x = make.input(rank, SHAPE, dtype)
    p = dist.all_reduce_init(x, op=make_op(opname))
    checks.true("all_reduce_init returns a Persistent", isinstance(p, Persistent))
    checks.true(
        "device arrays take the device backend's nonblocking path, host arrays a persistent request",
        fallback(p) == make.kind.device,
    )
    for run in range(RUNS):
        write(x, value(rank, SHAPE, dtype, run))
        checks.true("start() returns the operation", p.start() is p)
        checks.true("wait() returns True", p.wait() is True)
        checks.equal(f"run {run}", x, reference(inputs_of(SHAPE, dtype, run), make_op(opname)))
        checks.identical(f"run {run}", x)
    p.free()
    checks.done()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_all_reduce_init_every_dtype(dtype, rank, world_size, checks):
    x = rank_input(rank, (5,), dtype)
    with dist.all_reduce_init(x) as p:
        for run in range(RUNS):
            x[...] = value(rank, (5,), dtype, run)
            p.start().wait()
            checks.equal(f"run {run}", x, reference(inputs_of((5,), dtype, run), R.SUM))
    checks.done()


def test_all_reduce_init_premul_factor_read_at_each_start(make, rank, world_size, checks):
    factor = make(np.array([2.0]))
    x = make.input(rank, (4,), np.float32)
    p = dist.all_reduce_init(x, op=dist.make_premul_sum(factor))
    for run, f in enumerate((2.0, 4.0, 0.5)):
        write(factor, np.array([f]))
        write(x, value(rank, (4,), np.dtype(np.float32), run))
        p.start().wait()
        checks.equal(f"factor {f}", x, reference(inputs_of((4,), np.dtype(np.float32), run), dist.make_premul_sum(f)))
    p.free()
    checks.done()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_broadcast_init_every_src(dtype, make, rank, world_size, checks):
    for src in range(world_size):
        x = make.input(rank, (5,), dtype)
        p = dist.broadcast_init(x, src=src)
        for run in range(RUNS):
            write(x, value(rank, (5,), dtype, run))
            p.start().wait()
            checks.equal(f"src={src} run {run}", x, value(src, (5,), dtype, run))
        p.free()
    checks.done()


@pytest.mark.parametrize(("fam", "opname"), OP_CASES)
def test_reduce_init_every_dst(fam, opname, rank, world_size, checks):
    dtype = FAMILIES[fam]
    for dst in range(world_size):
        x = rank_input(rank, SHAPE, dtype)
        p = dist.reduce_init(x, dst=dst, op=make_op(opname))
        for run in range(RUNS):
            mine = value(rank, SHAPE, dtype, run + dst)
            x[...] = mine
            p.start().wait()
            if rank == dst:
                checks.equal(f"dst={dst} run {run}", x, reference(inputs_of(SHAPE, dtype, run + dst), make_op(opname)))
            else:
                checks.equal(f"dst={dst} run {run}: another rank's array is unchanged", x, mine)
        p.free()
    checks.done()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_all_gather_into_tensor_init(dtype, make, rank, world_size, checks):
    inp = make.input(rank, (3,), dtype)
    out = make.empty((world_size, 3), dtype)  # stacked form
    p = dist.all_gather_into_tensor_init(out, inp)
    for run in range(RUNS):
        write(inp, value(rank, (3,), dtype, run))
        p.start().wait()
        checks.equal(f"run {run}", out, np.stack(inputs_of((3,), dtype, run)))
    p.free()
    checks.done()


def test_all_gather_into_tensor_init_input_in_its_slot_and_overlapping(rank, world_size, checks):
    """The input as this rank's slot of the output (used in place), and an input overlapping the output
    elsewhere (copied before each start, as MPI forbids aliasing)."""
    dtype = np.dtype(np.int64)
    out = np.zeros(2 * world_size, dtype)
    mine = out[2 * rank : 2 * rank + 2]
    with dist.all_gather_into_tensor_init(out, mine) as p:
        for run in range(RUNS):
            mine[...] = value(rank, (2,), dtype, run)
            p.start().wait()
            checks.equal(f"in its slot, run {run}", out, np.concatenate(inputs_of((2,), dtype, run)))
    if world_size > 1:
        out = np.zeros(2 * world_size, dtype)
        other = out[2 * ((rank + 1) % world_size) :][:2]  # another rank's slot
        with dist.all_gather_into_tensor_init(out, other) as p:
            for run in range(RUNS):
                other[...] = value(rank, (2,), dtype, run)
                p.start().wait()
                checks.equal(f"overlapping, run {run}", out, np.concatenate(inputs_of((2,), dtype, run)))
    checks.done()


@pytest.mark.parametrize(("fam", "opname"), OP_CASES)
def test_reduce_scatter_tensor_init(fam, opname, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    out = make.empty((2,), dtype)
    inp = make.input(rank, (world_size, 2), dtype)
    p = dist.reduce_scatter_tensor_init(out, inp, op=make_op(opname))
    for run in range(RUNS):
        write(inp, value(rank, (world_size, 2), dtype, run))
        p.start().wait()
        full = reference(inputs_of((world_size, 2), dtype, run), make_op(opname))
        checks.equal(f"run {run}", out, full[rank])
    p.free()
    checks.done()


def test_reduce_scatter_tensor_init_large(rank, world_size, checks):
    """An input from 256 KiB on takes MPI_Reduce_scatter_init instead of the block variant."""
    dtype = np.dtype(np.float32)
    k = (1 << 18) // world_size + 1  # 1 MiB of float32 in all
    out = np.empty(k, dtype)
    inp = np.empty(k * world_size, dtype)
    with dist.reduce_scatter_tensor_init(out, inp) as p:
        for run in range(2):
            inp[...] = (np.arange(inp.size) % 7 + rank + run).astype(dtype)
            p.start().wait()
            want = sum((np.arange(inp.size) % 7 + r + run) for r in range(world_size)).astype(dtype)
            checks.equal(f"run {run}", out, want[rank * k : (rank + 1) * k])
    checks.done()


def _a2a_reference(rank: int, n: int, sent_by: Any, dtype: np.dtype, run: int, rows: int = 1) -> np.ndarray:
    """What rank ``rank`` receives when rank r sends ``sent_by(r)[j]`` rows (of ``rows`` values) to rank j."""
    parts = []
    for r in range(n):
        counts = sent_by(r)
        data = value(r, (sum(counts), rows), dtype, run)
        start = sum(counts[:rank])
        parts.append(data[start : start + counts[rank]])
    return np.concatenate(parts)


@pytest.mark.parametrize("dtype", [FAMILIES["int"], FAMILIES["bf16"], FAMILIES["complex"]], ids=str)
def test_all_to_all_single_init_even(dtype, make, rank, world_size, checks):
    inp = make.input(rank, (2 * world_size, 3), dtype)
    out = make.empty((2 * world_size, 3), dtype)
    p = dist.all_to_all_single_init(out, inp)
    for run in range(RUNS):
        write(inp, value(rank, (2 * world_size, 3), dtype, run))
        p.start().wait()
        checks.equal(f"run {run}", out, _a2a_reference(rank, world_size, lambda r: [2] * world_size, dtype, run, 3))
    p.free()
    checks.done()


def test_all_to_all_single_init_uneven(make, rank, world_size, checks):
    """Rank r sends r + j + 1 rows to rank j (so each pair's counts differ), every run new contents."""
    dtype = np.dtype(np.float64)

    def sent_by(r: int) -> list[int]:
        return [r + j + 1 for j in range(world_size)]

    send, recv = sent_by(rank), [r + rank + 1 for r in range(world_size)]
    inp = make.input(rank, (sum(send), 2), dtype)
    out = make.empty((sum(recv), 2), dtype)
    p = dist.all_to_all_single_init(out, inp, output_split_sizes=recv, input_split_sizes=send)
    for run in range(RUNS):
        write(inp, value(rank, (sum(send), 2), dtype, run))
        p.start().wait()
        checks.equal(f"run {run}", out, _a2a_reference(rank, world_size, sent_by, dtype, run, 2))
    p.free()
    checks.done()


def test_all_to_all_single_init_splits_on_some_ranks_only(rank, world_size, checks):
    """Even splits given explicitly on rank 0 and left out elsewhere: the ranks agree on one routine."""
    dtype = np.dtype(np.int32)
    inp = rank_input(rank, (world_size, 1), dtype)
    out = np.zeros((world_size, 1), dtype)
    splits = [1] * world_size if rank == 0 else None
    with dist.all_to_all_single_init(out, inp, output_split_sizes=splits, input_split_sizes=splits) as p:
        for run in range(RUNS):
            inp[...] = value(rank, (world_size, 1), dtype, run)
            p.start().wait()
            checks.equal(f"run {run}", out, _a2a_reference(rank, world_size, lambda r: [1] * world_size, dtype, run))
    checks.done()


# ---------------------------------------------------------------------------------------
# point-to-point
# ---------------------------------------------------------------------------------------


def test_send_init_recv_init_ring(make, rank, world_size, checks):
    """Each rank sends to the next and receives from the previous, with new values every run."""
    dtype = np.dtype(np.float32)
    out, inp = make.input(rank, (4,), dtype), make.empty((4,), dtype)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    before = p2p_calls_issued()
    s = dist.send_init(out, dst=nxt, tag=3)
    r = dist.recv_init(inp, src=prev, tag=3)
    # persistent requests: made once (two p2p calls), started without posting; the fallback posts at each start
    made, per_run = (0, 2) if make.kind.device else (2, 0)
    checks.equal("p2p calls made by the creation", p2p_calls_issued() - before, made)
    for run in range(RUNS):
        write(out, value(rank, (4,), dtype, run))
        r.start()
        s.start()
        s.wait()
        r.wait()
        checks.equal(f"run {run}", inp, value(prev, (4,), dtype, run))
    checks.equal("p2p calls made by the runs", p2p_calls_issued() - before - made, RUNS * per_run)
    s.free()
    r.free()
    checks.done()


@pytest.mark.mpi(min_size=2)
def test_recv_init_from_any_rank_and_wrong_size(rank, world_size, checks):
    """A receive from any rank gets rank 1's message; a message of another size makes wait() raise ValueError,
    and the operation runs again afterwards."""
    x = np.zeros(3)
    if rank == 1:
        with dist.send_init(x, dst=0, tag=5) as s:
            for run in range(2):
                x[...] = run + 1
                s.start().wait()
        dist.send(np.ones(5), dst=0, tag=6)  # another size
        dist.send(np.full(3, 9.0), dst=0, tag=6)
    elif rank == 0:
        with dist.recv_init(x, tag=5) as r:
            for run in range(2):
                r.start().wait()
                checks.equal(f"run {run}", x, np.full(3, run + 1.0))
        with dist.recv_init(x, src=1, tag=6) as r:
            checks.raises(
                ValueError,
                r"^recv: a message from rank 1 \(group rank\) is larger than the 3 elements of float64 expected",
                lambda: r.start().wait(),
            )
            r.start().wait()
            checks.equal("after a message of another size, the next run", x, np.full(3, 9.0))
    checks.done()


# ---------------------------------------------------------------------------------------
# staging: non-contiguous arrays, zero copies for contiguous ones
# ---------------------------------------------------------------------------------------


def test_non_contiguous_arrays_are_copied_in_and_back_at_every_run(make, rank, world_size, checks):
    dtype = np.dtype(np.float64)
    # all_reduce on a strided view; the gaps of its base must never change
    xv, xbase = make.strided(rank_input(rank, (6,), dtype))
    # broadcast on a strided view (root: copied in; others: written back)
    bv, bbase = make.strided(rank_input(rank, (4,), dtype))
    # all_gather_into_tensor: strided input and strided output
    iv, _ = make.strided(rank_input(rank, (2,), dtype))
    ov, obase = make.strided(np.zeros(2 * world_size, dtype))
    ps = [
        dist.all_reduce_init(xv, op=R.MAX),
        dist.broadcast_init(bv, src=world_size - 1),
        dist.all_gather_into_tensor_init(ov, iv),
    ]
    for run in range(RUNS):
        write(xv, value(rank, (6,), dtype, run))
        write(bv, value(rank, (4,), dtype, run))
        write(iv, value(rank, (2,), dtype, run))
        for p in ps:
            p.start()
        for p in reversed(ps):
            p.wait()
        checks.equal(f"all_reduce run {run}", xv, reference(inputs_of((6,), dtype, run), R.MAX))
        checks.equal(f"broadcast run {run}", bv, value(world_size - 1, (4,), dtype, run))
        checks.equal(f"all_gather run {run}", ov, np.concatenate(inputs_of((2,), dtype, run)))
        for name, base in (("all_reduce", xbase), ("broadcast", bbase), ("all_gather", obase)):
            gaps = to_numpy(base)[1::2]
            checks.equal(f"{name} run {run}: the gaps of the base", gaps, filled(gaps.shape, dtype, sentinel(dtype)))
    for p in ps:
        p.free()
    checks.done()


def test_contiguous_arrays_are_never_copied(rank, world_size, checks):
    dtype = np.dtype(np.float32)
    x = rank_input(rank, (8,), dtype)
    out = np.zeros((world_size, 8), dtype)
    a2a_in, a2a_out = rank_input(rank, (world_size, 2), dtype), np.zeros((world_size, 2), dtype)
    ps = [
        dist.all_reduce_init(x),
        dist.broadcast_init(x, src=0),
        dist.all_gather_into_tensor_init(out, x),
        dist.all_to_all_single_init(a2a_out, a2a_in),
        dist.reduce_scatter_tensor_init(x[:2].copy(), np.ones(2 * world_size, dtype)),
    ]
    before = world.stats.copies
    for _ in range(RUNS):
        for p in ps:
            p.start().wait()
    checks.equal("staging copies for contiguous arrays of native dtypes", world.stats.copies - before, 0)
    for p in ps:
        p.free()
    checks.done()


def test_bfloat16_sum_is_widened_at_every_run(rank, world_size, checks):
    """MPICH cannot sum bfloat16: without mpidist's C ops (backends/halfops.py) each run copies into float32
    and rounds back (counted); with them each run sums the 2-byte numbers where they are (no copy)."""
    from mpidist.backends.halfops import half_ops

    c_ops = half_ops(BF16) is not None
    x = rank_input(rank, (4,), BF16)
    with dist.all_reduce_init(x) as p:
        for run in range(RUNS):
            x[...] = value(rank, (4,), BF16, run)
            before = world.stats.copies
            p.start().wait()
            if c_ops:
                checks.true(f"run {run}: a staging copy was counted (C ops)", world.stats.copies == before)
            else:
                checks.true(f"run {run}: a staging copy was counted", world.stats.copies > before)
            checks.equal(f"run {run}", x, reference(inputs_of((4,), BF16, run), R.SUM))
    checks.done()


# ---------------------------------------------------------------------------------------
# misuse, errors, life cycle
# ---------------------------------------------------------------------------------------


def _messages(problems_and_messages: list[tuple[str, str]]) -> list[str]:
    """Every rank's messages must be the same (identical errors on every rank)."""
    everyone = MPI.COMM_WORLD.allgather([m for _, m in problems_and_messages])
    return [] if all(e == everyone[0] for e in everyone) else [f"messages differ between ranks: {everyone}"]


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is compared
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_misuse_raises_the_same_clear_error_on_every_rank(rank, world_size, checks):
    x = np.zeros(4)
    p = dist.all_reduce_init(x)
    cases = [
        (
            "wait before start",
            RuntimeError,
            r"^Persistent\.wait: all_reduce_init float64\[4\] op=SUM \(call #\d+ on group \S+\) has not been started; call start\(\) first$",
            p.wait,
        ),
        ("is_completed before start", RuntimeError, r"has not been started", p.is_completed),
    ]
    for _what, exc, match, fn in cases:
        checks.raises(exc, match, fn)
    p.start()
    checks.raises(
        RuntimeError,
        r"^Persistent\.start: .* is already running \(started and not waited for\); call wait\(\) before starting it again$",
        p.start,
    )
    checks.raises(RuntimeError, r"^Persistent\.free: .* is running .*call wait\(\) first$", p.free)
    checks.raises(
        TypeError, r"^Persistent\.wait: timeout must be a datetime\.timedelta or seconds, got str$", p.wait, "soon"
    )
    checks.true("the operation is still running after the refused calls", p.wait() is True)
    checks.true("is_completed after wait", p.is_completed() is True)
    checks.true("wait again after completion", p.wait() is True)
    p.free()
    p.free()  # twice: nothing
    checks.raises(RuntimeError, r"^Persistent\.start: .* has been freed; make a new one with all_reduce_init$", p.start)
    checks.raises(RuntimeError, r"has been freed", p.wait)
    checks.true("repr says freed", repr(p).endswith(" freed>"))
    msgs = [
        (w, _error(f))
        for w, f in [
            ("list", lambda: dist.all_reduce_init([1.0, 2.0])),
            ("op", lambda: dist.all_reduce_init(np.zeros(2), op=R.BAND)),
            ("op type", lambda: dist.all_reduce_init(np.zeros(2), op="sum")),
            ("read-only", lambda: dist.all_reduce_init(np.frombuffer(bytes(16)))),
            ("sizes", lambda: dist.all_gather_into_tensor_init(np.zeros(3), np.zeros(2))),
            ("shape", lambda: dist.reduce_scatter_tensor_init(np.zeros((2, 1)), np.zeros((1, 2 * world_size)))),
            ("dtypes", lambda: dist.reduce_scatter_tensor_init(np.zeros(2, np.float32), np.zeros(2 * world_size))),
            (
                "splits",
                lambda: dist.all_to_all_single_init(
                    np.zeros(world_size), np.zeros(world_size), input_split_sizes=[2] * world_size
                ),
            ),
            ("src", lambda: dist.broadcast_init(np.zeros(2), src=world_size)),
            ("tag", lambda: dist.send_init(np.zeros(2), dst=0, tag=-1)),
            ("group", lambda: dist.all_reduce_init(np.zeros(2), group="world")),
        ]
    ]
    expect = {
        "list": r"^TypeError: all_reduce_init: tensor must be an array",
        "op": r"^ValueError: all_reduce_init: ReduceOp\.BAND is not defined for float64 arrays",
        "op type": r"^TypeError: all_reduce_init: op must be a ReduceOp",
        "read-only": r"^ValueError: all_reduce_init: tensor is read-only",
        "sizes": r"^ValueError: all_gather_into_tensor_init: output_tensor has 3 elements but must have world_size",
        "shape": r"^ValueError: reduce_scatter_tensor_init: input has shape \(1, \d+\); for output of shape \(2, 1\)",
        "dtypes": r"^TypeError: reduce_scatter_tensor_init: output is float32 but input is float64",
        "splits": r"^ValueError: all_to_all_single_init: input_split_sizes sums to",
        "src": r"^RankNotInGroupError: broadcast_init: src=",
        "tag": r"^ValueError: send_init: tag must be between 0 and",
        "group": r"^TypeError: all_reduce_init: group must be a ProcessGroup",
    }
    for what, msg in msgs:
        checks.true(f"{what}: {msg!r} does not match {expect[what]!r}", re.search(expect[what], msg) is not None)
    checks.failures += _messages(msgs)
    checks.equal("refused calls sent nothing: the group is in step", _sum_ok(), True)
    checks.done()


def _sum_ok(group: Any = None) -> bool:
    pg = group or dist.group.WORLD
    x = np.full(3, dist.get_rank() + 1.0)
    dist.all_reduce(x, group=pg)
    members = dist.get_process_group_ranks(pg)
    return bool(np.array_equal(x, np.full(3, float(sum(r + 1 for r in members)))))


def test_refused_creation_sends_nothing(rank, world_size, checks):
    before = calls_issued()
    checks.raises(
        ValueError,
        r"^all_reduce_init: ReduceOp\.AVG is not defined for bool",
        dist.all_reduce_init,
        np.zeros(2, bool),
        op=R.AVG,
    )
    checks.equal("calls issued after a refused creation", calls_issued(), before)
    p = dist.all_reduce_init(np.zeros(2))
    checks.equal("a creation is one call of the group (the agreement)", calls_issued(), before + 1)
    for _ in range(RUNS):
        p.start().wait()
    checks.equal("starts of a persistent request issue no calls", calls_issued(), before + 1)
    p.free()
    checks.done()


def test_context_manager_frees_and_waits(rank, world_size, checks):
    x = np.full(3, float(rank))
    with dist.all_reduce_init(x) as p:
        p.start()  # left running: the exit waits for it, then frees
    checks.equal("the exit waited for the run", x, np.full(3, float(sum(range(world_size)))))
    checks.true("freed on exit", repr(p).endswith(" freed>"))
    checks.raises(RuntimeError, r"has been freed", p.start)
    # an exception leaving the block while a run is going: the run is left to finish, nothing hangs
    y = np.full(3, float(rank))
    try:
        with dist.all_reduce_init(y) as q:
            q.start()
            raise KeyError("boom")
    except KeyError:
        pass
    checks.true("freed after an exception", repr(q).endswith(" freed>"))
    checks.equal("the group is in step", _sum_ok(), True)
    checks.done()


def test_interleaved_with_one_off_calls(rank, world_size, checks):
    """Persistent runs between one-off collectives of the same group, and two persistent operations running at once."""
    a, b = np.zeros(2), np.zeros(3)
    pa = dist.all_reduce_init(a)
    pb = dist.broadcast_init(b, src=0)
    for run in range(RUNS):
        a[...] = rank + run
        b[...] = rank * 10 + run
        pa.start()
        pb.start()
        c = np.full(2, 1.0)
        pb.wait()
        pa.wait()
        dist.all_reduce(c)
        checks.equal(f"run {run} all_reduce", a, np.full(2, float(sum(range(world_size)) + world_size * run)))
        checks.equal(f"run {run} broadcast", b, np.full(3, float(run)))
        checks.equal(f"run {run} one-off", c, np.full(2, float(world_size)))
    pa.free()
    pb.free()
    checks.done()


def test_non_members_get_none(rank, world_size, checks):
    members = [0] if world_size < 3 else [0, 2]
    g = dist.new_group(members)
    x = np.full(2, float(rank))
    p = dist.all_reduce_init(x, group=g)
    others = [
        dist.broadcast_init(np.zeros(2), src=0, group=g),
        dist.reduce_init(np.zeros(2), dst=0, group=g),
        dist.all_gather_into_tensor_init(np.zeros(2 * len(members)), np.zeros(2), group=g),
        dist.reduce_scatter_tensor_init(np.zeros(1), np.zeros(len(members)), group=g),
        dist.all_to_all_single_init(np.zeros(len(members)), np.zeros(len(members)), group=g),
        dist.send_init(np.zeros(2), dst=0, group=g),
        dist.recv_init(np.zeros(2), src=0, group=g),
    ]
    if rank in members:
        checks.true("members get a Persistent", isinstance(p, Persistent))
        p.start().wait()
        checks.equal("member result", x, np.full(2, float(sum(members))))
        for q in [p, *others]:
            q.free()
    else:
        checks.true("non-members get None", p is None and all(q is None for q in others))
    checks.done()


def test_destroying_the_group_frees_its_operations(rank, world_size, checks):
    g = dist.new_group(list(range(world_size)))
    p = dist.all_reduce_init(np.zeros(2), group=g)
    p.start().wait()
    dist.destroy_process_group(g)
    checks.raises(RuntimeError, r"has been freed \(its process group was destroyed\)", p.start)
    checks.done()


# ---------------------------------------------------------------------------------------
# the nonblocking fallback and the agreement between ranks
# ---------------------------------------------------------------------------------------


def test_fallback_when_the_library_lacks_persistent_collectives(monkeypatch, rank, world_size, checks):
    """Without MPI-4 persistent collectives every ``*_init`` takes the nonblocking path, with the same results."""
    monkeypatch.setattr(mpi_persistent, "available", lambda routine: False)
    dtype = np.dtype(np.int64)
    x = np.zeros(3, dtype)
    out = np.zeros((world_size, 3), dtype)
    a2a_in = np.zeros((world_size, 2), dtype)
    a2a_out = np.zeros((world_size, 2), dtype)
    rs_out = np.zeros(2, dtype)
    rs_in = np.zeros((world_size, 2), dtype)
    xv, _ = Maker("numpy").strided(np.zeros(3, dtype))
    ps = {
        "all_reduce": dist.all_reduce_init(x, op=R.AVG),
        "all_reduce strided": dist.all_reduce_init(xv),
        "all_gather": dist.all_gather_into_tensor_init(out, x),
        "all_to_all": dist.all_to_all_single_init(a2a_out, a2a_in),
        "reduce_scatter": dist.reduce_scatter_tensor_init(rs_out, rs_in, op=R.MAX),
    }
    for name, p in ps.items():
        checks.true(f"{name}: nonblocking fallback", fallback(p))
    before = calls_issued()
    for run in range(RUNS):
        x[...] = value(rank, (3,), dtype, run)
        xv[...] = value(rank, (3,), dtype, run)
        a2a_in[...] = value(rank, (world_size, 2), dtype, run)
        rs_in[...] = value(rank, (world_size, 2), dtype, run)
        ps["all_reduce"].start().wait()
        checks.equal(f"all_reduce AVG run {run}", x, reference(inputs_of((3,), dtype, run), R.AVG))
        x[...] = value(rank, (3,), dtype, run)
        for name in ("all_reduce strided", "all_gather", "all_to_all", "reduce_scatter"):
            ps[name].start()
            checks.true(f"{name}: is_completed() eventually", _eventually(ps[name].is_completed))
            ps[name].wait()
        checks.equal(f"strided run {run}", xv, reference(inputs_of((3,), dtype, run), R.SUM))
        checks.equal(f"all_gather run {run}", out, np.stack(inputs_of((3,), dtype, run)))
        checks.equal(
            f"all_to_all run {run}",
            a2a_out,
            _a2a_reference(rank, world_size, lambda r: [1] * world_size, dtype, run, 2),
        )
        checks.equal(
            f"reduce_scatter run {run}", rs_out, reference(inputs_of((world_size, 2), dtype, run), R.MAX)[rank]
        )
    checks.equal("each run of the fallback is one call of the group", calls_issued() - before, RUNS * len(ps))
    for p in ps.values():
        p.free()
    checks.raises(RuntimeError, r"has been freed", ps["all_reduce"].start)
    checks.done()


def _eventually(test: Any, limit: float = 30.0) -> bool:
    deadline = time.monotonic() + limit
    while not test():
        if time.monotonic() > deadline:
            return False
    return True


def test_the_ranks_agree_on_the_fallback(monkeypatch, rank, world_size, checks):
    """If one rank's library lacks the routine, every rank takes the fallback (a mixed choice would deadlock)."""
    monkeypatch.setattr(mpi_persistent, "available", lambda routine: rank != world_size - 1)
    x = np.full(2, float(rank))
    p = dist.all_reduce_init(x)
    checks.true("every rank takes the fallback", fallback(p))
    p.start().wait()
    checks.equal("result", x, np.full(2, float(sum(range(world_size)))))
    p.free()
    monkeypatch.setattr(mpi_persistent, "available", lambda routine: True)
    q = dist.all_reduce_init(x)
    checks.true("with the routine everywhere: a persistent request", not fallback(q))
    q.free()
    checks.done()


def test_probe_of_this_library():
    """MPICH 5 (the development library) runs every routine mpidist uses; the answer is cached per process."""
    if MPI.Get_version() < (4, 0):
        pytest.skip("an MPI-3 library: the fallback is taken")
    for routine in ("Allreduce_init", "Bcast_init", "Reduce_init", "Allgather_init", "Reduce_scatter_block_init",
                    "Reduce_scatter_init", "Alltoall_init", "Alltoallv_init"):  # fmt: skip
        assert mpi_persistent.available(routine) is True, routine
        assert world.persistent_routines[routine] is True


# ---------------------------------------------------------------------------------------
# timeouts
# ---------------------------------------------------------------------------------------

NO_ANSWER = r"no answer \(not waiting in an mpidist call"


def _expect_timeout(fn: Any, patterns: list[str], bound: float, what: str) -> list[str]:
    start = time.monotonic()
    try:
        fn()
    except DistBackendError as exc:
        took = time.monotonic() - start
        problems = [f"{what}: {str(exc)!r} does not match {p!r}" for p in patterns if not re.search(p, str(exc))]
        if took > bound:
            problems.append(f"{what}: the error came after {took:.2f} s, more than {bound:g} s")
        return problems
    except Exception as exc:  # noqa: BLE001 - reported
        return [f"{what}: raised {type(exc).__name__}: {exc} instead of DistBackendError"]
    return [f"{what}: did not raise"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["persistent", "fallback"])
def test_a_rank_that_never_starts_makes_the_others_time_out(path, monkeypatch, rank, world_size):
    """Rank 1 makes the operation but never starts it: the others' wait raises within T + 2 s, and the
    operation cannot run again."""
    if path == "fallback":
        monkeypatch.setattr(mpi_persistent, "available", lambda routine: False)
    g = dist.new_group(timeout=T)
    x = np.ones(4)
    p = dist.all_reduce_init(x, group=g)
    seq = calls_issued(g)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if rank != 1:  # rank 1 stays away (outside mpidist) until the others are done
        p.start()
        op, number = ("persistent all_reduce", seq) if path == "persistent" else ("all_reduce", seq + 1)
        problems += _expect_timeout(
            p.wait, [timeout_head(op, number, g), rf"Rank 1: {NO_ANSWER}", "The group is unusable now"], T + SLACK, "wait"
        )
        problems += check_raises(RuntimeError, r"^Persistent\.start: .* failed and cannot be started again", p.start)
        problems += check_raises(DistBackendError, "did not complete within the timeout", p.wait)
        if p.is_completed() is not True:
            problems.append("is_completed() of a failed operation should be True")
    meet_outside_mpidist()
    p.free()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_wait_timeout_overrides_the_group_timeout(rank, world_size):
    g = dist.new_group(timeout=60)
    p = dist.broadcast_init(np.zeros(2), src=1, group=g)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if rank != 1:  # rank 1 stays away (outside mpidist) until the others are done
        p.start()
        problems += _expect_timeout(
            lambda: p.wait(timeout=T), [timeout_head("persistent broadcast", calls_issued(g), g)], T + SLACK, "wait(timeout=1)"
        )
    meet_outside_mpidist()
    p.free()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_never_creates_makes_the_others_time_out(rank, world_size):
    g = dist.new_group(timeout=T)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if rank != 1:  # rank 1 stays away (outside mpidist) until the others are done
        problems += _expect_timeout(
            lambda: dist.all_gather_into_tensor_init(np.zeros(2 * world_size), np.zeros(2), group=g),
            [timeout_head(r"all_gather_into_tensor_init \(every rank creates it, in the same order\)", 1, g),
             rf"Rank 1: {NO_ANSWER}"],
            T + SLACK, "all_gather_into_tensor_init",
        )  # fmt: skip
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_recv_init_that_times_out_is_cancelled(rank, world_size):
    """No message comes: the receive's wait times out, the run is cancelled and the group stays usable."""
    g = dist.new_group(timeout=T)
    problems: list[str] = []
    if rank == 0:
        r = dist.recv_init(np.zeros(2), src=1, group=g, tag=9)
        r.start()
        problems += _expect_timeout(
            r.wait,
            [r"^persistent recv \(call #1\)", "The receive was cancelled", "The group is still usable"],
            T + SLACK,
            "recv",
        )
        r.free()
    dist.barrier()
    if not _sum_ok(g):
        problems.append("the group does not compute correctly after the cancelled receive")
    fail_together(problems)


# ---------------------------------------------------------------------------------------
# debug levels
# ---------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_detail_checks_the_creation_across_ranks(debug_off, rank, world_size):
    dist.set_debug_level(L.DETAIL)
    pg = dist.group.WORLD
    problems: list[str] = []
    x = np.zeros(4)
    seq = calls_issued(pg) + 1
    listing = " / ".join(
        f"rank {i}: " + ("all_reduce_init float64[4] op=SUM" if i == 0 else "broadcast_init float64[4] src=0")
        for i in range(world_size)
    )
    make = (lambda: dist.all_reduce_init(x)) if rank == 0 else (lambda: dist.broadcast_init(x, src=0))
    problems += check_raises(
        DistError,
        rf"^{'all_reduce_init' if rank == 0 else 'broadcast_init'} \(call #{seq}\) on group {re.escape(pg.group_name)}: "
        rf"the ranks called different collectives: {re.escape(listing)}\. Nothing was sent; the group is still usable\.$",
        make,
    )
    # an all_reduce_init on one rank and a one-off all_reduce on the others would deadlock: caught as well
    call = (lambda: dist.all_reduce_init(x)) if rank == 0 else (lambda: dist.all_reduce(x))
    problems += check_raises(DistError, "the ranks called different collectives", call)
    op = R.SUM if rank == 0 else R.MAX
    problems += check_raises(DistError, "the ranks passed different reduction ops", dist.all_reduce_init, x, op=op)
    if not _sum_ok():
        problems.append("the group is out of step after the refused creations")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_detail_checks_each_start(debug_off, rank, world_size):
    """Two operations made in the same order; rank 0 starts the other one than the rest: refused before anything
    runs, then the right starts work. A debug level raised after creation applies to the starts."""
    a, b = np.zeros(2), np.zeros(2)
    pa = dist.all_reduce_init(a)
    pb = dist.all_reduce_init(b, op=R.MAX)
    dist.set_debug_level(L.DETAIL)
    problems: list[str] = []
    wrong, right = (pb, pa) if rank == 0 else (pa, pb)
    problems += check_raises(
        DistError, r"start of all_reduce_init float64\[2\] op=(SUM|MAX).*Nothing was sent", wrong.start
    )
    a[...] = rank
    b[...] = rank
    for p in (pa, pb):
        p.start().wait()
    if not (
        np.array_equal(a, np.full(2, float(sum(range(world_size)))))
        and np.array_equal(b, np.full(2, float(world_size - 1)))
    ):
        problems.append(f"after the refused start: {a}, {b}")
    del right
    pa.free()
    pb.free()
    fail_together(problems)


def test_info_traces_creation_and_starts(debug_off, caplog, rank, world_size):
    dist.set_debug_level(L.INFO)
    x = np.zeros(2)
    with caplog.at_level("INFO", logger="mpidist"):
        with dist.all_reduce_init(x) as p:
            p.start().wait()
            p.start().wait()
    lines = [r.getMessage() for r in caplog.records if r.name == "mpidist"]
    created = [ln for ln in lines if "all_reduce_init float64[2] op=SUM" in ln and ln.endswith("(persistent, created)")]
    started = [ln for ln in lines if "start of all_reduce_init float64[2] op=SUM" in ln and ln.endswith("(started)")]
    problems = []
    if len(created) != 1 or len(started) != 2:
        problems.append(f"expected one creation line and two start lines, got {lines}")
    fail_together(problems)
