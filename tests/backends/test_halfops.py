"""float16 and bfloat16 reductions with mpidist's C ops (backends/halfops.py, _halfops.c).

References are numpy's: every pairwise combine in float32, rounded to the 2-byte type
(``pairwise``). Where more than two ranks contribute, MPI's algorithm picks the order of
combination, so results are checked element by element against every order
(``any_order``); with two contributors (the other ranks add -0.0 or multiply by 1, which
change nothing) the result is one exact value. The fallback path (float32 copies, MPI's
float16 type, order keys) is the entry built with the C ops off, swapped into the group's
type table for a call (``fallback_entries``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist._world import world
from mpidist.backends import halfops, mpi_types
from mpidist.reduce_op import Prim

from helpers import BF16, Checks, gloo_group

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
F16 = np.dtype(np.float16)
HALVES = [F16, BF16]
R = dist.ReduceOp
OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG]
#: lengths around the vector loops' widths (8 and 16 lanes) and their tails
LENGTHS = [1, 7, 8, 9, 15, 17, 33, 1000, 4097]
QNAN = {"float16": 0x7E00, "bfloat16": 0x7FC0}

pytestmark = pytest.mark.skipif(
    halfops.half_ops(F16) is None, reason=f"mpidist's C ops are not in use: {halfops.halfops_status()}"
)


# -- references ----------------------------------------------------------------------------------
def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint16)


def pairwise(op: Any, dtype: np.dtype, a: np.ndarray, b: np.ndarray, high_first: bool = False) -> np.ndarray:
    """One combine as the C ops define it: float32 arithmetic rounded back, or IEEE maximum/minimum.

    SUM/PROD: the operand with the lower bits first (NaN + NaN is then the same NaN whichever side each
    comes from); ``high_first``: the other way round, which the vector loops may take (the compiler may
    swap the operands of a commutative instruction), so NaN + NaN may be either operand's NaN.
    """
    if op in (R.MIN, R.MAX):
        x, y = a.astype(np.float32), b.astype(np.float32)
        pick = np.maximum(x, y) if op == R.MAX else np.minimum(x, y)
        zeros = (x == 0) & (y == 0)  # -0 < +0: MAX(+0, -0) = +0, MIN(+0, -0) = -0
        signs = np.signbit(x) & np.signbit(y) if op == R.MAX else np.signbit(x) | np.signbit(y)
        pick = np.where(zeros, np.where(signs, np.float32(-0.0), np.float32(0.0)), pick)
        with np.errstate(invalid="ignore"):
            out = pick.astype(dtype)
        out[np.isnan(x) | np.isnan(y)] = np.nan  # the default quiet NaN
        return out
    fn = np.multiply if op == R.PRODUCT else np.add
    lo = np.minimum(bits(a), bits(b)).view(dtype)
    hi = np.maximum(bits(a), bits(b)).view(dtype)
    if high_first:
        lo, hi = hi, lo
    with np.errstate(all="ignore"):
        return fn(lo.astype(np.float32), hi.astype(np.float32)).astype(dtype).reshape(a.shape)


def divided(dtype: np.dtype, a: np.ndarray, n: int) -> np.ndarray:
    """AVG's division of one summed array, as numpy divides float16 (float32 quotient rounded back)."""
    with np.errstate(all="ignore"):
        return (a.astype(np.float32) / np.float32(n)).astype(dtype)


