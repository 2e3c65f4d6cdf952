"""A fake ``cupy.cuda.nccl`` and CUDA runtime, to run the nccl backend on a machine without a GPU.

* :class:`FakeNccl` stands in for the module: constants, ``get_version``,
  ``get_unique_id`` (bytes like cupy >= 14, or a tuple of signed chars like older
  cupy), ``groupStart``/``groupEnd`` and ``NcclCommunicator``.
* :class:`FakeComm` runs every NCCL call synchronously with mpi4py on host memory
  (the "device pointers" are addresses of numpy arrays). Calls made between
  ``groupStart`` and ``groupEnd`` are buffered and run at the outermost
  ``groupEnd``: collectives in order, then every send and receive at once
  (nonblocking MPI). It checks what real NCCL requires: a known datatype and op
  for the NCCL version (ncclAvg and ncclBfloat16 from 2.10), the communication
  stream, and the only in-place layouts NCCL allows.
* :class:`FakeRuntime` is the backend's runtime adapter with fake streams (integer
  handles) and events that complete at once, unless ``hold`` is set: then they stay
  pending until :meth:`FakeRuntime.release`. Device copies and arithmetic run at
  once through :class:`mpidist.testing.standin.HostOps`. Everything is logged in order.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import ml_dtypes
import numpy as np
from mpi4py import MPI

from mpidist.arrays.device import DeviceArray
from mpidist.backends._cuda import CudaRuntime
from mpidist.testing.standin import HostOps

HOST_OPS = HostOps()
CURRENT_STREAM = 7  # what the fake runtime calls the current stream

#: NCCL datatype -> numpy dtype (nccl.h)
NUMPY_OF = {
    0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32), 3: np.dtype(np.uint32),
    4: np.dtype(np.int64), 5: np.dtype(np.uint64), 6: np.dtype(np.float16), 7: np.dtype(np.float32),
    8: np.dtype(np.float64), 9: np.dtype(ml_dtypes.bfloat16),
}  # fmt: skip
OP_NAMES = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
_TAG = 77


class FakeNcclError(RuntimeError):
    """What the fake raises where NCCL would return an error (cupy raises NcclError, a RuntimeError)."""


def dev(a: np.ndarray, stream: int | None = 1, device: int = 0) -> DeviceArray:
    """A DeviceArray over the memory of numpy array ``a`` (host memory standing in for GPU memory)."""
    strides = None if a.flags.c_contiguous else a.strides
    return DeviceArray(a.ctypes.data if a.size else 0, a.shape, a.dtype, strides, device, stream, a, HOST_OPS)


def view(ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
    """The ``count`` elements at address ``ptr`` as a writable numpy array."""
    if count == 0:
        return np.empty(0, dtype)
    return np.frombuffer(MPI.buffer.fromaddress(ptr, count * dtype.itemsize, readonly=False), dtype)


def _overlap(p: int, n: int, q: int, m: int) -> bool:
    return n > 0 and m > 0 and p < q + m and q < p + n


def fold(parts: np.ndarray, dtype: np.dtype, op: int, size: int) -> np.ndarray:
    """Reduce ``parts`` (one row per rank) as NCCL does: floats in float64 rounded once, integers wrap."""
    floating = dtype.kind == "f" or dtype == NUMPY_OF[9]
    work = parts.astype(np.float64) if floating else parts
    name = OP_NAMES[op]
    if name in ("sum", "avg"):
        r = work.sum(axis=0, dtype=work.dtype)
    elif name == "prod":
        r = work.prod(axis=0, dtype=work.dtype)
    elif name == "max":
        r = work.max(axis=0)
    else:
        r = work.min(axis=0)
    if name == "avg":
        if floating:
            r = r / size
        elif dtype.kind == "u":
            r = r // size
        else:  # truncation toward zero
            r = (np.abs(r.astype(np.int64)) // size * np.sign(r.astype(np.int64))).astype(dtype)
    return np.asarray(r).astype(dtype)


class FakeNccl:
    """Stands in for the ``cupy.cuda.nccl`` module.

    Args:
        version: what ``get_version()`` returns (21903 is 2.19.3, 2804 is 2.8.4).
        uid_form: what ``get_unique_id()`` returns: "bytes" (cupy >= 14) or "tuple".
        ctor_form: the unique-id type ``NcclCommunicator`` takes (default: ``uid_form``).
        constants: whether the module has NCCL_AVG and NCCL_BFLOAT16 (old cupy had neither).
    """

    def __init__(
        self, version: int = 21903, uid_form: str = "bytes", ctor_form: str | None = None, constants: bool = True
    ):
        self.version = version
        self.uid_form = uid_form
        self.ctor_form = ctor_form or uid_form
        self.log: list[tuple[Any, ...]] = []
        self.streams: set[int] = set()  # the communication streams (made by FakeRuntime)
        self.depth = 0
        self.grouped: list[tuple[str, Callable[[], Any]]] = []
        self.bound: MPI.Comm | None = None
        self.comms: list[FakeComm] = []
        self.uid_seen: list[type] = []
        names = ["INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64", "FLOAT16", "FLOAT32", "FLOAT64"]
        for code, name in enumerate(names):
            setattr(self, f"NCCL_{name}", code)
        self.NCCL_SUM, self.NCCL_PROD, self.NCCL_MAX, self.NCCL_MIN = 0, 1, 2, 3
        if constants:
            self.NCCL_BFLOAT16 = 9
            self.NCCL_AVG = 4

    @property
    def new(self) -> bool:
        return self.version >= 21000

    def get_version(self) -> int:
        return self.version

    def get_unique_id(self) -> Any:
        data = os.urandom(128)
        self.log.append(("get_unique_id",))
        if self.uid_form == "bytes":
            return data
        return tuple(b - 256 if b > 127 else b for b in data)

    def NcclCommunicator(self, ndev: int, commId: Any, rank: int) -> FakeComm:  # noqa: N802, N803 - cupy's names
        return FakeComm(self, ndev, commId, rank)

    def groupStart(self) -> None:  # noqa: N802
        self.depth += 1
        self.log.append(("groupStart",))

    def groupEnd(self) -> None:  # noqa: N802
        if self.depth == 0:
            raise FakeNcclError("groupEnd without groupStart")
        self.depth -= 1
        self.log.append(("groupEnd",))
        if self.depth == 0:
            ops, self.grouped = self.grouped, []
            p2p = [op for kind, op in ops if kind == "p2p"]
            for kind, op in ops:
                if kind == "coll":
                    op()
            reqs = [op() for op in p2p]
            MPI.Request.Waitall(reqs)

    def bind(self, comm: MPI.Comm) -> None:
        """Give the next NcclCommunicator the group's MPI communicator to run over."""
        self.bound = comm

    def calls(self, name: str) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[0] == name]


