"""The interface every backend implements.

Collectives validate their arguments, translate ranks to group ranks and
prepare arrays (``mpidist.arrays.host``) before calling a backend, so a backend
method receives:

* C-contiguous numpy arrays of a supported dtype (for device backends later:
  the prepared device arrays), already checked for sizes and dtypes;
* ``backs``: None, or ``(buffer, target)`` pairs whose buffer must be copied into
  the target (``_arrays.write_back``) once the operation has completed;
* ranks as group ranks; ``async_op``: return a :class:`~mpidist.work.Work` if
  True, else complete the operation (within the group's timeout) and return None.

A third-party backend registered with ``Backend.register_backend`` returns an
object of a subclass of :class:`BaseBackend` from its factory.

Persistent operations (``mpidist.persistent``): ``<collective>_init`` methods take
the same prepared arguments minus ``async_op`` and return a :class:`PersistentPlan`.
By default each run of the plan is the backend's own nonblocking call
(``async_op=True``), so every backend has them; the MPI backend overrides them
with MPI-4 persistent requests bound to the arrays.

"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from .._world import world
from ..diagnose import stall
from ..errors import DistBackendError
from ..work import SPINS_IDLE_CORES, SPINS_OVERSUBSCRIBED, Work

_NOTHING = contextlib.nullcontext()  # stateless and reentrant: one for every coalescing() that groups nothing


class PersistentPlan:
    """What a backend makes for a persistent operation; ``mpidist.persistent.Persistent`` runs it.

    Either ``req``, a persistent MPI request bound to the arrays (each run:
    ``pre()``, ``req.Start()``; once ``test()`` is true: ``post()``), or, where the
    backend has no persistent requests, ``begin``: each run calls it and waits for
    the :class:`~mpidist.work.Work` it returns (the backend's nonblocking call).

    Attributes:
        owner: the backend that made it (timeout errors, stuck requests, spins, group name).
        op: the operation's name in messages, e.g. ``"persistent all_reduce"``.
        seq: the group's call number of its creation (the same on every rank), or the
            sender's point-to-point number for ``send_init``/``recv_init``.
        req, test, pre, post: the persistent request; how to test it (default
            ``req.Test``); what to do before each start and after each completion.
        begin: the fallback's start (returns a Work).
        cancel: for a receive, ``cancel(limit)`` after a timeout: True if the run was
            cancelled (nothing is left pending), False if its message completed it
            meanwhile, None if it is still pending.
        release: frees the request (``MPI_Request_free``), or None.
        keep: the buffers MPI uses, referenced as long as the plan exists.
        p2p: a send or receive (its starts are traced, never compared across ranks).
        debug, text, nbytes: the group's DebugBackend, which traces and checks starts
            while the debug level is above OFF, and the description it logs.
    """

    __slots__ = ("owner", "op", "seq", "req", "test", "pre", "post", "begin", "cancel", "release", "keep",
                 "p2p", "debug", "text", "nbytes", "timeout_s")  # fmt: skip

    def __init__(
        self,
        owner: BaseBackend,
        op: str,
        seq: int,
        keep: Any,
        req: Any = None,
        begin: Callable[[], Work] | None = None,
        pre: Callable[[], None] | None = None,
        post: Callable[[], None] | None = None,
        test: Callable[[], Any] | None = None,
        release: Callable[[], None] | None = None,
        cancel: Callable[[float], bool | None] | None = None,
        p2p: bool = False,
    ) -> None:
        self.owner = owner
        self.op = op
        self.seq = seq
        self.keep = keep
        self.req = req
        self.begin = begin
        self.pre = pre
        self.post = post
        self.test = test if test is not None or req is None else req.Test
        self.release = release
        self.cancel = cancel
        self.p2p = p2p
        self.debug: Any = None
        self.text = op
        self.nbytes = 0
        self.timeout_s = owner.timeout_s


class BaseBackend(ABC):
    """Base class of backends: one instance per process group.

    A third-party backend subclasses it (or ``mpidist.backends.mpi.MPIBackend``,
    to change a few calls) and is registered with ``Backend.register_backend``.
    Its methods take arrays already checked and made contiguous by the public
    functions, and group ranks; each returns a ``Work`` when asked for
    ``async_op`` (else None once the call is complete) and raises
    ``DistBackendError`` on failures and timeouts (``backend_error`` and
    ``timeout_failure`` build them). The abstract methods are the collectives
    and ``send``/``recv``; ``mpidist/backends/base.py`` lists the full interface.

    Args:
        rank: This process's rank in the group.
        size: The group's size.
        timeout_s: The group's timeout, in seconds.
        group_name: The group's name, shown in errors.
        global_ranks: The members' global ranks, for timeout diagnoses.

    Examples:
        >>> from mpidist.backends.mpi import MPIBackend
        >>> class CountingBackend(MPIBackend):
        ...     name = "counting"
        ...     calls = 0
        ...     def all_reduce(self, buf, backs, op, async_op):
        ...         self.calls += 1
        ...         return super().all_reduce(buf, backs, op, async_op)
    """

    #: the name ``get_backend()`` reports
    name: str = "undefined"

    def __init__(
        self, rank: int, size: int, timeout_s: float, group_name: str = "", global_ranks: list[int] | None = None
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.group_name = group_name
        self.global_ranks = global_ranks  # members' world ranks, for timeout diagnoses
        self.seq = 0  # collectives issued on this group (the same on every rank)
        self.p2p_seq = 0  # point-to-point calls issued here (differs between ranks)
        # messages this rank sent and receives it made on this backend: summed over the members, equal
        # when every message was received (destroy_process_group frees the communicators only then)
        self.sent = 0
        self.received = 0
        self._stuck: list[Any] = []
        # tests before a wait yields the CPU (see work.poll): long if this node has a core per rank
        self.spins = SPINS_OVERSUBSCRIBED if world.init_info.oversubscribed else SPINS_IDLE_CORES
        # ... and what the C calls take (``_direct.c``'s spin): negative with more ranks than cores, where
        # they go on testing with a yield between tests, without Python in the loop
        self.c_spins = -self.spins if world.init_info.oversubscribed else self.spins

    # -- errors shared by every backend ------------------------------------------------
    def describe(self) -> str:
        return f"group {self.group_name or '?'} ({self.name}, rank {self.rank} of {self.size})"

    def backend_error(self, op: str, seq: int, exc: BaseException) -> DistBackendError:
        """Wrap a library error of call ``seq`` in a DistBackendError."""
        return DistBackendError(f"{op} (call #{seq}) on {self.describe()} failed: {exc}")

    def timeout_failure(
        self, op: str, seq: int, timeout_s: float, note: str = "", settled: bool = False
    ) -> DistBackendError:
        """Diagnose call ``seq``, which did not complete within ``timeout_s``, and return its error.

        It reads what the other members are waiting in from the default store
        (``stall.survey``, three beats: 0.3 to 3 s; never a message to a
        member, which may be dead) so the message can say who has not arrived. Under
        ``MPIDIST_ABORT_ON_TIMEOUT=1``, ``world.init_info.on_timeout`` ends the job instead.
        ``note`` (a sentence) tells what became of the call; ``settled`` means nothing
        of it is left pending (a cancelled receive), so the group is still usable.
        Otherwise the call is recorded as stuck: at exit, a process that still has
        one aborts the job instead of finalizing MPI (``launch/abort.py``).
        """
        where = ""
        if self.global_ranks is not None and self.size > 1:
            with stall.waiting(self.group_name, op, seq):  # others that time out too may ask us
                answers = stall.survey(self.global_ranks, 3 * stall.beat_interval(timeout_s))
            if answers:
                where = " " + stall.explain(answers, self.global_ranks)
        if settled:
            end = "The group is still usable."
        else:
            end = (
                "The group is unusable now (the call is still pending inside MPI): destroy it, or end "
                "the job (mpidist.abort_process_group)."
            )
            world.timed_out.append((self, op, seq))
        error = DistBackendError(
            f"{op} (call #{seq}) on {self.describe()} did not complete within the timeout of "
            f"{timeout_s:g} s.{where}{' ' + note if note else ''} {end}"
        )
        if world.init_info.on_timeout is not None:
            world.init_info.on_timeout(error)  # MPIDIST_ABORT_ON_TIMEOUT=1: ends the job (launch/abort.py)
        return error

    def keep_stuck(self, reqs: Any, keep: Any) -> None:
        """Keep the requests and buffers of an operation that timed out alive forever.

        MPI may still write into them, so they must never be freed.
        """
        self._stuck.append((reqs, keep))

    def adopt(self, reqs: Any, keep: Any) -> None:
        """Keep the requests and buffers of a Work that was dropped before completing."""
        self._stuck.append((reqs, keep))

    def pending(self) -> bool:
        """True while operations that timed out or were dropped may still be running in the library."""
        return bool(self._stuck)

    def takes(self, arr: Any) -> bool:
        """True if this backend can run calls on the device array ``arr`` (device backends override)."""
        return True

    def calls_issued(self) -> int:
        """Collectives issued through this backend (the same count on every rank of the group)."""
        return self.seq

    def p2p_calls_issued(self) -> int:
        """Point-to-point operations posted through this backend by this rank."""
        return self.p2p_seq

    def coalescing(self) -> ContextManager[None]:
        """A block whose sends and receives the backend may issue as one group (NCCL); by default nothing."""
        return _NOTHING

    def shutdown(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the backend's resources (``destroy_process_group``)."""

    def abandon(self) -> None:  # noqa: B027 - optional hook, nothing to stop by default
        """The group was given up without its members agreeing (``shrink_group``): stop what runs on
        the device, without blocking the caller (nccl: abort the communicator). MPI: nothing."""

    # -- collectives -----------------------------------------------------------------
    @abstractmethod
    def broadcast(self, buf: np.ndarray, backs: Any, root: int, async_op: bool) -> Work | None: ...

    @abstractmethod
    def all_reduce(self, buf: np.ndarray, backs: Any, op: Any, async_op: bool) -> Work | None: ...

    @abstractmethod
    def reduce(self, buf: np.ndarray, backs: Any, op: Any, root: int, async_op: bool) -> Work | None: ...

    @abstractmethod
    def all_gather(self, outs: Sequence[np.ndarray], backs: Any, inp: np.ndarray, async_op: bool) -> Work | None: ...

    @abstractmethod
    def all_gather_into_tensor(self, out: np.ndarray, backs: Any, inp: np.ndarray, async_op: bool) -> Work | None: ...

    @abstractmethod
    def gather(
        self, inp: np.ndarray, outs: Sequence[np.ndarray] | None, backs: Any, root: int, async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def scatter(
        self, out: np.ndarray, backs: Any, ins: Sequence[np.ndarray] | None, root: int, async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def reduce_scatter(
        self, out: np.ndarray, backs: Any, ins: Sequence[np.ndarray], op: Any, async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def reduce_scatter_tensor(
        self, out: np.ndarray, backs: Any, inp: np.ndarray, op: Any, async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def all_to_all_single(
        self,
        out: np.ndarray,
        backs: Any,
        inp: np.ndarray,
        out_counts: Sequence[int] | None,
        in_counts: Sequence[int] | None,
        async_op: bool,
    ) -> Work | None:
        """Counts are in elements, one per rank; None means equal splits."""

    @abstractmethod
    def all_to_all(
        self, outs: Sequence[np.ndarray], backs: Any, ins: Sequence[np.ndarray], async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def barrier(self, async_op: bool) -> Work | None: ...

    def timed_barrier(self, timeout_s: float) -> Work | None:
        """``barrier(async_op=True)`` for ``barrier(timeout=...)``: the caller bounds the Work's wait by ``timeout_s``.

        A backend that waits before it posts (DETAIL's check) bounds that wait by ``timeout_s`` too.
        """
        return self.barrier(True)

    # -- point-to-point ---------------------------------------------------------------
    @abstractmethod
    def send(self, buf: np.ndarray, peer: int, tag: int) -> Work: ...

    @abstractmethod
    def recv(self, buf: np.ndarray, backs: Any, peer: int | None, tag: int) -> Work:
        """``peer`` None receives from any rank; ``Work.source_rank()`` tells which."""

    def recv_blocking(self, buf: np.ndarray, backs: Any, peer: int | None, tag: int) -> Work:
        """``recv`` for a caller that waits for the Work at once (blocking ``recv``).

        A backend may then match the message before writing into ``buf`` (the MPI
        backend does), so that a message of another size leaves ``buf`` untouched
        and a receive that times out leaves nothing posted. By default: ``recv``.
        """
        return self.recv(buf, backs, peer, tag)

    def isend_fast(self, buf: np.ndarray, peer: int, tag: int) -> Any:
        """``isend`` of the caller's own C-contiguous numpy array (its only output): ``send``'s Work,
        or a lighter one with the same methods (``MPIBackend``'s, made in C)."""
        return self.send(buf, peer, tag).with_outputs([buf])

    def irecv_fast(self, buf: np.ndarray, peer: int | None, tag: int) -> Any:
        """``irecv`` into the caller's own writeable C-contiguous numpy array: as :meth:`isend_fast`."""
        return self.recv(buf, None, peer, tag).with_outputs([buf])

    def send_and_wait(self, buf: np.ndarray, peer: int, tag: int) -> None:
        """Blocking ``send``: post it and wait within the timeout (a backend may do both in one call)."""
        self.send(buf, peer, tag).wait()

    def recv_and_wait(self, buf: np.ndarray, backs: Any, peer: int | None, tag: int) -> int:
        """Blocking ``recv`` (as ``recv_blocking``, waited for); return the source's group rank."""
        w = self.recv_blocking(buf, backs, peer, tag)
        w.wait()
        return w.source_rank()

    # -- persistent operations: by default each run is the backend's nonblocking call ----------
    def _nonblocking_plan(self, op: str, begin: Callable[[], Any], keep: Any, p2p: bool = False) -> PersistentPlan:
        """A plan whose every run is ``begin()``, a call with ``async_op=True`` (or isend/irecv)."""
        seq = self.p2p_calls_issued() if p2p else self.calls_issued()
        return PersistentPlan(self, op, seq, keep, begin=begin, p2p=p2p)

    def broadcast_init(self, buf: np.ndarray, backs: Any, root: int) -> PersistentPlan:
        return self._nonblocking_plan("broadcast", lambda: self.broadcast(buf, backs, root, True), buf)

    def all_reduce_init(self, buf: np.ndarray, backs: Any, op: Any) -> PersistentPlan:
        return self._nonblocking_plan("all_reduce", lambda: self.all_reduce(buf, backs, op, True), buf)

    def reduce_init(self, buf: np.ndarray, backs: Any, op: Any, root: int) -> PersistentPlan:
        return self._nonblocking_plan("reduce", lambda: self.reduce(buf, backs, op, root, True), buf)

    def all_gather_into_tensor_init(self, out: np.ndarray, backs: Any, inp: np.ndarray) -> PersistentPlan:
        begin = lambda: self.all_gather_into_tensor(out, backs, inp, True)  # noqa: E731
        return self._nonblocking_plan("all_gather_into_tensor", begin, (out, inp))

    def reduce_scatter_tensor_init(self, out: np.ndarray, backs: Any, inp: np.ndarray, op: Any) -> PersistentPlan:
        begin = lambda: self.reduce_scatter_tensor(out, backs, inp, op, True)  # noqa: E731
        return self._nonblocking_plan("reduce_scatter_tensor", begin, (out, inp))

    def all_to_all_single_init(
        self,
        out: np.ndarray,
        backs: Any,
        inp: np.ndarray,
        out_counts: Sequence[int] | None,
        in_counts: Sequence[int] | None,
    ) -> PersistentPlan:
        begin = lambda: self.all_to_all_single(out, backs, inp, out_counts, in_counts, True)  # noqa: E731
        return self._nonblocking_plan("all_to_all_single", begin, (out, inp))

    def send_init(self, buf: np.ndarray, peer: int, tag: int) -> PersistentPlan:
        return self._nonblocking_plan("send", lambda: self.send(buf, peer, tag), buf, p2p=True)

    def recv_init(self, buf: np.ndarray, backs: Any, peer: int | None, tag: int) -> PersistentPlan:
        return self._nonblocking_plan("recv", lambda: self.recv(buf, backs, peer, tag), buf, p2p=True)


class WrapperBackend(BaseBackend):
    """A backend that runs every call through another one (``inner``), adding work around it.

    Its identity and state are the inner backend's: the call counters, what is still
    pending, its description. ``DebugBackend`` (tracing, DETAIL checks) and
    ``MPIDeviceBackend`` (device arrays over MPI) are wrappers.
    """

    def __init__(self, inner: BaseBackend) -> None:
        super().__init__(inner.rank, inner.size, inner.timeout_s, inner.group_name, inner.global_ranks)
        self.inner = inner
        self.name = inner.name

    def describe(self) -> str:
        return self.inner.describe()

    def calls_issued(self) -> int:
        return self.inner.calls_issued()

    def p2p_calls_issued(self) -> int:
        return self.inner.p2p_calls_issued()

    def pending(self) -> bool:
        return self.inner.pending()

    def takes(self, arr: Any) -> bool:
        return self.inner.takes(arr)

    def coalescing(self) -> ContextManager[None]:
        return self.inner.coalescing()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def abandon(self) -> None:
        self.inner.abandon()
