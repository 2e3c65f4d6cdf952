"""A GPU stand-in that fails the way a GPU does, for testing device paths without one.

:class:`GpuStandin` is one "GPU":

* **device memory the host cannot touch**: every allocation is an address range
  mapped ``PROT_NONE``; a host read or write of a device pointer (numpy over it,
  MPI given it without a CUDA-aware path, ``memcpy`` in a C extension) is a
  SIGSEGV, as on a GPU node. The data lives in a host shadow that only the
  stand-in's own copies and kernels (and its "CUDA-aware MPI",
  :meth:`StandinOps.mpi_buffer`) reach;
* **streams that run only when ordered**: work enqueued on a stream runs when the
  host synchronizes it, when another stream that waits on one of its events runs,
  or when the host reads an array through the stand-in (:meth:`GpuArray.get` runs
  the current stream first, like ``cupy.ndarray.get``). A missing wait shows as
  stale data;
* **events that complete only when their stream has run** up to them;
* **freed memory reused and poisoned** (0xFF bytes: NaN, -1): a temporary dropped
  before its stream ran shows as garbage;
* **allocation failures on demand** (:meth:`GpuStandin.fail_allocations`), raised
  as :class:`OutOfMemoryError` (a ``MemoryError``, as cupy's is);
* an NCCL whose calls are enqueued on the given stream and run as nonblocking MPI
  over the shadows when the stream runs, the nccl backend's runtime adapter over
  the stand-in and a fake ``cupy`` package: :mod:`mpidist.testing.gpu_nccl`.

A blocking wait that could never end on a GPU (a peer that never joins an NCCL
call) raises :class:`StandinHangError` after ``hang_s`` seconds instead of hanging the test.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import threading
import time
import types
from collections import deque
from typing import Any, Callable, Iterator

import numpy as np

from ..arrays.device import DeviceArray, DeviceOps, c_strides, extent
from ..reduce_op import divide_average

__all__ = [
    "GpuStandin",
    "GpuArray",
    "StandinOps",
    "StandinHangError",
    "StandinCaptureError",
    "OutOfMemoryError",
]

_PAGE = 4096
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_PROT_NONE, _MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0, 0x02, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
#: MPI requests of aborted stand-in communicators, and their buffers: never freed
_abandoned: list[Any] = []


class OutOfMemoryError(MemoryError):
    """The stand-in could not allocate device memory (as ``cupy.cuda.memory.OutOfMemoryError``)."""


class StandinHangError(RuntimeError):
    """A blocking wait on the stand-in that a GPU would never finish (it would hang)."""


class StandinCaptureError(RuntimeError):
    """A call CUDA forbids while a graph is captured (global mode): the capture is invalidated."""


class _Block:
    """One allocation: a PROT_NONE address range and its host shadow."""

    __slots__ = ("heap", "addr", "nbytes", "shadow", "live", "__weakref__")

    def __init__(self, heap: _Heap, addr: int, nbytes: int, shadow: np.ndarray) -> None:
        self.heap, self.addr, self.nbytes, self.shadow, self.live = heap, addr, nbytes, shadow, True

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.heap.release(self)


class _Heap:
    """Device memory: PROT_NONE reservations with shadows, reused (poisoned) when freed."""

    def __init__(self) -> None:
        self.free: dict[int, list[tuple[int, np.ndarray]]] = {}
        self.starts: list[int] = []
        self.blocks: dict[int, Any] = {}  # start -> (size, shadow)
        self.fail = 0  # allocations still to fail
        self.fail_skip = 0  # allocations to let through before failing
        self.lock = threading.Lock()

    def alloc(self, nbytes: int) -> _Block:
        with self.lock:
            if self.fail:
                if self.fail_skip:
                    self.fail_skip -= 1
                else:
                    self.fail -= 1
                    raise OutOfMemoryError(f"out of memory allocating {nbytes:,} bytes (the stand-in was told to fail)")
            size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
            reuse = self.free.get(size)
            if reuse:
                addr, shadow = reuse.pop()
            else:
                addr = _libc.mmap(None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
                if addr in (None, _MAP_FAILED):
                    raise OutOfMemoryError(f"mmap of {size} bytes failed (errno {ctypes.get_errno()})")
                shadow = np.full(size, 0xFF, np.uint8)
                bisect.insort(self.starts, addr)
                self.blocks[addr] = (size, shadow)
            return _Block(self, addr, nbytes, shadow)

    def release(self, block: _Block) -> None:
        if not block.live:
            return
        block.live = False
        block.shadow.fill(0xFF)  # poisoned: NaN for floats, -1 for integers
        with self.lock:
            self.free.setdefault(block.shadow.size, []).append((block.addr, block.shadow))

    def shadow(self, addr: int, nbytes: int) -> np.ndarray:
        """The host bytes behind ``[addr, addr + nbytes)`` (raises unless it is one allocation's)."""
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0:
            start = self.starts[i]
            size, shadow = self.blocks[start]
            if addr + nbytes <= start + size:
                return shadow[addr - start : addr - start + nbytes]
        raise ValueError(f"stand-in: {addr:#x}+{nbytes} is not device memory of the stand-in")


class _Stream:
    __slots__ = ("handle", "steps", "enq", "ran", "pending", "owner")

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.steps: deque[tuple[int, Any]] = deque()
        self.enq = 0  # steps enqueued so far
        self.ran = 0  # steps finished so far
        self.pending: Any = None  # a started step not finished yet (an NCCL call)
        self.owner: int | None = None  # the thread running a step of this stream now


class StandinEvent:
    """An event: complete once its stream has run up to where it was recorded."""

    __slots__ = ("stream", "pos")

    def __init__(self) -> None:
        self.stream: int | None = None
        self.pos = 0


class _Pending:
    """A started NCCL call: MPI requests and what to do once they complete."""

    def __init__(self, comm: Any, reqs: list[Any], finish: Callable[[], None], keep: Any) -> None:
        self.comm, self.reqs, self.finish, self.keep = comm, reqs, finish, keep

    def test(self) -> bool:
        from mpi4py import MPI

        if self.comm.aborted:  # ncclCommAbort ends the kernels; their data is undefined
            _abandoned.append((self.reqs, self.keep))
            return True
        if MPI.Request.Testall(self.reqs):
            self.finish()
            return True
        return False


class GpuStandin:
    """One stand-in GPU (see the module docstring).

    Args:
        hang_s: how long a blocking wait may take before :class:`StandinHangError`.
        device: its device index (``cuda:device``): give each rank of a node its own.
    """

    #: the legacy default stream; 0 and 2 (per-thread default) mean it too
    DEFAULT = 1

    def __init__(self, hang_s: float = 30.0, device: int = 0) -> None:
        self.device = device  # its index (each rank's stand-in is its own GPU)
        self.heap = _Heap()
        self.hang_s = hang_s
        self.streams: dict[int, _Stream] = {}
        self.current = self.DEFAULT
        self._next = 0x7000
        self.lock = threading.RLock()
        self.capturing: set[int] = set()  # streams being captured into a graph (global mode)
        self.capture_broken: str | None = None  # what invalidated the capture in progress
        self.graph: list[Any] = []  # the steps captured (never run: replays are not modelled)
        self._relaxed = threading.local()  # threads in cudaStreamCaptureModeRelaxed
        self.ops = StandinOps(self)
        # mpidist looks the device ops up on the type: one class per stand-in
        self.Array: type[GpuArray] = type("GpuArray", (GpuArray,), {"__mpidist_device_ops__": self.ops})

    # -- memory --------------------------------------------------------------------------
    def fail_allocations(self, count: int = 1, after: int = 0) -> None:
        """Make the next ``count`` allocations (after letting ``after`` through) raise OutOfMemoryError."""
        self.heap.fail, self.heap.fail_skip = count, after

    def shadow(self, arr: DeviceArray) -> np.ndarray:
        """The stand-in's own view of a device array's memory (for its kernels only)."""
        if arr.size == 0:
            return np.empty(arr.shape, arr.dtype)
        strides = arr.strides or c_strides(arr.shape, arr.dtype.itemsize)
        lo, hi = extent(arr.shape, strides, arr.dtype.itemsize)
        raw = self.heap.shadow(arr.ptr + lo, hi - lo)
        return np.ndarray(arr.shape, arr.dtype, buffer=raw, offset=-lo, strides=strides)

    def raw(self, ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` elements at device address ``ptr``, as the stand-in's kernels see them."""
        if count == 0:
            return np.empty(0, dtype)
        return self.heap.shadow(ptr, count * dtype.itemsize).view(dtype)

    # -- graph capture -----------------------------------------------------------------------
    def begin_capture(self, stream: int) -> None:
        """Start capturing ``stream`` (as ``torch.cuda.graph``, global mode): work enqueued on it, or on a
        stream that waits for one of its events, goes into the graph; an event query or an allocation
        on any thread (not in relaxed mode) invalidates the capture and raises StandinCaptureError."""
        self.capturing.add(stream)
        self.capture_broken = None

    def end_capture(self) -> str | None:
        """End every capture; return what invalidated it (None: the graph is valid)."""
        self.capturing.clear()
        broken, self.capture_broken = self.capture_broken, None
        return broken

    @contextlib.contextmanager
    def relaxed(self) -> Iterator[None]:
        """This thread in ``cudaStreamCaptureModeRelaxed``: its queries leave a capture alone."""
        self._relaxed.on = True
        try:
            yield
        finally:
            self._relaxed.on = False

    def unsafe(self, what: str) -> None:
        """A call CUDA forbids during a global-mode capture: raise if one is in progress."""
        if self.capturing and not getattr(self._relaxed, "on", False):
            self.capture_broken = self.capture_broken or what
            raise StandinCaptureError(
                f"{what} while a CUDA graph is captured (cudaErrorStreamCaptureUnsupported); the capture is invalidated"
            )

    # -- streams and events ----------------------------------------------------------------
    def _stream(self, handle: int | None) -> _Stream:
        h = self.DEFAULT if handle in (None, 0, 2) else int(handle)
        s = self.streams.get(h)
        if s is None:
            s = self.streams[h] = _Stream(h)
        return s

    def new_stream(self) -> int:
        with self.lock:
            self._next += 1
            self._stream(self._next)
            return self._next

    def enqueue(self, stream: int | None, step: Callable[[], Any]) -> None:
        """Add ``step`` to ``stream``; it runs when something orders the stream to run.

        A step may return an object with ``test()`` (a started NCCL call): the stream
        then waits for it before its next step.
        """
        with self.lock:
            s = self._stream(stream)
            if s.handle in self.capturing:
                self.graph.append(step)  # recorded into the graph, not run
                return
            s.steps.append((s.enq, step))
            s.enq += 1

    def record(self, event: StandinEvent, stream: int | None) -> None:
        with self.lock:
            s = self._stream(stream)
            if s.handle in self.capturing:  # a node of the graph: nothing to wait for outside it
                event.stream, event.pos = None, 0
                return
            event.stream, event.pos = s.handle, s.enq

    def wait_event(self, stream: int | None, event: StandinEvent) -> None:
        """Make later work on ``stream`` wait for ``event`` (the host does not wait)."""
        if event.stream is None:
            return
        src, pos = event.stream, event.pos
        if src in self.capturing:  # the waiting stream joins the capture
            self.capturing.add(self._stream(stream).handle)
        self.enqueue(stream, lambda: self._run(src, pos))

    def query(self, event: StandinEvent) -> bool:
        """True once the event's stream has run up to it. A query orders nothing: only a
        call already running (an NCCL call a synchronize started) advances."""
        self.unsafe("cudaEventQuery")
        if event.stream is None:
            return True
        with self.lock:
            s = self._stream(event.stream)
            if s.ran < event.pos and s.pending is not None and s.pending.test():
                s.pending = None
                s.ran += 1
            return s.ran >= event.pos

    def synchronize(self, stream: int | None = None) -> None:
        """Run ``stream`` (the current one by default) to its end, as ``cudaStreamSynchronize``."""
        s = self._stream(self.current if stream is None else stream)
        self._run(s.handle, s.enq)

    def synchronize_all(self) -> None:
        """Run every stream to its end (``cudaDeviceSynchronize``)."""
        for h in list(self.streams):
            self.synchronize(h)

    def _run(self, handle: int, upto: int) -> None:
        """Run stream ``handle`` until ``upto`` steps have finished. Steps run outside the lock (a step
        that waits for another stream runs that one), one thread at a time per stream."""
        deadline = time.monotonic() + self.hang_s
        me = threading.get_ident()
        while True:
            step = None
            with self.lock:  # released between polls: another thread may abort the communicator
                s = self._stream(handle)
                if s.ran >= upto:
                    return
                if s.owner in (None, me):
                    if s.pending is None:
                        pos, step = s.steps.popleft()
                        s.owner = me
                    elif s.pending.test():
                        s.pending = None
                        s.ran += 1
                        continue
            if step is not None:
                try:
                    result = step()
                except BaseException:
                    with self.lock:  # not run: it stays first in the stream
                        s.owner = None
                        s.steps.appendleft((pos, step))
                    raise
                with self.lock:
                    s.owner = None
                    if result is not None and hasattr(result, "test"):
                        s.pending = result
                    else:
                        s.ran += 1
                continue
            if time.monotonic() > deadline:
                raise StandinHangError(
                    f"stand-in: stream {handle:#x} waits for an NCCL call that never completes "
                    f"(a GPU would hang here; gave up after {self.hang_s:g} s)"
                )
            time.sleep(0.0005)

    # -- arrays ------------------------------------------------------------------------------
    def empty(self, shape: Any, dtype: Any, stream: int | None = None) -> GpuArray:
        return self.Array(self, shape, dtype, stream)

    def array(self, host: np.ndarray, stream: int | None = None) -> GpuArray:
        """A device array holding a copy of ``host`` (uploaded at once)."""
        a = self.Array(self, host.shape, host.dtype, stream)
        a.shadow_view()[...] = host
        return a


class StandinOps(DeviceOps):
    """The stand-in's device runtime as mpidist's device paths see it."""

    name = "gpu-standin"

    def __init__(self, gpu: GpuStandin) -> None:
        self.gpu = gpu

    def synchronize(self, arr: DeviceArray) -> None:
        self.gpu.synchronize(arr.stream)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, device: int) -> DeviceArray:
        dtype = np.dtype(dtype)
        self.gpu.unsafe("cudaMalloc")
        block = self.gpu.heap.alloc(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        return DeviceArray(block.addr, tuple(shape), dtype, None, device, None, block, self)

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        gpu = self.gpu

        def step() -> None:
            np.copyto(gpu.shadow(dst), gpu.shadow(src).reshape(dst.shape), casting="no")

        gpu.enqueue(gpu.current, step)  # as cupy: on the current stream, done when it returns
        gpu.synchronize()

    def to_host(self, dst: np.ndarray, src: DeviceArray) -> None:
        self.synchronize(src)
        np.copyto(dst, self.gpu.shadow(src).reshape(dst.shape), casting="no")

    def to_device(self, dst: DeviceArray, src: np.ndarray) -> None:
        self.synchronize(dst)
        np.copyto(self.gpu.shadow(dst), src.reshape(dst.shape), casting="no")

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def scale(self, arr: DeviceArray, factor: float) -> None:
        v = self.gpu.shadow(arr)
        np.multiply(v, factor, out=v, casting="unsafe")

    def divide(self, arr: DeviceArray, n: int) -> None:
        divide_average(self.gpu.shadow(arr), n, np)

    def mpi_buffer(self, arr: DeviceArray) -> np.ndarray:
        """What a CUDA-aware MPI reads and writes for ``arr``: here its shadow, which only MPI may touch."""
        from ..arrays.device import DevicePointer

        return (
            self.gpu.raw(arr.ptr, arr.nbytes, np.dtype(np.uint8)).view(arr.dtype).reshape(arr.shape).view(DevicePointer)
        )


class GpuArray:
    """A device array of the stand-in, exposed through ``__cuda_array_interface__`` (version 3).

    Args:
        gpu: the stand-in it lives on.
        shape, dtype: as numpy's.
        stream: the producer's stream handle (None: nothing to wait for).
    """

    def __init__(self, gpu: GpuStandin, shape: Any, dtype: Any, stream: int | None = None) -> None:
        gpu.unsafe("cudaMalloc")
        self.gpu = gpu
        self.device = types.SimpleNamespace(id=gpu.device)  # as cupy.cuda.Device
        self.shape = tuple(int(s) for s in np.atleast_1d(np.asarray(shape, dtype=np.int64))) if shape != () else ()
        self.dtype = np.dtype(dtype)
        self.block = gpu.heap.alloc(max(1, int(np.prod(self.shape, dtype=np.int64))) * self.dtype.itemsize)
        self.stream = stream

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ptr(self) -> int:
        return self.block.addr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": "<V2" if self.dtype.name == "bfloat16" else self.dtype.str,
            "data": (self.block.addr if self.size else 0, False),
            "strides": None,
            "stream": self.stream,
        }

    def shadow_view(self) -> np.ndarray:
        """The stand-in's view of the memory, bypassing streams (for setting up tests only)."""
        return self.gpu.raw(self.block.addr, self.size, self.dtype).reshape(self.shape)

    def get(self, stream: int | None = None) -> np.ndarray:
        """Read the array on the host: runs ``stream`` (the current stream by default) first, like cupy."""
        self.gpu.synchronize(stream)
        return self.shadow_view().copy()

    def free(self) -> None:
        """Give the memory back now (reused and poisoned)."""
        self.gpu.heap.release(self.block)

    def __repr__(self) -> str:
        return f"GpuArray(shape={self.shape}, dtype={self.dtype}, ptr={self.block.addr:#x})"
