"""Persistent operations: a collective (or send/receive) made once and run many times, as MPI-4's ``*_init``.

Beyond torch.distributed's API. An iterative solver, a training loop on small
tensors or a parameter server repeats the same collective on the same arrays
thousands of times; a persistent operation binds it to those arrays once and
then only starts it::

    p = dist.all_reduce_init(x, op=dist.ReduceOp.SUM)   # collective: every rank, same order
    for step in range(n):
        x[:] = local_value(step)
        p.start().wait()                                # x holds the sum
    p.free()                                            # or: with dist.all_reduce_init(x) as p: ...

``<collective>_init`` takes the one-off call's parameters minus ``async_op`` and
returns a :class:`Persistent` (None on ranks outside ``group``). Each run reads the
arrays' contents at ``start()`` and writes results into them by the end of
``wait()``. On the MPI backend the operation is an MPI-4 persistent request
(``MPI_Allreduce_init``, ``MPI_Bcast_init``, ...) bound to the caller's memory;
where the MPI library lacks them, and on backends without persistent requests
(NCCL, device arrays over MPI), each start is the one-off nonblocking call, with
the same API and results. See docs/persistent.md.
"""

from __future__ import annotations

from typing import Any, Callable

from ._args import (
    all_to_all_counts,
    check_block_shapes,
    check_dtype,
    gathered_size_error,
    scattered_size_error,
    tag_value,
)
from ._validate import timeout_seconds
from ._world import world
from .arrays.host import DTYPES, copy_in, prepare_inout, prepare_output, prepare_source
from .backends.base import PersistentPlan
from .errors import DistBackendError
from .process_group import ProcessGroup, absent, resolve_group
from .reduce_op import ReduceOp, check_op
from .work import chain, poll

__all__ = [
    "Persistent",
    "broadcast_init",
    "all_reduce_init",
    "reduce_init",
    "all_gather_into_tensor_init",
    "reduce_scatter_tensor_init",
    "all_to_all_single_init",
    "send_init",
    "recv_init",
]

# the states of a Persistent: made, never started (start() takes the checked path once); between runs;
# running; freed; failed (timed out or MPI failed: it cannot run again)
_NEW, _IDLE, _ACTIVE, _FREED, _FAILED = -1, 0, 1, 2, 3
_STATE_NAMES = {_NEW: "new", _IDLE: "idle", _ACTIVE: "active", _FREED: "freed", _FAILED: "failed"}


