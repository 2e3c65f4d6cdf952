"""NCCL and the CUDA runtime adapter on the GPU stand-in (:mod:`mpidist.testing.gpu`), and a fake cupy.

* :class:`StandinNccl` stands in for ``cupy.cuda.nccl``: its calls are enqueued on
  the stand-in's streams and run as nonblocking MPI over the shadows when the stream
  runs; ``available`` can be False, as cupy's is without libnccl;
* :class:`StandinRuntime` is the nccl backend's :class:`~mpidist.backends._cuda.CudaRuntime`
  over the stand-in (devices, streams, events, copies and arithmetic on a stream,
  graph-capture probes);
* :func:`fake_cupy` installs a ``cupy`` package whose ``nccl.available`` is chosen.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from typing import Any, Callable, Iterator

import numpy as np

from ..arrays.device import DeviceArray
from ..backends._cuda import CudaRuntime
from .gpu import GpuStandin, StandinEvent, _Pending

__all__ = ["StandinNccl", "StandinComm", "StandinRuntime", "fake_cupy"]


_NUMPY_OF = {
    0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16", 7: "float32",
    8: "float64",
}  # fmt: skip


def _fold(parts: np.ndarray, dtype: np.dtype, op: int, size: int) -> np.ndarray:
    floating = dtype.kind == "f" or dtype.name == "bfloat16"
    work = parts.astype(np.float64) if floating else parts
    if op in (0, 4):
        r = work.sum(axis=0, dtype=work.dtype)
    elif op == 1:
        r = work.prod(axis=0, dtype=work.dtype)
    elif op == 2:
        r = work.max(axis=0)
    else:
        r = work.min(axis=0)
    if op == 4:
        r = r / size if floating else np.trunc(r.astype(np.float64) / size)
    return np.asarray(r).astype(dtype)


class StandinNccl:
    """Stands in for ``cupy.cuda.nccl``: its calls are enqueued on the stand-in's streams.

    Args:
        gpu: the stand-in.
        available: what ``available`` says (cupy sets False when libnccl cannot be loaded).
        version: what ``get_version()`` returns.
    """

    def __init__(self, gpu: GpuStandin, available: bool = True, version: int = 21903) -> None:
        self.gpu, self.available, self.version = gpu, available, version
        names = ["INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64", "FLOAT16", "FLOAT32", "FLOAT64"]
        for code, name in enumerate(names):
            setattr(self, f"NCCL_{name}", code)
        self.NCCL_BFLOAT16 = 9
        self.NCCL_SUM, self.NCCL_PROD, self.NCCL_MAX, self.NCCL_MIN, self.NCCL_AVG = 0, 1, 2, 3, 4
        self.bound: Any = None
        self.depth = 0
        self.grouped: list[tuple[int, Callable[[], Any]]] = []

    def get_version(self) -> int:
        return self.version

    def get_unique_id(self) -> bytes:
        import os

        return os.urandom(128)

    def NcclCommunicator(self, ndev: int, commId: Any, rank: int) -> StandinComm:  # noqa: N802, N803 - cupy's names
        comm, self.bound = self.bound, None
        if comm is None:
            raise RuntimeError("StandinRuntime.communicator was not used to make this communicator")
        return StandinComm(self, comm, ndev, rank)

    def groupStart(self) -> None:  # noqa: N802
        self.depth += 1

    def groupEnd(self) -> None:  # noqa: N802
        self.depth -= 1
        if self.depth == 0 and self.grouped:
            calls, self.grouped = self.grouped, []
            stream = calls[0][0]
            starts = [start for _, start in calls]

            def step() -> Any:
                parts = [start() for start in starts]
                return _Group(parts)

            self.gpu.enqueue(stream, step)


class _Group:
    def __init__(self, parts: list[_Pending]) -> None:
        self.parts = parts

    def test(self) -> bool:
        self.parts = [p for p in self.parts if not p.test()]
        return not self.parts


class StandinComm:
    """An NcclCommunicator of the stand-in: each call, when its stream runs, is nonblocking MPI."""

    def __init__(self, nccl: StandinNccl, comm: Any, ndev: int, rank: int) -> None:
        if comm.Get_size() != ndev or comm.Get_rank() != rank:
            raise RuntimeError(f"stand-in NCCL: rank {rank} of {ndev} does not match the MPI communicator")
        self.nccl, self.gpu = nccl, nccl.gpu
        self.mpi = comm.Dup()
        self.rank, self.ndev = rank, ndev
        self.aborted = False
        self.destroyed = False
        self.async_error: str | None = None

    def _issue(self, stream: int, start: Callable[[], _Pending]) -> None:
        if self.aborted or self.destroyed:
            raise RuntimeError("NCCL error: invalid usage (the communicator was aborted or destroyed)")
        if self.nccl.depth:
            self.nccl.grouped.append((stream, start))
        else:
            self.gpu.enqueue(stream, start)

    def _dt(self, datatype: int) -> np.dtype:
        if datatype == 9:
            from ..arrays.device import BFLOAT16

            return BFLOAT16
        return np.dtype(_NUMPY_OF[datatype])

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        self._reduction(sendbuf, recvbuf, count, datatype, op, None, stream)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        self._reduction(sendbuf, recvbuf, count, datatype, op, root, stream)

    def _reduction(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int | None, stream: int
    ) -> None:
        """allReduce (``root`` None: every rank gets the result) and reduce: gather every rank's input, fold."""
        dt, gpu = self._dt(datatype), self.gpu

        def start() -> _Pending:
            send = gpu.raw(sendbuf, count, dt).copy()
            parts = np.empty((self.ndev, count), dt)
            req = self.mpi.Iallgather(send.view(np.uint8), parts.view(np.uint8))

            def finish() -> None:
                if root is None or self.rank == root:
                    gpu.raw(recvbuf, count, dt)[...] = _fold(parts, dt, op, self.ndev)

            return _Pending(self, [req], finish, (send, parts))

        self._issue(stream, start)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        dt, gpu = self._dt(datatype), self.gpu

        def start() -> _Pending:
            data = gpu.raw(sendbuff, count, dt).copy() if self.rank == root else np.empty(count, dt)
            req = self.mpi.Ibcast(data.view(np.uint8), root=root)

            def finish() -> None:
                gpu.raw(recvbuff, count, dt)[...] = data

            return _Pending(self, [req], finish, data)

        self._issue(stream, start)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        dt, gpu = self._dt(datatype), self.gpu

        def start() -> _Pending:
            send = gpu.raw(sendbuf, count, dt).copy()
            parts = np.empty((self.ndev, count), dt)
            req = self.mpi.Iallgather(send.view(np.uint8), parts.view(np.uint8))

            def finish() -> None:
                gpu.raw(recvbuf, count * self.ndev, dt)[...] = parts.reshape(-1)

            return _Pending(self, [req], finish, (send, parts))

        self._issue(stream, start)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        dt, gpu = self._dt(datatype), self.gpu
        n = recvcount

        def start() -> _Pending:
            send = gpu.raw(sendbuf, n * self.ndev, dt).copy()
            parts = np.empty((self.ndev, n * self.ndev), dt)
            req = self.mpi.Iallgather(send.view(np.uint8), parts.view(np.uint8))

            def finish() -> None:
                full = _fold(parts, dt, op, self.ndev)
                gpu.raw(recvbuf, n, dt)[...] = full[self.rank * n : (self.rank + 1) * n]

            return _Pending(self, [req], finish, (send, parts))

        self._issue(stream, start)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        dt, gpu = self._dt(datatype), self.gpu

        def start() -> _Pending:
            data = gpu.raw(sendbuf, count, dt).copy()
            return _Pending(self, [self.mpi.Isend(data.view(np.uint8), peer, 5)], lambda: None, data)

        self._issue(stream, start)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        dt, gpu = self._dt(datatype), self.gpu

        def start() -> _Pending:
            data = np.empty(count, dt)

            def finish() -> None:
                gpu.raw(recvbuf, count, dt)[...] = data

            return _Pending(self, [self.mpi.Irecv(data.view(np.uint8), peer, 5)], finish, data)

        self._issue(stream, start)

    def check_async_error(self) -> None:
        if self.async_error is not None:
            raise RuntimeError(f"NCCL error: {self.async_error}")

    def abort(self) -> None:
        """ncclCommAbort: pending calls end (their data undefined); the MPI side is abandoned."""
        self.aborted = True

    def destroy(self) -> None:
        """ncclCommDestroy (after its calls): the communicator cannot be used again."""
        if not self.aborted and not self.destroyed:
            self.mpi.Free()
        self.destroyed = True


