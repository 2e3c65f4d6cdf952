"""The MPI backend: each process group is a private MPI communicator.

Every operation is one nonblocking MPI call (Iallreduce, Ibcast, Ialltoallv, ...).
A blocking call polls its request until it completes or the group's timeout
passes, which costs the same as MPI's blocking call (measured: 3.17 vs 3.12 us
for an 8-byte all_reduce on 2 ranks) and gives every call a timeout. With
``async_op=True`` the request goes into a :class:`~mpidist.work.Work`.

Datatypes and reductions are probed at run time with ``MPI_Reduce_local``:
float16 and bfloat16 move as their native MPI types where the library has them
and as same-size unsigned integers otherwise; a reduction the library cannot do
on them natively runs on a float32 copy that is rounded back (counted as a copy).

List collectives (all_gather into a list, gather, scatter, all_to_all) address
the caller's arrays directly: the vector variants of the MPI calls get byte
counts and absolute addresses relative to ``MPI.BOTTOM``, so separate arrays
need no packing.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from .. import _arrays
from .._world import world
from ..reduce_op import OP_TABLE, Post, Prim, RedOpType, factor_value, invalid_op_error, resolve
from ..work import Work, poll
from .base import BaseBackend

__all__ = ["MPIBackend", "type_table"]

IN_PLACE = MPI.IN_PLACE
BOTTOM = MPI.BOTTOM
BYTE = MPI.BYTE
ANY_SOURCE = MPI.ANY_SOURCE
Op = MPI.Op
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
_WIDE = np.dtype(np.float32)

#: Below this input size reduce_scatter uses Ireduce_scatter_block, above it Ireduce_scatter:
#: measured with MPICH 5 on 2 ranks, the vector variant costs +2.3 us at 8 B, while the
#: block variant is 8x slower than blocking MPI from 256 KiB up (1151 vs 134 us at 1 MiB).
_BLOCK_VARIANT_LIMIT = 256 << 10

#: marks an op that needs more than one native MPI call (AVG, PREMUL_SUM, widening)
_GENERAL = object()


class TypeEntry:
    """How this MPI library handles one dtype."""

    __slots__ = ("info", "mpi", "ops", "wide", "direct")

    def __init__(
        self, info: _arrays.DtypeInfo, mpi: MPI.Datatype, ops: tuple[Any, ...], wide: np.dtype | None, direct: bool
    ):
        self.info = info
        self.mpi = mpi  # datatype that moves the elements
        self.ops = ops  # by RedOpType: MPI.Op if native and direct, _GENERAL, or None (undefined)
        self.wide = wide  # dtype reductions run in when MPI cannot reduce this one natively
        # True if mpi4py's automatic datatype for the array (from its buffer format) is
        # the right one, so the array can be passed without a [buffer, datatype] list.
        self.direct = direct


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


def _entry(info: _arrays.DtypeInfo) -> TypeEntry:
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
    ops = tuple(
        None if e is None else (_PRIM_OPS[e[0]] if e[1] is Post.NONE and wide is None else _GENERAL) for e in table
    )
    direct = have and wide is None and (info.kind in "biuc" or info.name in ("float32", "float64"))
    return TypeEntry(info, move, ops, wide, direct)


def type_table() -> dict[np.dtype, TypeEntry]:
    """Return the dtype table of this MPI library (probed once per process)."""
    if world.mpi_type_table is None:
        world.mpi_type_table = {dt: _entry(info) for dt, info in _arrays.DTYPES.items()}
    return world.mpi_type_table


def _divide_inplace(a: ndarray, n: int) -> None:
    """AVG's division: true division for floats, truncation toward zero for integers."""
    if a.dtype.kind == "c":  # divide the components: complex division by n+0j rounds differently
        parts = a.view(a.real.dtype)
        np.divide(parts, n, out=parts)
    elif a.dtype.kind in "fV":
        np.divide(a, n, out=a, casting="unsafe")
    elif a.dtype.kind == "u":
        np.floor_divide(a, n, out=a)
    else:
        q = np.floor_divide(a, n)
        q += (np.remainder(a, n) != 0) & (a < 0)
        a[...] = q


def _write_backs(backs: Sequence[tuple[ndarray, ndarray]]) -> None:
    for buf, target in backs:
        _arrays.write_back(buf, target)


