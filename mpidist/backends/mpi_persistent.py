"""Persistent operations on the MPI backend: MPI-4 persistent requests (``MPI_Allreduce_init``, ...).

A persistent request is made once, bound to the arrays, and started again and
again (``MPI_Start``); MPICH then skips most of what a call sets up, which makes a
small persistent collective faster than MPI's own blocking call (see
docs/persistent.md). :class:`MPIPersistent` makes them for one
:class:`~mpidist.backends.mpi.MPIBackend`, which holds it and hands it each
``*_init`` call (a collaborator with the interface its constructor names, not a
mixin: what it uses of the backend is ``BaseBackend``'s counters and errors and
the backend's bounded agreement).

Two rules keep it safe:

* **The same choice on every rank.** A persistent request on one rank and a
  nonblocking call on another for the same collective deadlock. Whether the MPI
  library runs a routine is probed once per process on ``MPI_COMM_SELF``
  (:func:`available`), and every creation starts with an agreement: one all-reduce
  (MIN) of the ranks' answers on the group's communicator (``MPIBackend.agree``).
  Either every rank makes the persistent request or every rank takes the
  nonblocking fallback (a method here returns None, and the backend makes
  ``BaseBackend``'s plan: each run is the one-off call with ``async_op=True``).
* **Bounded.** Initializing a persistent collective is non-local in MPI-4 (it may
  wait for the other ranks) and has no timeout. The agreement is a nonblocking
  call polled within the group's timeout, so once it completes every rank has
  arrived and the initialization cannot hang (as ``MPIBackend.gate`` does before
  communicator creation).

What one MPI call cannot do (AVG, PREMUL_SUM, bfloat16 sums without mpidist's C
ops, outputs staged for layout, an input that overlaps the output) becomes work before each start and
after each completion (``PersistentPlan.pre``/``post``), on buffers allocated once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from .._world import world
from ..arrays import host as _arrays
from ..arrays.host import displacements, then_write_back
from ..reduce_op import RedOpType
from ..work import chain, poll
from .base import BaseBackend, PersistentPlan
from .mpi_receive import arrived, posted_receive, receive_size_error
from .mpi_reductions import reduction_plan
from .mpi_types import BLOCK_VARIANT_LIMIT, TypeEntry, address, bad_dtype

__all__ = ["MPIPersistent", "available"]

IN_PLACE = MPI.IN_PLACE
ERR_TRUNCATE = MPI.ERR_TRUNCATE
ndarray = np.ndarray
_I32 = MPI.INT32_T

#: the routines, and how the probe makes each on MPI_COMM_SELF with one int32 in ``a`` and room in ``b``
_PROBES: dict[str, Callable[[MPI.Comm, ndarray, ndarray], MPI.Prequest]] = {
    "Allreduce_init": lambda c, a, b: c.Allreduce_init([a, _I32], [b, _I32], MPI.SUM),
    "Bcast_init": lambda c, a, b: c.Bcast_init([b, _I32], 0),
    "Reduce_init": lambda c, a, b: c.Reduce_init([a, _I32], [b, _I32], MPI.SUM, 0),
    "Allgather_init": lambda c, a, b: c.Allgather_init([a, _I32], [b, _I32]),
    "Reduce_scatter_block_init": lambda c, a, b: c.Reduce_scatter_block_init([a, _I32], [b, _I32], MPI.SUM),
    "Reduce_scatter_init": lambda c, a, b: c.Reduce_scatter_init([a, _I32], [b, _I32], [1], MPI.SUM),
    "Alltoall_init": lambda c, a, b: c.Alltoall_init([a, _I32], [b, _I32]),
    "Alltoallv_init": lambda c, a, b: c.Alltoallv_init([a, [1], [0], _I32], [b, [1], [0], _I32]),
}


def available(routine: str) -> bool:
    """Whether this MPI library runs the persistent collective ``routine`` (probed once per process).

    The probe makes, starts, completes and frees the request on ``MPI_COMM_SELF``, a
    local operation: an MPI-3 library (no such routine: mpi4py raises
    NotImplementedError) or one that fails it (MPI.Exception) answers False. Tests
    monkeypatch this function to force the nonblocking fallback.
    """
    known = world.persistent_routines.get(routine)
    if known is None:
        a = np.array([7], np.int32)
        b = np.array([0 if routine != "Bcast_init" else 7], np.int32)
        try:
            req = _PROBES[routine](MPI.COMM_SELF, a, b)
            req.Start()
            req.Wait()
            req.Free()
            known = bool(b[0] == 7)
        except (NotImplementedError, MPI.Exception):
            known = False
        world.persistent_routines[routine] = known
    return known


def _free(req: MPI.Prequest) -> None:
    if not MPI.Is_finalized():
        req.Free()


def _separate(inp: ndarray) -> tuple[ndarray, Callable[[], None]]:
    """A buffer for an input that shares memory with the output (MPI forbids aliasing), refreshed each run."""
    copy = np.empty_like(inp)
    count = world.stats.count_copy

    def refresh() -> None:
        np.copyto(copy, inp)
        count(copy.nbytes)

    return copy, refresh


class MPIPersistent:
    """The persistent operations of one MPI backend (see the module docstring).

    Made by the backend with what it uses: ``owner``, the backend (its ``BaseBackend``
    counters ``seq``, ``p2p_seq``, ``sent``, ``received``, its ``spins`` and
    ``backend_error``; the owner of every plan made here), the group's communicator
    ``comm``, its type table ``types``, and ``agree(fn, flags)``, the backend's bounded
    agreement (numbers the creation as a call of the group and returns ``flags``
    ANDed over its ranks; a rank that never creates the operation makes the others
    raise DistBackendError naming ``fn``).

    Each collective method validates nothing new (the public ``*_init`` functions
    did), agrees with the other ranks on persistent or fallback, and returns a
    :class:`~mpidist.backends.base.PersistentPlan` whose request is bound to the
    prepared arrays (or, where staging is needed, to buffers made here once), or
    None where the ranks agreed on the nonblocking fallback.
    """

    __slots__ = ("_owner", "_comm", "_types", "_agree")

    def __init__(
        self,
        owner: BaseBackend,
        comm: MPI.Comm,
        types: dict[np.dtype, TypeEntry],
        agree: Callable[[str, Sequence[bool]], list[bool]],
    ) -> None:
        self._owner = owner
        self._comm = comm
        self._types = types
        self._agree = agree

    # -- plumbing ---------------------------------------------------------------------------
    def _make(self, fn: str, seq: int, create: Callable[[], MPI.Prequest]) -> MPI.Prequest:
        try:
            return create()
        except MPI.Exception as exc:
            raise self._owner.backend_error(fn, seq, exc) from exc

    def _plan(
        self,
        fn: str,
        op: str,
        create: Callable[[], MPI.Prequest],
        keep: Any,
        pre: Callable[[], None] | None = None,
        post: Callable[[], None] | None = None,
    ) -> PersistentPlan:
        """The plan of a collective's persistent request, numbered as the call ``agree`` numbered."""
        owner = self._owner
        req = self._make(fn, owner.seq, create)
        return PersistentPlan(owner, f"persistent {op}", owner.seq, keep, req=req, pre=pre, post=post,
                              release=lambda: _free(req))  # fmt: skip

    def _reduction_init(
        self,
        fn: str,
        op_name: str,
        e: TypeEntry,
        op: Any,
        send: ndarray,
        recv: ndarray | None,
        in_place: bool,
        init: Callable[[Any, Any, MPI.Op], MPI.Prequest],
        backs: Any,
        pre: Callable[[], None] | None = None,
    ) -> PersistentPlan:
        """A persistent reduction ``init(send message, recv message, op)`` (see ``mpi_reductions.reduction_plan``)."""
        smsg, rmsg, mop, prepare, finish, _, bufs = reduction_plan(
            fn, e, op, send, recv, in_place, self._owner.size, self._types
        )
        return self._plan(
            fn, op_name, lambda: init(smsg, rmsg, mop), bufs, chain(pre, prepare), then_write_back(finish, backs)
        )

    def _entry(self, a: ndarray, fn: str) -> TypeEntry:
        return self._types.get(a.dtype) or bad_dtype(a, fn)

    @staticmethod
    def _native(e: TypeEntry, op: Any) -> MPI.Op | None:
        """The MPI op if one MPI call computes ``op`` on the entry's dtype (host arrays: mpidist's C ops
        for float16/bfloat16 count), else None."""
        return e.fast[op] if type(op) is RedOpType else None

    # -- collectives: a plan, or None for the nonblocking fallback ---------------------------------
    def broadcast_init(self, buf: ndarray, backs: Any, root: int) -> PersistentPlan | None:
        fn = "broadcast_init"
        e = self._entry(buf, fn)
        if not self._agree(fn, [available("Bcast_init")])[0]:
            return None
        comm = self._comm
        return self._plan(
            fn, "broadcast", lambda: comm.Bcast_init([buf, e.mpi], root), buf, post=then_write_back(None, backs)
        )

    def all_reduce_init(self, buf: ndarray, backs: Any, op: Any) -> PersistentPlan | None:
        fn = "all_reduce_init"
        e = self._entry(buf, fn)
        if not self._agree(fn, [available("Allreduce_init")])[0]:
            return None
        comm = self._comm
        mop = self._native(e, op)
        if mop is not None and backs is None:
            return self._plan(fn, "all_reduce", lambda: comm.Allreduce_init(IN_PLACE, [buf, e.mpi], mop), buf)
        return self._reduction_init(fn, "all_reduce", e, op, buf, buf, True, comm.Allreduce_init, backs)

    def reduce_init(self, buf: ndarray, backs: Any, op: Any, root: int) -> PersistentPlan | None:
        fn = "reduce_init"
        e = self._entry(buf, fn)
        if not self._agree(fn, [available("Reduce_init")])[0]:
            return None
        comm = self._comm
        at_root = self._owner.rank == root
        return self._reduction_init(
            fn, "reduce", e, op, buf, buf if at_root else None, at_root,
            lambda s, r, o: comm.Reduce_init(s, r, o, root), backs,
        )  # fmt: skip

    def all_gather_into_tensor_init(self, out: ndarray, backs: Any, inp: ndarray) -> PersistentPlan | None:
        fn = "all_gather_into_tensor_init"
        e = self._entry(out, fn)
        if not self._agree(fn, [available("Allgather_init")])[0]:
            return None
        smsg: Any = [inp, e.mpi]
        pre = None
        if _arrays.may_overlap(out, inp):
            if inp.nbytes and address(inp) == address(out) + inp.nbytes * self._owner.rank:
                smsg = IN_PLACE  # the input already sits in this rank's slot of the output
            else:
                copy, pre = _separate(inp)
                smsg = [copy, e.mpi]
        comm = self._comm
        return self._plan(
            fn, "all_gather_into_tensor", lambda: comm.Allgather_init(smsg, [out, e.mpi]), (out, inp, smsg),
            pre, then_write_back(None, backs),
        )  # fmt: skip

    def reduce_scatter_tensor_init(self, out: ndarray, backs: Any, inp: ndarray, op: Any) -> PersistentPlan | None:
        fn = "reduce_scatter_tensor_init"
        e = self._entry(out, fn)
        block, vector, small = self._agree(
            fn, [available("Reduce_scatter_block_init"), available("Reduce_scatter_init"),
                 inp.nbytes < BLOCK_VARIANT_LIMIT],
        )  # fmt: skip
        if not (block or vector):
            return None
        comm = self._comm
        init: Callable[[Any, Any, MPI.Op], MPI.Prequest]
        if block and (small or not vector):
            init = comm.Reduce_scatter_block_init
        else:
            counts = [out.size] * self._owner.size
            init = lambda s, r, o: comm.Reduce_scatter_init(s, r, counts, o)  # noqa: E731
        pre = None
        if _arrays.may_overlap(out, inp):
            inp, pre = _separate(inp)
        mop = self._native(e, op)
        if mop is not None and backs is None:
            return self._plan(
                fn, "reduce_scatter_tensor", lambda: init([inp, e.mpi], [out, e.mpi], mop), (out, inp), pre
            )
        return self._reduction_init(fn, "reduce_scatter_tensor", e, op, inp, out, False, init, backs, pre)

    def all_to_all_single_init(
        self,
        out: ndarray,
        backs: Any,
        inp: ndarray,
        out_counts: Sequence[int] | None,
        in_counts: Sequence[int] | None,
    ) -> PersistentPlan | None:
        fn = "all_to_all_single_init"
        e = self._entry(out, fn)
        even_ok, vector_ok, even = self._agree(
            fn, [available("Alltoall_init"), available("Alltoallv_init"), out_counts is None or in_counts is None]
        )
        if not (even and even_ok or vector_ok):
            return None
        pre = None
        if _arrays.may_overlap(out, inp):
            inp, pre = _separate(inp)
        comm, n, mpi = self._comm, self._owner.size, e.mpi
        create: Callable[[], MPI.Prequest]
        if even and even_ok:
            create = lambda: comm.Alltoall_init([inp, mpi], [out, mpi])  # noqa: E731
        else:  # uneven splits (or another rank's are): counts and displacements, in elements
            sent = [inp.size // n] * n if in_counts is None else list(in_counts)
            room = [out.size // n] * n if out_counts is None else list(out_counts)
            smsg = [inp, sent, displacements(sent), mpi]
            rmsg = [out, room, displacements(room), mpi]
            create = lambda: comm.Alltoallv_init(smsg, rmsg)  # noqa: E731
        return self._plan(fn, "all_to_all_single", create, (out, inp), pre, then_write_back(None, backs))

    # -- point-to-point (not collective: no agreement; Send_init/Recv_init are MPI-1) --------------
    def send_init(self, buf: ndarray, peer: int, tag: int) -> PersistentPlan:
        owner = self._owner
        owner.p2p_seq += 1
        e = self._entry(buf, "send_init")
        comm = self._comm
        req = self._make("send_init", owner.p2p_seq, lambda: comm.Send_init([buf, e.mpi], peer, tag))

        def one_sent() -> None:
            """A start: one message more (see BaseBackend.sent)."""
            owner.sent += 1

        return PersistentPlan(owner, "persistent send", owner.p2p_seq, buf, req=req, release=lambda: _free(req),
                              pre=one_sent, p2p=True)  # fmt: skip

    def recv_init(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> PersistentPlan:
        """A persistent receive into ``buf``; each completed run checks the message had ``buf``'s size."""
        owner = self._owner
        owner.p2p_seq += 1
        e = self._entry(buf, "recv_init")
        source = MPI.ANY_SOURCE if peer is None else peer
        message, as_bytes = posted_receive(buf, e.mpi)
        comm = self._comm
        req = self._make("recv_init", owner.p2p_seq, lambda: comm.Recv_init(message, source, tag))
        status = MPI.Status()
        truncated = [False]  # MPICH reports a longer message as an error of the test

        def one_received() -> None:
            """A start: one receive more (see BaseBackend.received)."""
            owner.received += 1

        def test() -> bool:
            try:
                return req.Test(status)
            except MPI.Exception as exc:
                if exc.Get_error_class() != ERR_TRUNCATE:
                    raise
                truncated[0] = True
                return True

        def check() -> None:
            longer = truncated[0] or status.Get_error() == ERR_TRUNCATE
            got = -3 if longer else arrived(status, e.mpi, buf.itemsize, as_bytes)
            truncated[0] = False
            if got != buf.size:
                raise receive_size_error(buf.size, e.info.name, status.Get_source(), got)

        def cancel(limit: float) -> bool | None:
            """After a timeout: cancel the run. True: cancelled (no message had matched), nothing is left
            pending; False: its message completed it meanwhile; None: it is still pending."""
            try:
                req.Cancel()
                ended = poll(test, min(1.0, limit), owner.spins)
            except MPI.Exception:
                return None
            if not ended:
                return None
            return bool(status.Is_cancelled())

        return PersistentPlan(
            owner, "persistent recv", owner.p2p_seq, buf, req=req, test=test,
            post=then_write_back(check, backs), release=lambda: _free(req), cancel=cancel, pre=one_received,
            p2p=True,
        )  # fmt: skip