def orders(values: list[np.ndarray], combine: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> list[np.ndarray]:
    """Every result of combining ``values`` pairwise in any order and grouping (commutative: unordered pairs)."""
    if len(values) == 1:
        return [values[0]]
    out = []
    for i, j in itertools.combinations(range(len(values)), 2):
        rest = [v for k, v in enumerate(values) if k not in (i, j)]
        out.extend(orders(rest + [combine(values[i], values[j])], combine))
    return out


def any_order(got: np.ndarray, candidates: list[np.ndarray]) -> np.ndarray:
    """Per element: whether ``got`` is one of the candidates (a NaN matches any NaN)."""
    g = bits(got)
    ok = np.zeros(g.size, bool)
    nan = np.isnan(got.reshape(-1).astype(np.float32))
    for c in candidates:
        ok |= g == bits(c)
        ok |= nan & np.isnan(c.reshape(-1).astype(np.float32))
    return ok


def same(got: np.ndarray, want: np.ndarray, nan_payload: bool = True) -> bool:
    """Bit-identical; ``nan_payload=False``: a NaN matches any NaN (which NaN wins NaN + NaN is the CPU's choice)."""
    g, w = bits(got), bits(want)
    if nan_payload:
        return bool(np.array_equal(g, w))
    nan = np.isnan(want.reshape(-1).astype(np.float32))
    return bool(np.array_equal(g[~nan], w[~nan]) and np.isnan(got.reshape(-1).astype(np.float32)[nan]).all())


def random_bits(rng: np.random.Generator, n: int, dtype: np.dtype, finite: bool = False) -> np.ndarray:
    """Any 2-byte pattern (NaN, inf, subnormals, -0 included); ``finite``: normal numbers and zeros only."""
    b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    a = b.view(dtype)
    if finite:
        a = np.where(np.isfinite(a.astype(np.float32)), a, np.array(1.5, dtype))
        tiny = np.abs(a.astype(np.float32)) < (6.2e-5 if dtype == F16 else 1.2e-38)
        a = np.where(tiny, np.array(0.0, dtype), a)
    return np.ascontiguousarray(a, dtype)


def neutral(op: Any, n: int, dtype: np.dtype) -> np.ndarray:
    """What a non-contributing rank gives: nothing changes when it is combined."""
    return np.full(n, 1.0 if op == R.PRODUCT else -0.0, dtype)


def two_contributors(op: Any, dtype: np.dtype, n: int, seed: int, finite: bool = False) -> list[np.ndarray]:
    """Every rank's input: random patterns on ranks 0 and 1 (-0.0 or 1 elsewhere; MIN/MAX: every rank random)."""
    rng = np.random.default_rng(seed)
    rows = [random_bits(rng, n, dtype, finite) for _ in range(SIZE)]
    if op not in (R.MIN, R.MAX):
        rows[2:] = [neutral(op, n, dtype) for _ in rows[2:]]
    return rows


def expected(op: Any, dtype: np.dtype, rows: list[np.ndarray]) -> np.ndarray:
    """The result of ``rows`` combined in rank order (exact when at most two contribute, or for MIN/MAX)."""
    prim = R.SUM if op == R.AVG else op
    acc = rows[0]
    for row in rows[1:]:
        acc = pairwise(prim, dtype, acc, row)
    if op == R.AVG:
        acc = divided(dtype, acc, SIZE)
    if SIZE == 1 and op in (R.MIN, R.MAX):  # one rank: the order keys give every NaN the default bits
        acc = acc.copy()
        acc[np.isnan(acc.astype(np.float32))] = np.nan
    return acc


def fallback_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the default group reduce float16/bfloat16 as without the C ops (the entries swapped in its table)."""
    table = mpi_types.type_table(SIZE == 1)
    real = mpi_types.half_ops
    monkeypatch.setattr(mpi_types, "half_ops", lambda dtype: None)
    try:
        entries = {dt: mpi_types._entry(mpi_types._arrays.DTYPES[dt], SIZE == 1) for dt in HALVES}
    finally:
        monkeypatch.setattr(mpi_types, "half_ops", real)
    for dt, e in entries.items():
        assert e.half is None
        monkeypatch.setitem(table, dt, e)


# -- the ops themselves, on one rank ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_ops_are_numpys_pairwise_arithmetic_on_every_pattern(dtype):
    """Every 2-byte pattern against random partners, with MPI_Reduce_local: SUM/PROD bit for bit (NaN payloads
    as numpy gives them; NaN + NaN: one of the two), MIN/MAX by the float rule, the division as numpy's."""
    ops = halfops.half_ops(dtype)
    rng = np.random.default_rng(7)
    a = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    for prim, op in ((Prim.SUM, R.SUM), (Prim.PROD, R.PRODUCT), (Prim.MIN, R.MIN), (Prim.MAX, R.MAX)):
        for _ in range(2):
            b = random_bits(rng, a.size, dtype)
            got = b.copy()
            ops.by_prim[prim].Reduce_local([bits(a), MPI.UINT16_T], [bits(got), MPI.UINT16_T])
            want = pairwise(op, dtype, a, b)
            other = pairwise(op, dtype, a, b, high_first=True)  # differs from want only where both are NaN
            bad = np.flatnonzero((bits(got) != bits(want)) & (bits(got) != bits(other)))
            assert bad.size == 0, (
                f"{prim.name} {dtype}: {bad.size} differ, e.g. "
                + ", ".join(f"{bits(a)[i]:#06x} . {bits(b)[i]:#06x} -> {bits(got)[i]:#06x} != {bits(want)[i]:#06x}"
                            for i in bad[:4])
            )  # fmt: skip
    for n in (1, 2, 3, 4, 7):
        got = a.copy()
        ops.divide(got, n)
        assert same(got, divided(dtype, a, n)), f"divide by {n}"


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_min_max_nan_and_signed_zero(dtype):
    ops = halfops.half_ops(dtype)
    nan_payload = np.array(QNAN[dtype.name] | 0x8003, np.uint16).view(dtype)  # -NaN with a payload
    a = np.array([np.nan, 1.0, -0.0, 0.0, -np.inf, np.inf, 2.0], dtype)
    a[0] = nan_payload
    b = np.array([5.0, np.nan, 0.0, -0.0, np.nan, -1.0, 2.0], dtype)
    want = {
        Prim.MAX: np.array([np.nan, np.nan, 0.0, 0.0, np.nan, np.inf, 2.0], dtype),
        Prim.MIN: np.array([np.nan, np.nan, -0.0, -0.0, np.nan, -1.0, 2.0], dtype),
    }
    for prim, w in want.items():
        got = b.copy()
        ops.by_prim[prim].Reduce_local([bits(a), MPI.UINT16_T], [bits(got), MPI.UINT16_T])
        assert same(got, w), f"{prim.name}: {bits(got)} != {bits(w)}"
        assert (bits(got)[np.isnan(w.astype(np.float32))] == QNAN[dtype.name]).all(), "the default quiet NaN"


def test_status_and_switch(monkeypatch):
    assert halfops.halfops_status().startswith("C ops (")
    monkeypatch.setenv("MPIDIST_HALF_OPS", "0")
    state = halfops._make()
    assert state.ops == {} and state.reason == "MPIDIST_HALF_OPS is off"


def test_entries_use_the_c_ops_and_stay_native_only_for_devices():
    for dt in HALVES:
        e = mpi_types.type_table()[dt]
        assert e.half is halfops.half_ops(dt)
        assert e.fast[R.SUM] is e.half.by_prim[Prim.SUM] and e.fast[R.MAX] is e.half.by_prim[Prim.MAX]
        assert e.fast[R.AVG] is None and e.fast[R.BAND] is None
        # device arrays (mpi_device.py) go direct only for ops native to MPI: never with mpidist's host-memory ops
        assert not any(isinstance(o, MPI.Op) for o in e.ops)
        alone = mpi_types.type_table(True)[dt]
        assert alone.fast[R.MAX] is None and alone.fast[R.SUM] is e.fast[R.SUM]


# -- collectives -----------------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_all_reduce_exact(dtype, op):
    """Random patterns (NaN, inf, subnormals) at every odd length: exact bits, identical on every rank, no copy."""
    checks = Checks()
    for n in LENGTHS:
        rows = two_contributors(op, dtype, n, seed=n)
        want = expected(op, dtype, rows)
        for how in ("blocking", "async"):
            x = rows[RANK].copy()
            before = world.stats.copies
            work = dist.all_reduce(x, op=op, async_op=how == "async")
            if work is not None:
                work.wait()
            checks.true(f"n={n} {how}: a copy was counted", world.stats.copies == before)
            checks.true(f"n={n} {how}: {bits(x)[:6]} != {bits(want)[:6]}", same(x, want, nan_payload=False))
            checks.identical(f"n={n} {how}", x)
    checks.done()


@pytest.mark.parametrize("op", [R.SUM, R.PRODUCT, R.MAX], ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_reduce_and_reduce_scatter(dtype, op):
    checks = Checks()
    for n in (1, 9, 17):
        rows = two_contributors(op, dtype, n * SIZE, seed=100 + n)
        want = expected(op, dtype, rows)
        for root in range(SIZE):
            x = rows[RANK].copy()
            dist.reduce(x, dst=root, op=op)
            if RANK == root:
                checks.true(f"reduce n={n} root={root}", same(x, want, nan_payload=False))
        out = np.empty(n, dtype)
        dist.reduce_scatter_tensor(out, rows[RANK].copy(), op=op)
        checks.true(f"reduce_scatter_tensor n={n}", same(out, want[RANK * n : (RANK + 1) * n], nan_payload=False))
        outs = np.empty(n, dtype)
        dist.reduce_scatter(outs, list(rows[RANK].copy().reshape(SIZE, n)), op=op)
        checks.true(f"reduce_scatter n={n}", same(outs, want[RANK * n : (RANK + 1) * n], nan_payload=False))
    checks.done()


@pytest.mark.parametrize("op", [R.SUM, R.MIN, R.AVG], ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_strided_input_is_staged_and_exact(dtype, op):
    checks = Checks()
    rows = two_contributors(op, dtype, 9, seed=3)
    want = expected(op, dtype, rows)
    base = np.zeros((9, 2), dtype)
    base[:, 0] = rows[RANK]
    x = base[:, 0]
    dist.all_reduce(x, op=op)
    checks.true(f"{bits(x)} != {bits(want)}", same(np.ascontiguousarray(x), want, nan_payload=False))
    checks.true("the other column is untouched", not bits(base[:, 1]).any())
    checks.done()


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_every_rank_contributing_rounds_each_combine(dtype):
    """All ranks add random numbers: each element is some order of pairwise-rounded adds (as gloo and NCCL
    give; MPI's algorithm picks the order), the same on every rank."""
    rng = np.random.default_rng(11)
    n = 4097
    rows = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(dtype) for _ in range(SIZE)]
    x = rows[RANK].copy()
    dist.all_reduce(x)
    ok = any_order(x, orders(rows, lambda a, b: pairwise(R.SUM, dtype, a, b)))
    checks = Checks()
    checks.true(f"{(~ok).sum()} elements are no order of pairwise sums", bool(ok.all()))
    checks.identical("sum", x)
    checks.done()


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_small_integers_are_exact_at_every_size(dtype):
    """Sums, products and averages that every order computes exactly: one answer for every world size."""
    checks = Checks()
    i = np.arange(33)
    for op in OPS:
        mine = ((i + RANK) % 4 + 1 if op != R.PRODUCT else 1 + (i + RANK) % 2).astype(dtype)
        all_rows = [((i + r) % 4 + 1 if op != R.PRODUCT else 1 + (i + r) % 2).astype(np.float64) for r in range(SIZE)]
        fn = {R.SUM: np.sum, R.AVG: np.mean, R.PRODUCT: np.prod, R.MIN: np.min, R.MAX: np.max}[op]
        want = fn(np.array(all_rows), axis=0).astype(dtype)
        x = mine.copy()
        dist.all_reduce(x, op=op)
        if op == R.AVG:  # the average's division rounds once; the 2-byte sum is exact
            want = divided(dtype, np.sum(np.array(all_rows), axis=0).astype(dtype), SIZE)
        checks.true(f"{op.name}: {x} != {want}", same(x, want))
    checks.done()


# -- persistent operations --------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_persistent(dtype, op):
    checks = Checks()
    n = 17 * SIZE
    x = np.zeros(n, dtype)
    out = np.zeros(n // SIZE, dtype)
    inp = np.zeros(n, dtype)
    with dist.all_reduce_init(x, op=op) as p, dist.reduce_scatter_tensor_init(out, inp, op=op) as q:
        for run in range(3):
            rows = two_contributors(op, dtype, n, seed=1000 + run)
            want = expected(op, dtype, rows)
            x[...] = rows[RANK]
            inp[...] = rows[RANK]
            before = world.stats.copies
            p.start().wait()
            q.start().wait()
            if SIZE > 1 or op not in (R.MIN, R.MAX):  # one rank: MIN/MAX keep the keys (a copy of the input)
                checks.true(f"run {run}: a copy was counted", world.stats.copies == before)
            checks.true(f"run {run}: all_reduce", same(x, want, nan_payload=False))
            checks.true(f"run {run}: reduce_scatter", same(out, want[RANK * 17 : (RANK + 1) * 17], nan_payload=False))
    checks.done()


# -- the fallback path ------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_fallback_gives_the_same_results_with_two_contributors(dtype, op, monkeypatch):
    """The path without C ops (MPI's float16 or a float32 copy; order keys for MIN/MAX) gives the same bits where
    two ranks contribute (bfloat16 AVG: finite normal numbers, whose halving rounds alike both ways)."""
    finite = dtype == BF16 and op == R.AVG
    rows = two_contributors(op, dtype, 1001, seed=42, finite=finite)
    if op == R.AVG and SIZE not in (2, 4):  # a division by 3 rounds the 2-byte sum, not the float32 one
        pytest.skip("AVG: the division by a power of two only is exact in both paths")
    with_c = rows[RANK].copy()
    dist.all_reduce(with_c, op=op)
    p = dist.all_reduce_init(c_persistent := rows[RANK].copy(), op=op)
    p.start().wait()
    p.free()
    fallback_entries(monkeypatch)
    without = rows[RANK].copy()
    dist.all_reduce(without, op=op)
    q = dist.all_reduce_init(without_persistent := rows[RANK].copy(), op=op)
    q.start().wait()
    q.free()
    checks = Checks()
    checks.true(f"one-off: {bits(with_c)[:6]} != {bits(without)[:6]}", same(with_c, without, nan_payload=False))
    checks.true("persistent", same(c_persistent, without_persistent, nan_payload=False))
    checks.true("C ops vs reference", same(with_c, expected(op, dtype, rows), nan_payload=False))
    checks.done()


def test_nan_stays_nan_in_sums_and_products():
    checks = Checks()
    for dtype in HALVES:
        for op in (R.SUM, R.PRODUCT, R.AVG):
            x = np.full(9, 2.0, dtype)
            if RANK == SIZE - 1:
                x[3] = np.nan
                x[8] = -np.inf
            if RANK == 0:
                x[5] = np.inf
            dist.all_reduce(x, op=op)
            got = x.astype(np.float32)
            checks.true(f"{dtype} {op.name}: {got}", bool(np.isnan(got[3]) and math.isinf(got[5])))
            checks.true(f"{dtype} {op.name}: -inf", bool(got[8] == -np.inf))
    checks.done()


# -- gloo: torch.distributed's CPU backend rounds each pairwise add too -----------------------------
@pytest.fixture(scope="module")
def gloo():
    """A gloo process group over the same processes (rank and size from MPI), for this module."""
    torch = pytest.importorskip("torch")
    with gloo_group("mpidist-halfops-") as pg:
        yield torch, torch.distributed, pg


def _gloo_all_reduce(gloo: Any, a: np.ndarray, op: Any) -> np.ndarray:
    torch, tdist, pg = gloo
    tdtype = torch.float16 if a.dtype == F16 else torch.bfloat16
    t = torch.from_numpy(bits(a).astype(np.int16)).view(tdtype).clone()
    tdist.all_reduce(t, op=getattr(tdist.ReduceOp, op.name), group=pg)
    return t.view(torch.int16).numpy().view(np.uint16).view(a.dtype).copy()


@pytest.mark.parametrize("op", [R.SUM, R.PRODUCT, R.MIN, R.MAX], ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_same_bits_as_gloo_where_the_order_is_the_same(gloo, dtype, op):
    """Two ranks contribute random finite patterns (subnormals included; MIN/MAX: every rank, which is exact in
    any order): one rounding per element, so gloo and mpidist must agree bit for bit."""
    rng = np.random.default_rng(77)
    rows = [random_bits(rng, 4097, dtype) for _ in range(SIZE)]
    rows = [np.where(np.isfinite(r.astype(np.float32)), r, np.array(3.0, dtype)) for r in rows]
    if op not in (R.MIN, R.MAX):
        rows[2:] = [neutral(op, 4097, dtype) for _ in rows[2:]]
    x = rows[RANK].copy()
    dist.all_reduce(x, op=op)
    theirs = _gloo_all_reduce(gloo, rows[RANK], op)
    checks = Checks()
    diff = np.flatnonzero(bits(x) != bits(theirs))
    checks.true(f"{diff.size} elements differ from gloo, e.g. {bits(x)[diff[:4]]} != {bits(theirs)[diff[:4]]}",
                diff.size == 0)  # fmt: skip
    checks.done()


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_gloo_and_mpidist_both_round_each_add(gloo, dtype):
    """Every rank contributes: gloo's ring and MPI's algorithm combine in different orders, but each element of
    either is some order of pairwise-rounded adds (not the float32 sum rounded once)."""
    rng = np.random.default_rng(12)
    rows = [(rng.standard_normal(4097) * 10.0 ** rng.integers(-3, 3, 4097)).astype(dtype) for _ in range(SIZE)]
    candidates = orders(rows, lambda a, b: pairwise(R.SUM, dtype, a, b))
    x = rows[RANK].copy()
    dist.all_reduce(x)
    theirs = _gloo_all_reduce(gloo, rows[RANK], R.SUM)
    checks = Checks()
    checks.true("mpidist: not an order of pairwise sums", bool(any_order(x, candidates).all()))
    checks.true("gloo: not an order of pairwise sums", bool(any_order(theirs, candidates).all()))
    checks.done()
