"""MIN and MAX on floating-point arrays: NaN and +/-0 give the same bits on every rank (issue 13, finding 4).

The rule (IEEE 754-2019 maximum/minimum, and torch's NaN propagation): a NaN on any rank
makes the result NaN (the default quiet NaN, numpy.nan's bits); MAX(+0, -0) = +0 and
MIN(+0, -0) = -0 whatever the order. MPI's own MPI_MAX/MPI_MIN gave rank 0 ``[1, nan, -0]``
and rank 1 ``[nan, 1, 0]`` for the same call; mpidist now reduces integer order keys.
"""

from __future__ import annotations

import math
from functools import reduce as fold

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist.reduce_op import Prim, from_order_keys, to_order_keys

from helpers import BF16, Checks, gather_all

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
OPS = ["MAX", "MIN"]
NAN = float("nan")


def _nan_with_payload(dtype: np.dtype, payload: int, negative: bool = False) -> np.ndarray:
    """A quiet NaN of ``dtype`` whose mantissa carries ``payload`` (rank-specific bits)."""
    u = np.dtype(f"u{dtype.itemsize}")
    bits = int(np.array(NAN, dtype).view(u)) | (payload & 0xF)
    if negative:
        bits |= 1 << (8 * dtype.itemsize - 1)
    return np.array(bits, u).view(dtype)


#: column name -> the value rank r (of n) contributes there
COLUMNS = {
    "nan on rank 0": lambda r, n, dt: NAN if r == 0 else 1.0,
    "nan on the last rank": lambda r, n, dt: NAN if r == n - 1 else float(r),
    "nan everywhere": lambda r, n, dt: NAN,
    "-nan on rank 1": lambda r, n, dt: _nan_with_payload(dt, 0, negative=True) if r == 1 else -2.0,
    "nan payloads differ": lambda r, n, dt: _nan_with_payload(dt, r + 1, negative=r % 2 == 1),
    "nan and -inf": lambda r, n, dt: NAN if r == n // 2 else -math.inf,
    "nan and +inf": lambda r, n, dt: math.inf if r % 2 else NAN,
    "+0 on even ranks, -0 on odd": lambda r, n, dt: 0.0 if r % 2 == 0 else -0.0,
    "-0 on even ranks, +0 on odd": lambda r, n, dt: -0.0 if r % 2 == 0 else 0.0,
    "-0 on rank 0 only": lambda r, n, dt: -0.0 if r == 0 else 0.0,
    "+0 on the last rank only": lambda r, n, dt: 0.0 if r == n - 1 else -0.0,
    "-0 everywhere": lambda r, n, dt: -0.0,
    "+0 everywhere": lambda r, n, dt: 0.0,
    "zeros and negatives": lambda r, n, dt: -1.0 if r % 2 else -0.0,
    "zeros and positives": lambda r, n, dt: 1.0 if r == 0 else (0.0 if r % 2 else -0.0),
    "numbers": lambda r, n, dt: float((r * 5) % 7 - 3),
    "infinities": lambda r, n, dt: math.inf if r == 1 else -math.inf,
}


def rank_values(r: int, n: int, dtype: np.dtype, shift: int = 0) -> np.ndarray:
    """Rank ``r``'s row: one element per column, columns rotated by ``shift`` (chunks of reduce_scatter)."""
    names = list(COLUMNS)
    names = names[shift % len(names) :] + names[: shift % len(names)]
    return np.array([np.asarray(COLUMNS[c](r, n, dtype)).astype(dtype) for c in names], dtype)


def ieee(op: str, a: float, b: float) -> float:
    """IEEE 754-2019 maximum / minimum of two numbers: NaN wins, -0 < +0."""
    if math.isnan(a) or math.isnan(b):
        return NAN
    if a == b == 0.0:
        plus = math.copysign(1, a) > 0 or math.copysign(1, b) > 0
        minus = math.copysign(1, a) < 0 or math.copysign(1, b) < 0
        return 0.0 if (op == "MAX" and plus) or (op == "MIN" and not minus) else -0.0
    return max(a, b) if op == "MAX" else min(a, b)


def expected(op: str, dtype: np.dtype, rows: list[np.ndarray]) -> np.ndarray:
    """The element-wise rule folded over every rank's row, as ``dtype`` (NaN: numpy.nan's bits)."""
    cols = zip(*[[float(v) for v in row] for row in rows])
    folded = [fold(lambda a, b: ieee(op, a, b), col) for col in cols]
    return np.array([NAN if math.isnan(v) else v for v in folded]).astype(dtype)  # one rank's NaN too


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    return np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def describe_bits(a: np.ndarray) -> str:
    u = np.dtype(f"u{a.dtype.itemsize}")
    return " ".join(f"{v:#x}" for v in np.ascontiguousarray(a).view(u).reshape(-1))


