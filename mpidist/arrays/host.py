"""Array handling: the only module that knows which kinds of arrays exist.

Collectives hand every user array to one of the ``prepare_*`` functions and get
back a C-contiguous numpy array that a backend can give to MPI, plus, for
outputs that had to be staged, the caller's array to copy the result into.

* A C-contiguous array of a supported dtype is returned as it is: never copied.
* A non-contiguous one is staged through a contiguous copy (counted in
  ``world.stats``) and, for outputs, written back after completion.
* Anything else (lists, scalars, object or structured dtypes, read-only outputs)
  raises a TypeError or ValueError that names the function and the argument.

Array kinds (:func:`adapt`):

* numpy arrays, and host DLPack exporters (through ``numpy.from_dlpack``);
* torch CPU tensors: a numpy view of the tensor's memory (bfloat16 as its bits,
  strides kept, so results land in the caller's tensor); requires_grad ignored
  for the data, as in torch.distributed;
* GPU memory (cupy and numba arrays, torch CUDA tensors, CUDA DLPack exporters):
  a :class:`~mpidist.arrays.device.DeviceArray`. Backends take it as they take numpy
  arrays; a non-contiguous one is staged through a contiguous device copy.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence, Union

import numpy as np

from .._validate import c_extension_refused
from .._world import world
from .device import DLPACK_CPU, DLPACK_CUDA, DeviceArray, from_cuda_interface, from_dlpack, from_torch_cuda
from .dtypes import BFLOAT16, DTYPES, TYPESTR, DtypeInfo, describe, dtype_info

_asarray = np.asarray

__all__ = [
    "DtypeInfo",
    "DTYPES",
    "adapt",
    "torch_dtypes",
    "prepare_input",
    "prepare_output",
    "prepare_inout",
    "prepare_source",
    "prepare_input_list",
    "prepare_output_list",
    "dtype_info",
    "describe",
    "write_back",
    "copy_in",
    "then_write_back",
    "may_overlap",
    "byte_spans",
    "may_overlap_any",
    "own_separate_memory",
    "as_array",
    "DeviceArray",
    "is_device",
    "host_view",
    "as_host_array",
]

ndarray = np.ndarray

#: what backends get: a C-contiguous numpy array, or a DeviceArray for GPU memory
Buffer = Union[ndarray, DeviceArray]

#: the array kinds mpidist takes, for messages
_KINDS = "numpy.ndarray, torch.Tensor, or a CUDA array with __cuda_array_interface__ or DLPack"


def torch_dtypes(torch: Any) -> dict[Any, np.dtype]:
    """torch dtype -> numpy dtype, for the dtypes mpidist sends (built once per process)."""
    table = world.torch_dtypes
    if table is None:
        names = {
            "bool": np.bool_, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
            "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
            "float16": np.float16, "float32": np.float32, "float64": np.float64,
            "complex64": np.complex64, "complex128": np.complex128,
        }  # fmt: skip
        table = {getattr(torch, n): np.dtype(t) for n, t in names.items() if hasattr(torch, n)}
        if BFLOAT16 is not None:
            table[torch.bfloat16] = BFLOAT16
        world.torch_dtypes = table
        if _ready is not None:  # from now on the C readiness check makes plain CPU tensors' views itself
            _ready.bind_torch(torch.Tensor, torch.nn.Parameter, table)
    return table


class _TensorMemory:
    """A CPU tensor's memory as numpy sees it (``__array_interface__``), holding the tensor alive.

    ``Tensor.numpy()`` would be simpler but marks the tensor's storage
    non-resizable for good; torch's own code resizes tensors that went through
    a collective (DDP's batched PowerSGD hook resizes its bucket buffer), and
    gloo leaves them resizable, so mpidist must too.
    """

    __slots__ = ("tensor", "__array_interface__")


def _cpu_tensor_view(t: Any, dtype: np.dtype) -> ndarray:
    """numpy view of a dense CPU tensor's memory (zero-copy, strides kept, storage left resizable)."""
    memory = _TensorMemory()
    memory.tensor = t
    iface = {"data": (t.data_ptr(), False), "shape": t.shape, "typestr": TYPESTR[dtype], "version": 3}
    if not t.is_contiguous():
        size = dtype.itemsize
        iface["strides"] = tuple(s * size for s in t.stride())
    memory.__array_interface__ = iface
    view = _asarray(memory)
    return view.view(dtype) if dtype.kind == "V" else view  # bfloat16 arrives as raw 2-byte voids


def host_view(x: Any) -> Any:
    """Return a plain CPU tensor's numpy view (for the readiness check of ``prepare_*``), anything else unchanged.

    Costs about 1 us on a tensor (``Tensor.numpy()`` would cost 0.5 us but pins
    the storage's size, see :class:`_TensorMemory`); the checks and messages for
    every other case stay in :func:`_torch_array`, where :func:`adapt` sends it.
    """
    if type(x) is ndarray:
        return x
    torch = sys.modules.get("torch")  # _torch_of, inlined: every call runs this
    if torch is not None and isinstance(x, torch.Tensor):
        # torch.distributed acts on the data of a tensor that requires grad
        if x.is_cpu and x.layout is torch.strided and not (x.is_conj() or x.is_neg() or x.is_nested):
            dtype = torch_dtypes(torch).get(x.dtype)
            if dtype is not None:
                return _cpu_tensor_view(x, dtype)
    return x


def _torch_array(t: Any, torch: Any, fn: str, arg: str) -> ndarray | DeviceArray:
    """Return a numpy view of a CPU tensor's memory (zero-copy, strides kept), or a CUDA tensor's DeviceArray.

    Like torch.distributed, a tensor that requires grad is read and written
    without autograd (the collective acts on its data, as on ``t.detach()``).
    """
    if getattr(t, "is_nested", False):
        raise TypeError(f"{fn}: {arg} is a nested tensor; mpidist sends dense tensors, pass its components one by one")
    if t.layout is not torch.strided:
        raise TypeError(f"{fn}: {arg} is a {t.layout} tensor; mpidist sends dense (strided) tensors, pass t.to_dense()")
    kind = t.device.type
    if kind not in ("cpu", "cuda"):
        raise TypeError(f"{fn}: {arg} is a torch tensor on device {kind!r}; mpidist takes CPU and CUDA tensors")
    if t.is_conj() or t.is_neg():
        raise TypeError(
            f"{fn}: {arg} is a lazily conjugated or negated view; its memory does not hold its values, "
            "pass t.resolve_conj().resolve_neg() (a copy)"
        )
    dtype = torch_dtypes(torch).get(t.dtype)
    if dtype is None:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in torch_dtypes(torch)))
        raise TypeError(f"{fn}: {arg} has dtype {t.dtype}, which mpidist does not send; supported: {names}")
    if t.requires_grad:
        t = t.detach()
    if kind == "cuda":
        return from_torch_cuda(t, torch, dtype, fn, arg)
    return _cpu_tensor_view(t, dtype)