class Persistent:
    """A persistent operation: made by a ``*_init`` function, run with ``start()`` and ``wait()``.

    * ``start()`` starts a run and returns the operation (``p.start().wait()``). It
      reads the input arrays as they are now. A collective's start is collective: every
      rank of the group starts its operation, in the same order as the others start theirs.
    * ``wait(timeout=None)`` blocks until the run completes and returns True; the
      outputs then hold the results. Bounded by the group's timeout (``timeout``:
      a timedelta or seconds overrides it); past it, ``DistBackendError`` as for
      ``Work.wait``, and the operation cannot be started again.
    * ``is_completed()`` tests once (driving MPI's progress); True once the run has
      completed (its results written).
    * ``free()`` releases the operation (``MPI_Request_free``) and its arrays; a later
      ``start()`` raises RuntimeError. Freeing a running operation raises RuntimeError.
      Used as a context manager, the operation is freed on exit (after waiting for a
      run still going, unless an exception is on its way out).

    The arrays stay referenced as long as the operation exists. Starting a running
    operation, and ``wait()`` before the first ``start()``, raise RuntimeError.

    Examples:
        >>> x = np.ones(3)
        >>> with dist.all_reduce_init(x) as p:
        ...     for step in range(2):
        ...         x[:] = step
        ...         _ = p.start().wait()
        >>> x
        array([2., 2., 2.])  # rank 0 and rank 1
    """

    __slots__ = ("_go", "_test", "_post", "_state", "_plan", "_arrays", "_exc", "_stuck", "_pg", "_gone",
                 "__weakref__")  # fmt: skip

    def __init__(self, pg: ProcessGroup, plan: PersistentPlan, fills: Any, arrays: tuple) -> None:
        self._plan = plan
        self._pg = pg
        self._arrays = arrays  # the caller's arrays (and staged copies), referenced while the operation exists
        self._exc: BaseException | None = None
        self._stuck = False  # a run that failed may still be going inside MPI: never free its request
        self._gone = ""  # why it was freed, when not by free()
        self._state = _NEW
        self._go = self._starter(chain(_copy_ins(fills), plan.pre))
        self._test = plan.test
        self._post = plan.post

    def _starter(self, pre: Callable[[], None] | None) -> Callable[[], Any]:
        """What one start does: the staging copies, then ``MPI_Start``."""
        start = self._plan.req.Start
        if pre is None:
            return start

        def go() -> None:
            pre()
            start()

        return go

    # -- the hot path: start() and wait() of a run that needs nothing else ----------------------
    def start(self) -> Persistent:
        """Start a run; return the operation. Collective for collectives (see the class docstring).

        Returns:
            The operation itself, so that ``p.start().wait()`` reads as one step.

        Raises:
            RuntimeError: the operation is running (``wait()`` first), has been
                freed, or failed earlier.
            DistError: its group refuses calls on this rank (an earlier call failed
                on this rank alone).
            DistBackendError: MPI failed to start it (it cannot run again).

        Examples:
            >>> x = np.full(2, float(dist.get_rank()))
            >>> p = dist.all_reduce_init(x)
            >>> p.start().wait()
            True
            >>> x
            array([1., 1.])  # rank 0 and rank 1
        """
        if self._state or world.debug_level:  # not between runs, or traced: the checked path
            return self._start_checked()
        try:
            self._go()
        except Exception as exc:
            raise self._start_failed(exc) from exc
        self._state = _ACTIVE
        return self

    def wait(self, timeout: Any = None) -> bool:
        """Block until the run completes (within the group's timeout, or ``timeout``); return True.

        Args:
            timeout: This wait's limit, a ``datetime.timedelta`` or seconds; None
                means the group's timeout.

        Returns:
            True; the outputs hold the run's results.

        Raises:
            RuntimeError: the operation has not been started or has been freed.
            TypeError: ``timeout`` is neither a timedelta nor a number.
            ValueError: ``timeout`` is negative or NaN; for a receive, the message
                had another size than the array.
            DistBackendError: the run did not complete within the timeout (the
                operation cannot run again: free it), or MPI failed.

        Examples:
            >>> x = np.ones(2)
            >>> p = dist.all_reduce_init(x).start()
            >>> p.wait(timeout=60)
            True
        """
        if self._state != _ACTIVE or timeout is not None:
            return self._wait_checked(timeout)
        try:
            done = self._test()
        except Exception as exc:
            raise self._broken(exc) from exc
        if not done:
            return self._wait_long(self._plan.timeout_s)
        self._state = _IDLE
        post = self._post
        if post is not None:
            post()
        return True

    def is_completed(self) -> bool:
        """Test the run once (MPI progresses); True once it has completed and its results are written.

        True as well after a failure (``wait()`` raises its error). Before the first
        start and after ``free()``: RuntimeError.

        Returns:
            True once the run has completed (or failed), False while it is going;
            True between runs.

        Raises:
            RuntimeError: the operation has not been started or has been freed.

        Examples:
            >>> x = np.ones(1 << 16)
            >>> p = dist.all_reduce_init(x).start()
            >>> while not p.is_completed():
            ...     pass  # compute here
            >>> x[:2]
            array([2., 2.])  # rank 0 and rank 1
        """
        if self._state != _ACTIVE:
            self._refuse_inactive("is_completed")
            return True
        try:
            done = self._test()
        except Exception as exc:
            self._exc = self._broken(exc)
            return True
        if done:
            self._finish()
        return bool(done)

    # -- the rest -------------------------------------------------------------------------
    def _start_checked(self) -> Persistent:
        state = self._state
        if state == _ACTIVE:
            raise RuntimeError(
                f"Persistent.start: {self._label()} is already running (started and not waited for); "
                "call wait() before starting it again"
            )
        if state != _NEW and state != _IDLE:
            self._refuse_inactive("start")
        plan = self._plan
        if world.debug_level and plan.debug is not None:
            plan.debug.start_persistent(plan, self._launch)
        else:
            self._launch()
        return self

    def _launch(self) -> None:
        try:
            self._go()
        except Exception as exc:
            raise self._start_failed(exc) from exc
        self._state = _ACTIVE

    def _start_failed(self, exc: Exception) -> Exception:
        """An MPI error of ``MPI_Start`` fails the operation; an error of the staging step leaves it as it was."""
        if type(exc).__module__.startswith("mpi4py"):
            return self._broken(exc)
        return exc

    def _wait_checked(self, timeout: Any) -> bool:
        state = self._state
        if state != _ACTIVE:
            self._refuse_inactive("wait")
            timeout_seconds(timeout, "Persistent.wait", self._plan.timeout_s)  # a bad value raises all the same
            return True
        limit = timeout_seconds(timeout, "Persistent.wait", self._plan.timeout_s)
        try:
            done = self._test()
        except Exception as exc:
            raise self._broken(exc) from exc
        if not done:
            return self._wait_long(limit)
        return self._finish()

    def _wait_long(self, limit: float) -> bool:
        """The polling wait of ``work.poll`` (what the other ranks see as "waiting in persistent ...")."""
        plan = self._plan
        owner = plan.owner
        try:
            done = poll(self._test, limit, owner.spins, (owner.group_name, plan.op, plan.seq))
        except Exception as exc:
            raise self._broken(exc) from exc
        if not done:
            self._expired(limit)
        return self._finish()

    def _finish(self) -> bool:
        self._state = _IDLE
        post = self._post
        if post is not None:
            post()
        return True

    def _expired(self, limit: float) -> None:
        """The run did not complete within ``limit``: raise the backend's timeout error (unless a receive's
        message arrived while it was being cancelled: then it returns, and the run completes)."""
        plan = self._plan
        owner = plan.owner
        outcome = plan.cancel(limit) if plan.cancel is not None else None
        if outcome is False:
            return
        self._state = _FAILED
        if outcome:
            note = "The receive was cancelled: the next message goes to the next receive."
            self._exc = owner.timeout_failure(plan.op, plan.seq, limit, note, settled=True)
        else:
            self._stuck = True
            owner.keep_stuck([plan.req], (plan.keep, self._arrays))
            self._exc = owner.timeout_failure(plan.op, plan.seq, limit)
        raise self._exc

    def _broken(self, exc: Exception) -> DistBackendError:
        """MPI failed a start or a test: the operation fails for good; its buffers are kept (MPI may hold them)."""
        plan = self._plan
        self._state = _FAILED
        if not self._stuck:
            self._stuck = True
            plan.owner.keep_stuck([plan.req], (plan.keep, self._arrays))
        self._exc = plan.owner.backend_error(plan.op, plan.seq, exc)
        return self._exc

    def _refuse_inactive(self, what: str) -> None:
        """Raise what ``what`` raises outside a run: nothing between runs; RuntimeError before any start or after
        free(); a failed operation's error."""
        state = self._state
        if state == _IDLE:
            return
        if state == _FAILED and what != "start":
            if what == "wait":
                raise self._exc  # type: ignore[misc]
            return
        if state == _NEW:
            if what == "start":
                return
            raise RuntimeError(f"Persistent.{what}: {self._label()} has not been started; call start() first")
        if state == _FREED:
            why = f" ({self._gone})" if self._gone else ""
            raise RuntimeError(
                f"Persistent.{what}: {self._label()} has been freed{why}; make a new one with "
                f"{self._plan.text.split()[0]}"
            )
        raise RuntimeError(
            f"Persistent.start: {self._label()} failed and cannot be started again ({self._exc}); free it"
        )

    def free(self) -> None:
        """Release the operation and its arrays (``MPI_Request_free``); freeing twice does nothing.

        Raises RuntimeError while a run is going (MPI cannot free a running
        collective): ``wait()`` for it first.

        Raises:
            RuntimeError: a run is going.

        Examples:
            >>> p = dist.all_reduce_init(np.ones(2))
            >>> p.free()
            >>> p.start()
            Traceback (most recent call last):
            RuntimeError: Persistent.start: all_reduce_init float64[2] op=SUM (call #... on group 0) has been freed; make a new one with all_reduce_init
        """
        if self._state == _ACTIVE:
            raise RuntimeError(
                f"Persistent.free: {self._label()} is running (started and not waited for); call wait() first"
            )
        self._release()

    def _release(self) -> None:
        if self._state == _FREED:
            return
        plan = self._plan
        self._state = _FREED
        if not self._stuck:
            if plan.release is not None:
                plan.release()
            plan.keep = None
        self._arrays = ()
        self._go = self._test = self._post = _gone  # type: ignore[assignment]
        self._pg.persistent.discard(self)

    def _abandon(self) -> None:
        """Leave a running operation behind (an exception is on its way out): MPI keeps its buffers until done."""
        plan = self._plan
        self._stuck = True
        self._state = _FAILED
        plan.owner.adopt([plan.req], (plan.keep, self._arrays))

    def _group_destroyed(self) -> None:
        """``destroy_process_group`` of its group: freed (left behind if running)."""
        if self._state == _ACTIVE:
            self._abandon()
        self._release()
        self._gone = "its process group was destroyed"

    def _group_refused(self, refuse: Callable[[], None]) -> None:
        """Its group refuses every call on this rank (``ProcessGroup.failed_alone``): so does every later start.

        ``refuse`` raises the group's DistError; it takes the place of the MPI start, so the
        fast path of ``start()`` raises it too, at no cost to a group that never refuses.
        """
        if self._state != _FREED:
            self._go = refuse

    def __enter__(self) -> Persistent:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._state == _ACTIVE:
            if exc_type is None:
                self.wait()
            else:
                self._abandon()
        self._release()

    def __del__(self) -> None:
        try:
            state = self._state
            if state == _ACTIVE:
                self._abandon()
            elif state != _FREED and not self._stuck and self._plan.release is not None:
                self._plan.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to protect
            pass

    def _label(self) -> str:
        plan = self._plan
        number = f"p2p#{plan.seq}" if plan.p2p else f"call #{plan.seq}"
        return f"{plan.text} ({number} on group {plan.owner.group_name or '?'})"

    def __repr__(self) -> str:
        return f"<mpidist.Persistent {self._label()} {_STATE_NAMES[self._state]}>"


