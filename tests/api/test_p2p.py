"""Point-to-point: send/recv, isend/irecv, P2POp and batch_isend_irecv.

Every test pairs its sends and receives so that nothing is left pending, and
runs at any world size (rings over the world or over a subgroup). Tests that take
the ``make`` fixture run once per array kind (numpy arrays, torch CPU tensors) and
check the received values in the very objects they passed.
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist

from helpers import ALL_DTYPES, FAMILIES, Checks, assert_equal, rank_input, reverse_axes

TAG_UB = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))


def nxt(r: int, n: int) -> int:
    return (r + 1) % n


def prv(r: int, n: int) -> int:
    return (r - 1) % n


def ring_blocking(out: Any, inp: Any, me: int, n: int, group=None, tag: int = 0, by_group: bool = False):
    """Exchange on a ring with blocking send/recv (even ranks send first: no deadlock).

    ``me``/``n`` are this rank's rank and size in ``group``; with ``by_group``
    peers are passed as group ranks (``group_dst``/``group_src``), else as global ranks.
    Returns what ``recv`` returned.
    """
    if by_group:
        skw = dict(group_dst=nxt(me, n))
        rkw = dict(group_src=prv(me, n))
    else:
        skw = dict(dst=dist.get_global_rank(group, nxt(me, n)) if group is not None else nxt(me, n))
        rkw = dict(src=dist.get_global_rank(group, prv(me, n)) if group is not None else prv(me, n))
    if me % 2 == 0:
        dist.send(out, group=group, tag=tag, **skw)
        return dist.recv(inp, group=group, tag=tag, **rkw)
    got = dist.recv(inp, group=group, tag=tag, **rkw)
    dist.send(out, group=group, tag=tag, **skw)
    return got


# ---------------------------------------------------------------------------------------------
# send / recv
# ---------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_send_recv_every_dtype(dtype, make, rank, world_size):
    out = make.input(rank, (3, 4), dtype, salt=1)
    inp = make.zeros((3, 4), dtype)
    src = ring_blocking(out, inp, rank, world_size)
    assert src == prv(rank, world_size)
    assert_equal(inp, rank_input(prv(rank, world_size), (3, 4), dtype, salt=1))
    assert_equal(out, rank_input(rank, (3, 4), dtype, salt=1))  # the send buffer is unchanged


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_isend_irecv_every_dtype(dtype, make, rank, world_size):
    out = make.input(rank, (7,), dtype, salt=2)
    inp = make.zeros(7, dtype)
    rw = dist.irecv(inp, src=prv(rank, world_size))
    sw = dist.isend(out, dst=nxt(rank, world_size))
    assert sw.wait() is True
    assert rw.wait() is True
    assert_equal(inp, rank_input(prv(rank, world_size), (7,), dtype, salt=2))
    assert_equal(out, rank_input(rank, (7,), dtype, salt=2))  # the send buffer is unchanged


def test_recv_any_source_returns_sender_global_rank(make, rank, world_size):
    out = make(np.array([rank, 10 * rank], np.int64))
    inp = make.zeros(2, np.int64)
    sw = dist.isend(out, dst=nxt(rank, world_size), tag=3)
    src = dist.recv(inp, src=None, tag=3)
    sw.wait()
    assert src == prv(rank, world_size)
    assert_equal(inp, np.array([src, 10 * src], np.int64))


@pytest.mark.mpi(min_size=2)
def test_recv_any_source_from_many_senders(make, rank, world_size):
    if rank == 0:
        seen = {}
        for _ in range(world_size - 1):
            buf = make.zeros(4, np.float64)
            src = dist.recv(buf)
            seen[src] = buf
        assert sorted(seen) == list(range(1, world_size))
        for src, buf in seen.items():
            assert_equal(buf, rank_input(src, (4,), np.dtype(np.float64)))
    else:
        dist.send(make.input(rank, (4,), np.float64), dst=0)


@pytest.mark.mpi(min_size=2)
def test_recv_from_specific_src_picks_that_sender(make, rank, world_size):
    """Rank 0 receives from the senders in reverse order; each recv takes its own sender's message."""
    if rank == 0:
        got = {}
        for src in reversed(range(1, world_size)):
            buf = make.zeros(3, np.int32)
            got[src] = (dist.recv(buf, src=src), buf)
        for src, (ret, buf) in got.items():
            assert ret == src
            assert_equal(buf, rank_input(src, (3,), np.dtype(np.int32)))
    else:
        dist.isend(make.input(rank, (3,), np.int32), dst=0).wait()


@pytest.mark.mpi(min_size=2)
def test_messages_are_matched_by_tag_not_order(make, rank, world_size):
    tags = [5, 7, 9]
    works = [dist.isend(make(np.full(3, 100 * rank + t, np.int64)), dst=nxt(rank, world_size), tag=t) for t in tags]
    p = prv(rank, world_size)
    got, senders = {}, []
    for t in (9, 5, 7):  # the reverse of the send order, then out of order
        buf = make.zeros(3, np.int64)
        senders.append(dist.recv(buf, src=p, tag=t))
        got[t] = buf
    for w in works:
        w.wait()
    assert senders == [p, p, p]
    for t in tags:
        assert_equal(got[t], np.full(3, 100 * p + t, np.int64))


def test_same_tag_messages_arrive_in_send_order(make, rank, world_size):
    works = [dist.isend(make(np.array([rank, i], np.int64)), dst=nxt(rank, world_size), tag=4) for i in range(4)]
    bufs = [make.zeros(2, np.int64) for _ in range(4)]
    rws = [dist.irecv(b, src=prv(rank, world_size), tag=4) for b in bufs]
    for w in works + rws:
        w.wait()
    for i, b in enumerate(bufs):
        assert_equal(b, np.array([prv(rank, world_size), i], np.int64))


