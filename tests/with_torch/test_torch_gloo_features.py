"""What gloo does that the torch backend now does too, compared with gloo in the same processes:
events in torch's profiler, sparse COO all_reduce, monitored_barrier.

torch.distributed's default group is ``init_process_group("mpidist")``; a gloo group
over the same processes is the reference. Failures are decided on all ranks together.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist

from helpers import fail_together, torch_groups_with_gloo

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")
mpidist_torch = pytest.importorskip("mpidist.torch")

from mpidist.diagnose import profiler  # noqa: E402
from mpidist.process_group import ProcessGroup  # noqa: E402

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
TIMEOUT = timedelta(seconds=120)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pgs():
    """(mpidist torch group, gloo group) over every process."""
    with torch_groups_with_gloo("mpidist-tg-", TIMEOUT) as groups:
        yield groups


# -- torch's profiler ---------------------------------------------------------------------------


def _profile(calls, kind="autograd"):
    """Run ``calls`` under a torch profiler recording shapes; return its events."""
    if kind == "autograd":
        prof = torch.autograd.profiler.profile(record_shapes=True)
    else:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    with prof:
        calls()
    return prof.function_events if kind == "autograd" else prof.events()


def _calls(group):
    t = torch.arange(6.0).reshape(3, 2) + RANK
    c = torch.ones(4, dtype=torch.complex64)
    outs = [torch.empty(3, 2) for _ in range(SIZE)]

    def run():
        tdist.all_reduce(t, group=group)
        tdist.all_reduce(t, group=group, async_op=True).wait()
        tdist.all_reduce(c, group=group)
        tdist.broadcast(t, 0, group=group)
        tdist.all_gather(outs, t, group=group)
        tdist.reduce(t, 0, group=group)
        tdist.barrier(group=group)
        if SIZE > 1:
            if RANK == 0:
                tdist.send(t, 1, group=group)
            elif RANK == 1:
                tdist.recv(t, 0, group=group)

    return run


def _backend_events(events, name):
    """(op, input shapes, is_async, count) of the events named ``name:op``, in order."""
    prefix = f"{name}:"
    return [(e.name[len(prefix):], [list(s) for s in e.input_shapes], e.is_async, e.count)
            for e in events if e.name.startswith(prefix)]  # fmt: skip


@pytest.mark.parametrize("kind", ["autograd", "torch"])
def test_profiler_events_match_gloos(pgs, kind):
    mine, gloo = pgs
    got = _backend_events(_profile(_calls(mine), kind), "mpidist")
    expected = _backend_events(_profile(_calls(gloo), kind), "gloo")
    problems = []
    if sorted(got) != sorted(expected):
        problems.append(f"mpidist recorded {got}, gloo {expected}")
    if not got or not all(is_async and count == 1 for _, _, is_async, count in got):
        problems.append(f"events must be asynchronous with count 1, got {got}")
    fail_together(problems)


def test_profiler_event_spans_the_operation(pgs):
    """The event of an async all_reduce begins at the call and ends once the operation completes."""
    mine, _ = pgs
    t = torch.ones(1000)
    events = _profile(lambda: tdist.all_reduce(t, group=mine, async_op=True).wait())
    mine_events = [e for e in events if e.name == "mpidist:all_reduce"]
    problems = []
    if len(mine_events) != 1 or not mine_events[0].is_async or mine_events[0].input_shapes != [[1000]]:
        problems.append(f"got {[(e.name, e.is_async, e.input_shapes) for e in mine_events]}")
    elif not 0 < mine_events[0].cpu_time < 10e6:  # microseconds: ended, not left open until the profiler stopped
        problems.append(f"cpu_time {mine_events[0].cpu_time} us")
    fail_together(problems)


def test_mpidist_api_records_events_with_array_shapes(pgs):
    x = np.ones((2, 5))
    y = torch.ones(7)

    z = np.zeros((2, 5))

    def run():
        dist.all_reduce(x)
        dist.all_reduce(y, async_op=True).wait()
        dist.broadcast(x, src=0)
        received = dist.irecv(z, src=RANK)  # to this rank itself: isend/irecv's route of a numpy array
        dist.isend(x, dst=RANK).wait()
        received.wait()
        # batch_isend_irecv's route of ready numpy arrays (ProcessGroup.batch_fast): one event, as batch_p2p's
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, z, RANK), dist.P2POp(dist.isend, x, RANK)]):
            w.wait()

    got = [(e.name, e.input_shapes, e.is_async) for e in _profile(run) if e.name.startswith("mpidist:")]
    expected = [("mpidist:all_reduce", [[2, 5]], True), ("mpidist:all_reduce", [[7]], True),
                ("mpidist:broadcast", [[2, 5]], True), ("mpidist:recv", [[2, 5]], True),
                ("mpidist:send", [[2, 5]], True), ("mpidist:batch_isend_irecv", [], True)]  # fmt: skip
    fail_together([] if sorted(got) == sorted(expected) else [f"got {got}, expected {expected}"])


def test_no_recording_methods_while_no_profiler_runs(pgs):
    """Outside a profiler the groups' methods are the plain ones: nothing is checked per call."""
    _profile(lambda: tdist.all_reduce(torch.ones(2)))
    problems = []
    if profiler.status() != "watching":
        problems.append(f"status {profiler.status()!r}")
    with torch.autograd.profiler.profile():
        if profiler.status() != "recording" or not hasattr(ProcessGroup.all_reduce, "__mpidist_recording__"):
            problems.append(f"inside a profiler: status {profiler.status()!r}")
    for cls, name in ((ProcessGroup, "all_reduce"), (ProcessGroup, "send"),
                      (mpidist_torch.ProcessGroupMPIDist, "allreduce"),
                      (mpidist_torch.ProcessGroupMPIDist, "_allgather_base")):  # fmt: skip
        if hasattr(cls.__dict__[name], "__mpidist_recording__"):
            problems.append(f"{cls.__name__}.{name} still records after the profiler stopped")
    t = torch.ones(3)
    tdist.all_reduce(t)  # works after the switch back
    if not torch.equal(t, torch.full((3,), float(SIZE))):
        problems.append(f"all_reduce after profiling gave {t}")
    fail_together(problems)


