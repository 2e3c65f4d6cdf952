"""Device memory: arrays that live on a GPU, and the operations mpidist needs on them.

A device array (a cupy or numba array, a torch CUDA tensor, anything exposing
``__cuda_array_interface__`` or a CUDA DLPack capsule) becomes a :class:`DeviceArray`:
pointer, shape, dtype, strides, device, the stream its producer wrote on, and the
owner, kept alive. Backends take DeviceArrays as they take numpy arrays.

What needs the device runtime (synchronizing a stream, allocating, copying
between host and device, scaling in place) goes through a :class:`DeviceOps`:

* :class:`CupyOps` drives a real GPU through cupy (``pip install mpidist[gpu]``);
* an array type may bring its own ops in a ``__mpidist_device_ops__`` attribute:
  :class:`mpidist.testing.HostCudaArray` brings ``mpidist.testing.standin.HostOps``, whose "device"
  memory is host memory, so every device path runs on a machine without a GPU.

:func:`mpi_cuda_aware` tells whether the MPI library takes device pointers.
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any

import numpy as np

from .._validate import env_flag
from .._world import world
from ..reduce_op import divide_average
from .dtypes import BFLOAT16

__all__ = [
    "DeviceArray",
    "DeviceOps",
    "CupyOps",
    "from_cuda_interface",
    "from_torch_cuda",
    "from_dlpack",
    "mpi_cuda_aware",
    "DevicePointer",
    "BFLOAT16",
]

#: DLPack device types (dlpack.h): host memory, and the CUDA kinds mpidist takes
DLPACK_CPU = 1
DLPACK_CUDA = {2: "cuda", 3: "cuda_host", 13: "cuda_managed"}


class DeviceArray:
    """A device array as backends see it: where its elements are, and how to reach them.

    ``strides`` are in bytes (None: C-contiguous). ``stream`` is the stream the
    producer wrote on (``__cuda_array_interface__`` v3: None means nothing to
    wait for; 1 and 2 are CUDA's legacy and per-thread default streams).
    """

    __slots__ = ("ptr", "shape", "dtype", "strides", "device", "stream", "owner", "ops", "readonly")

    def __init__(
        self,
        ptr: int,
        shape: tuple[int, ...],
        dtype: np.dtype,
        strides: tuple[int, ...] | None,
        device: int,
        stream: int | None,
        owner: Any,
        ops: DeviceOps,
        readonly: bool = False,
    ) -> None:
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.strides = None if strides is None or strides == c_strides(shape, dtype.itemsize) else strides
        self.device = device
        self.stream = stream
        self.owner = owner
        self.ops = ops
        self.readonly = readonly

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def c_contiguous(self) -> bool:
        return self.strides is None or self.size <= 1

    def flat(self, start: int, count: int) -> DeviceArray:
        """Return elements ``start .. start+count`` of a contiguous array as a 1-D DeviceArray."""
        ptr = self.ptr + start * self.dtype.itemsize if count else self.ptr
        return DeviceArray(ptr, (count,), self.dtype, None, self.device, self.stream, self.owner, self.ops)

    def reshape(self, *shape: Any) -> DeviceArray:
        """Return a contiguous array with another shape (same elements)."""
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        shape = tuple(int(s) for s in shape)
        if -1 in shape:
            known = 1
            for s in shape:
                if s != -1:
                    known *= s
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        return DeviceArray(self.ptr, shape, self.dtype, None, self.device, self.stream, self.owner, self.ops)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        dtype = np.dtype(np.uint16) if self.dtype == BFLOAT16 else self.dtype
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": dtype.str,
            "data": (self.ptr, self.readonly),
            "strides": self.strides,
            "stream": None,  # backends synchronize before they hand the pointer on
        }

    def __repr__(self) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        return f"DeviceArray({self.dtype.name}[{dims}] on {self.ops.name}:{self.device})"


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """Byte offsets (lowest, one past highest) an array touches relative to its pointer."""
    if any(s == 0 for s in shape):
        return 0, 0
    lo = sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
    hi = sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + itemsize
    return lo, hi


class DevicePointer(np.ndarray):
    """A numpy array over device memory: a message for a CUDA-aware MPI call, and nothing else.

    Its metadata (shape, dtype, address, views of it) may be used on the host; its
    memory may not: numpy functions and ufuncs on it raise TypeError instead of
    reading GPU memory (a SIGSEGV on a GPU node), and host-side paths of the MPI
    backend (shared memory, packing, staging) must refuse it or stage the array first.
    """

    #: numpy functions that look only at metadata
    _METADATA = frozenset({"shares_memory", "may_share_memory", "shape", "ndim", "size", "result_type"})

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func.__name__ in self._METADATA:
            return super().__array_function__(func, types, args, kwargs)
        raise TypeError(f"numpy.{func.__name__}: a device pointer reached host code (only MPI calls may take it)")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise TypeError(f"numpy.{ufunc.__name__}: a device pointer reached host code (only MPI calls may take it)")

    def copy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("copy: a device pointer reached host code (only MPI calls may take it)")


class DeviceOps:
    """What a backend needs from the device runtime; one implementation per runtime."""

    name = "device"

    def synchronize(self, arr: DeviceArray) -> None:
        """Wait until the work its producer queued on ``arr.stream`` has finished."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, device: int) -> DeviceArray:
        """Allocate a C-contiguous device array."""
        raise NotImplementedError

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        """Copy ``src`` into ``dst`` (same shape; any strides); done when it returns."""
        raise NotImplementedError

    def to_host(self, dst: np.ndarray, src: DeviceArray) -> None:
        """Copy a device array into the C-contiguous host array ``dst``, after its producer's work."""
        raise NotImplementedError

    def to_device(self, dst: DeviceArray, src: np.ndarray) -> None:
        """Copy the C-contiguous host array ``src`` into ``dst``; done when it returns."""
        raise NotImplementedError

    def pinned(self, nbytes: int) -> np.ndarray:
        """Return page-locked host memory (uint8) for staging."""
        raise NotImplementedError

    def scale(self, arr: DeviceArray, factor: float) -> None:
        """Multiply in place (PREMUL_SUM's factor)."""
        raise NotImplementedError

    def divide(self, arr: DeviceArray, n: int) -> None:
        """Divide in place (AVG): true division for floats, truncation toward zero for integers."""
        raise NotImplementedError

    def mpi_buffer(self, arr: DeviceArray) -> DevicePointer:
        """What a CUDA-aware MPI is given for ``arr`` (contiguous): a :class:`DevicePointer` over its memory."""
        if arr.nbytes == 0:
            return np.empty(arr.shape, arr.dtype).view(DevicePointer)
        from mpi4py import MPI  # deferred: importing mpidist must not start MPI

        raw = MPI.buffer.fromaddress(arr.ptr, arr.nbytes)
        return np.frombuffer(raw, arr.dtype).reshape(arr.shape).view(DevicePointer)


class CupyOps(DeviceOps):
    """Device ops through cupy: streams, copies and arithmetic on a real GPU."""

    name = "cuda"

    def __init__(self, cupy: Any) -> None:
        self.cp = cupy

    def wrap(self, arr: DeviceArray) -> Any:
        """Return a cupy array over the same memory (bfloat16 as int16 bits: cupy has no bfloat16)."""
        cp = self.cp
        dtype = np.dtype(np.int16) if arr.dtype == BFLOAT16 else arr.dtype
        strides = arr.strides or c_strides(arr.shape, arr.dtype.itemsize)
        lo, hi = extent(arr.shape, strides, arr.dtype.itemsize)
        mem = cp.cuda.UnownedMemory(arr.ptr + lo, max(hi - lo, 1), arr.owner, arr.device)
        return cp.ndarray(arr.shape, dtype, cp.cuda.MemoryPointer(mem, -lo), strides=strides)

    def _stream(self, arr: DeviceArray) -> Any:
        cp = self.cp
        if arr.stream is None or arr.stream == 1:
            return cp.cuda.Stream.null
        return cp.cuda.ExternalStream(arr.stream, arr.device)

    def synchronize(self, arr: DeviceArray) -> None:
        if arr.stream is not None:
            with self.cp.cuda.Device(arr.device):
                self._stream(arr).synchronize()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, device: int) -> DeviceArray:
        cp = self.cp
        with cp.cuda.Device(device):
            x = cp.empty(shape, np.int16 if dtype == BFLOAT16 else dtype)
        return DeviceArray(x.data.ptr, tuple(shape), dtype, None, device, None, x, self)

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        with self.cp.cuda.Device(dst.device):
            stream = self._stream(src)
            with stream:
                self.wrap(dst)[...] = self.wrap(src).reshape(dst.shape)
            stream.synchronize()

    def to_host(self, dst: np.ndarray, src: DeviceArray) -> None:
        with self.cp.cuda.Device(src.device):
            d = self.wrap(src)
            out = dst.view(d.dtype).reshape(d.shape)
            d.get(stream=self._stream(src), out=out, blocking=True)

    def to_device(self, dst: DeviceArray, src: np.ndarray) -> None:
        with self.cp.cuda.Device(dst.device):
            d = self.wrap(dst)
            stream = self._stream(dst)
            d.set(src.view(d.dtype).reshape(d.shape), stream=stream)
            stream.synchronize()

    def pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cp.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, np.uint8, nbytes)

    def _arith(self, arr: DeviceArray, what: str) -> Any:
        if arr.dtype == BFLOAT16:
            raise TypeError(
                f"{what} on bfloat16 device arrays needs the nccl backend (cupy has no bfloat16 arithmetic)"
            )
        return self.wrap(arr)

    def scale(self, arr: DeviceArray, factor: float) -> None:
        with self.cp.cuda.Device(arr.device):
            d = self._arith(arr, "PREMUL_SUM")
            d *= factor

    def divide(self, arr: DeviceArray, n: int) -> None:
        with self.cp.cuda.Device(arr.device):
            divide_average(self._arith(arr, "AVG"), n, self.cp)


