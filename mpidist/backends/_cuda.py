"""The CUDA runtime and NCCL as the nccl backend sees them: one small adapter object.

Everything :mod:`mpidist.backends.nccl` asks of CUDA (devices, streams, events,
device-side copies and arithmetic on a given stream) and of NCCL (the module
with ``NcclCommunicator``, ``groupStart``/``groupEnd``, ``get_version``,
``get_unique_id``) goes through a :class:`CudaRuntime`. :meth:`CudaRuntime.from_cupy`
builds the real one over ``cupy.cuda`` and ``cupy.cuda.nccl``; tests subclass it
with a fake NCCL whose calls run over MPI on host memory, and fake streams and
events, so every line of the backend runs on a machine without a GPU.

Streams are passed around as integer handles (``cudaStream_t`` values; 1 and 2 are
CUDA's legacy and per-thread default streams, as in ``__cuda_array_interface__``),
events as opaque objects that only the runtime looks into.
"""

from __future__ import annotations

import contextlib
import os
import sys
import zlib
from typing import Any, Callable, Iterator

import numpy as np
from mpi4py import MPI

from .._world import world
from ..arrays.device import BFLOAT16, CupyOps, DeviceArray, DeviceOps
from ..errors import DistBackendError
from ..work import poll

__all__ = [
    "CudaRuntime",
    "UID_BYTES",
    "uid_bytes",
    "uid_tuple",
    "make_communicator",
    "parse_version",
    "choose_device",
    "agree_devices",
    "share_unique_id",
    "bfloat16_apply",
]

#: NCCL_UNIQUE_ID_BYTES (nccl.h)
UID_BYTES = 128
#: broadcasts of unique ids that timed out (their buffers must outlive them)


def uid_bytes(uid: Any) -> bytes:
    """Return an NCCL unique id as 128 bytes, whichever form cupy returned.

    cupy >= 14 returns ``bytes``; older versions a tuple of 128 ints (C ``char``
    values, so -128..127, or 0..255 on platforms where ``char`` is unsigned).

    Raises:
        TypeError: ``uid`` is neither form, or not 128 long.
    """
    if isinstance(uid, (bytes, bytearray)):
        data = bytes(uid)
    elif isinstance(uid, (tuple, list)) and all(isinstance(c, int) and -128 <= c <= 255 for c in uid):
        data = bytes(c & 0xFF for c in uid)
    else:
        raise TypeError(f"nccl: get_unique_id returned {type(uid).__name__}; expected bytes or a tuple of ints")
    if len(data) != UID_BYTES:
        raise TypeError(f"nccl: the unique id has {len(data)} bytes, expected {UID_BYTES}")
    return data


def uid_tuple(data: bytes, signed: bool = True) -> tuple[int, ...]:
    """Return 128 bytes as the tuple of ``char`` values that cupy < 14 takes.

    ``char`` is signed on x86-64 (-128..127) and unsigned on aarch64 (0..255, GH200):
    cupy 13 there raises OverflowError for a negative value.
    """
    if not signed:
        return tuple(data)
    return tuple(b - 256 if b > 127 else b for b in data)


def make_communicator(ctor: Callable[..., Any], size: int, uid: bytes, rank: int) -> Any:
    """Call ``NcclCommunicator(size, uid, rank)`` with the unique id in the form this cupy takes.

    cupy >= 14 declares the id as ``bytes``, older versions as a tuple of ``char``
    (signed or unsigned, by platform); a Cython argument of the wrong type raises
    TypeError, a value out of the ``char`` range OverflowError, before anything
    happens, so the next form is tried then.
    """
    first: BaseException | None = None
    for form in (uid, uid_tuple(uid), uid_tuple(uid, signed=False)):
        try:
            return ctor(size, form, rank)
        except (TypeError, OverflowError) as exc:
            first = first or exc
    assert first is not None
    raise first


def parse_version(code: int) -> tuple[int, int, int]:
    """Return ``(major, minor, patch)`` of an ``ncclGetVersion`` code.

    NCCL encodes 2.8.4 as 2804 and, from 2.9 on, 2.19.3 as 21903.
    """
    code = int(code)
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


