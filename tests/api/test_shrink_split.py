"""split_group and shrink_group (torch 2.13's signatures) on healthy groups, on any MPI library.

Shrinking after a member died needs ULFM: tests/cluster/test_ulfm.py kills ranks under Open MPI's
``mpirun --with-ft ulfm``.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

import mpidist as dist

from helpers import fail_together

pytestmark = pytest.mark.timeout(120)


def _sum_of(pg: dist.ProcessGroup, rank: int) -> float:
    x = np.array([float(rank + 1)])
    dist.all_reduce(x, group=pg)
    return float(x[0])


def test_split_group_gives_each_rank_its_split(rank, world_size):
    problems: list[str] = []
    half = (world_size + 1) // 2
    splits = [list(range(half)), list(range(half, world_size))] if world_size > 1 else [[0]]
    pg = dist.split_group(split_ranks=[s for s in splits if s])
    mine = next(s for s in splits if rank in s)
    if not isinstance(pg, dist.ProcessGroup) or dist.get_process_group_ranks(pg) != mine:
        problems.append(f"got {pg!r}, expected a group of {mine}")
    elif _sum_of(pg, rank) != sum(r + 1 for r in mine):
        problems.append("all_reduce on the split gave another sum")
    elif pg.rank() != mine.index(rank) or dist.get_backend(pg) != dist.get_backend():
        problems.append(f"rank {pg.rank()} / backend {dist.get_backend(pg)} on the split")
    fail_together(problems)


def test_split_group_ranks_are_the_parents_and_a_rank_in_no_split_gets_none(rank, world_size):
    """Group ranks of the parent, each split sorted; ranks in no split get None (torch), not NON_GROUP_MEMBER."""
    problems: list[str] = []
    parent = dist.new_group(list(reversed(range(world_size))), sort_ranks=False)  # group rank i is world rank n-1-i
    pg = dist.split_group(parent, [[1, 0]] if world_size > 1 else [[0]], timeout=timedelta(seconds=30))
    members = [world_size - 1, world_size - 2] if world_size > 1 else [0]
    if rank in members:
        if pg is None or dist.get_process_group_ranks(pg) != members:
            problems.append(f"got {pg!r}, expected the global ranks {members}")
        elif _sum_of(pg, rank) != sum(r + 1 for r in members):
            problems.append("all_reduce on the split gave another sum")
        elif pg.timeout != timedelta(seconds=30):
            problems.append(f"timeout {pg.timeout}")
    elif pg is not None:
        problems.append(f"a rank in no split got {pg!r}")
    dist.destroy_process_group(parent)
    fail_together(problems)


@pytest.mark.parametrize(
    "split_ranks, error, words",
    [
        (None, ValueError, "non-empty list"),
        ([], ValueError, "non-empty list"),
        ("01", TypeError, "list of lists"),
        ([[0, 0]], ValueError, "more than once"),
        ([[0], [0]], ValueError, "must not overlap"),
        ([[99]], ValueError, "outside"),
        ([[]], ValueError, "is empty"),
        ([["a"]], TypeError, "split_ranks[0]"),
    ],
)
def test_split_group_refuses_bad_split_ranks_on_every_rank(split_ranks, error, words):
    with pytest.raises(error, match=r"^split_group: ") as info:
        dist.split_group(split_ranks=split_ranks)
    assert words in str(info.value)


def test_shrink_group_of_a_healthy_group_leaves_the_excluded_rank_out(rank, world_size):
    """Only the remaining ranks call it (torch); the old group is destroyed on them."""
    if world_size < 2:
        pytest.skip("shrinking needs two ranks")
    problems: list[str] = []
    g = dist.new_group()
    gone = world_size - 1
    if rank != gone:
        try:
            new = dist.shrink_group([gone], g)
            members = list(range(world_size - 1))
            if dist.get_process_group_ranks(new) != members or new.rank() != rank:
                problems.append(f"shrunk group {dist.get_process_group_ranks(new)}, rank {new.rank()}")
            elif _sum_of(new, rank) != sum(r + 1 for r in members):
                problems.append("all_reduce on the shrunk group gave another sum")
            if not g.destroyed:
                problems.append("the old group is not destroyed")
            dist.destroy_process_group(new)
        except Exception as exc:  # noqa: BLE001 - reported by every rank together below
            problems.append(f"{type(exc).__name__}: {exc}")
    else:
        dist.destroy_process_group(g)  # the excluded rank: it left (its peers do not answer: a few seconds)
    fail_together(problems)


def test_shrink_group_of_the_default_group_replaces_the_world(rank, world_size):
    """The survivors' world renumbers; collectives without a group, new groups and the store follow."""
    if world_size < 2:
        pytest.skip("shrinking needs two ranks")
    problems: list[str] = []
    side = dist.new_group()
    gone = 0  # the store's host leaves: the survivors need a store of their own

    def survive() -> None:
        new = dist.shrink_group([gone])
        n = world_size - 1
        if new is not dist.group.WORLD or dist.get_world_size() != n or dist.get_rank() != rank - 1:
            problems.append(f"world {dist.get_rank()} of {dist.get_world_size()}")
        x = np.array([1.0])
        dist.all_reduce(x)  # no group: the new default group
        if x[0] != n:
            problems.append(f"all_reduce over the new world: {x[0]}")
        if not side.destroyed:
            problems.append("the other group survived the default group's shrink")
        ends = sorted({0, n - 1})
        pair = dist.new_group(ends)  # global ranks of the new world
        if dist.get_rank() in ends and dist.get_process_group_ranks(pair) != ends:
            problems.append(f"a new group in the new world: {dist.get_process_group_ranks(pair)}")
        store = dist.get_default_store()
        store.add("arrived", 1)
        dist.barrier()
        if store.add("arrived", 0) != n:
            problems.append("the new store did not count every survivor")

    if rank != gone:
        try:
            survive()
        except Exception as exc:  # noqa: BLE001 - reported by every rank together below
            problems.append(f"{type(exc).__name__}: {exc}")
    dist.destroy_process_group()  # on rank 0, the old world: its peers do not answer (a few seconds)
    fail_together(problems)  # then the harness makes a world of every rank again


