"""Point-to-point: ``send``, ``recv``, ``isend``, ``irecv``, ``P2POp``, ``batch_isend_irecv``.

Peers are global ranks (``dst``/``src``/``peer``) or group ranks
(``group_dst``/``group_src``/``group_peer``). Messages match by (group, source,
tag) in the order they were posted, as in MPI. A receive checks that the message
has exactly the receiving array's size (what a message of another size leaves
in the array: docs/sharp-bits.md); ``recv(src=None)`` takes a message from any
rank and returns the sender's global rank.
"""

from __future__ import annotations

from typing import Any, Callable

from numpy import ndarray

from ._args import tag_value
from ._world import world
from .arrays.dtypes import DTYPES
from .arrays.host import Buffer, adapt, prepare_input, prepare_output
from .process_group import Backs, ProcessGroup, resolve_group
from .work import Work

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]

_DST = ("dst", "group_dst")
_SRC = ("src", "group_src")

# The common case, decided in a few operations before any function call: a C-contiguous numpy array
# of a supported dtype (what prepare_input/prepare_output return as they are), an int global rank of
# the default group other than this rank, an int tag in range, and the group's host route (process_group.py's
# table of the common case; empty once the group refuses calls). Anything else, every bad input among
# it, takes the general path below, which raises the errors: the fast path never raises one of its own.
# ``_group_of``/``_route``/``_rank`` are ProcessGroup's own tables (what root_rank and the route read).


def _not_self(pg: ProcessGroup, peer: int, fn: str, what: str) -> None:
    if peer == pg.rank():
        raise ValueError(
            f"{fn}: the {what} rank is this process itself; a blocking {fn} to self would "
            f"deadlock (use i{fn} with a matching receive/send, or another rank)"
        )


def _start_send(pg: ProcessGroup, tensor: Any, peer: int, tag: Any, fn: str) -> Work:
    buf = prepare_input(tensor, fn, "tensor")
    w = pg.send(buf, peer, tag_value(tag, fn))
    w.with_outputs([tensor])
    return w


def _start_recv(pg: ProcessGroup, tensor: Any, peer: int | None, tag: Any, fn: str) -> Work:
    buf, target = prepare_output(tensor, fn, "tensor")
    w = pg.recv(buf, None if target is None else [(buf, target)], peer, tag_value(tag, fn))
    w.with_outputs([tensor])
    return w