class CudaRuntime:
    """The CUDA and NCCL operations of the nccl backend, over cupy.

    Args:
        cupy: the ``cupy`` module.
        nccl: the ``cupy.cuda.nccl`` module (or anything with its API).
        ops: the device ops used for temporaries (allocation); by default
            ``CupyOps(cupy)``.
    """

    def __init__(self, cupy: Any, nccl: Any, ops: DeviceOps | None = None) -> None:
        self.cp = cupy
        self.nccl = nccl
        self.ops = ops if ops is not None else CupyOps(cupy)

    @classmethod
    def from_cupy(cls) -> CudaRuntime:
        """Return the runtime over the installed cupy (and its NCCL bindings).

        Raises:
            RuntimeError: cupy or its NCCL bindings cannot be loaded.
        """
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as exc:
            raise RuntimeError(
                "the nccl backend needs cupy with NCCL bindings: pip install 'mpidist[gpu]' "
                f"(cupy-cuda12x and nvidia-nccl-cu12); importing them failed: {exc}"
            ) from exc
        if not getattr(nccl, "available", True):
            raise RuntimeError(
                "the nccl backend: cupy is installed but cannot load libnccl (pip install nvidia-nccl-cu12)"
            )
        from .._world import world

        ops = world.device_ops if isinstance(world.device_ops, CupyOps) else None
        return cls(cupy, nccl, ops)

    # -- arrays -------------------------------------------------------------------------
    def takes(self, arr: Any) -> bool:
        """Return True if ``arr`` is a device array whose memory this runtime reaches."""
        return type(arr) is DeviceArray and isinstance(arr.ops, CupyOps)

    # -- devices ------------------------------------------------------------------------
    def device_count(self) -> int:
        return int(self.cp.cuda.runtime.getDeviceCount())

    def current_device(self) -> int:
        return int(self.cp.cuda.runtime.getDevice())

    def device_chosen(self) -> bool:
        """Return True if this thread already uses a device: a CUDA context is current, or torch has
        initialized CUDA (``choose_device`` also keeps any current device other than 0).

        ``cupy.cuda.Device(i).use()`` and any allocation make a context current;
        ``torch.cuda.set_device(i)`` may not (torch creates contexts lazily), so a
        current device other than 0 counts as chosen too.
        """
        if int(self.cp.cuda.driver.ctxGetCurrent()) != 0:
            return True
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        try:
            return bool(cuda is not None and cuda.is_initialized())
        except Exception:  # noqa: BLE001 - a torch without CUDA
            return False

    def node_key(self) -> str:
        """What tells this process's node from others (two ranks with one key share its GPUs)."""
        return MPI.Get_processor_name()

    def set_device(self, device: int) -> None:
        self.cp.cuda.runtime.setDevice(device)

    def device(self, device: int) -> contextlib.AbstractContextManager[Any]:
        """A context in which ``device`` is the current device."""
        return self.cp.cuda.Device(device)

    # -- streams and events -------------------------------------------------------------
    def new_stream(self, device: int, high_priority: bool = False) -> tuple[int, Any]:
        """Create a non-blocking stream on ``device``; return ``(handle, owner)``."""
        cuda = self.cp.cuda
        with cuda.Device(device):
            if high_priority:  # CUDA clamps a priority beyond its range to the greatest one
                stream = cuda.Stream(non_blocking=True, priority=-100)
            else:
                stream = cuda.Stream(non_blocking=True)
        return int(stream.ptr), stream

    def current_stream(self, device: int) -> int:
        """The handle of the current stream on ``device``: cupy's if the program made one current, else
        torch's where torch has initialized CUDA (``torch.cuda.stream(s)`` does not tell cupy), else 0
        (the legacy default stream)."""
        handle = int(self.cp.cuda.get_current_stream(device).ptr)
        if handle == 0:
            cuda = getattr(sys.modules.get("torch"), "cuda", None)
            try:
                if cuda is not None and cuda.is_initialized():
                    return int(cuda.current_stream(device).cuda_stream)
            except Exception:  # noqa: BLE001 - a torch without CUDA: cupy's answer stands
                pass
        return handle

    def _runtime_call(self, name: str) -> Any:
        """``cupy.cuda.runtime.<name>``, or None where this cupy (or a runtime without cupy) has none."""
        return getattr(getattr(getattr(self.cp, "cuda", None), "runtime", None), name, None)

    def capturing(self, stream: int) -> bool:
        """Return True while ``stream`` is being captured into a CUDA graph (``torch.cuda.graph``)."""
        probe = self._runtime_call("streamIsCapturing")
        if probe is None:
            return False
        try:
            return int(probe(stream)) != 0
        except Exception:  # noqa: BLE001 - the legacy stream in some modes: not capturing
            return False

    @contextlib.contextmanager
    def relaxed_capture(self) -> Iterator[None]:
        """Let this thread query events while another captures a graph in global mode (the watchdog).

        ``cudaThreadExchangeStreamCaptureMode(relaxed)``: without it, an event query on
        any thread invalidates a capture in progress. A cupy without the call: nothing.
        """
        exchange = self._runtime_call("threadExchangeStreamCaptureMode")
        if exchange is None:
            yield
            return
        old = exchange(2)  # cudaStreamCaptureModeRelaxed
        try:
            yield
        finally:
            exchange(old)

    def new_event(self, device: int) -> Any:
        with self.cp.cuda.Device(device):
            return self.cp.cuda.Event(block=False, disable_timing=True)

    def record(self, event: Any, stream: int) -> None:
        self.cp.cuda.runtime.eventRecord(event.ptr, stream)

    def wait_event(self, stream: int, event: Any) -> None:
        """Make future work on ``stream`` wait for ``event`` (the host does not wait)."""
        self.cp.cuda.runtime.streamWaitEvent(stream, event.ptr, 0)

    def query(self, event: Any) -> bool:
        """Return True once the work before ``event`` has finished."""
        done = event.done
        return bool(done() if callable(done) else done)

    # -- device-side work on a stream -----------------------------------------------------
    @contextlib.contextmanager
    def on_stream(self, stream: int, device: int) -> Iterator[None]:
        """Run cupy operations issued inside the block on ``stream``."""
        with self.cp.cuda.ExternalStream(stream, device):
            yield

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: int) -> None:
        """Enqueue ``dst[...] = src`` (same number of elements, any strides) on ``stream``."""
        ops = _cupy_ops(dst)
        with self.on_stream(stream, dst.device):
            ops.wrap(dst)[...] = ops.wrap(src).reshape(dst.shape)

    def scale(self, arr: DeviceArray, factor: Any, stream: int) -> None:
        """Enqueue ``arr *= factor`` on ``stream`` (bfloat16 through float32, rounded to nearest even)."""
        if arr.dtype == BFLOAT16:
            self._bfloat16(arr, stream, lambda f: f * np.float32(factor))
            return
        with self.on_stream(stream, arr.device):
            arr.ops.scale(arr, factor)

    def divide(self, arr: DeviceArray, n: int, stream: int) -> None:
        """Enqueue AVG's division on ``stream``: true division, integers truncated toward zero."""
        if arr.dtype == BFLOAT16:
            self._bfloat16(arr, stream, lambda f: f / np.float32(n))
            return
        with self.on_stream(stream, arr.device):
            arr.ops.divide(arr, n)

    def _bfloat16(self, arr: DeviceArray, stream: int, fn: Callable[[Any], Any]) -> None:
        ops = _cupy_ops(arr)
        with self.on_stream(stream, arr.device):
            bits = ops.wrap(arr).view(self.cp.uint16)
            bits[...] = bfloat16_apply(self.cp, bits, fn)

    # -- NCCL -----------------------------------------------------------------------------
    def nccl_version(self) -> tuple[int, int, int]:
        return parse_version(self.nccl.get_version())

    def unique_id(self) -> bytes:
        """A new NCCL unique id, as 128 bytes."""
        return uid_bytes(self.nccl.get_unique_id())

    def communicator(self, size: int, uid: bytes, rank: int, comm: Any) -> Any:
        """Create this rank's NCCL communicator (every rank calls it with the same ``uid``).

        ``comm`` is the group's MPI communicator; NCCL does not need it (adapters
        that run NCCL's calls over MPI, such as the test fake, do).
        """
        return make_communicator(self.nccl.NcclCommunicator, size, uid, rank)

    def group_start(self) -> None:
        self.nccl.groupStart()

    def group_end(self) -> None:
        self.nccl.groupEnd()

    def check_async_error(self, nccl_comm: Any) -> None:
        """Raise NCCL's asynchronous error of ``nccl_comm`` (a peer failed, a network error), if any."""
        check = getattr(nccl_comm, "check_async_error", None)
        if check is not None:
            check()

    def abort(self, nccl_comm: Any) -> None:
        """Abort ``nccl_comm``: its pending operations end, it cannot be used again."""
        nccl_comm.abort()

    def destroy(self, nccl_comm: Any) -> None:
        """Free ``nccl_comm`` after its pending operations."""
        nccl_comm.destroy()


