"""Collectives on picklable Python objects.

Objects are pickled with protocol 5; large buffers inside them (numpy arrays,
bytes-like objects that support out-of-band pickling) travel as separate frames
of one byte payload, and on the receiving side they are rebuilt on the received
memory without another copy. Sizes are 64-bit, so objects over 2 GiB work. They run on the group's private
control communicator, never mixing with the arrays the program sends.

If an object cannot be pickled on one rank, every rank of the collective
raises the same error at once (the size every collective exchanges first says
so, and the error text travels instead of the payload), nothing else is sent
and the group stays usable.

.. warning::
   These functions unpickle what other ranks send. Unpickling untrusted data can
   execute arbitrary code: only use them among processes you trust.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from .collectives import root_rank
from .process_group import ProcessGroup, resolve_group

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "dumps",
    "loads",
]

_ALIGN = 64
_OBJECT_TAG = 1  # on the group's private control communicator: no user message can match it
_I64 = np.dtype(np.int64)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def dumps(obj: Any) -> np.ndarray:
    """Serialize ``obj`` into one uint8 payload: a header of frame sizes, then the frames.

    Frame 0 is the pickle stream (protocol 5); the others are its out-of-band
    buffers, each starting at a 64-byte boundary.
    """
    buffers: list[pickle.PickleBuffer] = []
    main = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    frames = [memoryview(main)] + [b.raw() for b in buffers]
    header = np.array([len(frames)] + [f.nbytes for f in frames], _I64)
    offset = _aligned(header.nbytes)
    payload = np.empty(offset + sum(_aligned(f.nbytes) for f in frames), np.uint8)
    payload[: header.nbytes] = header.view(np.uint8)
    for f in frames:
        payload[offset : offset + f.nbytes] = np.frombuffer(f, np.uint8)
        offset += _aligned(f.nbytes)
    return payload


def loads(payload: np.ndarray) -> Any:
    """Rebuild the object of a :func:`dumps` payload; buffers alias ``payload`` (no copy)."""
    count = int(payload[:8].view(_I64)[0])
    sizes = payload[8 : 8 * (count + 1)].view(_I64)
    view = memoryview(payload)
    offset = _aligned(8 * (count + 1))
    frames = []
    for size in sizes.tolist():
        frames.append(view[offset : offset + size])
        offset += _aligned(size)
    return pickle.loads(frames[0], buffers=frames[1:])


#: pickling errors every rank raises as the same type; any other is raised as pickle.PicklingError
_PICKLING_ERRORS = {
    e.__name__: e
    for e in (pickle.PicklingError, TypeError, AttributeError, ValueError, RecursionError, NotImplementedError)
}


def _try_dumps(obj: Any) -> tuple[np.ndarray, Exception | None]:
    """``(dumps(obj), None)``, or ``(the error as UTF-8 text, the error)`` if ``obj`` cannot be pickled."""
    try:
        return dumps(obj), None
    except Exception as exc:  # noqa: BLE001 - the text goes to every rank, which all raise (_pickling_error)
        return np.frombuffer(f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"), np.uint8), exc


def _announced(payload: np.ndarray, exc: Exception | None) -> int:
    """The size a rank announces: its payload's, or ``-1 - len(error text)`` if pickling failed."""
    return payload.size if exc is None else -1 - payload.size


