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
from mpidist import _object_wire, _pickling, objects
from mpidist.objects import OUT_OF_BAND_MIN_BYTES as OOB

from helpers import ALL_DTYPES, BF16, Checks, check_raises, fail_together, rank_input

pytestmark = pytest.mark.timeout(120)

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
    """A list on a non-destination rank is that rank's failed check: announced, so every rank raises it at once."""
    problems = check_raises(
        ValueError, "object_gather_list must be None on non-destination ranks",
        dist.gather_object, rank, [None] * world_size, dst=0,
    )  # fmt: skip
    if rank == 0 and world_size > 1:
        problems += check_raises(ValueError, r"raised on ranks? 1", dist.gather_object, rank, [None] * world_size, 0)
    elif rank != 0:
        problems += check_raises(ValueError, "must be None", dist.gather_object, rank, [None] * world_size, 0)
    out: list = [None] * world_size
    dist.all_gather_object(out, ("after", rank))  # the control group is in step
    if out != [("after", r) for r in range(world_size)]:
        problems.append(f"all_gather_object after the failed gather gave {out}")
    fail_together(problems)


def test_gather_object_wrong_list_on_dst_raises_everywhere(rank, world_size):
    """The destination's list has the wrong length: every rank raises, nothing stale reaches the next call."""
    slots = [None] * (world_size + 1) if rank == 0 else None
    problems = check_raises(ValueError, f"has {world_size + 1} slots", dist.gather_object,
                            {"secret": "from-failed-gather"}, slots, dst=0)  # fmt: skip
    out: list = [None] * world_size
    dist.all_gather_object(out, rank)
    if out != list(range(world_size)):
        problems.append(f"all_gather_object after the failed gather_object gave {out}")
    fail_together(problems)


def test_scatter_object_list_wrong_input_on_src_raises_everywhere(rank, world_size):
    objs = list(range(world_size + 2)) if rank == 0 else None
    out: list = [None]
    problems = check_raises(ValueError, f"has {world_size + 2} objects", dist.scatter_object_list, out, objs, src=0)
    if out != [None]:
        problems.append(f"the output was written: {out}")
    got: list = [None]
    dist.scatter_object_list(got, [r * 10 for r in range(world_size)] if rank == 0 else None, src=0)
    if got != [rank * 10]:
        problems.append(f"scatter_object_list after the failed one gave {got}")
    fail_together(problems)


def test_scatter_object_list_bad_output_on_one_rank_takes_its_part_then_raises(rank, world_size):
    """A rank whose output list is unusable still receives its part (nothing is left in flight), then raises."""
    bad = rank == world_size - 1
    out: list = [] if bad else [None]
    objs = [f"obj{r}" for r in range(world_size)] if rank == 0 else None
    if bad:
        problems = check_raises(ValueError, "must be a non-empty list", dist.scatter_object_list, out, objs, src=0)
    else:
        dist.scatter_object_list(out, objs, src=0)
        problems = [] if out == [f"obj{rank}"] else [f"got {out}"]
    got: list = [None]
    dist.scatter_object_list(got, [r + 100 for r in range(world_size)] if rank == 0 else None, src=0)
    if got != [rank + 100]:
        problems.append(f"scatter_object_list after the failed one gave {got}")
    fail_together(problems)


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
# round trips (every rank unpickles every rank's object)
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
    "large": np.arange(OOB, dtype=np.int16).reshape(2, -1),
    "large_bytes": bytes(range(256)) * (OOB // 256 + 1),  # bytes stay in band, whatever their size
    "large_bytearray": bytearray(OOB + 1),
}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_round_trip(name, rank, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, ROUND_TRIP[name])
    for got in out:
        assert_same(got, ROUND_TRIP[name])


def test_shared_references_stay_shared(rank, world_size):
    """An array that appears twice is one buffer and arrives as one array (pickle's memo), out of band or not."""
    big, small, d = np.arange(OOB, dtype=np.int32), np.arange(5), {"k": 1}
    out = [None] * world_size
    dist.all_gather_object(out, [big, big, small, small, d, d])
    for got in out:
        assert got[0] is got[1] and got[2] is got[3] and got[4] is got[5]
        assert np.array_equal(got[0], big) and np.array_equal(got[2], small) and got[4] == d


