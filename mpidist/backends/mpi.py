"""The MPI backend: each process group is a private MPI communicator.

Every operation is one nonblocking MPI call (Iallreduce, Ibcast, Ialltoallv, ...).
A blocking call polls its request until it completes or the group's timeout
passes, which costs the same as MPI's blocking call (measured: 3.17 vs 3.12 us
for an 8-byte all_reduce on 2 ranks) and gives every call a timeout. With
``async_op=True`` the request goes into a :class:`~mpidist.work.Work`.

This module holds the backend and its collectives; the rest of the MPI backend is
in modules by responsibility:

* ``mpi_types.py``: the dtype/op table probed at run time (:func:`type_table`) and
  the limits of the library's calls;
* ``mpi_reductions.py``: reductions one native call cannot do (AVG, PREMUL_SUM,
  MIN/MAX on floats, widening), as a plan of messages and steps;
* ``mpi_receive.py``: the receive path (posted and matched receives, size checks);
* ``mpi_persistent.py``: persistent operations, made by a collaborator the backend holds;
* ``direct.py``: the hot collectives' one MPI call each (C where built);
* ``shm.py``: large collectives among ranks of one node through shared memory, where the
  group's ranks measured it faster than MPI's own call (``shm_choice.py``) or
  ``MPIDIST_SHM_THRESHOLDS`` says so (``shm_tuning.py``); below 16 KiB, and across nodes,
  MPI's own call runs.

List collectives (all_gather into a list, gather, scatter, all_to_all) address
the caller's arrays directly: the vector variants of the MPI calls get byte
counts and displacements relative to the lowest of the arrays, so separate
arrays need no packing (see ``_vector``).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from .._world import world
from ..arrays import host as _arrays
from ..arrays.host import displacements, then_write_back
from ..errors import DistBackendError, ProcessFailedError
from ..reduce_op import RedOpType
from ..work import Work, poll
from .base import BaseBackend, PersistentPlan
from .direct import calls_kind, make_calls
from .mpi_types import (
    BLOCK_VARIANT_LIMIT,
    COUNT_ERRORS,
    LARGE_COUNTS,
    TypeEntry,
    address,
    bad_dtype,
    count_limit_note,
    type_table,
)  # fmt: skip
from .shm_tuning import CLASSES, NEVER, ONE_COPY, SETUP_FLOOR, SHARED, TRIAL

if TYPE_CHECKING:
    from types import ModuleType

    from .mpi_persistent import MPIPersistent
    from .node_leaders import NodeLeaders
    from .shm import SharedPath
    from .shm_choice import Chooser

__all__ = ["MPIBackend", "type_table"]

IN_PLACE = MPI.IN_PLACE
BYTE = MPI.BYTE
ANY_SOURCE = MPI.ANY_SOURCE
ERR_TRUNCATE = MPI.ERR_TRUNCATE
_REQUEST = MPI.Request
_I32 = MPI.INT32_T
ndarray = np.ndarray

_INT_MAX = 2**31 - 1
_EMPTY = np.empty(0, np.uint8)

def _receiving() -> ModuleType:
    """The receive path (mpi_receive.py), imported by the first receive and kept in ``world.rx``: init_process_group
    does not need it (nor mpi_reductions.py, imported by the first reduction that one MPI call cannot do, nor
    ulfm.py, by the first error)."""
    from . import mpi_receive

    world.rx = mpi_receive
    return mpi_receive


#: the tag of destroy_process_group's agreement on the control communicator (see MPIBackend.agree_to_free)
_FREE_TAG = 0x3B10
#: how long destroy_process_group waits for an agreement of the shared-memory measuring still in flight (shm_choice.py)
#: before it leaves the communicator allocated
_SETTLE_S = 5.0


def _vector(
    arrays: Sequence[ndarray], fn: str, arg: str, output: bool
) -> tuple[list[Any], list[int] | None, list[tuple[ndarray, ndarray]]]:
    """The message ``[buffer, byte counts, byte displacements, BYTE]`` for a list of arrays.

    The buffer starts at the lowest array and the displacements are offsets from
    it, so MPI reads and writes the arrays where they are (no packing). Outputs
    must not overlap (a ValueError names the two). Returns the message, the
    arrays' absolute addresses (None if staged) and the write-backs a staged
    output needs. An MPI library without MPI-4 large counts cannot express
    offsets beyond 2^31 bytes: then the arrays go through one staging buffer.
    One pass over the list: this runs on every call of the list collectives.
    """
    counts, addrs, lo, hi, disjoint = _arrays.byte_spans(arrays)
    if output and not disjoint:
        _arrays.refuse_overlapping_outputs(
            [(0, addr, addr + n, i) for i, (addr, n) in enumerate(zip(addrs, counts))], fn, arg
        )
    if lo < 0:
        return [_EMPTY, counts, [0] * len(counts), BYTE], addrs, []
    if hi - lo <= _INT_MAX or LARGE_COUNTS:
        displs = [addr - lo if addr else 0 for addr in addrs]
        return [MPI.buffer.fromaddress(lo, hi - lo), counts, displs, BYTE], addrs, []
    staging = np.empty(sum(counts), np.uint8)
    world.stats.count_copy(staging.nbytes)
    displs = displacements(counts)
    views = [staging[d : d + n].view(a.dtype).reshape(a.shape) for d, n, a in zip(displs, counts, arrays)]
    if not output:
        for view, a in zip(views, arrays):
            np.copyto(view, a)
    backs = list(zip(views, arrays)) if output else []
    return [staging, counts, displs, BYTE], None, backs


def _after_staging(staged: list[tuple[ndarray, ndarray]], backs: Any) -> Callable[[], None] | None:
    """What completes a list collective: ``_vector``'s staging buffer is copied into the arrays MPI
    was given first, and only then are those arrays written back into the caller's (non-contiguous)
    outputs; the other order hands the caller the arrays' bytes from before the call."""
    return then_write_back(None, staged + list(backs or []))