# -- the order keys on their own ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_order_keys_preserve_order_and_round_trip(dtype):
    values = np.array([-math.inf, -3.5, -1.0, -0.25, -0.0, 0.0, 0.25, 1.0, 3.5, math.inf], dtype)
    keys = to_order_keys(values, np.empty(values.size, f"i{dtype.itemsize}"), Prim.MAX, np)
    assert (np.diff(keys.astype(np.int64)) > 0).all(), keys  # -0 below +0, strictly increasing
    back = keys.copy()
    from_order_keys(back, dtype, Prim.MAX, np)
    assert same_bits(back.view(dtype), values)
    in_place = values.copy()
    assert (to_order_keys(in_place, None, Prim.MIN, np) == keys).all()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_every_nan_gets_the_winning_key(dtype, op):
    prim = Prim.MAX if op == "MAX" else Prim.MIN
    nans = np.concatenate([_nan_with_payload(dtype, p, neg).reshape(1) for p in range(4) for neg in (False, True)])
    numbers = np.array([-math.inf, -0.0, 0.0, math.inf], dtype)
    itype = f"i{dtype.itemsize}"
    nan_keys = to_order_keys(nans, np.empty(nans.size, itype), prim, np)
    number_keys = to_order_keys(numbers, np.empty(numbers.size, itype), prim, np)
    assert len(set(nan_keys.tolist())) == 1
    assert (nan_keys[0] > number_keys).all() if op == "MAX" else (nan_keys[0] < number_keys).all()
    from_order_keys(nan_keys, dtype, prim, np)
    assert same_bits(nan_keys.view(dtype), np.full(nans.size, NAN, dtype))  # the default quiet NaN


# -- every reduction, every rank --------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_all_reduce_is_the_rule_and_identical_on_every_rank(dtype, op):
    rows = [rank_values(r, SIZE, dtype) for r in range(SIZE)]
    want = expected(op, dtype, rows)
    checks = Checks()
    for how in ("blocking", "async", "strided"):
        if how == "strided":
            base = np.zeros((rows[RANK].size, 2), dtype)
            base[:, 0] = rows[RANK]
            x = base[:, 0]  # not contiguous: staged through a copy and written back
        else:
            x = rows[RANK].copy()
        work = dist.all_reduce(x, op=getattr(dist.ReduceOp, op), async_op=how == "async")
        if work is not None:
            work.wait()
        checks.true(f"{how}: got {describe_bits(x)}, expected {describe_bits(want)}", same_bits(x, want))
        checks.identical(how, np.ascontiguousarray(x))
    checks.done()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_reduce_gives_the_rule_at_every_root_and_leaves_inputs_alone(dtype, op):
    rows = [rank_values(r, SIZE, dtype) for r in range(SIZE)]
    want = expected(op, dtype, rows)
    checks = Checks()
    for root in range(SIZE):
        x = rows[RANK].copy()
        dist.reduce(x, dst=root, op=getattr(dist.ReduceOp, op))
        if RANK == root:
            checks.true(f"root {root}: got {describe_bits(x)}, expected {describe_bits(want)}", same_bits(x, want))
        else:
            checks.true(f"root {root}: a non-root input changed", same_bits(x, rows[RANK]))
    checks.done()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_reduce_scatter_gives_the_rule_and_leaves_inputs_alone(dtype, op):
    # chunk i holds the columns rotated by i, so every column lands on every rank at some size
    rows = [np.concatenate([rank_values(r, SIZE, dtype, shift=i) for i in range(SIZE)]) for r in range(SIZE)]
    want = expected(op, dtype, rows).reshape(SIZE, -1)
    rop = getattr(dist.ReduceOp, op)
    checks = Checks()
    inp = rows[RANK].copy()
    out = np.empty(want.shape[1], dtype)
    dist.reduce_scatter_tensor(out, inp, op=rop)
    checks.true(f"reduce_scatter_tensor: got {describe_bits(out)}", same_bits(out, want[RANK]))
    checks.true("reduce_scatter_tensor: the input changed", same_bits(inp, rows[RANK]))
    pieces = [p.copy() for p in np.split(rows[RANK], SIZE)]
    out2 = np.empty(want.shape[1], dtype)
    dist.reduce_scatter(out2, pieces, op=rop)
    checks.true(f"reduce_scatter: got {describe_bits(out2)}", same_bits(out2, want[RANK]))
    checks.true("reduce_scatter: an input changed", same_bits(np.concatenate(pieces), rows[RANK]))
    everyone = MPI.COMM_WORLD.allgather(out.tobytes())
    checks.true("reduce_scatter_tensor: the chunks do not make up the rule", b"".join(everyone) == want.tobytes())
    checks.done()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_persistent_operations_follow_the_rule_at_every_run(dtype, op):
    """all_reduce_init, reduce_init and reduce_scatter_tensor_init convert to keys and back at each run."""
    rows = [rank_values(r, SIZE, dtype) for r in range(SIZE)]
    want = expected(op, dtype, rows)
    rop = getattr(dist.ReduceOp, op)
    checks = Checks()
    x = np.empty_like(rows[RANK])
    root = SIZE - 1
    y = np.empty_like(x)
    chunked = [np.concatenate([rank_values(r, SIZE, dtype, shift=i) for i in range(SIZE)]) for r in range(SIZE)]
    inp = chunked[RANK].copy()
    out = np.empty(x.size, dtype)
    want_chunks = expected(op, dtype, chunked).reshape(SIZE, -1)
    with dist.all_reduce_init(x, op=rop) as pa, dist.reduce_init(y, dst=root, op=rop) as pr, \
            dist.reduce_scatter_tensor_init(out, inp, op=rop) as ps:  # fmt: skip
        for run in range(3):
            x[...] = rows[RANK]
            y[...] = rows[RANK]
            for p in (pa, pr, ps):
                p.start().wait()
            checks.true(f"run {run}: all_reduce_init got {describe_bits(x)}", same_bits(x, want))
            checks.identical(f"run {run}", x)
            mine = want if RANK == root else rows[RANK]
            checks.true(f"run {run}: reduce_init got {describe_bits(y)}", same_bits(y, mine))
            checks.true(f"run {run}: reduce_scatter_tensor_init got {describe_bits(out)}",
                        same_bits(out, want_chunks[RANK]))  # fmt: skip
            checks.true(f"run {run}: reduce_scatter_tensor_init changed its input", same_bits(inp, chunked[RANK]))
    checks.done()


