"""Device arrays over the MPI backend: CUDA-aware MPI, or staging through pinned host memory.

:class:`MPIDeviceBackend` wraps a group's :class:`~mpidist.backends.mpi.MPIBackend`
and takes the same calls with :class:`~mpidist.arrays.device.DeviceArray` arguments
(host arrays may be mixed in). Each device array becomes a host-side message for
the MPI backend in one of two ways:

* **direct** (the MPI library is CUDA-aware, see ``_device.mpi_cuda_aware``): the
  array's stream is synchronized and MPI gets the device pointer itself. Only
  when the MPI backend will hand the memory to MPI and nothing else: data
  movement, and reductions MPI computes natively on the dtype. AVG, PREMUL_SUM,
  MIN/MAX on floats (order keys, see ``reduce_op.to_order_keys``), widened
  float16/bfloat16 reductions and overlapping arguments need host-side arithmetic
  or copies, so they are staged.
* **staged**: the array is copied into page-locked host memory (after its
  producer's work), MPI runs on the copy, and outputs are copied back to the
  device once the operation completes. Every staging copy is counted in
  ``world.stats``. Without a CUDA-aware MPI this happens automatically with a
  one-time warning; ``MPIDIST_DEVICE_STAGING=quiet`` silences it and
  ``MPIDIST_DEVICE_STAGING=error`` turns it into a TypeError (for code that must
  never copy behind the user's back).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from .._world import world
from ..arrays.device import DeviceArray, mpi_cuda_aware
from ..arrays.host import overlapping_pair, refuse_overlapping_outputs
from ..reduce_op import RedOpType
from ..work import Work
from .base import WrapperBackend
from .mpi import _INT_MAX, MPIBackend
from .mpi_types import LARGE_COUNTS, type_table

__all__ = ["MPIDeviceBackend", "DeviceStagingWarning"]

ndarray = np.ndarray


class DeviceStagingWarning(UserWarning):
    """Device arrays are copied through host memory because MPI is not CUDA-aware."""


def _pointer_view(a: DeviceArray) -> ndarray:
    """What MPI is given for a device array: a :class:`DevicePointer` (metadata on the host, MPI's alone)."""
    return a.ops.mpi_buffer(a)


def _consecutive(arrays: Sequence[Any]) -> bool:
    """True if the device arrays are contiguous and lie back to back (MPI reads them as one buffer)."""
    if not all(type(a) is DeviceArray and a.c_contiguous for a in arrays):
        return False
    live = [a for a in arrays if a.nbytes]
    return all(b.ptr == a.ptr + a.nbytes for a, b in zip(live, live[1:]))


def _one_message(arrays: Sequence[Any]) -> bool:
    """True if ``_vector`` (mpi.py) sends these arrays where they are, without its host staging copy."""
    spans = [(a.ptr, a.ptr + a.nbytes) for a in arrays if type(a) is DeviceArray and a.nbytes]
    if not spans or LARGE_COUNTS:
        return True
    return max(h for _, h in spans) - min(lo for lo, _ in spans) <= _INT_MAX


def _spans(arrays: Sequence[Any]) -> list[tuple[Any, int, int, int]]:
    return [(a.device, a.ptr, a.ptr + a.nbytes, i) for i, a in enumerate(arrays) if type(a) is DeviceArray]


def _overlapping(arrays: Sequence[DeviceArray]) -> bool:
    return overlapping_pair(_spans(arrays)) is not None


def _distinct_outputs(outs: Sequence[Any] | None, fn: str, arg: str) -> None:
    """Refuse device outputs that overlap (staging would hide it; the MPI backend refuses it for host ones)."""
    if outs:
        refuse_overlapping_outputs(_spans(outs), fn, arg)


class _Call:
    """The conversion of one call's arguments: host messages, and write-backs to run afterwards."""

    __slots__ = ("direct", "backs", "keep")

    def __init__(self, direct: bool) -> None:
        self.direct = direct
        self.backs: list[tuple[Any, Any]] = []
        self.keep: list[Any] = []

    def inp(self, a: Any) -> Any:
        if type(a) is not DeviceArray:
            return a
        self.keep.append(a)
        if self.direct:
            a.ops.synchronize(a)
            return _pointer_view(a)
        h = _host(a)
        a.ops.to_host(h, a)
        return h

    def out(self, a: Any, keep_data: bool) -> Any:
        if type(a) is not DeviceArray:
            return a
        self.keep.append(a)
        if self.direct:
            a.ops.synchronize(a)  # the producer's pending reads and writes come first
            return _pointer_view(a)
        h = _host(a)
        if keep_data:
            a.ops.to_host(h, a)
        self.backs.append((h, a))
        return h

    def inputs(self, xs: Sequence[Any] | None) -> Any:
        return None if xs is None else [self.inp(a) for a in xs]

    def outputs(self, xs: Sequence[Any] | None) -> Any:
        return None if xs is None else [self.out(a, False) for a in xs]

    def merged(self, backs: Any) -> Any:
        """The write-backs: device copies first, then the caller's own (device temp -> strided target)."""
        allb = self.backs + list(backs or ())
        return allb or None


def _host(a: DeviceArray) -> ndarray:
    h = a.ops.pinned(a.nbytes).view(a.dtype).reshape(a.shape)
    world.stats.count_copy(a.nbytes)
    return h


def _devices(*groups: Any) -> list[DeviceArray]:
    found: list[DeviceArray] = []
    for g in groups:
        if type(g) is DeviceArray:
            found.append(g)
        elif isinstance(g, (list, tuple)):
            found.extend(x for x in g if type(x) is DeviceArray)
    return found


class MPIDeviceBackend(WrapperBackend):
    """Device arrays through a group's MPI backend (see the module docstring)."""

    name = "mpi"

    def __init__(self, inner: MPIBackend, owns_inner: bool = False) -> None:
        """Wrap ``inner``; ``owns_inner``: this is the group's only backend (``cuda:mpi``), shut both down."""
        super().__init__(inner)
        self.owns_inner = owns_inner

    def takes(self, arr: Any) -> bool:
        return True  # any device array: CUDA-aware MPI takes GPU memory, else it is staged

    def shutdown(self) -> None:
        if self.owns_inner:
            self.inner.shutdown()

    # -- choosing direct or staged ----------------------------------------------------------
    def _call(
        self, fn: str, arrays: list[DeviceArray], op: Any = None, shm_bytes: int = -1, host_side: bool = False
    ) -> _Call:
        """Direct (CUDA-aware MPI) or staged. Device pointers go only where the MPI backend hands them to
        MPI: calls of ``shm_bytes`` the shared-memory path may take (it reads and writes memory on the
        host), and calls the MPI backend prepares on the host (``host_side``: packing separate inputs,
        ``_vector``'s staging copy) are staged, as are reductions MPI cannot compute on the dtype."""
        direct = mpi_cuda_aware() and not _overlapping(arrays) and not host_side
        if direct and op is not None:
            # reductions: direct only if MPI reduces the dtype natively with this op
            e = type_table().get(arrays[0].dtype)
            direct = e is not None and type(op) is RedOpType and isinstance(e.ops[op], MPI.Op)
        if direct and shm_bytes >= 0 and shm_bytes >= self.inner.shared_memory_from():
            direct = False  # every rank decides alike: the size and the threshold are the same everywhere
        if not direct and arrays:
            _staging_allowed(fn)
        return _Call(direct)

    def _finish(self, w: Work | None, c: _Call) -> Work | None:
        if w is not None and c.keep:
            w._keep = (w._keep, c.keep)
        return w

    # -- collectives ----------------------------------------------------------------------------
    def broadcast(self, buf: Any, backs: Any, root: int, async_op: bool) -> Work | None:
        c = self._call("broadcast", _devices(buf), shm_bytes=buf.nbytes)
        h = c.inp(buf) if self.rank == root else c.out(buf, False)
        return self._finish(self.inner.broadcast(h, c.merged(backs), root, async_op), c)

    def all_reduce(self, buf: Any, backs: Any, op: Any, async_op: bool) -> Work | None:
        c = self._call("all_reduce", _devices(buf), op, buf.nbytes)
        h = c.out(buf, True)
        return self._finish(self.inner.all_reduce(h, c.merged(backs), op, async_op), c)

    def reduce(self, buf: Any, backs: Any, op: Any, root: int, async_op: bool) -> Work | None:
        c = self._call("reduce", _devices(buf), op, buf.nbytes)
        h = c.out(buf, True)
        return self._finish(self.inner.reduce(h, c.merged(backs), op, root, async_op), c)

    def all_gather(self, outs: Sequence[Any], backs: Any, inp: Any, async_op: bool) -> Work | None:
        _distinct_outputs(outs, "all_gather", "tensor_list")
        c = self._call("all_gather", _devices(outs, inp), host_side=not _one_message(outs))
        i, o = c.inp(inp), c.outputs(outs)
        return self._finish(self.inner.all_gather(o, c.merged(backs), i, async_op), c)

    def all_gather_into_tensor(self, out: Any, backs: Any, inp: Any, async_op: bool) -> Work | None:
        c = self._call("all_gather_into_tensor", _devices(out, inp), shm_bytes=out.nbytes)
        i, o = c.inp(inp), c.out(out, False)
        return self._finish(self.inner.all_gather_into_tensor(o, c.merged(backs), i, async_op), c)

    def gather(self, inp: Any, outs: Sequence[Any] | None, backs: Any, root: int, async_op: bool) -> Work | None:
        _distinct_outputs(outs, "gather", "gather_list")
        c = self._call("gather", _devices(outs, inp), host_side=not _one_message(outs or ()))
        i, o = c.inp(inp), c.outputs(outs)
        return self._finish(self.inner.gather(i, o, c.merged(backs), root, async_op), c)

    def scatter(self, out: Any, backs: Any, ins: Sequence[Any] | None, root: int, async_op: bool) -> Work | None:
        c = self._call("scatter", _devices(out, ins), host_side=not _one_message(ins or ()))
        i, o = c.inputs(ins), c.out(out, False)
        return self._finish(self.inner.scatter(o, c.merged(backs), i, root, async_op), c)

    def reduce_scatter(self, out: Any, backs: Any, ins: Sequence[Any], op: Any, async_op: bool) -> Work | None:
        c = self._call("reduce_scatter", _devices(out, ins), op, host_side=not _consecutive(ins))
        i, o = c.inputs(ins), c.out(out, False)
        return self._finish(self.inner.reduce_scatter(o, c.merged(backs), i, op, async_op), c)

    def reduce_scatter_tensor(self, out: Any, backs: Any, inp: Any, op: Any, async_op: bool) -> Work | None:
        c = self._call("reduce_scatter_tensor", _devices(out, inp), op, inp.nbytes)
        i, o = c.inp(inp), c.out(out, False)
        return self._finish(self.inner.reduce_scatter_tensor(o, c.merged(backs), i, op, async_op), c)

    def all_to_all_single(
        self, out: Any, backs: Any, inp: Any, out_counts: Any, in_counts: Any, async_op: bool
    ) -> Work | None:
        c = self._call("all_to_all_single", _devices(out, inp))
        i, o = c.inp(inp), c.out(out, False)
        return self._finish(self.inner.all_to_all_single(o, c.merged(backs), i, out_counts, in_counts, async_op), c)

    def all_to_all(self, outs: Sequence[Any], backs: Any, ins: Sequence[Any], async_op: bool) -> Work | None:
        _distinct_outputs(outs, "all_to_all", "output_tensor_list")
        c = self._call("all_to_all", _devices(outs, ins), host_side=not (_one_message(outs) and _one_message(ins)))
        i, o = c.inputs(ins), c.outputs(outs)
        return self._finish(self.inner.all_to_all(o, c.merged(backs), i, async_op), c)

    def barrier(self, async_op: bool) -> Work | None:
        return self.inner.barrier(async_op)

    # -- point-to-point -----------------------------------------------------------------------
    def send(self, buf: Any, peer: int, tag: int) -> Work:
        c = self._call("send", _devices(buf))
        w = self.inner.send(c.inp(buf), peer, tag)
        self._finish(w, c)
        return w

    def recv(self, buf: Any, backs: Any, peer: int | None, tag: int) -> Work:
        c = self._call("recv", _devices(buf))
        w = self.inner.recv(c.out(buf, False), c.merged(backs), peer, tag)
        self._finish(w, c)
        return w

    def recv_blocking(self, buf: Any, backs: Any, peer: int | None, tag: int) -> Work:
        c = self._call("recv", _devices(buf))
        w = self.inner.recv_blocking(c.out(buf, False), c.merged(backs), peer, tag)
        self._finish(w, c)
        return w


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning raised here at the program's call into mpidist."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1  # the warning is issued one frame up, in _staging_allowed
    while frame is not None and frame.f_code.co_filename.startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _staging_allowed(fn: str) -> None:
    """Apply ``MPIDIST_DEVICE_STAGING`` (warn once, quiet, or error) before staging device arrays."""
    mode = os.environ.get("MPIDIST_DEVICE_STAGING", "warn").strip().lower()
    if mode == "error":
        raise TypeError(
            f"{fn}: device arrays would be copied through host memory (the MPI library is not CUDA-aware, "
            "or the operation needs host-side arithmetic) and MPIDIST_DEVICE_STAGING=error forbids it; "
            "use a CUDA-aware MPI or the nccl backend"
        )
    if mode != "quiet" and not world.staging_warned:
        world.staging_warned = True
        reason = (
            "this operation needs host-side arithmetic or copies (its arrays overlap, or the shared-memory "
            "path or packing on the host would run it)"
            if mpi_cuda_aware()
            else "the MPI library is not CUDA-aware"
        )
        warnings.warn(
            f"{fn}: device arrays are copied through pinned host memory because {reason}; "
            "this costs two copies per array (use the nccl backend or a CUDA-aware MPI; "
            "MPIDIST_DEVICE_STAGING=quiet silences this warning, =error forbids staging)",
            DeviceStagingWarning,
            stacklevel=_caller_level(),
        )
