"""``Work`` (the handle of an asynchronous operation) and ``Future``.

A Work wraps the MPI requests of one operation. It keeps every buffer the
operation touches referenced until the requests complete, runs the finishing
step (copying staged results back, dividing for AVG) exactly once, and
completes its Future. There is no progress thread: ``is_completed()``,
``wait()``, ``Future.done()`` and ``Future.wait()`` drive MPI's progress, so
poll ``is_completed()`` from a compute loop to overlap communication.

Example (``mpiexec -n 2``)::

    >>> x = np.ones(1 << 20)
    >>> work = dist.all_reduce(x, async_op=True)
    >>> while not work.is_completed():
    ...     do_some_compute()
    >>> fut = work.get_future().then(lambda f: f.value()[0] / 2)
    >>> fut.wait()[0]
    1.0
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Sequence

from ._validate import timeout_seconds
from ._world import world
from .diagnose import stall

__all__ = [
    "Work",
    "Future",
    "chain",
    "poll",
    "poll_slowly",
    "timeout_seconds",
    "SPINS_IDLE_CORES",
    "SPINS_OVERSUBSCRIBED",
    "YIELDS_OVERSUBSCRIBED",
    "NAP_S",
    "oversubscribed",
    "usable_cpus",
]

_perf = time.perf_counter
_yield = os.sched_yield
_sleep = time.sleep
#: Tests made flat out before yielding the CPU. With a core per rank, spinning longer
#: wins (measured on 2 ranks: broadcast 8 B 1.36x raw MPI with 128 spins, 1.5x with 32);
#: with more ranks than cores, yielding early wins (3 ranks on 2 cores: all_reduce 8 B
#: 16 us with 32 spins, 32 us with 128). init_process_group picks one per process.
SPINS_IDLE_CORES = 128
SPINS_OVERSUBSCRIBED = 16
#: With more ranks than cores, yields before a wait naps instead. Under Linux's CFS a yield gives
#: the core away only to a task that has run less, so ranks that keep yielding still take turns
#: with the ranks they wait for; a nap leaves the run queue. Measured interleaved on 2 cores shared
#: with other jobs (load 15-25), 8-byte all_reduce, yielding only / 128 yields then naps: 4 ranks
#: 624-859 / 397-516 us, 8 ranks 931-1084 / 1066-2571 us, 16 ranks 9629 / 5420 us; 8 yields napped
#: too soon at 4 and 8 ranks (898, 1565-2071 us).
YIELDS_OVERSUBSCRIBED = 128
#: The nap asked for (seconds): the kernel's timer slack (50 us by default) makes it ~50-60 us
NAP_S = 1e-6
#: naps between two looks at the clock (and at the stall diagnosis's beat): ~1 ms
_NAPS_PER_CHECK = 16


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, ``os.sched_getaffinity``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def oversubscribed(node_size: int) -> bool:
    """Whether ``node_size`` ranks on this node are more than the CPUs this process may use.

    Then a wait gives its core away soon (:data:`SPINS_OVERSUBSCRIBED` tests, then
    :data:`YIELDS_OVERSUBSCRIBED` yields, then naps); otherwise it spins
    :data:`SPINS_IDLE_CORES` tests and then yields between tests, never sleeping.
    """
    return node_size > usable_cpus()


def poll(
    test: Callable[[], Any], timeout_s: float, spins: int = SPINS_OVERSUBSCRIBED, activity: tuple | None = None
) -> bool:
    """Call ``test()`` until it returns true (then return True) or ``timeout_s`` passes (False).

    Spins ``spins`` tests (latency matters for small messages), then yields the CPU
    between tests so that oversubscribed ranks (more ranks than cores) progress
    as fast as with MPI's own blocking calls. It never sleeps: MPI moves large
    messages forward only while it is tested (sleeping 1 ms between tests made a
    2 GiB all_gather_object take 86 s instead of 2), so a long wait keeps a core
    busy, as MPI_Wait does.

    ``activity`` (group, op, seq) is what this rank reports, while the wait is slow,
    to a rank that timed out and asks (see ``diagnose/stall.py``).
    """
    while not test():
        spins -= 1
        if not spins:
            if activity is None:
                return poll_slowly(test, timeout_s)
            with stall.waiting(*activity):
                return poll_slowly(test, timeout_s, stall.serve)
    return True


def chain(first: Callable[[], None] | None, then: Callable[[], None] | None) -> Callable[[], None] | None:
    """One step that calls ``first`` and then ``then``; either may be None (None if both are)."""
    if first is None or then is None:
        return first or then

    def both() -> None:
        first()
        then()

    return both


def poll_slowly(test: Callable[[], Any], timeout_s: float, idle: Callable[[], None] | None = None) -> bool:
    """The second phase of :func:`poll`: yield between tests; every 64 tests check the clock and call ``idle``.

    On a node with more ranks than cores (``world.init_info.oversubscribed``, set by
    ``init_process_group``; assumed before it) it yields :data:`YIELDS_OVERSUBSCRIBED`
    times, then naps (:data:`NAP_S`) between tests, looking at the clock every ~1 ms.
    """
    deadline = _perf() + timeout_s
    if world.init_info.oversubscribed:
        return _poll_napping(test, deadline, idle)
    while True:
        for _ in range(64):
            if test():
                return True
            _yield()
        if _perf() > deadline:
            return False
        if idle is not None:
            idle()


def _poll_napping(test: Callable[[], Any], deadline: float, idle: Callable[[], None] | None) -> bool:
    """:func:`poll_slowly` with more ranks than cores: a few yields, then a nap between tests.

    A rank that yields stays runnable and, under CFS, gets its core back before the peer it
    waits for has run its share; one that naps leaves the core to them. The clock is read as
    often as before in time (every ~1 ms), so the group's timeout and the stall beats hold.
    """
    for _ in range(YIELDS_OVERSUBSCRIBED):
        if test():
            return True
        _yield()
    while True:
        for _ in range(_NAPS_PER_CHECK):
            if test():
                return True
            _sleep(NAP_S)
        if _perf() > deadline:
            return False
        if idle is not None:
            idle()


class Future:
    """The result of an asynchronous operation, as ``torch.futures.Future``.

    ``then(callback)`` returns a new Future completed with ``callback(self)``'s
    return value (or its exception). Callbacks run in the thread that completes
    the Future: the one calling ``wait()``/``done()`` or ``set_result()``.

    ``Work.get_future()`` returns one completed with the operation's output
    arrays; DDP communication hooks return them. One made directly is completed
    with ``set_result``.

    Args:
        devices: Accepted for torch compatibility; unused.

    Examples:
        >>> fut = dist.Future()
        >>> doubled = fut.then(lambda f: f.value() * 2)
        >>> fut.set_result(21)
        >>> doubled.wait()
        42
    """

    def __init__(self, *, devices: Sequence[Any] | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[Future], None]] = []
        # (wait, poll) of whatever completes this future, when that is not another thread
        self._drive: tuple[Callable[[], Any], Callable[[], Any]] | None = None

    def done(self) -> bool:
        """Return True if the result (or an exception) is set; polls the operation.

        Returns:
            True once completed, with a value or an exception.

        Examples:
            >>> fut = dist.all_reduce(np.ones(2), async_op=True).get_future()
            >>> while not fut.done():
            ...     pass  # compute here
        """
        if not self._done and self._drive is not None:
            self._drive[1]()
        return self._done

    def wait(self) -> Any:
        """Block until completed and return the value, or raise its exception.

        Returns:
            The value: for a Work's future, the list of output arrays.

        Raises:
            Exception: the exception the Future was completed with, such as the
                operation's ``DistBackendError``.

        Examples:
            >>> x = np.ones(2)
            >>> dist.all_reduce(x, async_op=True).get_future().wait()
            [array([2., 2.])]  # rank 0 and rank 1
        """
        if not self._done:
            if self._drive is not None:
                try:
                    self._drive[0]()
                except BaseException as exc:  # the operation's error completes us too
                    if not self._done:
                        self.set_exception(exc)
            with self._cond:
                while not self._done:
                    self._cond.wait()
        if self._exc is not None:
            raise self._exc
        return self._value

    def value(self) -> Any:
        """Return the value of a completed Future (raise its exception if it failed).

        Returns:
            The value.

        Raises:
            RuntimeError: the Future has not completed.
            Exception: the exception it was completed with.

        Examples:
            >>> fut = dist.Future()
            >>> fut.set_result([1, 2])
            >>> fut.value()
            [1, 2]
        """
        if not self._done:
            raise RuntimeError("Future.value: not completed yet; call wait() first or use then()")
        if self._exc is not None:
            raise self._exc
        return self._value

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """Return a Future that completes with ``callback(self)`` once this one completes.

        The callback runs in the thread that completes this Future; if it raises,
        the new Future completes with that exception.

        Args:
            callback: Called with this Future once it is complete; its return
                value is the new Future's value.

        Returns:
            The new Future.

        Examples:
            >>> work = dist.all_reduce(np.ones(2), async_op=True)
            >>> fut = work.get_future().then(lambda f: f.value()[0] / 2)
            >>> fut.wait()
            array([1., 1.])  # rank 0 and rank 1
        """
        child = Future()
        child._drive = (self.wait, self.done)

        def run(parent: Future) -> None:
            try:
                result = callback(parent)
            except BaseException as exc:
                child.set_exception(exc)
            else:
                child.set_result(result)

        self.add_done_callback(run)
        return child

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        """Run ``callback(self)`` when completed (now, if already completed).

        Args:
            callback: Called with this Future; its return value is ignored.

        Examples:
            >>> fut = dist.Future()
            >>> fut.add_done_callback(lambda f: print("got", f.value()))
            >>> fut.set_result(3)
            got 3
        """
        with self._cond:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def set_result(self, result: Any) -> None:
        """Complete the Future with ``result``.

        Args:
            result: The value; ``wait()`` and ``value()`` return it.

        Raises:
            RuntimeError: the Future is already completed.

        Examples:
            >>> fut = dist.Future()
            >>> fut.set_result("ok")
            >>> fut.wait()
            'ok'
        """
        self._finish(result, None)

    def set_exception(self, result: BaseException) -> None:
        """Complete the Future with an exception (raised by ``wait()`` and ``value()``).

        Args:
            result: The exception.

        Raises:
            TypeError: ``result`` is not an exception.
            RuntimeError: the Future is already completed.

        Examples:
            >>> fut = dist.Future()
            >>> fut.set_exception(ValueError("bad input"))
            >>> fut.wait()
            Traceback (most recent call last):
            ValueError: bad input
        """
        if not isinstance(result, BaseException):
            raise TypeError(f"Future.set_exception: expected an exception, got {type(result).__name__}")
        self._finish(None, result)

    def _finish(self, value: Any, exc: BaseException | None) -> None:
        with self._cond:
            if self._done:
                raise RuntimeError("Future: result already set; a Future completes once")
            self._value, self._exc, self._done = value, exc, True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for cb in callbacks:
            cb(self)

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("failed" if self._exc is not None else "done")
        return f"<mpidist.Future {state}>"


class _WorkKind(type):
    """Work's metaclass: the lighter Work that ``isend``/``irecv`` of a numpy array return where the C calls
    are bound (``backends/_direct_posted.c``, not a Python class) is a Work to ``isinstance`` too."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj) or (cls is Work and _made_in_c(type(obj)))

    def __subclasscheck__(cls, sub: type) -> bool:
        return type.__subclasscheck__(cls, sub) or (cls is Work and _made_in_c(sub))