# -- sparse all_reduce --------------------------------------------------------------------------


def _sparse(dtype=torch.float32, hybrid=False):
    i = torch.tensor([[RANK % 4, 0, RANK % 4], [1, 2, 1]])  # (RANK, 1) twice: an uncoalesced input
    if hybrid:
        v = torch.tensor([[1, RANK], [10, 20], [100, 200]], dtype=dtype)
        return torch.sparse_coo_tensor(i, v, (4, 3, 2))
    v = torch.tensor([1 + RANK, 10, 100], dtype=dtype)
    return torch.sparse_coo_tensor(i, v, (4, 3))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("case", ["float32", "int64", "hybrid"])
def test_sparse_all_reduce_matches_gloo(pgs, case, async_op):
    dtype = torch.int64 if case == "int64" else torch.float32
    results = {}
    for name, group in zip(("mpidist", "gloo"), pgs):
        t = _sparse(dtype, hybrid=case == "hybrid")
        work = tdist.all_reduce(t, group=group, async_op=async_op)
        if async_op:
            work.wait()
            same = work.result()[0] is t and work.get_future().wait()[0] is t
        else:
            same = work is None
        results[name] = (t.is_coalesced(), t.indices().tolist(), t.values().tolist(), same)
    dense = sum(torch.sparse_coo_tensor(*_parts(r, dtype, case)).to_dense() for r in range(SIZE))
    problems = []
    if results["mpidist"] != results["gloo"]:
        problems.append(f"mpidist {results['mpidist']} != gloo {results['gloo']}")
    got = torch.sparse_coo_tensor(torch.tensor(results["mpidist"][1]).reshape(2, -1),
                                  torch.tensor(results["mpidist"][2], dtype=dtype), dense.shape)  # fmt: skip
    if not torch.equal(got.to_dense(), dense):
        problems.append(f"sum {got.to_dense().tolist()} != {dense.tolist()}")
    fail_together(problems)


def _parts(rank, dtype, case):
    i = torch.tensor([[rank % 4, 0, rank % 4], [1, 2, 1]])
    if case == "hybrid":
        return i, torch.tensor([[1, rank], [10, 20], [100, 200]], dtype=dtype), (4, 3, 2)
    return i, torch.tensor([1 + rank, 10, 100], dtype=dtype), (4, 3)


def test_sparse_all_reduce_refuses_other_ops_like_gloo(pgs):
    problems = []
    for name, group in zip(("mpidist", "gloo"), pgs):
        try:
            tdist.all_reduce(_sparse(), op=tdist.ReduceOp.MAX, group=group)
            problems.append(f"{name}: MAX on a sparse tensor did not raise")
        except (ValueError, RuntimeError) as exc:
            if "SUM" not in str(exc):
                problems.append(f"{name}: {exc}")
    t = torch.ones(3)
    tdist.all_reduce(t)  # the group is still in step
    if not torch.equal(t, torch.full((3,), float(SIZE))):
        problems.append(f"all_reduce afterwards gave {t}")
    fail_together(problems)


# -- monitored_barrier --------------------------------------------------------------------------


def test_monitored_barrier_passes_like_gloo(pgs):
    problems = []
    for name, group in zip(("mpidist", "gloo"), pgs):
        for wait_all in (False, True):
            if tdist.monitored_barrier(group, timeout=timedelta(seconds=30), wait_all_ranks=wait_all) is not None:
                problems.append(f"{name}: dist.monitored_barrier returned something")
    if pgs[0].monitored_barrier(timedelta(seconds=30), wait_all_ranks=True) is not None:
        problems.append("ProcessGroup.monitored_barrier returned something")
    tdist.monitored_barrier(timeout=30.0)  # a float: seconds, as torch takes it (with its warning)
    fail_together(problems)


@pytest.mark.mpi(min_size=3)
def test_monitored_barrier_names_the_missing_ranks_like_gloo(pgs):
    """Ranks 1 and 2 skip the barrier: rank 0 names rank 1 (the first), or both with wait_all_ranks."""
    problems = []
    for name in ("mpidist", "gloo"):
        for wait_all in (False, True):
            group = tdist.new_group(backend=name, timeout=TIMEOUT)  # its own: the failed barrier stays in it
            if RANK in (1, 2):
                MPI.COMM_WORLD.barrier()
                continue
            try:
                tdist.monitored_barrier(group, timeout=timedelta(seconds=1), wait_all_ranks=wait_all)
                problems.append(f"{name}: no error on rank {RANK}")
            except RuntimeError as exc:
                text = str(exc)
                if RANK == 0:
                    named = [r for r in (1, 2) if f"{r}" in text.split("failed to pass")[0]]
                    if "failed to pass" not in text or named != ([1, 2] if wait_all else [1]):
                        problems.append(f"{name} wait_all_ranks={wait_all}: {text}")
            MPI.COMM_WORLD.barrier()
    fail_together(problems)
