"""The node-leader path of a group that spans nodes (backends/node_leaders.py), on one machine.

Each rank's node key is patched (even ranks on one "node", odd ranks on another), so that a
group of 3 or 4 ranks spans two nodes with two ranks on at least one. all_reduce must then be
right on every call, blocking and async, several in flight and waited for in any order, during
the measuring and after it, for every dtype and op MPI reduces; the ranks must agree on one
choice whatever their clocks say; MPIDIST_SHM_THRESHOLDS fixes the path, MPIDIST_SHM_LEADERS=0
turns it off; the other collectives keep MPI's call; a rank that stays away gives the group's
timeout. tests/cluster/test_hosts.py runs it across simulated hosts with shaped links.
"""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
from mpi4py import MPI
from test_shm_choice import _expect_rank_1_timeout

import mpidist as dist
from mpidist.backends import node_leaders, shm, shm_choice
from mpidist.bench.tune import group_under
from mpidist.testing import backend_of

from helpers import Checks, fail_together, inputs_of, meet_outside_mpidist, rank_input, reference

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
#: float32 elements of the arrays: 64 KiB, one size class
N = (64 << 10) // 4
#: the calls of one class before the agreed choice is applied
MEASURED = shm_choice.CHOSEN_AT

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def two_nodes(monkeypatch):
    """Even ranks on one node, odd ranks on another (for the groups set up in the test)."""
    monkeypatch.setattr(shm, "_node_key", lambda: 1000 + RANK % 2)


def _leaders(g) -> node_leaders.NodeLeaders | None:
    path = backend_of(g).shared_memory()
    return path if isinstance(path, node_leaders.NodeLeaders) else None


def _issued(g) -> int:
    path = _leaders(g)
    return -1 if path is None else path.issued


def _sum_checked(c: Checks, g) -> None:
    """One all_reduce of 64 KiB on ``g``, its result checked."""
    x = np.full(N, RANK + 1, np.float32)
    dist.all_reduce(x, group=g)
    c.true(f"all_reduce gave {x[:3]}", (x == SIZE * (SIZE + 1) / 2).all())


def test_nodes_of_numbers_each_node_by_its_lowest_rank():
    assert node_leaders.nodes_of([5, 5, 5]) == [0, 0, 0]
    assert node_leaders.nodes_of([3, 9, 3, 7, 9]) == [0, 1, 0, 3, 1]


