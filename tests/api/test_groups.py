"""Process groups: new_group, new_subgroups, rank translation, non-members, collectives on subgroups."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist

from helpers import assert_equal, fail_together, rank_input

NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


def world_ranks_of(pg: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``pg``'s members, asked from MPI itself (not from mpidist)."""
    comm = pg.mpi_comm
    g, w = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(g, list(range(comm.Get_size())), w))
    finally:
        g.Free()
        w.Free()


def check_member(pg, members: list[int], rank: int) -> None:
    """Every query about ``pg`` on a member agrees with ``members`` (sorted global ranks)."""
    assert isinstance(pg, dist.ProcessGroup)
    me = members.index(rank)
    assert pg.rank() == me and dist.get_rank(pg) == me
    assert pg.size() == len(members) and dist.get_world_size(pg) == len(members)
    assert list(pg.ranks) == members
    assert dist.get_process_group_ranks(pg) == members
    for i, r in enumerate(members):
        assert dist.get_group_rank(pg, r) == i
        assert dist.get_global_rank(pg, i) == r
    assert pg.mpi_comm.Get_rank() == me and pg.mpi_comm.Get_size() == len(members)
    assert world_ranks_of(pg) == members
    assert dist.get_backend(pg) == "mpi"


def check_non_member(pg) -> None:
    assert pg is NON_MEMBER
    assert dist.get_rank(pg) == -1
    assert dist.get_world_size(pg) == -1


def outcome(fn) -> BaseException | None:
    """Run ``fn``; return the exception it raised, or None (to check after the collectives)."""
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def group_sum(members: list[int], shape, dtype, salt: int = 0) -> np.ndarray:
    return np.sum([rank_input(r, shape, np.dtype(dtype), salt) for r in members], axis=0).astype(dtype)


# ---------------------------------------------------------------------------------------------
# new_group
# ---------------------------------------------------------------------------------------------


def test_new_group_of_all_ranks(rank, world_size):
    g = dist.new_group()
    x = rank_input(rank, (4,), np.dtype(np.int64))
    dist.all_reduce(x, group=g)
    assert_equal(x, group_sum(list(range(world_size)), (4,), np.int64))
    check_member(g, list(range(world_size)), rank)
    assert g is not dist.group.WORLD


@pytest.mark.parametrize("ranks", ["range", "tuple", "set", "numpy_ints"])
def test_new_group_accepts_sequences_of_ranks(ranks, rank, world_size):
    given = {
        "range": range(world_size),
        "tuple": tuple(reversed(range(world_size))),
        "set": set(range(world_size)),
        "numpy_ints": [np.int64(r) for r in range(world_size)],
    }[ranks]
    g = dist.new_group(given)
    check_member(g, list(range(world_size)), rank)


@pytest.mark.mpi(min_size=2)
def test_new_group_of_odd_ranks(rank, world_size):
    odd = list(range(1, world_size, 2))
    g = dist.new_group(odd)
    if rank % 2 == 0:
        check_non_member(g)
        return
    x = np.array([rank, 1], np.int64)
    dist.all_reduce(x, group=g)
    assert_equal(x, np.array([sum(odd), len(odd)], np.int64))
    check_member(g, odd, rank)


def test_new_group_singleton_per_rank(rank, world_size):
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates all of them, in order
    for r, g in enumerate(groups):
        if r == rank:
            check_member(g, [rank], rank)
        else:
            check_non_member(g)
    mine = groups[rank]
    x = rank_input(rank, (3,), np.dtype(np.float64))
    dist.all_reduce(x, group=mine, op=dist.ReduceOp.PRODUCT)
    assert_equal(x, rank_input(rank, (3,), np.dtype(np.float64)))
    y = np.array([rank], np.int32)
    dist.broadcast(y, src=rank, group=mine)
    assert_equal(y, np.array([rank], np.int32))


@pytest.mark.mpi(min_size=3)
def test_overlapping_groups(rank, world_size):
    """Pairs [0, 1], [1, 2], ...: every inner rank belongs to two groups."""
    pairs = [[i, i + 1] for i in range(world_size - 1)]
    groups = [dist.new_group(p) for p in pairs]
    results = []
    for i, g in enumerate(groups):  # in creation order: deadlock-free along the chain
        x = np.array([rank, 10 * i], np.int64)
        results.append((dist.all_reduce(x, group=g), x))
    for i, (p, g) in enumerate(zip(pairs, groups)):
        ret, x = results[i]
        assert ret is None
        if rank in p:
            check_member(g, p, rank)
            assert_equal(x, np.array([sum(p), 20 * i], np.int64))
        else:
            check_non_member(g)
            assert_equal(x, np.array([rank, 10 * i], np.int64))  # untouched on non-members