class FakeComm:
    """A fake NcclCommunicator: each call runs over MPI on host memory (see the module docstring)."""

    def __init__(self, nccl: FakeNccl, ndev: int, uid: Any, rank: int) -> None:
        self.nccl = nccl
        want = bytes if nccl.ctor_form == "bytes" else tuple
        if not isinstance(uid, want):
            raise TypeError(
                f"Argument 'commId' has incorrect type (expected {want.__name__}, got {type(uid).__name__})"
            )
        if want is tuple:
            if len(uid) != 128 or not all(-128 <= c <= 127 for c in uid):
                raise OverflowError("value too large to convert to char")
            uid = bytes(c & 0xFF for c in uid)
        nccl.uid_seen.append(want)
        comm, nccl.bound = nccl.bound, None
        if comm is None:
            raise FakeNcclError("FakeRuntime.communicator was not used to make this communicator")
        if comm.Get_size() != ndev or comm.Get_rank() != rank:
            raise FakeNcclError(f"rank {rank} of {ndev} does not match the MPI communicator")
        self.mpi = comm.Dup()
        uids = self.mpi.allgather(uid)
        if any(u != uids[0] for u in uids):
            raise FakeNcclError("the ranks passed different unique ids")
        self.rank, self.ndev = rank, ndev
        self.aborted = False
        self.destroyed = False
        self.async_error: str | None = None
        self.pending: list[MPI.Request] = []  # ungrouped sends
        nccl.comms.append(self)

    # -- plumbing -----------------------------------------------------------------------
    def _enter(self, name: str, dtype: int, count: int, stream: int, op: int | None = None) -> np.dtype:
        nccl = self.nccl
        nccl.log.append((name, dtype, count, op, stream))
        if self.aborted or self.destroyed:
            raise FakeNcclError(f"{name}: the communicator was aborted or destroyed")
        if dtype not in NUMPY_OF or (dtype == 9 and not nccl.new):
            raise FakeNcclError(f"{name}: invalid datatype {dtype} for NCCL {nccl.version}")
        if op is not None and (op not in OP_NAMES or (op == 4 and not nccl.new)):
            raise FakeNcclError(f"{name}: invalid op {op} for NCCL {nccl.version}")
        if stream not in nccl.streams:
            raise FakeNcclError(f"{name}: stream {stream} is not a communication stream")
        if count < 0:
            raise FakeNcclError(f"{name}: negative count")
        return NUMPY_OF[dtype]

    def _run(self, kind: str, op: Callable[[], Any]) -> Any:
        if self.nccl.depth:
            self.nccl.grouped.append((kind, op))
            return None
        return op()

    def _gather(self, data: np.ndarray) -> np.ndarray:
        out = np.empty((self.ndev, data.size), data.dtype)
        self.mpi.Allgather(np.ascontiguousarray(data).view(np.uint8), out.view(np.uint8))
        return out

    # -- collectives ------------------------------------------------------------------------
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        dt = self._enter("allReduce", datatype, count, stream, op)
        nb = count * dt.itemsize
        if sendbuf != recvbuf and _overlap(sendbuf, nb, recvbuf, nb):
            raise FakeNcclError("allReduce: buffers overlap but are not the same (not in place)")

        def run() -> None:
            parts = self._gather(view(sendbuf, count, dt))
            view(recvbuf, count, dt)[...] = fold(parts, dt, op, self.ndev)

        self._run("coll", run)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        dt = self._enter("reduce", datatype, count, stream, op)
        nb = count * dt.itemsize
        if self.rank == root and sendbuf != recvbuf and _overlap(sendbuf, nb, recvbuf, nb):
            raise FakeNcclError("reduce: buffers overlap but are not the same")

        def run() -> None:
            parts = self._gather(view(sendbuf, count, dt))
            if self.rank == root:
                view(recvbuf, count, dt)[...] = fold(parts, dt, op, self.ndev)

        self._run("coll", run)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        dt = self._enter("broadcast", datatype, count, stream)
        nb = count * dt.itemsize
        if self.rank == root and sendbuff != recvbuff and _overlap(sendbuff, nb, recvbuff, nb):
            raise FakeNcclError("broadcast: buffers overlap but are not the same")

        def run() -> None:
            data = view(sendbuff, count, dt).copy() if self.rank == root else np.empty(count, dt)
            self.mpi.Bcast(data.view(np.uint8), root=root)
            view(recvbuff, count, dt)[...] = data

        self._run("coll", run)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        dt = self._enter("allGather", datatype, count, stream)
        nb = count * dt.itemsize
        if _overlap(sendbuf, nb, recvbuf, nb * self.ndev) and sendbuf != recvbuf + self.rank * nb:
            raise FakeNcclError("allGather: the input overlaps the output but is not this rank's block")

        def run() -> None:
            view(recvbuf, count * self.ndev, dt)[...] = self._gather(view(sendbuf, count, dt)).reshape(-1)

        self._run("coll", run)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        dt = self._enter("reduceScatter", datatype, recvcount, stream, op)
        nb = recvcount * dt.itemsize
        if _overlap(sendbuf, nb * self.ndev, recvbuf, nb) and recvbuf != sendbuf + self.rank * nb:
            raise FakeNcclError("reduceScatter: the output overlaps the input but is not this rank's block")

        def run() -> None:
            parts = self._gather(view(sendbuf, recvcount * self.ndev, dt))
            full = fold(parts, dt, op, self.ndev)
            view(recvbuf, recvcount, dt)[...] = full[self.rank * recvcount : (self.rank + 1) * recvcount]

        self._run("coll", run)

    # -- point-to-point -----------------------------------------------------------------------
    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        dt = self._enter("send", datatype, count, stream)

        def run() -> MPI.Request:
            return self.mpi.Isend(view(sendbuf, count, dt).copy().view(np.uint8), peer, _TAG)

        if self.nccl.depth:
            self.nccl.grouped.append(("p2p", run))
        else:  # like NCCL for small messages: returns once the data is on its way
            self.pending.append(run())

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        dt = self._enter("recv", datatype, count, stream)
        out = view(recvbuf, count, dt)

        def run() -> MPI.Request:
            return self.mpi.Irecv(out.view(np.uint8), peer, _TAG)

        if self.nccl.depth:
            self.nccl.grouped.append(("p2p", run))
        else:
            run().Wait()

    # -- lifetime -----------------------------------------------------------------------------
    def check_async_error(self) -> None:
        if self.async_error is not None:
            raise FakeNcclError(self.async_error)

    def abort(self) -> None:
        self.nccl.log.append(("abort",))
        self.aborted = True

    def destroy(self) -> None:
        self.nccl.log.append(("destroy",))
        MPI.Request.Waitall(self.pending)
        self.destroyed = True
        self.mpi.Free()

    def size(self) -> int:
        return self.ndev

    def rank_id(self) -> int:
        return self.rank


