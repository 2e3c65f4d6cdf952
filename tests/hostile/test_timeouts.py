"""Timeouts: fault injection under mpiexec.

Every test that makes the ranks diverge does it on a group of its own, created
with a short timeout (``T``), and lets the ranks meet again on the world before
it ends; the conftest fixture destroys the group (a group whose call timed out
is unusable: the call stays pending inside MPI). A rank "misses" a call by
sleeping (it is then outside mpidist and must be reported as "no answer") or by
waiting in a world collective (it must be reported as "waiting in barrier").
Timing is only asserted as an upper bound that proves "no hang".
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import DistBackendError, Work
from mpidist.testing import backend_of, calls_issued, p2p_calls_issued

from helpers import assert_equal, fail_together, meet_outside_mpidist, timeout_head

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()

#: the timeout (seconds) of the groups whose calls are meant to time out
T = 1.0
#: an error must arrive within the timeout plus this (the issue's bound)
SLACK = 2.0

NO_ANSWER = r"no answer \(not waiting in an mpidist call"
UNUSABLE = r"The group is unusable now \(the call is still pending inside MPI\): destroy it"
#: how a receive that timed out ends: nothing of it is left pending
NOTHING_POSTED = r"No message had arrived, and nothing is left posted: the next message goes to the next receive\. "
CANCELLED = r"The receive was cancelled: the next message goes to the next receive\. "
USABLE = r"The group is still usable\.$"

pytestmark = pytest.mark.timeout(60)


def expect_timeout(fn, patterns: list[str], bound: float, what: str) -> tuple[list[str], DistBackendError | None]:
    """Call ``fn``; return (problems, the error): it must raise DistBackendError matching ``patterns`` in ``bound`` s."""
    start = time.monotonic()
    try:
        fn()
    except DistBackendError as exc:
        took = time.monotonic() - start
        problems = [
            f"{what}: message {str(exc)!r} does not match {p!r}" for p in patterns if not re.search(p, str(exc))
        ]
        if took > bound:
            problems.append(f"{what}: the error came after {took:.2f} s, more than {bound:g} s")
        return problems, exc
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        return [f"{what}: raised {type(exc).__name__}: {exc} instead of DistBackendError"], None
    return [f"{what}: did not raise (completed after {time.monotonic() - start:.2f} s)"], None


def world_sum_ok() -> list[str]:
    """The world group still computes an all_reduce correctly."""
    x = np.full(3, RANK + 1, np.int64)
    dist.all_reduce(x)
    want = SIZE * (SIZE + 1) // 2
    return [] if np.array_equal(x, np.full(3, want, np.int64)) else [f"world all_reduce gave {x}, expected {want}"]


def test_dist_backend_error_is_a_runtime_error():
    assert issubclass(DistBackendError, RuntimeError)
    assert issubclass(DistBackendError, dist.DistError)


# -- a rank misses a collective ---------------------------------------------------------

MISSING = 1


def _run(op: str, g: dist.ProcessGroup) -> None:
    n = g.size()
    if op == "all_reduce":
        dist.all_reduce(np.ones(4), group=g)
    elif op == "all_reduce-avg":  # the general lane (not the fast one)
        dist.all_reduce(np.ones(4), op=dist.ReduceOp.AVG, group=g)
    elif op == "broadcast":  # from the missing rank: nobody can complete without it
        dist.broadcast(np.ones(4), src=MISSING, group=g)
    elif op == "barrier":
        dist.barrier(group=g)
    elif op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(np.empty(2 * n), np.ones(2), group=g)
    elif op == "all_gather":
        dist.all_gather([np.empty(2) for _ in range(n)], np.ones(2), group=g)
    else:  # pragma: no cover
        raise AssertionError(op)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "op", ["all_reduce", "all_reduce-avg", "broadcast", "barrier", "all_gather_into_tensor", "all_gather"]
)
def test_missing_rank_times_out_with_diagnosis(op):
    """Rank 1 stays away instead of calling: the others raise within T + 2 s, naming op, group, call, timeout, rank 1."""
    g = dist.new_group(timeout=T)
    name = op.split("-")[0]
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != MISSING:  # rank 1 stays away (outside mpidist) until the others are done
        problems, _ = expect_timeout(
            lambda: _run(op, g),
            [timeout_head(name, 1, g), rf"Rank {MISSING}: {NO_ANSWER}", UNUSABLE],
            T + SLACK,
            op,
        )
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    problems += world_sum_ok()
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["all_reduce", "barrier"])
def test_missing_rank_times_out_with_diagnosis_in_a_napping_wait(monkeypatch, op):
    """As above in the wait of a node with more ranks than cores (yields, then naps), whatever this node has."""
    from mpidist._world import world

    monkeypatch.setattr(world.init_info, "oversubscribed", True)
    g = dist.new_group(timeout=T)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != MISSING:
        problems, _ = expect_timeout(
            lambda: _run(op, g), [timeout_head(op, 1, g), rf"Rank {MISSING}: {NO_ANSWER}", UNUSABLE], T + SLACK, op
        )
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    problems += world_sum_ok()
    fail_together(problems)


@pytest.mark.mpi(min_size=3)
def test_ranks_that_time_out_together_report_each_other_as_waiting():
    """Ranks stuck in the same call answer each other's survey: "waiting in all_reduce (call #1)"."""
    g = dist.new_group(timeout=T)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != MISSING:  # rank 1 stays away (outside mpidist) until the others are done
        others = [r for r in range(SIZE) if r not in (RANK, MISSING)]
        patterns = [timeout_head("all_reduce", 1, g), rf"Rank {MISSING}: {NO_ANSWER}"]
        patterns += [
            rf"Rank {r}: waiting in all_reduce \(call #1\) on group {re.escape(g.group_name)}\." for r in others
        ]
        problems, exc = expect_timeout(lambda: dist.all_reduce(np.ones(2), group=g), patterns, T + SLACK, "all_reduce")
        if exc is not None and re.search(rf"Rank ({'|'.join(map(str, others))}): no answer", str(exc)):
            problems.append(f"a rank that timed out too was reported as not answering: {exc}")
    meet_outside_mpidist()
    dist.barrier()
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_rank_waiting_in_another_collective_is_named():
    """Rank 1 waits in a world barrier: the others' error says "Rank 1: waiting in barrier (call #k) on group <world>"."""
    g = dist.new_group(timeout=T)
    world = dist.group.WORLD
    k = calls_issued(world) + 1  # the world barrier below is the world's next collective (the same on every rank)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != MISSING:
        problems, _ = expect_timeout(
            lambda: dist.broadcast(np.zeros(3), src=MISSING, group=g),
            [
                timeout_head("broadcast", 1, g),
                rf"Rank {MISSING}: waiting in barrier \(call #{k}\) on group {re.escape(world.group_name)}\.",
            ],
            T + SLACK,
            "broadcast",
        )
    dist.barrier()  # rank 1 waits here from the start; the others join after their timeout
    if calls_issued(world) != k:
        problems.append(f"world seq is {calls_issued(world)} after the barrier, expected {k}")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_world_and_new_groups_work_after_a_timeout():
    """After a timeout: the stuck group can be destroyed, the world computes correctly, new groups work."""
    g = dist.new_group(timeout=T)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != MISSING:  # rank 1 stays away (outside mpidist) until the others are done
        problems, _ = expect_timeout(
            lambda: dist.all_reduce(np.ones(2), group=g), [timeout_head("all_reduce", 1, g)], T + SLACK, "all_reduce"
        )
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    if not g.destroyed:
        problems.append("the stuck group is not marked destroyed")
    try:
        dist.all_reduce(np.ones(2), group=g)
        problems.append("a collective on the destroyed group did not raise")
    except RuntimeError as exc:
        if "destroyed" not in str(exc):
            problems.append(f"collective on destroyed group: {exc}")
    for _ in range(3):
        problems += world_sum_ok()
    fresh = dist.new_group(timeout=T)
    y = np.full(2, float(RANK))
    dist.all_reduce(y, group=fresh)
    if not np.array_equal(y, np.full(2, SIZE * (SIZE - 1) / 2)):
        problems.append(f"all_reduce on a new group gave {y}")
    b = np.arange(3.0) if RANK == 0 else np.zeros(3)
    dist.broadcast(b, src=0)
    if not np.array_equal(b, np.arange(3.0)):
        problems.append(f"world broadcast gave {b}")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_sequence_number_counts_collectives_not_p2p():
    """The timed-out call is call #(collectives issued on the group + 1); sends and receives do not count."""
    g = dist.new_group(timeout=T)
    problems: list[str] = []
    x = np.full(2, float(RANK))
    dist.all_reduce(x, group=g)
    dist.broadcast(x, src=0, group=g)
    dist.barrier(group=g)
    dist.all_gather_into_tensor(np.empty(2 * SIZE), np.ones(2), group=g)
    dist.all_reduce(x, group=g, async_op=True).wait()
    collectives = 5
    # point-to-point on the same group: ring exchanges, twice
    for _ in range(2):
        out = np.full(3, float(RANK))
        inp = np.empty(3)
        works = [dist.isend(out, dst=(RANK + 1) % SIZE, group=g), dist.irecv(inp, src=(RANK - 1) % SIZE, group=g)]
        for w in works:
            w.wait()
        if not np.array_equal(inp, np.full(3, float((RANK - 1) % SIZE))):
            problems.append(f"ring exchange received {inp}")
    if calls_issued(g) != collectives:
        problems.append(f"backend seq is {calls_issued(g)}, expected {collectives}")
    if p2p_calls_issued(g) != 4:
        problems.append(f"p2p calls issued {p2p_calls_issued(g)}, expected 4")
    MPI.COMM_WORLD.Barrier()
    if RANK != MISSING:  # rank 1 stays away (outside mpidist) until the others are done
        p, _ = expect_timeout(
            lambda: dist.all_reduce(np.ones(2), group=g),
            [timeout_head("all_reduce", collectives + 1, g), rf"Rank {MISSING}: {NO_ANSWER}"],
            T + SLACK,
            "all_reduce",
        )
        problems += p
    meet_outside_mpidist()
    dist.barrier()
    fail_together(problems)