@pytest.mark.mpi(min_size=3)
def test_new_group_unsorted_ranks_give_sorted_group_ranks(rank, world_size):
    given = [world_size - 1, 0, 1]
    members = sorted(given)
    g = dist.new_group(given)
    if rank not in members:
        check_non_member(g)
        return
    x = np.zeros(len(members), np.int64)
    dist.all_gather_into_tensor(x, np.array([rank], np.int64), group=g)
    assert_equal(x, np.array(members, np.int64))  # gathered in group-rank order == sorted global order
    check_member(g, members, rank)


def unsorted_order(order: str, n: int) -> list[int]:
    return {
        "reversed": list(range(n))[::-1],
        "rotated": list(range(1, n)) + [0],
        "last_then_first": [n - 1, 0],
    }[order]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("order", ["reversed", "rotated", "last_then_first"])
def test_new_group_sort_ranks_false_keeps_the_order_given(order, rank, world_size):
    """torch's sort_ranks=False: group rank i is ranks[i], and collectives follow that order."""
    given = unsorted_order(order, world_size)
    m = len(given)
    g = dist.new_group(given, sort_ranks=False)
    listed = [np.full(2, -1, np.int64) for _ in given]
    flat = np.full(m, -1, np.int64)
    dist.all_gather(listed, np.array([rank, 7], np.int64), group=g)
    dist.all_gather_into_tensor(flat, np.array([rank], np.int64), group=g)
    sources = []
    for group_src in range(m):
        x = np.array([rank], np.int64)
        dist.broadcast(x, group=g, group_src=group_src)
        sources.append(int(x[0]))
    at_dst = [np.full(1, -1, np.int64) for _ in given] if rank == given[0] else None
    dist.gather(np.array([rank], np.int64), at_dst, group=g, group_dst=0)
    if rank not in given:
        check_non_member(g)
        assert_equal(flat, np.full(m, -1, np.int64))
        return
    check_member(g, given, rank)  # pg.ranks, get_group_rank/get_global_rank and MPI's own rank order
    assert_equal(np.stack(listed), np.array([[r, 7] for r in given], np.int64))
    assert_equal(flat, np.array(given, np.int64))
    assert sources == given
    if at_dst is not None:
        assert_equal(np.concatenate(at_dst), np.array(given, np.int64))


@pytest.mark.mpi(min_size=2)
def test_new_group_sort_ranks_false_with_local_synchronization(rank, world_size):
    """Only the members call; their communicator still has the order given."""
    evens, odds = list(range(0, world_size, 2))[::-1], list(range(1, world_size, 2))[::-1]
    mine = evens if rank % 2 == 0 else odds
    g = dist.new_group(mine, use_local_synchronization=True, sort_ranks=False)
    y = np.zeros(len(mine), np.int64)
    dist.all_gather_into_tensor(y, np.array([rank], np.int64), group=g)
    x = np.array([rank], np.int64)
    dist.broadcast(x, group=g, group_src=0)
    assert_equal(y, np.array(mine, np.int64))
    assert_equal(x, np.array([mine[0]], np.int64))
    check_member(g, mine, rank)


@pytest.mark.parametrize(
    "ranks, flag, expect",
    [
        ("reversed", None, "sorted"),
        ("reversed", True, "sorted"),
        ("reversed", np.True_, "sorted"),
        ("reversed", np.False_, "given"),
        ("reversed", 0, "given"),
        (None, False, "sorted"),
    ],
    ids=["default", "True", "numpy_True", "numpy_False", "int_0", "all_ranks_False"],
)
def test_new_group_sort_ranks_values(ranks, flag, expect, rank, world_size):
    """The default (and any true value) sorts as before; ranks=None is the world in order either way."""
    given = None if ranks is None else list(range(world_size))[::-1]
    kwargs = {} if flag is None else {"sort_ranks": flag}
    g = dist.new_group(given, **kwargs)
    x = np.zeros(world_size, np.int64)
    dist.all_gather_into_tensor(x, np.array([rank], np.int64), group=g)
    members = given if expect == "given" else list(range(world_size))
    assert_equal(x, np.array(members, np.int64))
    check_member(g, members, rank)


