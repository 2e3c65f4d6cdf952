"""The plumbing of the nccl backend: type and op tables, checks, streams, events, waits.

:class:`NCCLBase` holds what every call of :class:`~mpidist.backends.nccl.NCCLBackend`
needs around its NCCL calls: it checks the arrays and translates reductions
(:meth:`NCCLBase._plan`), makes the communication stream wait for the arrays'
producers (``_begin``), turns runtime errors into ``DistBackendError``
(``_enqueue``), records the call's event and hands out a
:class:`~mpidist.backends._cuda_work.CudaWork` or makes the consumers wait
(``_end``), keeps buffers referenced until their event completes, waits on the
host within a timeout (``host_wait``), and groups point-to-point calls
(``coalescing``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from .._validate import env_flag
from .._world import world
from ..arrays.device import DeviceArray
from ..arrays.host import DTYPES
from ..errors import DistBackendError, DistError
from ..reduce_op import OP_TABLE, Post, Prim, RedOpType, factor_value, invalid_op_error, resolve
from ..work import poll
from ._cuda import CudaRuntime, agree_devices, choose_device, share_unique_id
from ._cuda_work import CudaWork
from .base import BaseBackend

__all__ = ["NCCLBase", "type_table", "on_device"]

#: numpy dtype name -> (cupy constant, value in nccl.h)
_NCCL_TYPES = {
    "int8": ("NCCL_INT8", 0), "uint8": ("NCCL_UINT8", 1), "int32": ("NCCL_INT32", 2),
    "uint32": ("NCCL_UINT32", 3), "int64": ("NCCL_INT64", 4), "uint64": ("NCCL_UINT64", 5),
    "float16": ("NCCL_FLOAT16", 6), "float32": ("NCCL_FLOAT32", 7), "float64": ("NCCL_FLOAT64", 8),
    "bfloat16": ("NCCL_BFLOAT16", 9),
}  # fmt: skip
_NCCL_OPS = {
    "sum": ("NCCL_SUM", 0),
    "prod": ("NCCL_PROD", 1),
    "max": ("NCCL_MAX", 2),
    "min": ("NCCL_MIN", 3),
    "avg": ("NCCL_AVG", 4),
}
#: the element-wise primitive of mpidist's op table -> NCCL op (bool: LOR is max, LAND is min)
_PRIM_NAMES = {Prim.SUM: "sum", Prim.PROD: "prod", Prim.MIN: "min", Prim.MAX: "max", Prim.LOR: "max", Prim.LAND: "min"}
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)
#: NCCL 2.10 brought ncclAvg and ncclBfloat16
_AVG_VERSION = (2, 10)
_F32 = np.dtype(np.float32)

#: buffers of operations that never completed, from backends already gone (never freed)


class _TypeEntry(NamedTuple):
    move: tuple[int, int]  # (NCCL type, elements per array element) for data movement
    reduce: tuple[int, int] | None  # the same for reductions, None if NCCL cannot reduce the dtype
    why: str  # why not


def type_table(nccl: Any, version: tuple[int, int, int]) -> dict[np.dtype, _TypeEntry]:
    """Return how each supported dtype moves and reduces with this NCCL."""
    new = version[:2] >= _AVG_VERSION
    code = {name: int(getattr(nccl, const, value)) for name, (const, value) in _NCCL_TYPES.items()}
    table: dict[np.dtype, _TypeEntry] = {}
    for dtype, info in DTYPES.items():
        name = info.name
        if name in code and (name != "bfloat16" or new):
            native = (code[name], 1)
            table[dtype] = _TypeEntry(native, native, "")
        elif info.kind == "c":
            half = (code["float32" if dtype.itemsize == 8 else "float64"], 2)
            table[dtype] = _TypeEntry(half, half, "")
        elif info.kind == "b":
            table[dtype] = _TypeEntry((code["uint8"], 1), (code["uint8"], 1), "")
        else:
            why = (
                f"bfloat16 needs NCCL >= 2.10, this is {'.'.join(map(str, version))}"
                if name == "bfloat16"
                else "NCCL has no 16-bit integer type"
            )
            table[dtype] = _TypeEntry((code["uint8"], dtype.itemsize), None, why)
    return table


class _Plan(NamedTuple):
    """How one reduction runs: NCCL type, element multiplier, NCCL op, divide afterwards, premul factor."""

    dtype: int
    mult: int
    op: int
    divide: bool
    factor: Any


def _overlap(a: DeviceArray, b: DeviceArray) -> bool:
    """Two non-empty arrays share device memory (the pairwise form of ``_arrays.overlapping_pair``, kept
    direct: backends test it per pair of arguments on every call)."""
    return (
        a.device == b.device and a.nbytes > 0 and b.nbytes > 0 and a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes
    )


def _same_memory(a: DeviceArray, b: DeviceArray) -> bool:
    return a.ptr == b.ptr and a.nbytes == b.nbytes and a.device == b.device


def _consecutive(arrays: Sequence[DeviceArray]) -> bool:
    """True if the arrays lie back to back in memory, in order."""
    return all(b.ptr == a.ptr + a.nbytes for a, b in zip(arrays, arrays[1:]))


def on_device(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a backend method with the backend's GPU as the current device."""

    @functools.wraps(method)
    def run(self: NCCLBase, *args: Any) -> Any:
        with self.rt.device(self.device):
            return method(self, *args)

    return run