def _from_dlpack(x: Any, fn: str, arg: str) -> ndarray | DeviceArray:
    try:
        device_type = int(x.__dlpack_device__()[0])
    except Exception as exc:  # noqa: BLE001 - a broken exporter
        raise TypeError(f"{fn}: {arg} has a __dlpack_device__ that failed: {exc}") from exc
    if device_type == DLPACK_CPU:
        return np.from_dlpack(x)
    if device_type in DLPACK_CUDA:
        return from_dlpack(x, device_type, fn, arg)
    raise TypeError(f"{fn}: {arg} is a DLPack array on device type {device_type}; mpidist takes host and CUDA memory")


def adapt(x: Any, fn: str, arg: str) -> ndarray | DeviceArray:
    """Return a numpy view of ``x`` or a DeviceArray (zero-copy), or raise a TypeError."""
    if isinstance(x, ndarray):
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(
                f"{fn}: {arg} is a numpy masked array; its mask would be ignored, "
                "pass arr.filled(value) or arr.data explicitly"
            )
        return x
    torch = _torch_of(x)
    if torch is not None:
        return _torch_array(x, torch, fn, arg)
    if type(x) is DeviceArray:
        return x
    cls = type(x)
    if hasattr(cls, "__cuda_array_interface__"):
        return from_cuda_interface(x, fn, arg)
    if hasattr(cls, "__dlpack_device__") and hasattr(cls, "__dlpack__"):
        return _from_dlpack(x, fn, arg)
    hint = ""
    if isinstance(x, (list, tuple, int, float, complex, bool)):
        hint = "; convert it with numpy.asarray(...)"
    elif isinstance(x, np.generic):
        hint = "; numpy scalars are immutable, use numpy.array(value) instead"
    raise TypeError(f"{fn}: {arg} must be an array ({_KINDS}), got {type(x).__module__}.{type(x).__qualname__}{hint}")