def test_largest_tag_is_accepted(make, rank, world_size):
    out = make(np.array([rank], np.int16))
    inp = make.zeros(1, np.int16)
    rw = dist.irecv(inp, src=prv(rank, world_size), tag=TAG_UB)
    dist.isend(out, dst=nxt(rank, world_size), tag=TAG_UB).wait()
    rw.wait()
    assert_equal(inp, np.array([prv(rank, world_size)], np.int16))


@pytest.mark.parametrize("tag", [-1, -(2**31), TAG_UB + 1, 2**62], ids=["-1", "int32min", "tag_ub+1", "huge"])
def test_tag_out_of_range_raises_value_error(tag, make, rank, world_size):
    x = make.zeros(2)
    # isend/irecv to self: the only error possible here is the tag
    with pytest.raises(ValueError, match="tag"):
        dist.isend(x, dst=rank, tag=tag)
    with pytest.raises(ValueError, match="tag"):
        dist.irecv(x, src=rank, tag=tag)
    with pytest.raises(ValueError, match="tag"):
        dist.irecv(x, tag=tag)
    if world_size > 1:
        with pytest.raises(ValueError, match="tag"):
            dist.send(x, dst=nxt(rank, world_size), tag=tag)
        with pytest.raises(ValueError, match="tag"):
            dist.recv(x, src=prv(rank, world_size), tag=tag)
    # nothing was posted: a matched exchange with the same buffers still works
    out, inp = make(np.full(2, float(rank))), make.zeros(2)
    rw = dist.irecv(inp, src=prv(rank, world_size))
    dist.isend(out, dst=nxt(rank, world_size)).wait()
    rw.wait()
    assert_equal(inp, np.full(2, float(prv(rank, world_size))))


@pytest.mark.parametrize("tag", [1.0, "1", True, None], ids=["float", "str", "bool", "None"])
def test_tag_of_wrong_type_raises_type_error(tag, make, rank):
    x = make.zeros(2)
    with pytest.raises(TypeError, match="tag"):
        dist.isend(x, dst=rank, tag=tag)
    with pytest.raises(TypeError, match="tag"):
        dist.irecv(x, src=rank, tag=tag)


def test_numpy_integer_tag_and_peer_are_accepted(make, rank, world_size):
    out, inp = make(np.array([rank], np.int64)), make.zeros(1, np.int64)
    rw = dist.irecv(inp, src=np.int64(prv(rank, world_size)), tag=np.int32(11))
    dist.isend(out, dst=np.int16(nxt(rank, world_size)), tag=np.uint8(11)).wait()
    rw.wait()
    assert_equal(inp, np.array([prv(rank, world_size)], np.int64))


# ---------------------------------------------------------------------------------------------
# Works
# ---------------------------------------------------------------------------------------------


def test_isend_irecv_works(make, rank, world_size):
    out = make(np.arange(5, dtype=np.float32) + rank)
    inp = make.zeros(5, np.float32)
    rw = dist.irecv(inp, src=prv(rank, world_size), tag=2)
    sw = dist.isend(out, dst=nxt(rank, world_size), tag=2)
    assert isinstance(rw, dist.Work) and isinstance(sw, dist.Work)
    deadline = time.monotonic() + 60
    while not (rw.is_completed() and sw.is_completed()):
        assert time.monotonic() < deadline, "is_completed() never became True"
    assert rw.is_completed() and sw.is_completed()  # stays True
    assert rw.wait() is True and sw.wait() is True  # wait after completion returns at once
    assert rw.is_success() and sw.is_success()
    assert rw.exception() is None
    assert rw.result()[0] is inp
    assert sw.result()[0] is out
    assert_equal(inp, np.arange(5, dtype=np.float32) + prv(rank, world_size))


def test_wait_then_is_completed(make, rank, world_size):
    inp = make.zeros(3, np.uint8)
    rw = dist.irecv(inp, src=prv(rank, world_size))
    sw = dist.isend(make(np.full(3, rank, np.uint8)), dst=nxt(rank, world_size))
    sw.wait()
    rw.wait()
    assert rw.is_completed() and sw.is_completed()
    assert_equal(inp, np.full(3, prv(rank, world_size), np.uint8))


# ---------------------------------------------------------------------------------------------
# self, sizes, layouts
# ---------------------------------------------------------------------------------------------


def test_blocking_send_recv_to_self_raise_value_error(make, rank):
    x = make.zeros(3)
    with pytest.raises(ValueError):
        dist.send(x, dst=rank)
    with pytest.raises(ValueError):
        dist.recv(x, src=rank)
    with pytest.raises(ValueError):
        dist.send(x, group_dst=rank)
    with pytest.raises(ValueError):
        dist.recv(x, group_src=rank)
    assert_equal(x, np.zeros(3))


def test_isend_irecv_to_self(make, rank):
    values = rank_input(rank, (2, 3), np.dtype(np.complex128))
    out = make(values)
    inp = make.zeros((2, 3), np.complex128)
    rw = dist.irecv(inp, src=rank, tag=1)  # receive posted first
    sw = dist.isend(out, dst=rank, tag=1)
    sw.wait()
    rw.wait()
    assert_equal(inp, values)
    inp2 = make.zeros((2, 3), np.complex128)
    sw = dist.isend(make(values * 2), dst=rank, tag=2)  # send posted first
    rw = dist.irecv(inp2, src=rank, tag=2)
    rw.wait()
    sw.wait()
    assert_equal(inp2, values * 2)


#: (what is sent, its dtype) to a receive of 5 float64: shorter, longer, not a whole number of float64
OTHER_SIZES = {"shorter": (3, np.float64), "longer": (8, np.float64), "ragged": (7, np.int8)}


