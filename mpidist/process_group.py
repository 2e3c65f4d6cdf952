"""``ProcessGroup``: a set of ranks with a backend, and rank translation."""

from __future__ import annotations

import contextlib
import operator
import sys
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

from numpy import ndarray

from ._world import world
from .arrays.device import DeviceArray
from .arrays.host import Buffer, prepare_input
from .backends.base import BaseBackend, PersistentPlan
from .diagnose.debug import DebugBackend, DebugLevel
from .errors import DefaultGroupStateError, DistError, RankNotInGroupError
from .work import Work

#: a backend's coalescing() that groups nothing (BaseBackend's): its batches may be posted one operation at a time
_NO_COALESCING = BaseBackend.coalescing

#: how long destroy_process_group waits for the other members before leaving the communicators allocated
_FREE_AGREEMENT_S = 5.0

#: write-backs of staged outputs: ``(buffer, caller's array)`` pairs, or None
Backs = Optional[list[tuple[Buffer, Buffer]]]

__all__ = [
    "ProcessGroup",
    "GroupMember",
    "group",
    "resolve_group",
    "absent",
    "rank_int",
    "NON_GROUP_MEMBER",
]


#: the index of a backend's DebugBackend in its levels (see _levels)
_TRACED = 1


def _levels(backend: BaseBackend, pg: ProcessGroup) -> tuple[BaseBackend, BaseBackend, BaseBackend]:
    """A backend as each debug level calls it: plain at OFF, through its DebugBackend at INFO and DETAIL."""
    traced = DebugBackend(backend, pg)
    return (backend, traced, traced)


