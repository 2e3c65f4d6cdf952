"""How a rank waits: the oversubscription check, the napping wait of a node with more ranks than cores."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import work
from mpidist._world import world
from mpidist.testing import backend_of

from helpers import fail_together


@pytest.mark.one_rank
@pytest.mark.parametrize(
    ("cpus", "node_size", "expected"), [(2, 1, False), (2, 2, False), (2, 3, True), (8, 4, False), (1, 2, True)]
)
def test_oversubscription_compares_the_node_with_the_affinity_mask(monkeypatch, cpus, node_size, expected):
    """More ranks on the node than CPUs in this process's affinity mask (not the machine's count) is oversubscribed."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert work.usable_cpus() == cpus
    assert work.oversubscribed(node_size) is expected


@pytest.mark.one_rank
def test_oversubscription_without_an_affinity_mask_counts_the_cpus(monkeypatch):
    def refuse(pid):
        raise OSError("no affinity here")

    monkeypatch.setattr(os, "sched_getaffinity", refuse, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert work.usable_cpus() == 3
    assert not work.oversubscribed(3) and work.oversubscribed(4)


def test_init_picks_the_wait_mode_of_this_node():
    """The default group's waits spin long only where every rank of the node has a CPU of its own."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    expected = node.Get_size() > len(os.sched_getaffinity(0))
    node.Free()
    problems = []
    if world.init_info.oversubscribed is not expected:
        problems.append(f"oversubscribed={world.init_info.oversubscribed}, expected {expected}")
    spins = work.SPINS_OVERSUBSCRIBED if expected else work.SPINS_IDLE_CORES
    if backend_of().spins != spins:
        problems.append(f"the default group spins {backend_of().spins} tests, expected {spins}")
    c_spins = -spins if expected else spins  # negative: the C calls go on testing with yields between
    if backend_of().c_spins != c_spins:
        problems.append(f"the default group's C calls spin {backend_of().c_spins}, expected {c_spins}")
    fail_together(problems)


class _Never:
    """A request that never completes; counts its tests."""

    def __init__(self) -> None:
        self.tests = 0

    def __call__(self) -> bool:
        self.tests += 1
        return False


@pytest.mark.one_rank
@pytest.mark.parametrize("oversubscribed", [True, False])
def test_the_slow_wait_ends_at_its_timeout_and_beats(monkeypatch, oversubscribed):
    """Napping or yielding, the wait returns False at its timeout and calls ``idle`` (the stall beat) meanwhile."""
    monkeypatch.setattr(world.init_info, "oversubscribed", oversubscribed)
    naps = []
    monkeypatch.setattr(work, "_sleep", lambda s: (naps.append(s), time.sleep(s)))
    never, beats = _Never(), []
    start = time.perf_counter()
    assert work.poll_slowly(never, 0.3, lambda: beats.append(1)) is False
    took = time.perf_counter() - start
    assert 0.3 <= took < 1.5, took
    assert beats, "idle was never called"
    if oversubscribed:  # a few yields, then a nap between tests: the CPU goes to the other ranks
        assert len(naps) >= 3 and set(naps) == {work.NAP_S}
        assert never.tests == work.YIELDS_OVERSUBSCRIBED + len(naps)
    else:  # a core per rank: never a nap (MPI advances a large message only while it is tested)
        assert not naps


@pytest.mark.one_rank
def test_a_napping_wait_returns_as_soon_as_the_test_succeeds(monkeypatch):
    monkeypatch.setattr(world.init_info, "oversubscribed", True)
    for after in (1, work.YIELDS_OVERSUBSCRIBED, work.YIELDS_OVERSUBSCRIBED + 5):
        calls = []

        def test(calls=calls, after=after) -> bool:
            calls.append(1)
            return len(calls) >= after

        assert work.poll_slowly(test, 60) is True
        assert len(calls) == after


def test_the_yielding_c_wait_gives_the_results_and_keeps_the_timeout(rank, world_size):
    """Where the C calls yield between tests (``c_spins`` < 0: more ranks than cores; forced here), the
    blocking calls give numpy's results, and a receive that nobody sends still ends at the group's timeout."""
    g = dist.new_group(timeout=timedelta(seconds=5))
    backend_of(g).c_spins = -2
    problems = []
    x = np.arange(4, dtype=np.float64) + rank
    dist.all_reduce(x, group=g)
    if not np.array_equal(x, np.arange(4) * world_size + sum(range(world_size))):
        problems.append(f"all_reduce gave {x}")
    y = np.full(3, float(rank))
    dist.broadcast(y, src=world_size - 1, group=g)
    if not np.array_equal(y, np.full(3, world_size - 1.0)):
        problems.append(f"broadcast gave {y}")
    dist.barrier(group=g)
    if world_size > 1:
        got = np.zeros(2)
        if rank % 2 == 0 and rank + 1 < world_size:
            dist.send(np.full(2, rank + 0.5), dst=rank + 1, group=g)
        elif rank % 2 == 1:
            if dist.recv(got, src=rank - 1, group=g) != rank - 1 or not np.array_equal(got, np.full(2, rank - 0.5)):
                problems.append(f"recv gave {got}")
    alone = [dist.new_group([r], timeout=timedelta(seconds=0.3)) for r in range(world_size)][rank]
    backend_of(alone).c_spins = -2
    start = time.monotonic()
    try:
        dist.recv(np.zeros(1), group=alone)  # any source, in a group of one, and nobody sends
        problems.append("the receive returned")
    except dist.DistBackendError:
        took = time.monotonic() - start
        if not 0.25 <= took < 3:
            problems.append(f"the receive timed out after {took:.2f} s, its timeout is 0.3 s")
    fail_together(problems)