def _size_message(rank_from: int, sent: int, dtype: Any) -> str:
    arrived = f"{sent * np.dtype(dtype).itemsize} bytes" if dtype != np.float64 else str(sent)
    return (
        f"recv: expected 5 elements of float64 from rank {rank_from} (group rank) but {arrived} arrived; "
        "sizes must match"
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", list(OTHER_SIZES))
def test_recv_of_another_size_raises_and_leaves_the_array_untouched(case, make, rank, world_size):
    """Blocking recv matches the message before writing: one of another size raises a ValueError that names
    both sizes, writes nothing into the array, and the next message (of the right size) arrives in it."""
    sent, dtype = OTHER_SIZES[case]
    c = Checks()
    wrong = dist.isend(make(np.arange(sent).astype(dtype)), dst=nxt(rank, world_size), tag=3)
    right = dist.isend(make(np.arange(5.0) + rank), dst=nxt(rank, world_size), tag=3)
    inp = make(np.full(5, -1.0))
    c.raises(ValueError, "^" + re.escape(_size_message(prv(rank, world_size), sent, dtype)) + "$",
             dist.recv, inp, src=prv(rank, world_size), tag=3)  # fmt: skip
    c.equal("the array after the error", inp, np.full(5, -1.0))
    c.equal("recv's return", dist.recv(inp, src=prv(rank, world_size), tag=3), prv(rank, world_size))
    c.equal("the next message", inp, np.arange(5.0) + prv(rank, world_size))
    wrong.wait()
    right.wait()
    c.done()


@pytest.mark.parametrize("case", ["shorter", "longer"])
def test_irecv_of_another_size_raises_having_written_what_mpi_wrote(case, make, rank, world_size):
    """A posted receive (irecv) is matched by MPI, which writes the message before its size can be checked
    (docs/sharp-bits.md): the wait raises a ValueError naming both sizes; a shorter message's elements fill
    the start of a host array, the rest is untouched (a staged device array is untouched: it is written back
    only on success); the next message arrives whole. At every world size (rank 0 alone talks to itself)."""
    sent = OTHER_SIZES[case][0]
    src, dst = prv(rank, world_size), nxt(rank, world_size)
    c = Checks()
    inp = make(np.full(5, -1.0))
    rw = dist.irecv(inp, src=src, tag=4)
    sw = dist.isend(make(np.arange(sent, dtype=np.float64) + 10 * rank), dst=dst, tag=4)
    sw.wait()
    if case == "shorter":
        want = re.escape(_size_message(src, sent, np.float64))
    else:
        want = re.escape(f"recv: a message from rank {src} (group rank) is larger than the 5 elements of float64 "
                         "expected; sizes must match")  # fmt: skip
    c.raises(ValueError, "^" + want + "$", rw.wait)
    c.true("the failed Work reports its ValueError", isinstance(rw.exception(), ValueError) and not rw.is_success())
    if case == "shorter":
        written = np.full(5, -1.0)
        if not make.kind.device:
            written[:sent] = np.arange(sent) + 10 * src
        c.equal("the array after the error", inp, written)
    rw = dist.irecv(inp, src=src, tag=4)
    dist.isend(make(np.arange(5.0) + 10 * rank), dst=dst, tag=4).wait()
    rw.wait()
    c.equal("the next message", inp, np.arange(5.0) + 10 * src)
    c.done()


def test_noncontiguous_receive_arrays_are_filled(make, rank, world_size):
    p = prv(rank, world_size)
    strided = make(np.full(10, -1, np.int64))
    every_other = strided[::2]
    transposed = reverse_axes(make(np.full((4, 3), -1.0)))  # (3, 4), Fortran-ordered view
    rws = [
        dist.irecv(every_other, src=p, tag=1),
        dist.irecv(transposed, src=p, tag=2),
    ]
    sws = [
        dist.isend(make(np.arange(5, dtype=np.int64) + 10 * rank), dst=nxt(rank, world_size), tag=1),
        dist.isend(make(np.arange(12.0).reshape(3, 4) + rank), dst=nxt(rank, world_size), tag=2),
    ]
    for w in rws + sws:
        w.wait()
    assert_equal(strided[::2], np.arange(5, dtype=np.int64) + 10 * p)
    assert_equal(strided[1::2], np.full(5, -1, np.int64))  # the gaps are untouched
    assert_equal(transposed, np.arange(12.0).reshape(3, 4) + p)
    assert rws[0].result()[0] is every_other  # result() gives back the caller's view
    assert rws[1].result()[0] is transposed


@pytest.mark.mpi(min_size=2)
def test_blocking_recv_into_noncontiguous_and_send_from_noncontiguous(make, rank, world_size):
    base = make(np.arange(24, dtype=np.float32).reshape(4, 6) + 100 * rank)
    out = base[:, 1::2]  # (4, 3), strided
    buf = make(np.full((3, 8), -1, np.float32))
    inp = reverse_axes(buf[:, ::2])  # (4, 3) view with gaps
    src = ring_blocking(out, inp, rank, world_size)
    p = prv(rank, world_size)
    assert src == p
    assert_equal(inp, (np.arange(24, dtype=np.float32).reshape(4, 6) + 100 * p)[:, 1::2])
    assert_equal(buf[:, 1::2], np.full((3, 4), -1, np.float32))


@pytest.mark.parametrize("family", list(FAMILIES), ids=list(FAMILIES))
def test_zero_dim_and_empty_arrays(family, make, rank, world_size):
    dtype = FAMILIES[family]
    scalar_in = make.zeros((), dtype)
    empty_in = make.zeros((0, 3), dtype)
    rws = [
        dist.irecv(scalar_in, src=prv(rank, world_size), tag=1),
        dist.irecv(empty_in, src=prv(rank, world_size), tag=2),
    ]
    sws = [
        dist.isend(make.input(rank, (), dtype), dst=nxt(rank, world_size), tag=1),
        dist.isend(make.zeros((0, 3), dtype), dst=nxt(rank, world_size), tag=2),
    ]
    for w in rws + sws:
        w.wait()
    assert_equal(scalar_in, rank_input(prv(rank, world_size), (), dtype))
    assert tuple(empty_in.shape) == (0, 3)


def test_readonly_receive_array_raises(rank):
    x = np.zeros(3)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        dist.irecv(x, src=rank)


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, np.float64(1.0), np.array([object()], dtype=object)],
                         ids=["list", "float", "npscalar", "object"])  # fmt: skip