@pytest.mark.parametrize("local", [False, True], ids=["collective", "local"])
@pytest.mark.parametrize(
    "bad", ["no", None, 1.5, [False], np.array([True, False])], ids=["str", "None", "float", "list", "array"]
)
def test_new_group_sort_ranks_of_wrong_type_raises_type_error(bad, local, rank, world_size):
    count = dist.get_pg_count()
    with pytest.raises(TypeError, match=r"^new_group: sort_ranks must be a bool, got "):
        dist.new_group(list(range(world_size)), sort_ranks=bad, use_local_synchronization=local)
    assert dist.get_pg_count() == count
    g = dist.new_group()  # nothing was posted: the next group still lines up
    x = np.ones(1, np.int64)
    dist.all_reduce(x, group=g)
    assert_equal(x, np.array([world_size], np.int64))


@pytest.mark.parametrize("ranks", [[0, 0], [0, 1, 0]], ids=["0,0", "0,1,0"])
def test_new_group_duplicate_ranks_raise(ranks, rank, world_size):
    ranks = [min(r, world_size - 1) for r in ranks]
    count = dist.get_pg_count()
    with pytest.raises(ValueError, match="more than once"):
        dist.new_group(ranks)
    assert dist.get_pg_count() == count


@pytest.mark.parametrize("bad", ["size", "negative", "mixed"])
def test_new_group_out_of_range_raises(bad, rank, world_size):
    ranks = {"size": [world_size], "negative": [-1], "mixed": [0, world_size + 5]}[bad]
    with pytest.raises(ValueError):
        dist.new_group(ranks)
    with pytest.raises(ValueError):
        dist.new_group(ranks, use_local_synchronization=True)
    # the world is intact and new groups still line up afterwards
    g = dist.new_group()
    x = np.ones(1, np.int64)
    dist.all_reduce(x, group=g)
    assert_equal(x, np.array([world_size], np.int64))


@pytest.mark.parametrize("bad", ["0", 0, [0.0], [None]], ids=["str", "int", "float", "None"])
def test_new_group_ranks_of_wrong_type_raise_type_error(bad, rank):
    with pytest.raises(TypeError):
        dist.new_group(bad)


@pytest.mark.mpi(min_size=2)
def test_use_local_synchronization_only_members_call(rank, world_size):
    """Even and odd ranks create their own groups at the same time; nobody calls for the other."""
    evens, odds = list(range(0, world_size, 2)), list(range(1, world_size, 2))
    mine = evens if rank % 2 == 0 else odds
    g = dist.new_group(mine, use_local_synchronization=True)
    x = np.array([rank, 1], np.int64)
    dist.all_reduce(x, group=g)
    y = np.zeros(len(mine), np.int64)
    dist.all_gather_into_tensor(y, np.array([rank], np.int64), group=g)
    assert_equal(x, np.array([sum(mine), len(mine)], np.int64))
    assert_equal(y, np.array(mine, np.int64))
    check_member(g, mine, rank)


@pytest.mark.mpi(min_size=3)
def test_use_local_synchronization_overlapping_groups(rank, world_size):
    """Pairs [i, i+1] created locally, in chain order: the inner ranks create two."""
    pairs = [[i, i + 1] for i in range(world_size - 1)]
    made = {}
    for i, p in enumerate(pairs):
        if rank in p:
            made[i] = dist.new_group(p, use_local_synchronization=True)
    results = {}
    for i, g in made.items():
        x = np.array([rank + 100 * i], np.int64)
        dist.all_reduce(x, group=g)
        results[i] = x
    assert sorted(made) == [i for i, p in enumerate(pairs) if rank in p]
    for i, g in made.items():
        check_member(g, pairs[i], rank)
        assert_equal(results[i], np.array([sum(pairs[i]) + 200 * i], np.int64))


def test_use_local_synchronization_non_member_gets_non_group_member(rank, world_size):
    """Called by a non-member it returns NON_GROUP_MEMBER without communicating."""
    others = [r for r in range(world_size) if r != rank]
    if not others:
        pytest.skip("needs another rank")
    # each rank asks for a group it is not in; no one else calls, so this must not block
    for r in others:
        assert dist.new_group([r], use_local_synchronization=True) is NON_MEMBER


