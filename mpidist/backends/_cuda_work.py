"""``CudaWork``: the handle of an NCCL operation, with torch's CUDA semantics.

A CUDA operation is finished in two senses: *enqueued* (the streams that use its
output have been made to wait for it, so work queued on them afterwards sees the
result) and *completed* (the GPU has run it). As in torch's ProcessGroupNCCL:

* ``wait()`` makes the streams of the call's arrays (the producer's stream, or
  the current stream) wait for the operation's event, and on every call the
  stream current then (torch's ``WorkNCCL::wait``), and returns at once; the
  host blocks only for a barrier, when ``wait(timeout)`` is given a timeout, or
  with ``TORCH_NCCL_BLOCKING_WAIT=1``, and then at most that long (the group's
  timeout by default): past it the communicator is aborted and a
  ``DistBackendError`` raised;
* ``is_completed()`` queries the event: True once the GPU has run the operation;
* ``get_future()`` returns a Future whose value (``result()``, the output arrays)
  is set by ``wait()`` or once the operation completes, whichever comes first;
* the arrays stay referenced until the operation has completed on the GPU, even
  if the Work is dropped (the backend adopts them).
"""

from __future__ import annotations

from typing import Any

from .._validate import timeout_seconds
from ..work import Future, Work

__all__ = ["CudaWork"]


class CudaWork(Work):
    """Handle of an operation on the GPU (see the module docstring); made by the nccl backend."""

    __slots__ = ("_event", "_streams", "_synced", "_host_wait", "_source")

    def __init__(
        self,
        backend: Any,
        op: str,
        seq: int,
        event: Any,
        streams: list[int],
        keep: Any,
        timeout_s: float,
        source: int | None = None,
        host_wait: bool = False,
    ) -> None:
        super().__init__([], None, keep, op, backend, seq, timeout_s)
        self._event = event  # None until a coalescing block ends
        self._streams = streams  # the streams that use the outputs
        self._synced = False  # whether they have been made to wait
        self._host_wait = host_wait  # barrier: wait() blocks the host
        self._source = source

    def __del__(self) -> None:
        if not self._done and self._owner is not None:  # dropped while the GPU may still use its buffers
            try:
                self._owner.adopt(self._event, self._keep)
            except Exception:  # interpreter shutdown: nothing left to protect
                pass

    def _test(self) -> bool:
        if self._event is None:
            return False
        owner = self._owner
        if owner.rt.query(self._event):
            return True
        owner.rt.check_async_error(owner._comm)
        return False

    def is_completed(self) -> bool:
        """Return True once the GPU has run the operation (or it failed)."""
        if not self._done:
            try:
                finished = self._test()
            except Exception as exc:  # NCCL's asynchronous error: the communicator is aborted
                self._fail(self._owner.failed(self._op, self._seq, self._event, self._keep, exc))
                return True
            if finished:
                self._complete()
        return self._done

    def _sync_streams(self) -> None:
        """Make the arrays' streams (once) and the caller's current stream (every call) wait for the event.

        As torch's ``WorkNCCL::wait``: a Work issued on a side stream and waited for on
        another stream orders that one, and each ``wait()`` orders the stream current then.
        """
        if self._event is None:
            raise RuntimeError(
                f"Work.wait: {self._op} was made inside a coalescing block that has not ended; "
                "wait after the block (batch_isend_irecv returns when it has ended)"
            )
        owner = self._owner
        rt = owner.rt
        if not self._synced:
            for s in self._streams:
                rt.wait_event(s, self._event)
            self._synced = True
        current = rt.current_stream(owner.device)
        if current not in self._streams:
            rt.wait_event(current, self._event)

    def _resolve(self) -> None:
        fut = self._future
        if fut is not None and not fut._done:
            if self._exc is not None:
                fut.set_exception(self._exc)
            else:
                fut.set_result(self._outputs)

    def _complete(self) -> None:
        if self._done:
            return
        self._done = True
        self._keep = None
        self._resolve()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is not None:
            return
        self._done = True
        self._exc = exc
        self._keep = None  # the backend keeps the buffers of a failed call (keep_stuck)
        self._resolve()

    def wait(self, timeout: Any = None) -> bool:
        """Make the streams that use the outputs wait for the operation; return True.

        Blocks the host only for a barrier, with ``timeout`` (timedelta or seconds;
        0 means the group's timeout) or with ``TORCH_NCCL_BLOCKING_WAIT=1``, until
        the GPU has run it: past the limit the communicator is aborted and a
        ``DistBackendError`` raised.
        """
        if self._exc is None:
            self._sync_streams()
            owner = self._owner
            if not self._done and (timeout is not None or self._host_wait or owner.blocking_wait):
                limit = timeout_seconds(timeout, "Work.wait", self._timeout)
                try:
                    owner.host_wait(self._op, self._seq, self._event, self._keep, limit)
                except BaseException as exc:
                    self._fail(exc)
                else:
                    self._complete()
            self._resolve()
        if self._exc is not None:
            raise self._exc
        return True

    def synchronize(self) -> None:
        """Make the streams that use the outputs wait for the operation (torch's ``synchronize``)."""
        self.wait()

    def get_future(self) -> Future:
        """Return a Future of ``result()``, completed by ``wait()`` or once the GPU has run the operation."""
        if self._future is None:
            fut = Future()
            fut._drive = (self.wait, self.is_completed)
            self._future = fut
            if self._done or self._synced:
                self._resolve()
        return self._future

    def source_rank(self) -> int:
        """For a receive: the group rank it receives from."""
        if self._source is None:
            raise RuntimeError(f"Work.source_rank: only receives have a source rank, this is {self._op}")
        self.wait()
        return self._source

    _source_rank = source_rank