def _complete(reqs: list[MPI.Request]) -> bool:
    """``MPI_Testall`` of requests left behind (dropped Works, timed-out calls), one request at a time.

    MPICH 5.0.2's ``MPI_Testall`` fails persistent collective requests (MPI_ERR_IN_STATUS, with
    MPI_SUCCESS in the status) while ``MPI_Test`` completes them; a persistent operation left behind
    (``mpidist.persistent``) hands its request here.
    """
    return all(r.Test() for r in reqs)


def _finished(reqs: list[MPI.Request]) -> bool:
    """Whether the requests of a call that timed out have completed since (one that failed counts as pending)."""
    try:
        return _complete(reqs)
    except MPI.Exception:
        return False


def _consecutive(arrays: Sequence[ndarray]) -> bool:
    """Return True if the arrays lie back to back in memory, in order."""
    addr = None
    for a in arrays:
        if not a.nbytes:
            continue
        start = address(a)
        if addr is not None and start != addr:
            return False
        addr = start + a.nbytes
    return True


class Sent(Work):
    """The Work of an ``isend``: ``wait``'s first test is up to the owner's ``c_spins`` tests in C
    (``Direct.wait``, without Python between them; one ``Test`` where C is off), then the poll of any Work."""

    __slots__ = ("_calls", "_spins")

    def _first_test(self) -> bool:
        return self._calls.wait(self._reqs[0], None, self._spins)


