"""The benchmark's cases: one entry of :data:`CASES` per ``-c`` choice.

A :class:`Case` knows its size rule (nccl-tests' size S and count), its bus
bandwidth factor, and how to set up one size: :meth:`Case.setup` returns a
:class:`Run` holding the buffers, one mpidist iteration, one raw mpi4py iteration
(the blocking call on a duplicate of ``COMM_WORLD``) and what each rank's outputs
must hold for ``--check``. A new case is one more :func:`register` call.

The ``*_persistent`` cases time mpidist's persistent operations
(``mpidist.all_reduce_init`` ...): made once per size, then each iteration is
``p.start(); p.wait()``, against the same raw mpi4py blocking call as the one-off case.

Inputs are small integers (exact in every dtype, also when summed), the same
function of (rank, index) on every rank, so every rank can build every expected
result with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..reduce_op import divide_average as divide  # AVG as mpidist defines it: raw mpi4py sums, then this

__all__ = [
    "CASES", "Case", "Context", "Run", "register", "OPS", "DTYPES", "RAW_MODES", "parse_dtype", "raw_datatype", "raw_op",
]  # fmt: skip

#: how raw mpi4py makes the calls mpidist is compared with (``--raw``; see Context.mpi)
RAW_MODES = ("blocking", "nonblocking")

#: ``--op`` choices: name -> the ReduceOp attribute
OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG",
       "band": "BAND", "bor": "BOR", "bxor": "BXOR"}  # fmt: skip

#: ``--dtype`` choices (numpy names); bfloat16 comes from ml_dtypes
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128")  # fmt: skip
#: nccl-tests' names for the same types
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16"}


def parse_dtype(name: str) -> np.dtype:
    """``'float32'`` (or nccl-tests' ``'float'``) -> the numpy dtype; ValueError for other names."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)} (or half, float, double)")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# -- raw mpi4py's datatypes and reductions -----------------------------------------------------
_MPI_TYPE_NAMES = {
    "bool": "C_BOOL", "int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
    "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T", "uint64": "UINT64_T",
    "float16": "FLOAT16_T", "bfloat16": "BFLOAT16_T", "float32": "FLOAT", "float64": "DOUBLE",
    "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX",
}  # fmt: skip
_BY_SIZE = {1: "UINT8_T", 2: "UINT16_T", 4: "UINT32_T", 8: "UINT64_T", 16: "C_DOUBLE_COMPLEX"}
_MPI_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX",
            "band": "BAND", "bor": "BOR", "bxor": "BXOR"}  # fmt: skip
# bool arrays reduce logically (as mpidist and torch do)
_BOOL_OPS = {"sum": "LOR", "prod": "LAND", "min": "LAND", "max": "LOR", "band": "LAND", "bor": "LOR", "bxor": "LXOR"}
_NUMPY_OPS = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
              "BOR": np.bitwise_or, "BXOR": np.bitwise_xor, "LAND": np.logical_and, "LOR": np.logical_or,
              "LXOR": np.logical_xor}  # fmt: skip


def _native(dtype: np.dtype) -> MPI.Datatype:
    return getattr(MPI, _MPI_TYPE_NAMES.get(dtype.name, ""), MPI.DATATYPE_NULL)