class ProcessGroup:
    """A group of processes that communicate through one backend.

    Created by ``init_process_group`` (the default group) and ``new_group``;
    pass it as ``group=`` to any collective. ``rank()`` and ``size()`` are this
    process's rank in the group and the group's size; ``ranks`` lists the members'
    global ranks in group-rank order.

    It is the one place a call is routed: each collective has a method here that
    takes prepared arrays (``mpidist.arrays.host.prepare_*``) and group ranks, picks
    the backend (host arrays: the host backend; device arrays: the device backend;
    the debug wrapper while the debug level is above OFF) and makes one call.
    The backends are fixed when the group is made; only a device backend that
    depends on the kind of device array (NCCL for GPU memory, MPI for others) is
    made on the first call that needs it, by ``device_maker``.

    Examples:
        >>> pair = dist.new_group([0, 1])
        >>> pair.rank(), pair.size(), pair.ranks
        (0, 2, [0, 1])  # rank 0
        (1, 2, [0, 1])  # rank 1
        >>> dist.all_reduce(np.ones(2), group=pair)
    """

    def __init__(
        self,
        host: BaseBackend | None,
        device: BaseBackend | None,
        control: Any,
        ranks: list[int],
        group_name: str,
        timeout: timedelta,
        backend_name: str,
        devices: dict[str, str],
        comm: Any = None,
        group_desc: str = "",
        device_maker: Callable[[ProcessGroup, str, Any], BaseBackend] | None = None,
    ) -> None:
        self.control = control  # MPIBackend over a private duplicate: library traffic (objects, barriers)
        self.ranks = ranks
        self.group_name = group_name
        self.group_desc = group_desc or group_name
        self.timeout = timeout
        self.backend_name = backend_name
        self.devices = devices
        self._comm = comm
        self._rank = control.rank
        self._size = len(ranks)
        self._identity = ranks == list(range(len(ranks)))
        self._group_of = {g: i for i, g in enumerate(ranks)}
        self.destroyed = False
        self._host = None if host is None else _levels(host, self)
        self._device = None if device is None else _levels(device, self)
        # the host-packed buffers of *_coalesced calls: the host backend, or the control's on a device-only group
        self._packing = self._host or _levels(control, self)
        self._device_maker = device_maker
        self._made: list[tuple[BaseBackend, ...]] = []  # device backends made on first use (at most two)
        # the route of the common case, a dict lookup: host arrays to the host backend (none on device-only groups)
        self._route: dict[type, tuple[BaseBackend, ...]] = {} if self._host is None else {ndarray: self._host}
        self.refusal: str | None = None  # why this group refuses every call on this rank (see failed_alone)
        #: the live persistent operations made on this group (mpidist.persistent.Persistent), freed by shutdown
        self.persistent: weakref.WeakSet[Any] = weakref.WeakSet()
        if "torch" in sys.modules:  # events in torch's profiler while one runs (no cost per call otherwise)
            from .diagnose import profiler

            profiler.register(ProcessGroup, profiler.CORE_METHODS, profiler.core_label)
            profiler.watch()

    # -- routing: each method below takes ``(self._route.get(type(x)) or self._levels(...))[world.debug_level]``
    def _levels(self, fn: str, a: Any, b: Any = None) -> tuple[BaseBackend, ...]:
        """The backend (by debug level) for a call on prepared arrays ``a`` and ``b`` (arrays, lists, None)
        that the route of the common case did not take: device arrays, lists of arrays, or a refusal."""
        if self.refusal is not None:
            self._refuse(fn)
        d = _first_device(a) or _first_device(b)
        if d is not None:
            return self._device_levels(fn, d)
        if self._host is None:
            raise TypeError(
                f"{fn}: process group {self.group_name} has backend {self.backend_name}, which takes CUDA "
                "arrays only; got a host array (numpy or CPU tensor); create the group with "
                "backend='cpu:mpi,cuda:nccl' to use both"
            )
        return self._host

    def _device_levels(self, fn: str, arr: DeviceArray) -> tuple[BaseBackend, ...]:
        """The group's device backend if it takes ``arr``, else one made for such arrays (on first use)."""
        for levels in (self._device, *self._made):
            if levels is not None and levels[0].takes(arr):
                return levels
        if self._device_maker is None:
            raise TypeError(
                f"{fn}: process group {self.group_name} (backend {self.backend_name}) takes no device arrays"
            )
        made = _levels(self._device_maker(self, fn, arr), self)
        self._made.append(made)
        return made

    # -- a call that failed on some ranks only ---------------------------------------------
    def failed_alone(self, fn: str, exc: Exception) -> Exception:
        """Keep a call that failed a check only this rank makes from leaving the group out of step; return ``exc``.

        Such checks are a root's lists (``gather_list``, ``scatter_list``) and a
        receiver's outputs: the other ranks pass their checks and post their part of
        the call, which a later call of this rank could otherwise receive as its data.

        At debug level DETAIL the other ranks are already exchanging descriptions of
        the call: the failure goes into that exchange, every rank raises it at once,
        nothing is sent and the group stays usable. Otherwise this group refuses every
        later call on this rank with a DistError that names the failed call.
        """
        if self._size == 1:
            return exc  # no other rank: nothing can be in flight
        backend = (self._host or self._device or self._packing)[world.debug_level]
        if world.debug_level >= DebugLevel.DETAIL and isinstance(backend, DebugBackend):
            backend.share_failure(fn, exc)
        else:
            self.refusal = (
                f"{fn} (call #{backend.calls_issued() + 1}) failed on this rank only ({type(exc).__name__}: {exc}) "
                "while the other ranks may have sent their part of it"
            )
            self._route = {}  # every call now takes _levels, which refuses it
            for p in list(self.persistent):  # and so does every start of the persistent operations made before
                p._group_refused(lambda: self._refuse("Persistent.start"))
        return exc

    def failed_in_role(self, fn: str, exc: Exception, *tensor: Any) -> Exception:
        """``exc``: a check this rank makes in its role (root, receiver) failed; return it to raise.

        The other ranks may have passed theirs and sent their part, so the group is
        told (:meth:`failed_alone`) unless the ``tensor`` given fails as a plain input
        too: a bad array, which every rank of an SPMD program passes alike.
        """
        if tensor:
            try:
                prepare_input(tensor[0], fn, "tensor")
            except (TypeError, ValueError):
                return exc
        return self.failed_alone(fn, exc)

    def _refuse(self, fn: str) -> None:
        raise DistError(
            f"{fn}: process group {self.group_name} is unusable on this rank: {self.refusal}. A later call could "
            "receive that data, so the group refuses every call; create a new group (new_group), or run with "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL, where every rank raises such an error at once and the group stays usable"
        )

    def backend(self, device: str = "cpu") -> BaseBackend | None:
        """The backend a call on ``device`` ("cpu" or "cuda") arrays runs on now: at a debug level above
        OFF its DebugBackend. None if the group has none (yet: device backends made on first use)."""
        if device == "cpu":
            levels = self._host
        elif device == "cuda":
            levels = self._device or next(iter(self._made), None)
        else:
            raise ValueError(f"ProcessGroup.backend: device must be 'cpu' or 'cuda', got {device!r}")
        return None if levels is None else levels[world.debug_level]

    def calls_issued(self) -> int:
        """Collectives issued on this group so far (the same count on every rank)."""
        return (self._host or self._device or self._packing)[0].calls_issued()

    def p2p_calls_issued(self) -> int:
        """Point-to-point operations this rank posted on this group's host (or only) backend."""
        return (self._host or self._device or self._packing)[0].p2p_calls_issued()

    # -- collectives: prepared arrays and group ranks in, one backend call --------------
    def broadcast(self, buf: Buffer, backs: Backs, root: int, async_op: bool) -> Work | None:
        b = (self._route.get(type(buf)) or self._levels("broadcast", buf))[world.debug_level]
        return b.broadcast(buf, backs, root, async_op)

    def all_reduce(self, buf: Buffer, backs: Backs, op: Any, async_op: bool) -> Work | None:
        b = (self._route.get(type(buf)) or self._levels("all_reduce", buf))[world.debug_level]
        return b.all_reduce(buf, backs, op, async_op)

    def reduce(self, buf: Buffer, backs: Backs, op: Any, root: int, async_op: bool) -> Work | None:
        b = (self._route.get(type(buf)) or self._levels("reduce", buf))[world.debug_level]
        return b.reduce(buf, backs, op, root, async_op)

    def all_gather(self, outs: list[Buffer], backs: Backs, inp: Buffer, async_op: bool) -> Work | None:
        b = self._levels("all_gather", inp, outs)[world.debug_level]
        return b.all_gather(outs, backs, inp, async_op)

    def all_gather_into_tensor(self, out: Buffer, backs: Backs, inp: Buffer, async_op: bool) -> Work | None:
        b = (type(inp) is type(out) and self._route.get(type(out)) or self._levels("all_gather_into_tensor", out, inp))[
            world.debug_level
        ]
        return b.all_gather_into_tensor(out, backs, inp, async_op)

    def gather(self, inp: Buffer, outs: list[Buffer] | None, backs: Backs, root: int, async_op: bool) -> Work | None:
        b = self._levels("gather", inp, outs)[world.debug_level]
        return b.gather(inp, outs, backs, root, async_op)

    def scatter(self, out: Buffer, backs: Backs, ins: list[Buffer] | None, root: int, async_op: bool) -> Work | None:
        b = self._levels("scatter", out, ins)[world.debug_level]
        return b.scatter(out, backs, ins, root, async_op)

    def reduce_scatter(self, out: Buffer, backs: Backs, ins: list[Buffer], op: Any, async_op: bool) -> Work | None:
        b = self._levels("reduce_scatter", out, ins)[world.debug_level]
        return b.reduce_scatter(out, backs, ins, op, async_op)

    def reduce_scatter_tensor(self, out: Buffer, backs: Backs, inp: Buffer, op: Any, async_op: bool) -> Work | None:
        b = (type(inp) is type(out) and self._route.get(type(out)) or self._levels("reduce_scatter_tensor", out, inp))[
            world.debug_level
        ]
        return b.reduce_scatter_tensor(out, backs, inp, op, async_op)

    def all_to_all_single(
        self, out: Buffer, backs: Backs, inp: Buffer, out_counts: Any, in_counts: Any, async_op: bool
    ) -> Work | None:
        b = (type(inp) is type(out) and self._route.get(type(out)) or self._levels("all_to_all_single", out, inp))[
            world.debug_level
        ]
        return b.all_to_all_single(out, backs, inp, out_counts, in_counts, async_op)

    def all_to_all(self, outs: list[Buffer], backs: Backs, ins: list[Buffer], async_op: bool) -> Work | None:
        b = self._levels("all_to_all", outs, ins)[world.debug_level]
        return b.all_to_all(outs, backs, ins, async_op)

    def barrier(self, async_op: bool, timeout_s: float | None = None) -> Work | None:
        """``timeout_s``: the barrier's own timeout; the Work returned (``async_op`` must be True) is waited for within it."""
        if self.refusal is not None:
            self._refuse("barrier")
        b = (self._host or self._device or self._packing)[world.debug_level]
        return b.barrier(async_op) if timeout_s is None else b.timed_barrier(timeout_s)

    def all_reduce_packed(self, packed: ndarray, backs: Backs, op: Any, async_op: bool) -> Work | None:
        """``all_reduce`` of a host buffer mpidist packed itself (``all_reduce_coalesced``), on any group."""
        if self.refusal is not None:
            self._refuse("all_reduce_coalesced")
        return self._packing[world.debug_level].all_reduce(packed, backs, op, async_op)

    def all_gather_packed(self, out: ndarray, backs: Backs, inp: ndarray, async_op: bool) -> Work | None:
        """``all_gather_into_tensor`` of host buffers mpidist packed itself (``all_gather_coalesced``)."""
        if self.refusal is not None:
            self._refuse("all_gather_coalesced")
        return self._packing[world.debug_level].all_gather_into_tensor(out, backs, inp, async_op)

    def send(self, buf: Buffer, peer: int, tag: int) -> Work:
        return (self._route.get(type(buf)) or self._levels("send", buf))[world.debug_level].send(buf, peer, tag)

    def recv(self, buf: Buffer, backs: Backs, peer: int | None, tag: int) -> Work:
        b = (self._route.get(type(buf)) or self._levels("recv", buf))[world.debug_level]
        return b.recv(buf, backs, peer, tag)

    def isend_fast(self, buf: ndarray, peer: int, tag: int) -> Work:
        """``isend`` of the caller's own ready numpy array (``BaseBackend.isend_fast``): its outputs are named."""
        return self._route[ndarray][world.debug_level].isend_fast(buf, peer, tag)

    def irecv_fast(self, buf: ndarray, peer: int | None, tag: int) -> Work:
        """``irecv`` into the caller's own ready numpy array (``BaseBackend.irecv_fast``)."""
        return self._route[ndarray][world.debug_level].irecv_fast(buf, peer, tag)

    def recv_blocking(self, buf: Buffer, backs: Backs, peer: int | None, tag: int) -> Work:
        """A receive the caller waits for at once (``BaseBackend.recv_blocking``)."""
        b = (self._route.get(type(buf)) or self._levels("recv", buf))[world.debug_level]
        return b.recv_blocking(buf, backs, peer, tag)

    def send_and_wait(self, buf: Buffer, peer: int, tag: int) -> None:
        """Blocking ``send``: posted and waited for in one backend call."""
        b = (self._route.get(type(buf)) or self._levels("send", buf))[world.debug_level]
        b.send_and_wait(buf, peer, tag)

    def recv_and_wait(self, buf: Buffer, backs: Backs, peer: int | None, tag: int) -> int:
        """Blocking ``recv`` (``BaseBackend.recv_and_wait``); returns the source's group rank."""
        b = (self._route.get(type(buf)) or self._levels("recv", buf))[world.debug_level]
        return b.recv_and_wait(buf, backs, peer, tag)

    def batch_p2p(self, ops: list[tuple[bool, Buffer, Backs, int, int]]) -> list[Work]:
        """Post ``(is_send, buffer, backs, peer, tag)`` sends and receives as one batch.

        Each backend involved issues its share inside its ``coalescing()`` block (NCCL: one group).
        """
        level = world.debug_level
        backends = [(self._route.get(type(op[1])) or self._levels("batch_isend_irecv", op[1]))[level] for op in ops]
        distinct = dict.fromkeys(backends)  # in order of first use; mostly one
        if len(distinct) == 1:
            with backends[0].coalescing():
                return _post_p2p(backends, ops)
        with contextlib.ExitStack() as batch:
            for backend in distinct:
                batch.enter_context(backend.coalescing())
            return _post_p2p(backends, ops)

    def batch_fast(self, ops: list[tuple[bool, ndarray, int, int]]) -> list[Work] | None:
        """Post ``(is_send, array, peer, tag)`` of the caller's own ready numpy arrays as ``isend_fast`` and
        ``irecv_fast`` do, one after the other; None (nothing posted) where their backend groups a batch's
        operations (its own ``coalescing``): then ``batch_p2p`` must post them."""
        levels = self._route.get(ndarray)
        if levels is None:
            return None
        b = levels[world.debug_level]
        if type(b).coalescing is not _NO_COALESCING:
            return None
        return [b.isend_fast(t, peer, tag) if send else b.irecv_fast(t, peer, tag) for send, t, peer, tag in ops]

    # -- persistent operations (mpidist.persistent): routed like the one-off calls --------
    # Creation is rare, so it takes the general route, and always through the DebugBackend (index 1 of
    # the levels): at OFF that only labels the plan, so that its starts can be traced and checked
    # whenever the debug level is raised later.
    def broadcast_init(self, buf: Buffer, backs: Backs, root: int) -> PersistentPlan:
        return self._levels("broadcast_init", buf)[_TRACED].broadcast_init(buf, backs, root)

    def all_reduce_init(self, buf: Buffer, backs: Backs, op: Any) -> PersistentPlan:
        return self._levels("all_reduce_init", buf)[_TRACED].all_reduce_init(buf, backs, op)

    def reduce_init(self, buf: Buffer, backs: Backs, op: Any, root: int) -> PersistentPlan:
        return self._levels("reduce_init", buf)[_TRACED].reduce_init(buf, backs, op, root)

    def all_gather_into_tensor_init(self, out: Buffer, backs: Backs, inp: Buffer) -> PersistentPlan:
        b = self._levels("all_gather_into_tensor_init", out, inp)[_TRACED]
        return b.all_gather_into_tensor_init(out, backs, inp)

    def reduce_scatter_tensor_init(self, out: Buffer, backs: Backs, inp: Buffer, op: Any) -> PersistentPlan:
        b = self._levels("reduce_scatter_tensor_init", out, inp)[_TRACED]
        return b.reduce_scatter_tensor_init(out, backs, inp, op)

    def all_to_all_single_init(
        self, out: Buffer, backs: Backs, inp: Buffer, out_counts: Any, in_counts: Any
    ) -> PersistentPlan:
        b = self._levels("all_to_all_single_init", out, inp)[_TRACED]
        return b.all_to_all_single_init(out, backs, inp, out_counts, in_counts)

    def send_init(self, buf: Buffer, peer: int, tag: int) -> PersistentPlan:
        return self._levels("send_init", buf)[_TRACED].send_init(buf, peer, tag)

    def recv_init(self, buf: Buffer, backs: Backs, peer: int | None, tag: int) -> PersistentPlan:
        return self._levels("recv_init", buf)[_TRACED].recv_init(buf, backs, peer, tag)

    # -- identity ---------------------------------------------------------------------
    def rank(self) -> int:
        """Return this process's rank in the group.

        Returns:
            The rank, from 0 to ``size() - 1`` (``get_rank(group)`` is the same).

        Examples:
            >>> dist.group.WORLD.rank()
            0  # rank 0
            1  # rank 1
        """
        return self._rank

    def size(self) -> int:
        """Return the number of processes in the group.

        Returns:
            The group's size (``get_world_size(group)`` is the same).

        Examples:
            >>> dist.group.WORLD.size()
            2
        """
        return self._size

    def name(self) -> str:
        """Return the backend's name (torch's ``ProcessGroup.name()``).

        Returns:
            The name the group's backend was asked by, as ``get_backend(group)``.

        Examples:
            >>> dist.group.WORLD.name()
            'mpi'
        """
        return self.backend_name

    def shutdown(self) -> None:
        """Mark the group destroyed and free its backends and communicators."""
        if self.destroyed:
            return
        self.destroyed = True
        for p in list(self.persistent):
            p._group_destroyed()  # free their requests while the communicator still exists
        backends = [levels[0] for levels in (*self._made, self._device, self._host) if levels is not None]
        # a refused group (failed_alone) counts as pending: the other ranks' part of the failed call may be in flight
        pending = self.refusal is not None or any(b.pending() for b in backends) or self.control.pending()
        # calls made on the control and the other backends, alike on every member (MPIBackend.agree_to_free);
        # summed over the backends so that the state has one length on every rank (device backends are made
        # on first use: a rank may have one that another has not)
        state = [int(pending), self.control.seq, sum(b.seq for b in backends)]
        every = [*backends, self.control]
        messages = (sum(b.sent for b in every), sum(b.received for b in every))
        agreed = self.control.agree_to_free(state, messages, min(self.control.timeout_s, _FREE_AGREEMENT_S))
        if not agreed:
            self.control.keep_comm()  # a member may still send on the communicators: never free them
        for b in backends:
            b.shutdown()
        self.control.shutdown()
        if self._comm is None:
            return
        if agreed and not pending:
            self._comm.Free()
        else:  # MPI may still deliver into it (see MPIBackend.shutdown), or the other ranks' part of the
            # call that failed here waits in it: freed, its context could be reused by a later group
            world.unreleased.append(self._comm)

    def abandon(self) -> None:
        """Mark the group destroyed without a word to its members (``shrink_group``: some are dead or
        left out, so no agreement to free can complete). Its communicators stay allocated for the
        life of the process, as after a timeout."""
        if self.destroyed:
            return
        self.destroyed = True
        world.unreleased.append(self)
        for backend in self.backends():
            with contextlib.suppress(Exception):  # best effort: the group is given up either way
                backend.abandon()  # nccl: the old communicator is aborted, off this thread

    def backends(self) -> list[BaseBackend]:
        """The group's backends (host, device, those made on first use), without the debug wrappers."""
        return [levels[0] for levels in (*self._made, self._device, self._host) if levels is not None]

    def communicators(self) -> list[Any]:
        """The MPI communicators the group calls on: its own and its control's."""
        return [c for c in (self._comm, getattr(self.control, "comm", None)) if c is not None]

    @property
    def mpi_comm(self) -> Any:
        """The group's private MPI communicator (an ``mpi4py.MPI.Comm``), for use with mpi4py.

        mpidist's own calls on the group use it too, so messages of the program's
        mpi4py calls on it must not be pending while mpidist calls run. None for a
        group without an MPI communicator.

        Examples:
            >>> comm = dist.group.WORLD.mpi_comm
            >>> comm.allreduce(dist.get_rank())
            1  # rank 0 and rank 1
        """
        return self._comm

    def group_rank(self, global_rank: int, fn: str = "get_group_rank", arg: str = "global_rank") -> int:
        """Translate a global rank into this group's rank, or raise RankNotInGroupError."""
        global_rank = rank_int(global_rank, fn, arg)
        r = self._group_of.get(global_rank)
        if r is None:
            raise RankNotInGroupError(
                f"{fn}: {arg}={global_rank} is not a member of process group {self.group_name} "
                f"(its global ranks: {_short(self.ranks)})"
            )
        return r

    def root_rank(
        self, global_rank: Any, group_rank: Any, fn: str, names: tuple[str, str], default: int | None = None
    ) -> int:
        """The group rank a call's root argument names: ``global_rank`` or ``group_rank`` (exactly one of them).

        ``names`` are the two parameters' names (``("src", "group_src")``) for the errors;
        ``default`` (a global rank) stands for neither given. Raises ValueError (both,
        or neither and no default) or RankNotInGroupError (not a member, out of range).
        """
        if group_rank is None and type(global_rank) is int:  # the common case: one lookup in the group's table
            r = self._group_of.get(global_rank)
            if r is not None:
                return r
        if group_rank is not None:
            if global_rank is not None:
                raise ValueError(f"{fn}: pass either {names[0]} (global rank) or {names[1]} (group rank), not both")
            r = rank_int(group_rank, fn, names[1])
            if not 0 <= r < self._size:
                raise RankNotInGroupError(f"{fn}: {names[1]}={r} is out of range for a group of size {self._size}")
            return r
        if global_rank is None:
            if default is None:
                raise ValueError(f"{fn}: {names[0]} (a global rank) or {names[1]} (a group rank) is required")
            global_rank = default
        return self.group_rank(global_rank, fn, names[0])

    def is_identity(self) -> bool:
        """True if the group's ranks are the global ranks in order (group rank == global rank)."""
        return self._identity

    def global_rank(self, group_rank: int, fn: str = "get_global_rank", arg: str = "group_rank") -> int:
        """Translate a rank of this group into a global rank, or raise RankNotInGroupError."""
        group_rank = rank_int(group_rank, fn, arg)
        if not 0 <= group_rank < len(self.ranks):
            raise RankNotInGroupError(
                f"{fn}: {arg}={group_rank} is out of range for process group {self.group_name} "
                f"of size {len(self.ranks)}"
            )
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        state = " destroyed" if self.destroyed else ""
        return (
            f"<ProcessGroup {self.group_name!r} backend={self.backend_name} "
            f"ranks={_short(self.ranks)} rank={self.rank()}{state}>"
        )