# -- point-to-point and Work.wait -------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_recv_without_send_times_out():
    """recv from rank 1, which never sends (it waits in a world barrier): DistBackendError within T + 2 s.

    The message numbers the receive among this rank's point-to-point calls on the group. Blocking recv
    posts no receive until the message is there, so nothing is left behind: the message rank 1 sends
    afterwards arrives in the next recv.
    """
    g = dist.new_group(timeout=T)
    world = dist.group.WORLD
    k = calls_issued(world) + 1
    problems: list[str] = []
    # one completed exchange first: rank 1 sends to rank 0 twice
    if RANK == 0:
        for i in range(2):
            got = np.empty(2)
            dist.recv(got, src=1, group=g, tag=i)
            if not np.array_equal(got, np.full(2, float(i))):
                problems.append(f"recv #{i} got {got}")
    elif RANK == 1:
        for i in range(2):
            dist.send(np.full(2, float(i)), dst=0, group=g, tag=i)
    MPI.COMM_WORLD.Barrier()
    if RANK == 0:
        p, _ = expect_timeout(
            lambda: dist.recv(np.empty(2), src=1, group=g, tag=7),
            [
                timeout_head("recv", 3, g),
                rf"Rank 1: waiting in barrier \(call #{k}\) on group {re.escape(world.group_name)}\.",
                NOTHING_POSTED + USABLE,
            ],
            T + SLACK,
            "recv",
        )
        problems += p
        if calls_issued(g) != 0:
            problems.append(f"point-to-point calls advanced the collective seq to {calls_issued(g)}")
    dist.barrier()
    if RANK == 1:
        dist.send(np.full(2, 7.0), dst=0, group=g, tag=7)
    elif RANK == 0:
        got = np.zeros(2)
        dist.recv(got, src=1, group=g, tag=7)
        if not np.array_equal(got, np.full(2, 7.0)):
            problems.append(f"the recv after the timeout got {got}")
        if backend_of(g).pending():
            problems.append("the receive that timed out is still pending")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_irecv_that_timed_out_is_cancelled_and_the_next_receive_gets_the_message():
    """Rank 1's irecv waits 0.5 s for rank 0, which has not sent yet: the wait raises and the receive is
    cancelled. The message rank 0 sends afterwards arrives in rank 1's next irecv, and the array of the
    cancelled receive is untouched."""
    g = dist.new_group(timeout=30)
    problems: list[str] = []
    if RANK == 1:
        first = np.full(4, -1.0)
        w = dist.irecv(first, src=0, group=g, tag=3)
        p, exc = expect_timeout(
            lambda: w.wait(timeout=0.5),
            [timeout_head("recv", 1, g, "0.5") + r" Rank 0: waiting in barrier .*\. " + CANCELLED + USABLE],
            0.5 + SLACK,
            "irecv",
        )
        problems += p
        if exc is not None and (w.exception() is not exc or w.is_success()):
            problems.append("the cancelled irecv's Work does not report its error")
    dist.barrier()
    if RANK == 0:
        dist.send(np.arange(4.0), dst=1, group=g, tag=3)
    elif RANK == 1:
        fresh = np.zeros(4)
        dist.irecv(fresh, src=0, group=g, tag=3).wait(timeout=10)
        if not np.array_equal(fresh, np.arange(4.0)):
            problems.append(f"the next irecv got {fresh}")
        if not np.array_equal(first, np.full(4, -1.0)):
            problems.append(f"the cancelled receive's array was written: {first}")
        if backend_of(g).pending():
            problems.append("the cancelled receive is still pending")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_irecv_and_isend_work_wait_time_out():
    """Work.wait(timeout=...) of an irecv with no sender and of a large isend with no receiver raise in time."""
    g = dist.new_group(timeout=30)  # the wait's own timeout must bound it, not the group's
    problems: list[str] = []
    MPI.COMM_WORLD.Barrier()
    if RANK == 0:
        w = dist.irecv(np.empty(4), src=1, group=g, tag=3)
        p, exc = expect_timeout(lambda: w.wait(timeout=0.5), [timeout_head("recv", 1, g, "0.5")], 0.5 + SLACK, "irecv")
        problems += p
        if exc is not None and (w.exception() is not exc or not w.is_completed() or w.is_success()):
            problems.append("the failed irecv's Work does not report its error")
        # 32 MiB: far above any eager limit, so the send cannot complete without a receiver
        s = dist.isend(np.ones(4 << 20), dst=1, group=g, tag=4)
        p, _ = expect_timeout(
            lambda: s.wait(timeout=timedelta(seconds=0.5)), [timeout_head("send", 2, g, "0.5")], 0.5 + SLACK, "isend"
        )
        problems += p
    dist.barrier()
    fail_together(problems)


