"""The MPI backend: each process group is a private MPI communicator.

Every operation is one nonblocking MPI call (Iallreduce, Ibcast, Ialltoallv, ...).
A blocking call polls its request until it completes or the group's timeout
passes, which costs the same as MPI's blocking call (measured: 3.17 vs 3.12 us
for an 8-byte all_reduce on 2 ranks) and gives every call a timeout. With
``async_op=True`` the request goes into a :class:`~mpidist.work.Work`.

Datatypes and reductions are probed at run time with ``MPI_Reduce_local``:
float16 and bfloat16 move as their native MPI types where the library has them
and as same-size unsigned integers otherwise. They reduce with mpidist's own MPI
ops (``halfops.py``: C, at memory speed, on the 2-byte numbers); where those are
not built or are switched off, a reduction the library cannot do on them natively
runs on a float32 copy that is rounded back (counted as a copy).

List collectives (all_gather into a list, gather, scatter, all_to_all) address
the caller's arrays directly: the vector variants of the MPI calls get byte
counts and displacements relative to the lowest of the arrays, so separate
arrays need no packing (see ``_vector``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .._world import world
from ..arrays import host as _arrays
from ..arrays.host import displacements, then_write_back
from ..errors import DistBackendError
from ..reduce_op import (
    OP_TABLE,
    Post,
    Prim,
    RedOpType,
    divide_average,
    factor_value,
    from_order_keys,
    invalid_op_error,
    resolve,
    to_order_keys,
)  # fmt: skip
from ..work import Work, poll
from .base import BaseBackend
from .direct import calls_kind, make_calls
from .halfops import HALF_DTYPES, HalfOps, half_ops
from .mpi_persistent import MPIPersistent, arrived, posted_receive, receive_size_error

__all__ = ["MPIBackend", "type_table"]

IN_PLACE = MPI.IN_PLACE
BYTE = MPI.BYTE
ANY_SOURCE = MPI.ANY_SOURCE
ERR_TRUNCATE = MPI.ERR_TRUNCATE
Op = MPI.Op
_REQUEST = MPI.Request
ndarray = np.ndarray

_PRIM_OPS = {
    Prim.SUM: MPI.SUM, Prim.PROD: MPI.PROD, Prim.MIN: MPI.MIN, Prim.MAX: MPI.MAX,
    Prim.BAND: MPI.BAND, Prim.BOR: MPI.BOR, Prim.BXOR: MPI.BXOR,
    Prim.LAND: MPI.LAND, Prim.LOR: MPI.LOR, Prim.LXOR: MPI.LXOR,
}  # fmt: skip

_MPI_TYPE_NAMES = {
    "bool": "C_BOOL",
    "int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
    "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T", "uint64": "UINT64_T",
    "float16": "FLOAT16_T", "bfloat16": "BFLOAT16_T", "float32": "FLOAT", "float64": "DOUBLE",
    "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX",
}  # fmt: skip
_RAW_BY_SIZE = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}
#: the integer types float MIN/MAX reduce their order keys in (reduce_op.to_order_keys), by itemsize
_KEYS_BY_SIZE = {2: (MPI.INT16_T, np.dtype(np.int16)), 4: (MPI.INT32_T, np.dtype(np.int32)),
                 8: (MPI.INT64_T, np.dtype(np.int64))}  # fmt: skip
_WIDE = np.dtype(np.float32)
#: a step of an operation (prepare, finish, undo), or None where there is nothing to do
Step = Optional[Callable[[], None]]

#: Below this input size reduce_scatter uses Ireduce_scatter_block, above it Ireduce_scatter:
#: measured with MPICH 5 on 2 ranks, the vector variant costs +2.3 us at 8 B, while the
#: block variant is 8x slower than blocking MPI from 256 KiB up (1151 vs 134 us at 1 MiB).
_BLOCK_VARIANT_LIMIT = 256 << 10

#: whether mpi4py passes 64-bit counts and displacements to MPI (MPI-4 large-count routines)
_LARGE_COUNTS = MPI.Get_version() >= (4, 0)
#: the error classes an MPI-3 library gives for a count beyond its 32-bit limit
_COUNT_ERRORS = (MPI.ERR_ARG, MPI.ERR_COUNT)
_INT_MAX = 2**31 - 1
_EMPTY = np.empty(0, np.uint8)

#: the tag of destroy_process_group's agreement on the control communicator (see MPIBackend.agree_to_free)
_FREE_TAG = 0x3B10

#: marks an op that needs more than one native MPI call (AVG, PREMUL_SUM, widening)
_GENERAL = object()


class TypeEntry:
    """How this MPI library handles one dtype."""

    __slots__ = ("info", "mpi", "ops", "wide", "fast", "half")

    def __init__(
        self,
        info: _arrays.DtypeInfo,
        mpi: MPI.Datatype,
        ops: tuple[Any, ...],
        wide: np.dtype | None,
        fast: tuple[MPI.Op | None, ...] | None = None,
        half: HalfOps | None = None,
    ) -> None:
        self.info = info
        self.mpi = mpi  # datatype that moves the elements
        # by RedOpType: an MPI.Op if MPI computes it natively on this dtype in one call, on any memory (host or
        # a CUDA-aware library's device memory: mpi_device.py reads this), _GENERAL, or None (undefined)
        self.ops = ops
        self.wide = wide  # dtype reductions run in when MPI cannot reduce this one natively (and no C ops)
        # by RedOpType: the MPI.Op one call on host arrays uses (native, or mpidist's C op), else None
        self.fast = fast if fast is not None else tuple(o if type(o) is Op else None for o in ops)
        self.half = half  # float16/bfloat16: mpidist's C reductions (halfops.py), or None


def _reduces_natively(mpi_type: MPI.Datatype, dtype: np.dtype, prim: Prim) -> bool:
    """Return True if MPI_Reduce_local computes ``prim`` correctly on ``mpi_type``."""
    a = np.array([1, 0, 1, 2], dtype)
    b = np.array([1, 1, 0, 3], dtype)
    expect = {
        Prim.SUM: np.add, Prim.PROD: np.multiply, Prim.MIN: np.minimum, Prim.MAX: np.maximum,
        Prim.BAND: np.bitwise_and, Prim.BOR: np.bitwise_or, Prim.BXOR: np.bitwise_xor,
        Prim.LAND: np.logical_and, Prim.LOR: np.logical_or, Prim.LXOR: np.logical_xor,
    }[prim](a, b).astype(dtype)  # fmt: skip
    try:
        _PRIM_OPS[prim].Reduce_local([a, mpi_type], [b, mpi_type])
    except MPI.Exception:
        return False
    return bool(np.array_equal(b, expect))


def _entry(info: _arrays.DtypeInfo, alone: bool) -> TypeEntry:
    """The entry of one dtype; ``alone``: for a communicator of one rank (see ``_half_fast``)."""
    native = getattr(MPI, _MPI_TYPE_NAMES[info.name], MPI.DATATYPE_NULL)
    have = native != MPI.DATATYPE_NULL
    move = native if have else _RAW_BY_SIZE[info.dtype.itemsize]
    table = OP_TABLE[info.kind]
    prims = {e[0] for e in table if e is not None}
    wide = None
    if not (have and all(_reduces_natively(native, info.dtype, p) for p in prims)):
        if info.kind != "f" or info.dtype.itemsize >= _WIDE.itemsize:  # pragma: no cover - MPI-2 era libraries
            raise RuntimeError(f"this MPI library cannot reduce {info.name} arrays")
        wide = _WIDE
    half = half_ops(info.dtype) if info.name in HALF_DTYPES else None
    if half is not None:
        # mpidist's C ops read host memory: no op of this dtype counts as native (a CUDA-aware MPI must not
        # get device memory for them: mpi_device.py stages); one call on host arrays uses them
        ops = tuple(None if e is None else _GENERAL for e in table)
        return TypeEntry(info, move, ops, wide, _half_fast(table, half, alone), half)
    ops = tuple(
        None if e is None else (_PRIM_OPS[e[0]] if e[1] is Post.NONE and wide is None else _GENERAL) for e in table
    )
    return TypeEntry(info, move, ops, wide)


def _half_fast(table: tuple[Any, ...], half: HalfOps, alone: bool) -> tuple[MPI.Op | None, ...]:
    """The C ops one call uses, by RedOpType: SUM and PRODUCT, and MIN/MAX (their rule is inside the C op).

    On a communicator of one rank MPI never calls an op, so MIN/MAX would hand a NaN back with its
    payload: there they keep the order keys, which make every NaN the default one.
    """
    return tuple(
        half.by_prim[e[0]] if e is not None and (e[1] is Post.NONE or (e[1] is Post.KEYS and not alone)) else None
        for e in table
    )


def type_table(alone: bool = False) -> dict[np.dtype, TypeEntry]:
    """Return the dtype table of this MPI library (probed once per process); ``alone``: for a one-rank group."""
    tables = world.mpi_type_table
    if tables is None:
        tables = world.mpi_type_table = {}
    table = tables.get(alone)
    if table is None:
        table = tables[alone] = {dt: _entry(info, alone) for dt, info in _arrays.DTYPES.items()}
    return table


def _address(a: ndarray) -> int:
    return MPI.buffer(a).address


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
    if hi - lo <= _INT_MAX or _LARGE_COUNTS:
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
        start = _address(a)
        if addr is not None and start != addr:
            return False
        addr = start + a.nbytes
    return True


def _count_limit_note() -> str:
    """What an invalid-argument error from an MPI-3 library most likely means (docs/sharp-bits.md)."""
    version = MPI.Get_library_version().splitlines()
    library = version[0].split(",")[0].strip() if version else "this MPI library"
    major, minor = MPI.Get_version()
    return (
        f"({library} implements MPI {major}.{minor}, whose calls take counts below 2**31: a message of 2**31 "
        "elements or more (bytes, for lists of arrays and for objects) needs an MPI-4 library such as MPICH >= 4, "
        "pip install mpidist[mpich]; see docs/sharp-bits.md)"
    )


def _reports_self_truncation() -> bool:
    """Whether this MPI library reports a message a rank sends itself that is longer than the receive.

    MPICH raises MPI_ERR_TRUNCATE as for any peer; Open MPI 5 silently truncates a message
    to self (found out once per process, on MPI_COMM_SELF; kept in ``world``).
    """
    if world.self_truncation_reported is None:
        comm = MPI.COMM_SELF
        got = np.zeros(1, np.uint8)
        recv = comm.Irecv([got, BYTE], 0, 0)
        comm.Isend([np.ones(2, np.uint8), BYTE], 0, 0).Wait()
        status = MPI.Status()
        try:
            recv.Wait(status)
            reported = status.Get_error() == ERR_TRUNCATE
        except MPI.Exception as exc:
            reported = exc.Get_error_class() == ERR_TRUNCATE
        world.self_truncation_reported = reported
    return world.self_truncation_reported


class MPIBackend(MPIPersistent, BaseBackend):
    """Backend over one private MPI communicator (see the module docstring).

    Its persistent operations (``*_init``) come from :class:`~mpidist.backends.mpi_persistent.MPIPersistent`.
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
        return bool(self._stuck or self._orphans)

    def shutdown(self) -> None:
        """Free the communicator if this backend owns it and nothing may still use it.

        A communicator with operations that timed out is left allocated (a small
        leak): freeing it under a pending operation aborts the job in Open MPI.
        """
        if self._owns_comm and self.comm != MPI.COMM_NULL and not self.pending():
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

    def _bad_dtype(self, a: ndarray, fn: str) -> TypeEntry:
        _arrays.dtype_info(a.dtype, fn, "array")  # raises the specific TypeError
        raise TypeError(f"{fn}: the MPI backend cannot send {a.dtype.name} arrays")  # pragma: no cover

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
            if not req.Test() and not poll(req.Test, self.timeout_s, self.spins, (self.group_name, op, self.seq)):
                self._expired(op, req, keep)
        except MPI.Exception as exc:
            raise self._fail(op, exc) from exc
        if post is not None:
            post()
        return None

    def _expired(self, op: str, req: MPI.Request, keep: Any) -> None:
        """A blocking call ran out of time: keep its buffers forever and raise."""
        self.keep_stuck([req], keep)
        raise self.timeout_failure(op, self.seq, self.timeout_s)

    def _fail(self, op: str, exc: MPI.Exception) -> Exception:
        return self.backend_error(op, self.seq, exc)

    def backend_error(self, op: str, seq: int, exc: BaseException) -> DistBackendError:
        """Wrap an MPI error; on an MPI-3 library, say what an invalid-argument error most likely means."""
        error = super().backend_error(op, seq, exc)
        if not _LARGE_COUNTS and isinstance(exc, MPI.Exception) and exc.Get_error_class() in _COUNT_ERRORS:
            error = DistBackendError(f"{error} {_count_limit_note()}")
        return error

    # -- reductions -----------------------------------------------------------------------
    def _reduction_plan(
        self, fn: str, e: TypeEntry, op: Any, send: ndarray, recv: ndarray | None, in_place: bool
    ) -> tuple[Any, Any, MPI.Op, Step, Step, Step, tuple]:
        """The messages and steps of a reduction that one native MPI call cannot do alone.

        Handles AVG (divide afterwards), PREMUL_SUM (scale a copy of the input
        first; the factor is read at every run), dtypes that MPI cannot reduce
        (work on a float32 copy, unless mpidist's C ops reduce them: ``e.half``),
        MIN/MAX on floats (``_keys_plan``), and ops of one call whose output is
        staged (``e.fast``). Returns
        ``(send message, recv message, MPI op, prepare, finish, undo, buffers)``: the
        messages are bound to buffers allocated here once, ``prepare()`` (None if
        there is nothing to do) fills them before each run, ``finish()`` (or None)
        completes each run and ``undo()`` (or None) gives the caller's input back if
        the MPI call fails after ``prepare()``; so a persistent request can be made on
        the messages as well as a one-off call.
        """
        base, factor = resolve(op, fn)
        info = e.info
        entry = OP_TABLE[info.kind][base]
        if entry is None:
            raise invalid_op_error(fn, base, info.kind, info.name)
        prim, post = entry
        one = e.fast[base]
        if one is not None:  # one MPI call does it (here for a staged output, or an input apart from the output)
            return (
                IN_PLACE if in_place else [send, e.mpi], None if recv is None else [recv, e.mpi], one,
                None, None, None, (send, recv),
            )  # fmt: skip
        if post is Post.KEYS:
            return self._keys_plan(e, prim, send, recv, in_place)
        premul = post is Post.PREMUL
        if premul:
            f = factor_value(factor)
            if isinstance(f, complex) and info.kind != "c":
                raise ValueError(f"{fn}: PREMUL_SUM factor {f!r} is complex but the array is {info.name}")
        half = e.half
        # mpidist's C ops sum the 2-byte numbers themselves; PREMUL_SUM keeps the float32 copy where MPI
        # cannot reduce the dtype (its products are not rounded to the 2-byte type, as before)
        wide = None if half is not None and not (premul and e.wide is not None) else e.wide
        if half is None or wide is not None:
            half = None
        if wide is not None:
            s = np.empty(send.shape, wide)
            r = s if in_place else (None if recv is None else np.empty(recv.shape, wide))
            mpi_type = self._types[wide].mpi
        else:
            s = np.empty_like(send) if premul and not in_place else send  # never scale the caller's input
            r, mpi_type = recv, e.mpi
        mop = _PRIM_OPS[prim] if half is None else half.by_prim[prim]
        copied = s is not send
        count = world.stats.count_copy

        def prepare() -> None:
            if copied:
                np.copyto(s, send, casting="unsafe")
                count(s.nbytes)
            if premul:
                np.multiply(s, factor_value(factor), out=s, casting="unsafe")

        size = self.size
        average = post is Post.AVG

        def finish() -> None:
            if average:
                if half is not None:
                    half.divide(r, size)  # in C: numpy's float16 division is a slow loop
                else:
                    divide_average(r, size, np)
            if wide is not None:
                np.copyto(recv, r, casting="unsafe")
                if r is not s:
                    count(r.nbytes)

        smsg = IN_PLACE if in_place else [s, mpi_type]
        rmsg = None if r is None else [r, mpi_type]
        done = finish if r is not None and (average or wide is not None) else None
        return smsg, rmsg, mop, prepare if copied or premul else None, done, None, (send, recv, s, r)

    def _keys_plan(
        self, e: TypeEntry, prim: Prim, send: ndarray, recv: ndarray | None, in_place: bool
    ) -> tuple[Any, Any, MPI.Op, Step, Step, Step, tuple]:
        """MIN/MAX on floats: reduce integer order keys, so every rank gets the same bits (see reduce_op).

        An in-place buffer is converted where it is (and back on failure); a separate
        input (reduce on a non-root rank, reduce_scatter) is converted into a copy made
        here once. The result comes back as keys in the output's memory, converted back
        when each run completes.
        """
        dtype = e.info.dtype
        mpi_type, key_dtype = _KEYS_BY_SIZE[dtype.itemsize]
        if in_place:
            s = r = send.reshape(-1).view(key_dtype)
        else:
            s = np.empty(send.size, key_dtype)
            r = None if recv is None else recv.reshape(-1).view(key_dtype)
        count = world.stats.count_copy

        def prepare() -> None:
            if in_place:
                to_order_keys(send, None, prim, np)
            else:
                to_order_keys(send, s, prim, np)
                count(s.nbytes)

        def finish() -> None:
            from_order_keys(r, dtype, prim, np)  # NaN payloads become the default NaN

        def undo() -> None:
            from_order_keys(s, dtype, prim, np)  # the caller's numbers back

        smsg = IN_PLACE if in_place else [s, mpi_type]
        rmsg = None if r is None else [r, mpi_type]
        done = None if r is None else finish
        return smsg, rmsg, _PRIM_OPS[prim], prepare, done, undo if in_place else None, (send, recv, s, r)

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
        """Run a reduction whose MPI call is ``start(send message, recv message, op)`` (see ``_reduction_plan``);
        staged outputs are written back afterwards."""
        try:
            smsg, rmsg, mop, prepare, finish, undo, bufs = self._reduction_plan(fn, e, op, send, recv, in_place)
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
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "all_reduce")
        mop = e.fast[op] if type(op) is RedOpType else None
        if mop is None or backs is not None:
            comm = self.comm
            return self._reduction(
                "all_reduce", e, op, buf, buf, True,
                lambda s, r, o: comm.Iallreduce(s, r, o), backs, async_op,
            )  # fmt: skip
        try:
            req = self._calls.allreduce(buf, e.mpi, mop, 0 if async_op else self.spins)
        except MPI.Exception as exc:
            raise self._fail("all_reduce", exc) from exc
        return None if req is None else self._done("all_reduce", req, None, buf, async_op)

    def reduce(self, buf: ndarray, backs: Any, op: Any, root: int, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "reduce")
        mop = e.fast[op] if type(op) is RedOpType else None
        if mop is None or backs is not None:
            comm = self.comm
            at_root = self.rank == root
            return self._reduction(
                "reduce", e, op, buf, buf if at_root else None, at_root,
                lambda s, r, o: comm.Ireduce(s, r, o, root), backs, async_op,
            )  # fmt: skip
        try:
            req = self._calls.reduce(buf, e.mpi, mop, root, 0 if async_op else self.spins)
        except MPI.Exception as exc:
            raise self._fail("reduce", exc) from exc
        return None if req is None else self._done("reduce", req, None, buf, async_op)

    def reduce_scatter_tensor(self, out: ndarray, backs: Any, inp: ndarray, op: Any, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or self._bad_dtype(out, "reduce_scatter_tensor")
        if _arrays.may_overlap(out, inp):
            inp = self._separate(inp)  # MPI forbids aliased buffers
        mop = e.fast[op] if type(op) is RedOpType else None
        if mop is None or backs is not None:
            comm = self.comm
            return self._reduction(
                "reduce_scatter_tensor", e, op, inp, out, False,
                lambda s, r, o: comm.Ireduce_scatter(s, r, None, o), backs, async_op,
            )  # fmt: skip
        try:
            if inp.nbytes < _BLOCK_VARIANT_LIMIT:
                req = self._calls.reduce_scatter_block(out, inp, e.mpi, mop, 0 if async_op else self.spins)
            else:
                req = self._calls.reduce_scatter(out, inp, e.mpi, mop, 0 if async_op else self.spins)
        except MPI.Exception as exc:
            raise self._fail("reduce_scatter_tensor", exc) from exc
        return None if req is None else self._done("reduce_scatter_tensor", req, None, (inp, out), async_op)

    def reduce_scatter(self, out: ndarray, backs: Any, ins: Sequence[ndarray], op: Any, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or self._bad_dtype(out, "reduce_scatter")
        counts = [a.size for a in ins]
        if _consecutive(ins) and not _arrays.may_overlap_any(out, ins):
            total = sum(a.nbytes for a in ins)
            packed = np.frombuffer(MPI.buffer.fromaddress(_address(ins[0]) if total else 0, total), out.dtype)
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
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "broadcast")
        try:
            req = self._calls.bcast(buf, e.mpi, root, 0 if async_op else self.spins)
        except MPI.Exception as exc:
            raise self._fail("broadcast", exc) from exc
        if req is None and not backs:  # complete, nothing to write back
            return None
        post = None if not backs else then_write_back(None, backs)
        return self._done("broadcast", req, post, buf, async_op)

    def all_gather_into_tensor(self, out: ndarray, backs: Any, inp: ndarray, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or self._bad_dtype(out, "all_gather_into_tensor")
        send: ndarray | None = inp
        if _arrays.may_overlap(out, inp):
            mine = inp.nbytes * self.rank
            if inp.nbytes and _address(inp) == _address(out) + mine:
                send = None  # in place: the input already sits in this rank's slot of the output
            else:
                send = self._separate(inp)
        try:
            req = self._calls.allgather(out, send, e.mpi, 0 if async_op else self.spins)
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
        backs = (backs or []) + staged
        post = None if not backs else then_write_back(None, backs)
        return self._done("all_gather", req, post, (inp, outs, smsg, rmsg), async_op)

    def _own_block(self, inp: ndarray, mine: ndarray, addrs: list[int] | None, outs: Sequence[ndarray]) -> Any:
        """The send message of a rank whose output block may be (or overlap) its input."""
        if addrs is None or not _arrays.may_overlap_any(inp, outs):
            return [inp, inp.nbytes, BYTE]  # (outputs staged elsewhere, or no overlap)
        if inp.nbytes and mine.nbytes == inp.nbytes and _address(inp) == addrs[self.rank]:
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
        backs = (backs or []) + staged
        post = None if not backs else then_write_back(None, backs)
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
                if out.nbytes and mine.nbytes == out.nbytes and _address(mine) == _address(out):
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
        e = self._types.get(out.dtype) or self._bad_dtype(out, "all_to_all_single")
        if _arrays.may_overlap(out, inp):
            inp = self._separate(inp)  # MPI forbids aliased buffers
        try:
            if out_counts is None or in_counts is None:
                req = self._calls.alltoall(out, inp, e.mpi, 0 if async_op else self.spins)
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
        backs = (backs or []) + staged
        post = None if not backs else then_write_back(None, backs)
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

    def barrier(self, async_op: bool) -> Work | None:
        self.seq += 1
        try:
            req = self.comm.Ibarrier()
        except MPI.Exception as exc:
            raise self._fail("barrier", exc) from exc
        return self._done("barrier", req, None, None, async_op)

    # -- point-to-point -------------------------------------------------------------------
    def send(self, buf: ndarray, peer: int, tag: int) -> Work:
        self.p2p_seq += 1
        self.sent += 1
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "send")
        try:
            req = self.comm.Isend([buf, e.mpi], peer, tag)
        except MPI.Exception as exc:
            raise self.backend_error("send", self.p2p_seq, exc) from exc
        return Work([req], None, buf, "send", self, self.p2p_seq, self.timeout_s)

    def recv(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> Work:
        """Post the receive into ``buf`` at once (see :class:`_Receive`)."""
        self.p2p_seq += 1
        self.received += 1
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "recv")
        target = buf
        if (peer == self.rank or (peer is None and self.size == 1)) and not _reports_self_truncation():
            # Open MPI truncates a longer message from this rank to itself without an error:
            # receive into one element more, so that a longer message shows (copied on completion)
            target = np.empty(buf.size + 1, buf.dtype)
            world.stats.count_copy(buf.nbytes)
        message, as_bytes = posted_receive(target, e.mpi)
        try:
            req = self.comm.Irecv(message, ANY_SOURCE if peer is None else peer, tag)
        except MPI.Exception as exc:
            raise self.backend_error("recv", self.p2p_seq, exc) from exc
        return _Receive(req, buf, e, backs, self, peer, None, None if target is buf else target, as_bytes)

    def recv_blocking(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> Work:
        """Match the message with a probe first, then receive it (see :class:`_Receive`)."""
        self.p2p_seq += 1
        self.received += 1
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "recv")
        return _Receive(None, buf, e, backs, self, peer, (self.comm, tag))


class _Receive(Work):
    """The Work of a receive on an MPI communicator.

    A receive is *posted* (``MPIBackend.recv``: ``irecv`` and ``batch_isend_irecv``)
    or *matched* (``MPIBackend.recv_blocking``: blocking ``recv``):

    * posted: ``MPI_Irecv`` into the caller's array at once, so that MPI matches
      the message as soon as it arrives and a large send to this rank can
      complete while this rank waits elsewhere (what send-then-receive exchanges
      rely on). MPI writes the message into the array when it matches, before its
      size can be checked: a message of another size raises ValueError here but
      has written its first elements (up to the array's size) into the array.
    * matched: nothing is posted; each test probes (``MPI_Improbe``) for the
      message and only once it is there, and its size is the array's, receives
      it (``MPI_Imrecv``) into the array. A message of another size goes into a
      scratch buffer (so the array is untouched) and raises ValueError.

    When ``wait`` times out, a posted receive that no message has matched is
    cancelled (``MPI_Cancel``) and a matched one that found no message has
    nothing to cancel: either way nothing is left pending, the next message goes
    to the next receive and the group stays usable. A receive whose message had
    already matched cannot be cancelled: it stays pending, as a timed-out
    collective does.
    """

    __slots__ = ("_buf", "_entry", "_peer", "_posted", "_probe", "_arrived", "_longer", "_as_bytes")

    def __init__(
        self, req: MPI.Request | None, buf: ndarray, e: TypeEntry, backs: Any, owner: MPIBackend,
        peer: int | None, probe: tuple[MPI.Comm, int] | None, longer: ndarray | None = None,
        as_bytes: bool = False,
    ) -> None:  # fmt: skip
        post = None if not backs else then_write_back(None, backs)  # a staged array: write it back
        keep = buf if longer is None else (buf, longer)
        Work.__init__(
            self, [] if req is None else [req], post, keep, "recv", owner, owner.p2p_seq, owner.timeout_s, MPI.Status()
        )
        # a posted receive from this rank to itself on a library that truncates those silently:
        # the message lands in this array of one element more, and is copied into buf
        self._longer = longer
        self._as_bytes = as_bytes  # posted as bytes (mpi_persistent.posted_receive)
        self._buf = buf
        self._entry = e
        self._peer = peer  # group rank, or None: any
        self._posted = req is not None
        self._probe = probe  # (communicator, tag) of a matched receive until its message is there
        # elements that arrived, once known (else read from the status); -2 - bytes: not whole elements; -3: longer
        self._arrived: int | None = None

    def _test(self) -> bool:
        if self._probe is not None and not self._match():
            return False
        try:
            return self._reqs[0].Test(self._status)
        except MPI.Exception as exc:  # MPICH reports a longer message as an error of the test
            if exc.Get_error_class() != ERR_TRUNCATE:
                raise
            self._arrived = -3
            return True

    def _match(self) -> bool:
        """Probe for the message of a matched receive; once it is there, receive it. True once matched."""
        comm, tag = self._probe  # type: ignore[misc]
        status, peer = self._status, self._peer
        msg = comm.Improbe(ANY_SOURCE if peer is None else peer, tag, status)
        if msg is None:
            return False
        self._probe = None
        mpi, buf = self._entry.mpi, self._buf
        self._arrived = count = status.Get_count(mpi)
        if count == buf.size:
            self._reqs = [msg.Irecv([buf, mpi])]
            return True
        if count == MPI.UNDEFINED:  # not a whole number of elements
            nbytes = status.Get_count(BYTE)
            scratch, self._arrived = np.empty(nbytes, np.uint8), -2 - nbytes
            self._reqs = [msg.Irecv([scratch, BYTE])]
        else:
            scratch = np.empty(count, buf.dtype)
            self._reqs = [msg.Irecv([scratch, mpi])]
        self._keep = (self._keep, scratch)  # the caller's array is never written
        return True

    def _complete(self) -> None:
        """Fail with a ValueError if a message of another size arrived; else finish as any Work."""
        if self._done:
            return
        got, longer_message = self._arrived, False
        if got is None:  # a posted receive: the status tells (Open MPI reports a longer message there)
            status = self._status
            longer_message = status.Get_error() == ERR_TRUNCATE
            got = -3 if longer_message else arrived(status, self._entry.mpi, self._buf.itemsize, self._as_bytes)
        longer = self._longer
        if longer is not None and (got >= 0 or longer_message):  # not when the message was not whole elements
            size = self._buf.size
            if got > size:
                got = -3
            n = min(got, size) if got >= 0 else size  # what MPI would have written into the array itself
            self._buf.reshape(-1)[:n] = longer[:n]
        if got != self._buf.size:
            self._fail(self._size_error(got))
            return
        Work._complete(self)

    def _size_error(self, got: int) -> ValueError:
        return receive_size_error(self._buf.size, self._entry.info.name, self._status.Get_source(), got)

    def _expired(self, limit: float) -> None:
        owner, op, seq = self._owner, self._op, self._seq
        if self._probe is not None:  # matched receive: no message has come, and nothing was posted
            note = "No message had arrived, and nothing is left posted: the next message goes to the next receive."
            self._fail(owner.timeout_failure(op, seq, limit, note, settled=True))
            return
        if self._posted:
            try:
                self._reqs[0].Cancel()
                # a receive that no message matched ends at once, cancelled; else its message completes it
                ended = poll(self._test, min(1.0, limit), owner.spins)
            except MPI.Exception:
                ended = False
            if ended and self._status.Is_cancelled():
                note = "The receive was cancelled: the next message goes to the next receive."
                self._fail(owner.timeout_failure(op, seq, limit, note, settled=True))
                return
            if ended:  # its message arrived as the time ran out: it is received after all
                self._complete()
                return
        owner.keep_stuck(self._reqs, self._keep)
        source = self._status.Get_source() if self._peer is None and not self._posted else self._peer
        sender = "A message" if source is None else f"A message from rank {source} (group rank)"
        note = (
            f"{sender} had matched the receive but did not finish arriving, and MPI cannot cancel a "
            "matched receive: the receive stays pending and its array in use."
        )
        self._fail(owner.timeout_failure(op, seq, limit, note))