def test_send_of_non_array_raises_type_error(bad, rank):
    with pytest.raises(TypeError):
        dist.isend(bad, dst=rank)
    with pytest.raises(TypeError):
        dist.irecv(bad, src=rank)


# ---------------------------------------------------------------------------------------------
# P2POp and batch_isend_irecv
# ---------------------------------------------------------------------------------------------


def test_batch_isend_irecv_ring_of_the_spec(make, rank, world_size):
    send_tensor = make(np.arange(2) + 2 * rank)
    recv_tensor = make.zeros(2, np.arange(2).dtype)
    send_op = dist.P2POp(dist.isend, send_tensor, (rank + 1) % world_size)
    recv_op = dist.P2POp(dist.irecv, recv_tensor, (rank - 1 + world_size) % world_size)
    reqs = dist.batch_isend_irecv([send_op, recv_op])
    assert len(reqs) == 2 and all(isinstance(r, dist.Work) for r in reqs)
    for req in reqs:
        req.wait()
    assert_equal(recv_tensor, np.arange(2) + 2 * prv(rank, world_size))


def test_batch_isend_irecv_several_ops_per_peer(make, rank, world_size):
    """Three messages each way around the ring, in one batch, receives listed before sends."""
    n, k = world_size, 3
    fwd_in = [make.zeros(4, np.int64) for _ in range(k)]
    bwd_in = [make.zeros(4, np.float64) for _ in range(k)]
    ops = [dist.P2POp(dist.irecv, b, prv(rank, n), tag=1) for b in fwd_in]
    ops += [dist.P2POp(dist.irecv, b, nxt(rank, n), tag=2) for b in bwd_in]
    ops += [dist.P2POp(dist.isend, make(np.full(4, 10 * rank + i, np.int64)), nxt(rank, n), tag=1) for i in range(k)]
    ops += [dist.P2POp(dist.isend, make(np.full(4, -10.0 * rank - i)), prv(rank, n), tag=2) for i in range(k)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == len(ops)
    for w in works:
        w.wait()
    for i in range(k):
        assert_equal(fwd_in[i], np.full(4, 10 * prv(rank, n) + i, np.int64))
        assert_equal(bwd_in[i], np.full(4, -10.0 * nxt(rank, n) - i))


def test_batch_isend_irecv_tags_match_across_order(make, rank, world_size):
    """Sends with tags 1, 2 against receives listed with tags 2, 1."""
    n = world_size
    a, b = make.zeros(2, np.int32), make.zeros(2, np.int32)
    ops = [
        dist.P2POp(dist.isend, make(np.array([rank, 1], np.int32)), nxt(rank, n), tag=1),
        dist.P2POp(dist.isend, make(np.array([rank, 2], np.int32)), nxt(rank, n), tag=2),
        dist.P2POp(dist.irecv, b, prv(rank, n), tag=2),
        dist.P2POp(dist.irecv, a, prv(rank, n), tag=1),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert_equal(a, np.array([prv(rank, n), 1], np.int32))
    assert_equal(b, np.array([prv(rank, n), 2], np.int32))


def test_batch_isend_irecv_noncontiguous_receive(make, rank, world_size):
    n = world_size
    buf = make(np.full((2, 6), -1, np.int16))
    view = buf[:, ::3]
    ops = [
        dist.P2POp(dist.irecv, view, prv(rank, n)),
        dist.P2POp(dist.isend, make(np.arange(4, dtype=np.int16).reshape(2, 2) + rank), nxt(rank, n)),
    ]
    works = dist.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    assert_equal(buf[:, ::3], np.arange(4, dtype=np.int16).reshape(2, 2) + prv(rank, n))
    assert_equal(buf[:, 1::3], np.full((2, 2), -1, np.int16))
    assert_equal(buf[:, 2::3], np.full((2, 2), -1, np.int16))
    assert works[0].result()[0] is view


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("by", ["group_peer", "peer"])
def test_batch_isend_irecv_on_subgroup(by, make, rank, world_size):
    """A ring over the ranks 1..n-1 (group rank != global rank); rank 0 is not a member."""
    members = list(range(1, world_size))
    g = dist.new_group(members)
    if rank == 0:
        assert g is dist.GroupMember.NON_GROUP_MEMBER
        x = make.zeros(2)
        send_op = dist.P2POp(dist.isend, x, 1, group=g)
        recv_op = dist.P2POp(dist.irecv, x, group_peer=0, group=g)
        assert dist.batch_isend_irecv([send_op, recv_op]) == []
        assert_equal(x, np.zeros(2))
        return
    me, m = rank - 1, world_size - 1
    inp = make.zeros(3, np.int64)
    out = make(np.array([rank, me, 7], np.int64))
    if by == "group_peer":
        ops = [
            dist.P2POp(dist.isend, out, group=g, group_peer=nxt(me, m)),
            dist.P2POp(dist.irecv, inp, group=g, group_peer=prv(me, m)),
        ]
    else:
        ops = [
            dist.P2POp(dist.isend, out, members[nxt(me, m)], group=g),
            dist.P2POp(dist.irecv, inp, members[prv(me, m)], group=g),
        ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert_equal(inp, np.array([members[prv(me, m)], prv(me, m), 7], np.int64))
    assert (dist.get_rank(g), dist.get_world_size(g)) == (me, m)
    assert ops[0].peer == members[nxt(me, m)] and ops[0].group_peer == nxt(me, m)
    assert ops[1].peer == members[prv(me, m)] and ops[1].group_peer == prv(me, m)


def test_p2pop_validation(make, rank, world_size):
    x = make.zeros(2)
    for bad_op in (dist.send, dist.recv, dist.all_reduce, lambda *a, **k: None, "isend"):
        with pytest.raises(ValueError):
            dist.P2POp(bad_op, x, rank)
    with pytest.raises(ValueError):
        dist.P2POp(dist.isend, x)  # no peer
    with pytest.raises(ValueError):
        dist.P2POp(dist.irecv, x, None, group_peer=None)
    with pytest.raises(ValueError):
        dist.P2POp(dist.isend, x, rank, group_peer=rank)  # both
    with pytest.raises(dist.RankNotInGroupError):
        dist.P2POp(dist.isend, x, world_size)  # not a rank of the world
    with pytest.raises(dist.RankNotInGroupError):
        dist.P2POp(dist.isend, x, group_peer=world_size)
    op = dist.P2POp(dist.isend, x, rank, tag=5)
    assert op.op is dist.isend and op.tensor is x and op.peer == rank and op.tag == 5 and op.group is None


def test_batch_isend_irecv_validation(make, rank):
    x = make.zeros(2)
    not_ops = r"^batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp$"
    with pytest.raises(ValueError, match=not_ops):
        dist.batch_isend_irecv([])
    with pytest.raises(ValueError, match=not_ops):
        dist.batch_isend_irecv((dist.P2POp(dist.isend, x, rank),))  # a tuple, not a list
    with pytest.raises(ValueError, match=not_ops):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, x, rank), "not an op"])
    with pytest.raises(ValueError, match=not_ops):
        dist.batch_isend_irecv(["not an op", dist.P2POp(dist.isend, x, rank)])
    with pytest.raises(ValueError, match=not_ops):
        dist.batch_isend_irecv(dist.P2POp(dist.isend, x, rank))  # a single op, not a list