class MPIBackend(BaseBackend):
    """Backend over one private MPI communicator (see the module docstring).

    Its persistent operations (``*_init``) are made by a
    :class:`~mpidist.backends.mpi_persistent.MPIPersistent` it holds, or, where the
    ranks agree the library cannot, by ``BaseBackend``'s nonblocking plans.
    """

    name = "mpi"

    def __init__(
        self,
        comm: MPI.Comm,
        timeout_s: float,
        group_name: str = "",
        owns_comm: bool = False,
        global_ranks: list[int] | None = None,
    ) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout_s, group_name, global_ranks)
        self.comm = comm
        # the latency-critical collectives: one call each, straight to MPI where the C module binds (direct.py)
        self._calls = make_calls(comm)
        self._owns_comm = owns_comm
        self._types = type_table(self.size == 1)
        self._orphans: list[tuple[list[MPI.Request], Any]] = []
        self._epoch = 0  # monitored_barrier calls on this communicator
        self._persistent_ops: MPIPersistent | None = None  # made (and its module imported) on first use
        # the shared-memory path (shm.py): set up by the first call of SETUP_FLOOR bytes, then calls from
        # _shm_from bytes look at it; NEVER where it is off (one rank, or the ranks agreed so). The choice
        # between it and MPI's call, per collective, dtype and op, and size class: shm_choice.py
        self._shm: SharedPath | NodeLeaders | None = None
        self._shm_from = SETUP_FLOOR if self.size > 1 else NEVER
        self._host_from = self._shm_from  # from here calls may read and write host memory of their own (staging)
        self._choice: Chooser | None = None

    @property
    def _persistent(self) -> MPIPersistent:
        """The persistent operations' collaborator, made on first use (init_process_group does not import it)."""
        ops = self._persistent_ops
        if ops is None:
            from .mpi_persistent import MPIPersistent

            ops = self._persistent_ops = MPIPersistent(self, self.comm, self._types, self.agree)
        return ops

    def mpi_calls(self) -> str:
        """``"direct"`` if the hot collectives call MPI from C (``direct.py``), else ``"mpi4py"``."""
        return calls_kind(self._calls)

    def next_epoch(self) -> int:
        """Number the next monitored_barrier on this communicator (the same on every rank)."""
        self._epoch += 1
        return self._epoch

    def sync_epoch(self, epoch: int) -> None:
        """Adopt rank 0's monitored_barrier number (after a rank skipped barriers)."""
        self._epoch = max(self._epoch, epoch)

    # -- plumbing -----------------------------------------------------------------------
    def pending(self) -> bool:
        self._orphans = [o for o in self._orphans if not _complete(o[0])]
        self._stuck = [s for s in self._stuck if not _finished(s[0])]  # a late rank may have completed one
        # an agreement of the measuring (shm_choice.py) issued and not yet applied: every rank issued it at the
        # same call, so it completes as the others make progress (they are in destroy_process_group too, or soon)
        settled = self._choice is None or self._choice.settle(min(self.timeout_s, _SETTLE_S))
        return bool(self._stuck or self._orphans) or not settled

    def shutdown(self) -> None:
        """Free the communicator if this backend owns it and nothing may still use it.

        A communicator with operations that timed out is left allocated (a small
        leak): freeing it under a pending operation aborts the job in Open MPI.
        """
        if self.pending():
            return
        if self._shm is not None:
            self._shm.release()
        self._shm = None  # its memory goes when every rank has dropped it
        if self._owns_comm and self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def agree_to_free(self, state: Sequence[int], messages: tuple[int, int], limit_s: float) -> bool:
        """Whether every member is done with the group's communicators, so that freeing them is safe.

        ``destroy_process_group`` frees a group's communicators, and MPI reuses their
        context ids for later communicators. A message still on its way to a freed
        one (a collective that another member called and this rank skipped, a call
        that timed out elsewhere) then arrives for the new communicator: Open MPI
        aborts the job ("PML OB1 received a message from a rank outside the valid
        range of the communicator"), MPICH may deliver it to a receive of the new
        one. So before freeing, the members compare ``state`` (this rank's count of
        calls on each of the group's backends, and 1 if a call is still pending): group
        rank 0 collects every state with point-to-point messages on this (control)
        communicator under a tag of their own (no stale collective traffic or library
        message can match them) and answers each member whether all states are equal,
        nothing is pending and every message was received: ``messages`` is this rank's
        (messages sent, receives made) on the group, and the sums over the members must
        be equal (a send that completed at once, eagerly, with no receive for it, would
        otherwise be delivered to a later group's receive). A member that does not answer within ``limit_s``
        (it has not called destroy, or is busy elsewhere) means no: the communicators
        are left allocated (a small leak), never freed under a message in flight.
        """
        comm, size = self.comm, self.size
        if size == 1:
            return not state[0] and messages[0] == messages[1]
        mine = np.array([*state, *messages], np.int64)
        same_from = len(state)  # the columns that must be equal on every member; the last two are summed
        verdict = np.zeros(1, np.int64)
        try:
            if state[0]:  # a call is pending here: the answer is no; tell the others without waiting for them
                if self.rank != 0:
                    self._orphans.append(([comm.Isend(mine, 0, _FREE_TAG)], mine))
                else:
                    self._orphans.append(([comm.Isend(verdict, k, _FREE_TAG) for k in range(1, size)], verdict))
                return False
            if self.rank != 0:
                sent = comm.Isend(mine, 0, _FREE_TAG)
                answer = comm.Irecv(verdict, 0, _FREE_TAG)
                if not poll(answer.Test, limit_s, self.spins):
                    answer.Cancel()
                    poll(answer.Test, 1.0, self.spins)  # cancelled at once (or the verdict came after all)
                    if not answer.Test():  # pragma: no cover - MPI did neither within a second
                        self._orphans.append(([answer, sent], (mine, verdict)))
                        return False
                if not poll(sent.Test, 1.0, self.spins):  # matched by rank 0: completes
                    self._orphans.append(([sent], mine))  # pragma: no cover
                return bool(verdict[0])
            boxes = np.zeros((size - 1, len(mine)), np.int64)
            reqs = [comm.Irecv(boxes[k - 1], k, _FREE_TAG) for k in range(1, size)]
            everyone = poll(lambda: MPI.Request.Testall(reqs), limit_s, self.spins)
            answered = [k for k in range(1, size) if reqs[k - 1].Test()]
            for k in range(1, size):
                if k not in answered:
                    reqs[k - 1].Cancel()
            sent, received = boxes[:, same_from:].sum(axis=0) + mine[same_from:]
            same = everyone and bool((boxes[:, :same_from] == mine[:same_from]).all()) and not state[0]
            same = same and sent == received
            verdict[0] = int(same)
            sends = [comm.Isend(verdict, k, _FREE_TAG) for k in answered]
            if not poll(lambda: MPI.Request.Testall(sends), 1.0, self.spins):  # pragma: no cover - small: eager
                self._orphans.append((sends, verdict))
                return False
            MPI.Request.Testall([r for k, r in enumerate(reqs, 1) if k not in answered])  # the cancelled receives
            return same
        except MPI.Exception:  # pragma: no cover - an MPI error here: keep everything allocated
            return False

    def keep_comm(self) -> None:
        """Never free this backend's communicator (``shutdown`` leaves it allocated)."""
        self._owns_comm = False

    def adopt(self, reqs: list[MPI.Request], keep: Any) -> None:
        """Keep the buffers of a Work dropped before completion until MPI is done with them."""
        self._orphans = [o for o in self._orphans if not _complete(o[0])]
        if not _complete(reqs):
            self._orphans.append((reqs, keep))

    def _done(
        self, op: str, req: MPI.Request | int, post: Callable[[], None] | None, keep: Any, async_op: bool
    ) -> Work | None:
        """Return a Work for ``req``, or wait for it (within the timeout) and finish: every call ends here.

        ``req`` is an ``MPI.Request`` or what the hot calls returned (``backends/direct.py``): None
        when the C calls saw the operation complete, else the pending request's handle. (The hot
        methods return None themselves for a complete call with nothing to ``post``: that skips
        this frame, about 60 ns of a 1.5 us call.)
        A blocking call tests once (a small operation is usually complete by then:
        MPICH progresses it inside the nonblocking call) and only then enters the
        polling wait; ``keep`` holds the buffers until MPI is done with them.
        """
        if req is None:  # complete in the C calls (a blocking call)
            if post is not None:
                post()
            return None
        if type(req) is int:  # the C calls' pending request
            req = _REQUEST.fromhandle(req)
        if async_op:
            return Work([req], post, keep, op, self, self.seq, self.timeout_s)
        try:  # one test first: a small operation is often complete; else poll until the timeout
            if not req.Test() and not poll(  # a SharedOp waits in C between tests (spin)
                self.advancing(getattr(req, "spin", req.Test), req), self.timeout_s, self.spins,
                (self.group_name, op, self.seq),
            ):  # fmt: skip
                self._expired(op, req, keep)
        except MPI.Exception as exc:
            raise self._fail(op, exc) from exc
        if post is not None:
            post()
        return None

    def advancing(self, test: Callable[[], bool], req: Any) -> Callable[[], bool]:
        """``test``, or where the group's path (shared memory, node leaders) has operations queued other than
        ``req``: ``test`` that first advances them (never waiting). A rank blocked in one call then still
        plays its part in the async operations it issued before, which other ranks may be waiting for (a
        path's operation moves only when its rank tests it; MPI's requests move inside any MPI call)."""
        path = self._shm
        if path is None or not path.queue:
            return test
        try:
            if path.queue[-1] is req:  # the operation waited for is the last: its own test advances the rest
                return test
        except IndexError:  # another thread (torch's progress thread) completed them meanwhile
            return test
        queue = path.queue

        def both() -> bool:
            try:
                queue[-1].Test()  # a path's Test advances its queue up to that operation, never waits
            except IndexError:  # nothing left queued
                pass
            return test()

        return both

    def _expired(self, op: str, req: MPI.Request, keep: Any) -> None:
        """A blocking call ran out of time: keep its buffers forever and raise."""
        self.keep_stuck([req], keep)
        raise self.timeout_failure(op, self.seq, self.timeout_s)

    def _fail(self, op: str, exc: MPI.Exception) -> Exception:
        return self.backend_error(op, self.seq, exc)

    def backend_error(self, op: str, seq: int, exc: BaseException) -> DistBackendError:
        """Wrap an MPI error; on an MPI-3 library, say what an invalid-argument error most likely means.

        A dead member (ULFM) gives a ``ProcessFailedError`` naming it, and the communicator is revoked so
        that the members blocked in other calls on it wake up too."""
        from . import ulfm

        if ulfm.is_failure(exc):
            return self._process_failed(op, seq, exc)
        error = super().backend_error(op, seq, exc)
        if not LARGE_COUNTS and isinstance(exc, MPI.Exception) and exc.Get_error_class() in COUNT_ERRORS:
            error = DistBackendError(f"{error} {count_limit_note()}")
        return error

    def _process_failed(self, op: str, seq: int, exc: BaseException) -> ProcessFailedError:
        from . import ulfm

        ulfm.revoke(self.comm)
        dead = ulfm.failed_members(self.comm, min(self.timeout_s, ulfm.REPORT_WAIT_S))
        ranks = [self.global_ranks[r] for r in dead] if self.global_ranks is not None else dead
        known = f"rank(s) {ranks} died" if ranks else "a member died (the detector has not named it yet)"
        return ProcessFailedError(
            f"{op} (call #{seq}) on {self.describe()} failed: {known} ({exc}). The group is revoked: every "
            "call on it fails now; shrink_group(exc.failed_group_ranks, group) makes a group of the survivors.",
            ranks,
            dead,
            self.group_name,
        )

    # -- shared memory --------------------------------------------------------------------
    def _path(self, fn: str) -> SharedPath | NodeLeaders | None:
        """The group's shared-memory path, set up by the first call that may take it; None where it is off."""
        path = self._shm
        if path is None and self._shm_from < NEVER:
            from .shm import SharedPath  # imported on first use: init_process_group's cost grows with ranks per core
            from .shm_choice import Chooser

            path = self._shm = SharedPath.setup(self, fn)  # or the node-leader path, where the ranks span nodes
            self._shm_from = NEVER if path is None else path.smallest
            self._host_from = NEVER if path is None else path.host_from
            if path is not None:
                self._choice = Chooser(self, path.prior, path.one_copy, path.way)
        return path

    def _way(self, fn: str, nbytes: int, routes: dict[str, list[Any]], label: str) -> int:
        """What this call takes: MPI's call (0), shared memory (1, ``SHARED``) or a measured call (``TRIAL``).

        Every rank answers alike: the sizes, dtypes and ops of the group's calls are the same on every
        rank, and so are the fixed ranges (agreed at set-up) and the measured choices (shm_choice.py).
        """
        choice = self._choice
        table = routes.get(fn)
        if table is not None:  # the common case first: a class whose choice is made and not due for a check
            r = table[nbytes.bit_length()]
            if r is not None and r.left > 1 and choice.trying is None:  # (left counts down only once chosen)
                r.left -= 1
                return r.way
        if choice.trying is not None:  # the measured call, issued again as the path it measures
            return choice.trying
        path = self._shm
        if fn in path.fixed:
            return SHARED if path.takes(fn, nbytes) else 0
        if table is None:
            table = routes[fn] = [None] * CLASSES
        return choice.next(table, fn, label, nbytes)

    def _shm_runs(self, fn: str, nbytes: int, dtype: np.dtype, op: Any = None, reduces: bool = False) -> bool:
        """Whether one-off calls of ``fn`` on ``nbytes`` may go through shared memory: a persistent operation of
        that size then runs them (``BaseBackend``'s plan), so that it takes the path each call chooses.
        Counts no call (every rank asks at the same call of the group, so every rank answers alike)."""
        if nbytes < self._shm_from:
            return False
        e = self._types.get(dtype)
        if e is None:
            return False  # the persistent path raises the TypeError
        path = self._path(fn)
        if path is None:
            return False
        if fn in path.fixed:
            return path.takes(fn, nbytes)
        if reduces:
            r = path.reducer(e, op)
            if r is None:
                return False
            table = r.routes.get(fn)
        else:
            table = path.routes.get(fn)
        return table is None or self._choice.may_share(table, nbytes)

    def shared_memory_from(self) -> int:
        """The size (bytes) from which calls may take the shared-memory path, which reads and writes memory on
        the host (the same on every rank; it only grows once the path is set up or found off; the node-leader
        path of a group that spans nodes hands arrays to MPI as they are)."""
        return self._host_from

    def shared_memory(self) -> SharedPath | NodeLeaders | None:
        """The group's shared-memory path once set up (None before, or where it is off): for tests and the bench."""
        return self._shm

    def shared_memory_choices(self) -> list[tuple[str, str, str, str]]:
        """(collective, dtype and op, sizes, what the calls take) per size class measured so far (shm_choice.py)."""
        return [] if self._choice is None else self._choice.choices()

    # -- reductions -----------------------------------------------------------------------
    def _reduction(
        self,
        fn: str,
        e: TypeEntry,
        op: Any,
        send: ndarray,
        recv: ndarray | None,
        in_place: bool,
        start: Callable[[Any, Any, MPI.Op], MPI.Request],
        backs: Any,
        async_op: bool,
        keep: Any = None,
    ) -> Work | None:
        """Run a reduction whose MPI call is ``start(send message, recv message, op)`` (see ``mpi_reductions.reduction_plan``);
        staged outputs are written back afterwards."""
        from .mpi_reductions import reduction_plan

        try:
            smsg, rmsg, mop, prepare, finish, undo, bufs = reduction_plan(
                fn, e, op, send, recv, in_place, self.size, self._types
            )
        except (TypeError, ValueError):
            self.seq -= 1  # the op was refused before anything was posted: the call was not issued
            raise
        if prepare is not None:
            prepare()
        try:
            req = start(smsg, rmsg, mop)
        except MPI.Exception as exc:
            if undo is not None:
                undo()
            raise self._fail(fn, exc) from exc
        return self._done(fn, req, then_write_back(finish, backs), (bufs, keep), async_op)

    def all_reduce(self, buf: ndarray, backs: Any, op: Any, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(buf.dtype) or bad_dtype(buf, "all_reduce")
        if buf.nbytes >= self._shm_from:
            path = self._shm or self._path("all_reduce")
            r = None if path is None else path.reducer(e, op)
            if r is not None and (path.host_from < NEVER or type(buf) is np.ndarray):  # node leaders: host arrays
                way = self._way("all_reduce", buf.nbytes, r.routes, r.label)
                if way == TRIAL:
                    self.seq -= 1  # counted again when the call runs as the path measured
                    return self._choice.measure(lambda a: self.all_reduce(buf, backs, op, a), async_op)
                if way:
                    post = then_write_back(None, backs) if backs else None
                    return self._done("all_reduce", path.all_reduce(buf, r), post, buf, async_op)
        mop = e.fast[op] if type(op) is RedOpType else None
        if mop is None or backs is not None:
            comm = self.comm
            return self._reduction(
                "all_reduce", e, op, buf, buf, True,
                lambda s, r, o: comm.Iallreduce(s, r, o), backs, async_op,
            )  # fmt: skip
        try:
            req = self._calls.allreduce(buf, e.mpi, mop, 0 if async_op else self.c_spins)
        except MPI.Exception as exc:
            raise self._fail("all_reduce", exc) from exc
        return None if req is None else self._done("all_reduce", req, None, buf, async_op)

    def reduce(self, buf: ndarray, backs: Any, op: Any, root: int, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(buf.dtype) or bad_dtype(buf, "reduce")
        if buf.nbytes >= self._shm_from:
            path = self._shm or self._path("reduce")
            r = None if path is None else path.reducer(e, op)
            if r is not None:
                way = self._way("reduce", buf.nbytes, r.routes, r.label)
                if way == TRIAL:
                    self.seq -= 1
                    return self._choice.measure(lambda a: self.reduce(buf, backs, op, root, a), async_op)
                if way:
                    post = then_write_back(None, backs) if backs and self.rank == root else None
                    return self._done("reduce", path.reduce(buf, r, root), post, buf, async_op)
        mop = e.fast[op] if type(op) is RedOpType else None
        if mop is None or backs is not None:
            comm = self.comm
            at_root = self.rank == root
            return self._reduction(
                "reduce", e, op, buf, buf if at_root else None, at_root,
                lambda s, r, o: comm.Ireduce(s, r, o, root), backs, async_op,
            )  # fmt: skip
        try:
            req = self._calls.reduce(buf, e.mpi, mop, root, 0 if async_op else self.c_spins)
        except MPI.Exception as exc:
            raise self._fail("reduce", exc) from exc
        return None if req is None else self._done("reduce", req, None, buf, async_op)

    def reduce_scatter_tensor(self, out: ndarray, backs: Any, inp: ndarray, op: Any, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or bad_dtype(out, "reduce_scatter_tensor")
        if _arrays.may_overlap(out, inp):
            inp = self._separate(inp)  # MPI forbids aliased buffers
        if inp.nbytes >= self._shm_from:
            path = self._shm or self._path("reduce_scatter_tensor")
            r = None if path is None else path.reducer(e, op)
            if r is not None:
                way = self._way("reduce_scatter_tensor", inp.nbytes, r.routes, r.label)
                if way == TRIAL:
                    self.seq -= 1
                    again = lambda a: self.reduce_scatter_tensor(out, backs, inp, op, a)  # noqa: E731
                    return self._choice.measure(again, async_op)
                if way:
                    post = then_write_back(None, backs) if backs else None
                    return self._done(
                        "reduce_scatter_tensor", path.reduce_scatter(out, inp, r), post, (inp, out), async_op
                    )
        mop = e.fast[op] if type(op) is RedOpType else None
        if mop is None or backs is not None:
            comm = self.comm
            return self._reduction(
                "reduce_scatter_tensor", e, op, inp, out, False,
                lambda s, r, o: comm.Ireduce_scatter(s, r, None, o), backs, async_op,
            )  # fmt: skip
        try:
            if inp.nbytes < BLOCK_VARIANT_LIMIT:
                req = self._calls.reduce_scatter_block(out, inp, e.mpi, mop, 0 if async_op else self.c_spins)
            else:
                req = self._calls.reduce_scatter(out, inp, e.mpi, mop, 0 if async_op else self.c_spins)
        except MPI.Exception as exc:
            raise self._fail("reduce_scatter_tensor", exc) from exc
        return None if req is None else self._done("reduce_scatter_tensor", req, None, (inp, out), async_op)

    def reduce_scatter(self, out: ndarray, backs: Any, ins: Sequence[ndarray], op: Any, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or bad_dtype(out, "reduce_scatter")
        counts = [a.size for a in ins]
        if _consecutive(ins) and not _arrays.may_overlap_any(out, ins):
            total = sum(a.nbytes for a in ins)
            packed = np.frombuffer(MPI.buffer.fromaddress(address(ins[0]) if total else 0, total), out.dtype)
        else:
            packed = np.concatenate([a.reshape(-1) for a in ins]) if ins else np.empty(0, out.dtype)
            world.stats.count_copy(packed.nbytes)
        comm = self.comm
        return self._reduction(
            "reduce_scatter", e, op, packed, out, False,
            lambda s, r, o: comm.Ireduce_scatter(s, r, counts, o), backs, async_op, keep=ins,
        )  # fmt: skip

    # -- data movement ------------------------------------------------------------------
    def _separate(self, inp: ndarray) -> ndarray:
        """Copy an input that shares memory with the output (MPI forbids aliasing)."""
        copy = inp.copy()
        world.stats.count_copy(copy.nbytes)
        return copy

    def broadcast(self, buf: ndarray, backs: Any, root: int, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(buf.dtype) or bad_dtype(buf, "broadcast")
        if buf.nbytes >= self._shm_from:
            path = self._shm or self._path("broadcast")
            way = 0 if path is None else self._way("broadcast", buf.nbytes, path.routes, "")
            if way == TRIAL:
                self.seq -= 1
                return self._choice.measure(lambda a: self.broadcast(buf, backs, root, a), async_op)
            if way:
                post = then_write_back(None, backs) if backs else None
                return self._done("broadcast", path.broadcast(buf, root, way == ONE_COPY), post, buf, async_op)
        try:
            req = self._calls.bcast(buf, e.mpi, root, 0 if async_op else self.c_spins)
        except MPI.Exception as exc:
            raise self._fail("broadcast", exc) from exc
        if req is None and not backs:  # complete, nothing to write back
            return None
        post = None if not backs else then_write_back(None, backs)
        return self._done("broadcast", req, post, buf, async_op)

    def all_gather_into_tensor(self, out: ndarray, backs: Any, inp: ndarray, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or bad_dtype(out, "all_gather_into_tensor")
        send: ndarray | None = inp
        if _arrays.may_overlap(out, inp):
            mine = inp.nbytes * self.rank
            if inp.nbytes and address(inp) == address(out) + mine:
                send = None  # in place: the input already sits in this rank's slot of the output
            else:
                send = self._separate(inp)
        if out.nbytes >= self._shm_from:
            path = self._shm or self._path("all_gather_into_tensor")
            way = 0 if path is None else self._way("all_gather_into_tensor", out.nbytes, path.routes, "")
            if way == TRIAL:
                self.seq -= 1
                mine = inp if send is None else send  # already separated from ``out`` where they overlapped
                again = lambda a: self.all_gather_into_tensor(out, backs, mine, a)  # noqa: E731
                return self._choice.measure(again, async_op)
            if way:
                post = then_write_back(None, backs) if backs else None
                shm_op = path.all_gather(out, send, way == ONE_COPY)
                return self._done("all_gather_into_tensor", shm_op, post, (out, send), async_op)
        try:
            req = self._calls.allgather(out, send, e.mpi, 0 if async_op else self.c_spins)
        except MPI.Exception as exc:
            raise self._fail("all_gather_into_tensor", exc) from exc
        if req is None and not backs:  # complete, nothing to write back
            return None
        post = None if not backs else then_write_back(None, backs)
        return self._done("all_gather_into_tensor", req, post, (out, send), async_op)

    def all_gather(self, outs: Sequence[ndarray], backs: Any, inp: ndarray, async_op: bool) -> Work | None:
        self.seq += 1
        rmsg, addrs, staged = _vector(outs, "all_gather", "tensor_list", True)
        smsg = self._own_block(inp, outs[self.rank], addrs, outs)
        try:
            req = self.comm.Iallgatherv(smsg, rmsg)
        except MPI.Exception as exc:
            raise self._fail("all_gather", exc) from exc
        post = _after_staging(staged, backs)
        return self._done("all_gather", req, post, (inp, outs, smsg, rmsg), async_op)

    def _own_block(self, inp: ndarray, mine: ndarray, addrs: list[int] | None, outs: Sequence[ndarray]) -> Any:
        """The send message of a rank whose output block may be (or overlap) its input."""
        if addrs is None or not _arrays.may_overlap_any(inp, outs):
            return [inp, inp.nbytes, BYTE]  # (outputs staged elsewhere, or no overlap)
        if inp.nbytes and mine.nbytes == inp.nbytes and address(inp) == addrs[self.rank]:
            return IN_PLACE
        copy = self._separate(inp)
        return [copy, copy.nbytes, BYTE]

    def gather(
        self, inp: ndarray, outs: Sequence[ndarray] | None, backs: Any, root: int, async_op: bool
    ) -> Work | None:
        self.seq += 1
        staged: list[tuple[ndarray, ndarray]] = []
        if outs is None:
            smsg: Any = [inp, inp.nbytes, BYTE]
            rmsg = None
        else:
            rmsg, addrs, staged = _vector(outs, "gather", "gather_list", True)
            smsg = self._own_block(inp, outs[self.rank], addrs, outs)
        try:
            req = self.comm.Igatherv(smsg, rmsg, root)
        except MPI.Exception as exc:
            raise self._fail("gather", exc) from exc
        post = _after_staging(staged, backs)
        return self._done("gather", req, post, (inp, outs, smsg, rmsg), async_op)

    def scatter(
        self, out: ndarray, backs: Any, ins: Sequence[ndarray] | None, root: int, async_op: bool
    ) -> Work | None:
        self.seq += 1
        rmsg: Any = [out, out.nbytes, BYTE]
        smsg = None
        if ins is not None:
            if _arrays.may_overlap_any(out, ins):
                mine = ins[self.rank]
                if out.nbytes and mine.nbytes == out.nbytes and address(mine) == address(out):
                    rmsg = IN_PLACE  # this rank's block already is its output
                else:
                    ins = [self._separate(a) if _arrays.may_overlap(out, a) else a for a in ins]
            smsg = _vector(ins, "scatter", "scatter_list", False)[0]
        try:
            req = self.comm.Iscatterv(smsg, rmsg, root)
        except MPI.Exception as exc:
            raise self._fail("scatter", exc) from exc
        post = None if not backs else then_write_back(None, backs)
        return self._done("scatter", req, post, (out, ins, smsg), async_op)

    def all_to_all_single(
        self,
        out: ndarray,
        backs: Any,
        inp: ndarray,
        out_counts: Sequence[int] | None,
        in_counts: Sequence[int] | None,
        async_op: bool,
    ) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or bad_dtype(out, "all_to_all_single")
        if _arrays.may_overlap(out, inp):
            inp = self._separate(inp)  # MPI forbids aliased buffers
        try:
            if out_counts is None or in_counts is None:
                req = self._calls.alltoall(out, inp, e.mpi, 0 if async_op else self.c_spins)
            else:
                req = self.comm.Ialltoallv(
                    [inp, in_counts, displacements(in_counts), e.mpi],
                    [out, out_counts, displacements(out_counts), e.mpi],
                )
        except MPI.Exception as exc:
            raise self._fail("all_to_all_single", exc) from exc
        if req is None and not backs:  # complete, nothing to write back
            return None
        post = None if not backs else then_write_back(None, backs)
        return self._done("all_to_all_single", req, post, (inp, out), async_op)

    def all_to_all(self, outs: Sequence[ndarray], backs: Any, ins: Sequence[ndarray], async_op: bool) -> Work | None:
        self.seq += 1
        rmsg, _, staged = _vector(outs, "all_to_all", "output_tensor_list", True)
        if any(_arrays.may_overlap_any(a, outs) for a in ins):
            ins = [self._separate(a) for a in ins]
        smsg = _vector(ins, "all_to_all", "input_tensor_list", False)[0]
        try:
            req = self.comm.Ialltoallv(smsg, rmsg)
        except MPI.Exception as exc:
            raise self._fail("all_to_all", exc) from exc
        post = _after_staging(staged, backs)
        return self._done("all_to_all", req, post, (ins, outs, smsg, rmsg), async_op)

    def gate(self, op: str) -> None:
        """A barrier named after ``op``, which needs every rank (MPI communicator creation).

        Communicator-creation calls have no timeout in MPI; passing this bounded
        barrier first means every rank is there, so the creation cannot hang.
        """
        self.seq += 1
        try:
            req = self.comm.Ibarrier()
        except MPI.Exception as exc:
            raise self._fail(op, exc) from exc
        self._done(f"{op} (every rank must call it)", req, None, None, False)

    def agree(self, fn: str, flags: Sequence[bool]) -> list[bool]:
        """Number a call of the group named ``fn`` and return ``flags`` ANDed over its ranks.

        ``flags`` are this rank's answers (routine available, even split, ...); one
        all-reduce (MIN), bounded by the group's timeout (a rank that never calls makes
        the others raise DistBackendError naming ``fn``). Persistent operations start with
        it: once it completes every rank has arrived, so their non-local initialization
        cannot hang.
        """
        self.seq += 1
        mine = np.array([1 if f else 0 for f in flags], np.int32)
        try:
            req = self.comm.Iallreduce(IN_PLACE, [mine, _I32], MPI.MIN)
        except MPI.Exception as exc:
            raise self._fail(fn, exc) from exc
        self._done(f"{fn} (every rank creates it, in the same order)", req, None, mine, False)
        return [bool(f) for f in mine]

    def barrier(self, async_op: bool) -> Work | None:
        self.seq += 1
        try:
            req = self._calls.barrier(0 if async_op else self.c_spins)
        except MPI.Exception as exc:
            raise self._fail("barrier", exc) from exc
        return None if req is None else self._done("barrier", req, None, None, async_op)

    # -- point-to-point -------------------------------------------------------------------
    # (one call each through self._calls: straight to MPI where the C calls are bound, see _direct_p2p.c)
    def send(self, buf: ndarray, peer: int, tag: int) -> Work:
        self.p2p_seq += 1
        self.sent += 1
        e = self._types.get(buf.dtype) or bad_dtype(buf, "send")
        try:
            req = self._calls.send(buf, e.mpi, peer, tag, 0)
        except MPI.Exception as exc:
            raise self.backend_error("send", self.p2p_seq, exc) from exc
        if type(req) is int:
            req = _REQUEST.fromhandle(req)
        w = Sent([req], None, buf, "send", self, self.p2p_seq, self.timeout_s)
        w._calls, w._spins = self._calls, self.c_spins
        return w

    def isend_fast(self, buf: ndarray, peer: int, tag: int) -> Any:
        """``isend`` of the caller's own array: a Work made in C (``_direct_posted.c``), where C takes it."""
        seq = self.p2p_seq + 1
        e = self._types.get(buf.dtype)
        try:
            w = None if e is None else self._calls.post_send(buf, e.mpi, peer, tag, self.c_spins, self, seq)
        except MPI.Exception as exc:
            self.p2p_seq = seq
            raise self.backend_error("send", seq, exc) from exc
        if w is None:
            return self.send(buf, peer, tag).with_outputs([buf])
        self.p2p_seq = seq
        self.sent += 1
        return w

    def irecv_fast(self, buf: ndarray, peer: int | None, tag: int) -> Any:
        """``irecv`` into the caller's own array: as :meth:`isend_fast` (not from this rank itself)."""
        seq = self.p2p_seq + 1
        w = None
        if self._posts_directly(peer):
            try:
                w = self._calls.post_recv(buf, ANY_SOURCE if peer is None else peer, tag, self.c_spins, self, seq)
            except MPI.Exception as exc:
                self.p2p_seq = seq
                raise self.backend_error("recv", seq, exc) from exc
        if w is None:
            return self.recv(buf, None, peer, tag).with_outputs([buf])
        self.p2p_seq = seq
        self.received += 1
        return w

    def _posts_directly(self, peer: int | None) -> bool:
        """Whether a receive from ``peer`` (None: any) is posted as it is: not one that may come from this
        rank itself, which ``recv`` posts with care for libraries that truncate those silently."""
        return peer != self.rank and (peer is not None or self.size > 1)

    def promoted(
        self, recv: bool, buf: ndarray, seq: int, peer: int, handle: int | None, rc: int, status: bytes | None
    ) -> Work:
        """The Python Work of a C-made one (``_direct_posted.c``) that needs more than its C paths: the request
        ``handle`` still pending, or (None) completed with MPI error ``rc`` (0: none) and a receive's ``status``."""
        req = MPI.Request() if handle is None else _REQUEST.fromhandle(handle)
        if recv:
            peer_rank = None if peer == ANY_SOURCE else peer
            e = self._types[buf.dtype]
            w: Work = (world.rx or _receiving()).Receive(req, buf, e, None, self, peer_rank, None, None, True)
            w._seq = seq  # (Receive takes the backend's latest number)
            if status is not None:
                ctypes.memmove(MPI._addressof(w._status), status, MPI._sizeof(MPI.Status))
        else:
            w = Sent([req], None, buf, "send", self, seq, self.timeout_s)
            w._calls, w._spins = self._calls, self.c_spins
        w.with_outputs([buf])
        if rc:
            exc = MPI.Exception(rc)
            if recv and exc.Get_error_class() == ERR_TRUNCATE:  # MPICH: a longer message fails the test
                w._arrived = -3  # type: ignore[attr-defined]
                w._complete()
            else:
                w._fail(self.backend_error(w._op, seq, exc))
        elif handle is None:
            w._complete()
        return w

    def abandoned(self, handle: int, buf: Any) -> None:
        """A C-made Work (``_direct_posted.c``) was dropped while pending: keep its array while MPI may use it."""
        self.adopt([_REQUEST.fromhandle(handle)], buf)

    def send_and_wait(self, buf: ndarray, peer: int, tag: int) -> None:
        self.p2p_seq += 1
        self.sent += 1
        e = self._types.get(buf.dtype) or bad_dtype(buf, "send")
        try:
            req = self._calls.send(buf, e.mpi, peer, tag, self.c_spins)
            if req is None:  # complete within the C call's tests
                return
            if type(req) is int:
                req = _REQUEST.fromhandle(req)
            if req.Test() or poll(req.Test, self.timeout_s, self.spins, (self.group_name, "send", self.p2p_seq)):
                return
        except MPI.Exception as exc:
            raise self.backend_error("send", self.p2p_seq, exc) from exc
        self.keep_stuck([req], buf)
        raise self.timeout_failure("send", self.p2p_seq, self.timeout_s)

    def recv_and_wait(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> int:
        """Receive a message of ``buf``'s size into it, never writing one of another size there (see
        ``_direct_p2p.c`` and :class:`~mpidist.backends.mpi_receive.Receive`); return the source's group rank."""
        self.p2p_seq += 1
        self.received += 1
        got = None
        if backs is None:  # (the C call takes bytes: the dtype is looked up only past it)
            try:
                got = self._calls.recv(buf, ANY_SOURCE if peer is None else peer, tag, self.c_spins)
            except MPI.Exception as exc:
                raise self.backend_error("recv", self.p2p_seq, exc) from exc
            if type(got) is int:
                return got
        e = self._types.get(buf.dtype) or bad_dtype(buf, "recv")
        return (world.rx or _receiving()).finish_blocking_receive(self, got, buf, e, backs, peer, tag)

    def recv(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> Work:
        """Post the receive into ``buf`` at once (see :class:`~mpidist.backends.mpi_receive.Receive`)."""
        self.p2p_seq += 1
        self.received += 1
        e = self._types.get(buf.dtype) or bad_dtype(buf, "recv")
        target = buf
        rx = world.rx or _receiving()
        if self._posts_directly(peer):  # not from this rank itself (below)
            try:
                req = self._calls.irecv(buf, ANY_SOURCE if peer is None else peer, tag)
            except MPI.Exception as exc:
                raise self.backend_error("recv", self.p2p_seq, exc) from exc
            if req is not None:  # posted as bytes, as posted_receive does
                return rx.Receive(_REQUEST.fromhandle(req), buf, e, backs, self, peer, None, None, True)
        elif not rx.reports_self_truncation():
            # Open MPI truncates a longer message from this rank to itself without an error:
            # receive into one element more, so that a longer message shows (copied on completion)
            target = np.empty(buf.size + 1, buf.dtype)
            world.stats.count_copy(buf.nbytes)
        message, as_bytes = rx.posted_receive(target, e.mpi)
        try:
            req = self.comm.Irecv(message, ANY_SOURCE if peer is None else peer, tag)
        except MPI.Exception as exc:
            raise self.backend_error("recv", self.p2p_seq, exc) from exc
        return rx.Receive(req, buf, e, backs, self, peer, None, None if target is buf else target, as_bytes)

    def recv_blocking(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> Work:
        """Match the message with a probe first, then receive it (see :class:`~mpidist.backends.mpi_receive.Receive`)."""
        self.p2p_seq += 1
        self.received += 1
        e = self._types.get(buf.dtype) or bad_dtype(buf, "recv")
        return (world.rx or _receiving()).Receive(None, buf, e, backs, self, peer, (self.comm, tag))

    # -- persistent operations: MPI-4 persistent requests where every rank can make them ------------
    # (MPIPersistent returns None where the ranks agreed on BaseBackend's nonblocking plan)
    def broadcast_init(self, buf: ndarray, backs: Any, root: int) -> PersistentPlan:
        if self._shm_runs("broadcast", buf.nbytes, buf.dtype):
            return super().broadcast_init(buf, backs, root)
        return self._persistent.broadcast_init(buf, backs, root) or super().broadcast_init(buf, backs, root)

    def all_reduce_init(self, buf: ndarray, backs: Any, op: Any) -> PersistentPlan:
        if self._shm_runs("all_reduce", buf.nbytes, buf.dtype, op, True):
            return super().all_reduce_init(buf, backs, op)
        return self._persistent.all_reduce_init(buf, backs, op) or super().all_reduce_init(buf, backs, op)

    def reduce_init(self, buf: ndarray, backs: Any, op: Any, root: int) -> PersistentPlan:
        if self._shm_runs("reduce", buf.nbytes, buf.dtype, op, True):
            return super().reduce_init(buf, backs, op, root)
        return self._persistent.reduce_init(buf, backs, op, root) or super().reduce_init(buf, backs, op, root)

    def all_gather_into_tensor_init(self, out: ndarray, backs: Any, inp: ndarray) -> PersistentPlan:
        if self._shm_runs("all_gather_into_tensor", out.nbytes, out.dtype):
            return super().all_gather_into_tensor_init(out, backs, inp)
        plan = self._persistent.all_gather_into_tensor_init(out, backs, inp)
        return plan or super().all_gather_into_tensor_init(out, backs, inp)

    def reduce_scatter_tensor_init(self, out: ndarray, backs: Any, inp: ndarray, op: Any) -> PersistentPlan:
        if self._shm_runs("reduce_scatter_tensor", inp.nbytes, out.dtype, op, True):
            return super().reduce_scatter_tensor_init(out, backs, inp, op)
        plan = self._persistent.reduce_scatter_tensor_init(out, backs, inp, op)
        return plan or super().reduce_scatter_tensor_init(out, backs, inp, op)

    def all_to_all_single_init(
        self,
        out: ndarray,
        backs: Any,
        inp: ndarray,
        out_counts: Sequence[int] | None,
        in_counts: Sequence[int] | None,
    ) -> PersistentPlan:
        plan = self._persistent.all_to_all_single_init(out, backs, inp, out_counts, in_counts)
        return plan or super().all_to_all_single_init(out, backs, inp, out_counts, in_counts)

    def send_init(self, buf: ndarray, peer: int, tag: int) -> PersistentPlan:
        return self._persistent.send_init(buf, peer, tag)

    def recv_init(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> PersistentPlan:
        return self._persistent.recv_init(buf, backs, peer, tag)