def _pickling_error(fn: str, what: str, impl: Any, ranks: list[int], text: np.ndarray) -> Exception:
    """The error every rank raises when the objects of group ranks ``ranks`` could not be pickled."""
    kind, _, detail = bytes(text).decode("utf-8", "replace").partition(": ")
    names = [str(r if impl.global_ranks is None else impl.global_ranks[r]) for r in ranks]  # global ranks
    who = f"rank {names[0]}" if len(names) == 1 else f"ranks {', '.join(names)}"
    error = f"{kind}: {detail}" if len(names) == 1 else f"rank {names[0]}: {kind}: {detail}"
    return _PICKLING_ERRORS.get(kind, pickle.PicklingError)(
        f"{fn}: {what} of {who} could not be pickled ({error}); no object was sent and the group is still usable"
    )


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
    compatibility. Unpickles data from ``src``: use only with trusted peers.

    Example (``mpiexec -n 3``)::

        >>> objs = ["foo", 12, {1: 2}] if dist.get_rank() == 0 else [None] * 3
        >>> dist.broadcast_object_list(objs, src=0)
        >>> objs
        ['foo', 12, {1: 2}]
    """
    fn = "broadcast_object_list"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    root = root_rank(pg, src, group_src, fn, ("src", "group_src"), default=0)
    _check_list(object_list, fn, "object_list")
    impl = pg.control
    exc = None
    if impl.rank == root:
        payload, exc = _try_dumps(list(object_list))
        head = np.array([_announced(payload, exc), len(object_list)], _I64)
    else:
        head = np.empty(2, _I64)
    impl.broadcast(head, None, root, False)
    size = int(head[0])
    if impl.rank != root:
        payload = np.empty(size if size >= 0 else -1 - size, np.uint8)
    impl.broadcast(payload, None, root, False)  # the objects, or the pickling error's text
    if size < 0:
        raise _pickling_error(fn, "object_list", impl, [root], payload) from exc
    if impl.rank != root:
        if int(head[1]) != len(object_list):
            raise ValueError(
                f"{fn}: object_list has {len(object_list)} items here but {int(head[1])} on the "
                "source rank; every rank must pass a list of the same length"
            )
        object_list[:] = loads(payload)
    return None


def _exchange_sizes(impl: Any, mine: int) -> np.ndarray:
    sizes = np.empty(impl.size, _I64)
    impl.all_gather_into_tensor(sizes, None, np.array([mine], _I64), False)
    return sizes


def _slices(sizes: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """One buffer for all payloads and consecutive views of it, one per rank."""
    big = np.empty(int(sizes.sum()), np.uint8)
    views, offset = [], 0
    for s in sizes.tolist():
        views.append(big[offset : offset + s])
        offset += s
    return big, views


def _raise_if_failed(impl: Any, sizes: np.ndarray, mine: np.ndarray, exc: Exception | None, fn: str) -> None:
    """If a rank announced a pickling error (a negative size), gather the error texts and raise on every rank."""
    failed = [r for r, s in enumerate(sizes.tolist()) if s < 0]
    if not failed:
        return
    _, texts = _slices(np.where(sizes < 0, -1 - sizes, 0))
    impl.all_gather(texts, None, mine if exc is not None else mine[:0], False)
    raise _pickling_error(fn, "obj", impl, failed, texts[failed[0]]) from exc


def gather_all(impl: Any, obj: Any, fn: str = "all_gather_object") -> list[Any]:
    """Every rank's ``obj``, gathered over backend ``impl`` (collective; used by debug checks too)."""
    mine, exc = _try_dumps(obj)
    sizes = _exchange_sizes(impl, _announced(mine, exc))
    _raise_if_failed(impl, sizes, mine, exc, fn)
    _, views = _slices(sizes)
    impl.all_gather(views, None, mine, False)
    return [loads(v) for v in views]


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """Fill ``object_list`` (one slot per rank) with every rank's ``obj``.

    Unpickles data from every rank: use only with trusted peers.

    Example (``mpiexec -n 3``)::

        >>> out = [None] * 3
        >>> dist.all_gather_object(out, ["foo", 12, {1: 2}][dist.get_rank()])
        >>> out
        ['foo', 12, {1: 2}]
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
    """
    fn = "gather_object"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    root = root_rank(pg, dst, group_dst, fn, ("dst", "group_dst"), default=0)
    impl = pg.control
    at_root = impl.rank == root
    if at_root:
        slots = _check_list(object_gather_list, fn, "object_gather_list")
        if len(slots) != impl.size:
            raise ValueError(f"{fn}: object_gather_list has {len(slots)} slots but the group has {impl.size} ranks")
    elif object_gather_list:
        raise ValueError(f"{fn}: object_gather_list must be None on non-destination ranks")
    mine, exc = _try_dumps(obj)
    sizes = _exchange_sizes(impl, _announced(mine, exc))  # every rank learns of a pickling error
    _raise_if_failed(impl, sizes, mine, exc, fn)
    views = _slices(sizes)[1] if at_root else None
    impl.gather(mine, views, None, root, False)
    if views is not None:
        for i, v in enumerate(views):
            slots[i] = loads(v)
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
    """
    fn = "scatter_object_list"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    root = root_rank(pg, src, group_src, fn, ("src", "group_src"), default=0)
    impl = pg.control
    _check_list(scatter_object_output_list, fn, "scatter_object_output_list")
    if not scatter_object_output_list:
        raise ValueError(f"{fn}: scatter_object_output_list must be a non-empty list (its first slot receives)")
    size = np.empty(1, _I64)
    exc = None
    if impl.rank == root:
        objs = _check_list(scatter_object_input_list, fn, "scatter_object_input_list")
        if len(objs) != impl.size:
            raise ValueError(
                f"{fn}: scatter_object_input_list has {len(objs)} objects but the group has {impl.size} ranks"
            )
        payloads = []
        for o in objs:
            payload, exc = _try_dumps(o)
            if exc is not None:  # every rank gets the error's text instead of an object
                payloads = [payload] * impl.size
                break
            payloads.append(payload)
        sizes = np.array([_announced(p, exc) for p in payloads], _I64)
        impl.scatter(size, None, [sizes[i : i + 1] for i in range(impl.size)], root, False)
    else:
        payloads = None
        impl.scatter(size, None, None, root, False)
    n = int(size[0])
    mine = np.empty(n if n >= 0 else -1 - n, np.uint8)
    impl.scatter(mine, None, payloads, root, False)
    if n < 0:
        raise _pickling_error(fn, "an object of scatter_object_input_list", impl, [root], mine) from exc
    scatter_object_output_list[0] = loads(mine)
    return None


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` to ``dst`` (matched by ``recv_object_list``)."""
    fn = "send_object_list"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    peer = root_rank(pg, dst, group_dst, fn, ("dst", "group_dst"))
    _not_self(pg, peer, fn, "destination")
    _check_list(object_list, fn, "object_list")
    payload, exc = _try_dumps(list(object_list))
    if exc is not None:
        raise _pickling_error(fn, "object_list", pg.control, [pg.rank()], payload) from exc
    tag = _OBJECT_TAG
    pg.control.send(np.array([payload.size, len(object_list)], _I64), peer, tag).wait()
    pg.control.send(payload, peer, tag).wait()
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
    """
    fn = "recv_object_list"
    pg = resolve_group(group, fn)
    if pg is None:
        return -1
    _check_list(object_list, fn, "object_list")
    peer = None if src is None and group_src is None else root_rank(pg, src, group_src, fn, ("src", "group_src"))
    if peer is not None:
        _not_self(pg, peer, fn, "source")
    tag = _OBJECT_TAG
    head = np.empty(2, _I64)
    w = pg.control.recv_blocking(head, None, peer, tag)  # a timeout leaves nothing posted
    w.wait()
    sender = w.source_rank()
    payload = np.empty(int(head[0]), np.uint8)
    pg.control.recv_blocking(payload, None, sender, tag).wait()
    if int(head[1]) != len(object_list):
        raise ValueError(f"{fn}: object_list has {len(object_list)} slots but {int(head[1])} objects arrived")
    object_list[:] = loads(payload)
    return pg.ranks[sender]