@pytest.mark.mpi(min_size=1)
def test_the_path_exists_only_where_a_node_holds_two_ranks(two_nodes):
    """3 or more ranks over the two nodes: the node-leader path, with the right node and leaders' communicators;
    1 or 2 ranks (no node with two of them): no path at all, and every call is right."""
    g = group_under(dist, {})
    c = Checks()
    path = _leaders(g)
    if SIZE < 3:
        c.true(f"{SIZE} rank(s): the group has a path", backend_of(g).shared_memory() is None)
    else:
        c.true("no node-leader path", path is not None)
        if path is not None:
            c.equal("the node's ranks", path.node.Get_size(), len(range(RANK % 2, SIZE, 2)))
            c.equal("this rank's place on its node", path.node.Get_rank(), RANK // 2)
            c.equal("leader", path.leaders is not None, RANK < 2)
            if path.leaders is not None:
                c.equal("the leaders", path.leaders.Get_size(), 2)
            c.equal("device arrays are not staged for it", backend_of(g).shared_memory_from(), 1 << 62)
    _sum_checked(c, g)
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=3)
def test_fixed_all_reduce_takes_the_path_for_every_dtype_and_op(two_nodes):
    """MPIDIST_SHM_THRESHOLDS=all_reduce=16K: every all_reduce from 16 KiB takes the path where MPI has the reduction
    (not float MAX: mpidist's own, which propagates NaN), for sizes that split unevenly; below, and the other
    collectives, MPI's call."""
    g = group_under(dist, {"MPIDIST_SHM_THRESHOLDS": "all_reduce=16K"})
    c = Checks()
    R = dist.ReduceOp
    cases = [(np.float32, R.SUM), (np.float64, R.MAX), (np.int32, R.MIN), (np.int64, R.PRODUCT), (np.uint8, R.BXOR),
             (np.complex64, R.SUM), (np.int16, R.BAND)]  # fmt: skip
    for dtype, op in cases:
        for count in (5000, 40_001):
            x = rank_input(RANK, (count,), np.dtype(dtype))
            before = _issued(g)
            dist.all_reduce(x, op=op, group=g)
            want = reference(inputs_of(SIZE, (count,), dtype), op)
            c.equal(f"all_reduce {np.dtype(dtype).name} {op} of {count}", x, want)
            took = _issued(g) - before
            mpi_has_it = backend_of(g)._types[np.dtype(dtype)].fast[op] is not None  # float MIN/MAX: mpidist's own
            c.equal(f"{np.dtype(dtype).name} {count}: calls on the path", took, int(x.nbytes >= 16 << 10 and mpi_has_it))
    before = _issued(g)
    x = np.full(N, RANK, np.float32)
    dist.broadcast(x, src=SIZE - 1, group=g)
    c.true(f"broadcast gave {x[:3]}", (x == SIZE - 1).all())
    x = np.full(N, RANK + 1, np.float32)
    dist.reduce(x, dst=0, group=g)
    c.true(f"reduce gave {x[:3]}", RANK != 0 or (x == SIZE * (SIZE + 1) / 2).all())
    x = np.full(N, RANK + 1, np.float32)
    dist.all_reduce(x, op=R.AVG, group=g)  # an op MPI has no reduction for: MPI's path computes it
    c.true(f"AVG gave {x[:3]}", np.allclose(x, (SIZE + 1) / 2))
    c.equal("other calls on the path", _issued(g) - before, 0)
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=3)
def test_async_calls_in_flight_complete_in_any_order(two_nodes):
    """Eight async all_reduces issued back to back, then waited for last first (or tested only): each result right;
    the steps of every call are posted in the same order on every rank (else MPI would mismatch them)."""
    g = group_under(dist, {"MPIDIST_SHM_THRESHOLDS": "all_reduce=16K"})
    c = Checks()
    for reverse in (True, False):
        xs = [np.full(N + k, RANK + k, np.float32) for k in range(8)]
        works = [dist.all_reduce(x, group=g, async_op=True) for x in xs]
        if reverse:
            for w in reversed(works):
                w.wait()
        else:
            deadline = time.monotonic() + 30
            while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
                time.sleep(0)
        for k, x in enumerate(xs):
            want = sum(r + k for r in range(SIZE))
            c.true(f"call {k} ({'waited last first' if reverse else 'tested'}) gave {x[:2]}", (x == want).all())
    c.equal("calls on the path", _issued(g), 16)
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=3)
def test_ranks_whose_timings_disagree_take_the_same_path(two_nodes, monkeypatch, caplog):
    """The measured choice: rank 0's clock says MPI wins, the others' that node leaders do: every rank takes the
    same path (node leaders, the slowest rank's medians), logged at INFO; results right throughout, and the calls
    after the choice take the path."""
    monkeypatch.setattr(shm_choice, "skew", (1.0, 3.0) if RANK == 0 else (1e4, 1.0))
    caplog.set_level(logging.INFO, logger="mpidist")
    g = group_under(dist, {})
    c = Checks()
    for k in range(MEASURED + 4):
        x = np.full(N, RANK + 1, np.float32)
        w = dist.all_reduce(x, group=g, async_op=bool(k % 3 == 1))
        w and w.wait()
        c.true(f"call {k} gave {x[:3]}", (x == SIZE * (SIZE + 1) / 2).all())
    choices = [way for fn, _, _, way in backend_of(g).shared_memory_choices() if fn == "all_reduce"]
    c.equal("the choice", choices, ["node leaders"])
    before = _issued(g)
    for _ in range(3):
        dist.all_reduce(np.ones(N, np.float32), group=g)
    c.equal("calls on the path after the choice", _issued(g) - before, 3)
    logged = [m for m in caplog.messages if re.search(r"all_reduce float32 sum, 64 KiB-128 KiB.*: node leaders", m)]
    c.equal("INFO lines of the choice", len(logged), 1)
    c.true(f"the log has no timings of both ways: {logged}", bool(logged) and "node leaders " in logged[0])
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("env", [{"MPIDIST_SHM_LEADERS": "0"}, {"MPIDIST_SHM": "0"}])
def test_switched_off_on_one_rank_keeps_mpi_calls(two_nodes, env):
    """One rank (the last) refuses the path: no rank sets it up, and all_reduce is right."""
    g = group_under(dist, env if RANK == SIZE - 1 else {})
    c = Checks()
    c.true("a path was set up", backend_of(g).shared_memory() is None)
    _sum_checked(c, g)
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=3)
def test_a_rank_that_stays_away_gives_the_timeout(two_nodes):
    """Rank 1 (a leader) skips an all_reduce on the path: every other rank raises the group's timeout naming it."""
    g = group_under(dist, {"MPIDIST_SHM_THRESHOLDS": "all_reduce=16K"}, timeout=1.0)
    x = np.ones(N, np.float32)
    dist.all_reduce(x, group=g)
    problems: list[str] = []
    if RANK != 1:
        _expect_rank_1_timeout(problems, g, lambda: dist.all_reduce(x, group=g), "all_reduce with rank 1 away")
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=3)
def test_a_rank_blocked_in_another_call_advances_its_async_operation(two_nodes):
    """A leader blocked in a barrier or a recv, that the others reach only after the async all_reduce on the path
    completes, must post its steps meanwhile (the others' waits need them)."""
    from test_shm import blocked_elsewhere

    g = group_under(dist, {"MPIDIST_SHM_THRESHOLDS": "all_reduce=16K"}, timeout=10.0)
    problems = blocked_elsewhere(g, "node leaders")
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)
