"""Stand-ins for GPU memory, to test device paths without a GPU.

``HostCudaArray`` is host memory dressed as a CUDA array; ``HostOps`` is its
"device" runtime (copies and synchronizations on host memory, recorded).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from ..arrays.device import DeviceArray, DeviceOps, c_strides, extent
from ..reduce_op import divide_average

__all__ = ["HostCudaArray", "HostOps"]


class HostOps(DeviceOps):
    """Device ops for "device" arrays whose memory is host memory (tests without a GPU).

    Records the streams of the last synchronizations it was asked for (``syncs``, the
    newest 1024), so tests can check that a backend waits for the producer before it
    touches the memory.
    """

    name = "host-standin"

    def __init__(self) -> None:
        self.syncs: collections.deque[int | None] = collections.deque(maxlen=1024)

    def view(self, arr: DeviceArray) -> np.ndarray:
        """Return a numpy view of the array's memory (possible only because it is host memory)."""
        if arr.size == 0:
            return np.empty(arr.shape, arr.dtype)
        from mpi4py import MPI  # deferred: importing mpidist.testing must not start MPI

        strides = arr.strides or c_strides(arr.shape, arr.dtype.itemsize)
        lo, hi = extent(arr.shape, strides, arr.dtype.itemsize)
        buf = MPI.buffer.fromaddress(arr.ptr + lo, hi - lo, readonly=False)
        return np.ndarray(arr.shape, arr.dtype, buffer=buf, offset=-lo, strides=strides)

    def synchronize(self, arr: DeviceArray) -> None:
        self.syncs.append(arr.stream)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, device: int) -> DeviceArray:
        host = np.empty(shape, dtype)
        return DeviceArray(host.ctypes.data, tuple(shape), dtype, None, device, None, host, self)

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        np.copyto(self.view(dst), self.view(src).reshape(dst.shape), casting="no")

    def to_host(self, dst: np.ndarray, src: DeviceArray) -> None:
        self.synchronize(src)
        np.copyto(dst, self.view(src).reshape(dst.shape), casting="no")

    def to_device(self, dst: DeviceArray, src: np.ndarray) -> None:
        self.synchronize(dst)  # as CupyOps: the copy is ordered on the array's stream, then waited for
        np.copyto(self.view(dst), src.reshape(dst.shape), casting="no")

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def scale(self, arr: DeviceArray, factor: float) -> None:
        v = self.view(arr)
        np.multiply(v, factor, out=v, casting="unsafe")

    def divide(self, arr: DeviceArray, n: int) -> None:
        divide_average(self.view(arr), n, np)


_OPS = HostOps()


class HostCudaArray:
    """A numpy array exposed only through ``__cuda_array_interface__`` (version 3).

    mpidist treats it as GPU memory: it takes the device paths (the MPI backend's
    CUDA-aware or pinned-staging route, stream synchronization), while the memory
    is plain host memory, so those paths run and can be checked on any machine.
    Its device operations (copies, synchronization) are :class:`HostOps`,
    which records every stream synchronization in ``HostCudaArray.ops.syncs``.

    Args:
        host: the numpy array whose memory this array exposes (not copied).
        stream: the stream handle to report as the producer's (``None``: nothing to wait for).

    Example::

        >>> x = HostCudaArray(np.arange(4.0))
        >>> dist.all_reduce(x)              # the device path; x.get() holds the sum
    """

    __mpidist_device_ops__ = _OPS
    ops = _OPS

    def __init__(self, host: np.ndarray, stream: int | None = 1) -> None:
        if not isinstance(host, np.ndarray):
            raise TypeError(f"HostCudaArray: host must be a numpy.ndarray, got {type(host).__name__}")
        self.host = host
        self.stream = stream

    @property
    def shape(self) -> tuple[int, ...]:
        return self.host.shape

    @property
    def dtype(self) -> np.dtype:
        return self.host.dtype

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        h = self.host
        return {
            "version": 3,
            "shape": h.shape,
            "typestr": "<V2" if h.dtype.name == "bfloat16" else h.dtype.str,  # bfloat16: see .dtype
            "data": (h.ctypes.data if h.size else 0, not h.flags.writeable),
            "strides": None if h.flags.c_contiguous else h.strides,
            "stream": self.stream,
        }

    @property
    def flags(self) -> Any:
        """The host array's flags (cupy arrays have ``flags.c_contiguous`` too)."""
        return self.host.flags

    @property
    def size(self) -> int:
        return self.host.size

    def item(self) -> Any:
        """Return the only element as a Python number (like ``cupy.ndarray.item``)."""
        return self.host.item()

    def get(self) -> np.ndarray:
        """Return a host copy (like ``cupy.ndarray.get``)."""
        return self.host.copy()

    def __setitem__(self, index: Any, value: Any) -> None:
        self.host[index] = value

    def __getitem__(self, index: Any) -> HostCudaArray:
        return HostCudaArray(self.host[index], self.stream)

    def __repr__(self) -> str:
        return f"HostCudaArray({self.host!r})"