def test_batch_isend_irecv_validates_every_op_before_posting(make, rank, world_size):
    """A bad op anywhere in the list: ValueError, and none of the valid ops was posted. P2POp refuses such
    arguments itself, so the bad ops are valid ones whose attributes were changed afterwards."""
    n = world_size
    stolen = make(np.full(2, -5.0))
    bad = [
        dist.P2POp(dist.irecv, stolen, prv(rank, n), tag=3),  # valid; must not be posted
        dist.P2POp(dist.isend, make(np.ones(2)), nxt(rank, n), tag=3),
    ]
    bad[1].tag = -1  # invalid tag
    with pytest.raises(ValueError, match=r"^batch_isend_irecv: p2p_op_list\[1\] \(isend\): tag must be between 0 and"):
        dist.batch_isend_irecv(bad)
    bad2 = [
        dist.P2POp(dist.irecv, stolen, prv(rank, n), tag=3),
        dist.P2POp(dist.isend, make(np.ones(2)), nxt(rank, n), tag=3),
    ]
    bad2[1].tensor = [1.0, 2.0]  # not an array
    with pytest.raises(TypeError, match=r"^batch_isend_irecv: p2p_op_list\[1\] \(isend\): tensor "):
        dist.batch_isend_irecv(bad2)
    inp = make.zeros(2)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.irecv, inp, prv(rank, n), tag=3),
            dist.P2POp(dist.isend, make(np.full(2, float(rank))), nxt(rank, n), tag=3),
        ]
    )
    for w in works:
        w.wait()
    assert_equal(inp, np.full(2, float(prv(rank, n))))
    assert_equal(stolen, np.full(2, -5.0))


@pytest.mark.mpi(min_size=2)
def test_batch_isend_irecv_ops_of_different_groups_raise(make, rank, world_size):
    g = dist.new_group(None)
    x = make.zeros(2)
    same = r"^batch_isend_irecv: all operations must use the same group$"
    with pytest.raises(ValueError, match=same):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, x, rank), dist.P2POp(dist.irecv, x, rank, group=g)])
    with pytest.raises(ValueError, match=same):  # an op of another group after two of one group
        dist.batch_isend_irecv([dist.P2POp(dist.isend, x, rank, group=g), dist.P2POp(dist.irecv, x, rank, group=g),
                                dist.P2POp(dist.irecv, x, rank)])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# groups: global vs group ranks, non-members
# ---------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("by_group", [True, False], ids=["group_dst_src", "dst_src"])
def test_send_recv_in_subgroup(by_group, make, rank, world_size):
    """Ring over the ranks 1..n-1; recv returns the sender's *global* rank either way."""
    members = list(range(1, world_size))
    g = dist.new_group(members)
    if rank == 0:
        return
    me, m = dist.get_rank(g), dist.get_world_size(g)
    out = make(np.array([rank, me], np.int64))
    inp = make.zeros(2, np.int64)
    src = ring_blocking(out, inp, me, m, group=g, by_group=by_group)
    assert src == members[prv(me, m)]
    assert_equal(inp, np.array([members[prv(me, m)], prv(me, m)], np.int64))


