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

The wire format, the same for every function (numbers are int64):

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

import copyreg
import io
import pickle
import sys
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
    "OUT_OF_BAND_MIN_BYTES",
]

#: Buffers of at least this many bytes travel out of band (a message of their own, no copy); smaller
#: ones are copied into the pickle stream, where they cost less than one more message would.
OUT_OF_BAND_MIN_BYTES = 64 << 10

_OBJECT_TAG = 1  # on the group's private control communicator: no user message can match it
_I64 = np.dtype(np.int64)
_PLAIN, _STORAGE = 0, 1  # kinds of out-of-band buffers (the table's second column)


# ---------------------------------------------------------------------------------------------
# pickling with out-of-band buffers
# ---------------------------------------------------------------------------------------------


class _Memory:
    """Raw bytes at an address as numpy sees them (``__array_interface__``), keeping their owner alive.

    The owner is a torch storage (sending) or a torch uint8 tensor (receiving).
    ``Tensor.numpy()`` would mark the storage non-resizable for good (see
    ``arrays.host._TensorMemory``).
    """

    __slots__ = ("owner", "__array_interface__")


def _bytes_at(address: int, nbytes: int, owner: Any) -> np.ndarray:
    memory = _Memory()
    memory.owner = owner
    memory.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
    return np.asarray(memory)


def _reduce_untyped_storage(s: Any) -> Any:
    """Pickle a torch CPU storage as its memory, a PickleBuffer (out of band if large); others as torch does.

    Every CPU storage goes this way, not only large ones: torch's own way
    (``torch.save`` per storage) is slow for small ones and, in torch 2.13, fails for
    the dtypes of ``torch.storage._new_dtypes()`` (uint16, uint32, uint64, float8...).
    """
    if s.device.type != "cpu":
        return s.__reduce__()
    return _storage, (pickle.PickleBuffer(_bytes_at(s.data_ptr(), s.nbytes(), s)),)


def _reduce_typed_storage(s: Any) -> Any:
    """Pickle a torch TypedStorage (what tensors of most dtypes pickle) as its untyped storage and dtype."""
    untyped = s._untyped_storage
    if untyped.device.type != "cpu":
        return s.__reduce__()
    return _typed_storage, (untyped, s.dtype)


def _storage(buf: Any) -> Any:
    """Unpickle a storage: the storage of the uint8 tensor it was received into (out of band, no copy), or a
    copy of the in-band bytes in a new one.

    It comes back as a TypedStorage of uint8 bytes wrapping it, as ``torch.load``
    gives an untyped storage back and as ``torch._utils._rebuild_tensor_v3`` expects.
    """
    import torch

    if not isinstance(buf, torch.Tensor):
        data = np.frombuffer(buf, np.uint8)
        tensor = torch.empty(data.size, dtype=torch.uint8)
        _bytes_at(tensor.data_ptr(), data.size, tensor)[:] = data
        buf = tensor
    return torch.storage.TypedStorage(wrap_storage=buf.untyped_storage(), dtype=torch.uint8, _internal=True)


def _typed_storage(untyped: Any, dtype: Any) -> Any:
    import torch

    return torch.storage.TypedStorage(wrap_storage=untyped._untyped_storage, dtype=dtype, _internal=True)


def _reduce_ndarray(a: np.ndarray) -> Any:
    """Pickle a large contiguous numpy array as its memory (a PickleBuffer, out of band); others as numpy does.

    numpy itself does this for most dtypes, but pickles arrays of user-defined dtypes
    (ml_dtypes' bfloat16, float8...) and datetimes in band, as a copy.
    """
    if a.nbytes < OUT_OF_BAND_MIN_BYTES or a.dtype.hasobject or not a.dtype.itemsize:
        return a.__reduce_ex__(5)
    if a.flags.c_contiguous:
        order = "C"
    elif a.flags.f_contiguous:
        order = "F"
    else:
        return a.__reduce_ex__(5)
    flat = a.reshape(-1, order=order).view(np.uint8)  # views: the array's own memory
    return _array, (pickle.PickleBuffer(flat), a.dtype, a.shape, order)