class _NonblockingPersistent(Persistent):
    """A persistent operation whose every run is the backend's nonblocking call (``PersistentPlan.begin``).

    The fallback where the backend has no persistent requests: the same API; each
    run's wait is the Work's, with its timeout and errors.
    """

    __slots__ = ("_work",)

    def _starter(self, pre: Callable[[], None] | None) -> Callable[[], Any]:
        begin = self._plan.begin
        self._work: Any = None

        def go() -> None:
            if pre is not None:
                pre()
            self._work = begin()  # type: ignore[misc]

        return go

    def wait(self, timeout: Any = None) -> bool:
        if self._state != _ACTIVE:
            return self._wait_checked(timeout)
        work, self._work = self._work, None
        try:
            work.wait(timeout)
        except DistBackendError as exc:  # timed out, or the library failed: it cannot run again
            self._state, self._exc, self._stuck = _FAILED, exc, True
            raise
        except BaseException:
            self._work = work if work._exc is None else None  # a bad timeout argument: still running
            if self._work is None:
                self._state = _IDLE  # the run ended with an error of its own (a receive of another size)
            raise
        self._state = _IDLE
        return True

    def is_completed(self) -> bool:
        if self._state != _ACTIVE:
            self._refuse_inactive("is_completed")
            return True
        if not self._work.is_completed():
            return False
        try:
            self.wait()
        except DistBackendError:
            pass  # wait() raises it again
        return True

    def _abandon(self) -> None:
        self._stuck = True
        self._state = _FAILED
        self._work = None  # a Work dropped while running hands its buffers to its backend