@pytest.mark.mpi(min_size=3)
def test_recv_any_source_in_subgroup_returns_global_rank(make, rank, world_size):
    members = list(range(1, world_size))
    g = dist.new_group(members)
    if rank == 0:
        return
    me, m = dist.get_rank(g), dist.get_world_size(g)
    sw = dist.isend(make(np.array([rank], np.int64)), group=g, group_dst=nxt(me, m), tag=6)
    inp = make.zeros(1, np.int64)
    src = dist.recv(inp, group=g, tag=6)
    sw.wait()
    assert src == members[prv(me, m)]
    assert_equal(inp, np.array([src], np.int64))


@pytest.mark.mpi(min_size=2)
def test_isend_irecv_in_subgroup_with_group_ranks(make, rank, world_size):
    """Odd ranks only; at world size 2 or 3 the group is a single rank that talks to itself."""
    members = list(range(1, world_size, 2))
    g = dist.new_group(members)
    if rank % 2 == 0:
        assert g is dist.GroupMember.NON_GROUP_MEMBER
        return
    me, m = members.index(rank), len(members)
    inp = make.zeros(2, np.float64)
    rw = dist.irecv(inp, group=g, group_src=prv(me, m))
    sw = dist.isend(make(np.array([rank, me], np.float64)), group=g, group_dst=nxt(me, m))
    sw.wait()
    rw.wait()
    assert_equal(inp, np.array([members[prv(me, m)], prv(me, m)], np.float64))
    assert (dist.get_rank(g), dist.get_world_size(g)) == (me, m)


@pytest.mark.mpi(min_size=2)
def test_peer_outside_subgroup_raises(make, rank, world_size):
    members = list(range(1, world_size))
    g = dist.new_group(members)
    if rank == 0:
        return
    x = make.zeros(2)
    for call, key in ((dist.send, "dst"), (dist.isend, "dst"), (dist.recv, "src"), (dist.irecv, "src")):
        with pytest.raises(dist.RankNotInGroupError) as info:
            call(x, group=g, **{key: 0})  # global rank 0 is not a member
        assert isinstance(info.value, ValueError)
        with pytest.raises(dist.RankNotInGroupError):
            call(x, group=g, **{f"group_{key}": len(members)})  # group rank out of range
        with pytest.raises(ValueError):
            call(x, group=g, **{key: rank, f"group_{key}": 0})  # both given
    with pytest.raises(ValueError):
        dist.send(x, group=g)  # no destination at all


@pytest.mark.mpi(min_size=2)
def test_p2p_non_members_get_none_and_minus_one(make, rank, world_size):
    g = dist.new_group(list(range(1, world_size)))
    x = make(np.full(3, 7.0))
    if rank == 0:
        assert dist.send(x, dst=1, group=g) is None
        assert dist.recv(x, src=1, group=g) == -1
        assert dist.recv(x, group=g) == -1
        assert dist.isend(x, dst=1, group=g) is None
        assert dist.irecv(x, src=1, group=g) is None
        assert dist.irecv(x, group=g) is None
        assert_equal(x, np.full(3, 7.0))


@pytest.mark.mpi(min_size=2)
def test_messages_on_different_groups_do_not_mix(make, rank, world_size):
    """Same peer, same tag, two groups: each receive gets its own group's message."""
    n = world_size
    g = dist.new_group(None)
    sw_world = dist.isend(make(np.array([rank, 0], np.int64)), dst=nxt(rank, n), tag=0)
    sw_group = dist.isend(make(np.array([rank, 1], np.int64)), dst=nxt(rank, n), group=g, tag=0)
    from_group, from_world = make.zeros(2, np.int64), make.zeros(2, np.int64)
    senders = [
        dist.recv(from_group, src=prv(rank, n), group=g),  # posted in the reverse order
        dist.recv(from_world, src=prv(rank, n)),
    ]
    sw_world.wait()
    sw_group.wait()
    assert senders == [prv(rank, n)] * 2
    assert_equal(from_group, np.array([prv(rank, n), 1], np.int64))
    assert_equal(from_world, np.array([prv(rank, n), 0], np.int64))


def test_p2p_on_destroyed_group_raises(make, rank):
    g = dist.new_group(None)
    dist.destroy_process_group(g)
    x = make.zeros(1)
    with pytest.raises(RuntimeError):
        dist.isend(x, dst=rank, group=g)
    with pytest.raises(RuntimeError):
        dist.irecv(x, src=rank, group=g)
    with pytest.raises(RuntimeError):
        dist.P2POp(dist.isend, x, rank, group=g)


def test_group_of_wrong_type_raises_type_error(make, rank):
    with pytest.raises(TypeError):
        dist.isend(make.zeros(1), dst=rank, group="world")


# ---------------------------------------------------------------------------------------------
# the common case's fast path (p2p.py): it takes only what the general path takes as it is
# ---------------------------------------------------------------------------------------------


def _bad_calls(rank: int, n: int) -> list[tuple[str, Any, dict]]:
    """Calls every route must refuse before any MPI call: (function, tensor, keywords)."""
    peer, readonly = (rank + 1) % n, np.zeros(3)
    readonly.flags.writeable = False
    calls: list[tuple[str, Any, dict]] = []
    for fn in ("send", "recv", "isend", "irecv"):
        key = "dst" if "send" in fn else "src"
        other = "group_dst" if "send" in fn else "group_src"
        x = np.zeros(3)
        calls += [
            (fn, [1.0, 2.0, 3.0], {key: peer}),
            (fn, np.ma.masked_array(np.zeros(3)), {key: peer}),
            (fn, np.array([object()] * 3, dtype=object), {key: peer}),
            (fn, np.zeros(3, "U2"), {key: peer}),
            (fn, x, {key: n}),  # not a member
            (fn, x, {key: -1}),
            (fn, x, {key: float(peer)}),
            (fn, x, {key: str(peer)}),
            (fn, x, {key: peer, other: 0}),  # both
            (fn, x, {key: peer, "tag": -1}),
            (fn, x, {key: peer, "tag": TAG_UB + 1}),
            (fn, x, {key: peer, "tag": 1.0}),
            (fn, x, {key: peer, "tag": True}),
            (fn, x, {key: peer, "tag": "0"}),
        ]
        if "send" in fn:
            calls.append((fn, x, {}))  # no destination
        else:
            calls.append((fn, readonly, {key: peer}))
            calls.append((fn, readonly, {}))  # any source
        if fn in ("send", "recv"):
            calls.append((fn, x, {key: rank}))  # to/from itself: would deadlock
    return calls