def _array(buf: Any, dtype: np.dtype, shape: tuple[int, ...], order: str) -> np.ndarray:
    """Unpickle an array: a view of the buffer it was received into (no copy)."""
    return np.frombuffer(buf, dtype).reshape(shape, order=order)


def _dispatch_table() -> dict[Any, Any]:
    """copyreg's reducers, and ours: numpy arrays, torch CPU storages (where torch is imported)."""
    table = dict(copyreg.dispatch_table)
    table[np.ndarray] = _reduce_ndarray
    torch = sys.modules.get("torch")
    typed = getattr(getattr(torch, "storage", None), "TypedStorage", None)  # None while torch is being imported
    if typed is not None:
        table[torch.UntypedStorage] = _reduce_untyped_storage
        table[typed] = _reduce_typed_storage
    return table


class _Pickled:
    """An object ready to send: the pickle stream (or a pickling error's text) and the out-of-band buffers."""

    __slots__ = ("stream", "frames", "table")

    def __init__(self, stream: np.ndarray, frames: list[np.ndarray], table: np.ndarray) -> None:
        self.stream = stream  # uint8
        self.frames = frames  # uint8 views of the object's memory
        self.table = table  # int64 rows [bytes, kind], one per frame


def _pickle(obj: Any) -> _Pickled:
    """Pickle ``obj`` (protocol 5); buffers of OUT_OF_BAND_MIN_BYTES or more become frames, not copied."""
    frames: list[np.ndarray] = []
    rows: list[tuple[int, int]] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        """The buffer_callback: False (out of band) for a large contiguous buffer, True (in band) otherwise."""
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: in band (pickle copies it, or refuses it as it always would)
            return True
        if raw.nbytes < OUT_OF_BAND_MIN_BYTES:
            return True
        frames.append(np.frombuffer(raw, np.uint8))
        rows.append((raw.nbytes, _STORAGE if type(getattr(raw.obj, "base", None)) is _Memory else _PLAIN))
        return False

    f = io.BytesIO()
    pickler = pickle.Pickler(f, protocol=5, buffer_callback=out_of_band)
    pickler.dispatch_table = _dispatch_table()
    pickler.dump(obj)
    stream = f.getbuffer()
    return _Pickled(np.frombuffer(stream, np.uint8), frames, np.array(rows, _I64).reshape(-1, 2))


def _torch() -> Any:
    """The torch module (imported if it was not), or None where it is not installed."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    return torch


def _receive_buffers(table: np.ndarray) -> tuple[list[np.ndarray], list[Any]]:
    """Exact-size buffers for the frames of ``table``: (the arrays MPI receives into, what pickle gets).

    A torch storage is received into the memory of a new uint8 tensor, whose storage
    the tensor is then rebuilt on (it stays resizable); anything else into a new
    numpy uint8 array, which the unpickled array is a view of.
    """
    into: list[np.ndarray] = []
    give: list[Any] = []
    for nbytes, kind in table.tolist():
        torch = _torch() if kind == _STORAGE else None
        if torch is not None:
            t = torch.empty(nbytes, dtype=torch.uint8)
            into.append(_bytes_at(t.data_ptr(), nbytes, t))
            give.append(t)
        else:
            a = np.empty(nbytes, np.uint8)
            into.append(a)
            give.append(a)
    return into, give


def _unpickle(stream: np.ndarray, buffers: list[Any] | tuple[()] = ()) -> Any:
    return pickle.loads(stream, buffers=buffers)


def _empty() -> np.ndarray:
    """Nothing to move: a rank's part of a frame collective beyond its own frames (a new array each time)."""
    return np.empty(0, np.uint8)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