def _gone() -> None:
    raise RuntimeError("Persistent: this operation has been freed")


def _copy_ins(fills: list[tuple[Any, Any]] | None) -> Callable[[], None] | None:
    """The copies of staged inputs from the caller's arrays, made before each start (None if none)."""
    if not fills:
        return None

    def fill() -> None:
        for buf, source in fills:
            copy_in(buf, source)

    return fill


def _made(pg: ProcessGroup, plan: PersistentPlan, fills: Any, arrays: tuple) -> Persistent:
    cls = Persistent if plan.req is not None else _NonblockingPersistent
    p = cls(pg, plan, fills, arrays)
    pg.persistent.add(p)
    return p


def _staged(buf: Any, target: Any) -> list[tuple[Any, Any]] | None:
    return None if target is None else [(buf, target)]


# -- the collectives ------------------------------------------------------------------------------
def broadcast_init(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, group_src: int | None = None
) -> Persistent | None:
    """Make a persistent ``broadcast`` of ``tensor`` from rank ``src`` (global; or ``group_src``).

    Collective: every rank of the group makes it, in the same order as its other
    ``*_init`` calls and collectives. Each ``start()`` sends the root's current
    values; after ``wait()`` every rank's ``tensor`` holds them.

    Args:
        tensor: On ``src``, the data each run sends; elsewhere, the array that
            receives it.
        src: The sending rank, as a global rank. Give ``src`` or ``group_src``.
        group: The group; None is the default group. On ranks outside it nothing
            is made and None is returned.
        group_src: The sending rank as a rank of ``group``, instead of ``src``.

    Returns:
        A ``Persistent`` to run with ``start()`` and ``wait()``; None on ranks
        outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, or a rank or
            ``group`` has the wrong type.
        ValueError: neither or both of ``src`` and ``group_src`` are given, or a
            receiving ``tensor`` is read-only.
        RankNotInGroupError: ``src`` is not a member of ``group``.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: MPI failed to make the operation.

    Examples:
        >>> x = np.zeros(3)
        >>> with dist.broadcast_init(x, src=0) as p:
        ...     for step in range(3):
        ...         if dist.get_rank() == 0:
        ...             x[:] = step
        ...         _ = p.start().wait()
        >>> x
        array([2., 2., 2.])  # rank 0 and rank 1
    """
    fn = "broadcast_init"
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    root = pg.root_rank(src, group_src, fn, ("src", "group_src"))
    if pg.rank() == root:
        buf, source = prepare_source(tensor, fn, "tensor")
        fills, backs = _staged(buf, source), None
    else:
        buf, target = prepare_output(tensor, fn, "tensor")
        fills, backs = None, _staged(buf, target)
    return _made(pg, pg.broadcast_init(buf, backs, root), fills, (tensor, buf))