def is_device(x: Any) -> bool:
    """True for a prepared device array (what backends get for GPU memory)."""
    return type(x) is DeviceArray


def as_host_array(x: Any, fn: str, arg: str, writeable: bool = False) -> tuple[ndarray, DeviceArray | None]:
    """Like :func:`as_array`, but a device array is copied into host memory (a counted copy).

    Returns ``(host array, device array or None)``; an output's result goes back with
    ``write_back(host, device)``. For calls that pack their arrays anyway (``*_coalesced``).
    """
    a = x if type(x) is ndarray else adapt(x, fn, arg)
    if type(a) is not DeviceArray:
        return as_array(a, fn, arg, writeable), None
    dtype_info(a.dtype, fn, arg)
    if writeable and a.readonly:
        raise ValueError(f"{fn}: {arg} is read-only; outputs must be writeable arrays (pass a copy)")
    if writeable:
        _check_distinct(a.strides or (), a.shape, fn, arg)
    h = a.ops.pinned(a.nbytes).view(a.dtype).reshape(a.shape)
    a.ops.to_host(h, a)
    world.stats.count_copy(a.nbytes)
    return h, a


def as_array(x: Any, fn: str, arg: str, writeable: bool = False) -> ndarray:
    """Return a validated numpy view of ``x`` (any layout), without staging."""
    a = x if type(x) is ndarray else adapt(x, fn, arg)
    if type(a) is DeviceArray:
        raise TypeError(f"{fn}: {arg} is a device array; {fn} takes host arrays (numpy, CPU tensors) only")
    dtype_info(a.dtype, fn, arg)
    if writeable:
        _check_writeable(a, fn, arg)
    return a


def _count_copy(a: ndarray) -> None:
    world.stats.count_copy(a.nbytes)


def _contiguous_copy(a: ndarray) -> ndarray:
    out = np.array(a, order="C", copy=True)
    _count_copy(out)
    return out


def _device_copy(a: DeviceArray, keep_data: bool) -> DeviceArray:
    tmp = a.ops.empty(a.shape, a.dtype, a.device)
    tmp.stream = a.stream
    if keep_data:
        a.ops.copy(tmp, a)
    world.stats.count_copy(tmp.nbytes)
    return tmp


def prepare_input(x: Any, fn: str, arg: str, index: int | None = None) -> Buffer:
    """Return a C-contiguous array (numpy, or DeviceArray for GPU memory) with ``x``'s data, for reading only.

    The first test is the readiness check of every call: a C-contiguous numpy
    array (or a plain CPU tensor's view) of a supported dtype goes to MPI as it is.
    ``index``: ``x`` is ``arg[index]`` (named so in errors; the name is made only then).
    """
    if type(x) is not ndarray:
        x = host_view(x)
    if type(x) is ndarray and x.dtype in DTYPES and x.flags.c_contiguous:
        return x
    if index is not None:
        arg = f"{arg}[{index}]"
    a = adapt(x, fn, arg)
    dtype_info(a.dtype, fn, arg)
    if type(a) is DeviceArray:
        return a if a.c_contiguous else _device_copy(a, keep_data=True)
    return a if a.flags.c_contiguous else _contiguous_copy(a)


def prepare_source(x: Any, fn: str, arg: str) -> tuple[Buffer, Buffer | None]:
    """:func:`prepare_input` for an operation that reads ``x`` again on every run (persistent operations).

    Returns ``(buffer, source)``: ``source`` is None when the buffer is ``x``'s own
    memory (a C-contiguous array of a supported dtype: every run reads what ``x``
    holds then), else the caller's array whose current values :func:`copy_in`
    copies into the staged buffer before each run.
    """
    if type(x) is not ndarray:
        x = host_view(x)
    if type(x) is ndarray and x.dtype in DTYPES and x.flags.c_contiguous:
        return x, None
    a = adapt(x, fn, arg)
    dtype_info(a.dtype, fn, arg)
    if type(a) is DeviceArray:
        return (a, None) if a.c_contiguous else (_device_copy(a, keep_data=True), a)
    return (a, None) if a.flags.c_contiguous else (_contiguous_copy(a), a)


def _check_writeable(a: ndarray, fn: str, arg: str) -> None:
    if not a.flags.writeable:
        raise ValueError(f"{fn}: {arg} is read-only; outputs must be writeable arrays (pass a copy)")