def test_local_groups_with_the_same_ranks_are_distinct(rank, world_size):
    """Two groups of the same ranks created with use_local_synchronization are two live groups."""
    members = list(range(world_size))
    count = dist.get_pg_count()
    a = dist.new_group(members, use_local_synchronization=True)
    b = dist.new_group(members, use_local_synchronization=True)
    with_both = dist.get_pg_count()
    dist.destroy_process_group(a)
    with_b = dist.get_pg_count()
    x = np.ones(1, np.int64)
    dist.all_reduce(x, group=b)
    dist.destroy_process_group(b)
    assert a is not b
    assert_equal(x, np.array([world_size], np.int64))
    assert (with_both, with_b, dist.get_pg_count()) == (count + 2, count + 1, count)


# ---------------------------------------------------------------------------------------------
# rank translation and non-members
# ---------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_rank_translation_errors(rank, world_size):
    members = list(range(1, world_size))
    g = dist.new_group(members)
    if rank == 0:
        check_non_member(g)
        for call, arg in ((dist.get_group_rank, 1), (dist.get_global_rank, 0)):
            with pytest.raises(ValueError):
                call(g, arg)
        with pytest.raises(ValueError):
            dist.get_process_group_ranks(g)
        return
    with pytest.raises(dist.RankNotInGroupError) as info:
        dist.get_group_rank(g, 0)  # global rank 0 is not a member
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    for bad in (len(members), -1, world_size + 3):
        with pytest.raises(dist.RankNotInGroupError) as info:
            dist.get_global_rank(g, bad)
        assert isinstance(info.value, RuntimeError)
    for bad in (world_size, -1):
        with pytest.raises(RuntimeError):
            dist.get_group_rank(g, bad)
    with pytest.raises(TypeError):
        dist.get_group_rank(g, "1")
    with pytest.raises(TypeError):
        dist.get_global_rank(g, 0.0)


def test_rank_not_in_group_error_is_value_and_runtime_error():
    assert issubclass(dist.RankNotInGroupError, ValueError)
    assert issubclass(dist.RankNotInGroupError, RuntimeError)


def test_translation_on_the_default_group_is_identity(rank, world_size):
    for grp in (None, dist.group.WORLD, dist.GroupMember.WORLD):
        assert dist.get_process_group_ranks(grp) == list(range(world_size))
        for r in range(world_size):
            assert dist.get_group_rank(grp, r) == r
            assert dist.get_global_rank(grp, r) == r
    with pytest.raises(dist.RankNotInGroupError):
        dist.get_group_rank(None, world_size)
    with pytest.raises(dist.RankNotInGroupError):
        dist.get_global_rank(None, world_size)


def test_world_is_the_default_group(rank, world_size):
    w = dist.group.WORLD
    assert isinstance(w, dist.ProcessGroup)
    assert w is dist.GroupMember.WORLD
    assert dist.get_rank(w) == dist.get_rank() == rank == w.rank()
    assert dist.get_world_size(w) == world_size == w.size()
    assert list(w.ranks) == list(range(world_size))
    assert MPI.Comm.Compare(w.mpi_comm, MPI.COMM_WORLD) == MPI.CONGRUENT  # a private duplicate
    x = np.array([1], np.int64)
    dist.all_reduce(x, group=w)
    assert_equal(x, np.array([world_size], np.int64))


def test_non_group_member_sentinel(rank, world_size):
    assert dist.GroupMember.NON_GROUP_MEMBER is NON_MEMBER
    assert not isinstance(NON_MEMBER, dist.ProcessGroup)
    others = [r for r in range(world_size) if r != rank]
    groups = [dist.new_group([r]) for r in range(world_size)]
    for r in others:
        assert groups[r] is dist.GroupMember.NON_GROUP_MEMBER


@pytest.mark.mpi(min_size=2)
def test_get_rank_and_world_size_of_non_members(rank, world_size):
    g = dist.new_group([world_size - 1])
    if rank == world_size - 1:
        assert dist.get_rank(g) == 0 and dist.get_world_size(g) == 1
    else:
        assert dist.get_rank(g) == -1 and dist.get_world_size(g) == -1
        assert dist.get_rank(NON_MEMBER) == -1 and dist.get_world_size(NON_MEMBER) == -1


def test_get_backend_of_non_member_raises(rank, world_size):
    with pytest.raises(ValueError):
        dist.get_backend(NON_MEMBER)
    assert dist.get_backend() == "mpi"