# ---------------------------------------------------------------------------------------------
# out-of-band buffers: large arrays and tensors travel as messages of their own, without copies
# ---------------------------------------------------------------------------------------------


def test_threshold_is_64_kib():
    assert OOB == 64 << 10


def test_pickle_sends_large_buffers_from_the_objects_memory():
    """Buffers of OOB bytes or more become frames that are the object's own memory (no copy on the sender);
    smaller, non-contiguous, zero-size and bytes-like ones stay in the pickle stream."""
    at = np.arange(OOB, dtype=np.uint8)  # exactly the threshold: out of band
    below = np.arange(OOB - 1, dtype=np.uint8)  # one byte less: in band
    fortran = np.asfortranarray(np.arange(OOB // 8 * 2, dtype=np.float64).reshape(2, -1))
    readonly = np.arange(OOB // 4 * 3, dtype=np.int32)
    readonly.flags.writeable = False
    strided = np.arange(OOB // 4, dtype=np.float64)[::2]  # OOB bytes, not contiguous: in band
    obj = {"at": at, "below": below, "nested": [fortran, {"ro": readonly}], "strided": strided,
           "empty": np.zeros((0, 3)), "bytes": b"x" * OOB}  # fmt: skip
    p = _pickling.pickled(obj)
    assert len(p.frames) == 3
    for frame, source in zip(p.frames, (at, fortran, readonly)):
        assert frame.dtype == np.uint8 and frame.nbytes == source.nbytes
        assert frame.ctypes.data == source.ctypes.data  # the object's memory itself
    assert p.table.tolist() == [[at.nbytes, 0], [fortran.nbytes, 0], [readonly.nbytes, 0]]
    assert not p.frames[2].flags.writeable  # a read-only array is sent as it is
    in_band = below.nbytes + strided.nbytes + OOB  # the in-band buffers are copied into the stream
    assert in_band <= p.stream.nbytes < in_band + 4096


def test_pickle_of_a_small_object_is_one_stream():
    p = _pickling.pickled({"step": 1, "loss": 0.5, "rank": 3})
    assert p.frames == [] and p.table.shape == (0, 2)
    assert pickle.loads(p.stream) == {"step": 1, "loss": 0.5, "rank": 3}


def received_arrays(monkeypatch) -> list:
    """Record the buffers the object functions receive frames into (what MPI writes, what pickle gets)."""
    seen: list = []
    real = objects.receive_buffers

    def recording(table):
        into, give = real(table)
        seen.extend(zip(into, give))
        return into, give

    monkeypatch.setattr(objects, "receive_buffers", recording)
    monkeypatch.setattr(_object_wire, "receive_buffers", recording)  # gather_all's (all_gather_object)
    return seen


def root_base(a: np.ndarray):
    """The object at the end of ``a``'s base chain (through memoryviews): what owns its memory."""
    while True:
        base = a.base if isinstance(a, np.ndarray) else getattr(a, "obj", None)
        if base is None:
            return a
        a = base


def mixed_arrays_of(r: int) -> dict:
    """Arrays of many dtypes, shapes and sizes on both sides of the threshold, nested; rank-dependent."""
    big = OOB + 8 * 64 * r  # bytes, rank-dependent
    return {
        "f64": np.arange(big // 8, dtype=np.float64) * 0.5 + r,
        "i32_at_threshold": np.arange(OOB // 4, dtype=np.int32) - r,
        "u8_below_threshold": (np.arange(OOB - 1) % 251).astype(np.uint8) + r,
        "bf16": rank_input(r, (4, big // 8), BF16),
        "c64": rank_input(r, (2, 4, big // 64), np.dtype(np.complex64)),
        "bool": rank_input(r, (big,), np.dtype(np.bool_)),
        "fortran": np.asfortranarray(rank_input(r, (big // 256, 64), np.dtype(np.float32))),
        "strided": (np.arange(big // 2, dtype=np.float64) + r)[::2],  # not contiguous: in band
        "empty": np.zeros((0, 5), np.float32),
        "small": np.arange(7, dtype=np.int8) + r,
        "nested": [
            {"i16": np.arange(OOB, dtype=np.int16) + r, "more": [np.arange(3) + r, np.full(OOB // 8, r, np.uint64)]},
            ("f16", rank_input(r, (big // 2,), np.dtype(np.float16))),
        ],
        "rank": r,
    }


#: keys (paths) of mixed_arrays_of's arrays that travel out of band
OUT_OF_BAND = {"f64", "i32_at_threshold", "bf16", "c64", "bool", "fortran", "nested/0/i16", "nested/0/more/1",
               "nested/1/1"}  # fmt: skip


def arrays_in(obj, path: str = "") -> dict:
    """Every numpy array in a nest of dicts, lists and tuples, by path."""
    if isinstance(obj, np.ndarray):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    found = {}
    for k, v in items:
        found.update(arrays_in(v, f"{path}/{k}" if path else str(k)))
    return found


def check_mixed(c: Checks, what: str, got, r: int, received: list) -> None:
    """Values, dtypes, shapes and layout as sent; writable; out-of-band arrays are views of a receive buffer of
    their exact size (no copy on the receiver), the others are not."""
    expected = mixed_arrays_of(r)
    c.true(f"{what}: rank field {got.get('rank') if isinstance(got, dict) else got!r}", isinstance(got, dict)
           and got.get("rank") == r)  # fmt: skip
    if not isinstance(got, dict):
        return
    arrays, exp = arrays_in(got), arrays_in(expected)
    c.equal(f"{what}: array paths", sorted(arrays), sorted(exp))
    buffers = [into for into, _ in received]
    for path, e in exp.items():
        g = arrays.get(path)
        if g is None:
            continue
        c.true(f"{what}/{path}: {g.dtype}{g.shape} vs {e.dtype}{e.shape}", g.dtype == e.dtype and g.shape == e.shape)
        c.true(f"{what}/{path}: values differ", bool(np.array_equal(g, e)))
        c.true(f"{what}/{path}: not writable", g.flags.writeable)
        c.true(f"{what}/{path}: layout", g.flags.f_contiguous if path == "fortran" else g.flags.c_contiguous)
        owner = root_base(g)
        if path in OUT_OF_BAND:
            c.true(f"{what}/{path}: not a view of a receive buffer (owner {type(owner).__name__})",
                   any(owner is b for b in buffers))  # fmt: skip
            c.true(f"{what}/{path}: receive buffer of {getattr(owner, 'nbytes', '?')} bytes for {g.nbytes}",
                   isinstance(owner, np.ndarray) and owner.nbytes == g.nbytes and owner.dtype == np.uint8)  # fmt: skip
        else:
            c.true(f"{what}/{path}: in-band array is a view of a receive buffer", not any(owner is b for b in buffers))


def test_out_of_band_broadcast_every_src(rank, world_size, monkeypatch):
    received = received_arrays(monkeypatch)
    c = Checks()
    for src in range(world_size):
        before = len(received)
        sent = [mixed_arrays_of(src), "tail", np.arange(OOB, dtype=np.uint8)]
        objs = list(sent) if rank == src else [None] * 3
        dist.broadcast_object_list(objs, src=src)
        if rank == src:
            c.true("the source's objects stay as they were", all(a is b for a, b in zip(objs, sent)))
            c.equal("nothing received on the source", len(received), before)
            continue
        check_mixed(c, f"src {src}", objs[0], src, received)
        c.equal(f"src {src}: tail", objs[1], "tail")
        c.equal(f"src {src}: third", objs[2], np.arange(OOB, dtype=np.uint8))
        c.equal(f"src {src}: frames received", len(received) - before, len(OUT_OF_BAND) + 1)
    c.done()


def oob_count_of(r: int) -> int:
    """How many out-of-band arrays rank r's object in the mixed tests has: none on odd ranks, r // 2 + 1 else."""
    return 0 if r % 2 else r // 2 + 1


def varied_object_of(r: int) -> dict:
    """Rank-dependent: odd ranks send small objects only, even ranks 1, 2, ... large arrays (and a small one)."""
    return {"rank": r, "small": np.arange(r + 1),
            "large": [np.full(OOB // 8 + j, r * 10 + j, np.int64) for j in range(oob_count_of(r))]}  # fmt: skip


def check_varied(c: Checks, what: str, got, r: int, received: list) -> None:
    if not (isinstance(got, dict) and got.get("rank") == r):
        c.true(f"{what}: got {type(got).__name__}", False)
        return
    c.equal(f"{what}: small", got["small"], np.arange(r + 1))
    c.equal(f"{what}: number of large arrays", len(got["large"]), oob_count_of(r))
    for j, a in enumerate(got["large"]):
        c.equal(f"{what}: large[{j}]", a, np.full(OOB // 8 + j, r * 10 + j, np.int64))
        c.true(f"{what}: large[{j}] not writable", a.flags.writeable)
        owner = root_base(a)
        c.true(f"{what}: large[{j}] is not a view of its own receive buffer",
               any(owner is into for into, _ in received) and owner.nbytes == a.nbytes)  # fmt: skip


def test_out_of_band_all_gather_object_mixed_ranks(rank, world_size, monkeypatch):
    """Ranks with no large array, one, two...: every rank gets every object, large arrays without copies."""
    received = received_arrays(monkeypatch)
    c = Checks()
    out = [None] * world_size
    dist.all_gather_object(out, varied_object_of(rank))
    for r in range(world_size):
        check_varied(c, f"slot {r}", out[r], r, received)
    c.equal("frames received", len(received), sum(oob_count_of(r) for r in range(world_size)))
    mixed = [None] * world_size
    dist.all_gather_object(mixed, mixed_arrays_of(rank))
    for r in range(world_size):
        check_mixed(c, f"mixed slot {r}", mixed[r], r, received)
    # every array has its own memory: writing one changes no other
    for r in range(world_size):
        mixed[r]["f64"][:] = -1
    for r in range(world_size):
        c.equal(
            f"slot {r} after writing the others", mixed[r]["i32_at_threshold"], mixed_arrays_of(r)["i32_at_threshold"]
        )
    c.done()


def test_out_of_band_gather_object_mixed_ranks_every_dst(rank, world_size, monkeypatch):
    received = received_arrays(monkeypatch)
    c = Checks()
    for dst in range(world_size):
        before = len(received)
        out = [None] * world_size if rank == dst else None
        dist.gather_object(varied_object_of(rank), out, dst=dst)
        if rank != dst:
            c.equal(f"dst {dst}: nothing received here", len(received), before)
            continue
        for r in range(world_size):
            check_varied(c, f"dst {dst} slot {r}", out[r], r, received[before:])
    out = [None] * world_size if rank == 0 else None
    dist.gather_object(mixed_arrays_of(rank), out, dst=0)
    if rank == 0:
        for r in range(world_size):
            check_mixed(c, f"mixed slot {r}", out[r], r, received)
    c.done()


def test_out_of_band_scatter_object_list_every_src(rank, world_size, monkeypatch):
    """The source sends objects with different numbers of large arrays (some none) to the ranks."""
    received = received_arrays(monkeypatch)
    c = Checks()
    for src in range(world_size):
        before = len(received)
        out = [None]
        ins = [varied_object_of(r) for r in range(world_size)] if rank == src else None
        dist.scatter_object_list(out, ins, src=src)
        check_varied(c, f"src {src}", out[0], rank, received[before:])
        c.equal(f"src {src}: frames received", len(received) - before, oob_count_of(rank))
    out = [None]
    dist.scatter_object_list(out, [mixed_arrays_of(r) for r in range(world_size)] if rank == 0 else None, src=0)
    check_mixed(c, "mixed", out[0], rank, received)
    c.done()


@pytest.mark.mpi(min_size=2)
def test_out_of_band_send_recv_object_list(rank, world_size, monkeypatch):
    """A ring of objects with large arrays, then of objects without, then from any source: nothing is left over
    between them."""
    received = received_arrays(monkeypatch)
    c = Checks()
    prv = (rank - 1) % world_size
    inp = [None, None]
    c.equal("sender", ring_send_recv_objects([mixed_arrays_of(rank), "x"], inp, rank, world_size), prv)
    check_mixed(c, "ring", inp[0], prv, received)
    c.equal("second item", inp[1], "x")
    inp = [None]
    c.equal("sender (small)", ring_send_recv_objects([varied_object_of(rank)], inp, rank, world_size), prv)
    check_varied(c, "small ring", inp[0], prv, received)
    inp = [None]
    c.equal("sender (any source)",
            ring_send_recv_objects([varied_object_of(rank + 1)], inp, rank, world_size, any_source=True), prv)  # fmt: skip
    check_varied(c, "any-source ring", inp[0], prv + 1, received)
    c.done()


def test_read_only_arrays_arrive_read_only(rank, world_size):
    """As pickle does: a read-only array arrives read-only (in band and out of band), a writable one writable."""
    ro_big, ro_small = np.arange(OOB, dtype=np.int16), np.arange(4)
    ro_big.flags.writeable = ro_small.flags.writeable = False
    out = [None] * world_size
    dist.all_gather_object(out, [ro_big, ro_small, np.arange(OOB, dtype=np.int16)])
    src = world_size - 1
    objs = [ro_big, ro_small, np.arange(OOB, dtype=np.int16)] if rank == src else [None] * 3
    dist.broadcast_object_list(objs, src=src)  # the source sends its read-only memory as it is
    for got in out + ([] if rank == src else [objs]):
        assert [a.flags.writeable for a in got] == [False, False, True]
        assert np.array_equal(got[0], ro_big) and np.array_equal(got[1], ro_small) and np.array_equal(got[2], ro_big)


@pytest.mark.parametrize("fn", list(PICKLED_ARG))
def test_one_rank_cannot_pickle_while_the_others_have_large_arrays(fn, rank, world_size):
    """The other ranks' objects hold out-of-band arrays: still the same error on every rank at once, nothing
    is left in flight (the group works afterwards)."""
    bad_rank = world_size - 1
    g = dist.new_group(timeout=30)
    c = Checks()
    big = {"array": np.arange(OOB, dtype=np.float64), "rank": rank}
    start = time.monotonic()
    mine = threading.Lock() if rank == bad_rank else big
    expected = (f"{fn}: {PICKLED_ARG[fn]} of rank {bad_rank} could not be pickled (TypeError: cannot pickle "
                "'_thread.lock' object); no object was sent and the group is still usable")  # fmt: skip
    if fn == "broadcast_object_list":  # the source has large arrays besides the lock
        call = lambda: dist.broadcast_object_list([big, mine] if rank == bad_rank else [None, None],  # noqa: E731
                                                  src=bad_rank, group=g)  # fmt: skip
    elif fn == "scatter_object_list":
        objs = [dict(big, to=i) for i in range(world_size)]
        objs[-1] = threading.Lock()
        call = lambda: dist.scatter_object_list([None], objs if rank == bad_rank else None,  # noqa: E731
                                                src=bad_rank, group=g)  # fmt: skip
    elif fn == "all_gather_object":
        call = lambda: dist.all_gather_object([None] * world_size, mine, group=g)  # noqa: E731
    else:
        call = lambda: dist.gather_object(mine, [None] * world_size if rank == 0 else None, dst=0,  # noqa: E731
                                          group=g)  # fmt: skip
    c.raises(TypeError, "^" + re.escape(expected) + "$", call)
    c.true("not at once", time.monotonic() - start < 10)
    out = [None] * world_size
    dist.all_gather_object(out, big, group=g)
    c.true("a collective afterwards", all(np.array_equal(o["array"], big["array"]) and o["rank"] == r
                                          for r, o in enumerate(out)))  # fmt: skip
    c.done()


@pytest.mark.mpi(min_size=2)
def test_recv_object_list_length_mismatch_with_large_arrays_leaves_nothing_pending(rank, world_size):
    if rank == 0:
        dist.send_object_list([np.arange(OOB, dtype=np.uint8), 2, 3], dst=1)
        dist.send_object_list([np.full(OOB, 7, np.uint8)], dst=1)
    elif rank == 1:
        error = None
        try:
            dist.recv_object_list([None], src=0)
        except ValueError as exc:
            error = exc
        inp = [None]
        assert dist.recv_object_list(inp, src=0) == 0
        assert error is not None and "1 slots but 3 objects arrived" in str(error)
        assert np.array_equal(inp[0], np.full(OOB, 7, np.uint8))


# ---------------------------------------------------------------------------------------------
# torch CPU tensors inside objects
# ---------------------------------------------------------------------------------------------


def tensors_of(torch, r: int) -> dict:
    big = OOB // 4 + 16 * r  # float32 elements: out of band
    base = torch.arange(big, dtype=torch.float32) + r
    param = torch.nn.Parameter(torch.full((OOB // 8,), float(r), dtype=torch.float64))
    return {
        "f32": base,
        "view": base[10:20],  # shares base's storage
        "transposed": (torch.arange(OOB // 4, dtype=torch.int32) - r).reshape(64, -1).t(),  # not contiguous
        "bf16": torch.full((OOB,), r + 0.5, dtype=torch.bfloat16),
        "u16": (torch.arange(OOB, dtype=torch.int32) % 1000 + r).to(torch.uint16),  # torch's own pickle fails on it
        "small": torch.tensor([r, r + 1], dtype=torch.int64),
        "empty": torch.zeros((0, 3), dtype=torch.float16),
        "param": param,
        "grad": torch.ones(5, requires_grad=True),
        "array": np.arange(OOB, dtype=np.int8),
    }


def check_tensors(c: Checks, torch, what: str, got, r: int, received: list) -> None:
    e = tensors_of(torch, r)
    if not isinstance(got, dict) or got.keys() != e.keys():
        c.true(f"{what}: got {got!r:.200}", False)
        return
    for k, ev in e.items():
        g = got[k]
        if k == "array":
            c.equal(f"{what}/{k}", g, ev)
            continue
        c.true(f"{what}/{k}: {type(g).__name__} {g.dtype}{tuple(g.shape)} stride {g.stride()} vs "
               f"{type(ev).__name__} {ev.dtype}{tuple(ev.shape)} stride {ev.stride()}",
               type(g) is type(ev) and g.dtype == ev.dtype and g.shape == ev.shape and g.stride() == ev.stride()
               and g.requires_grad == ev.requires_grad)  # fmt: skip
        c.true(f"{what}/{k}: values differ", bool(torch.equal(g.detach(), ev.detach())))
    storages = {g.data_ptr() for _, g in received if isinstance(g, torch.Tensor)}
    for k in ("f32", "transposed", "bf16", "u16", "param"):  # storages of OOB bytes or more
        c.true(f"{what}/{k}: not received in place (storage at {got[k].untyped_storage().data_ptr():#x})",
               got[k].untyped_storage().data_ptr() in storages)  # fmt: skip
    for k in ("small", "empty", "grad"):
        c.true(f"{what}/{k}: small tensor received out of band", got[k].untyped_storage().data_ptr() not in storages)
    c.true(f"{what}: view no longer shares f32's storage",
           got["view"].untyped_storage().data_ptr() == got["f32"].untyped_storage().data_ptr())  # fmt: skip
    got["f32"][10] = -7.0
    c.true(f"{what}: writing f32 does not show in view", float(got["view"][0]) == -7.0)
    try:
        got["f32"].resize_(got["f32"].numel() * 2)  # a storage of torch's own allocator: resizable
    except RuntimeError as exc:
        c.true(f"{what}: f32 cannot be resized: {exc}", False)


def test_torch_cpu_tensors_in_objects(rank, world_size, monkeypatch):
    torch = pytest.importorskip("torch")
    received = received_arrays(monkeypatch)
    c = Checks()
    out = [None] * world_size
    dist.all_gather_object(out, tensors_of(torch, rank))
    for r in range(world_size):
        check_tensors(c, torch, f"all_gather slot {r}", out[r], r, received)
    src = world_size - 1
    objs = [tensors_of(torch, src)] if rank == src else [None]
    dist.broadcast_object_list(objs, src=src)
    if rank != src:
        check_tensors(c, torch, "broadcast", objs[0], src, received)
    c.done()


def test_pickle_sends_torch_storages_from_their_memory():
    torch = pytest.importorskip("torch")
    big = torch.arange(OOB // 4, dtype=torch.float32)
    p = _pickling.pickled({"big": big, "view": big[3:9], "small": torch.ones(3)})
    assert p.table.tolist() == [[big.nbytes, 1]]  # one storage, sent once, received as a tensor's memory
    assert p.frames[0].ctypes.data == big.data_ptr()
    big.resize_(OOB)  # the sender's tensor was not made non-resizable