def all_reduce_init(tensor: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None) -> Persistent | None:
    """Make a persistent in-place ``all_reduce`` of ``tensor``.

    Collective: every rank of the group makes it, in the same order as its other
    ``*_init`` calls and collectives. Each ``start()`` reduces what ``tensor`` holds
    then; after ``wait()`` it holds the result on every rank.

    Args:
        tensor: Each rank's input, overwritten with the result by every run.
        op: How to combine: a ``ReduceOp`` or an op from ``make_premul_sum`` (see
            ``all_reduce``).
        group: The group; None is the default group. On ranks outside it nothing
            is made and None is returned.

    Returns:
        A ``Persistent`` to run with ``start()`` and ``wait()``; None on ranks
        outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, ``op`` is not
            a reduction, or ``group`` has the wrong type.
        ValueError: ``op`` is not defined for the dtype, or ``tensor`` is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: MPI failed to make the operation.

    Examples:
        >>> x = np.zeros(2)
        >>> p = dist.all_reduce_init(x, op=dist.ReduceOp.SUM)
        >>> for step in range(3):
        ...     x[:] = dist.get_rank() + step
        ...     _ = p.start().wait()
        >>> x
        array([5., 5.])  # rank 0 and rank 1: (0 + 2) + (1 + 2)
        >>> p.free()
    """
    fn = "all_reduce_init"
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    buf, target = prepare_inout(tensor, fn, "tensor")
    check_op(op, DTYPES[buf.dtype], fn)
    staged = _staged(buf, target)
    return _made(pg, pg.all_reduce_init(buf, staged, op), staged, (tensor, buf))