def test_new_group_timeout(rank, world_size):
    """A group's timeout bounds its blocking calls; the default is the world's timeout."""
    assert dist.new_group().timeout == dist.group.WORLD.timeout
    groups = [dist.new_group([r], timeout=timedelta(seconds=0.3)) for r in range(world_size)]
    g = groups[rank]
    assert g.timeout == timedelta(seconds=0.3)
    x = np.zeros(1)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError):
        dist.recv(x, group=g)  # any source, in a group of one, and nobody sends
    assert 0.25 <= time.monotonic() - start < 30
    # the receive that timed out left nothing posted: a message sent now goes to the next receive
    s = dist.isend(np.full(1, 5.0), dst=rank, group=g)
    z = np.zeros(1)
    dist.irecv(z, src=rank, group=g).wait()
    s.wait()
    assert_equal(z, np.full(1, 5.0))
    assert_equal(x, np.zeros(1))
    y = np.ones(1)
    dist.all_reduce(y)  # the world is unaffected
    assert_equal(y, np.full(1, float(world_size)))


def test_collectives_on_non_members_return_none_and_do_nothing(rank, world_size):
    g = NON_MEMBER
    x = np.arange(4, dtype=np.float64) + rank
    before = x.copy()
    out = np.full(4 * world_size, -1.0)
    lst = [np.full(4, -1.0) for _ in range(world_size)]
    calls = [
        lambda: dist.all_reduce(x, group=g),
        lambda: dist.all_reduce(x, group=g, async_op=True),
        lambda: dist.broadcast(x, src=0, group=g),
        lambda: dist.reduce(x, dst=0, group=g),
        lambda: dist.all_gather(lst, x, group=g),
        lambda: dist.all_gather_into_tensor(out, x, group=g),
        lambda: dist.gather(x, lst, dst=0, group=g),
        lambda: dist.scatter(x, lst, src=0, group=g),
        lambda: dist.reduce_scatter_tensor(x, out, group=g),
        lambda: dist.all_to_all_single(out, out.copy(), group=g),
        lambda: dist.barrier(group=g),
    ]
    for call in calls:
        assert call() is None
    assert_equal(x, before)
    assert_equal(out, np.full(4 * world_size, -1.0))
    for a in lst:
        assert_equal(a, np.full(4, -1.0))


@pytest.mark.mpi(min_size=2)
def test_collectives_on_a_real_subgroup_leave_non_members_alone(rank, world_size):
    members = list(range(1, world_size))
    g = dist.new_group(members)
    x = np.array([rank + 1], np.int64)
    ret = dist.all_reduce(x, group=g)
    assert ret is None
    if rank == 0:
        assert_equal(x, np.array([1], np.int64))
    else:
        assert_equal(x, np.array([sum(r + 1 for r in members)], np.int64))


def test_process_group_properties(rank, world_size):
    members = list(range(0, world_size, 2))
    g = dist.new_group(members)
    if rank not in members:
        check_non_member(g)
        return
    check_member(g, members, rank)
    assert g.name() == "mpi"
    comm = g.mpi_comm
    assert isinstance(comm, MPI.Comm)
    assert comm != MPI.COMM_NULL
    assert MPI.Comm.Compare(comm, MPI.COMM_WORLD) != MPI.IDENT
    assert isinstance(repr(g), str)


def test_mpi_comm_is_usable_with_mpi4py(rank, world_size):
    g = dist.new_group()
    total = g.mpi_comm.allreduce(rank)
    assert total == world_size * (world_size - 1) // 2


# ---------------------------------------------------------------------------------------------
# collectives on subgroups
# ---------------------------------------------------------------------------------------------

LAYOUTS = ["all", "tail", "odd", "even", "last", "first_and_last"]


def layout_members(layout: str, n: int) -> list[int]:
    return {
        "all": list(range(n)),
        "tail": list(range(1, n)),
        "odd": list(range(1, n, 2)),
        "even": list(range(0, n, 2)),
        "last": [n - 1],
        "first_and_last": sorted({0, n - 1}),
    }[layout]


@pytest.fixture(params=LAYOUTS)
def subgroup(request, rank, world_size):
    """(group or NON_GROUP_MEMBER, its sorted global ranks); skips where the layout is empty."""
    members = layout_members(request.param, world_size)
    if not members:
        pytest.skip(f"layout {request.param} is empty at world size {world_size}")
    g = dist.new_group(members[::-1])  # given in reverse order; group ranks follow the sorted order
    return g, members


def test_all_reduce_on_subgroup(subgroup, rank):
    g, members = subgroup
    x = rank_input(rank, (2, 3), np.dtype(np.int32))
    y = rank_input(rank, (5,), np.dtype(np.float32), salt=1)
    assert dist.all_reduce(x, group=g) is None
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=g)
    if rank in members:
        assert_equal(x, group_sum(members, (2, 3), np.int32))
        expect = np.max([rank_input(r, (5,), np.dtype(np.float32), 1) for r in members], axis=0)
        assert_equal(y, expect.astype(np.float32))
    else:
        assert_equal(x, rank_input(rank, (2, 3), np.dtype(np.int32)))


