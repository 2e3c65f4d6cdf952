"""``HostCudaArray``: host memory dressed as a CUDA array, to test device paths without a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._device import HostOps

__all__ = ["HostCudaArray"]

_OPS = HostOps()


class HostCudaArray:
    """A numpy array exposed only through ``__cuda_array_interface__`` (version 3).

    mpidist treats it as GPU memory: it takes the device paths (the MPI backend's
    CUDA-aware or pinned-staging route, stream synchronization), while the memory
    is plain host memory, so those paths run and can be checked on any machine.
    Its device operations (copies, synchronization) are :class:`mpidist._device.HostOps`,
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
