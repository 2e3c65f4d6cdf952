"""The progress thread of the torch backend, and the Future it completes.

torch's machinery starts an operation, asks for its Future and chains callbacks
onto it (DDP's reducer, its communication hooks, FSDP), then waits much later,
often from C++. MPI moves data only while someone calls into it, so one thread
per process, the *engine*, drives every asynchronous operation of the torch
backend to completion and then completes its Future. That is what lets DDP's
bucket all-reduces overlap the rest of the backward pass.

Callbacks are the delicate part. A callback may start collectives itself
(PowerSGD's chained all-reduces, which it waits for inside the callback). MPI
needs every rank to start the collectives of a communicator in the same order,
so where and when callbacks run must not depend on timing:

* Callbacks added with :meth:`TorchFuture.then` or ``add_done_callback`` never
  run in the program's thread. They are queued, in program order, behind the
  completion of every operation started before them, and the engine runs the
  queue strictly in order: the k-th callback runs after the same operations
  have completed on every rank, whatever the timing.
* Collectives started *inside* a callback (on the engine thread) go to a second
  communicator of the group (the side lane, see ``backend.py``), so the
  program's own collectives and the callbacks' never interleave on one
  communicator; each lane's order is fixed by program order and queue order.
* The engine never waits for itself: an operation started on the engine thread
  is driven there, inline, when the callback waits for it or chains onto it.

Without ``MPI_THREAD_MULTIPLE`` there is no engine: an operation then completes
when it is waited for or its Future is requested (no overlap), and callbacks
run inline in that thread.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

import torch

__all__ = ["Engine", "TorchFuture", "engine"]

log = logging.getLogger("mpidist")

#: how many Works the engine keeps alive for torch's C++ code (``Engine.hold``): not yet waited for, and waited for
HELD_LIMIT, WAITED_LIMIT = 256, 8


class Engine:
    """The one progress thread of this process (started on the first asynchronous operation)."""

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._queue: collections.deque[Any] = collections.deque()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.ident: int | None = None  # the engine thread's ident, compared on every call
        self.enabled: bool | None = None  # False without MPI_THREAD_MULTIPLE (decided on first use)
        self._held: dict[int, Any] = {}  # id -> Work, oldest first (Engine.hold)
        self._waited: dict[int, Any] = {}  # the same, for Works waited for but whose Future nobody took

    def here(self) -> bool:
        """True when called on the engine thread (inside a callback)."""
        return threading.get_ident() == self.ident

    def running(self) -> bool:
        """True if operations complete in the background (MPI_THREAD_MULTIPLE)."""
        if self.enabled is None:
            from mpi4py import MPI

            self.enabled = MPI.Query_thread() == MPI.THREAD_MULTIPLE
            if not self.enabled:
                log.warning(
                    "mpidist.torch: the MPI library gives less than MPI_THREAD_MULTIPLE, so asynchronous "
                    "operations complete only when waited for (DDP's communication does not overlap backward)"
                )
        return self.enabled

    def hold(self, work: Any, waited: bool) -> None:
        """Keep ``work``, a Python Work that Python dropped before its Future was taken, alive for torch's C++ code.

        torch's C++ code may hold a Work that Python has dropped and call it later:
        DDP's reducer keeps the Work of ``Join``'s notification (under
        ``divide_by_initial_world_size=False``) and calls ``wait()`` then
        ``getFuture()`` on it in the backward pass. Without the Python object,
        pybind11 falls back to c10d's base ``Work::wait``, which never returns, and to
        ``getFuture``, which raises "not implemented". So ``TorchWork.__del__`` brings
        such a Work back here, where it stays until its Future is taken
        (:meth:`taken`). Of those already waited for (``waited``, or :meth:`waited`
        later) only the ``WAITED_LIMIT`` latest stay, of the others the ``HELD_LIMIT``
        latest, so a program that drops Works keeps a bounded number of outputs alive.
        Works that Python still refers to are never here and count against no limit.
        """
        if waited:
            _keep(self._waited, work, WAITED_LIMIT)
        else:
            _keep(self._held, work, HELD_LIMIT)

    def waited(self, work: Any) -> None:
        """``work`` was waited for: its Future may still be asked for at once (the reducer's wait, then getFuture)."""
        if self._held.pop(id(work), None) is not None:
            _keep(self._waited, work, WAITED_LIMIT)

    def taken(self, work: Any) -> None:
        """``work``'s Future was taken: whoever holds that needs nothing more of the Work's Python object."""
        self._held.pop(id(work), None)
        self._waited.pop(id(work), None)

    def submit(self, item: Any) -> None:
        """Queue ``item`` (an object with ``run()``) behind everything queued before it."""
        with self._wake:
            self._queue.append(item)
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="mpidist-progress", daemon=True)
                self._thread.start()
            else:
                self._wake.notify()

    def _loop(self) -> None:
        self.ident = threading.get_ident()
        queue = self._queue
        while True:
            with self._wake:
                while not queue:
                    if self._stop:
                        return
                    self._wake.wait()
                item = queue.popleft()
            try:
                item.run()
            except BaseException:  # noqa: BLE001 - items deliver their errors; never let the thread die
                log.exception("mpidist.torch: an internal error in the progress thread")

    def drain(self) -> None:
        """Stop the thread once everything queued has run (``destroy_process_group``)."""
        with self._wake:
            thread = self._thread
            if thread is None:
                return
            self._stop = True
            self._wake.notify()
        if thread is not threading.current_thread():
            thread.join()
        with self._wake:
            if self._thread is thread:
                self._thread = None
                self.ident = None