@pytest.mark.parametrize(
    "args, error, words",
    [
        (("1",), TypeError, "must be a list"),
        (([],), ValueError, "must not be empty"),
        (([99],), ValueError, "outside group"),
        (([1, 1],), ValueError, "more than once"),
        (([1], None, 7), ValueError, "shrink_flags"),
    ],
)
def test_shrink_group_refuses_bad_arguments(args, error, words, world_size):
    if world_size < 2 and error is ValueError and words != "shrink_flags":
        args = ([0],) + args[1:] if words == "must not be empty" else args
    with pytest.raises((error, ValueError), match=r"^shrink_group: ") as info:
        dist.shrink_group(*args)
    assert words in str(info.value) or (world_size < 2 and "at least 2" in str(info.value))


def test_shrink_group_refuses_this_ranks_own_exclusion_and_every_rank(rank, world_size):
    if world_size < 2:
        with pytest.raises(ValueError, match="a group to shrink has at least 2"):
            dist.shrink_group([0])
        return
    with pytest.raises(RuntimeError, match=r"this rank .* is in ranks_to_exclude; only the remaining ranks call"):
        dist.shrink_group([rank])
    with pytest.raises(ValueError, match="names all"):
        dist.shrink_group(list(range(world_size)))


def test_shrink_group_after_a_timeout_without_ulfm_names_what_it_needs(rank, world_size):
    """A group with a call that timed out (a member may be dead): without ULFM, a clear error, not a hang."""
    if world_size < 2:
        pytest.skip("needs a rank that stays away")
    from mpidist.backends import ulfm

    if ulfm.enabled():
        pytest.skip("this MPI library has ULFM")
    g = dist.new_group(timeout=timedelta(seconds=2))
    problems: list[str] = []
    if rank == 0:  # the others stay away: rank 0's call times out
        try:
            dist.all_reduce(np.ones(2), group=g)
            problems.append("the all_reduce without the other ranks did not time out")
        except dist.DistBackendError:
            pass
        try:
            dist.shrink_group([1], g)
            problems.append("shrink_group went ahead on a group with a timed-out call")
        except dist.DistBackendError as exc:
            if "needs an MPI library with User-Level Failure Mitigation" not in str(exc) or "--with-ft ulfm" not in str(exc):
                problems.append(f"the error does not say what is needed: {exc}")
    fail_together(problems)
    dist.destroy_process_group(g)