def _cupy_ops(fn: str, arg: str, what: str) -> CupyOps:
    ops = world.device_ops
    if ops is None:
        try:
            cupy = importlib.import_module("cupy")
        except ImportError as exc:
            raise TypeError(
                f"{fn}: {arg} is {what}; mpidist reaches GPU memory through cupy, which is not "
                "installed: pip install 'mpidist[gpu]' (or cupy-cuda12x)"
            ) from exc
        ops = world.device_ops = CupyOps(cupy)
    return ops


def _ops_for(obj: Any, fn: str, arg: str, what: str) -> DeviceOps:
    own = getattr(type(obj), "__mpidist_device_ops__", None)
    return own if own is not None else _cupy_ops(fn, arg, what)


def _dtype_from_typestr(obj: Any, typestr: str, fn: str, arg: str) -> np.dtype:
    dtype = np.dtype(typestr)
    if dtype.kind == "V" and dtype.itemsize == 2 and getattr(getattr(obj, "dtype", None), "name", "") == "bfloat16":
        assert BFLOAT16 is not None
        return BFLOAT16
    return dtype


def from_cuda_interface(obj: Any, fn: str, arg: str) -> DeviceArray:
    """Describe an object exposing ``__cuda_array_interface__`` (zero-copy)."""
    try:
        cai = obj.__cuda_array_interface__
    except Exception as exc:  # noqa: BLE001 - the exporter's own refusal, e.g. requires_grad
        raise TypeError(f"{fn}: {arg} does not export its memory: {exc}") from exc
    if not isinstance(cai, dict) or "data" not in cai or "shape" not in cai or "typestr" not in cai:
        raise TypeError(f"{fn}: {arg} has a malformed __cuda_array_interface__ (needs data, shape, typestr)")
    if cai.get("mask") is not None:
        raise TypeError(f"{fn}: {arg} is a masked CUDA array; mpidist sends unmasked arrays")
    ops = _ops_for(obj, fn, arg, f"a CUDA array ({type(obj).__module__}.{type(obj).__qualname__})")
    ptr, readonly = cai["data"]
    shape = tuple(int(s) for s in cai["shape"])
    dtype = _dtype_from_typestr(obj, cai["typestr"], fn, arg)
    strides = cai.get("strides")
    strides = None if strides is None else tuple(int(s) for s in strides)
    device = _device_of(obj, ops, ptr)
    return DeviceArray(int(ptr or 0), shape, dtype, strides, device, cai.get("stream"), obj, ops, bool(readonly))