def _address(a: ndarray) -> int:
    return MPI.buffer(a).address


def _layout(arrays: Sequence[ndarray], fn: str, arg: str, check_overlap: bool) -> tuple[list[int], list[int]]:
    """Return byte counts and absolute addresses of ``arrays`` for BOTTOM-based vector calls."""
    counts = [a.nbytes for a in arrays]
    addrs = [_address(a) if n else 0 for a, n in zip(arrays, counts)]
    if check_overlap:
        spans = sorted((addr, addr + n, i) for i, (addr, n) in enumerate(zip(addrs, counts)) if n)
        for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError(
                    f"{fn}: {arg}[{i}] and {arg}[{j}] overlap in memory; every output needs its own memory"
                )
    return counts, addrs


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


class MPIBackend(BaseBackend):
    """Backend over one private MPI communicator (see the module docstring)."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm, timeout_s: float, group_name: str = "", owns_comm: bool = False) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout_s, group_name)
        self.comm = comm
        # bound once: the hot paths call these on every operation
        self._iallreduce = comm.Iallreduce
        self._ibcast = comm.Ibcast
        self._iallgather = comm.Iallgather
        self._ireduce_scatter_block = comm.Ireduce_scatter_block
        self._ialltoall = comm.Ialltoall
        self._owns_comm = owns_comm
        self._types = type_table()
        self._orphans: list[tuple[list[MPI.Request], Any]] = []

    # -- plumbing -----------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._owns_comm and self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def adopt(self, reqs: list[MPI.Request], keep: Any) -> None:
        """Keep the buffers of a Work dropped before completion until MPI is done with them."""
        self._orphans = [o for o in self._orphans if not MPI.Request.Testall(o[0])]
        if not MPI.Request.Testall(reqs):
            self._orphans.append((reqs, keep))

    def _bad_dtype(self, a: ndarray, fn: str) -> TypeEntry:
        _arrays.dtype_info(a.dtype, fn, "array")  # raises the specific TypeError
        raise TypeError(f"{fn}: the MPI backend cannot send {a.dtype.name} arrays")  # pragma: no cover

    def _done(self, op: str, req: MPI.Request, post: Callable[[], None] | None, keep: Any, async_op: bool) -> Work | None:
        """Return a Work for ``req``, or wait for it (within the timeout) and finish.

        The five collectives of the benchmark write this tail out themselves: one
        Python call less per blocking call is measurable at 8 bytes.
        """
        if async_op:
            return Work([req], post, keep, op, self, self.seq, self.timeout_s)
        try:
            if not req.Test():
                self._wait(op, req, keep)
        except MPI.Exception as exc:
            raise self._fail(op, exc) from exc
        if post is not None:
            post()
        return None

    def _wait(self, op: str, req: MPI.Request, keep: Any) -> None:
        """Block until ``req`` completes or the group's timeout passes (then raise).

        Only called once a first test found ``req`` incomplete, so the call costs
        nothing that waiting would not have cost anyway.
        """
        if not poll(req.Test, self.timeout_s):
            self._expired(op, req, keep)

    def _expired(self, op: str, req: MPI.Request, keep: Any) -> None:
        """A blocking call ran out of time: keep its buffers forever and raise."""
        self.keep_stuck([req], keep)
        raise self.timeout_error(op, self.seq, self.timeout_s)

    def _fail(self, op: str, exc: MPI.Exception) -> Exception:
        return self.backend_error(op, self.seq, exc)

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
        """Run a reduction whose MPI call is ``start(send message, recv message, op)``.

        Handles what a single native MPI call cannot: AVG (divide afterwards),
        PREMUL_SUM (scale a copy of the input first), dtypes that MPI cannot reduce
        (work on a float32 copy) and staged outputs (write back).
        """
        base, factor = resolve(op, fn)
        info = e.info
        entry = OP_TABLE[info.kind][base]
        if entry is None:
            raise invalid_op_error(fn, base, info.kind, info.name)
        prim, post = entry
        wide = e.wide
        if wide is not None:
            s = send.astype(wide)
            world.stats.count_copy(s.nbytes)
            if in_place or recv is None:
                r = s if in_place else None
            else:
                r = np.empty(recv.shape, wide)
                world.stats.count_copy(r.nbytes)
            mpi_type = self._types[wide].mpi
        else:
            s, r, mpi_type = send, recv, e.mpi
        if post is Post.PREMUL:
            f = factor_value(factor)
            if isinstance(f, complex) and info.kind != "c":
                raise ValueError(f"{fn}: PREMUL_SUM factor {f!r} is complex but the array is {info.name}")
            if s is send and not in_place:  # never scale the caller's input
                s = send.copy()
                world.stats.count_copy(s.nbytes)
            np.multiply(s, f, out=s, casting="unsafe")
        smsg = IN_PLACE if in_place else [s, mpi_type]
        rmsg = None if r is None else [r, mpi_type]
        try:
            req = start(smsg, rmsg, _PRIM_OPS[prim])
        except MPI.Exception as exc:
            raise self._fail(fn, exc) from exc
        size = self.size

        def finish() -> None:
            if r is not None:
                if post is Post.AVG:
                    _divide_inplace(r, size)
                if wide is not None:
                    np.copyto(recv, r, casting="unsafe")
            if backs:
                _write_backs(backs)

        return self._done(fn, req, finish, (send, recv, s, r, keep), async_op)

    def all_reduce(self, buf: ndarray, backs: Any, op: Any, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "all_reduce")
        mop = e.ops[op] if type(op) is RedOpType else _GENERAL
        if type(mop) is not Op or backs is not None:
            comm = self.comm
            return self._reduction(
                "all_reduce", e, op, buf, buf, True,
                lambda s, r, o: comm.Iallreduce(s, r, o), backs, async_op,
            )  # fmt: skip
        try:
            req = self._iallreduce(IN_PLACE, buf if e.direct else [buf, e.mpi], mop)
            if async_op:
                return Work([req], None, buf, "all_reduce", self, self.seq, self.timeout_s)
            if not req.Test():
                self._wait("all_reduce", req, buf)
        except MPI.Exception as exc:
            raise self._fail("all_reduce", exc) from exc
        return None

    def reduce(self, buf: ndarray, backs: Any, op: Any, root: int, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "reduce")
        comm = self.comm
        at_root = self.rank == root
        return self._reduction(
            "reduce", e, op, buf, buf if at_root else None, at_root,
            lambda s, r, o: comm.Ireduce(s, r, o, root), backs, async_op,
        )  # fmt: skip

    def reduce_scatter_tensor(self, out: ndarray, backs: Any, inp: ndarray, op: Any, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or self._bad_dtype(out, "reduce_scatter_tensor")
        if (out.base is not None or inp.base is not None or out is inp) and _arrays.may_overlap(out, inp):
            inp = self._separate(inp)  # MPI forbids aliased buffers
        mop = e.ops[op] if type(op) is RedOpType else _GENERAL
        comm = self.comm
        if type(mop) is not Op or backs is not None:
            return self._reduction(
                "reduce_scatter_tensor", e, op, inp, out, False,
                lambda s, r, o: comm.Ireduce_scatter(s, r, None, o), backs, async_op,
            )  # fmt: skip
        smsg = inp if e.direct else [inp, e.mpi]
        rmsg = out if e.direct else [out, e.mpi]
        try:
            if inp.nbytes < _BLOCK_VARIANT_LIMIT:
                req = self._ireduce_scatter_block(smsg, rmsg, mop)
            else:
                req = comm.Ireduce_scatter(smsg, rmsg, None, mop)
            if async_op:
                return Work([req], None, (inp, out), "reduce_scatter_tensor", self, self.seq, self.timeout_s)
            if not req.Test():
                self._wait("reduce_scatter_tensor", req, (inp, out))
        except MPI.Exception as exc:
            raise self._fail("reduce_scatter_tensor", exc) from exc
        return None

    def reduce_scatter(
        self, out: ndarray, backs: Any, ins: Sequence[ndarray], op: Any, async_op: bool
    ) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or self._bad_dtype(out, "reduce_scatter")
        counts = [a.size for a in ins]
        if _consecutive(ins) and not any(_arrays.may_overlap(out, a) for a in ins):
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
        if backs is not None:
            try:
                req = self.comm.Ibcast([buf, e.mpi], root)
            except MPI.Exception as exc:
                raise self._fail("broadcast", exc) from exc
            return self._done("broadcast", req, lambda: _write_backs(backs), buf, async_op)
        try:
            req = self._ibcast(buf if e.direct else [buf, e.mpi], root)
            if async_op:
                return Work([req], None, buf, "broadcast", self, self.seq, self.timeout_s)
            if not req.Test():
                self._wait("broadcast", req, buf)
        except MPI.Exception as exc:
            raise self._fail("broadcast", exc) from exc
        return None

    def all_gather_into_tensor(self, out: ndarray, backs: Any, inp: ndarray, async_op: bool) -> Work | None:
        self.seq += 1
        e = self._types.get(out.dtype) or self._bad_dtype(out, "all_gather_into_tensor")
        smsg: Any = inp if e.direct else [inp, e.mpi]
        if (out.base is not None or inp.base is not None or out is inp) and _arrays.may_overlap(out, inp):
            mine = inp.nbytes * self.rank
            if inp.nbytes and _address(inp) == _address(out) + mine:
                smsg = IN_PLACE  # the input already sits in this rank's slot of the output
            else:
                smsg = [self._separate(inp), e.mpi]
        rmsg = out if e.direct else [out, e.mpi]
        if backs is not None:
            try:
                req = self.comm.Iallgather(smsg, rmsg)
            except MPI.Exception as exc:
                raise self._fail("all_gather_into_tensor", exc) from exc
            return self._done("all_gather_into_tensor", req, lambda: _write_backs(backs), (out, smsg), async_op)
        try:
            req = self._iallgather(smsg, rmsg)
            if async_op:
                return Work([req], None, (out, smsg), "all_gather_into_tensor", self, self.seq, self.timeout_s)
            if not req.Test():
                self._wait("all_gather_into_tensor", req, (out, smsg))
        except MPI.Exception as exc:
            raise self._fail("all_gather_into_tensor", exc) from exc
        return None

    def all_gather(self, outs: Sequence[ndarray], backs: Any, inp: ndarray, async_op: bool) -> Work | None:
        self.seq += 1
        counts, addrs = _layout(outs, "all_gather", "tensor_list", True)
        smsg = self._own_block(inp, outs[self.rank], addrs[self.rank], outs)
        try:
            req = self.comm.Iallgatherv(smsg, [BOTTOM, counts, addrs, BYTE])
        except MPI.Exception as exc:
            raise self._fail("all_gather", exc) from exc
        post = None if not backs else (lambda: _write_backs(backs))
        return self._done("all_gather", req, post, (inp, outs, smsg), async_op)

    def _own_block(self, inp: ndarray, mine: ndarray, mine_addr: int, outs: Sequence[ndarray]) -> Any:
        """The send message of a rank whose output block may be (or overlap) its input."""
        if not any(_arrays.may_overlap(inp, o) for o in outs):
            return [inp, inp.nbytes, BYTE]
        if inp.nbytes and mine.nbytes == inp.nbytes and _address(inp) == mine_addr:
            return IN_PLACE
        copy = self._separate(inp)
        return [copy, copy.nbytes, BYTE]

    def gather(
        self, inp: ndarray, outs: Sequence[ndarray] | None, backs: Any, root: int, async_op: bool
    ) -> Work | None:
        self.seq += 1
        if outs is None:
            smsg: Any = [inp, inp.nbytes, BYTE]
            rmsg = None
        else:
            counts, addrs = _layout(outs, "gather", "gather_list", True)
            smsg = self._own_block(inp, outs[self.rank], addrs[self.rank], outs)
            rmsg = [BOTTOM, counts, addrs, BYTE]
        try:
            req = self.comm.Igatherv(smsg, rmsg, root)
        except MPI.Exception as exc:
            raise self._fail("gather", exc) from exc
        post = None if not backs else (lambda: _write_backs(backs))
        return self._done("gather", req, post, (inp, outs, smsg), async_op)

    def scatter(
        self, out: ndarray, backs: Any, ins: Sequence[ndarray] | None, root: int, async_op: bool
    ) -> Work | None:
        self.seq += 1
        rmsg: Any = [out, out.nbytes, BYTE]
        if ins is None:
            smsg = None
        else:
            counts, addrs = _layout(ins, "scatter", "scatter_list", False)
            smsg = [BOTTOM, counts, addrs, BYTE]
            if any(_arrays.may_overlap(out, a) for a in ins):
                mine = ins[self.rank]
                if out.nbytes and mine.nbytes == out.nbytes and addrs[self.rank] == _address(out):
                    rmsg = IN_PLACE  # this rank's block already is its output
                else:
                    ins = [self._separate(a) if _arrays.may_overlap(out, a) else a for a in ins]
                    counts, addrs = _layout(ins, "scatter", "scatter_list", False)
                    smsg = [BOTTOM, counts, addrs, BYTE]
        try:
            req = self.comm.Iscatterv(smsg, rmsg, root)
        except MPI.Exception as exc:
            raise self._fail("scatter", exc) from exc
        post = None if not backs else (lambda: _write_backs(backs))
        return self._done("scatter", req, post, (out, ins), async_op)

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
        if (out.base is not None or inp.base is not None or out is inp) and _arrays.may_overlap(out, inp):
            inp = self._separate(inp)  # MPI forbids aliased buffers
        if out_counts is None or in_counts is None:
            smsg: Any = inp if e.direct else [inp, e.mpi]
            rmsg: Any = out if e.direct else [out, e.mpi]
        else:
            smsg = [inp, list(in_counts), _displacements(in_counts), e.mpi]
            rmsg = [out, list(out_counts), _displacements(out_counts), e.mpi]
        if backs is not None or out_counts is not None:
            start = self.comm.Ialltoall if out_counts is None else self.comm.Ialltoallv
            post = None if backs is None else (lambda: _write_backs(backs))
            try:
                req = start(smsg, rmsg)
            except MPI.Exception as exc:
                raise self._fail("all_to_all_single", exc) from exc
            return self._done("all_to_all_single", req, post, (inp, out), async_op)
        try:
            req = self._ialltoall(smsg, rmsg)
            if async_op:
                return Work([req], None, (inp, out), "all_to_all_single", self, self.seq, self.timeout_s)
            if not req.Test():
                self._wait("all_to_all_single", req, (inp, out))
        except MPI.Exception as exc:
            raise self._fail("all_to_all_single", exc) from exc
        return None

    def all_to_all(
        self, outs: Sequence[ndarray], backs: Any, ins: Sequence[ndarray], async_op: bool
    ) -> Work | None:
        self.seq += 1
        rcounts, raddrs = _layout(outs, "all_to_all", "output_tensor_list", True)
        if any(_arrays.may_overlap(o, a) for o in outs for a in ins):
            ins = [self._separate(a) for a in ins]
        scounts, saddrs = _layout(ins, "all_to_all", "input_tensor_list", False)
        try:
            req = self.comm.Ialltoallv([BOTTOM, scounts, saddrs, BYTE], [BOTTOM, rcounts, raddrs, BYTE])
        except MPI.Exception as exc:
            raise self._fail("all_to_all", exc) from exc
        post = None if not backs else (lambda: _write_backs(backs))
        return self._done("all_to_all", req, post, (ins, outs), async_op)

    def barrier(self, async_op: bool) -> Work | None:
        self.seq += 1
        try:
            req = self.comm.Ibarrier()
        except MPI.Exception as exc:
            raise self._fail("barrier", exc) from exc
        return self._done("barrier", req, None, None, async_op)

    # -- point-to-point -------------------------------------------------------------------
    def send(self, buf: ndarray, peer: int, tag: int) -> Work:
        self.seq += 1
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "send")
        try:
            req = self.comm.Isend([buf, e.mpi], peer, tag)
        except MPI.Exception as exc:
            raise self._fail("send", exc) from exc
        return Work([req], None, buf, "send", self, self.seq, self.timeout_s)

    def recv(self, buf: ndarray, backs: Any, peer: int | None, tag: int) -> Work:
        self.seq += 1
        e = self._types.get(buf.dtype) or self._bad_dtype(buf, "recv")
        status = MPI.Status()
        source = ANY_SOURCE if peer is None else peer
        try:
            req = self.comm.Irecv([buf, e.mpi], source, tag)
        except MPI.Exception as exc:
            raise self._fail("recv", exc) from exc

        def finish() -> None:
            got = status.Get_count(e.mpi)
            if got != buf.size:
                raise ValueError(
                    f"recv: expected {buf.size} elements of {e.info.name} from rank "
                    f"{status.Get_source()} (group rank) but {got} arrived; sizes must match"
                )
            if backs:
                _write_backs(backs)

        return Work([req], finish, buf, "recv", self, self.seq, self.timeout_s, status)


def _displacements(counts: Sequence[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out