class StandinRuntime(CudaRuntime):
    """The nccl backend's CUDA/NCCL adapter over a :class:`GpuStandin` and :class:`StandinNccl`.

    Args:
        gpu: the stand-in.
        nccl: its NCCL (default: a new, available one).
        devices: how many GPUs are visible.
        context: whether a CUDA context is current (a device is in use).
        current: the current device (default: the stand-in's; ``torch.cuda.set_device`` may set it
            without a context).
        devices: how many GPUs are visible (default: the stand-in's index + 1).
    """

    def __init__(
        self,
        gpu: GpuStandin,
        nccl: StandinNccl | None = None,
        devices: int | None = None,
        context: bool = True,
        current: int | None = None,
    ):
        super().__init__(None, nccl or StandinNccl(gpu), gpu.ops)
        self.gpu = gpu
        self.devices = gpu.device + 1 if devices is None else devices
        self.current = gpu.device if current is None else current
        self.context = context

    def takes(self, arr: Any) -> bool:
        return type(arr) is DeviceArray and arr.ops is self.gpu.ops

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return self.current

    def device_chosen(self) -> bool:
        return self.context

    def set_device(self, device: int) -> None:
        self.current, self.context = device, True

    def device(self, device: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def new_stream(self, device: int, high_priority: bool = False) -> tuple[int, Any]:
        return self.gpu.new_stream(), None

    def current_stream(self, device: int) -> int:
        return self.gpu.current

    def new_event(self, device: int) -> StandinEvent:
        return StandinEvent()

    def record(self, event: StandinEvent, stream: int) -> None:
        self.gpu.record(event, stream)

    def wait_event(self, stream: int, event: StandinEvent) -> None:
        self.gpu.wait_event(stream, event)

    def query(self, event: StandinEvent) -> bool:
        return self.gpu.query(event)

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: int) -> None:
        gpu = self.gpu
        gpu.enqueue(stream, lambda: np.copyto(gpu.shadow(dst), gpu.shadow(src).reshape(dst.shape), casting="no"))

    def scale(self, arr: DeviceArray, factor: Any, stream: int) -> None:
        self.gpu.enqueue(stream, lambda: self.gpu.ops.scale(arr, factor))

    def divide(self, arr: DeviceArray, n: int, stream: int) -> None:
        self.gpu.enqueue(stream, lambda: self.gpu.ops.divide(arr, n))

    def capturing(self, stream: int) -> bool:
        return stream in self.gpu.capturing

    def relaxed_capture(self) -> contextlib.AbstractContextManager[Any]:
        return self.gpu.relaxed()

    def communicator(self, size: int, uid: bytes, rank: int, comm: Any) -> Any:
        self.nccl.bound = comm
        return super().communicator(size, uid, rank, comm)