def _device_of(obj: Any, ops: DeviceOps, ptr: int) -> int:
    dev = getattr(obj, "device", None)
    ident = getattr(dev, "id", None)  # cupy.cuda.Device
    if ident is None:
        ident = getattr(dev, "index", None)  # torch.device
    if isinstance(ident, int):
        return ident
    if isinstance(ops, CupyOps) and ptr:
        attrs = ops.cp.cuda.runtime.pointerGetAttributes(ptr)
        return int(attrs.device)
    return 0


def from_torch_cuda(t: Any, torch: Any, dtype: np.dtype, fn: str, arg: str) -> DeviceArray:
    """Describe a torch CUDA tensor (zero-copy; its current stream is the producer's)."""
    ops = _cupy_ops(fn, arg, "a torch CUDA tensor")
    item = t.element_size()
    strides = tuple(s * item for s in t.stride())
    stream = torch.cuda.current_stream(t.device).cuda_stream
    return DeviceArray(t.data_ptr(), tuple(t.shape), dtype, strides, t.device.index or 0, stream or 1, t, ops)


def from_dlpack(obj: Any, device_type: int, fn: str, arg: str) -> DeviceArray:
    """Describe a CUDA DLPack exporter, through cupy (zero-copy)."""
    ops = _cupy_ops(fn, arg, f"a CUDA DLPack array ({type(obj).__module__}.{type(obj).__qualname__})")
    x = ops.cp.from_dlpack(obj)
    return from_cuda_interface(x, fn, arg)


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library this process loaded (found in /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths, key=len):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def mpi_cuda_aware() -> bool:
    """Return True if the MPI library takes device pointers (checked once per process).

    ``MPIDIST_CUDA_AWARE=1`` or ``0`` overrides the check, which asks the library
    through ``MPIX_Query_cuda_support`` (Open MPI, MPICH >= 4).
    """
    if world.cuda_aware is None:
        forced = env_flag("MPIDIST_CUDA_AWARE", default=None)
        if forced is not None:
            world.cuda_aware = forced
        else:
            from mpi4py import MPI

            if not MPI.Is_initialized() or MPI.Is_finalized():
                return False  # MPICH aborts on MPIX_ calls outside MPI; ask again once it runs
            lib = _libmpi()
            query = getattr(lib, "MPIX_Query_cuda_support", None) if lib is not None else None
            world.cuda_aware = bool(query()) if query is not None else False
    return bool(world.cuda_aware)