def test_irecv_from_self_work_wait_times_out():
    """At every world size: an irecv from this rank itself with no isend; wait(timeout) raises within the bound,
    the receive is cancelled, and the group still carries a message from this rank to itself."""
    g = dist.new_group(timeout=30)
    buf = np.zeros(2)
    w = dist.irecv(buf, src=RANK, group=g, tag=9)
    problems, exc = expect_timeout(
        lambda: w.wait(timeout=0.3), [timeout_head("recv", 1, g, "0.3"), CANCELLED + USABLE], 0.3 + SLACK, "irecv"
    )
    if exc is not None:
        again, _ = expect_timeout(w.wait, [re.escape(str(exc))], 1.0, "second wait")
        problems += again
        if w.exception() is not exc:
            problems.append("Work.exception() is not the timeout error")
    got = np.zeros(2)
    r = dist.irecv(got, src=RANK, group=g, tag=9)
    dist.isend(np.full(2, 5.0), dst=RANK, group=g, tag=9).wait()
    r.wait()
    if not np.array_equal(got, np.full(2, 5.0)) or not np.array_equal(buf, np.zeros(2)):
        problems.append(f"after the timeout the message went to {buf} (cancelled) / {got} (the next receive)")
    dist.barrier()
    dist.destroy_process_group(g)
    problems += world_sum_ok()
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["wait-timeout", "wait-default", "future"])
def test_async_collective_wait_times_out(how):
    """An async all_reduce that cannot complete (rank 1 never calls it): wait/future raise within the bound."""
    group_timeout, limit, shown = (30, 0.5, "0.5") if how == "wait-timeout" else (T, T, "1")
    g = dist.new_group(timeout=group_timeout)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != MISSING:  # rank 1 stays away (outside mpidist) until the others are done
        w = dist.all_reduce(np.ones(3), group=g, async_op=True)
        assert isinstance(w, Work)
        if how == "wait-timeout":
            fn = lambda: w.wait(timeout=limit)  # noqa: E731
        elif how == "wait-default":
            fn = w.wait
        else:
            fut = w.get_future().then(lambda f: f.value())
            fn = fut.wait
        problems, exc = expect_timeout(
            fn, [timeout_head("all_reduce", 1, g, shown), rf"Rank {MISSING}: {NO_ANSWER}"], limit + SLACK, how
        )
        if exc is not None and w.exception() is None:
            problems.append("Work.exception() is None after the timeout")
        if exc is not None and w.is_success():
            problems.append("Work.is_success() after the timeout")
    meet_outside_mpidist()
    dist.barrier()
    fail_together(problems)