def _refusal(fn: str, tensor: Any, kw: dict) -> tuple[type, str]:
    try:
        getattr(dist, fn)(tensor, **kw)
    except (TypeError, ValueError, RuntimeError) as exc:
        return type(exc), str(exc)
    raise AssertionError(f"{fn}({tensor!r}, {kw}) did not raise")


def test_fast_path_refuses_each_bad_input_as_the_general_path(rank, world_size):
    # group=None may take the fast path; group=dist.group.WORLD (the same group) always takes the general one
    for fn, tensor, kw in _bad_calls(rank, world_size):
        fast = _refusal(fn, tensor, kw)
        general = _refusal(fn, tensor, {**kw, "group": dist.group.WORLD})
        assert fast == general, (fn, kw, fast, general)
    # nothing was posted: an exchange still pairs up
    out, inp = np.full(2, float(rank)), np.zeros(2)
    rw = dist.irecv(inp, src=prv(rank, world_size))
    dist.isend(out, dst=nxt(rank, world_size)).wait()
    rw.wait()
    assert_equal(inp, np.full(2, float(prv(rank, world_size))))


def test_common_case_takes_the_fast_path(monkeypatch, rank, world_size):
    # a ready numpy array to an int rank of the default group never reaches the general path's checks
    from mpidist import p2p

    def general(*args: Any) -> None:
        raise AssertionError("the general path ran")

    for name in ("resolve_group", "prepare_input", "prepare_output", "tag_value"):
        monkeypatch.setattr(p2p, name, general)
    out, inp = np.arange(4.0) + rank, np.zeros(4)
    rw = dist.irecv(inp, src=prv(rank, world_size), tag=3)
    assert dist.isend(out, dst=nxt(rank, world_size), tag=3).wait()
    assert rw.wait() and rw.result()[0] is inp
    assert_equal(inp, np.arange(4.0) + prv(rank, world_size))
    if world_size > 1:
        got = np.zeros(4)
        for tag, src in ((0, prv(rank, world_size)), (TAG_UB, None)):  # a peer, and any source
            if rank % 2 == 0:
                dist.send(out, dst=nxt(rank, world_size), tag=tag)
                assert dist.recv(got, src=src, tag=tag) == prv(rank, world_size)
            else:
                assert dist.recv(got, src=src, tag=tag) == prv(rank, world_size)
                dist.send(out, dst=nxt(rank, world_size), tag=tag)
            assert_equal(got, np.arange(4.0) + prv(rank, world_size))


# ---------------------------------------------------------------------------------------------
# the lighter Work of isend/irecv (backends/_direct_posted.c): every method of a Work
# ---------------------------------------------------------------------------------------------


def _made_in_c(w: Any) -> bool:
    return type(w).__name__ == "Posted"


@pytest.mark.mpi(min_size=2)
def test_isend_irecv_work_made_in_c_is_a_whole_work(rank, world_size):
    """Where the C calls are bound, isend/irecv of a numpy array return a Work made in C; waited for late
    (its C tests run out), with keywords, with a bad timeout, through its future and its source, it behaves
    as the Python Work it becomes, and as a Work of the general path (group=WORLD) does."""
    from mpidist.backends.direct import direct_status

    c = Checks()
    peer = 1 - rank if rank < 2 else None
    if peer is not None:
        inp, out = np.zeros(3), np.arange(3.0) + rank
        first = dist.irecv(inp, tag=21)  # any source; completes only after the sender's nap
        c.true(f"made in C iff the C calls are bound: {type(first)}", _made_in_c(first) == (direct_status() == "direct"))
        c.true("a Work to isinstance", isinstance(first, dist.Work))
        c.raises(ValueError, "timeout", first.wait, timeout=-1.0)  # checked, and the Work stays usable
        if rank == 1:
            time.sleep(0.2)  # rank 0 waits longer than its C tests
        sw = dist.isend(out, dst=peer, tag=21)
        c.true("wait", first.wait() is True and sw.wait(timeout=30) is True)
        c.equal("received", inp, np.arange(3.0) + peer)
        c.equal("source_rank", first.source_rank(), peer)
        c.true("result is the caller's array", first.result()[0] is inp and sw.result()[0] is out)
        c.true("future", first.get_future().wait()[0] is inp)
        c.true("success", first.is_success() and first.exception() is None and sw.is_success())
        c.true(f"repr {first!r}", "recv" in repr(first))
        # completed before the first wait: is_completed polls it done
        inp2 = np.zeros(3)
        rw = dist.irecv(inp2, src=peer, tag=22)
        dist.isend(out, dst=peer, tag=22).wait()
        deadline = time.monotonic() + 30
        while not rw.is_completed() and time.monotonic() < deadline:
            pass
        c.true("is_completed then wait", rw.is_completed() and rw.wait() is True)
        c.equal("received (polled)", inp2, np.arange(3.0) + peer)
    c.done()


