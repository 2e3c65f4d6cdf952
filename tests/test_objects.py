"""Object collectives: broadcast/all_gather/gather/scatter of picklable objects, send/recv_object_list."""

from __future__ import annotations

import pickle
import re
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

import mpidist as dist
from mpidist.objects import dumps, loads

from helpers import ALL_DTYPES, BF16, Checks, rank_input

NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER
PICKLE_ERRORS = (TypeError, AttributeError, pickle.PicklingError)


def same(a, b) -> bool:
    """Deep equality that compares numpy arrays by dtype, shape and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def assert_same(got, expected) -> None:
    assert same(got, expected), f"\n got      {got!r}\n expected {expected!r}"


def objects_of(r: int) -> list:
    """A rank-dependent list of mixed objects (sizes differ from rank to rank)."""
    return [
        r,
        f"rank {r}" * (r + 1),
        {"rank": r, "nested": [r, (r, str(r)), {r: None}]},
        None,
        (1.5 * r, complex(r, -r), True, b"\x00" * r),
        Fraction(r, 7),
        list(range(r * 10)),
        rank_input(r, (3, r + 1), np.dtype(np.float32)),
    ]


def object_of(r: int):
    return {"rank": r, "payload": list(range(r * 3)), "array": np.arange(r + 2, dtype=np.int16) * r, "s": "x" * r}


def ring_send_recv_objects(out: list, inp: list, me: int, n: int, group=None, by_group=False, any_source=False):
    """send_object_list/recv_object_list around a ring (even ranks send first). Returns recv's result."""
    nxt_, prv_ = (me + 1) % n, (me - 1) % n
    if by_group:
        skw, rkw = dict(group_dst=nxt_), dict(group_src=prv_)
    else:
        g = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
        skw, rkw = dict(dst=g(nxt_)), dict(src=g(prv_))
    if any_source:
        rkw = {}
    if me % 2 == 0:
        sent = dist.send_object_list(out, group=group, **skw)
        got = dist.recv_object_list(inp, group=group, **rkw)
    else:
        got = dist.recv_object_list(inp, group=group, **rkw)
        sent = dist.send_object_list(out, group=group, **skw)
    assert sent is None
    return got


# ---------------------------------------------------------------------------------------------
# broadcast_object_list
# ---------------------------------------------------------------------------------------------


def test_broadcast_object_list_every_src(rank, world_size):
    results = []
    for src in range(world_size):
        objs = objects_of(src) if rank == src else [None] * len(objects_of(src))
        before = list(objs)
        results.append((dist.broadcast_object_list(objs, src=src), objs, before))
    for src, (ret, objs, before) in enumerate(results):
        assert ret is None
        assert_same(objs, objects_of(src))
        if rank == src:
            assert all(a is b for a, b in zip(objs, before))  # the source's objects stay as they were


def test_broadcast_object_list_default_src_is_rank_0(rank):
    objs = ["foo", 12, {1: 2}] if rank == 0 else [None] * 3
    dist.broadcast_object_list(objs)
    assert objs == ["foo", 12, {1: 2}]


def test_broadcast_object_list_receivers_may_hold_anything(rank, world_size):
    """Receivers' old items are replaced whatever they were (same length required)."""
    objs = ["a", ("b",), None] if rank == 0 else [np.zeros(rank + 1), object(), "stale"]
    dist.broadcast_object_list(objs, src=0)
    assert objs == ["a", ("b",), None]