def _made_in_c(kind: type) -> bool:
    """Whether ``kind`` is the C module's Work type (``_direct.Posted``)."""
    direct = world.direct
    return direct is not None and direct.module is not None and kind is direct.module.Posted


class Work(metaclass=_WorkKind):
    """Handle of an operation started with ``async_op=True`` (or ``isend``/``irecv``).

    Created by backends; users call ``wait``, ``is_completed``, ``get_future``, ...

    It keeps the operation's arrays referenced until it completes. There is no
    progress thread: ``is_completed()`` and ``wait()`` drive MPI's progress, so
    poll ``is_completed()`` from a compute loop to overlap communication.

    Examples:
        >>> x = np.ones(1 << 20)
        >>> work = dist.all_reduce(x, async_op=True)
        >>> while not work.is_completed():
        ...     pass  # compute here
        >>> work.is_success(), x[:3]
        (True, array([2., 2., 2.]))  # rank 0 and rank 1
    """

    __slots__ = (
        "_reqs", "_post", "_keep", "_done", "_exc", "_outputs", "_op",
        "_owner", "_seq", "_future", "_status", "_timeout",
    )  # fmt: skip

    def __init__(
        self,
        reqs: list[Any],
        post: Callable[[], None] | None,
        keep: Any,
        op: str,
        owner: Any,
        seq: int,
        timeout_s: float,
        status: Any = None,
    ) -> None:
        self._reqs = reqs
        self._post = post
        self._keep = keep  # buffers MPI uses until completion
        self._done = False
        self._exc: BaseException | None = None
        self._outputs: list[Any] = []
        self._op = op
        self._owner = owner  # the backend: builds timeout errors, keeps stuck requests
        self._seq = seq
        self._future: Future | None = None
        self._status = status
        self._timeout = timeout_s

    def with_outputs(self, outputs: list[Any]) -> Work:
        """Name the arrays :meth:`result` and the Future give: the caller's own objects; return this Work.

        A backend makes the Work from the buffers it was handed (a torch tensor's numpy
        view, a staged copy); the public function that called it knows the arrays the
        caller passed and hands them over here, once, before returning the Work.
        """
        self._outputs = outputs
        return self

    def __del__(self) -> None:
        if not self._done and self._owner is not None:  # dropped while MPI still uses its buffers
            try:
                self._owner.adopt(self._reqs, self._keep)
            except Exception:  # interpreter shutdown: nothing left to protect
                pass

    def _test(self) -> bool:
        reqs = self._reqs
        if len(reqs) == 1:
            if self._status is not None:
                return reqs[0].Test(self._status)
            return reqs[0].Test()
        return reqs[0].Testall(reqs)

    def _wait_test(self) -> Callable[[], bool]:
        """What ``wait`` polls: ``_test``, or the one request's ``spin`` where it has one (the shared-memory
        path's operation, which waits in C between tests); where the owner's group has other operations queued
        on a path of its own (``MPIBackend.advancing``), each test advances them too."""
        reqs = self._reqs
        test = getattr(reqs[0], "spin", self._test) if len(reqs) == 1 and self._status is None else self._test
        path = getattr(self._owner, "_shm", None)  # the MPI backend's path: its other operations move too
        if path is None or not path.queue:
            return test
        return self._owner.advancing(test, reqs[-1] if reqs else None)

    def _first_test(self) -> bool:
        """The first test of ``wait``: one ``_test`` (a subclass may test longer, in C, before the poll)."""
        return self._test()

    def is_completed(self) -> bool:
        """Return True once the operation has finished; each call makes MPI progress.

        Returns:
            True once the operation has completed or failed (``exception()`` says
            which); False while it is going. It never waits.

        Examples:
            >>> work = dist.all_reduce(np.ones(1 << 16), async_op=True)
            >>> while not work.is_completed():
            ...     pass  # compute here
        """
        if not self._done:
            try:
                finished = self._test()
            except Exception as exc:
                self._fail(self._owner.backend_error(self._op, self._seq, exc))
                return True
            if finished:
                self._complete()
        return self._done

    def act_as(self, owner: Any, op: str, seq: int) -> None:
        """Wait, report and fail as call ``op`` (number ``seq``) of ``owner``: a Work of library traffic
        that a rank waits in on behalf of a user's call (DETAIL's check of that call, ``diagnose.debug``)."""
        self._owner, self._op, self._seq = owner, op, seq

    def default_timeout(self, timeout_s: float) -> None:
        """Make ``timeout_s`` (seconds, already checked) the limit of a ``wait()`` given no timeout of its own.

        ``barrier(timeout=..., async_op=True)`` sets it on the Work it returns.
        """
        self._timeout = timeout_s

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation completes; return True.

        ``timeout`` (timedelta or seconds; None or 0 means the group's timeout, or
        the one given to ``barrier``) bounds the wait: past it a ``DistBackendError``
        is raised.

        Args:
            timeout: This wait's limit, a ``datetime.timedelta`` or seconds.

        Returns:
            True; the outputs hold the results.

        Raises:
            DistBackendError: the operation did not complete within the timeout
                (the message names the ranks that have not arrived), or MPI failed.
            ValueError: a received message had another size than the array, or
                ``timeout`` is negative or NaN.
            TypeError: ``timeout`` is neither a timedelta nor a number.

        Examples:
            >>> x = np.ones(2)
            >>> work = dist.all_reduce(x, async_op=True)
            >>> work.wait(timeout=60)
            True
            >>> x
            array([2., 2.])  # rank 0 and rank 1
        """
        if not self._done:
            limit = self._timeout if timeout is None else timeout_seconds(timeout, "Work.wait", self._timeout)
            try:  # one test first (a small operation is often complete), as poll would; else poll
                finished = self._first_test()
                if not finished:
                    owner = self._owner
                    activity = (getattr(owner, "group_name", "?"), self._op, self._seq)
                    finished = poll(self._wait_test(), limit, getattr(owner, "spins", SPINS_OVERSUBSCRIBED), activity)
            except Exception as exc:
                self._fail(self._owner.backend_error(self._op, self._seq, exc))
            else:
                if finished:
                    self._complete()
                else:
                    self._expired(limit)
        if self._exc is not None:
            raise self._exc
        return True

    def _expired(self, limit: float) -> None:
        """``wait`` ran out of time: keep the buffers for good (MPI may still write into them) and fail.

        A receive on MPI overrides this: MPI can cancel a receive that no message has matched yet.
        """
        self._owner.keep_stuck(self._reqs, self._keep)
        self._fail(self._owner.timeout_failure(self._op, self._seq, limit))

    def _complete(self) -> None:
        if self._done:
            return
        try:
            if self._post is not None:
                self._post()
        except Exception as exc:
            self._fail(exc)
            return
        self._done = True
        self._keep = None
        if self._future is not None:
            self._future.set_result(self._outputs)

    def _fail(self, exc: BaseException) -> None:
        if self._done:
            return
        self._done = True
        self._exc = exc
        if self._future is not None:
            self._future.set_exception(exc)

    def is_success(self) -> bool:
        """Return True if the operation completed without error.

        Returns:
            True once completed successfully; False while running or after a
            failure. It tests once, as ``is_completed()`` does.

        Examples:
            >>> work = dist.all_reduce(np.ones(2), async_op=True)
            >>> work.wait()
            True
            >>> work.is_success()
            True
        """
        return self.is_completed() and self._exc is None

    def exception(self) -> BaseException | None:
        """Return the error the operation failed with, or None.

        Returns:
            The exception (a ``DistBackendError`` for a timeout or an MPI
            failure), or None if it has not failed (yet).

        Examples:
            >>> work = dist.all_reduce(np.ones(2), async_op=True)
            >>> work.wait()
            True
            >>> work.exception() is None
            True
        """
        return self._exc

    def result(self) -> list[Any]:
        """Return the output arrays of the operation (after ``wait()``).

        Returns:
            A list of the arrays the operation wrote (for ``all_gather``, the
            arrays of ``tensor_list``).

        Examples:
            >>> x = np.ones(2)
            >>> work = dist.all_reduce(x, async_op=True)
            >>> work.wait()
            True
            >>> work.result()[0] is x
            True
        """
        return self._outputs

    def get_future(self) -> Future:
        """Return a Future completed with ``result()`` when the operation completes.

        Returns:
            The same ``Future`` on every call; it fails with the operation's error.

        Examples:
            >>> fut = dist.all_reduce(np.ones(2), async_op=True).get_future()
            >>> fut.wait()
            [array([2., 2.])]  # rank 0 and rank 1
        """
        if self._future is None:
            fut = Future()
            fut._drive = (self.wait, self.is_completed)
            self._future = fut
            if self._done:
                if self._exc is not None:
                    fut.set_exception(self._exc)
                else:
                    fut.set_result(self._outputs)
        return self._future

    def synchronize(self) -> None:
        """Same as ``wait()`` for host arrays.

        Raises:
            DistBackendError: as ``wait()``.

        Examples:
            >>> dist.all_reduce(np.ones(2), async_op=True).synchronize()
        """
        self.wait()

    def source_rank(self) -> int:
        """For a receive: the group rank the message came from.

        It waits for the receive first.

        Returns:
            The sender's rank in the group of the receive.

        Raises:
            RuntimeError: the Work is not a receive's.
            DistBackendError: as ``wait()``.

        Examples:
            >>> x = np.zeros(1)
            >>> if dist.get_rank() == 0:
            ...     dist.irecv(x).source_rank()
            ... else:
            ...     dist.send(np.ones(1), dst=0)
            1  # rank 0
        """
        if self._status is None:
            raise RuntimeError(f"Work.source_rank: only receives have a source rank, this is {self._op}")
        self.wait()
        return self._status.Get_source()

    _source_rank = source_rank

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("failed" if self._exc is not None else "completed")
        return f"<mpidist.Work {self._op} #{self._seq} {state}>"