def _node_local_rank(comm: Any) -> int:
    """This process's rank on its node: LOCAL_RANK, else the world's shared-memory split, else ``comm``'s."""
    text = os.environ.get("LOCAL_RANK", "").strip()
    if text.isdigit():
        return int(text)
    node_rank = world.init_info.node_rank if world.node_comm is not None else None  # known once init split it
    if node_rank is not None:
        return int(node_rank)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return int(node.Get_rank())
    finally:
        node.Free()


def choose_device(rt: CudaRuntime, comm: Any) -> int:
    """Return the GPU a new NCCL backend uses, and make it current.

    The device the program chose (a CUDA context current, torch's CUDA initialized,
    or a current device other than 0: ``torch.cuda.set_device(i)`` need not create a
    context), else the node-local rank's. :func:`agree_devices` then checks that no
    two ranks of a node share one.

    Raises:
        RuntimeError: no CUDA device is visible.
    """
    count = rt.device_count()
    if count < 1:
        raise RuntimeError("the nccl backend: no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES)")
    current = rt.current_device()
    if current != 0 or rt.device_chosen():
        return current
    device = _node_local_rank(comm) % count
    rt.set_device(device)
    return device


def agree_devices(
    rt: CudaRuntime, comm: Any, device: int, failure: BaseException | None, timeout_s: float, where: str
) -> None:
    """A timed exchange of every rank's (node, GPU) before ``ncclCommInitRank``; raise on every rank alike.

    It is the barrier that ``ncclCommInitRank`` needs (every rank has the unique id,
    so none enters NCCL's unbounded bootstrap alone), and it turns a rank that could
    not pick a GPU, or two ranks of one node on one GPU (more ranks than GPUs), into
    a DistBackendError on every rank that names the ranks and the GPU.
    """
    node = zlib.crc32(rt.node_key().encode())
    mine = np.array([node, device if failure is None else -1], np.int64)
    table = np.empty((comm.Get_size(), 2), np.int64)
    req = comm.Iallgather(mine, table)
    if not poll(req.Test, timeout_s):
        world.unreleased.append((req, mine, table))  # MPI may still write into them: never free
        raise DistBackendError(
            f"{where}: not every rank of the group reached NCCL's set-up within the timeout of {timeout_s:g} s "
            "(a rank failed earlier, or did not create the group)"
        )
    if failure is not None:
        raise DistBackendError(f"{where}: this rank could not choose a GPU: {failure}") from failure
    failed = [r for r in range(len(table)) if table[r, 1] < 0]
    if failed:
        raise DistBackendError(f"{where}: group rank(s) {failed} could not choose a GPU (see their error)")
    shared: dict[tuple[int, int], list[int]] = {}
    for r, (n, d) in enumerate(table.tolist()):
        shared.setdefault((n, d), []).append(r)
    for (_, d), ranks in shared.items():
        if len(ranks) > 1:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
            raise DistBackendError(
                f"{where}: group ranks {ranks} run on one node and would all use cuda:{d}; NCCL cannot put two "
                f"ranks of a communicator on one GPU, and this process sees {rt.device_count()} GPU(s){shown}. "
                "Run at most one rank per GPU on each node, or give each rank its own GPU "
                "(torch.cuda.set_device) before creating the group"
            )