def test_broadcast_on_subgroup_src_is_a_global_rank(subgroup, rank):
    g, members = subgroup
    for src in members:
        x = rank_input(rank, (4,), np.dtype(np.int64), salt=src)
        dist.broadcast(x, src=src, group=g)
        if rank in members:
            assert_equal(x, rank_input(src, (4,), np.dtype(np.int64), salt=src))
        else:
            assert_equal(x, rank_input(rank, (4,), np.dtype(np.int64), salt=src))
    for group_src, src in enumerate(members):
        x = rank_input(rank, (3,), np.dtype(np.float64))
        dist.broadcast(x, group=g, group_src=group_src)
        if rank in members:
            assert_equal(x, rank_input(src, (3,), np.dtype(np.float64)))


def test_broadcast_src_outside_subgroup_raises(subgroup, rank, world_size):
    g, members = subgroup
    outside = [r for r in range(world_size) if r not in members]
    if rank not in members or not outside:
        return
    with pytest.raises(dist.RankNotInGroupError):
        dist.broadcast(np.zeros(1), src=outside[0], group=g)
    with pytest.raises(dist.RankNotInGroupError):
        dist.broadcast(np.zeros(1), group=g, group_src=len(members))


def test_all_gather_into_tensor_on_subgroup(subgroup, rank):
    g, members = subgroup
    m = len(members)
    out = np.full(3 * m, -1, np.int16)
    stacked = np.full((m, 3), -1, np.int16)
    dist.all_gather_into_tensor(out, rank_input(rank, (3,), np.dtype(np.int16)), group=g)
    dist.all_gather_into_tensor(stacked, rank_input(rank, (3,), np.dtype(np.int16)), group=g)
    if rank in members:
        expect = np.concatenate([rank_input(r, (3,), np.dtype(np.int16)) for r in members])
        assert_equal(out, expect)
        assert_equal(stacked, expect.reshape(m, 3))
    else:
        assert_equal(out, np.full(3 * m, -1, np.int16))


def test_reduce_scatter_tensor_on_subgroup(subgroup, rank):
    g, members = subgroup
    m = len(members)
    inp = rank_input(rank, (m * 2,), np.dtype(np.int64), salt=3)
    out = np.full(2, -1, np.int64)
    dist.reduce_scatter_tensor(out, inp, group=g)
    if rank in members:
        me = members.index(rank)
        total = group_sum(members, (m * 2,), np.int64, salt=3)
        assert_equal(out, total[2 * me : 2 * me + 2])
    else:
        assert_equal(out, np.full(2, -1, np.int64))


def test_all_to_all_single_on_subgroup(subgroup, rank):
    g, members = subgroup
    m = len(members)
    me = members.index(rank) if rank in members else -1
    # row block j (2 rows of 3) goes to group rank j: value 1000*global + 10*j + column
    inp = np.array([[1000 * rank + 10 * j + c for c in range(3)] for j in range(m) for _ in range(2)], np.int64)
    out = np.full((2 * m, 3), -1, np.int64)
    dist.all_to_all_single(out, inp, group=g)
    if rank in members:
        expect = np.array([[1000 * members[i] + 10 * me + c for c in range(3)] for i in range(m) for _ in range(2)])
        assert_equal(out, expect.astype(np.int64))
    else:
        assert_equal(out, np.full((2 * m, 3), -1, np.int64))


def test_all_to_all_single_uneven_on_subgroup(subgroup, rank):
    """Group rank i sends i+1 rows to every peer: sizes follow group ranks, not global ranks."""
    g, members = subgroup
    if rank not in members:
        return
    m = len(members)
    me = members.index(rank)
    in_splits = [me + 1] * m
    out_splits = [i + 1 for i in range(m)]
    inp = np.repeat(np.arange(m) + 100 * rank, me + 1).astype(np.float64)
    out = np.full(sum(out_splits), -1.0)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=g)
    expect = np.concatenate([np.full(i + 1, 100.0 * members[i] + me) for i in range(m)])
    assert_equal(out, expect)