class NCCLBase(BaseBackend):
    """Construction and plumbing of the nccl backend (see the module docstring).

    Args:
        comm: the group's MPI communicator (used once, to share the unique id).
        timeout_s: the group's timeout in seconds.
        runtime: the CUDA/NCCL adapter.
        group_name: the group's name, for messages.
        global_ranks: the members' world ranks (timeout diagnoses).
        device: the GPU to use; None chooses one (:func:`choose_device`).
        high_priority: create the communication stream with the greatest priority
            (torch's ``ProcessGroupNCCL.Options.is_high_priority_stream``).
    """

    name = "nccl"

    def __init__(
        self,
        comm: Any,
        timeout_s: float,
        runtime: CudaRuntime,
        group_name: str = "",
        global_ranks: list[int] | None = None,
        device: int | None = None,
        high_priority: bool = False,
    ) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout_s, group_name, global_ranks)
        self.rt = rt = runtime
        self._comm: Any = None
        where = f"nccl backend of group {group_name or '?'}"
        failure: BaseException | None = None
        try:
            self.device = choose_device(rt, comm) if device is None else int(device)
        except Exception as exc:  # noqa: BLE001 - every rank raises it together (agree_devices)
            self.device, failure = -1, exc
        if failure is not None:  # the peers wait in the exchange of unique id and devices: join it, then raise
            share_unique_id(rt, comm, timeout_s, where, take_part_only=True)
            agree_devices(rt, comm, -1, failure, timeout_s, where)
        self.version = rt.nccl_version()
        self.has_avg = self.version[:2] >= _AVG_VERSION
        nccl = rt.nccl
        self._types = type_table(nccl, self.version)
        self._ops = {name: int(getattr(nccl, const, value)) for name, (const, value) in _NCCL_OPS.items()}
        self.blocking_wait = bool(env_flag("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"))
        self._inflight: deque[tuple[Any, Any]] = deque()  # (event, buffers) of calls nobody waits for
        self._scratch: DeviceArray | None = None  # barrier's one element
        self._batch: list[Any] | None = None  # inside coalescing(): works and deferred steps
        self._broken: str | None = None  # why the communicator cannot be used any more
        # (event, issued at, fn, seq) of every call, in issue order: the watchdog's view (async Works included)
        self._watch: deque[tuple[Any, float, str, int]] = deque()
        self._watch_lock = threading.Lock()
        self._abort_lock = threading.Lock()
        self._capturing = False  # the call being made is captured into a CUDA graph
        self._captured: list[Any] = []  # buffers of captured calls: a graph may replay them at any time
        with rt.device(self.device):
            self.stream, self._stream_owner = rt.new_stream(self.device, high_priority)
            self._dep = rt.new_event(self.device)  # re-recorded for every producer stream
            uid = share_unique_id(rt, comm, timeout_s, where)
            agree_devices(rt, comm, self.device, None, timeout_s, where)  # the timed barrier before NCCL's init
            assert uid is not None  # None only where rank 0 failed before, which agree_devices raised
            try:
                self._comm = rt.communicator(self.size, uid, self.rank, comm)
            except Exception as exc:
                raise DistBackendError(f"{where}: creating the NCCL communicator failed: {exc}") from exc
            self._scratch = rt.ops.empty((1,), _F32, self.device)  # now: barrier() may run in a graph capture
        _Watchdog.watch(self)

    def describe(self) -> str:
        return f"group {self.group_name or '?'} (nccl on cuda:{self.device}, rank {self.rank} of {self.size})"

    def takes(self, arr: Any) -> bool:
        return self.rt.takes(arr)

    def timeout_failure(self, op: str, seq: int, timeout_s: float) -> DistBackendError:
        """The base class's error, saying what happens to the NCCL communicator."""
        error = super().timeout_failure(op, seq, timeout_s)
        text = str(error).replace(
            "The group is unusable now (the call is still pending inside MPI)",
            "Its NCCL communicator is aborted, so the group is unusable now",
        )
        return DistBackendError(text)

    # -- checks --------------------------------------------------------------------------
    def _check(self, fn: str, arrays: Sequence[Any], backs: Any = None) -> tuple[int, int]:
        """Check the call's arrays (device, kind); return the movement type of the first one."""
        if self._broken is not None:
            raise DistBackendError(f"{fn} on {self.describe()}: {self._broken}; destroy the group and create a new one")
        if self._batch is not None and fn not in ("send", "recv"):
            raise RuntimeError(f"{fn}: only send and recv may run inside the nccl backend's coalescing() block")
        found = list(arrays) + [t for _, t in backs or ()]
        for a in found:
            if not self.rt.takes(a):
                raise TypeError(
                    f"{fn}: the nccl backend takes CUDA arrays, got {a!r}; run host arrays on a group with "
                    "backend='cpu:mpi,cuda:nccl'"
                )
            if a.device != self.device:
                raise ValueError(
                    f"{fn}: an array is on cuda:{a.device} but the nccl backend of group {self.group_name or '?'} "
                    f"uses cuda:{self.device}; one GPU per process: select it (torch.cuda.set_device) before "
                    "creating the group"
                )
        entry = self._types.get(found[0].dtype) if found else None
        if entry is None:
            return self._types[_F32].move
        return entry.move

    def _plan(self, fn: str, dtype: np.dtype, op: Any) -> _Plan:
        """Translate ``op`` on ``dtype`` into NCCL terms, or raise before anything is sent."""
        base, factor = resolve(op, fn)
        info = DTYPES[dtype]
        if base in _BITWISE:
            raise ValueError(
                f"{fn}: ReduceOp.{base.name} is not supported by the nccl backend (NCCL has no bitwise or "
                "logical reductions); use MIN/MAX on bool arrays, or reduce host arrays with the mpi backend"
            )
        entry = OP_TABLE[info.kind][base]
        if entry is None:
            raise invalid_op_error(fn, base, info.kind, info.name)
        t = self._types[dtype]
        if t.reduce is None:
            raise TypeError(f"{fn}: the nccl backend cannot reduce {info.name} arrays ({t.why}); convert them first")
        prim, post = entry
        nccl_op = self._ops[_PRIM_NAMES[prim]]
        divide, f = False, None
        if post is Post.AVG:
            if self.has_avg:
                nccl_op = self._ops["avg"]
            else:
                divide = True
        elif post is Post.PREMUL:
            f = factor_value(factor)
            if isinstance(f, complex) and info.kind != "c":
                raise ValueError(f"{fn}: PREMUL_SUM factor {f!r} is complex but the array is {info.name}")
        return _Plan(t.reduce[0], t.reduce[1], nccl_op, divide, f)

    def _disjoint(self, fn: str, arg: str, arrays: Sequence[DeviceArray]) -> None:
        spans = sorted((a.ptr, a.ptr + a.nbytes, i) for i, a in enumerate(arrays) if a.nbytes)
        for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError(
                    f"{fn}: {arg}[{i}] and {arg}[{j}] overlap in memory; every output needs its own memory"
                )

    # -- enqueueing ------------------------------------------------------------------------
    def _begin(self, arrays: Sequence[DeviceArray], backs: Any = None) -> list[int]:
        """Make the comm stream wait for the arrays' producers; return those streams (the consumers)."""
        streams: list[int] = []
        for a in list(arrays) + [t for _, t in backs or ()]:
            s = a.stream
            if s is not None and s not in streams:
                streams.append(s)
        if not streams:
            streams.append(self.rt.current_stream(self.device))
        rt, dep = self.rt, self._dep
        self._capturing = any(rt.capturing(s) for s in streams)
        for s in streams:
            if s != self.stream:
                rt.record(dep, s)
                rt.wait_event(self.stream, dep)
        return streams

    @contextlib.contextmanager
    def _enqueue(self, fn: str, seq: int) -> Iterator[None]:
        """Wrap errors of the runtime in DistBackendError and mark the group broken.

        Any failure here (NcclError, a CUDA error, cupy's OutOfMemoryError for a
        temporary, cupy < 14's KeyError on ncclRemoteError) leaves the group's ranks
        out of step: the peers may already be inside this call's NCCL kernel. So the
        communicator is aborted; the peers' watchdog ends their wait within the
        group's timeout, and every later call raises on every rank.
        """
        try:
            yield
        except DistError:
            raise
        except Exception as exc:
            self._abort(f"its NCCL communicator was aborted after {fn} (call #{seq}) failed on this rank: {exc!r}")
            raise self.backend_error(fn, seq, exc) from exc

    @contextlib.contextmanager
    def _grouped(self) -> Iterator[None]:
        """Issue the NCCL calls made inside the block as one group (ncclGroupStart/End)."""
        self.rt.group_start()
        try:
            yield
        finally:
            self.rt.group_end()

    def _later(self, step: Callable[[], None]) -> None:
        """Run a device-side step after the NCCL calls: now, or at the end of a coalescing block."""
        if self._batch is not None:
            self._batch.append(step)
        else:
            step()

    def _temp(self, like: DeviceArray, count: int, keep: list[Any]) -> DeviceArray:
        if self._capturing:  # every rank captures alike: every rank raises here, nothing was enqueued yet
            raise DistBackendError(
                f"{self.describe()}: this call needs a temporary buffer, which cannot be allocated while a CUDA "
                "graph is being captured; capture it with in-place or back-to-back arrays, or call it outside"
            )
        tmp = like.ops.empty((count,), like.dtype, self.device)
        keep.append(tmp)
        return tmp

    def _copy_of(self, a: DeviceArray, keep: list[Any]) -> DeviceArray:
        """A temporary copy of ``a`` (enqueued on the comm stream), flat."""
        tmp = self._temp(a, a.size, keep)
        self.rt.copy(tmp, a.reshape(a.size), self.stream)
        world.stats.count_copy(a.nbytes)
        return tmp

    def _copy_into(self, dst: DeviceArray, src: DeviceArray, keep: list[Any]) -> None:
        """Enqueue ``dst[...] = src`` (the same memory: nothing; overlapping: through a temporary)."""
        if _same_memory(dst, src) or not dst.size:
            return
        if _overlap(dst, src):
            src = self._copy_of(src, keep)
        self.rt.copy(dst, src.reshape(dst.shape), self.stream)

    def _divide(self, a: DeviceArray) -> None:
        """AVG's division (NCCL without ncclAvg), enqueued; complex arrays divide each component."""
        if a.dtype.kind == "c":  # complex division by n + 0j would round differently
            half = np.dtype(np.float32 if a.dtype.itemsize == 8 else np.float64)
            a = DeviceArray(a.ptr, (2 * a.size,), half, None, a.device, a.stream, a.owner, a.ops)
        self.rt.divide(a, self.size, self.stream)

    def _write_backs(self, backs: Any) -> None:
        for buf, target in backs or ():
            self.rt.copy(target, buf, self.stream)

    def _end(
        self,
        fn: str,
        seq: int,
        streams: list[int],
        keep: Any,
        async_op: bool,
        source: int | None = None,
        host_wait: bool = False,
    ) -> CudaWork | None:
        """Record the call's event; return its Work, or make the streams wait for it (blocking call)."""
        if self._batch is not None:
            work = CudaWork(self, fn, seq, None, streams, keep, self.timeout_s, source)
            self._batch.append(work)
            return work
        rt = self.rt
        event = rt.new_event(self.device)
        rt.record(event, self.stream)
        if self._capturing:  # in a CUDA graph: no event query (it would end the capture); kept for replays
            self._captured.append(keep)
            if async_op:
                return CudaWork(self, fn, seq, event, streams, None, self.timeout_s, source, False)
            for s in streams:
                rt.wait_event(s, event)
            return None
        self._watched(event, fn, seq)
        if async_op:
            return CudaWork(self, fn, seq, event, streams, keep, self.timeout_s, source, host_wait)
        for s in streams:
            rt.wait_event(s, event)
        if host_wait or self.blocking_wait:
            self.host_wait(fn, seq, event, keep, self.timeout_s)
        else:
            self._track(event, keep)
        return None

    def _track(self, event: Any, keep: Any) -> None:
        """Keep ``keep`` referenced until ``event`` completes (checked on later calls)."""
        q = self._inflight
        query = self.rt.query
        while q and query(q[0][0]):
            q.popleft()
        q.append((event, keep))

    def host_wait(self, fn: str, seq: int, event: Any, keep: Any, limit: float) -> None:
        """Block the host until ``event`` completes; past ``limit`` seconds abort the communicator and raise."""
        rt, comm = self.rt, self._comm

        def test() -> bool:
            if rt.query(event):
                return True
            if self._broken is not None:  # the watchdog aborted the communicator
                raise _WatchdogAbortError(self._broken)
            rt.check_async_error(comm)
            return False

        try:
            finished = poll(test, limit, self.spins, (self.group_name, fn, seq))
        except _WatchdogAbortError as stop:
            self.keep_stuck(event, keep)
            if stop.timed_out:  # the same error as a host wait that timed out itself
                raise self.timeout_failure(fn, seq, limit) from None
            raise DistBackendError(f"{fn} (call #{seq}) on {self.describe()}: {stop}") from None
        except DistError:
            raise
        except Exception as exc:
            raise self.failed(fn, seq, event, keep, exc) from exc
        if not finished:
            self.keep_stuck(event, keep)
            error = self.timeout_failure(fn, seq, limit)
            self._abort(self._timed_out(fn, seq, limit))
            raise error

    def failed(self, fn: str, seq: int, event: Any, keep: Any, exc: BaseException) -> DistBackendError:
        """An operation reported an error while running: keep its buffers, abort, return the error to raise."""
        self.keep_stuck(event, keep)
        self._abort(f"its NCCL communicator was aborted after {fn} (call #{seq}) failed: {exc}")
        return self.backend_error(fn, seq, exc)

    def _timed_out(self, fn: str, seq: int, limit: float) -> str:
        """Why the group broke when a call outlived its timeout.

        The host wait and the watchdog may both see it first: they give one reason.
        """
        return (
            f"its NCCL communicator was aborted after {fn} (call #{seq}) timed out: it was unfinished after "
            f"{limit:g} s (a peer failed or never made the call)"
        )

    def _abort(self, reason: str) -> None:
        """Mark the group broken and abort the communicator on a thread of its own.

        ``ncclCommAbort`` can block (NCCL >= 2.16 waits for its proxy threads): the
        caller waits at most half a second for it, then goes on.
        """
        with self._abort_lock:  # a second caller (the watchdog, a host wait) returns once the group is broken
            if self._broken is not None or self._comm is None:
                return
            rt, comm, device = self.rt, self._comm, self.device

            def run() -> None:
                with contextlib.suppress(Exception), rt.device(device):
                    rt.abort(comm)

            t = threading.Thread(target=run, name="mpidist-nccl-abort", daemon=True)
            t.start()
            t.join(0.5)
            self._broken = reason

    def abandon(self) -> None:
        """The group was shrunk: abort the communicator (off the caller's thread); its calls end."""
        self._abort("the group was replaced by shrink_group; its NCCL communicator was aborted")
        _Watchdog.forget(self)

    # -- the watchdog ------------------------------------------------------------------------
    def _watched(self, event: Any, fn: str, seq: int) -> None:
        with self._watch_lock:
            self._watch.append((event, time.monotonic(), fn, seq))

    def watchdog_tick(self, now: float) -> None:
        """One look of the watchdog: drop finished calls, enforce the timeout, poll NCCL's async error."""
        if self._broken is not None or self._comm is None:
            return
        rt = self.rt
        with rt.device(self.device), rt.relaxed_capture():  # a graph captured meanwhile stays valid
            with self._watch_lock:
                q = self._watch
                while q and rt.query(q[0][0]):
                    q.popleft()
                oldest = q[0] if q else None
            if oldest is not None and now - oldest[1] > self.timeout_s:
                _, _, fn, seq = oldest
                self._abort(self._timed_out(fn, seq, self.timeout_s))
                return
            try:
                rt.check_async_error(self._comm)
            except Exception as exc:  # noqa: BLE001 - NcclError, or cupy < 14's KeyError on ncclRemoteError
                self._abort(f"its NCCL communicator was aborted by the watchdog: NCCL reported {exc!r}")

    # -- plumbing ------------------------------------------------------------------------
    def adopt(self, reqs: Any, keep: Any) -> None:
        """Keep the buffers of a dropped Work until its event (``reqs``) completes."""
        if reqs is None:
            self._stuck.append(keep)
        else:
            self._track(reqs, keep)

    def pending(self) -> bool:
        q = self._inflight
        while q and self.rt.query(q[0][0]):
            q.popleft()
        with self._watch_lock:
            w = self._watch
            while w and self.rt.query(w[0][0]):
                w.popleft()
            watched = bool(w)
        return bool(self._stuck or q or watched)

    def shutdown(self) -> None:
        """Wait (within the timeout) for calls still running, then free the communicator.

        If they do not finish, or a call failed or timed out before, the
        communicator is aborted and their buffers stay referenced forever.
        """
        if self._comm is None:
            return
        rt = self.rt
        with rt.device(self.device):
            inflight = self._inflight
            with self._watch_lock:
                events = [e for e, _ in inflight] + [e for e, _, _, _ in self._watch]  # async Works too
            if self._broken is None and events:
                if not poll(lambda: all(rt.query(e) for e in events), self.timeout_s, self.spins):
                    self._abort("a call was still running when the group was destroyed")
            if self.pending():
                world.unreleased.append((list(inflight), list(self._stuck)))
            if self._broken is None:
                with contextlib.suppress(Exception):
                    rt.destroy(self._comm)
        self._comm = None
        self._broken = "the group was destroyed"
        _Watchdog.forget(self)

    @contextlib.contextmanager
    def coalescing(self) -> Iterator[None]:
        """Issue the sends and receives made inside the block as one NCCL group.

        ``batch_isend_irecv`` needs this (as torch's does): NCCL runs point-to-point
        calls of one stream in order, so a send and a receive that depend on each
        other must be grouped. The Works made inside complete together.

        Example (``mpiexec -n 2``, ``x`` and ``y`` CUDA arrays)::

            >>> with backend.coalescing():
            ...     works = [backend.send(x, peer, 0), backend.recv(y, None, peer, 0)]
        """
        fn = "batch_isend_irecv"
        if self._batch is not None:
            raise RuntimeError(f"{fn}: coalescing blocks of the nccl backend do not nest")
        self._check(fn, [])
        rt = self.rt
        batch: list[Any] = []
        with rt.device(self.device):
            with self._enqueue(fn, self.p2p_seq):
                rt.group_start()
            self._batch = batch
            try:
                yield
            finally:
                self._batch = None
                try:
                    with self._enqueue(fn, self.p2p_seq):
                        rt.group_end()
                finally:  # the Works get their event even if the block failed
                    for step in batch:
                        if not isinstance(step, CudaWork):
                            step()
                    event = rt.new_event(self.device)
                    rt.record(event, self.stream)
                    self._watched(event, fn, self.p2p_seq)
                    for step in batch:
                        if isinstance(step, CudaWork):
                            step._event = event