#: pickling errors every rank raises as the same type; any other is raised as pickle.PicklingError
_PICKLING_ERRORS = {
    e.__name__: e
    for e in (pickle.PicklingError, TypeError, AttributeError, ValueError, RecursionError, NotImplementedError)
}


def _try_pickle(obj: Any) -> tuple[_Pickled, Exception | None]:
    """``(_pickle(obj), None)``, or (the error's text as the stream, the error) if ``obj`` cannot be pickled."""
    try:
        return _pickle(obj), None
    except Exception as exc:  # noqa: BLE001 - the text goes to every rank, which all raise (_pickling_error)
        text = np.frombuffer(f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"), np.uint8)
        return _Pickled(text, [], np.empty((0, 2), _I64)), exc


def _announced(p: _Pickled, exc: Exception | None) -> int:
    """The size a rank announces: its stream's, or ``-1 - len(error text)`` if pickling failed."""
    return p.stream.size if exc is None else -1 - p.stream.size


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
    compatibility. Large arrays and CPU tensors in the objects arrive without a copy
    (see the module's docstring). Unpickles data from ``src``: use only with trusted peers.

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
    at_root = impl.rank == root
    exc = None
    if at_root:
        mine, exc = _try_pickle(list(object_list))
        head = np.array([_announced(mine, exc), len(mine.frames), len(object_list)], _I64)
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
        into, buffers = (mine.frames, ()) if at_root else _receive_buffers(table)
        works += [impl.broadcast(frame, None, root, True) for frame in into]
        _wait(works)
    if size < 0:
        raise _pickling_error(fn, "object_list", impl, [root], stream) from exc
    if not at_root:
        if count != len(object_list):
            raise ValueError(
                f"{fn}: object_list has {len(object_list)} items here but {count} on the "
                "source rank; every rank must pass a list of the same length"
            )
        object_list[:] = _unpickle(stream, buffers)
    return None


def _exchange_heads(impl: Any, mine: _Pickled, exc: Exception | None) -> np.ndarray:
    """Every rank's ``[stream bytes (negative: a pickling error), frames]``, one row per rank."""
    heads = np.empty((impl.size, 2), _I64)
    impl.all_gather_into_tensor(heads, None, np.array([_announced(mine, exc), len(mine.frames)], _I64), False)
    return heads


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


def _frame(p: _Pickled, j: int) -> np.ndarray:
    return p.frames[j] if j < len(p.frames) else _empty()


def gather_all(impl: Any, obj: Any, fn: str = "all_gather_object") -> list[Any]:
    """Every rank's ``obj``, gathered over backend ``impl`` (collective; used by debug checks too)."""
    mine, exc = _try_pickle(obj)
    heads = _exchange_heads(impl, mine, exc)
    _raise_if_failed(impl, heads[:, 0], mine.stream, exc, fn)
    _, streams = _slices(heads[:, 0])
    counts = heads[:, 1].tolist()
    if not any(counts):
        impl.all_gather(streams, None, mine.stream, False)
        return [_unpickle(s) for s in streams]
    works = [impl.all_gather(streams, None, mine.stream, True)]
    tables = [np.empty((k, 2), _I64) for k in counts]
    impl.all_gather(tables, None, mine.table, False)
    received = [_receive_buffers(t) for t in tables]
    for j in range(max(counts)):
        outs = [into[j] if j < len(into) else _empty() for into, _ in received]
        works.append(impl.all_gather(outs, None, _frame(mine, j), True))
    _wait(works)
    return [_unpickle(s, give) for s, (_, give) in zip(streams, received)]


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """Fill ``object_list`` (one slot per rank) with every rank's ``obj``.

    Large arrays and CPU tensors in the objects arrive without a copy (see the
    module's docstring). Unpickles data from every rank: use only with trusted peers.

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
    mine, exc = _try_pickle(obj)
    heads = _exchange_heads(impl, mine, exc)  # every rank learns of a pickling error, and every rank's frames
    _raise_if_failed(impl, heads[:, 0], mine.stream, exc, fn)
    streams = _slices(heads[:, 0])[1] if at_root else None
    counts = heads[:, 1].tolist()
    received: list[tuple[list[np.ndarray], Any]] = [([], ())] * impl.size
    if not any(counts):
        impl.gather(mine.stream, streams, None, root, False)
    else:
        works = [impl.gather(mine.stream, streams, None, root, True)]
        tables = [np.empty((k, 2), _I64) for k in counts] if at_root else None
        impl.gather(mine.table, tables, None, root, False)
        if tables is not None:
            received = [_receive_buffers(t) for t in tables]
        for j in range(max(counts)):
            outs = [into[j] if j < len(into) else _empty() for into, _ in received] if at_root else None
            works.append(impl.gather(_frame(mine, j), outs, None, root, True))
        _wait(works)
    if streams is not None:
        for i, (s, (_, give)) in enumerate(zip(streams, received)):
            slots[i] = _unpickle(s, give)
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
    head = np.empty(3, _I64)  # [stream bytes, frames, the most frames of any rank]
    exc = None
    pickled: list[_Pickled] | None = None
    if impl.rank == root:
        objs = _check_list(scatter_object_input_list, fn, "scatter_object_input_list")
        if len(objs) != impl.size:
            raise ValueError(
                f"{fn}: scatter_object_input_list has {len(objs)} objects but the group has {impl.size} ranks"
            )
        pickled = []
        for o in objs:
            p, exc = _try_pickle(o)
            if exc is not None:  # every rank gets the error's text instead of an object
                pickled = [p] * impl.size
                break
            pickled.append(p)
        most = max((len(p.frames) for p in pickled), default=0)
        heads = np.array([[_announced(p, exc), len(p.frames), most] for p in pickled], _I64)
        impl.scatter(head, None, list(heads), root, False)
    else:
        impl.scatter(head, None, None, root, False)
    size, k, most = head.tolist()
    stream = np.empty(size if size >= 0 else -1 - size, np.uint8)
    streams = None if pickled is None else [p.stream for p in pickled]
    buffers: Any = ()
    if most == 0:
        impl.scatter(stream, None, streams, root, False)
    else:
        works = [impl.scatter(stream, None, streams, root, True)]
        table = np.empty((k, 2), _I64)
        impl.scatter(table, None, None if pickled is None else [p.table for p in pickled], root, False)
        into, buffers = _receive_buffers(table)
        for j in range(most):
            ins = None if pickled is None else [_frame(p, j) for p in pickled]
            works.append(impl.scatter(into[j] if j < k else _empty(), None, ins, root, True))
        _wait(works)
    if size < 0:
        raise _pickling_error(fn, "an object of scatter_object_input_list", impl, [root], stream) from exc
    scatter_object_output_list[0] = _unpickle(stream, buffers)
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
    mine, exc = _try_pickle(list(object_list))
    if exc is not None:
        raise _pickling_error(fn, "object_list", pg.control, [pg.rank()], mine.stream) from exc
    impl, tag = pg.control, _OBJECT_TAG
    head = np.array([mine.stream.size, len(mine.frames), len(object_list)], _I64)
    works = [impl.send(head, peer, tag), impl.send(mine.stream, peer, tag)]
    if mine.frames:
        works.append(impl.send(mine.table, peer, tag))
        works += [impl.send(frame, peer, tag) for frame in mine.frames]
    _wait(works)
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
        into, buffers = _receive_buffers(table)
        for frame in into:
            impl.recv_blocking(frame, None, sender, tag).wait()
    if count != len(object_list):
        raise ValueError(f"{fn}: object_list has {len(object_list)} slots but {count} objects arrived")
    object_list[:] = _unpickle(stream, buffers)
    return pg.ranks[sender]