def isend(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Start sending ``tensor`` to ``dst``; returns a Work (None if not a member of ``group``).

    Do not modify ``tensor`` until the Work completes.

    Args:
        tensor: The array to send (numpy, torch tensor or GPU array).
        dst: The receiving rank, as a global rank. Give ``dst`` or ``group_dst``.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        tag: Matches this message with a receive of the same tag (from 0 to MPI's
            ``MPI_TAG_UB``).
        group_dst: The receiving rank as a rank of ``group``, instead of ``dst``.

    Returns:
        A ``Work``; its ``wait()`` returns once ``tensor`` may be reused. None on
        ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, or ``dst``,
            ``tag`` or ``group`` has the wrong type.
        ValueError: neither or both of ``dst`` and ``group_dst`` are given, or
            ``tag`` is out of range.
        RankNotInGroupError: ``dst`` is not a member of ``group``, or ``group_dst``
            is out of range.
        DefaultGroupStateError: ``init_process_group`` has not been called.

    Examples:
        >>> r = dist.get_rank()
        >>> out, inp = np.full(2, r), np.empty(2, np.int64)
        >>> works = [dist.isend(out, dst=1 - r), dist.irecv(inp, src=1 - r)]
        >>> [w.wait() for w in works]
        [True, True]
        >>> inp
        array([1, 1])  # rank 0
        array([0, 0])  # rank 1
    """
    if group is None and group_dst is None and type(tensor) is ndarray and type(dst) is int and type(tag) is int:
        pg = world.default_pg  # the fast path (above)
        if pg is not None and (tag == 0 or 0 < tag <= world.init_info.tag_ub) and tensor.dtype in DTYPES:
            peer = pg._group_of.get(dst)
            if peer is not None and ndarray in pg._route and tensor.flags.c_contiguous:
                return pg.isend_fast(tensor, peer, tag)
    pg = resolve_group(group, "isend")
    if pg is None:
        return None
    return _start_send(pg, tensor, pg.root_rank(dst, group_dst, "isend", _DST), tag, "isend")


def irecv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Start receiving into ``tensor`` from ``src`` (any rank if None); returns a Work.

    The message must have exactly ``tensor``'s size: one of another size fails the
    Work with a ValueError (having written its first elements into ``tensor``).

    Args:
        tensor: The array to receive into.
        src: The sending rank, as a global rank; None (and no ``group_src``)
            takes a message from any rank.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        tag: Matches this message with a receive of the same tag (from 0 to MPI's
            ``MPI_TAG_UB``).
        group_src: The sending rank as a rank of ``group``, instead of ``src``.

    Returns:
        A ``Work``; after ``wait()``, ``source_rank()`` is the sender's group rank.
        None on ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, or ``src``,
            ``tag`` or ``group`` has the wrong type.
        ValueError: both ``src`` and ``group_src`` are given, ``tag`` is out of
            range, or ``tensor`` is read-only.
        RankNotInGroupError: ``src`` is not a member of ``group``, or ``group_src``
            is out of range.
        DefaultGroupStateError: ``init_process_group`` has not been called.

    Examples:
        >>> x = np.zeros(3)
        >>> if dist.get_rank() == 0:
        ...     dist.send(np.ones(3), dst=1)
        ... else:
        ...     work = dist.irecv(x)  # from any rank
        ...     work.wait(), work.source_rank()
        (True, 0)  # rank 1
        >>> x
        array([0., 0., 0.])  # rank 0
        array([1., 1., 1.])  # rank 1
    """
    if group is None and group_src is None and type(tensor) is ndarray and type(tag) is int:
        pg = world.default_pg  # the fast path (above)
        if pg is not None and (tag == 0 or 0 < tag <= world.init_info.tag_ub) and tensor.dtype in DTYPES:
            peer = None if src is None else pg._group_of.get(src) if type(src) is int else None
            if (peer is not None or src is None) and ndarray in pg._route:
                f = tensor.flags
                if f.c_contiguous and f.writeable:
                    return pg.irecv_fast(tensor, peer, tag)
    pg = resolve_group(group, "irecv")
    if pg is None:
        return None
    peer = None if src is None and group_src is None else pg.root_rank(src, group_src, "irecv", _SRC)
    return _start_recv(pg, tensor, peer, tag, "irecv")


def send(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to ``dst`` and wait until the send buffer may be reused.

    Args:
        tensor: The array to send (numpy, torch tensor or GPU array).
        dst: The receiving rank, as a global rank. Give ``dst`` or ``group_dst``.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        tag: Matches this message with a receive of the same tag (from 0 to MPI's
            ``MPI_TAG_UB``).
        group_dst: The receiving rank as a rank of ``group``, instead of ``dst``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, or ``dst``,
            ``tag`` or ``group`` has the wrong type.
        ValueError: ``dst`` is this rank itself (it would deadlock: use ``isend``),
            neither or both of ``dst`` and ``group_dst`` are given, or ``tag`` is out
            of range.
        RankNotInGroupError: ``dst`` is not a member of ``group``, or ``group_dst``
            is out of range.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the send did not complete within the group's timeout,
            or MPI failed.

    Examples:
        >>> x = np.arange(4.0) if dist.get_rank() == 0 else np.zeros(4)
        >>> if dist.get_rank() == 0:
        ...     dist.send(x, dst=1)
        ... else:
        ...     dist.recv(x, src=0)
        0  # rank 1: the sender's rank
        >>> x
        array([0., 1., 2., 3.])  # rank 0 and rank 1
    """
    if group is None and group_dst is None and type(tensor) is ndarray and type(dst) is int and type(tag) is int:
        pg = world.default_pg  # the fast path (above)
        if pg is not None and (tag == 0 or 0 < tag <= world.init_info.tag_ub) and tensor.dtype in DTYPES:
            peer = pg._group_of.get(dst)
            levels = pg._route.get(ndarray)
            if peer is not None and levels is not None and peer != pg._rank and tensor.flags.c_contiguous:
                levels[world.debug_level].send_and_wait(tensor, peer, tag)
                return None
    pg = resolve_group(group, "send")
    if pg is None:
        return None
    peer = pg.root_rank(dst, group_dst, "send", _DST)
    _not_self(pg, peer, "send", "destination")
    pg.send_and_wait(prepare_input(tensor, "send", "tensor"), peer, tag_value(tag, "send"))
    return None


def recv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from ``src`` (any rank if None); return the sender's global rank.

    Returns -1 if this rank is not a member of ``group``.

    Args:
        tensor: The array to receive into; the message must have exactly its size.
        src: The sending rank, as a global rank; None (and no ``group_src``)
            takes a message from any rank.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        tag: Matches this message with a receive of the same tag (from 0 to MPI's
            ``MPI_TAG_UB``).
        group_src: The sending rank as a rank of ``group``, instead of ``src``.

    Returns:
        The sender's global rank; -1 on ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, or ``src``,
            ``tag`` or ``group`` has the wrong type.
        ValueError: the message has another size than ``tensor`` (``tensor`` is
            left untouched), ``src`` is this rank itself, both ``src`` and
            ``group_src`` are given, ``tag`` is out of range, or ``tensor`` is
            read-only.
        RankNotInGroupError: ``src`` is not a member of ``group``, or ``group_src``
            is out of range.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: no message came within the group's timeout (the
            receive is withdrawn and the group stays usable), or MPI failed.

    Examples:
        >>> x = np.array([1.0, 2.0]) if dist.get_rank() == 1 else np.zeros(2)
        >>> if dist.get_rank() == 1:
        ...     dist.send(x, dst=0)
        ... else:
        ...     dist.recv(x)  # from any rank
        1  # rank 0: the sender's rank
        >>> x
        array([1., 2.])  # rank 0 and rank 1
    """
    if group is None and group_src is None and type(tensor) is ndarray and type(tag) is int:
        pg = world.default_pg  # the fast path (above)
        if pg is not None and (tag == 0 or 0 < tag <= world.init_info.tag_ub) and tensor.dtype in DTYPES:
            peer = None if src is None else pg._group_of.get(src) if type(src) is int else None
            levels = pg._route.get(ndarray)
            if (src is None or peer is not None and peer != pg._rank) and levels is not None:
                f = tensor.flags
                if f.c_contiguous and f.writeable:
                    return pg.ranks[levels[world.debug_level].recv_and_wait(tensor, None, peer, tag)]
    pg = resolve_group(group, "recv")
    if pg is None:
        return -1
    peer = None if src is None and group_src is None else pg.root_rank(src, group_src, "recv", _SRC)
    if peer is not None:
        _not_self(pg, peer, "recv", "source")
    buf, target = prepare_output(tensor, "recv", "tensor")
    # waited for at once: the backend may match the message before writing (sharp-bits: receive sizes)
    source = pg.recv_and_wait(buf, None if target is None else [(buf, target)], peer, tag_value(tag, "recv"))
    return pg.ranks[source]


class P2POp:
    """One operation for :func:`batch_isend_irecv`: ``op`` is ``isend`` or ``irecv``.

    The arguments are checked when it is made, as torch does.

    Args:
        op: ``mpidist.isend`` or ``mpidist.irecv``.
        tensor: The array to send, or to receive into.
        peer: The other rank, as a global rank. Give ``peer`` or ``group_peer``.
        group: The group; None is the default group. ``batch_isend_irecv`` skips
            the operation on ranks outside it.
        tag: Matches a send with a receive of the same tag.
        group_peer: The other rank as a rank of ``group``, instead of ``peer``.

    Raises:
        ValueError: ``op`` is neither ``isend`` nor ``irecv``, neither or both of
            ``peer`` and ``group_peer`` are given, or ``tag`` is out of range.
        TypeError: ``tensor`` is not an array, or ``peer``, ``tag`` or ``group``
            has the wrong type.
        RankNotInGroupError: ``peer`` is not a member of ``group``, or
            ``group_peer`` is out of range.

    Examples:
        >>> rank, n = dist.get_rank(), dist.get_world_size()
        >>> out, inp = np.arange(2) + 2 * rank, np.empty(2, np.int64)
        >>> reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, (rank + 1) % n),
        ...                                dist.P2POp(dist.irecv, inp, (rank - 1) % n)])
        >>> [r.wait() for r in reqs]
        [True, True]
        >>> inp
        array([2, 3])  # rank 0
        array([0, 1])  # rank 1
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer")

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Any,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if group is None and group_peer is None and type(tensor) is ndarray and type(peer) is int and type(tag) is int:
            pg = world.default_pg  # the common case (as isend's fast path): checked, nothing else to look up
            if pg is not None and (op is isend or op is irecv) and (tag == 0 or 0 < tag <= world.init_info.tag_ub):
                group_rank = pg._group_of.get(peer)
                if group_rank is not None and tensor.dtype in DTYPES:
                    self.op, self.tensor, self.group, self.tag = op, tensor, None, tag
                    self.peer, self.group_peer = peer, group_rank
                    return
        fn = "P2POp"
        if op is not isend and op is not irecv:
            raise ValueError(f"{fn}: op must be mpidist.isend or mpidist.irecv, got {op!r}")
        if peer is None and group_peer is None:
            raise ValueError(f"{fn}: peer (a global rank) or group_peer (a group rank) is required")
        adapt(tensor, fn, "tensor")  # an array of a kind mpidist takes (as torch checks the tensor here)
        self.op = op
        self.tensor = tensor
        self.group = group
        self.tag = tag_value(tag, fn)
        pg = resolve_group(group, fn)
        if pg is None:  # not a member: batch_isend_irecv skips it
            self.peer, self.group_peer = peer, group_peer
            return
        self.group_peer = pg.root_rank(peer, group_peer, fn, ("peer", "group_peer"))
        self.peer = pg.ranks[self.group_peer]

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def _prepared(p: P2POp, where: str) -> tuple[bool, Buffer, Backs, int, int]:
    """``(is_send, buffer, backs, group peer, tag)`` of ``p`` for ``ProcessGroup.batch_p2p``; ``where`` names it in errors."""
    t, tag = p.tensor, p.tag
    if type(t) is ndarray and type(tag) is int and (tag == 0 or 0 < tag <= world.init_info.tag_ub):
        if t.dtype in DTYPES:  # the common case: a ready numpy array is its own buffer (as for isend/irecv)
            f = t.flags
            if p.op is isend:
                if f.c_contiguous:
                    return True, t, None, p.group_peer, tag
            elif f.c_contiguous and f.writeable:
                return False, t, None, p.group_peer, tag
    tag = tag_value(tag, where)
    if p.op is isend:
        return True, prepare_input(p.tensor, where, "tensor"), None, p.group_peer, tag
    buf, target = prepare_output(p.tensor, where, "tensor")
    return False, buf, None if target is None else [(buf, target)], p.group_peer, tag


def _ready_batch(ops: list[Any]) -> list[tuple[bool, ndarray, int, int]] | None:
    """``(is_send, array, group peer, tag)`` per operation where every one is a P2POp of the default group on a
    ready numpy array (C-contiguous, writeable to receive into, a dtype mpidist sends as it is) with an int tag
    in range, as ``isend``'s fast path takes them; else None, and the general path checks everything."""
    tag_ub = world.init_info.tag_ub
    ready = []
    for p in ops:
        if type(p) is not P2POp or p.group is not None:
            return None
        t, tag = p.tensor, p.tag
        if type(t) is not ndarray or type(tag) is not int or not (tag == 0 or 0 < tag <= tag_ub) or t.dtype not in DTYPES:
            return None
        f = t.flags
        send = p.op is isend
        if not f.c_contiguous or not (send or f.writeable):
            return None
        ready.append((send, t, p.group_peer, tag))
    return ready or None


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Post every send and receive of ``p2p_op_list`` at once; return their Works.

    All operations are validated before any is posted. Ranks pair up their
    operations in list order per peer, as with ``isend``/``irecv``.

    Args:
        p2p_op_list: A non-empty list of ``P2POp``, all on the same group.

    Returns:
        One ``Work`` per operation, in order; an empty list on ranks outside the
        group.

    Raises:
        ValueError: ``p2p_op_list`` is empty, not a list of ``P2POp``, mixes
            groups, or an output is read-only.
        TypeError: an array has an unsupported dtype.
        DefaultGroupStateError: ``init_process_group`` has not been called.

    Examples:
        >>> r = dist.get_rank()
        >>> got = np.empty(1, np.int64)
        >>> works = dist.batch_isend_irecv([dist.P2POp(dist.isend, np.array([r]), 1 - r),
        ...                                 dist.P2POp(dist.irecv, got, 1 - r)])
        >>> [w.wait() for w in works]
        [True, True]
        >>> got
        array([1])  # rank 0
        array([0])  # rank 1
    """
    pg = world.default_pg
    if pg is not None and type(p2p_op_list) is list:  # the common case: ready numpy arrays on the default group
        ready = _ready_batch(p2p_op_list)
        if ready is not None:
            works = pg.batch_fast(ready)
            if works is not None:
                return works
    fn = "batch_isend_irecv"
    if not isinstance(p2p_op_list, list) or not p2p_op_list:
        raise ValueError(f"{fn}: p2p_op_list must be a non-empty list of P2POp")
    group = p2p_op_list[0].group if isinstance(p2p_op_list[0], P2POp) else None
    for p in p2p_op_list:
        if not isinstance(p, P2POp):
            raise ValueError(f"{fn}: p2p_op_list must be a non-empty list of P2POp")
        if p.group is not group:
            raise ValueError(f"{fn}: all operations must use the same group")
    pg = resolve_group(group, fn)
    if pg is None:
        return []
    prepared = []
    for i, p in enumerate(p2p_op_list):
        try:
            prepared.append(_prepared(p, fn))
        except (TypeError, ValueError):  # again, to raise the error naming the operation (the checks are pure)
            _prepared(p, f"{fn}: p2p_op_list[{i}] ({p.op.__name__})")
            raise
    works = pg.batch_p2p(prepared)
    return [w.with_outputs([p.tensor]) for w, p in zip(works, p2p_op_list)]