def reduce_init(
    tensor: Any,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    group_dst: int | None = None,
) -> Persistent | None:
    """Make a persistent ``reduce`` of ``tensor`` onto rank ``dst`` (global; or ``group_dst``).

    Collective, made by every rank in the same order. After each ``wait()`` the
    destination's ``tensor`` holds the reduction of what every rank's held at its
    ``start()``; the other ranks' arrays are left unchanged.

    Args:
        tensor: Each rank's input; on ``dst`` overwritten with the result.
        dst: The rank that gets the result, as a global rank. Give ``dst`` or
            ``group_dst``.
        op: How to combine: a ``ReduceOp`` or an op from ``make_premul_sum`` (see
            ``all_reduce``).
        group: The group; None is the default group. On ranks outside it nothing
            is made and None is returned.
        group_dst: The rank that gets the result as a rank of ``group``.

    Returns:
        A ``Persistent`` to run with ``start()`` and ``wait()``; None on ranks
        outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, ``op`` is not
            a reduction, or a rank or ``group`` has the wrong type.
        ValueError: neither or both of ``dst`` and ``group_dst`` are given, ``op``
            is not defined for the dtype, or ``tensor`` is read-only on ``dst``.
        RankNotInGroupError: ``dst`` is not a member of ``group``.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: MPI failed to make the operation.

    Examples:
        >>> x = np.full(2, dist.get_rank() + 1)
        >>> with dist.reduce_init(x, dst=0) as p:
        ...     _ = p.start().wait()
        >>> x
        array([3, 3])  # rank 0
        array([2, 2])  # rank 1 (unchanged)
    """
    fn = "reduce_init"
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    root = pg.root_rank(dst, group_dst, fn, ("dst", "group_dst"))
    if pg.rank() == root:
        buf, target = prepare_inout(tensor, fn, "tensor")
        fills = backs = _staged(buf, target)
    else:
        buf, source = prepare_source(tensor, fn, "tensor")
        fills, backs = _staged(buf, source), None
    check_op(op, DTYPES[buf.dtype], fn)
    return _made(pg, pg.reduce_init(buf, backs, op, root), fills, (tensor, buf))


def all_gather_into_tensor_init(
    output_tensor: Any, input_tensor: Any, group: ProcessGroup | None = None
) -> Persistent | None:
    """Make a persistent ``all_gather_into_tensor``: every run gathers each rank's ``input_tensor`` into
    ``output_tensor`` (``world_size`` times the input's elements). Collective, made by every rank in the
    same order.

    Args:
        output_tensor: The output: the inputs in rank order, concatenated or
            stacked (see ``all_gather_into_tensor``).
        input_tensor: This rank's input; each run sends what it holds then.
        group: The group; None is the default group. On ranks outside it nothing
            is made and None is returned.

    Returns:
        A ``Persistent`` to run with ``start()`` and ``wait()``; None on ranks
        outside ``group``.

    Raises:
        TypeError: an argument is not an array of a supported dtype, the dtypes
            differ, or ``group`` has the wrong type.
        ValueError: ``output_tensor`` has the wrong size or shape, or is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: MPI failed to make the operation.

    Examples:
        >>> x, out = np.zeros(2), np.zeros(4)
        >>> with dist.all_gather_into_tensor_init(out, x) as p:
        ...     x[:] = dist.get_rank()
        ...     _ = p.start().wait()
        >>> out
        array([0., 0., 1., 1.])  # rank 0 and rank 1
    """
    fn = "all_gather_into_tensor_init"
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    out, target = prepare_output(output_tensor, fn, "output_tensor")
    inp, source = prepare_source(input_tensor, fn, "input_tensor")
    n = pg.size()
    check_dtype(fn, out, "output_tensor", inp, "input_tensor")
    if out.size != n * inp.size:
        raise gathered_size_error(fn, out, inp, n)
    check_block_shapes(fn, out, inp, n, "output_tensor", "input_tensor")
    plan = pg.all_gather_into_tensor_init(out, _staged(out, target), inp)
    return _made(pg, plan, _staged(inp, source), (output_tensor, input_tensor, out, inp))