@pytest.mark.mpi(min_size=2)
def test_broadcast_object_list_length_mismatch_raises_on_receivers(rank, world_size):
    src = world_size - 1
    objs = [1, 2, 3] if rank == src else ["keep"] * (2 + rank % 2 * 2)  # 2 or 4 items, never 3
    error = None
    try:
        dist.broadcast_object_list(objs, src=src)
    except Exception as exc:
        error = exc
    # the group is consistent afterwards
    after = ["ok", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(after, src=0)
    if rank == src:
        assert error is None
        assert objs == [1, 2, 3]
    else:
        assert isinstance(error, ValueError), repr(error)
        assert objs == ["keep"] * len(objs)  # left unchanged
    assert after == ["ok", 0]


def test_broadcast_object_list_empty_list(rank):
    objs: list = []
    dist.broadcast_object_list(objs, src=0)
    assert objs == []


def test_broadcast_object_list_not_a_list_raises_type_error(rank):
    with pytest.raises(TypeError):
        dist.broadcast_object_list(("a", "b"), src=0)


@pytest.mark.mpi(min_size=2)
def test_broadcast_object_list_on_subgroup(rank, world_size):
    members = list(range(1, world_size))
    g = dist.new_group(members)
    if rank == 0:
        objs = ["untouched"]
        assert dist.broadcast_object_list(objs, src=1, group=g) is None
        assert objs == ["untouched"]
        return
    by_src, by_group_src = {}, {}
    for src in members:  # src as a global rank
        objs = objects_of(src) if rank == src else [None] * 8
        dist.broadcast_object_list(objs, src=src, group=g)
        by_src[src] = objs
    for group_src, src in enumerate(members):
        objs = [src, "x"] if rank == src else [None, None]
        dist.broadcast_object_list(objs, group=g, group_src=group_src)
        by_group_src[src] = objs
    for src in members:
        assert_same(by_src[src], objects_of(src))
        assert by_group_src[src] == [src, "x"]
    with pytest.raises(dist.RankNotInGroupError):
        dist.broadcast_object_list([None], src=0, group=g)  # rank 0 is not a member


# ---------------------------------------------------------------------------------------------
# all_gather_object
# ---------------------------------------------------------------------------------------------


def test_all_gather_object(rank, world_size):
    out = [None] * world_size
    assert dist.all_gather_object(out, object_of(rank)) is None
    for r in range(world_size):
        assert_same(out[r], object_of(r))


def test_all_gather_object_of_the_spec(rank, world_size):
    gather_objects = ["foo", 12, {1: 2}] + [f"extra{i}" for i in range(max(0, world_size - 3))]
    output = [None for _ in gather_objects[:world_size]]
    dist.all_gather_object(output, gather_objects[rank])
    assert output == gather_objects[:world_size]


@pytest.mark.parametrize("delta", [-1, 1])
def test_all_gather_object_wrong_length_raises(delta, rank, world_size):
    if world_size + delta < 0:
        pytest.skip("no list of negative length")
    out = ["keep"] * (world_size + delta)
    with pytest.raises(ValueError):
        dist.all_gather_object(out, rank)
    assert out == ["keep"] * (world_size + delta)


def test_all_gather_object_not_a_list_raises_type_error(rank, world_size):
    with pytest.raises(TypeError):
        dist.all_gather_object(tuple([None] * world_size), rank)


# ---------------------------------------------------------------------------------------------
# gather_object
# ---------------------------------------------------------------------------------------------


def test_gather_object_default_dst_is_rank_0(rank, world_size):
    out = [None] * world_size if rank == 0 else None
    assert dist.gather_object(object_of(rank), out) is None
    if rank == 0:
        for r in range(world_size):
            assert_same(out[r], object_of(r))


def test_gather_object_every_dst(rank, world_size):
    outs = []
    for dst in range(world_size):
        out = [None] * world_size if rank == dst else None
        dist.gather_object(objects_of(rank), out, dst=dst)
        outs.append(out)
    for dst, out in enumerate(outs):
        if rank == dst:
            for r in range(world_size):
                assert_same(out[r], objects_of(r))
        else:
            assert out is None


@pytest.mark.mpi(min_size=2)
def test_gather_object_list_on_non_dst_raises(rank, world_size):
    # only the non-destination ranks call: they must fail before communicating
    if rank != 0:
        with pytest.raises(ValueError):
            dist.gather_object(rank, [None] * world_size, dst=0)


def test_gather_object_bad_list_on_dst_raises(rank):
    """In a group of one (each rank its own dst): a missing or wrongly sized list."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    g = groups[rank]
    with pytest.raises(ValueError):
        dist.gather_object(rank, [None, None], dst=rank, group=g)
    with pytest.raises((TypeError, ValueError)):
        dist.gather_object(rank, None, dst=rank, group=g)
    out = [None]
    dist.gather_object({"me": rank}, out, dst=rank, group=g)
    assert out == [{"me": rank}]


# ---------------------------------------------------------------------------------------------
# scatter_object_list
# ---------------------------------------------------------------------------------------------


def test_scatter_object_list_every_src(rank, world_size):
    outs = []
    for src in range(world_size):
        inputs = [object_of(r + 10 * src) for r in range(world_size)] if rank == src else None
        out = [None]
        outs.append((dist.scatter_object_list(out, inputs, src=src), out))
    for src, (ret, out) in enumerate(outs):
        assert ret is None
        assert_same(out[0], object_of(rank + 10 * src))


def test_scatter_object_list_default_src_and_extra_slots(rank, world_size):
    """Default src is rank 0; only slot 0 of the output list is written; non-src inputs are ignored."""
    inputs = [("for", r) for r in range(world_size)] if rank == 0 else ["ignored"]
    out = [None, "second", "third"]
    dist.scatter_object_list(out, inputs)
    assert out == [("for", rank), "second", "third"]


def test_scatter_object_list_empty_output_raises(rank):
    with pytest.raises(ValueError):
        dist.scatter_object_list([], [rank] * dist.get_world_size(), src=0)


def test_scatter_object_list_wrong_input_length_raises_on_src(rank):
    """In a group of one: the source's input list must have one object per rank."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    g = groups[rank]
    out = ["keep"]
    with pytest.raises(ValueError):
        dist.scatter_object_list(out, [1, 2], src=rank, group=g)
    with pytest.raises((TypeError, ValueError)):
        dist.scatter_object_list(out, None, src=rank, group=g)
    assert out == ["keep"]
    dist.scatter_object_list(out, [("mine", rank)], src=rank, group=g)
    assert out == [("mine", rank)]


# ---------------------------------------------------------------------------------------------
# send_object_list / recv_object_list
# ---------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_send_recv_object_list(rank, world_size):
    prv = (rank - 1) % world_size
    inp = [None] * 8
    got = ring_send_recv_objects(objects_of(rank), inp, rank, world_size)
    assert got == prv
    assert_same(inp, objects_of(prv))


@pytest.mark.mpi(min_size=2)
def test_recv_object_list_any_source_returns_global_rank(rank, world_size):
    prv = (rank - 1) % world_size
    inp = [None, None]
    got = ring_send_recv_objects([rank, "from"], inp, rank, world_size, any_source=True)
    assert got == prv
    assert inp == [prv, "from"]


@pytest.mark.mpi(min_size=2)
def test_recv_object_list_from_many_senders(rank, world_size):
    if rank == 0:
        seen = {}
        for _ in range(world_size - 1):
            inp = [None]
            src = dist.recv_object_list(inp)
            seen[src] = inp[0]
        assert sorted(seen) == list(range(1, world_size))
        for src, obj in seen.items():
            assert_same(obj, object_of(src))
    else:
        dist.send_object_list([object_of(rank)], dst=0)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("mode", ["group_dst_src", "dst_src", "any_source"])
def test_send_recv_object_list_on_subgroup(mode, rank, world_size):
    members = list(range(1, world_size))
    g = dist.new_group(members)
    if rank == 0:
        objs = ["keep"]
        assert dist.send_object_list(objs, dst=1, group=g) is None
        assert dist.recv_object_list(objs, src=1, group=g) == -1
        assert objs == ["keep"]
        return
    me, m = dist.get_rank(g), dist.get_world_size(g)
    inp = [None, None]
    got = ring_send_recv_objects(
        [rank, me], inp, me, m, group=g, by_group=mode == "group_dst_src", any_source=mode == "any_source"
    )
    prv_global = members[(me - 1) % m]
    assert got == prv_global
    assert inp == [prv_global, (me - 1) % m]


@pytest.mark.mpi(min_size=2)
def test_recv_object_list_length_mismatch_raises(rank, world_size):
    if rank == 0:
        dist.send_object_list([1, 2, 3], dst=1)
        dist.send_object_list(["second"], dst=1)
    elif rank == 1:
        inp = ["keep"] * 2
        error = None
        try:
            dist.recv_object_list(inp, src=0)
        except Exception as exc:
            error = exc
        # nothing is left pending: a second exchange matches as usual
        inp2 = [None]
        sender = dist.recv_object_list(inp2, src=0)
        assert isinstance(error, ValueError), repr(error)
        assert inp == ["keep"] * 2
        assert sender == 0 and inp2 == ["second"]


@pytest.mark.mpi(min_size=2)
def test_object_p2p_does_not_collide_with_array_p2p(rank, world_size):
    """Array messages and object messages between the same pair, posted in opposite orders."""
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    arr_in = np.zeros(3, np.int64)
    rw = dist.irecv(arr_in, src=prv)
    sw = dist.isend(np.array([rank, rank, rank], np.int64), dst=nxt)
    inp = [None]
    got = ring_send_recv_objects([("obj", rank)], inp, rank, world_size)
    sw.wait()
    rw.wait()
    assert got == prv
    assert inp == [("obj", prv)]
    np.testing.assert_array_equal(arr_in, np.full(3, prv, np.int64))


# ---------------------------------------------------------------------------------------------
# numpy arrays inside objects, large objects
# ---------------------------------------------------------------------------------------------


def arrays_of(r: int) -> dict:
    d = {dt.name: rank_input(r, (2, 3), dt, salt=1) for dt in ALL_DTYPES}
    d["fortran"] = np.asfortranarray(np.arange(12.0).reshape(3, 4) + r)
    d["strided"] = (np.arange(20, dtype=np.int32) + r)[::3]
    d["scalar"] = np.array(r, np.int64)
    d["empty"] = np.zeros((0, 4), np.complex64)
    d["record"] = np.array([(r, 1.5 * r)] * 3, dtype=[("a", np.int32), ("b", np.float64)])
    d["objects"] = np.array([r, "x", None], dtype=object)
    d["big"] = np.arange(1000, dtype=np.float64) * (r + 1)
    d["big_endian"] = np.arange(5, dtype=">i4") + r
    return d


def check_arrays(got: dict, r: int) -> None:
    expected = arrays_of(r)
    assert got.keys() == expected.keys()
    for k, e in expected.items():
        g = got[k]
        assert isinstance(g, np.ndarray), k
        assert g.dtype == e.dtype, (k, g.dtype, e.dtype)
        assert g.shape == e.shape, (k, g.shape, e.shape)
        assert np.array_equal(g, e), k
        assert g.flags.writeable, k  # usable like the original
        assert g.flags.aligned, k
    assert got["fortran"].flags.f_contiguous
    assert got[BF16.name].dtype == BF16


def test_objects_with_numpy_arrays_all_gather(rank, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, arrays_of(rank))
    for r in range(world_size):
        check_arrays(out[r], r)
    # received arrays are independent of each other: writing one changes no other
    out[0]["big"][:] = -1
    if world_size > 1:
        assert np.array_equal(out[1]["big"], arrays_of(1)["big"])


def test_objects_with_numpy_arrays_broadcast_gather_scatter(rank, world_size):
    broadcasts = []
    for src in range(world_size):
        objs = [arrays_of(src)] if rank == src else [None]
        dist.broadcast_object_list(objs, src=src)
        broadcasts.append(objs[0])
    out = [None] * world_size if rank == world_size - 1 else None
    dist.gather_object(arrays_of(rank), out, dst=world_size - 1)
    mine = [None]
    dist.scatter_object_list(mine, [arrays_of(r) for r in range(world_size)] if rank == 0 else None, src=0)
    for src, obj in enumerate(broadcasts):
        check_arrays(obj, src)
    if rank == world_size - 1:
        for r in range(world_size):
            check_arrays(out[r], r)
    check_arrays(mine[0], rank)


@pytest.mark.mpi(min_size=2)
def test_objects_with_numpy_arrays_send_recv(rank, world_size):
    inp = [None]
    ring_send_recv_objects([arrays_of(rank)], inp, rank, world_size)
    check_arrays(inp[0], (rank - 1) % world_size)


def big_object_of(r: int) -> dict:
    """About (r + 1) MB: an array (out of band) and a bytes object (in band)."""
    return {
        "array": np.arange((r + 1) * 100_000, dtype=np.float64) + r,  # 0.8 MB per step
        "bytes": bytes([r % 251]) * ((r + 1) * 200_000),
        "rank": r,
    }


def check_big(got: dict, r: int) -> None:
    e = big_object_of(r)
    assert got["rank"] == r
    assert got["bytes"] == e["bytes"]
    assert got["array"].dtype == e["array"].dtype and np.array_equal(got["array"], e["array"])


def test_large_objects_of_different_sizes(rank, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, big_object_of(rank))
    src = world_size - 1
    objs = [big_object_of(src), "tail"] if rank == src else [None, None]
    dist.broadcast_object_list(objs, src=src)
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(big_object_of(rank), gathered, dst=0)
    mine = [None]
    dist.scatter_object_list(mine, [big_object_of(r) for r in range(world_size)] if rank == src else None, src=src)
    for r in range(world_size):
        check_big(out[r], r)
    check_big(objs[0], src)
    assert objs[1] == "tail"
    if rank == 0:
        for r in range(world_size):
            check_big(gathered[r], r)
    check_big(mine[0], rank)


@pytest.mark.mpi(min_size=2)
def test_large_objects_send_recv(rank, world_size):
    inp = [None]
    ring_send_recv_objects([big_object_of(rank)], inp, rank, world_size)
    check_big(inp[0], (rank - 1) % world_size)


# ---------------------------------------------------------------------------------------------
# unpicklable objects: the error is raised where the object is pickled
# ---------------------------------------------------------------------------------------------


def test_unpicklable_object_all_gather_and_gather_raise(rank, world_size):
    lock = threading.Lock()
    out = ["keep"] * world_size
    with pytest.raises(PICKLE_ERRORS):
        dist.all_gather_object(out, lock)
    assert out == ["keep"] * world_size
    with pytest.raises(PICKLE_ERRORS):
        dist.gather_object(lambda: rank, [None] * world_size if rank == 0 else None, dst=0)
    # nothing was started: the group still works
    out = [None] * world_size
    dist.all_gather_object(out, rank)
    assert out == list(range(world_size))


def test_unpicklable_object_raises_on_the_source(rank, world_size):
    """In a group of one (each rank its own source) for broadcast and scatter."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    g = groups[rank]
    objs = ["a", threading.Lock()]
    with pytest.raises(PICKLE_ERRORS):
        dist.broadcast_object_list(objs, src=rank, group=g)
    out = [None]
    with pytest.raises(PICKLE_ERRORS):
        dist.scatter_object_list(out, [threading.Lock()], src=rank, group=g)
    assert out == [None]


@pytest.mark.mpi(min_size=2)
def test_unpicklable_object_send_object_list_raises_before_sending(rank, world_size):
    nxt = (rank + 1) % world_size
    with pytest.raises(PICKLE_ERRORS):
        dist.send_object_list(["fine", threading.Lock()], dst=nxt)  # nobody receives: nothing may be sent
    inp = [None]
    got = ring_send_recv_objects([("after", rank)], inp, rank, world_size)
    assert got == (rank - 1) % world_size
    assert inp == [("after", (rank - 1) % world_size)]


class Refuses:
    """An object whose pickling raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __reduce__(self):
        raise self.error


#: what cannot be pickled: (a maker, the error type every rank raises, the error's text in the message)
UNPICKLABLE = {
    "lock": (threading.Lock, TypeError, "TypeError: cannot pickle '_thread.lock' object"),
    "pickling-error": (lambda: Refuses(pickle.PicklingError("not today")), pickle.PicklingError,
                       "PicklingError: not today"),
    "other-error": (lambda: Refuses(KeyError("k")), pickle.PicklingError, "KeyError: 'k'"),
}  # fmt: skip

#: how each collective names what could not be pickled
PICKLED_ARG = {
    "broadcast_object_list": "object_list",
    "all_gather_object": "obj",
    "gather_object": "obj",
    "scatter_object_list": "an object of scatter_object_input_list",
}


def call_with_one_unpicklable(fn: str, bad_rank: int, bad: object, rank: int, n: int, group) -> None:
    """Call collective ``fn`` on ``group`` where only ``bad_rank`` has ``bad`` to pickle (it is the source
    of broadcast and scatter; gather's destination is rank 0)."""
    mine = bad if rank == bad_rank else ("fine", rank)
    if fn == "broadcast_object_list":
        dist.broadcast_object_list(["x", mine] if rank == bad_rank else [None, None], src=bad_rank, group=group)
    elif fn == "all_gather_object":
        dist.all_gather_object([None] * n, mine, group=group)
    elif fn == "gather_object":
        dist.gather_object(mine, [None] * n if rank == 0 else None, dst=0, group=group)
    else:
        objs = [("fine", i) for i in range(n)]
        objs[n // 2] = bad
        dist.scatter_object_list([None], objs if rank == bad_rank else None, src=bad_rank, group=group)


@pytest.mark.parametrize("what", list(UNPICKLABLE))
@pytest.mark.parametrize("fn", list(PICKLED_ARG))
def test_one_rank_cannot_pickle_and_every_rank_raises_the_same_error_at_once(fn, what, rank, world_size):
    """Only the last rank has an object that cannot be pickled: every rank raises the same error (its type
    where it is a usual pickling error, else pickle.PicklingError) naming the function, the rank and the
    error, at once (not after the group's timeout), and the group then works."""
    make_bad, error_type, text = UNPICKLABLE[what]
    bad_rank = world_size - 1
    g = dist.new_group(timeout=30)
    c = Checks()
    expected = (
        f"{fn}: {PICKLED_ARG[fn]} of rank {bad_rank} could not be pickled ({text}); no object was sent and the "
        "group is still usable"
    )
    start = time.monotonic()
    c.raises(error_type, "^" + re.escape(expected) + "$",
             call_with_one_unpicklable, fn, bad_rank, make_bad(), rank, world_size, g)  # fmt: skip
    took = time.monotonic() - start
    c.true(f"the error came after {took:.1f} s, not at once", took < 10)
    out = [None] * world_size
    dist.all_gather_object(out, ("after", rank), group=g)
    c.equal("a collective afterwards", out, [("after", r) for r in range(world_size)])
    c.done()


@pytest.mark.mpi(min_size=3)
def test_several_ranks_cannot_pickle_and_the_error_names_them_all(rank, world_size):
    c = Checks()
    others = ", ".join(str(r) for r in range(1, world_size))
    expected = (
        f"all_gather_object: obj of ranks {others} could not be pickled (rank 1: TypeError: cannot pickle "
        "'_thread.lock' object); no object was sent and the group is still usable"
    )
    c.raises(TypeError, "^" + re.escape(expected) + "$",
             dist.all_gather_object, [None] * world_size, threading.Lock() if rank else rank)  # fmt: skip
    out = [None] * world_size
    dist.all_gather_object(out, rank)
    c.equal("a collective afterwards", out, list(range(world_size)))
    c.done()


@pytest.mark.parametrize("fn", ["send_object_list", "recv_object_list"])
@pytest.mark.parametrize("by", ["global", "group"])
def test_object_p2p_with_this_rank_itself_raises_at_once(fn, by, rank, world_size):
    """send_object_list/recv_object_list to or from this rank itself raise ValueError before any MPI call,
    as send/recv do (they would deadlock), instead of waiting the group's timeout."""
    g = dist.new_group(timeout=30)
    c = Checks()
    kw = {("send_object_list", "global"): {"dst": rank}, ("send_object_list", "group"): {"group_dst": rank},
          ("recv_object_list", "global"): {"src": rank}, ("recv_object_list", "group"): {"group_src": rank}}[fn, by]  # fmt: skip
    what = "destination" if fn == "send_object_list" else "source"
    expected = (
        f"{fn}: the {what} rank is this process itself; send_object_list and recv_object_list need another "
        "rank (to itself they would deadlock)"
    )
    start = time.monotonic()
    c.raises(ValueError, "^" + re.escape(expected) + "$", getattr(dist, fn), [1, 2], group=g, **kw)
    took = time.monotonic() - start
    c.true(f"the error came after {took:.1f} s, not at once", took < 10)
    if world_size > 1:  # an exchange of objects on the ring still works
        inp = [None]
        got = ring_send_recv_objects([("after", rank)], inp, rank, world_size, group=g)
        c.equal("the sender", got, (rank - 1) % world_size)
        c.equal("the objects", inp, [("after", (rank - 1) % world_size)])
    c.done()


# ---------------------------------------------------------------------------------------------
# subgroups and non-members
# ---------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_object_collectives_on_subgroup(rank, world_size):
    members = list(range(1, world_size, 2))  # odd ranks
    g = dist.new_group(members)
    if rank not in members:
        assert g is NON_MEMBER
        return
    m, me = len(members), members.index(rank)
    out = [None] * m
    dist.all_gather_object(out, object_of(rank), group=g)
    dst = members[-1]
    gathered = [None] * m if rank == dst else None
    dist.gather_object((rank, me), gathered, dst=dst, group=g)
    gathered0 = [None] * m if me == 0 else None
    dist.gather_object(rank, gathered0, group=g, group_dst=0)
    mine = [None]
    src = members[0]
    dist.scatter_object_list(mine, [("to", r) for r in members] if rank == src else None, src=src, group=g)
    mine2 = [None]
    dist.scatter_object_list(mine2, [i * 10 for i in range(m)] if me == m - 1 else None, group=g, group_src=m - 1)
    for i, r in enumerate(members):
        assert_same(out[i], object_of(r))
    if rank == dst:
        assert gathered == [(r, i) for i, r in enumerate(members)]
    if me == 0:
        assert gathered0 == members
    assert mine == [("to", rank)]
    assert mine2 == [me * 10]


@pytest.mark.mpi(min_size=2)
def test_object_collectives_default_root_in_subgroup_is_global_rank_0(rank, world_size):
    """dst/src default to global rank 0, which is not a member of the ranks 1..n-1."""
    members = list(range(1, world_size))
    g = dist.new_group(members)
    if rank == 0:
        return
    with pytest.raises(ValueError):
        dist.gather_object(rank, None, group=g)
    with pytest.raises(ValueError):
        dist.scatter_object_list([None], None, group=g)
    with pytest.raises(ValueError):
        dist.broadcast_object_list([None], group=g)


def test_object_collectives_non_members_unaffected(rank, world_size):
    g = NON_MEMBER
    objs = ["keep", 1]
    out = ["keep"] * world_size
    assert dist.broadcast_object_list(objs, src=0, group=g) is None
    assert dist.all_gather_object(out, rank, group=g) is None
    assert dist.gather_object(rank, out, dst=0, group=g) is None
    assert dist.scatter_object_list(objs, [1] * world_size, src=0, group=g) is None
    assert dist.send_object_list(objs, dst=0, group=g) is None
    assert dist.recv_object_list(objs, src=0, group=g) == -1
    assert dist.recv_object_list(objs, group=g) == -1
    assert objs == ["keep", 1]
    assert out == ["keep"] * world_size


@pytest.mark.mpi(min_size=2)
def test_object_collectives_members_and_non_members_of_a_real_group(rank, world_size):
    g = dist.new_group([0])
    objs = [rank]
    dist.broadcast_object_list(objs, src=0, group=g)
    assert objs == [rank]
    out = [None] if rank == 0 else ["keep"]
    dist.all_gather_object(out, ("zero", rank), group=g)
    assert out == ([("zero", 0)] if rank == 0 else ["keep"])


# ---------------------------------------------------------------------------------------------
# dumps / loads
# ---------------------------------------------------------------------------------------------

ROUND_TRIP = {
    "none": None,
    "int": 12,
    "str": "héllo",
    "bytes": b"\x00\x01" * 100,
    "bytearray": bytearray(b"abc"),
    "nested": {"a": [1, (2, 3), {"b": None}], 4: frozenset({5})},
    "empty_list": [],
    "array": np.arange(10.0),
    "bf16": np.arange(6, dtype=BF16).reshape(2, 3),
    "fortran": np.asfortranarray(np.arange(6, dtype=np.int8).reshape(2, 3)),
    "strided": np.arange(10, dtype=np.uint32)[::2],
    "scalar": np.array(3.5),
    "empty": np.zeros(0, np.int64),
    "numpy_scalar": np.float32(2.5),
    "mixed": [np.ones(3, np.complex128), "x", np.zeros((2, 2), np.bool_)],
}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_dumps_loads_round_trip(name):
    obj = ROUND_TRIP[name]
    payload = dumps(obj)
    assert isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and payload.ndim == 1
    assert_same(loads(payload.copy()), obj)  # from a copy, as a receiver has it
    assert_same(loads(payload), obj)


def test_dumps_puts_large_buffers_out_of_band():
    a = np.arange(4096, dtype=np.float64)
    b = np.arange(100, dtype=np.int16).reshape(10, 10)
    payload = dumps({"a": a, "b": b, "s": "small"})
    count = int(payload[:8].view(np.int64)[0])
    assert count == 3  # the pickle stream and one frame per array
    sizes = payload[8 : 8 * (count + 1)].view(np.int64).tolist()
    assert sizes[1:] == [a.nbytes, b.nbytes]
    assert payload.nbytes >= a.nbytes + b.nbytes
    received = payload.copy()
    obj = loads(received)
    assert np.array_equal(obj["a"], a) and np.array_equal(obj["b"], b) and obj["s"] == "small"
    # rebuilt on the received memory, without another copy
    assert np.shares_memory(obj["a"], received) and np.shares_memory(obj["b"], received)
    assert obj["a"].ctypes.data % obj["a"].dtype.alignment == 0


def test_dumps_loads_keeps_shared_references():
    a = np.arange(1000, dtype=np.int32)
    d = {"k": 1}
    obj = loads(dumps([a, a, d, d]).copy())
    assert obj[0] is obj[1] and obj[2] is obj[3]
    assert np.array_equal(obj[0], a)


def test_dumps_of_unpicklable_raises():
    with pytest.raises(PICKLE_ERRORS):
        dumps(threading.Lock())
