"""Persistent operations on the MPI backend: MPI-4 persistent requests (``MPI_Allreduce_init``, ...).

A persistent request is made once, bound to the arrays, and started again and
again (``MPI_Start``); MPICH then skips most of what a call sets up, which makes a
small persistent collective faster than MPI's own blocking call (see
docs/persistent.md). :class:`MPIPersistent` gives :class:`~mpidist.backends.mpi.MPIBackend`
its ``*_init`` methods.

Two rules keep it safe:

* **The same choice on every rank.** A persistent request on one rank and a
  nonblocking call on another for the same collective deadlock. Whether the MPI
  library runs a routine is probed once per process on ``MPI_COMM_SELF``
  (:func:`available`), and every creation starts with an agreement: one all-reduce
  (MIN) of the ranks' answers on the group's communicator. Either every rank makes
  the persistent request or every rank takes the nonblocking fallback
  (``BaseBackend``'s ``*_init``: each run is the one-off call with ``async_op=True``).
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
from .base import PersistentPlan

__all__ = ["MPIPersistent", "available", "receive_size_error", "posted_receive", "arrived"]

IN_PLACE = MPI.IN_PLACE
ANY_SOURCE = MPI.ANY_SOURCE
ERR_TRUNCATE = MPI.ERR_TRUNCATE
ndarray = np.ndarray

#: Below this input size reduce_scatter_tensor_init uses MPI_Reduce_scatter_block_init, from it on
#: MPI_Reduce_scatter_init (as the one-off call switches variants, see mpi.py). Measured with MPICH 5 on
#: 2 ranks (raw start/test loops against the blocking call): the two are equally fast up to 384 KiB,
#: while the block variant takes 1.4x the blocking call at 512 KiB and 1.9x at 1 MiB, the vector one 0.97x.
_BLOCK_VARIANT_LIMIT = 256 << 10

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


def _address(a: ndarray) -> int:
    return MPI.buffer(a).address


#: a posted receive of this many bytes or fewer posts bytes, not elements (see posted_receive)
_BYTES_RECEIVE_LIMIT = 2**63 - 1 if MPI.Get_version() >= (4, 0) else 2**31 - 1


def posted_receive(buf: Any, mpi_type: MPI.Datatype) -> tuple[list[Any], bool]:
    """The message a receive posted into ``buf`` gives MPI: ``(message, as bytes)``.

    A message that is not a whole number of the receive's elements (12 bytes of
    float32 into float64) makes MPICH 5 fail an assertion while it unpacks it and
    abort the whole job. Posted as bytes, the message arrives as it is and
    :func:`arrived` finds it was not whole elements, for the ValueError every other
    size mismatch raises. On an MPI-3 library (32-bit counts: Open MPI 5) a receive
    of 2 GiB or more keeps its element type, so that its limit stays 2**31 elements.
    """
    if buf.nbytes <= _BYTES_RECEIVE_LIMIT:
        return [buf, MPI.BYTE], True
    return [buf, mpi_type], False


def arrived(status: MPI.Status, mpi_type: MPI.Datatype, itemsize: int, as_bytes: bool) -> int:
    """The elements a completed receive got, or ``-2 - bytes`` when the message was not whole elements."""
    if as_bytes:
        nbytes = status.Get_count(MPI.BYTE)
        return nbytes // itemsize if nbytes % itemsize == 0 else -2 - nbytes
    got = status.Get_count(mpi_type)
    return -2 - status.Get_count(MPI.BYTE) if got == MPI.UNDEFINED else got


def receive_size_error(size: int, name: str, source: int, got: int) -> ValueError:
    """The error of a receive into ``size`` elements of ``name`` that got ``got`` (-3: more; -2 - n: n bytes)."""
    where = f"from rank {source} (group rank)"
    if got == -3:
        return ValueError(
            f"recv: a message {where} is larger than the {size} elements of {name} expected; sizes must match"
        )
    arrived = f"{-2 - got} bytes" if got < -1 else str(got)
    return ValueError(f"recv: expected {size} elements of {name} {where} but {arrived} arrived; sizes must match")


class MPIPersistent:
    """The ``*_init`` methods of the MPI backend (a mixin of ``MPIBackend``; see the module docstring).

    Each one validates nothing new (the public ``*_init`` functions did), agrees
    with the other ranks on persistent or fallback, and returns a
    :class:`~mpidist.backends.base.PersistentPlan` whose request is bound to the
    prepared arrays (or, where staging is needed, to buffers made here once).
    """

    comm: MPI.Comm
    rank: int
    size: int
    seq: int
    p2p_seq: int
    spins: int
    _types: dict[np.dtype, Any]

    # -- plumbing ---------------------------------------------------------------------------
    def _agree(self, fn: str, flags: Sequence[bool]) -> list[bool]:
        """Numbers the creation as a call of the group and returns ``flags`` ANDed over its ranks.

        ``flags[0]`` and the others are this rank's answers (routine available, even
        split, ...); one all-reduce (MIN), bounded by the group's timeout (a rank that
        never creates the operation makes the others raise DistBackendError naming ``fn``).
        """
        self.seq += 1
        mine = np.array([1 if f else 0 for f in flags], np.int32)
        try:
            req = self.comm.Iallreduce(IN_PLACE, [mine, _I32], MPI.MIN)
        except MPI.Exception as exc:
            raise self._fail(fn, exc) from exc
        self._done(f"{fn} (every rank creates it, in the same order)", req, None, mine, False)
        return [bool(f) for f in mine]

    def _make(self, fn: str, seq: int, create: Callable[[], MPI.Prequest]) -> MPI.Prequest:
        try:
            return create()
        except MPI.Exception as exc:
            raise self.backend_error(fn, seq, exc) from exc

    def _plan(
        self,
        fn: str,
        op: str,
        create: Callable[[], MPI.Prequest],
        keep: Any,
        pre: Callable[[], None] | None = None,
        post: Callable[[], None] | None = None,
    ) -> PersistentPlan:
        req = self._make(fn, self.seq, create)
        return PersistentPlan(self, f"persistent {op}", self.seq, keep, req=req, pre=pre, post=post,
                              release=lambda: _free(req))  # fmt: skip

    def _reduction_init(
        self,
        fn: str,
        op_name: str,
        e: Any,
        op: Any,
        send: ndarray,
        recv: ndarray | None,
        in_place: bool,
        init: Callable[[Any, Any, MPI.Op], MPI.Prequest],
        backs: Any,
        pre: Callable[[], None] | None = None,
    ) -> PersistentPlan:
        """A persistent reduction ``init(send message, recv message, op)`` (see ``MPIBackend._reduction_plan``)."""
        smsg, rmsg, mop, prepare, finish, _, bufs = self._reduction_plan(fn, e, op, send, recv, in_place)
        return self._plan(
            fn, op_name, lambda: init(smsg, rmsg, mop), bufs, chain(pre, prepare), then_write_back(finish, backs)
        )

    def _one_sent(self) -> None:
        """A start of a persistent send: one message more (see BaseBackend.sent)."""
        self.sent += 1

    def _one_received(self) -> None:
        """A start of a persistent receive: one receive more."""
        self.received += 1

    def _entry(self, a: ndarray, fn: str) -> Any:
        return self._types.get(a.dtype) or self._bad_dtype(a, fn)

    @staticmethod
    def _native(e: Any, op: Any) -> Any:
        """The MPI op if one MPI call computes ``op`` on the entry's dtype (host arrays: mpidist's C ops
        for float16/bfloat16 count), else None."""
        return e.fast[op] if type(op) is RedOpType else None

    # -- collectives ----------------------------------------------------------------------------
    def broadcast_init(self, buf: ndarray, backs: Any, root: int) -> PersistentPlan:
        fn = "broadcast_init"
        e = self._entry(buf, fn)
        if not self._agree(fn, [available("Bcast_init")])[0]:
            return super().broadcast_init(buf, backs, root)
        comm = self.comm
        return self._plan(
            fn, "broadcast", lambda: comm.Bcast_init([buf, e.mpi], root), buf, post=then_write_back(None, backs)
        )

    def all_reduce_init(self, buf: ndarray, backs: Any, op: Any) -> PersistentPlan:
        fn = "all_reduce_init"
        e = self._entry(buf, fn)
        if not self._agree(fn, [available("Allreduce_init")])[0]:
            return super().all_reduce_init(buf, backs, op)
        comm = self.comm
        mop = self._native(e, op)
        if mop is not None and backs is None:
            return self._plan(fn, "all_reduce", lambda: comm.Allreduce_init(IN_PLACE, [buf, e.mpi], mop), buf)
        return self._reduction_init(fn, "all_reduce", e, op, buf, buf, True, comm.Allreduce_init, backs)

    def reduce_init(self, buf: ndarray, backs: Any, op: Any, root: int) -> PersistentPlan:
        fn = "reduce_init"
        e = self._entry(buf, fn)
        if not self._agree(fn, [available("Reduce_init")])[0]:
            return super().reduce_init(buf, backs, op, root)
        comm = self.comm
        at_root = self.rank == root
        return self._reduction_init(
            fn, "reduce", e, op, buf, buf if at_root else None, at_root,
            lambda s, r, o: comm.Reduce_init(s, r, o, root), backs,
        )  # fmt: skip

    def all_gather_into_tensor_init(self, out: ndarray, backs: Any, inp: ndarray) -> PersistentPlan:
        fn = "all_gather_into_tensor_init"
        e = self._entry(out, fn)
        if not self._agree(fn, [available("Allgather_init")])[0]:
            return super().all_gather_into_tensor_init(out, backs, inp)
        smsg: Any = [inp, e.mpi]
        pre = None
        if _arrays.may_overlap(out, inp):
            if inp.nbytes and _address(inp) == _address(out) + inp.nbytes * self.rank:
                smsg = IN_PLACE  # the input already sits in this rank's slot of the output
            else:
                copy, pre = _separate(inp)
                smsg = [copy, e.mpi]
        comm = self.comm
        return self._plan(
            fn, "all_gather_into_tensor", lambda: comm.Allgather_init(smsg, [out, e.mpi]), (out, inp, smsg),
            pre, then_write_back(None, backs),
        )  # fmt: skip

    def reduce_scatter_tensor_init(self, out: ndarray, backs: Any, inp: ndarray, op: Any) -> PersistentPlan:
        fn = "reduce_scatter_tensor_init"
        e = self._entry(out, fn)
        block, vector, small = self._agree(
            fn, [available("Reduce_scatter_block_init"), available("Reduce_scatter_init"),
                 inp.nbytes < _BLOCK_VARIANT_LIMIT],
        )  # fmt: skip
        if not (block or vector):
            return super().reduce_scatter_tensor_init(out, backs, inp, op)
        comm = self.comm
        init: Callable[[Any, Any, MPI.Op], MPI.Prequest]
        if block and (small or not vector):
            init = comm.Reduce_scatter_block_init
        else:
            counts = [out.size] * self.size
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
    ) -> PersistentPlan:
        fn = "all_to_all_single_init"
        e = self._entry(out, fn)
        even_ok, vector_ok, even = self._agree(
            fn, [available("Alltoall_init"), available("Alltoallv_init"), out_counts is None or in_counts is None]
        )
        if not (even and even_ok or vector_ok):
            return super().all_to_all_single_init(out, backs, inp, out_counts, in_counts)
        pre = None
        if _arrays.may_overlap(out, inp):
            inp, pre = _separate(inp)
        comm, n, mpi = self.comm, self.size, e.mpi
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
        self.p2p_seq += 1
        e = self._entry(buf, "send_init")
        req = self._make("send_init", self.p2p_seq, lambda: self.comm.Send_init([buf, e.mpi], peer, tag))
        return PersistentPlan(self, "persistent send", self.p2p_seq, buf, req=req, release=lambda: _free(req),
                              pre=self._one_sent, p2p=True)  # fmt: skip

    def recv_init(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> PersistentPlan:
        """A persistent receive into ``buf``; each completed run checks the message had ``buf``'s size."""
        self.p2p_seq += 1
        e = self._entry(buf, "recv_init")
        source = ANY_SOURCE if peer is None else peer
        message, as_bytes = posted_receive(buf, e.mpi)
        req = self._make("recv_init", self.p2p_seq, lambda: self.comm.Recv_init(message, source, tag))
        status = MPI.Status()
        truncated = [False]  # MPICH reports a longer message as an error of the test

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
                ended = poll(test, min(1.0, limit), self.spins)
            except MPI.Exception:
                return None
            if not ended:
                return None
            return bool(status.Is_cancelled())

        return PersistentPlan(
            self, "persistent recv", self.p2p_seq, buf, req=req, test=test,
            post=then_write_back(check, backs), release=lambda: _free(req), cancel=cancel, pre=self._one_received,
            p2p=True,
        )  # fmt: skip