def _writable_preparer(keep_data: bool) -> Callable[[Any, str, str], tuple[Buffer, Buffer | None]]:
    """Make :func:`prepare_inout` (``keep_data``) and :func:`prepare_output`: one body, no extra call per use."""

    def prepare(x: Any, fn: str, arg: str, index: int | None = None) -> tuple[Buffer, Buffer | None]:
        if type(x) is not ndarray:
            x = host_view(x)
        if type(x) is ndarray and x.dtype in DTYPES:  # the readiness check (see prepare_input)
            f = x.flags
            if f.c_contiguous and f.writeable:
                return x, None
        return _prepare_writable(x, fn, arg if index is None else f"{arg}[{index}]", keep_data)

    return prepare


prepare_inout = _writable_preparer(keep_data=True)
prepare_inout.__name__ = prepare_inout.__qualname__ = "prepare_inout"
prepare_inout.__doc__ = """Return ``(buffer, target)``: a contiguous buffer holding ``x``'s data.

    ``target`` is None when the buffer is ``x`` itself, else the array to copy
    the result into with :func:`write_back` once the operation completes.
    """

prepare_output = _writable_preparer(keep_data=False)
prepare_output.__name__ = prepare_output.__qualname__ = "prepare_output"
prepare_output.__doc__ = """Like :func:`prepare_inout`, for pure outputs: a staged buffer is left uninitialised."""


def prepare_pair(out: Any, inp: Any, fn: str, out_arg: str, in_arg: str) -> tuple[Buffer, Buffer | None, Buffer]:
    """``prepare_output(out)`` and ``prepare_input(inp)`` in one step: ``(out buffer, target, in buffer)``.

    For the collectives with one output and one input (all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single): the readiness check of both arrays
    at the cost of one call.
    """
    if type(out) is ndarray and type(inp) is ndarray:
        dtype = out.dtype
        if dtype in DTYPES and (inp.dtype is dtype or inp.dtype in DTYPES):
            f = out.flags
            if f.c_contiguous and f.writeable and inp.flags.c_contiguous:
                return out, None, inp
    buf, target = prepare_output(out, fn, out_arg)
    return buf, target, prepare_input(inp, fn, in_arg)


def _check_distinct(strides: Sequence[int], shape: Sequence[int], fn: str, arg: str) -> None:
    """Refuse an output whose elements share memory (stride 0, from expand or broadcast_to)."""
    if any(st == 0 and n > 1 for st, n in zip(strides, shape)):
        raise ValueError(
            f"{fn}: {arg} is an expanded (stride-0) view whose elements share memory; an output needs "
            "one memory location per element, pass a contiguous array"
        )


def _prepare_writable(x: Any, fn: str, arg: str, keep_data: bool) -> tuple[Buffer, Buffer | None]:
    """The rest of :func:`prepare_inout`/:func:`prepare_output`, for an ``x`` the readiness check did not take."""
    a = adapt(x, fn, arg)
    dtype_info(a.dtype, fn, arg)
    if type(a) is DeviceArray:
        if a.readonly:
            raise ValueError(f"{fn}: {arg} is read-only; outputs must be writeable arrays (pass a copy)")
        if a.c_contiguous:
            return a, None
        _check_distinct(a.strides or (), a.shape, fn, arg)
        return _device_copy(a, keep_data), a
    _check_writeable(a, fn, arg)
    if a.flags.c_contiguous:
        return a, None
    _check_distinct(a.strides, a.shape, fn, arg)
    if keep_data:
        return _contiguous_copy(a), a
    tmp = np.empty(a.shape, a.dtype)
    _count_copy(tmp)
    return tmp, a


def write_back(buf: ndarray | DeviceArray, target: ndarray | DeviceArray) -> None:
    """Copy a staged result into the caller's array (host or device)."""
    if type(target) is DeviceArray:
        if type(buf) is DeviceArray:
            target.ops.copy(target, buf)
        else:
            target.ops.to_device(target, buf)
        return
    np.copyto(target, buf.reshape(target.shape), casting="no")


def then_write_back(finish: Callable[[], None] | None, backs: Any) -> Callable[[], None] | None:
    """``finish()``, then the write-backs of staged outputs (``(buffer, target)`` pairs): what completes
    an operation, as one callable (None if there is nothing to do)."""
    if not backs:
        return finish

    def post() -> None:
        if finish is not None:
            finish()
        for buf, target in backs:
            write_back(buf, target)

    return post