class _WatchdogAbortError(Exception):
    """Raised inside a host wait's poll when the watchdog has aborted the communicator meanwhile."""

    @property
    def timed_out(self) -> bool:
        return "timed out" in str(self)


class _Watchdog:
    """One daemon thread for every nccl backend of the process (as torch's ProcessGroupNCCL watchdog).

    Every ``INTERVAL`` seconds it looks at each live backend (:meth:`NCCLBase.watchdog_tick`):
    a call older than the group's timeout, or an asynchronous NCCL error (a peer died,
    ``ncclRemoteError``), aborts the communicator and marks the group broken, so a host
    wait ends with a DistBackendError and later calls raise, instead of hanging.
    """

    INTERVAL = 0.1
    _backends: weakref.WeakSet[NCCLBase] = weakref.WeakSet()
    _thread: threading.Thread | None = None
    _lock = threading.Lock()

    @classmethod
    def watch(cls, backend: NCCLBase) -> None:
        with cls._lock:
            cls._backends.add(backend)
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._run, name="mpidist-nccl-watchdog", daemon=True)
                cls._thread.start()

    @classmethod
    def forget(cls, backend: NCCLBase) -> None:
        with cls._lock:
            cls._backends.discard(backend)

    @classmethod
    def _run(cls) -> None:
        while True:
            time.sleep(cls.INTERVAL)
            with cls._lock:
                backends = list(cls._backends)
            now = time.monotonic()
            for b in backends:
                with contextlib.suppress(Exception):  # a runtime gone at interpreter exit
                    b.watchdog_tick(now)