class FakeEvent:
    __slots__ = ("done", "stream")

    def __init__(self) -> None:
        self.done = False
        self.stream: int | None = None


class FakeRuntime(CudaRuntime):
    """The nccl backend's runtime adapter over :class:`FakeNccl`, fake streams and events.

    Args:
        nccl: the fake NCCL module.
        devices: the number of "visible GPUs".
        current: the current device.
        context: whether a device is already in use (else the backend chooses one).
    """

    def __init__(self, nccl: FakeNccl, devices: int = 1, current: int = 0, context: bool = True) -> None:
        super().__init__(None, nccl, HOST_OPS)
        self.log = nccl.log
        self.hold = False  # events recorded now stay pending until release()
        self.held: list[FakeEvent] = []
        self.devices, self.current, self.context = devices, current, context
        self._next = 0x5000

    def takes(self, arr: Any) -> bool:
        return type(arr) is DeviceArray and isinstance(arr.ops, HostOps)

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return self.current

    def device_chosen(self) -> bool:
        return self.context

    def node_key(self) -> str:
        """Each rank on a node of its own: every rank's "GPU 0" is another GPU."""
        return f"fake-node-{MPI.COMM_WORLD.Get_rank()}"

    def set_device(self, device: int) -> None:
        self.log.append(("set_device", device))
        self.current, self.context = device, True

    def device(self, device: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def new_stream(self, device: int, high_priority: bool = False) -> tuple[int, Any]:
        self._next += 1
        self.nccl.streams.add(self._next)
        self.log.append(("new_stream", self._next, high_priority))
        return self._next, None

    def current_stream(self, device: int) -> int:
        return CURRENT_STREAM

    def new_event(self, device: int) -> FakeEvent:
        return FakeEvent()

    def record(self, event: FakeEvent, stream: int) -> None:
        self.log.append(("record", stream))
        event.stream = stream
        event.done = not self.hold
        if self.hold:
            self.held.append(event)

    def wait_event(self, stream: int, event: FakeEvent) -> None:
        self.log.append(("wait", stream, event.stream))

    def query(self, event: FakeEvent) -> bool:
        return event.done

    def release(self) -> None:
        """Complete every event recorded while ``hold`` was set."""
        for e in self.held:
            e.done = True
        self.held.clear()
        self.hold = False

    def _on_comm(self, stream: int, what: str) -> None:
        self.log.append((what, stream))
        if stream not in self.nccl.streams:
            raise AssertionError(f"{what} enqueued on stream {stream}, not on the communication stream")

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: int) -> None:
        self._on_comm(stream, "copy")
        if dst.size != src.size:
            raise AssertionError(f"copy of {src.size} elements into {dst.size}")
        dst.ops.copy(dst, src.reshape(dst.shape))

    def scale(self, arr: DeviceArray, factor: Any, stream: int) -> None:
        self._on_comm(stream, "scale")
        arr.ops.scale(arr, factor)

    def divide(self, arr: DeviceArray, n: int, stream: int) -> None:
        self._on_comm(stream, "divide")
        arr.ops.divide(arr, n)

    def communicator(self, size: int, uid: bytes, rank: int, comm: Any) -> Any:
        self.nccl.bind(comm)
        return super().communicator(size, uid, rank, comm)