@pytest.mark.parametrize("path", ["device staged", "device CUDA-aware"])
@pytest.mark.parametrize("op", OPS)
def test_device_arrays_over_mpi_follow_the_rule(op, path, monkeypatch):
    from mpidist._world import world
    from mpidist.testing import HostCudaArray

    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    monkeypatch.setattr(world, "cuda_aware", path == "device CUDA-aware")
    dtype = np.dtype(np.float32)
    rows = [rank_values(r, SIZE, dtype) for r in range(SIZE)]
    want = expected(op, dtype, rows)
    arr = HostCudaArray(rows[RANK].copy(), 7)
    dist.all_reduce(arr, op=getattr(dist.ReduceOp, op))
    checks = Checks()
    checks.true(f"{path}: got {describe_bits(arr.host)}", same_bits(arr.host, want))
    checks.done()


@pytest.mark.parametrize("op", OPS)
def test_nan_propagates_as_torch_does(op):
    """Against torch.maximum / torch.minimum folded over the ranks: NaN where torch has NaN, equal elsewhere."""
    torch = pytest.importorskip("torch")
    dtype = np.dtype(np.float32)
    rows = [rank_values(r, SIZE, dtype) for r in range(SIZE)]
    fn = torch.maximum if op == "MAX" else torch.minimum
    ref = fold(fn, [torch.from_numpy(row.copy()) for row in rows]).numpy()
    x = torch.from_numpy(rows[RANK].copy())
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    got = x.numpy()
    checks = Checks()
    checks.equal("NaN positions", np.isnan(got), np.isnan(ref))
    checks.true(f"values: got {got}, torch {ref}", bool(np.all((got == ref) | np.isnan(ref))))
    checks.identical("torch result", got)
    checks.done()


def test_the_issue_example_now_agrees():
    """Issue 13's report: rank 0 had [1, nan, -0] and rank 1 [nan, 1, 0] after the same MAX."""
    x = np.array([[1.0, NAN, -0.0], [NAN, 1.0, 0.0]][RANK % 2], np.float32)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    blobs = gather_all(x)
    checks = Checks()
    checks.true("differs between ranks", all(b == blobs[0] for b in blobs))
    want = [1.0, NAN, -0.0] if SIZE == 1 else [NAN, NAN, 0.0]
    checks.true(f"got {x}", same_bits(x, np.array(want, np.float32)))
    checks.done()


@pytest.mark.parametrize("dtype", [np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.bool_)], ids=str)
def test_integer_and_bool_min_max_stay_on_mpis_own_ops(dtype):
    from mpidist.backends.mpi import type_table

    entry = type_table()[dtype]
    for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        assert isinstance(entry.ops[op], MPI.Op), (dtype, op)