def _post_p2p(backends: list[BaseBackend], ops: list[tuple[bool, Buffer, Backs, int, int]]) -> list[Work]:
    """Post each ``(is_send, buffer, backs, peer, tag)`` of a batch on its backend; return the Works.

    Each takes the route of ``isend``/``irecv`` (``isend_fast``, ``irecv_fast``) unless a receive is staged
    (``backs``: written back on completion); the caller names the outputs (``with_outputs``) afterwards.
    """
    return [
        backend.isend_fast(buf, peer, tag)
        if is_send
        else (backend.irecv_fast(buf, peer, tag) if backs is None else backend.recv(buf, backs, peer, tag))
        for backend, (is_send, buf, backs, peer, tag) in zip(backends, ops)
    ]


def _first_device(arrays: Any) -> DeviceArray | None:
    """The first device array of a prepared argument (an array, a list of arrays, or None)."""
    if type(arrays) is DeviceArray:
        return arrays
    if type(arrays) is list:
        for x in arrays:
            if type(x) is DeviceArray:
                return x
    return None


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def rank_int(rank: Any, fn: str, arg: str) -> int:
    """Return ``rank`` as an int (numpy integers accepted), or raise TypeError."""
    if isinstance(rank, bool) or not hasattr(rank, "__index__"):
        raise TypeError(f"{fn}: {arg} must be an int rank, got {type(rank).__name__}")
    try:
        return operator.index(rank)
    except TypeError:  # an array of more than one element has __index__, which refuses
        raise TypeError(f"{fn}: {arg} must be an int rank, got {type(rank).__name__}") from None