@contextlib.contextmanager
def fake_cupy(available: bool = False, devices: int = 1) -> Iterator[types.ModuleType]:
    """Install a fake ``cupy`` (with ``cupy.cuda.nccl.available = available``) in ``sys.modules``.

    mpidist's check of NCCL (``backends.registry.nccl_available``) is reset on entry
    and on exit, so it looks at the fake inside the block only.
    """
    from .._world import world

    names = ("cupy", "cupy.cuda", "cupy.cuda.nccl", "cupy.cuda.runtime")
    saved = {n: sys.modules.get(n) for n in names}
    mods = {n: types.ModuleType(n) for n in names}
    for n, m in mods.items():
        m.__spec__ = importlib.machinery.ModuleSpec(n, None, is_package=n != "cupy.cuda.nccl")
        m.__path__ = []  # type: ignore[attr-defined]
    mods["cupy"].cuda = mods["cupy.cuda"]  # type: ignore[attr-defined]
    mods["cupy.cuda"].nccl = mods["cupy.cuda.nccl"]  # type: ignore[attr-defined]
    mods["cupy.cuda"].runtime = mods["cupy.cuda.runtime"]  # type: ignore[attr-defined]
    mods["cupy.cuda.nccl"].available = available  # type: ignore[attr-defined]
    mods["cupy.cuda.runtime"].getDeviceCount = lambda: devices  # type: ignore[attr-defined]
    sys.modules.update(mods)
    world.nccl_ok = None
    try:
        yield mods["cupy"]
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
        world.nccl_ok = None