def reduce_scatter_tensor_init(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None
) -> Persistent | None:
    """Make a persistent ``reduce_scatter_tensor``: every run reduces ``input`` (``world_size`` times
    ``output``'s elements) across ranks and leaves block ``i`` of the result in rank ``i``'s ``output``.
    Collective, made by every rank in the same order.

    Args:
        output: The output: this rank's block of the reduction.
        input: This rank's input, ``world_size`` blocks shaped like ``output``
            (see ``reduce_scatter_tensor``); each run reads what it holds then.
        op: How to combine: a ``ReduceOp`` or an op from ``make_premul_sum``.
        group: The group; None is the default group. On ranks outside it nothing
            is made and None is returned.

    Returns:
        A ``Persistent`` to run with ``start()`` and ``wait()``; None on ranks
        outside ``group``.

    Raises:
        TypeError: an argument is not an array of a supported dtype, the dtypes
            differ, ``op`` is not a reduction, or ``group`` has the wrong type.
        ValueError: ``input`` has the wrong size or shape, ``op`` is not defined
            for the dtype, or ``output`` is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: MPI failed to make the operation.

    Examples:
        >>> out = np.zeros(2, np.int64)
        >>> with dist.reduce_scatter_tensor_init(out, np.arange(4)) as p:
        ...     _ = p.start().wait()
        >>> out
        array([0, 2])  # rank 0
        array([4, 6])  # rank 1
    """
    fn = "reduce_scatter_tensor_init"
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    out, target = prepare_output(output, fn, "output")
    inp, source = prepare_source(input, fn, "input")
    n = pg.size()
    check_dtype(fn, out, "output", inp, "input")
    if inp.size != n * out.size:
        raise scattered_size_error(fn, out, inp, n)
    check_block_shapes(fn, inp, out, n, "input", "output")
    check_op(op, DTYPES[out.dtype], fn)
    plan = pg.reduce_scatter_tensor_init(out, _staged(out, target), inp, op)
    return _made(pg, plan, _staged(inp, source), (output, input, out, inp))


def all_to_all_single_init(
    output: Any,
    input: Any,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
) -> Persistent | None:
    """Make a persistent ``all_to_all_single``, even or with split sizes (rows to and from each rank).

    Collective, made by every rank in the same order; the split sizes are fixed
    when it is made. Each run sends ``input``'s current rows.

    Args:
        output: The output: the blocks received, in rank order.
        input: This rank's input, of ``output``'s dtype and row shape.
        output_split_sizes: Rows received from each rank, or None for an even
            split (see ``all_to_all_single``).
        input_split_sizes: Rows sent to each rank, or None for an even split.
        group: The group; None is the default group. On ranks outside it nothing
            is made and None is returned.

    Returns:
        A ``Persistent`` to run with ``start()`` and ``wait()``; None on ranks
        outside ``group``.

    Raises:
        TypeError: an argument is not an array of a supported dtype, the dtypes
            differ, a split size is not an int, or ``group`` has the wrong type.
        ValueError: the split sizes do not fit the arrays (see
            ``all_to_all_single``), or ``output`` is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: MPI failed to make the operation.

    Examples:
        >>> out = np.empty(4, np.int64)
        >>> with dist.all_to_all_single_init(out, np.arange(4) + 4 * dist.get_rank()) as p:
        ...     _ = p.start().wait()
        >>> out
        array([0, 1, 4, 5])  # rank 0
        array([2, 3, 6, 7])  # rank 1
    """
    fn = "all_to_all_single_init"
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    out, target = prepare_output(output, fn, "output")
    inp, source = prepare_source(input, fn, "input")
    in_counts, out_counts = all_to_all_counts(fn, out, inp, output_split_sizes, input_split_sizes, pg.size())
    plan = pg.all_to_all_single_init(out, _staged(out, target), inp, out_counts, in_counts)
    return _made(pg, plan, _staged(inp, source), (output, input, out, inp))


