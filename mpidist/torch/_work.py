"""``TorchWork``: a ``torch.distributed.Work`` around mpidist's own Work.

The MPI requests of one operation are driven by exactly one thread at a time
(MPI forbids testing a request from two threads at once): the engine, or a
thread that waits for the operation while the engine is busy elsewhere (which
saves the engine's wake-up latency on the common "start, then wait" pattern).
Whoever finishes the operation first completes its Future; errors (a timeout
naming the ranks that have not arrived, a size mismatch) travel the same way.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from ..backends._cuda_work import CudaWork
from ..errors import DistBackendError
from ._engine import TorchFuture, engine

__all__ = ["TorchWork"]

_ZERO = timedelta(0)


def _seconds(timeout: Any) -> float | None:
    """torch passes ``timedelta(0)`` (kNoTimeout) for "the group's timeout"."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class TorchWork(dist.Work):
    """The handle torch's code gets for one asynchronous operation of the mpidist backend."""

    _record: Any = None  # the profiler's event of this operation, ended when it settles (diagnose/profiler.py)

    def __init__(self, inner: Sequence[Any], outputs: Any, op: str, devices: list[Any] | None = None) -> None:
        super().__init__()
        self._inner = inner  # mpidist Works (more than one for the *_coalesced loops)
        self._outputs = outputs  # what the Future holds: the output tensors, as torch's backends give them
        self._op = op
        self._devices = devices
        self._drive_lock = threading.Lock()  # held by the one thread testing the MPI requests
        self._state = threading.Lock()  # guards _settled and _future
        self._finished = threading.Event()
        self._settled = False
        self._exc: BaseException | None = None
        self._future: TorchFuture | None = None
        self._waited = self._taken = False  # what was asked of it (see __del__)

    def __del__(self) -> None:
        """Python dropped this Work before anyone took its Future: torch's C++ code may still hold it and call
        it later, which needs this Python object (``Engine.hold``), so it is kept (bounded)."""
        if not self._taken:
            try:
                engine.hold(self, self._waited)
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing will call it
                pass

    # -- completion -----------------------------------------------------------------------
    def _run_inner(self, timeout_s: float | None) -> None:
        """Drive every mpidist Work to completion (caller holds the drive lock), then settle.

        A GPU Work's ``wait()`` only orders streams; the Future's value is there once the
        GPU has run the operation, so the host waits for that (``0``: the group's timeout).
        """
        try:
            for w in self._inner:
                w.wait(0 if timeout_s is None and isinstance(w, CudaWork) else timeout_s)
        except BaseException as exc:  # noqa: BLE001 - a timeout or MPI error: the Work fails with it
            self._settle(exc)
        else:
            self._settle(None)

    def _settle(self, exc: BaseException | None) -> None:
        with self._state:
            if self._settled:
                return
            self._settled = True
            self._exc = exc
            future = self._future
            record = self._record
        if record is not None:
            record.end()
        self._finished.set()
        if future is not None:
            _complete(future, self._outputs, exc)

    def _complete_here(self) -> None:
        """Complete the operation in this thread (the engine's queue item, or an inline drive)."""
        if self._settled:
            return
        with self._drive_lock:
            if not self._settled:
                self._run_inner(None)

    def run(self) -> None:
        """The engine's queue item: drive the operation to completion."""
        self._complete_here()

    def _profile_until_done(self, record: Any) -> None:
        """End the profiler's event ``record`` when the operation completes (now, if it has)."""
        with self._state:
            if not self._settled:
                self._record = record
                return
        record.end()

    # -- torch.distributed.Work --------------------------------------------------------------
    def wait(self, timeout: timedelta = _ZERO) -> bool:
        """Block until the operation completes (``timeout``: at most that long, else the group's)."""
        self._waited = True
        engine.waited(self)
        if not self._settled:
            seconds = _seconds(timeout)
            # drive it here unless another thread does; the engine thread always drives (it waits for no one)
            if self._drive_lock.acquire(blocking=engine.here()):
                try:
                    if not self._settled:
                        self._run_inner(seconds)
                finally:
                    self._drive_lock.release()
            elif not self._finished.wait(None if seconds is None else seconds + 2.0):
                raise DistBackendError(f"Work.wait: {self._op} did not complete within the timeout of {seconds:g} s")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """Return True once the operation has finished (tests it if no other thread does)."""
        if not self._settled and self._drive_lock.acquire(blocking=False):
            try:
                if not self._settled and all(w.is_completed() for w in self._inner):
                    errors = [w.exception() for w in self._inner if w.exception() is not None]
                    self._settle(errors[0] if errors else None)
            finally:
                self._drive_lock.release()
        return self._settled

    def is_success(self) -> bool:
        """Return True if the operation completed without error."""
        return self.is_completed() and self._exc is None

    def exception(self) -> BaseException | None:
        """Return the error the operation failed with, or None."""
        return self._exc

    def result(self) -> Any:
        """Return the output tensors."""
        return self._outputs

    def synchronize(self) -> None:
        """Wait for the operation (CPU tensors: the same as ``wait()``)."""
        self.wait()

    def get_future(self) -> TorchFuture:
        """Return a Future completed with the output tensors when the operation completes.

        With a background engine this returns at once (communication overlaps what
        the program does next); without one it completes the operation first.
        """
        self._taken = True
        engine.taken(self)
        with self._state:
            future = self._future
            if future is None:
                future = self._future = TorchFuture(self, self._devices)
                settled = self._settled
            else:
                return future
        if settled:
            _complete(future, self._outputs, self._exc)
        elif not engine.running():
            self._complete_here()
        return future

    def source_rank(self) -> int:
        """For a receive from any rank: the group rank the message came from."""
        self.wait()
        return self._inner[0].source_rank()

    _source_rank = source_rank

    def __repr__(self) -> str:
        state = "pending" if not self._settled else ("failed" if self._exc is not None else "completed")
        return f"<mpidist.torch.TorchWork {self._op} {state}>"


def _complete(future: TorchFuture, value: Any, exc: BaseException | None) -> None:
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
