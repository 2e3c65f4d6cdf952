"""monitored_barrier: passing, naming the ranks that fail to arrive, recovering from skipped barriers.

Barriers that are meant to fail run on a group of the test's own (monitored_barrier
numbers its calls per group, so a skipped barrier would leave the world's count out
of step); every test ends with the ranks meeting on the world. Timing is only
asserted as an upper bound that proves "no hang".
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import GroupMember

from helpers import check_raises, fail_together

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()

#: the monitored_barrier timeout of the failing cases (seconds), and how it is printed
T = 1
MS = "1000 ms"
#: an error must arrive within the timeout plus this
SLACK = 2.0
#: the grace non-zero ranks give rank 0 beyond the timeout (mpidist/barriers.py)
GRACE = 2.0

pytestmark = pytest.mark.timeout(60)


def expect_error(fn, pattern: str, bound: float, what: str) -> list[str]:
    """Call ``fn``: it must raise RuntimeError whose message matches ``pattern`` within ``bound`` seconds."""
    start = time.monotonic()
    try:
        fn()
    except RuntimeError as exc:
        took = time.monotonic() - start
        problems = [] if re.search(pattern, str(exc)) else [f"{what}: message {str(exc)!r} does not match {pattern!r}"]
        if took > bound:
            problems.append(f"{what}: the error came after {took:.2f} s, more than {bound:g} s")
        return problems
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        return [f"{what}: raised {type(exc).__name__}: {exc} instead of RuntimeError"]
    return [f"{what}: did not raise (returned after {time.monotonic() - start:.2f} s)"]


def drain(g: dist.ProcessGroup) -> None:
    """Receive what a failed barrier left unreceived on ``g``'s control communicator (every member calls).

    A report that rank 0 never received outlives ``destroy_process_group`` and is
    taken by the next group that reuses the communicator's context id (see
    test_new_group_is_not_fooled_by_reports_left_from_a_destroyed_group): clean up so
    that each test starts from a clean slate.
    """
    MPI.COMM_WORLD.Barrier()
    comm = g.control.comm
    status = MPI.Status()
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:
        while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            comm.Recv(bytearray(status.Get_count(MPI.BYTE)), status.Get_source(), status.Get_tag())
        time.sleep(0.01)
    MPI.COMM_WORLD.Barrier()


def expect_pass(fn, what: str) -> list[str]:
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        return [f"{what}: raised {type(exc).__name__}: {exc}"]
    return [] if result is None else [f"{what}: returned {result!r}, not None"]


# -- everyone arrives ---------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [None, 30, 12.5, timedelta(seconds=30), timedelta(minutes=1)])
def test_all_arrive_returns_none_repeatedly(timeout):
    for _ in range(4):
        assert dist.monitored_barrier(timeout=timeout) is None
    assert dist.monitored_barrier(dist.group.WORLD, timeout, True) is None
    assert dist.monitored_barrier(timeout=timeout, wait_all_ranks=True) is None


def test_all_arrive_on_a_short_timeout_group():
    """A group whose own timeout is short: repeated barriers with the default (the group's) timeout pass."""
    g = dist.new_group(timeout=T)
    for _ in range(10):
        assert dist.monitored_barrier(g) is None
    assert g.control._epoch == 10


def test_it_synchronizes():
    """No rank leaves before the last one arrives."""
    if RANK == SIZE - 1:
        time.sleep(0.3)
    start = time.monotonic()
    dist.monitored_barrier(timeout=30)
    took = time.monotonic() - start
    waited = MPI.COMM_WORLD.allgather(took)
    if SIZE > 1:
        assert all(w >= 0.2 for r, w in enumerate(waited) if r != SIZE - 1), waited


@pytest.mark.skipif(SIZE != 1, reason="a world of one rank")
def test_world_of_one_returns_at_once():
    start = time.monotonic()
    assert dist.monitored_barrier(timeout=0.001) is None
    assert dist.monitored_barrier(wait_all_ranks=True) is None
    assert time.monotonic() - start < 1.0


def test_group_of_one_returns_at_once():
    groups = [dist.new_group([r]) for r in range(SIZE)]
    start = time.monotonic()
    assert dist.monitored_barrier(groups[RANK], timeout=0.001) is None
    assert time.monotonic() - start < 1.0


@pytest.mark.mpi(min_size=2)
def test_non_members_get_none():
    g = dist.new_group([0])
    if RANK == 0:
        assert dist.monitored_barrier(g, timeout=5) is None
    else:
        assert g is GroupMember.NON_GROUP_MEMBER
        assert dist.monitored_barrier(g, timeout=5) is None
        assert dist.monitored_barrier(GroupMember.NON_GROUP_MEMBER, timeout=5, wait_all_ranks=True) is None


# -- argument errors ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_wait_all_ranks_must_be_a_bool(bad):
    problems = check_raises(
        TypeError, r"^monitored_barrier: wait_all_ranks must be a bool, got", dist.monitored_barrier, wait_all_ranks=bad
    )
    fail_together(problems)
    assert dist.monitored_barrier(timeout=30) is None  # the error left the ranks in step


@pytest.mark.parametrize("bad", ["5", [1], object(), True])
def test_bad_timeout_type(bad):
    problems = check_raises(
        TypeError,
        r"^monitored_barrier: timeout must be a datetime.timedelta or seconds",
        dist.monitored_barrier,
        timeout=bad,
    )
    fail_together(problems)
    assert dist.monitored_barrier(timeout=30) is None


def test_negative_timeout():
    problems = check_raises(
        ValueError,
        r"^monitored_barrier: timeout must not be negative",
        dist.monitored_barrier,
        timeout=timedelta(seconds=-1),
    )
    fail_together(problems)
    assert dist.monitored_barrier(timeout=30) is None


def test_bad_group():
    fail_together(
        check_raises(TypeError, r"^monitored_barrier: group must be a ProcessGroup", dist.monitored_barrier, group=3)
    )


def test_destroyed_group():
    g = dist.new_group()
    dist.destroy_process_group(g)
    fail_together(
        check_raises(
            RuntimeError, r"^monitored_barrier: process group .* has been destroyed", dist.monitored_barrier, g
        )
    )


# -- a rank fails to arrive ------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("timeout", [T, timedelta(seconds=T)])
def test_missing_rank_is_named_on_every_arrived_rank(timeout):
    """Rank 1 skips: rank 0 raises "Rank 1 failed to pass monitored_barrier in 1000 ms", the others the same."""
    g = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    verdict = rf"^Rank 1 failed to pass monitored_barrier in {MS}"
    if RANK == 0:
        problems = expect_error(lambda: dist.monitored_barrier(g, timeout=timeout), verdict + "$", T + SLACK, "rank 0")
    elif RANK != 1:
        problems = expect_error(
            lambda: dist.monitored_barrier(g, timeout=timeout),
            verdict + r" \(reported by rank 0 of the group\)$",
            T + SLACK,
            "arrived",
        )
    drain(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("wait_all_ranks", [True, False])
def test_two_missing_ranks(wait_all_ranks):
    """Ranks 1 and 2 skip: wait_all_ranks=True names both, False names the first only."""
    g = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if wait_all_ranks:
        verdict = rf"^Ranks 1, 2 failed to pass monitored_barrier in {MS}"
    else:
        verdict = rf"^Rank 1 failed to pass monitored_barrier in {MS}"
    if RANK == 0:
        problems = expect_error(
            lambda: dist.monitored_barrier(g, T, wait_all_ranks), verdict + "$", T + SLACK, "rank 0"
        )
    elif RANK not in (1, 2):
        problems = expect_error(
            lambda: dist.monitored_barrier(g, T, wait_all_ranks),
            verdict + r" \(reported by rank 0",
            T + SLACK,
            "arrived",
        )
    drain(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=4)
def test_wait_all_ranks_names_every_missing_rank():
    """Ranks 1 and 3 skip, rank 2 arrives: "Ranks 1, 3 failed ..." on ranks 0 and 2."""
    g = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    verdict = rf"^Ranks 1, 3 failed to pass monitored_barrier in {MS}"
    if RANK in (0, 2):
        problems = expect_error(
            lambda: dist.monitored_barrier(g, timeout=T, wait_all_ranks=True), verdict, T + SLACK, f"rank {RANK}"
        )
    drain(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_missing_rank_zero_does_not_hang_the_others():
    """Rank 0 (the monitor) skips: every other rank raises after the timeout plus the grace, instead of hanging."""
    g = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != 0:
        problems = expect_error(
            lambda: dist.monitored_barrier(g, timeout=T),
            rf"^monitored_barrier: rank 0 of the group did not release this rank \(rank {RANK}\) within {MS}",
            T + GRACE + 1.0,
            f"rank {RANK}",
        )
    drain(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_late_rank_gets_an_error_and_the_next_barrier_passes():
    """Rank 1 arrives after rank 0 gave up: rank 1 gets an error too; then a barrier of everyone passes."""
    g = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK == 1:
        time.sleep(T + 0.5)
        problems = expect_error(
            lambda: dist.monitored_barrier(g, timeout=T),
            r"^monitored_barrier: rank 0 of the group did not release this rank \(rank 1\)",
            T + GRACE + 1.0,
            "late rank 1",
        )
    else:
        pattern = rf"^Rank 1 failed to pass monitored_barrier in {MS}"
        problems = expect_error(lambda: dist.monitored_barrier(g, timeout=T), pattern, T + SLACK, f"rank {RANK}")
    # rank 1 is still in its late barrier for about T + GRACE: this one's timeout covers that
    problems += expect_pass(lambda: dist.monitored_barrier(g, timeout=15), "next barrier")
    problems += expect_pass(lambda: dist.monitored_barrier(g, timeout=15), "the one after")
    drain(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_rank_that_skipped_a_barrier_is_out_of_step_then_recovers():
    """Rank 1 skips barrier #1; at barrier #2 every rank raises "Rank 1 is out of step"; barrier #3 passes."""
    g = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != 1:
        problems += expect_error(
            lambda: dist.monitored_barrier(g, timeout=T),
            rf"^Rank 1 failed to pass monitored_barrier in {MS}",
            T + SLACK,
            "barrier #1",
        )
    MPI.COMM_WORLD.Barrier()
    out_of_step = (
        r"^Rank 1 is out of step: it is at its monitored_barrier #1 while rank 0 is at #2 "
        r"\(it skipped earlier ones\); the ranks are in step again after this error"
    )
    if RANK != 0:
        out_of_step += r" \(reported by rank 0 of the group\)"
    problems += expect_error(lambda: dist.monitored_barrier(g, timeout=T), out_of_step + "$", T + SLACK, "barrier #2")
    problems += expect_pass(lambda: dist.monitored_barrier(g, timeout=10), "barrier #3")
    problems += expect_pass(lambda: dist.monitored_barrier(g, timeout=10, wait_all_ranks=True), "barrier #4")
    if g.control._epoch != 4:
        problems.append(f"this rank is at monitored_barrier #{g.control._epoch}, expected #4")
    drain(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_rank_zero_that_skipped_catches_up():
    """Rank 0 (the monitor) skips barrier #1 (the others fail it); at #2 rank 0 adopts the others' number."""
    g = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != 0:
        problems += expect_error(
            lambda: dist.monitored_barrier(g, timeout=T), r"did not release this rank", T + GRACE + 1.0, "barrier #1"
        )
    MPI.COMM_WORLD.Barrier()
    # rank 0 is at #1, the others at #2 (they report #2); whatever #2 says, the ranks must be in step after it
    try:
        dist.monitored_barrier(g, timeout=T)
    except RuntimeError:
        pass
    # rank 0 may reach the next barrier up to T + GRACE before the others: its timeout covers that
    problems += expect_pass(lambda: dist.monitored_barrier(g, timeout=6), "the barrier after")
    epochs = MPI.COMM_WORLD.allgather(g.control._epoch)
    if len(set(epochs)) != 1:
        problems.append(f"the ranks' monitored_barrier numbers differ: {epochs}")
    drain(g)
    fail_together(problems)


# -- subgroups ------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=3)
def test_subgroup_names_group_ranks_and_global_ranks():
    """Group of global [1, 2, ...]; global 2 (group rank 1) skips: "Rank 1 (global 2) failed ..."."""
    members = list(range(1, SIZE))
    g = dist.new_group(members, timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    verdict = rf"^Rank 1 \(global 2\) failed to pass monitored_barrier in {MS}"
    if RANK == 0:
        problems += expect_pass(lambda: dist.monitored_barrier(g, timeout=T), "non-member")
    elif RANK == 1:  # group rank 0: the monitor
        problems += expect_error(lambda: dist.monitored_barrier(g, timeout=T), verdict + "$", T + SLACK, "group rank 0")
    elif RANK != 2:
        problems += expect_error(
            lambda: dist.monitored_barrier(g, timeout=T),
            verdict + r" \(reported by rank 0 of the group\)$",
            T + SLACK,
            "arrived",
        )
    MPI.COMM_WORLD.Barrier()
    fail_together(problems)


@pytest.mark.mpi(min_size=4)
def test_subgroup_wait_all_ranks():
    """Group of global [0, 2, 3]; globals 2 and 3 skip: "Ranks 1, 2 (global 2, 3) failed ..."."""
    g = dist.new_group([0, 2, 3], timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK == 0:
        problems += expect_error(
            lambda: dist.monitored_barrier(g, timeout=T, wait_all_ranks=True),
            rf"^Ranks 1, 2 \(global 2, 3\) failed to pass monitored_barrier in {MS}$",
            T + SLACK,
            "rank 0",
        )
    MPI.COMM_WORLD.Barrier()
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_subgroup_all_arrive():
    evens, _ = dist.new_subgroups_by_enumeration([list(range(0, SIZE, 2)), list(range(1, SIZE, 2))])
    for _ in range(3):
        assert dist.monitored_barrier(evens, timeout=10) is None
        assert dist.monitored_barrier(evens, timeout=10, wait_all_ranks=True) is None


# -- usability after errors ------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_new_group_is_not_fooled_by_reports_left_from_a_destroyed_group():
    """Rank 0 skips a barrier of group g, g is destroyed; on a new group rank 1 does not come: rank 0 must fail.

    The reports the other ranks sent to rank 0 for g's barrier were never received; a
    new group must not take them for arrivals at its own barrier.
    """
    g = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    problems: list[str] = []
    if RANK != 0:
        problems += expect_error(
            lambda: dist.monitored_barrier(g, timeout=0.5),
            r"did not release this rank",
            0.5 + GRACE + 1.0,
            "g's barrier",
        )
    MPI.COMM_WORLD.Barrier()
    dist.destroy_process_group(g)
    h = dist.new_group(timeout=30)
    MPI.COMM_WORLD.Barrier()
    if RANK == 0:
        problems += expect_error(
            lambda: dist.monitored_barrier(h, timeout=T),
            rf"^Rank 1 failed to pass monitored_barrier in {MS}",
            T + SLACK,
            "rank 0 on the new group",
        )
    elif RANK != 1:
        problems += expect_error(
            lambda: dist.monitored_barrier(h, timeout=T), r"Rank 1 failed to pass", T + GRACE + 1.0, f"rank {RANK}"
        )
    drain(h)
    fail_together(problems)