# -- point-to-point --------------------------------------------------------------------------------
def send_init(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Persistent | None:
    """Make a persistent send of ``tensor`` to ``dst`` (global; or ``group_dst``); each run sends its current values.

    Not collective: pair it with a ``recv_init`` (or any receive) on the peer.
    Each ``start()`` is like ``isend`` and ``wait()`` like its ``Work.wait()``:
    do not modify ``tensor`` in between.

    Args:
        tensor: The array to send; each run sends what it holds then.
        dst: The receiving rank, as a global rank. Give ``dst`` or ``group_dst``.
        group: The group; None is the default group. On ranks outside it nothing
            is made and None is returned.
        tag: Matches each message with a receive of the same tag.
        group_dst: The receiving rank as a rank of ``group``, instead of ``dst``.

    Returns:
        A ``Persistent``; None on ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, or ``dst``,
            ``tag`` or ``group`` has the wrong type.
        ValueError: neither or both of ``dst`` and ``group_dst`` are given, or
            ``tag`` is out of range.
        RankNotInGroupError: ``dst`` is not a member of ``group``.
        DefaultGroupStateError: ``init_process_group`` has not been called.

    Examples:
        >>> x = np.zeros(4)
        >>> if dist.get_rank() == 0:
        ...     p = dist.send_init(x, dst=1)
        ... else:
        ...     p = dist.recv_init(x, src=0)
        >>> for step in range(3):
        ...     if dist.get_rank() == 0:
        ...         x[:] = step
        ...     _ = p.start().wait()
        >>> x
        array([2., 2., 2., 2.])  # rank 0 and rank 1
    """
    fn = "send_init"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    peer = pg.root_rank(dst, group_dst, fn, ("dst", "group_dst"))
    t = tag_value(tag, fn)
    buf, source = prepare_source(tensor, fn, "tensor")
    return _made(pg, pg.send_init(buf, peer, t), _staged(buf, source), (tensor, buf))


def recv_init(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Persistent | None:
    """Make a persistent receive into ``tensor`` from ``src`` (global; ``group_src``; None: any rank).

    Each run receives one message, which must have ``tensor``'s size (else
    ``wait()`` raises ValueError, as ``irecv``'s Work does). A run that times out is
    cancelled if no message has matched it.

    Args:
        tensor: The array each run receives into.
        src: The sending rank, as a global rank; None (and no ``group_src``)
            takes a message from any rank.
        group: The group; None is the default group. On ranks outside it nothing
            is made and None is returned.
        tag: Matches each message with a send of the same tag.
        group_src: The sending rank as a rank of ``group``, instead of ``src``.

    Returns:
        A ``Persistent``; None on ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, or ``src``,
            ``tag`` or ``group`` has the wrong type.
        ValueError: both ``src`` and ``group_src`` are given, ``tag`` is out of
            range, or ``tensor`` is read-only.
        RankNotInGroupError: ``src`` is not a member of ``group``.
        DefaultGroupStateError: ``init_process_group`` has not been called.

    Examples:
        >>> x = np.zeros(2)
        >>> if dist.get_rank() == 0:
        ...     p = dist.recv_init(x)  # from any rank
        ... else:
        ...     p = dist.send_init(np.array([7.0, 8.0]), dst=0)
        >>> p.start().wait()
        True
        >>> x
        array([7., 8.])  # rank 0
        array([0., 0.])  # rank 1
    """
    fn = "recv_init"
    pg = resolve_group(group, fn)
    if pg is None:
        return None
    peer = None if src is None and group_src is None else pg.root_rank(src, group_src, fn, ("src", "group_src"))
    t = tag_value(tag, fn)
    buf, target = prepare_output(tensor, fn, "tensor")
    return _made(pg, pg.recv_init(buf, _staged(buf, target), peer, t), None, (tensor, buf))