#: the first byte of share_unique_id's message: the id follows; rank 0 could not create it; rank 0 failed
#: before (it could not choose a GPU: agree_devices, which every rank reaches next, says so)
_UID_OK, _UID_FAILED, _UID_SKIPPED = 1, 0, 2


def share_unique_id(
    rt: CudaRuntime, comm: Any, timeout_s: float, where: str, take_part_only: bool = False
) -> bytes | None:
    """Create the NCCL unique id on rank 0 and broadcast it over ``comm`` (bounded by ``timeout_s``).

    The first byte says whether rank 0 could create it, so a failure there is an
    error on every rank instead of a wait until the timeout. ``take_part_only``: this
    rank failed before and only joins the broadcast; returns None where rank 0 did so.
    """
    buf = np.zeros(UID_BYTES + 1, np.uint8)
    failure: BaseException | None = None
    if comm.Get_rank() == 0 and take_part_only:
        buf[0] = _UID_SKIPPED
    elif comm.Get_rank() == 0:
        try:
            buf[1:] = np.frombuffer(rt.unique_id(), np.uint8)
            buf[0] = 1
        except Exception as exc:  # noqa: BLE001 - reported to every rank, raised here below
            failure = exc
    req = comm.Ibcast([buf, MPI.BYTE], root=0)
    if not poll(req.Test, timeout_s):
        world.unreleased.append((req, buf))  # MPI may still write into buf: never free it
        raise DistBackendError(
            f"{where}: rank 0's NCCL unique id did not arrive within the timeout of {timeout_s:g} s; "
            "every member of the group must create it at the same point"
        )
    if failure is not None:
        raise DistBackendError(f"{where}: NCCL could not create a unique id: {failure}") from failure
    if buf[0] == _UID_SKIPPED or take_part_only:
        return None
    if buf[0] != _UID_OK:
        raise DistBackendError(f"{where}: rank 0 of the group could not create the NCCL unique id (see its error)")
    return buf[1:].tobytes()


def bfloat16_apply(xp: Any, bits: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to bfloat16 values given as their uint16 bits, in float32; return the result's bits.

    ``xp`` is cupy (or numpy): neither has bfloat16 arithmetic, so the bits are
    widened to float32 (exact), ``fn`` runs there, and the result is rounded to
    nearest even (NaN stays NaN).
    """
    wide = (bits.astype(xp.uint32) << 16).view(xp.float32)
    out = xp.asarray(fn(wide), dtype=xp.float32)
    u = out.view(xp.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(out), xp.uint16(0x7FC0), rounded)


def _cupy_ops(arr: DeviceArray) -> Any:
    ops = arr.ops
    if not isinstance(ops, CupyOps):
        raise TypeError(f"nccl: {arr!r} is not memory that cupy manages")
    return ops
