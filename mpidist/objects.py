"""Collectives on picklable Python objects.

Objects are pickled with protocol 5. Large contiguous buffers inside them -- numpy
arrays, torch CPU tensors (their storages), anything that pickles through a
:class:`pickle.PickleBuffer` -- of at least :data:`OUT_OF_BAND_MIN_BYTES` travel *out
of band*: each as a message of its own, sent straight from the object's memory and
received into an exact-size buffer that the unpickled object then uses, with no copy
on either side. The rest of the object (its structure, small buffers, bytes, strings)
is the in-band pickle stream, one message. Sizes are 64-bit, so objects and buffers
over 2 GiB work. Everything runs on the group's private control communicator (never
mixing with the arrays the program sends) through its backend's timed calls, so
every message has the group's timeout.

How objects are pickled, and received arrays and tensors rebuilt on the received
memory, is ``_pickling.py``'s part; this module moves the pieces. The wire format,
the same for every function (numbers are int64):

1. the head: ``[stream bytes, buffers k, list length]`` for broadcast_object_list and
   send_object_list; every rank's ``[stream bytes, k]`` for all_gather_object and
   gather_object (exchanged among all ranks); ``[stream bytes, k, largest k]`` for
   each rank from scatter_object_list's source;
2. the pickle stream;
3. only if some k > 0: the table of the buffers, k rows ``[bytes, kind]`` (kind 1: a
   torch storage, received into the memory of a new torch tensor; 0: anything else,
   received into a new numpy uint8 array);
4. the k buffers, one message each (the gather and scatter functions: one collective
   per buffer index, in which a rank with fewer buffers moves nothing).

A small object is steps 1 and 2: two messages.

If an object cannot be pickled on one rank, every rank of the collective raises the
same error at once: the head says so (a negative size, ``-1 - len(error text)``), the
error's text travels instead of the stream, nothing else is sent and the group stays
usable.

.. warning::
   These functions unpickle what other ranks send. Unpickling untrusted data can
   execute arbitrary code: only use them among processes you trust.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._object_wire import (
    announced,
    empty,
    exchange_heads,
    failure_error,
    frame,
    gather_all,
    raise_if_failed,
    slices,
    try_pickle,
    wait_all,
)
from ._pickling import OUT_OF_BAND_MIN_BYTES, Pickled, receive_buffers, unpickle
from ._world import world
from .diagnose.debug import DebugLevel
from .process_group import ProcessGroup, resolve_group

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "OUT_OF_BAND_MIN_BYTES",
]

_OBJECT_TAG = 1  # on the group's private control communicator: no user message can match it
_I64 = np.dtype(np.int64)


def _not_self(pg: ProcessGroup, peer: int, fn: str, what: str) -> None:
    if peer == pg.rank():
        raise ValueError(
            f"{fn}: the {what} rank is this process itself; send_object_list and recv_object_list need "
            "another rank (to itself they would deadlock)"
        )


def _check_list(value: Any, fn: str, arg: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{fn}: {arg} must be a list, got {type(value).__name__}")
    return value


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    """Replace ``object_list``'s items on every rank with those of rank ``src`` (default 0).

    Every rank passes a list of the same length. ``device`` is accepted for torch
    compatibility. Large arrays and CPU tensors in the objects arrive without a copy
    (see the module's docstring). Unpickles data from ``src``: use only with trusted peers.

    Args:
        object_list: On ``src``, the picklable objects to send; elsewhere a list
            of the same length, whose items are replaced by them.
        src: The sending rank, as a global rank; None means global rank 0.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        device: Accepted for torch compatibility; unused.
        group_src: The sending rank as a rank of ``group``, instead of ``src``.

    Raises:
        TypeError: ``object_list`` is not a list, or a rank or ``group`` has the
            wrong type.
        ValueError: a receiver's list has another length than the source's (with
            ``MPIDIST_DEBUG=DETAIL`` every rank raises it), or both ``src`` and
            ``group_src`` are given.
        RankNotInGroupError: ``src`` is not a member of ``group``.
        pickle.PicklingError: an object could not be pickled (or the TypeError,
            AttributeError, ... pickling raised); every rank of the call raises it,
            nothing is sent and the group stays usable.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout, or
            MPI failed.

    Examples:
        >>> objs = ["foo", 12, {1: 2}] if dist.get_rank() == 0 else [None] * 3
        >>> dist.broadcast_object_list(objs, src=0)
        >>> objs
        ['foo', 12, {1: 2}]  # rank 0 and rank 1
    """
    fn = "broadcast_object_list"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    root = pg.root_rank(src, group_src, fn, ("src", "group_src"), default=0)
    _check_list(object_list, fn, "object_list")
    impl = pg.control
    at_root = impl.rank == root
    if world.debug_level >= DebugLevel.DETAIL:
        _same_lengths(impl, root, len(object_list), fn)
    exc = None
    if at_root:
        mine, exc = try_pickle(list(object_list))
        head = np.array([announced(mine, exc), len(mine.frames), len(object_list)], _I64)
    else:
        head = np.empty(3, _I64)
    impl.broadcast(head, None, root, False)
    size, k, count = head.tolist()
    stream = mine.stream if at_root else np.empty(size if size >= 0 else -1 - size, np.uint8)
    buffers: Any = ()
    if k == 0:
        impl.broadcast(stream, None, root, False)  # the objects, or the pickling error's text
    else:
        works = [impl.broadcast(stream, None, root, True)]
        table = mine.table if at_root else np.empty((k, 2), _I64)
        impl.broadcast(table, None, root, False)
        into, buffers = (mine.frames, ()) if at_root else receive_buffers(table)
        works += [impl.broadcast(frame, None, root, True) for frame in into]
        wait_all(works)
    if size < 0:
        raise failure_error(fn, "object_list", impl, [root], stream) from exc
    if not at_root:
        if count != len(object_list):
            raise ValueError(
                f"{fn}: object_list has {len(object_list)} items here but {count} on the "
                "source rank; every rank must pass a list of the same length"
            )
        object_list[:] = unpickle(stream, buffers)
    return None


def _same_lengths(impl: Any, root: int, length: int, fn: str) -> None:
    """DETAIL's check of ``broadcast_object_list``: every rank's list has the source's length, else every rank raises.

    Without it only the receivers whose length differs raise (when the broadcast
    arrives); the source cannot know their lengths without this exchange.
    """
    lengths = np.empty(impl.size, _I64)
    impl.all_gather_into_tensor(lengths, None, np.array([length], _I64), False)
    wrong = [r for r, k in enumerate(lengths.tolist()) if k != lengths[root]]
    if wrong:
        counts = ", ".join(f"{lengths[r]} on rank {r}" for r in wrong)
        raise ValueError(
            f"{fn}: object_list has {lengths[root]} items on the source rank {root} but {counts} (group ranks); "
            "every rank must pass a list of the same length (checked at debug level DETAIL, on every rank)"
        )


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """Fill ``object_list`` (one slot per rank) with every rank's ``obj``.

    Large arrays and CPU tensors in the objects arrive without a copy (see the
    module's docstring). Unpickles data from every rank: use only with trusted peers.

    Args:
        object_list: A list with one slot per rank of the group; slot ``i`` gets
            rank ``i``'s ``obj``.
        obj: This rank's picklable object.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.

    Raises:
        TypeError: ``object_list`` is not a list, or ``group`` has the wrong type.
        ValueError: ``object_list`` does not have one slot per rank.
        pickle.PicklingError: an object could not be pickled (or the TypeError,
            AttributeError, ... pickling raised); every rank of the call raises it,
            nothing is sent and the group stays usable.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout, or
            MPI failed.

    Examples:
        >>> out = [None] * dist.get_world_size()
        >>> dist.all_gather_object(out, {"rank": dist.get_rank()})
        >>> out
        [{'rank': 0}, {'rank': 1}]  # rank 0 and rank 1
    """
    fn = "all_gather_object"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    impl = pg.control
    _check_list(object_list, fn, "object_list")
    if len(object_list) != impl.size:
        raise ValueError(f"{fn}: object_list has {len(object_list)} slots but the group has {impl.size} ranks")
    object_list[:] = gather_all(impl, obj, fn)
    return None


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    group_dst: int | None = None,
) -> None:
    """Gather every rank's ``obj`` into ``object_gather_list`` on rank ``dst`` (default 0).

    ``object_gather_list`` has one slot per rank on ``dst`` and is None elsewhere.
    Unpickles data from every rank: use only with trusted peers.

    Args:
        obj: This rank's picklable object.
        object_gather_list: On ``dst``, a list with one slot per rank; None on the
            other ranks.
        dst: The gathering rank, as a global rank; None means global rank 0.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        group_dst: The gathering rank as a rank of ``group``, instead of ``dst``.

    Raises:
        TypeError: ``object_gather_list`` is not a list on ``dst``, or a rank or
            ``group`` has the wrong type.
        ValueError: ``object_gather_list`` does not have one slot per rank on
            ``dst`` or is given elsewhere (every rank raises it), or both ``dst``
            and ``group_dst`` are given.
        RankNotInGroupError: ``dst`` is not a member of ``group``.
        pickle.PicklingError: an object could not be pickled (or the TypeError,
            AttributeError, ... pickling raised); every rank of the call raises it,
            nothing is sent and the group stays usable.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout, or
            MPI failed.

    Examples:
        >>> out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        >>> dist.gather_object(dist.get_rank() * 10, out, dst=0)
        >>> out
        [0, 10]  # rank 0 (rank 1: None)
    """
    fn = "gather_object"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    root = pg.root_rank(dst, group_dst, fn, ("dst", "group_dst"), default=0)
    impl = pg.control
    at_root = impl.rank == root
    refused = None  # a check only this rank makes: announced in the head, so every rank raises it
    try:
        if at_root:
            slots = _check_list(object_gather_list, fn, "object_gather_list")
            if len(slots) != impl.size:
                raise ValueError(f"{fn}: object_gather_list has {len(slots)} slots but the group has {impl.size} ranks")
        elif object_gather_list:
            raise ValueError(f"{fn}: object_gather_list must be None on non-destination ranks")
    except (TypeError, ValueError) as exc:
        refused = exc
    mine, exc = try_pickle(obj, refused)
    heads = exchange_heads(impl, mine, exc)  # every rank learns of a pickling error, and every rank's frames
    raise_if_failed(impl, heads[:, 0], mine.stream, exc, fn)
    streams = slices(heads[:, 0])[1] if at_root else None
    counts = heads[:, 1].tolist()
    received: list[tuple[list[np.ndarray], Any]] = [([], ())] * impl.size
    if not any(counts):
        impl.gather(mine.stream, streams, None, root, False)
    else:
        works = [impl.gather(mine.stream, streams, None, root, True)]
        tables = [np.empty((k, 2), _I64) for k in counts] if at_root else None
        impl.gather(mine.table, tables, None, root, False)
        if tables is not None:
            received = [receive_buffers(t) for t in tables]
        for j in range(max(counts)):
            outs = [into[j] if j < len(into) else empty() for into, _ in received] if at_root else None
            works.append(impl.gather(frame(mine, j), outs, None, root, True))
        wait_all(works)
    if streams is not None:
        for i, (s, (_, give)) in enumerate(zip(streams, received)):
            slots[i] = unpickle(s, give)
    return None


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    group_src: int | None = None,
) -> None:
    """Send ``scatter_object_input_list[i]`` from rank ``src`` (default 0) to rank ``i``.

    Each rank finds its object in ``scatter_object_output_list[0]`` (a non-empty
    list). Unpickles data from ``src``: use only with trusted peers.

    Args:
        scatter_object_output_list: A non-empty list; its first slot receives
            this rank's object.
        scatter_object_input_list: On ``src``, one picklable object per rank of
            the group; ignored elsewhere.
        src: The sending rank, as a global rank; None means global rank 0.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        group_src: The sending rank as a rank of ``group``, instead of ``src``.

    Raises:
        TypeError: ``scatter_object_output_list`` is not a list, or
            ``scatter_object_input_list`` is not a list on ``src``; a rank or
            ``group`` has the wrong type.
        ValueError: ``scatter_object_output_list`` is empty, or
            ``scatter_object_input_list`` does not have one object per rank (every
            rank raises the source's error).
        RankNotInGroupError: ``src`` is not a member of ``group``.
        pickle.PicklingError: an object could not be pickled (or the TypeError,
            AttributeError, ... pickling raised); every rank of the call raises it,
            nothing is sent and the group stays usable.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout, or
            MPI failed.

    Examples:
        >>> out = [None]
        >>> objs = [{"part": 0}, {"part": 1}] if dist.get_rank() == 0 else None
        >>> dist.scatter_object_list(out, objs, src=0)
        >>> out[0]
        {'part': 0}  # rank 0
        {'part': 1}  # rank 1
    """
    fn = "scatter_object_list"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    root = pg.root_rank(src, group_src, fn, ("src", "group_src"), default=0)
    impl = pg.control
    bad_output = None  # this rank only receives into it: the call goes on (nothing is left in flight), then raises
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        bad_output = (TypeError if not isinstance(scatter_object_output_list, list) else ValueError)(
            f"{fn}: scatter_object_output_list must be a non-empty list (its first slot receives), got "
            f"{scatter_object_output_list!r:.60}"
        )
    head = np.empty(3, _I64)  # [stream bytes, frames, the most frames of any rank]
    exc = refused = None
    sent: list[Pickled] | None = None
    if impl.rank == root:
        objs: Any = scatter_object_input_list
        if not isinstance(objs, list):
            refused = TypeError(
                f"{fn}: scatter_object_input_list must be a list on the source rank, got {type(objs).__name__}"
            )
        elif len(objs) != impl.size:
            refused = ValueError(
                f"{fn}: scatter_object_input_list has {len(objs)} objects but the group has {impl.size} ranks"
            )
        sent = []
        for o in [None] if refused is not None else objs:
            p, exc = try_pickle(o, refused)
            if exc is not None:  # every rank gets the error's text instead of an object
                sent = [p] * impl.size
                break
            sent.append(p)
        most = max((len(p.frames) for p in sent), default=0)
        heads = np.array([[announced(p, exc), len(p.frames), most] for p in sent], _I64)
        impl.scatter(head, None, list(heads), root, False)
    else:
        impl.scatter(head, None, None, root, False)
    size, k, most = head.tolist()
    stream = np.empty(size if size >= 0 else -1 - size, np.uint8)
    streams = None if sent is None else [p.stream for p in sent]
    buffers: Any = ()
    if most == 0:
        impl.scatter(stream, None, streams, root, False)
    else:
        works = [impl.scatter(stream, None, streams, root, True)]
        table = np.empty((k, 2), _I64)
        impl.scatter(table, None, None if sent is None else [p.table for p in sent], root, False)
        into, buffers = receive_buffers(table)
        for j in range(most):
            ins = None if sent is None else [frame(p, j) for p in sent]
            works.append(impl.scatter(into[j] if j < k else empty(), None, ins, root, True))
        wait_all(works)
    if size < 0:
        if exc is not None and refused is not None:
            raise exc  # the source's own failed check, as it was raised
        raise failure_error(fn, "an object of scatter_object_input_list", impl, [root], stream) from exc
    received = unpickle(stream, buffers)
    if bad_output is not None:
        raise bad_output
    scatter_object_output_list[0] = received
    return None


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` to ``dst`` (matched by ``recv_object_list``).

    Args:
        object_list: The picklable objects to send.
        dst: The receiving rank, as a global rank. Give ``dst`` or ``group_dst``.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        device: Accepted for torch compatibility; unused.
        group_dst: The receiving rank as a rank of ``group``, instead of ``dst``.
        use_batch: Accepted for torch compatibility; unused.

    Raises:
        TypeError: ``object_list`` is not a list, or a rank or ``group`` has the
            wrong type.
        ValueError: ``dst`` is this rank itself, or neither or both of ``dst`` and
            ``group_dst`` are given.
        RankNotInGroupError: ``dst`` is not a member of ``group``.
        pickle.PicklingError: an object could not be pickled (or the error
            pickling raised); nothing is sent.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout, or
            MPI failed.

    Examples:
        >>> objs = [{"step": 3}, "done"] if dist.get_rank() == 0 else [None, None]
        >>> if dist.get_rank() == 0:
        ...     dist.send_object_list(objs, dst=1)
        ... else:
        ...     dist.recv_object_list(objs, src=0)
        0  # rank 1: the sender's rank
        >>> objs
        [{'step': 3}, 'done']  # rank 0 and rank 1
    """
    fn = "send_object_list"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    peer = pg.root_rank(dst, group_dst, fn, ("dst", "group_dst"))
    _not_self(pg, peer, fn, "destination")
    _check_list(object_list, fn, "object_list")
    mine, exc = try_pickle(list(object_list))
    if exc is not None:
        raise failure_error(fn, "object_list", pg.control, [pg.rank()], mine.stream) from exc
    impl, tag = pg.control, _OBJECT_TAG
    head = np.array([mine.stream.size, len(mine.frames), len(object_list)], _I64)
    works = [impl.send(head, peer, tag), impl.send(mine.stream, peer, tag)]
    if mine.frames:
        works.append(impl.send(mine.table, peer, tag))
        works += [impl.send(frame, peer, tag) for frame in mine.frames]
    wait_all(works)
    return None


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Receive objects sent by ``send_object_list`` into ``object_list``; return the sender's global rank.

    Unpickles data from the sender: use only with trusted peers.

    Args:
        object_list: A list with as many slots as the sender's list; its items are
            replaced by the objects received.
        src: The sending rank, as a global rank; None (and no ``group_src``)
            takes the objects of any rank.
        group: The group; None is the default group. On ranks outside it the call
            does nothing.
        device: Accepted for torch compatibility; unused.
        group_src: The sending rank as a rank of ``group``, instead of ``src``.
        use_batch: Accepted for torch compatibility; unused.

    Returns:
        The sender's global rank; -1 on ranks outside ``group``.

    Raises:
        TypeError: ``object_list`` is not a list, or a rank or ``group`` has the
            wrong type.
        ValueError: ``object_list`` has another length than the list sent, ``src``
            is this rank itself, or both ``src`` and ``group_src`` are given.
        RankNotInGroupError: ``src`` is not a member of ``group``.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout, or
            MPI failed.

    Examples:
        >>> objs = [None]
        >>> if dist.get_rank() == 1:
        ...     dist.send_object_list([np.arange(3)], dst=0)
        ... else:
        ...     dist.recv_object_list(objs)
        1  # rank 0: the sender's rank
        >>> objs
        [array([0, 1, 2])]  # rank 0
        [None]  # rank 1
    """
    fn = "recv_object_list"
    pg = resolve_group(group, fn)
    if pg is None:
        return -1
    _check_list(object_list, fn, "object_list")
    peer = None if src is None and group_src is None else pg.root_rank(src, group_src, fn, ("src", "group_src"))
    if peer is not None:
        _not_self(pg, peer, fn, "source")
    impl, tag = pg.control, _OBJECT_TAG
    head = np.empty(3, _I64)
    w = impl.recv_blocking(head, None, peer, tag)  # a timeout leaves nothing posted
    w.wait()
    sender = w.source_rank()
    size, k, count = head.tolist()
    stream = np.empty(size, np.uint8)
    impl.recv_blocking(stream, None, sender, tag).wait()
    buffers: Any = ()
    if k:
        table = np.empty((k, 2), _I64)
        impl.recv_blocking(table, None, sender, tag).wait()
        into, buffers = receive_buffers(table)
        for frame in into:
            impl.recv_blocking(frame, None, sender, tag).wait()
    if count != len(object_list):
        raise ValueError(f"{fn}: object_list has {len(object_list)} slots but {count} objects arrived")
    object_list[:] = unpickle(stream, buffers)
    return pg.ranks[sender]