def copy_in(buf: ndarray | DeviceArray, source: ndarray | DeviceArray) -> None:
    """Copy the caller's array ``source`` into its staged buffer (the reverse of :func:`write_back`), counted."""
    if type(buf) is DeviceArray:
        buf.ops.copy(buf, source)
    else:
        np.copyto(buf, source, casting="no")
    world.stats.count_copy(buf.nbytes)


def _check_list(xs: Any, fn: str, arg: str, n: int | None) -> Sequence[Any]:
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{fn}: {arg} must be a list of arrays, got {type(xs).__name__}")
    if n is not None and len(xs) != n:
        raise ValueError(f"{fn}: {arg} has {len(xs)} arrays but the group has {n} ranks; pass one per rank")
    return xs


def prepare_input_list(xs: Any, fn: str, arg: str, n: int | None = None) -> list[Buffer]:
    """Prepare every array of a list as an input (see :func:`prepare_input`)."""
    xs = _check_list(xs, fn, arg, n)
    return [prepare_input(x, fn, arg, i) for i, x in enumerate(xs)]


def prepare_output_list(
    xs: Any, fn: str, arg: str, n: int | None = None
) -> tuple[list[Buffer], list[tuple[Buffer, Buffer]]]:
    """Prepare every array of a list as an output.

    Returns the buffers and the ``(buffer, target)`` pairs that need a write-back.
    """
    xs = _check_list(xs, fn, arg, n)
    bufs: list[Buffer] = []
    backs: list[tuple[Buffer, Buffer]] = []
    for i, x in enumerate(xs):
        buf, target = prepare_output(x, fn, arg, i)
        bufs.append(buf)
        if target is not None:
            backs.append((buf, target))
    return bufs, backs


def _torch_of(x: Any) -> Any:
    """Return the torch module if ``x`` is a torch tensor, else None (never imports torch)."""
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def array_or_tensor_arg(x: Any, fn: str, arg: str) -> tuple[np.ndarray, Any]:
    """Validate ``x`` as a numpy array or CPU torch tensor of a dtype mpidist sends.

    Returns ``(view, torch)``: a zero-copy numpy view of ``x`` (``x`` itself for
    numpy; read and written without autograd for a tensor) and the torch module
    for a tensor, None for a numpy array. Raises _arrays' TypeError or ValueError.
    """
    view = as_array(x, fn, arg)
    torch = _torch_of(x)
    if torch is None and not isinstance(x, np.ndarray):  # a kind _arrays takes but the utilities cannot return
        raise TypeError(
            f"{fn}: {arg} must be a numpy.ndarray or a CPU torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}"
        )
    return view, torch


def new_like(x: Any, view: np.ndarray, torch: Any, shape: tuple[int, ...], fn: str) -> tuple[Any, np.ndarray]:
    """Return a new uninitialized array of ``x``'s kind and dtype, and a numpy view of it."""
    if torch is None:
        out = np.empty(shape, view.dtype)
        return out, out
    out = torch.empty(shape, dtype=x.dtype)
    return out, as_array(out, fn, "output")


def displacements(counts: Sequence[int]) -> list[int]:
    """Where each of consecutive blocks of ``counts`` starts: ``[0, c0, c0 + c1, ...]`` (one per count)."""
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def overlapping_pair(spans: Sequence[tuple[Any, int, int, int]]) -> tuple[int, int] | None:
    """The first two of ``spans`` that share memory, as ``(i, j)`` with ``i < j``, or None.

    Each span is ``(memory space, start, end, index)``: the space is 0 for host
    memory or the device for GPU memory, start and end are byte addresses. Empty
    spans never overlap. (Sorted by start, two spans overlap only if two
    neighbours do.)
    """
    ordered = sorted(s for s in spans if s[2] > s[1])
    for (d1, _, end, i), (d2, start, _, j) in zip(ordered, ordered[1:]):
        if d1 == d2 and start < end:
            return min(i, j), max(i, j)
    return None


def refuse_overlapping_outputs(spans: Sequence[tuple[Any, int, int, int]], fn: str, arg: str) -> None:
    """Raise the ValueError for outputs ``arg[i]`` and ``arg[j]`` that share memory (see :func:`overlapping_pair`)."""
    pair = overlapping_pair(spans)
    if pair is not None:
        raise ValueError(
            f"{fn}: {arg}[{pair[0]}] and {arg}[{pair[1]}] overlap in memory; every output needs its own memory"
        )