class _NonGroupMember:
    """What ``new_group`` returns on ranks outside the group."""

    _instance: _NonGroupMember | None = None

    def __new__(cls) -> _NonGroupMember:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"

    def __reduce__(self) -> str:
        return "NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember()


class _WorldMeta(type):
    """Gives ``group.WORLD``/``GroupMember.WORLD``: the default group, or None before init."""

    @property
    def WORLD(cls) -> ProcessGroup | None:  # noqa: N802 - torch's name
        return world.default_pg


class group(metaclass=_WorldMeta):  # noqa: N801 - torch's name
    """``group.WORLD`` is the default process group.

    It is None before ``init_process_group`` and after ``destroy_process_group``.

    Examples:
        >>> dist.group.WORLD.size() == dist.get_world_size()
        True
    """


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` (the default group) and ``GroupMember.NON_GROUP_MEMBER``.

    ``NON_GROUP_MEMBER`` is what ``new_group`` returns on ranks outside the group:
    collectives given it do nothing and return None, ``get_rank`` of it is -1.
    (torch uses the integer -100; here it is a sentinel object.)

    Examples:
        >>> g = dist.new_group([0])
        >>> g is dist.GroupMember.NON_GROUP_MEMBER
        False  # rank 0
        True  # rank 1
        >>> dist.get_rank(g)
        0  # rank 0
        -1  # rank 1
    """

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


def not_initialized(fn: str) -> DefaultGroupStateError:
    return DefaultGroupStateError(
        f"{fn}: the default process group is not initialized; call mpidist.init_process_group() first"
    )


def absent(grp: Any, fn: str) -> None:
    """What a call does when ``world.default_pg if grp is None else resolve_group(grp)`` gave None.

    Raise before ``init_process_group``; else (a non-member) return None.
    """
    if grp is None:
        raise not_initialized(fn)
    return None


def resolve_group(grp: Any, fn: str) -> ProcessGroup | None:
    """Return the group a call runs on, None for a non-member, or raise.

    ``None`` means the default group; raises RuntimeError before
    ``init_process_group`` or on a destroyed group, TypeError for a non-group.
    """
    if grp is None:
        pg = world.default_pg
        if pg is None:
            raise not_initialized(fn)
        return pg
    if isinstance(grp, ProcessGroup):
        if grp.destroyed:
            raise RuntimeError(f"{fn}: process group {grp.group_name!r} has been destroyed")
        return grp
    if grp is NON_GROUP_MEMBER:
        if world.default_pg is None:
            raise not_initialized(fn)
        return None
    raise TypeError(f"{fn}: group must be a ProcessGroup (or None for the default group), got {type(grp).__name__}")