# -- subgroups ----------------------------------------------------------------------------


@pytest.mark.mpi(min_size=3)
def test_subgroup_message_uses_group_ranks_and_names_global_ranks():
    """Group [0, 2, ...] without global 1; global 2 (group rank 1) misses the call.

    Messages give group ranks, with the global rank where it differs.
    """
    members = [0] + list(range(2, SIZE))
    g = dist.new_group(members, timeout=T)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK == 1:
        if g is not dist.GroupMember.NON_GROUP_MEMBER:
            problems.append(f"global rank 1 got {g!r}, not NON_GROUP_MEMBER")
        if dist.all_reduce(np.ones(2), group=g) is not None:
            problems.append("all_reduce on a non-member did not return None")
    elif RANK != 2:  # global rank 2 stays away (outside mpidist) until the others are done
        me = members.index(RANK)
        patterns = [timeout_head("all_reduce", 1, g), rf"Rank 1 \(global rank 2\): {NO_ANSWER}"]
        for gr, gl in enumerate(members):
            if gl in (2, RANK):
                continue
            who = f"Rank {gr}" + ("" if gr == gl else f" \\(global rank {gl}\\)")
            patterns.append(rf"{who}: waiting in all_reduce \(call #1\) on group {re.escape(g.group_name)}\.")
        p, exc = expect_timeout(lambda: dist.all_reduce(np.ones(2), group=g), patterns, T + SLACK, "all_reduce")
        problems += p
        if exc is not None:
            if g.rank() != me or f"rank {me} of {len(members)}" not in str(exc):
                problems.append(f"the message does not give this rank's group rank {me}: {exc}")
            if "(global rank 0)" in str(exc):
                problems.append(f"global rank 0 (= group rank 0) is annotated needlessly: {exc}")
    meet_outside_mpidist()
    dist.barrier()
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_group_timeout_bounds_the_call_not_the_world_timeout():
    """The world's timeout is long (90 s in the harness); a group's short timeout is the one that applies."""
    assert dist.group.WORLD.timeout > timedelta(seconds=10)
    g = dist.new_group(timeout=timedelta(milliseconds=500))
    assert g.timeout == timedelta(milliseconds=500)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != MISSING:  # rank 1 stays away (outside mpidist) until the others are done
        problems, _ = expect_timeout(
            lambda: dist.barrier(group=g), [timeout_head("barrier", 1, g, "0.5")], 0.5 + SLACK, "barrier"
        )
    meet_outside_mpidist()
    dist.barrier()
    fail_together(problems)


def test_equal_calls_complete_on_short_timeout_group():
    """Control: with every rank calling, a short-timeout group never times out."""
    g = dist.new_group(timeout=T)
    x = np.full(4, RANK + 1.0)
    for _ in range(20):
        dist.all_reduce(x, group=g)
        dist.barrier(group=g)
    expected = np.full(4, float(SIZE * (SIZE + 1) // 2) * SIZE**19)
    assert_equal(x, expected)
    assert calls_issued(g) == 40