# ---------------------------------------------------------------------------------------------
# new_subgroups / new_subgroups_by_enumeration
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [1, 2, 3, 4])
def test_new_subgroups(group_size, rank, world_size):
    if world_size % group_size:
        pytest.skip(f"world size {world_size} is not divisible by {group_size}")
    mine, groups = dist.new_subgroups(group_size)
    x = np.array([rank, 1], np.int64)
    dist.all_reduce(x, group=mine)
    block = rank // group_size
    members = list(range(block * group_size, (block + 1) * group_size))
    assert_equal(x, np.array([sum(members), group_size], np.int64))
    check_member(mine, members, rank)
    assert len(groups) == world_size // group_size
    for i, g in enumerate(groups):
        if i == block:
            assert g is mine
        else:
            assert g is NON_MEMBER


@pytest.mark.parametrize("bad", ["not_divisible", "too_big", "zero", "negative"])
def test_new_subgroups_bad_sizes_raise_value_error(bad, rank, world_size):
    size = {
        "not_divisible": next((k for k in range(2, world_size) if world_size % k), world_size + 1),
        "too_big": world_size + 1,
        "zero": 0,
        "negative": -2,
    }[bad]
    count = dist.get_pg_count()
    with pytest.raises(ValueError):
        dist.new_subgroups(size)
    assert dist.get_pg_count() == count


@pytest.mark.parametrize("bad", [1.0, "2", True], ids=["float", "str", "bool"])
def test_new_subgroups_group_size_of_wrong_type(bad):
    with pytest.raises(TypeError):
        dist.new_subgroups(bad)


def test_new_subgroups_default_size_is_ranks_per_node(rank, world_size):
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        per_node = node.Get_size()
    finally:
        node.Free()
    if world_size % per_node:
        with pytest.raises(ValueError):
            dist.new_subgroups()
        return
    mine, groups = dist.new_subgroups()
    assert len(groups) == world_size // per_node
    block = rank // per_node
    check_member(mine, list(range(block * per_node, (block + 1) * per_node)), rank)


def test_new_subgroups_of_a_given_group(rank, world_size):
    parent = dist.new_group()
    mine, groups = dist.new_subgroups(1, group=parent)
    mine2, groups2 = dist.new_subgroups(world_size, group=dist.group.WORLD)
    assert len(groups) == world_size
    check_member(mine, [rank], rank)
    assert groups2 == [mine2]
    check_member(mine2, list(range(world_size)), rank)


@pytest.mark.mpi(min_size=2)
def test_new_subgroups_by_enumeration(rank, world_size):
    lists = [list(range(0, world_size, 2)), list(range(1, world_size, 2))]
    mine, groups = dist.new_subgroups_by_enumeration(lists)
    x = np.array([rank], np.int64)
    dist.all_reduce(x, group=mine)
    idx = rank % 2
    assert_equal(x, np.array([sum(lists[idx])], np.int64))
    assert len(groups) == 2
    check_member(mine, lists[idx], rank)
    assert groups[idx] is mine and groups[1 - idx] is NON_MEMBER


def test_new_subgroups_by_enumeration_unsorted_and_partial(rank, world_size):
    """Ranks given out of order are sorted; a rank listed nowhere gets (None, all NON_GROUP_MEMBER)."""
    covered = list(range(world_size - 1, 0, -1))  # everyone but rank 0, in reverse
    if not covered:
        pytest.skip("needs a second rank")
    mine, groups = dist.new_subgroups_by_enumeration([covered])
    assert len(groups) == 1
    if rank == 0:
        assert mine is None
        assert groups[0] is NON_MEMBER
    else:
        check_member(mine, sorted(covered), rank)
        assert groups[0] is mine


@pytest.mark.mpi(min_size=2)
def test_new_subgroups_by_enumeration_overlap_raises(rank, world_size):
    with pytest.raises(ValueError, match="overlap"):
        dist.new_subgroups_by_enumeration([[0, 1], [1]])


@pytest.mark.parametrize("bad", ["empty", "out_of_range", "duplicate", "not_lists"])
def test_new_subgroups_by_enumeration_bad_input(bad, rank, world_size):
    arg = {"empty": [], "out_of_range": [[world_size]], "duplicate": [[0, 0]], "not_lists": [0]}[bad]
    with pytest.raises((ValueError, TypeError)):
        dist.new_subgroups_by_enumeration(arg)


# ---------------------------------------------------------------------------------------------
# destroy_process_group(subgroup), get_pg_count
# ---------------------------------------------------------------------------------------------