@pytest.mark.mpi(min_size=2)
def test_dropped_irecv_made_in_c_keeps_its_array_for_mpi(rank, world_size):
    """An irecv dropped unwaited: its array stays referenced while MPI may write into it (owner.abandoned), and
    the message goes into it; the group is destroyed cleanly afterwards."""
    import gc
    import weakref

    c = Checks()
    if rank < 2:
        inp = np.zeros(1 << 14)
        ref = weakref.ref(inp)
        dist.irecv(inp, src=1 - rank, tag=23)  # dropped at once
        del inp
        gc.collect()
        c.true("the array lives on while the receive is pending", ref() is not None)
        dist.send(np.full(1 << 14, 7.0 + rank), dst=1 - rank, tag=23)
        kept = ref()
        deadline = time.monotonic() + 30
        while kept is not None and kept[-1] != 8.0 - rank and time.monotonic() < deadline:
            MPI.COMM_WORLD.Iprobe()  # MPI's progress
        c.true("the message arrived in the dropped receive's array", kept is not None and kept[-1] == 8.0 - rank)
    c.done()


def test_batch_of_ready_numpy_arrays_skips_the_general_checks(monkeypatch, rank, world_size):
    """P2POp and batch_isend_irecv take a ready numpy array, an int peer of the default group and a tag in range
    as they are (as isend does), without the general path's checks; the result is the same."""
    from mpidist import p2p

    def general(*args: Any) -> None:
        raise AssertionError("the general path ran")

    for name in ("adapt", "prepare_input", "prepare_output", "tag_value"):
        monkeypatch.setattr(p2p, name, general)
    out, inp = np.arange(4.0) + rank, np.zeros(4)
    ops = [dist.P2POp(dist.isend, out, nxt(rank, world_size), tag=5),
           dist.P2POp(dist.irecv, inp, prv(rank, world_size), tag=5)]  # fmt: skip
    works = dist.batch_isend_irecv(ops)
    assert [w.wait() for w in works] == [True, True]
    assert works[1].result()[0] is inp
    assert_equal(inp, np.arange(4.0) + prv(rank, world_size))
    assert (ops[0].peer, ops[0].group_peer, ops[0].tag) == (nxt(rank, world_size), nxt(rank, world_size), 5)


@pytest.mark.mpi(min_size=2)
def test_the_small_blocking_recv_counts_its_copy_out_of_the_scratch_buffer(rank):
    """A blocking recv of at most ``direct.scratch_max()`` bytes receives through the C calls' scratch buffer and
    copies into the array: that copy is counted in ``world.stats`` (one per message, of its bytes), whether the
    message was there at once or came late (the pending route finishes in Python); a larger recv, a send and an
    irecv copy nothing."""
    from mpidist._world import world
    from mpidist.backends import direct

    from helpers import copies

    small = direct.scratch_max() if direct.bind().module is not None else 0
    c = Checks()
    if rank < 2:
        peer = 1 - rank
        for nbytes, late in [(64, False), (4096, True), (small or 4096, False), (max(small, 4096) * 4, False)]:
            x = np.zeros(nbytes // 8)
            before, before_bytes = copies(), world.stats.copied_bytes
            if rank == 0:
                if late:
                    time.sleep(0.05)
                dist.send(np.arange(nbytes // 8, dtype=np.float64), dst=peer, tag=31)
                c.equal(f"{nbytes} B: copies counted by a send", copies() - before, 0)
            else:
                dist.recv(x, src=peer, tag=31)
                c.true(f"{nbytes} B: the message", bool((x == np.arange(nbytes // 8)).all()))
                counted = 1 if nbytes <= small else 0
                c.equal(f"{nbytes} B{' (late)' if late else ''}: copies counted", copies() - before, counted)
                c.equal(f"{nbytes} B: bytes counted", world.stats.copied_bytes - before_bytes, counted * nbytes)
        before = copies()
        x = np.zeros(8)
        w = dist.irecv(x, src=peer, tag=32) if rank == 1 else dist.isend(np.ones(8), dst=peer, tag=32)
        w.wait()
        c.equal("copies counted by isend/irecv", copies() - before, 0)
    c.done()


def test_a_batch_of_ready_numpy_arrays_is_posted_as_isend_and_irecv_are(monkeypatch, rank, world_size):
    """A batch of P2POps of the default group on ready numpy arrays goes straight to the backend's isend_fast and
    irecv_fast (ProcessGroup.batch_fast), not through batch_p2p; one op that is not ready (a non-contiguous
    array), or a backend that groups a batch's operations (its own coalescing()), sends the whole batch the general
    way. The results are the same."""
    from mpidist.backends.mpi import MPIBackend
    from mpidist.process_group import ProcessGroup

    general = []
    real = ProcessGroup.batch_p2p

    def counted(self, ops):
        general.append(len(ops))
        return real(self, ops)

    monkeypatch.setattr(ProcessGroup, "batch_p2p", counted)

    def ring(out_of: Any, salt: int) -> None:
        out = out_of(np.arange(6.0) + 10 * rank + salt)
        inp = np.zeros(6)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt(rank, world_size), tag=7),
                                        dist.P2POp(dist.irecv, inp, prv(rank, world_size), tag=7)])  # fmt: skip
        assert [w.wait() for w in works] == [True, True]
        assert_equal(inp, np.arange(6.0) + 10 * prv(rank, world_size) + salt)

    ring(lambda a: a, 1)
    assert general == [], general
    ring(lambda a: np.stack([a, a], axis=1)[:, 0], 2)  # a strided view: the general path stages it
    assert general == [2], general

    @contextlib.contextmanager
    def grouped():
        yield

    monkeypatch.setattr(MPIBackend, "coalescing", lambda self: grouped(), raising=False)
    ring(lambda a: a, 3)
    assert general == [2, 2], general