def may_overlap_any(a: ndarray, arrays: Sequence[ndarray]) -> bool:
    """Return True unless ``a`` certainly shares memory with none of ``arrays`` (see :func:`may_overlap`)."""
    for b in arrays:
        if may_overlap(a, b):
            return True
    return False


def own_separate_memory(arrays: Sequence[Any]) -> bool:
    """Return True if no two of ``arrays`` can share memory because each owns its own.

    Numpy arrays that own their memory (numpy allocated it: the common case, a
    list of ``np.empty`` arrays) and are all different objects cannot overlap;
    then the sorted span check (:func:`overlapping_pair`) is not needed. False
    means "not decided here". (``owndata``, not ``base is None``: an array that
    a C extension made over foreign memory has no base but does not own it.)
    """
    for a in arrays:
        if type(a) is not ndarray or not a.flags.owndata:
            return False
    return len(set(map(id, arrays))) == len(arrays)


def byte_spans(arrays: Sequence[Buffer]) -> tuple[list[int], list[int], int, int, bool]:
    """The layout of C-contiguous arrays (numpy, or device arrays for CUDA-aware MPI) for one vector message.

    Returns each array's byte count and address (0 for an empty one), the lowest
    address and the end of the highest byte any of them spans (-1, -1 if all are
    empty), and whether they are certainly disjoint (no two share a byte; see
    :func:`refuse_overlapping_outputs` for the error). One pass over the list, in C
    where ``_ready.c`` is built: the list collectives run it on every call.
    """
    counts: list[int] = []
    addrs: list[int] = []
    lo = hi = -1
    for a in arrays:
        n = a.nbytes
        counts.append(n)
        if n:
            addr = a.ptr if type(a) is DeviceArray else a.__array_interface__["data"][0]
            addrs.append(addr)
            if lo < 0 or addr < lo:
                lo = addr
            if addr + n > hi:
                hi = addr + n
        else:
            addrs.append(0)
    disjoint = own_separate_memory(arrays) or (
        overlapping_pair([(0, addr, addr + n, i) for i, (addr, n) in enumerate(zip(addrs, counts))]) is None
    )
    return counts, addrs, lo, hi, disjoint


def may_overlap(a: ndarray, b: ndarray) -> bool:
    """Return True unless ``a`` and ``b`` certainly use separate memory.

    Cheap when each array owns its memory or is a view of an array that does
    (numpy points ``base`` at the owner); otherwise numpy's bounds check decides.
    """
    oa = a.base
    ob = b.base
    if oa is None and ob is None:
        return a is b  # each owns its memory (the common case: decided without numpy)
    if oa is None:
        oa = a
    if ob is None:
        ob = b
    if oa is not ob and type(oa) is ndarray and type(ob) is ndarray and oa.base is None and ob.base is None:
        return False
    return bool(np.may_share_memory(a, b))


def _checks_in_c() -> tuple[Callable[..., Any], ...] | None:
    """The four ``prepare_*`` functions, :func:`may_overlap` and :func:`byte_spans` in C (``_ready.c``), where built.

    They answer ready arrays without a Python frame (about 0.1 us less per array),
    make plain CPU tensors' views (once :func:`torch_dtypes` has bound torch), and
    hand anything else to the Python functions above.
    """
    if _ready is None:
        return None
    _ready.bind(DTYPES, *IN_PYTHON)
    return (
        _ready.prepare_input, _ready.prepare_output, _ready.prepare_inout, _ready.prepare_pair, _ready.may_overlap,
        _ready.byte_spans,
    )  # fmt: skip


if c_extension_refused():  # MPIDIST_C_EXTENSIONS=0: the Python functions do it all
    _ready = None
else:
    try:
        from . import _ready
    except ImportError:  # not built (no C compiler at install): the Python functions do it all
        _ready = None

#: the Python functions; where the C module exists it hands them what it does not take (tests compare the two)
IN_PYTHON = (prepare_input, prepare_output, prepare_inout, prepare_pair, may_overlap, byte_spans)
_in_c = _checks_in_c()
if _in_c is not None:
    prepare_input, prepare_output, prepare_inout, prepare_pair, may_overlap, byte_spans = _in_c