def raw_datatype(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype raw mpi4py moves ``dtype`` with: the native one, else a same-size integer."""
    native = _native(dtype)
    return native if native != MPI.DATATYPE_NULL else getattr(MPI, _BY_SIZE[dtype.itemsize])


def _prim(dtype: np.dtype, op: str) -> str:
    return _BOOL_OPS.get(op, "") if dtype.kind == "b" else _MPI_OPS[op]


def raw_op(dtype: np.dtype, op: str) -> tuple[MPI.Op | None, str]:
    """``(MPI op, "")`` if this MPI library computes ``op`` on ``dtype`` natively, else ``(None, why not)``.

    Probed with ``MPI_Reduce_local`` (as mpidist probes its own table), so the answer
    is the library's and identical on every rank. AVG is raw SUM followed by a
    division in place.
    """
    prim = _prim(dtype, op)
    native = _native(dtype)
    why = f"this MPI library cannot compute {op} on {dtype.name} natively"
    if native == MPI.DATATYPE_NULL or not prim:
        return None, why
    a = np.array([1, 0, 1, 2]).astype(dtype)
    b = np.array([1, 1, 0, 3]).astype(dtype)
    want = _NUMPY_OPS[prim](a, b).astype(dtype)
    try:
        getattr(MPI, prim).Reduce_local([a.view(np.uint8), native], [b.view(np.uint8), native])
    except MPI.Exception:
        return None, why
    if not np.array_equal(b, want):
        return None, why
    return getattr(MPI, prim), ""


# -- what every case needs -------------------------------------------------------------------
@dataclass
class Context:
    """The run's settings and handles, the same for every case and size."""

    dist: Any  # the mpidist module
    comm: MPI.Comm  # raw mpi4py's communicator: a duplicate of COMM_WORLD
    arrays: Any  # a namespace from devices.py
    dtype: np.dtype
    op: str  # an OPS name
    root: int
    window: int  # messages per iteration of p2p_bandwidth
    raw_mode: str = "blocking"  # RAW_MODES: how raw mpi4py makes each call
    share: bool = False  # while timing: raw mpi4py's calls use mpidist's arrays where they can (twin)
    rank: int = field(init=False)
    size: int = field(init=False)
    reduce_op: Any = field(init=False)  # the mpidist ReduceOp
    raw_type: MPI.Datatype = field(init=False)
    raw_op: MPI.Op | None = field(init=False)
    raw_op_missing: str = field(init=False)

    def __post_init__(self) -> None:
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.reduce_op = getattr(self.dist.ReduceOp, OPS[self.op])
        self.raw_type = raw_datatype(self.dtype)
        self.raw_op, self.raw_op_missing = raw_op(self.dtype, self.op)

    def empty(self, k: int) -> Any:
        return self.arrays.empty(k, self.dtype)

    def twin(self, a: Any, k: int) -> Any:
        """Raw mpi4py's array of ``k`` elements in the place of mpidist's ``a``: ``a`` itself while timing
        (``share``: the same pages for both, wherever the allocator put them), a new one while checking."""
        return a if self.share else self.empty(k)

    def buf(self, a: Any) -> list[Any]:
        """Raw mpi4py's message for array ``a``: ``[its bytes, datatype]``."""
        return [self.arrays.raw(a), self.raw_type]

    def mpi(self, name: str, *args: Any) -> Callable[[], Any]:
        """Raw mpi4py's call ``comm.<name>(*args)`` as a function of no arguments, made as ``raw_mode`` says.

        ``blocking``: the call itself. ``nonblocking``: its ``I`` variant (``Iallreduce``
        for ``Allreduce``), then ``Test`` until it completes: what a timeout-safe call
        must do at least, the floor of mpidist's one-off calls.
        """
        if self.raw_mode == "blocking":
            call = getattr(self.comm, name)
            return lambda: call(*args)
        start = getattr(self.comm, "I" + name.lower())

        def nonblocking() -> None:
            req = start(*args)
            while not req.Test():
                pass

        return nonblocking

    def raw_missing(self, reduces: bool) -> str | None:
        """Why raw mpi4py cannot run this case here (None: it can)."""
        if self.arrays.raw_missing:
            return self.arrays.raw_missing
        if reduces and self.raw_op is None:
            return self.raw_op_missing
        return None

    def averaged(self, call: Callable[[], Any], out: Any) -> Callable[[], Any]:
        """``call`` followed by AVG's division of ``out`` when ``--op avg`` (raw MPI has no AVG)."""
        if self.op != "avg":
            return call
        typed, n, xp = self.arrays.typed(out), self.size, self.arrays.xp

        def call_then_divide() -> None:
            call()
            divide(typed, n, xp)

        return call_then_divide

    # -- known inputs and expected results (numpy, on every rank) --
    def pattern(self, k: int, rank: int) -> np.ndarray:
        """Rank ``rank``'s input of ``k`` elements: small integers, exact in every dtype."""
        i = np.arange(k, dtype=np.int64)
        if self.dtype.kind == "b":
            values = (i + rank) % 3 == 0
        elif self.op == "prod":
            values = 1 + (i + rank) % 2  # products stay powers of two
        else:
            values = (i * 7 + 3 * rank) % 5 + 1 + rank % 3  # 1..7
        return values.astype(self.dtype)

    def reduced(self, k: int) -> np.ndarray:
        """What ``--op`` over every rank's :meth:`pattern` gives, computed in a wide type then rounded once."""
        kind = self.dtype.kind
        wide = {"b": np.bool_, "i": np.int64, "u": np.uint64, "c": np.complex128}.get(kind, np.float64)
        prim = _NUMPY_OPS[_prim(self.dtype, self.op)]
        acc = self.pattern(k, 0).astype(wide)
        for r in range(1, self.size):
            acc = prim(acc, self.pattern(k, r).astype(wide))
        if self.op != "avg":
            return acc.astype(self.dtype)
        if kind in "iu":  # the sum wraps in the dtype first, as it does in MPI
            acc = acc.astype(self.dtype)
        divide(acc, self.size, np)
        return acc.astype(self.dtype)


Expected = Callable[[], "np.ndarray | None"]


@dataclass
class Run:
    """One case at one size: the two implementations and, for ``--check``, what they must compute."""

    mpidist: Callable[[], Any]
    raw: Callable[[], Any] | None
    raw_missing: str | None = None
    #: arrays that hold a rank's input, with their known values (both implementations' arrays)
    inputs: list[tuple[Any, Callable[[], np.ndarray]]] = field(default_factory=list)
    #: per implementation ("mpidist", "raw"): arrays the call writes, with what they must then hold
    outputs: dict[str, list[tuple[Any, Expected]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One ``-c`` choice."""

    name: str
    summary: str
    factor: Callable[[int], float]  # nccl-tests' busbw factor for n ranks
    factor_text: str
    setup: Callable[[Context, int], Run]  # (context, count) -> the buffers and calls of one size
    split: bool = False  # the buffer is split over the ranks: S = count * n * itemsize
    reduces: bool = False  # takes --op
    rooted: bool = False  # takes --root
    sized: bool = True  # False: one row, no bytes (barrier)
    min_ranks: int = 1
    #: messages per iteration: the time column is per message (ping-pong: 2, one way each; window: --window)
    per_iteration: Callable[[Context], int] = lambda ctx: 1

    def layout(self, nbytes: int, itemsize: int, n: int) -> tuple[int, int]:
        """``(count, S)`` for a requested size: nccl-tests' count column and size in bytes."""
        if not self.sized:
            return 0, 0
        total = max(1, nbytes // itemsize)
        if self.split:
            count = max(1, total // n)
            return count, count * n * itemsize
        return total, total * itemsize


#: every case, in ``-c all`` order
CASES: dict[str, Case] = {}


def register(case: Case) -> Case:
    CASES[case.name] = case
    return case


def _persistent(run: Run, make: Callable[[], Callable[[], None]]) -> Run:
    """``run`` with its mpidist iteration replaced by the one ``make()`` returns (after making the operations).

    The persistent operations are made at the first call (the check or the first
    call of the size: collective, on every rank, and where mpidist's refusal is
    reported as a one-off call's is); that call rebinds ``run.mpidist`` to the bare
    iteration, which is what is timed.
    """

    def first() -> None:
        iteration = make()
        run.mpidist = iteration
        iteration()

    run.mpidist = first
    return run


def _start_wait(p: Any) -> Callable[[], None]:
    """One iteration of a persistent collective: ``p.start(); p.wait()``."""
    start, wait = p.start, p.wait

    def iteration() -> None:
        start()
        wait()

    return iteration


def _variant(run: Run, make: Callable[[], Any], persistent: bool) -> Run:
    """``run`` (a one-off case), or its persistent variant: each iteration starts and waits for ``make()``'s operation."""
    return _persistent(run, lambda: _start_wait(make())) if persistent else run


def _all_n(n: int) -> float:
    return 2 * (n - 1) / n


def _one(n: int) -> float:
    return 1.0


def _spread(n: int) -> float:
    return (n - 1) / n


# -- the collectives ---------------------------------------------------------------------------
def _all_reduce(ctx: Context, c: int, persistent: bool = False) -> Run:
    a = ctx.empty(c)
    b = ctx.twin(a, c)
    dist, op, rb, mop = ctx.dist, ctx.reduce_op, ctx.buf(b), ctx.raw_op
    missing = ctx.raw_missing(reduces=True)

    raw = ctx.mpi("Allreduce", MPI.IN_PLACE, rb, mop)

    want = lambda: ctx.reduced(c)  # noqa: E731
    run = Run(
        mpidist=lambda: dist.all_reduce(a, op=op),
        raw=None if missing else ctx.averaged(raw, b),
        raw_missing=missing,
        inputs=[(a, lambda: ctx.pattern(c, ctx.rank)), (b, lambda: ctx.pattern(c, ctx.rank))],
        outputs={"mpidist": [(a, want)], "raw": [(b, want)]},
    )
    return _variant(run, lambda: dist.all_reduce_init(a, op=op), persistent)


def _broadcast(ctx: Context, c: int, persistent: bool = False) -> Run:
    a = ctx.empty(c)
    b = ctx.twin(a, c)
    dist, root, rb = ctx.dist, ctx.root, ctx.buf(b)
    want = lambda: ctx.pattern(c, root)  # noqa: E731
    run = Run(
        mpidist=lambda: dist.broadcast(a, src=root),
        raw=ctx.mpi("Bcast", rb, root),
        raw_missing=ctx.raw_missing(reduces=False),
        inputs=[(a, lambda: ctx.pattern(c, ctx.rank)), (b, lambda: ctx.pattern(c, ctx.rank))],
        outputs={"mpidist": [(a, want)], "raw": [(b, want)]},
    )
    return _variant(run, lambda: dist.broadcast_init(a, src=root), persistent)


def _reduce(ctx: Context, c: int, persistent: bool = False) -> Run:
    a = ctx.empty(c)
    b = ctx.twin(a, c)
    dist, op, root, rb, mop = ctx.dist, ctx.reduce_op, ctx.root, ctx.buf(b), ctx.raw_op
    missing = ctx.raw_missing(reduces=True)
    if ctx.rank == root:
        raw_call = ctx.averaged(ctx.mpi("Reduce", MPI.IN_PLACE, rb, mop, root), b)
        want: Expected = lambda: ctx.reduced(c)  # noqa: E731
    else:
        raw_call = ctx.mpi("Reduce", rb, None, mop, root)
        want = lambda: None  # noqa: E731 - undefined off the root
    run = Run(
        mpidist=lambda: dist.reduce(a, dst=root, op=op),
        raw=None if missing else raw_call,
        raw_missing=missing,
        inputs=[(a, lambda: ctx.pattern(c, ctx.rank)), (b, lambda: ctx.pattern(c, ctx.rank))],
        outputs={"mpidist": [(a, want)], "raw": [(b, want)]},
    )
    return _variant(run, lambda: dist.reduce_init(a, dst=root, op=op), persistent)


def _gathered(ctx: Context, c: int) -> np.ndarray:
    return np.concatenate([ctx.pattern(c, r) for r in range(ctx.size)])


def _all_gather_into_tensor(ctx: Context, c: int, persistent: bool = False) -> Run:
    n = ctx.size
    a, out = ctx.empty(c), ctx.empty(c * n)
    b, raw_out = ctx.twin(a, c), ctx.twin(out, c * n)
    dist, rb, rout = ctx.dist, ctx.buf(b), ctx.buf(raw_out)
    want = lambda: _gathered(ctx, c)  # noqa: E731
    run = Run(
        mpidist=lambda: dist.all_gather_into_tensor(out, a),
        raw=ctx.mpi("Allgather", rb, rout),
        raw_missing=ctx.raw_missing(reduces=False),
        inputs=[(a, lambda: ctx.pattern(c, ctx.rank)), (b, lambda: ctx.pattern(c, ctx.rank))],
        outputs={"mpidist": [(out, want)], "raw": [(raw_out, want)]},
    )
    return _variant(run, lambda: dist.all_gather_into_tensor_init(out, a), persistent)


def _all_gather(ctx: Context, c: int) -> Run:
    """mpidist gathers into a list of n separate arrays; raw mpi4py into one contiguous buffer (Allgather)."""
    n = ctx.size
    a, outs, b, raw_out = ctx.empty(c), [ctx.empty(c) for _ in range(n)], ctx.empty(c), ctx.empty(c * n)
    dist, rb, rout = ctx.dist, ctx.buf(b), ctx.buf(raw_out)
    return Run(
        mpidist=lambda: dist.all_gather(outs, a),
        raw=ctx.mpi("Allgather", rb, rout),
        raw_missing=ctx.raw_missing(reduces=False),
        inputs=[(a, lambda: ctx.pattern(c, ctx.rank)), (b, lambda: ctx.pattern(c, ctx.rank))],
        outputs={
            "mpidist": [(o, lambda r=r: ctx.pattern(c, r)) for r, o in enumerate(outs)],
            "raw": [(raw_out, lambda: _gathered(ctx, c))],
        },
    )


def _reduce_scatter_tensor(ctx: Context, c: int, persistent: bool = False) -> Run:
    n, me = ctx.size, ctx.rank
    a, out = ctx.empty(c * n), ctx.empty(c)
    b, raw_out = ctx.twin(a, c * n), ctx.twin(out, c)
    dist, op, rb, rout, mop = ctx.dist, ctx.reduce_op, ctx.buf(b), ctx.buf(raw_out), ctx.raw_op
    missing = ctx.raw_missing(reduces=True)

    raw = ctx.mpi("Reduce_scatter_block", rb, rout, mop)

    want = lambda: ctx.reduced(c * n)[me * c : (me + 1) * c]  # noqa: E731
    run = Run(
        mpidist=lambda: dist.reduce_scatter_tensor(out, a, op=op),
        raw=None if missing else ctx.averaged(raw, raw_out),
        raw_missing=missing,
        inputs=[(a, lambda: ctx.pattern(c * n, me)), (b, lambda: ctx.pattern(c * n, me))],
        outputs={"mpidist": [(out, want)], "raw": [(raw_out, want)]},
    )
    return _variant(run, lambda: dist.reduce_scatter_tensor_init(out, a, op=op), persistent)


def _all_to_all_single(ctx: Context, c: int, persistent: bool = False) -> Run:
    n, me = ctx.size, ctx.rank
    a, out = ctx.empty(c * n), ctx.empty(c * n)
    b, raw_out = ctx.twin(a, c * n), ctx.twin(out, c * n)
    dist, rb, rout = ctx.dist, ctx.buf(b), ctx.buf(raw_out)

    def want() -> np.ndarray:
        return np.concatenate([ctx.pattern(c * n, r)[me * c : (me + 1) * c] for r in range(n)])

    run = Run(
        mpidist=lambda: dist.all_to_all_single(out, a),
        raw=ctx.mpi("Alltoall", rb, rout),
        raw_missing=ctx.raw_missing(reduces=False),
        inputs=[(a, lambda: ctx.pattern(c * n, me)), (b, lambda: ctx.pattern(c * n, me))],
        outputs={"mpidist": [(out, want)], "raw": [(raw_out, want)]},
    )
    return _variant(run, lambda: dist.all_to_all_single_init(out, a), persistent)


def _gather(ctx: Context, c: int) -> Run:
    """mpidist gathers into a list of n arrays on the root; raw mpi4py into one buffer (Gather)."""
    n, me, root = ctx.size, ctx.rank, ctx.root
    a, b = ctx.empty(c), ctx.empty(c)
    dist, rb = ctx.dist, ctx.buf(b)
    outputs: dict[str, list[tuple[Any, Expected]]] = {"mpidist": [], "raw": []}
    if me == root:
        outs, raw_out = [ctx.empty(c) for _ in range(n)], ctx.empty(c * n)
        rout = ctx.buf(raw_out)
        mpidist_call = lambda: dist.gather(a, outs, dst=root)  # noqa: E731
        raw_call = ctx.mpi("Gather", rb, rout, root)
        outputs = {
            "mpidist": [(o, lambda r=r: ctx.pattern(c, r)) for r, o in enumerate(outs)],
            "raw": [(raw_out, lambda: _gathered(ctx, c))],
        }
    else:
        mpidist_call = lambda: dist.gather(a, None, dst=root)  # noqa: E731
        raw_call = ctx.mpi("Gather", rb, None, root)
    return Run(
        mpidist=mpidist_call,
        raw=raw_call,
        raw_missing=ctx.raw_missing(reduces=False),
        inputs=[(a, lambda: ctx.pattern(c, me)), (b, lambda: ctx.pattern(c, me))],
        outputs=outputs,
    )


def _scatter(ctx: Context, c: int) -> Run:
    """mpidist scatters from a list of n arrays on the root; raw mpi4py from one buffer (Scatter)."""
    n, me, root = ctx.size, ctx.rank, ctx.root
    out, raw_out = ctx.empty(c), ctx.empty(c)
    dist, rout = ctx.dist, ctx.buf(raw_out)
    inputs: list[tuple[Any, Callable[[], np.ndarray]]] = []
    if me == root:
        ins, b = [ctx.empty(c) for _ in range(n)], ctx.empty(c * n)
        rb = ctx.buf(b)
        mpidist_call = lambda: dist.scatter(out, ins, src=root)  # noqa: E731
        raw_call = ctx.mpi("Scatter", rb, rout, root)
        inputs = [(x, lambda r=r: ctx.pattern(c * n, root)[r * c : (r + 1) * c]) for r, x in enumerate(ins)]
        inputs.append((b, lambda: ctx.pattern(c * n, root)))
    else:
        mpidist_call = lambda: dist.scatter(out, None, src=root)  # noqa: E731
        raw_call = ctx.mpi("Scatter", None, rout, root)
    want = lambda: ctx.pattern(c * n, root)[me * c : (me + 1) * c]  # noqa: E731
    return Run(
        mpidist=mpidist_call,
        raw=raw_call,
        raw_missing=ctx.raw_missing(reduces=False),
        inputs=inputs,
        outputs={"mpidist": [(out, want)], "raw": [(raw_out, want)]},
    )


def _barrier(ctx: Context, c: int) -> Run:
    dist = ctx.dist
    return Run(mpidist=lambda: dist.barrier(), raw=ctx.mpi("Barrier"), raw_missing=None)


def _noop() -> None:
    pass


def _p2p_latency(ctx: Context, c: int, persistent: bool = False) -> Run:
    """Ping-pong between ranks 0 and 1 (OSU's osu_latency); the other ranks wait at the batch barriers.

    Persistent: ``send_init``/``recv_init`` made once, each one-way message a ``start(); wait()``."""
    me = ctx.rank
    s, r, rs, rr = ctx.empty(c), ctx.empty(c), ctx.empty(c), ctx.empty(c)
    dist, bs, br = ctx.dist, ctx.buf(rs), ctx.buf(rr)
    missing = ctx.raw_missing(reduces=False)
    if me > 1:
        return Run(mpidist=_noop, raw=None if missing else _noop, raw_missing=missing)
    peer = 1 - me
    if me == 0:

        def mpidist_call() -> None:
            dist.send(s, peer)
            dist.recv(r, peer)

    else:

        def mpidist_call() -> None:
            dist.recv(r, peer)
            dist.send(s, peer)

    raw_send, raw_recv = ctx.mpi("Send", bs, peer), ctx.mpi("Recv", br, peer)  # --raw nonblocking: Isend/Irecv + Test
    raw_call = _ping_pong_raw(raw_send, raw_recv, me == 0)

    want = lambda: ctx.pattern(c, peer)  # noqa: E731
    run = Run(
        mpidist=mpidist_call,
        raw=raw_call,
        raw_missing=missing,
        inputs=[(s, lambda: ctx.pattern(c, me)), (rs, lambda: ctx.pattern(c, me))],
        outputs={"mpidist": [(r, want)], "raw": [(rr, want)]},
    )
    if persistent:
        return _persistent(run, lambda: _ping_pong(dist.send_init(s, dst=peer), dist.recv_init(r, src=peer), me == 0))
    return run


def _ping_pong_raw(send: Callable[[], Any], recv: Callable[[], Any], sends_first: bool) -> Callable[[], None]:
    """One raw ping-pong iteration: ``send`` then ``recv``, or ``recv`` then ``send``."""
    a, b = (send, recv) if sends_first else (recv, send)

    def iteration() -> None:
        a()
        b()

    return iteration


def _ping_pong(send: Any, recv: Any, sends_first: bool) -> Callable[[], None]:
    """One ping-pong iteration of a persistent send and receive: send then receive, or receive then send."""
    a, b = (send, recv) if sends_first else (recv, send)
    a_start, a_wait, b_start, b_wait = a.start, a.wait, b.start, b.wait

    def iteration() -> None:
        a_start()
        a_wait()
        b_start()
        b_wait()

    return iteration


def _p2p_bandwidth(ctx: Context, c: int) -> Run:
    """Rank 0 sends a window of ``--window`` isends to rank 1, which posts as many irecvs, then acknowledges
    with a one-element message (OSU's osu_bw; the window's receives share one buffer, as there)."""
    me, window = ctx.rank, ctx.window
    missing = ctx.raw_missing(reduces=False)
    if me > 1:
        return Run(mpidist=_noop, raw=None if missing else _noop, raw_missing=missing)
    buf, ack, rbuf, rack = ctx.empty(c), ctx.empty(1), ctx.empty(c), ctx.empty(1)
    dist, comm, rb, ra = ctx.dist, ctx.comm, ctx.buf(rbuf), ctx.buf(rack)
    waitall = MPI.Request.Waitall
    if me == 0:

        def mpidist_call() -> None:
            works = [dist.isend(buf, 1) for _ in range(window)]
            for w in works:
                w.wait()
            dist.recv(ack, 1)

        def raw_call() -> None:
            waitall([comm.Isend(rb, 1) for _ in range(window)])
            comm.Recv(ra, 1)

        inputs = [(buf, lambda: ctx.pattern(c, 0)), (rbuf, lambda: ctx.pattern(c, 0))]
        outputs: dict[str, list[tuple[Any, Expected]]] = {"mpidist": [], "raw": []}
    else:

        def mpidist_call() -> None:
            works = [dist.irecv(buf, 0) for _ in range(window)]
            for w in works:
                w.wait()
            dist.send(ack, 0)

        def raw_call() -> None:
            waitall([comm.Irecv(rb, 0) for _ in range(window)])
            comm.Send(ra, 0)

        want = lambda: ctx.pattern(c, 0)  # noqa: E731
        inputs = [(ack, lambda: ctx.pattern(1, 1)), (rack, lambda: ctx.pattern(1, 1))]
        outputs = {"mpidist": [(buf, want)], "raw": [(rbuf, want)]}
    return Run(mpidist=mpidist_call, raw=raw_call, raw_missing=missing, inputs=inputs, outputs=outputs)


# fmt: off
for _case in (
    Case("all_reduce", "in place; every rank gets the reduction", _all_n, "2(n-1)/n", _all_reduce, reduces=True),
    Case("broadcast", "in place, from --root", _one, "1", _broadcast, rooted=True),
    Case("reduce", "in place, onto --root", _one, "1", _reduce, reduces=True, rooted=True),
    Case("all_gather_into_tensor", "into one array of n x count", _spread, "(n-1)/n", _all_gather_into_tensor,
         split=True),
    Case("all_gather", "into a list of n arrays", _spread, "(n-1)/n", _all_gather, split=True),
    Case("reduce_scatter_tensor", "n x count in, count out", _spread, "(n-1)/n", _reduce_scatter_tensor,
         split=True, reduces=True),
    Case("all_to_all_single", "count to and from every rank", _spread, "(n-1)/n", _all_to_all_single, split=True),
    Case("gather", "into a list on --root", _spread, "(n-1)/n", _gather, split=True, rooted=True),
    Case("scatter", "from a list on --root", _spread, "(n-1)/n", _scatter, split=True, rooted=True),
    Case("barrier", "no data", _one, "-", _barrier, sized=False),
    Case("p2p_latency", "ping-pong send/recv between ranks 0 and 1; time is one way", _one, "1", _p2p_latency,
         min_ranks=2, per_iteration=lambda ctx: 2),
    Case("p2p_bandwidth", "a window of isend/irecv from rank 0 to 1; time is per message", _one, "1",
         _p2p_bandwidth, min_ranks=2, per_iteration=lambda ctx: ctx.window),
    # persistent operations: made once per size, each iteration p.start(); p.wait(); raw: the same blocking call
    Case("all_reduce_persistent", "all_reduce_init: start/wait; raw: Allreduce", _all_n, "2(n-1)/n",
         partial(_all_reduce, persistent=True), reduces=True),
    Case("broadcast_persistent", "broadcast_init: start/wait; raw: Bcast", _one, "1",
         partial(_broadcast, persistent=True), rooted=True),
    Case("reduce_persistent", "reduce_init: start/wait; raw: Reduce", _one, "1", partial(_reduce, persistent=True),
         reduces=True, rooted=True),
    Case("all_gather_into_tensor_persistent", "all_gather_into_tensor_init: start/wait; raw: Allgather", _spread,
         "(n-1)/n", partial(_all_gather_into_tensor, persistent=True), split=True),
    Case("reduce_scatter_tensor_persistent", "reduce_scatter_tensor_init: start/wait; raw: Reduce_scatter_block",
         _spread, "(n-1)/n", partial(_reduce_scatter_tensor, persistent=True), split=True, reduces=True),
    Case("all_to_all_single_persistent", "all_to_all_single_init: start/wait; raw: Alltoall", _spread, "(n-1)/n",
         partial(_all_to_all_single, persistent=True), split=True),
    Case("p2p_latency_persistent", "ping-pong of send_init/recv_init between ranks 0 and 1; time is one way",
         _one, "1", partial(_p2p_latency, persistent=True), min_ranks=2, per_iteration=lambda ctx: 2),
):
    register(_case)
# fmt: on
