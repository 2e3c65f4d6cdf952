"""Pickling with out-of-band buffers: what the object functions (objects.py) send and receive.

:func:`pickled` pickles an object with protocol 5; every buffer of at least
:data:`OUT_OF_BAND_MIN_BYTES` inside it becomes a *frame*: a uint8 view of the
object's own memory, to be sent as a message of its own. The receiver allocates
exact-size buffers for the frames (:func:`receive_buffers`) and :func:`unpickle`
rebuilds the object on them, so nothing is copied on either side.

Two reductions are mpidist's own, installed only in this pickler (a per-call
``dispatch_table``, nothing global): numpy arrays of at least the threshold (numpy
pickles arrays of user dtypes such as ml_dtypes' bfloat16 in band), and torch CPU
storages (torch pickles each through ``torch.save``, slowly, and cannot pickle
uint16/uint32/uint64/float8 tensors in torch 2.13). A large storage is received
into a new torch uint8 tensor's memory and rebuilt on that tensor's storage, so the
received tensor stays resizable.

Unpickling runs code named by the sender: only among processes you trust.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from typing import Any

import numpy as np

__all__ = ["OUT_OF_BAND_MIN_BYTES", "PLAIN", "STORAGE", "Pickled", "pickled", "receive_buffers", "unpickle"]

#: Buffers of at least this many bytes travel out of band (a message of their own, no copy); smaller
#: ones are copied into the pickle stream, where they cost less than one more message would.
OUT_OF_BAND_MIN_BYTES = 64 << 10

_I64 = np.dtype(np.int64)
PLAIN, STORAGE = 0, 1  # kinds of frames (the table's second column): numpy memory, a torch storage


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


class Pickled:
    """An object ready to send: the pickle stream (or a pickling error's text) and the out-of-band buffers."""

    __slots__ = ("stream", "frames", "table")

    def __init__(self, stream: np.ndarray, frames: list[np.ndarray], table: np.ndarray) -> None:
        self.stream = stream  # uint8
        self.frames = frames  # uint8 views of the object's memory
        self.table = table  # int64 rows [bytes, kind], one per frame


def pickled(obj: Any) -> Pickled:
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
        rows.append((raw.nbytes, STORAGE if type(getattr(raw.obj, "base", None)) is _Memory else PLAIN))
        return False

    f = io.BytesIO()
    pickler = pickle.Pickler(f, protocol=5, buffer_callback=out_of_band)
    pickler.dispatch_table = _dispatch_table()
    pickler.dump(obj)
    stream = f.getbuffer()
    return Pickled(np.frombuffer(stream, np.uint8), frames, np.array(rows, _I64).reshape(-1, 2))


def _torch() -> Any:
    """The torch module (imported if it was not), or None where it is not installed."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    return torch


def receive_buffers(table: np.ndarray) -> tuple[list[np.ndarray], list[Any]]:
    """Exact-size buffers for the frames of ``table``: (the arrays MPI receives into, what pickle gets).

    A torch storage is received into the memory of a new uint8 tensor, whose storage
    the tensor is then rebuilt on (it stays resizable); anything else into a new
    numpy uint8 array, which the unpickled array is a view of.
    """
    into: list[np.ndarray] = []
    give: list[Any] = []
    for nbytes, kind in table.tolist():
        torch = _torch() if kind == STORAGE else None
        if torch is not None:
            t = torch.empty(nbytes, dtype=torch.uint8)
            into.append(_bytes_at(t.data_ptr(), nbytes, t))
            give.append(t)
        else:
            a = np.empty(nbytes, np.uint8)
            into.append(a)
            give.append(a)
    return into, give


def unpickle(stream: np.ndarray, buffers: list[Any] | tuple[()] = ()) -> Any:
    """Rebuild an object from its received stream and frames (``receive_buffers``' second list)."""
    return pickle.loads(stream, buffers=buffers)