def _keep(held: dict[int, Any], work: Any, limit: int) -> None:
    """Add ``work`` to ``held`` (id -> Work, oldest first), dropping the oldest beyond ``limit``."""
    held[id(work)] = work
    if len(held) > limit:
        held.pop(next(iter(held)), None)  # another thread may have removed it meanwhile


#: the process's engine
engine = Engine()


class _Callback:
    """A queued ``then``/``add_done_callback``: run ``fn(parent)`` once ``parent`` is complete."""

    __slots__ = ("parent", "fn", "child")

    def __init__(self, parent: TorchFuture, fn: Callable[[Any], Any], child: TorchFuture | None) -> None:
        self.parent, self.fn, self.child = parent, fn, child

    def run(self) -> None:
        self.parent._drive()
        if not self.parent.done():
            _refuse(self.child)
            return
        _call(self.parent, self.fn, self.child)


def _refuse(child: TorchFuture | None) -> None:
    error = RuntimeError(
        "mpidist.torch: a callback was chained onto a Future that another thread completes later; "
        "chain callbacks in the thread that started the operation"
    )
    if child is not None:
        child.set_exception(error)
    else:
        log.error("%s", error)


def _call(parent: TorchFuture, fn: Callable[[Any], Any], child: TorchFuture | None) -> None:
    try:
        value = fn(parent)
    except BaseException as exc:  # noqa: BLE001 - delivered to the chained Future, as torch does
        if child is not None:
            child.set_exception(exc)
        else:
            log.exception("mpidist.torch: a Future done-callback raised")
        return
    if child is not None:
        child.set_result(value)


class _Failure:
    """The value of a Future completed with an error (``TorchFuture.set_exception``)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise self.error  # torch's C++ code extracts a value's tensors by pickling it

    def __str__(self) -> str:  # quoted by torch where it fails to read a tensor out of it
        return f"{type(self.error).__name__}: {self.error}"

    __repr__ = __str__


def _raise_failure(value: _Failure) -> Any:
    raise value.error


class TorchFuture(torch.futures.Future):
    """A ``torch.futures.Future`` whose callbacks run in a fixed order on the engine thread.

    The Future of an operation is completed by the engine (or by whoever waits
    for the operation first); ``then`` returns another TorchFuture, so a chain
    ``fut.then(a).then(b)`` keeps the ordering rules of the module docstring.
    C++ code that chains onto it directly (DDP's default all-reduce) gets torch's
    own behaviour: its callback runs where the Future is completed.
    """

    def __init__(self, work: Any = None, devices: list[Any] | None = None) -> None:
        super().__init__(devices=devices)
        self._work = work  # the TorchWork that completes this Future, if any
        self._devices = devices

    def _drive(self) -> None:
        """Complete the operation behind this Future in this thread if it is not complete yet."""
        if self._work is not None and not super().done():
            self._work._complete_here()

    def wait(self) -> Any:
        """Block until complete and return the value (raise the error)."""
        if self._work is not None and not super().done():
            try:
                self._work.wait()
            except BaseException:  # noqa: BLE001 - the Future carries the same error
                pass
        return super().wait()

    def set_exception(self, result: BaseException) -> None:
        """Complete with an error: raised to Python readers as torch does, and to C++ readers too.

        torch's ``set_exception`` makes the exception the Future's value, raised by an unwrap
        function that only Python readers call; a C++ reader such as DDP's reducer takes the value
        as the bucket's tensors and, given an exception, indexes an empty list (a segfault in
        torch 2.13). The value here is a ``_Failure``, which raises the error where C++ extracts
        tensors from it (by pickling), so ``loss.backward()`` raises a RuntimeError quoting it
        (with a Python communication hook: torch's "Unable to cast <the error> to Tensor").
        """
        if not isinstance(result, Exception):
            raise AssertionError(f"{result} is of type {type(result)}, not an Exception.")  # torch's check
        super()._set_unwrap_func(_raise_failure)
        self.set_result(_Failure(result))

    def then(self, callback: Callable[[Any], Any]) -> TorchFuture:
        """Return a Future completed with ``callback(self)`` (run on the engine thread, in order)."""
        child = TorchFuture(devices=self._devices)
        self._schedule(callback, child)
        return child

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """Run ``callback(self)`` once complete (on the engine thread, in order)."""
        self._schedule(callback, None)

    def _schedule(self, callback: Callable[[Any], Any], child: TorchFuture | None) -> None:
        if engine.here() or not engine.running():
            # inside a callback (or without an engine): run now, in this thread's order
            self._drive()
            if not super().done():
                _refuse(child)
                return
            _call(self, callback, child)
        else:
            engine.submit(_Callback(self, callback, child))