def test_destroy_frees_the_communicators_of_a_group_every_member_is_done_with(rank, world_size):
    g = dist.new_group()
    x = np.ones(2)
    dist.all_reduce(x, group=g)
    comms = [g.mpi_comm, g.control.comm]
    dist.destroy_process_group(g)
    freed = [c == MPI.COMM_NULL for c in comms]
    everyone = MPI.COMM_WORLD.allgather(freed)
    assert all(all(f) for f in everyone), everyone


@pytest.mark.mpi(min_size=2)
def test_destroy_keeps_the_communicators_of_a_group_a_rank_skipped_a_call_on(rank, world_size):
    """Rank 0 skips a broadcast the others enter (its root, rank 1, completes: the data is on its way to rank 0).
    Freeing the communicators would let MPI give their context id to a later communicator, which the stale
    message would then reach (Open MPI aborted the job: "PML OB1 received a message from a rank outside the valid
    range of the communicator"). Every member keeps them instead, and later groups work."""
    g = dist.new_group(timeout=timedelta(seconds=1))
    comms = [g.mpi_comm, g.control.comm]
    problems = []
    if rank != 0:
        try:
            dist.broadcast(np.full(4, float(rank)), src=1, group=g)  # rank 1 completes; ranks 2.. time out
        except dist.DistBackendError:
            pass
    start = time.monotonic()
    dist.destroy_process_group(g)
    if time.monotonic() - start > 3.0:
        problems.append(f"destroy took {time.monotonic() - start:.1f} s (every member called it)")
    if any(c == MPI.COMM_NULL for c in comms):
        problems.append("the communicators were freed")
    singles = [dist.new_group([r]) for r in range(world_size)]  # reuse any freed context id
    y = np.array([rank], np.int32)
    dist.broadcast(y, src=rank, group=singles[rank])
    z = np.ones(3)
    dist.all_reduce(z)
    if y[0] != rank or z.tolist() != [float(world_size)] * 3:
        problems.append(f"later groups: {y.tolist()}, {z.tolist()}")
    fail_together(problems)


def test_destroy_subgroup_leaves_world_working(rank, world_size):
    members = list(range(0, world_size, 2))
    g = dist.new_group(members)
    count = dist.get_pg_count()
    dist.destroy_process_group(g)  # a no-op on non-members
    count_after = dist.get_pg_count()
    x = np.ones(1)
    errors = []
    if rank in members:  # every use of the destroyed group fails locally (errors checked at the end)
        errors = [
            outcome(lambda: dist.all_reduce(x, group=g)),
            outcome(lambda: dist.broadcast(x, src=members[0], group=g)),
            outcome(lambda: dist.get_rank(g)),
            outcome(lambda: dist.destroy_process_group(g)),  # twice
        ]
    y = np.array([rank], np.int64)
    dist.all_reduce(y)  # the world still works
    g2 = dist.new_group(members)  # and new groups too
    z = np.ones(1, np.int64)
    dist.all_reduce(z, group=g2)
    assert dist.is_initialized()
    assert_equal(y, np.array([world_size * (world_size - 1) // 2], np.int64))
    if rank in members:
        assert count_after == count - 1
        assert g.destroyed
        for e in errors:
            assert isinstance(e, RuntimeError), repr(e)
        assert_equal(x, np.ones(1))
        check_member(g2, members, rank)
        assert_equal(z, np.array([len(members)], np.int64))
    else:
        assert count_after == count
        assert_equal(z, np.ones(1, np.int64))


def test_get_pg_count(rank, world_size):
    counts = [dist.get_pg_count()]
    a = dist.new_group()
    counts.append(dist.get_pg_count())
    mine, _ = dist.new_subgroups(1)
    counts.append(dist.get_pg_count())
    dist.destroy_process_group(a)
    counts.append(dist.get_pg_count())
    dist.destroy_process_group(mine)
    counts.append(dist.get_pg_count())
    c = counts[0]
    assert c >= 1  # the default group
    assert counts == [c, c + 1, c + 2, c + 1, c]


def test_groups_created_in_the_same_order_line_up(rank, world_size):
    """Many groups back to back: each collective runs on the group it names."""
    groups = [dist.new_group() for _ in range(5)]
    works = []
    bufs = []
    for i, g in enumerate(reversed(groups)):
        x = np.array([i * (rank + 1)], np.int64)
        works.append(dist.all_reduce(x, group=g, async_op=True))
        bufs.append(x)
    for w in works:
        w.wait()
    for i, x in enumerate(bufs):
        assert_equal(x, np.array([i * world_size * (world_size + 1) // 2], np.int64))
