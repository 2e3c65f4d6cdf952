"""Parity with torch.distributed's gloo backend, run in the same mpiexec processes.

Each test gives mpidist (numpy arrays) and gloo (torch tensors made from the same
arrays) the same inputs and requires bit-identical results. Inputs are small integers
(exact in every dtype), so float sums do not depend on the order of reduction.
Where gloo does not support an operation or dtype (decided on all ranks together),
the comparison is skipped rather than failed.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist

from helpers import gloo_group, rank_input

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
DTYPES = [np.int64, np.float32, np.float64]
DTYPE_IDS = ["int64", "float32", "float64"]
GLOO_TIMEOUT = timedelta(seconds=120)


@pytest.fixture(scope="module")
def gloo():
    """A gloo process group over the same processes (rank and size from MPI), for this module."""
    with gloo_group("mpidist-gloo-", GLOO_TIMEOUT) as pg:
        assert tdist.get_rank(pg) == RANK and tdist.get_world_size(pg) == SIZE
        yield pg


def torch_or_skip(what: str, fn, *args, **kwargs) -> None:
    """Run ``fn(*args, **kwargs)``; if it fails on any rank (gloo lacks it), skip the test on every rank."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecation notices of renamed functions
            fn(*args, **kwargs)
        err = ""
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError) as e:
        err = f"{type(e).__name__}: {e}"
    errors = [e for e in MPI.COMM_WORLD.allgather(err) if e]
    if errors:
        pytest.skip(f"gloo does not support {what}: {errors[0][:200]}")


def t(a: np.ndarray):
    return torch.from_numpy(np.array(a, copy=True))


def assert_same(mine: np.ndarray, theirs) -> None:
    other = theirs.numpy() if hasattr(theirs, "numpy") else np.asarray(theirs)
    assert mine.dtype == other.dtype, (mine.dtype, other.dtype)
    assert mine.shape == other.shape, (mine.shape, other.shape)
    assert np.array_equal(mine, other), f"\nmpidist {mine}\ngloo    {other}"


def torch_op(op):
    return getattr(tdist.ReduceOp, op.name)


R = dist.ReduceOp
ALL_REDUCE_OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


# -- reductions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, dtype",
    [
        pytest.param(op, dt, id=f"{op.name}-{name}")
        for op in ALL_REDUCE_OPS
        for dt, name in zip(DTYPES, DTYPE_IDS)
        if not (op in (R.BAND, R.BOR, R.BXOR) and np.dtype(dt).kind == "f")  # bitwise: integers only
    ],
)
def test_all_reduce(gloo, op, dtype):
    dtype = np.dtype(dtype)
    x = rank_input(RANK, (3, 5), dtype)
    theirs = t(x)
    torch_or_skip(f"all_reduce {op.name} on {dtype}", tdist.all_reduce, theirs, op=torch_op(op), group=gloo)
    dist.all_reduce(x, op=op)
    assert_same(x, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", [R.SUM, R.MAX, R.MIN, R.PRODUCT], ids=lambda o: o.name)
def test_reduce(gloo, op, dtype):
    for dst in range(SIZE):
        x = rank_input(RANK, (7,), np.dtype(dtype), salt=dst)
        theirs = t(x)
        torch_or_skip(f"reduce {op.name}", tdist.reduce, theirs, dst=dst, op=torch_op(op), group=gloo)
        dist.reduce(x, dst=dst, op=op)
        if RANK == dst:  # elsewhere the contents are unspecified in torch
            assert_same(x, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", [R.SUM, R.MAX, R.MIN, R.PRODUCT], ids=lambda o: o.name)
def test_reduce_scatter(gloo, op, dtype):
    dtype = np.dtype(dtype)
    ins = [rank_input(RANK, (4,), dtype, salt=i) for i in range(SIZE)]
    out = np.zeros(4, dtype)
    theirs = t(out)
    torch_or_skip(
        f"reduce_scatter {op.name}", tdist.reduce_scatter, theirs, [t(a) for a in ins], op=torch_op(op), group=gloo
    )
    dist.reduce_scatter(out, ins, op=op)
    assert_same(out, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", [R.SUM, R.MAX], ids=lambda o: o.name)
def test_reduce_scatter_tensor(gloo, op, dtype):
    dtype = np.dtype(dtype)
    inp = rank_input(RANK, (SIZE * 3,), dtype)
    out = np.zeros(3, dtype)
    theirs = t(out)
    torch_or_skip("reduce_scatter_tensor", tdist.reduce_scatter_tensor, theirs, t(inp), op=torch_op(op), group=gloo)
    dist.reduce_scatter_tensor(out, inp, op=op)
    assert_same(out, theirs)


# -- data movement --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_broadcast(gloo, dtype):
    for src in range(SIZE):
        x = rank_input(RANK, (2, 3), np.dtype(dtype), salt=src)
        theirs = t(x)
        torch_or_skip("broadcast", tdist.broadcast, theirs, src=src, group=gloo)
        dist.broadcast(x, src=src)
        assert_same(x, theirs)
        assert_same(x, rank_input(src, (2, 3), np.dtype(dtype), salt=src))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_gather(gloo, dtype):
    dtype = np.dtype(dtype)
    x = rank_input(RANK, (3,), dtype)
    outs = [np.zeros(3, dtype) for _ in range(SIZE)]
    theirs = [t(o) for o in outs]
    torch_or_skip("all_gather", tdist.all_gather, theirs, t(x), group=gloo)
    dist.all_gather(outs, x)
    for mine, other in zip(outs, theirs):
        assert_same(mine, other)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_gather_into_tensor(gloo, dtype):
    dtype = np.dtype(dtype)
    x = rank_input(RANK, (2, 3), dtype)
    out = np.zeros((2 * SIZE, 3), dtype)
    theirs = t(out)
    torch_or_skip("all_gather_into_tensor", tdist.all_gather_into_tensor, theirs, t(x), group=gloo)
    dist.all_gather_into_tensor(out, x)
    assert_same(out, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather(gloo, dtype):
    dtype = np.dtype(dtype)
    for dst in range(SIZE):
        x = rank_input(RANK, (4,), dtype, salt=dst)
        outs = [np.zeros(4, dtype) for _ in range(SIZE)] if RANK == dst else None
        theirs = [t(o) for o in outs] if RANK == dst else None
        torch_or_skip("gather", tdist.gather, t(x), theirs, dst=dst, group=gloo)
        dist.gather(x, outs, dst=dst)
        if RANK == dst:
            for mine, other in zip(outs, theirs):
                assert_same(mine, other)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scatter(gloo, dtype):
    dtype = np.dtype(dtype)
    for src in range(SIZE):
        ins = [rank_input(RANK, (2, 2), dtype, salt=i) for i in range(SIZE)] if RANK == src else None
        out = np.zeros((2, 2), dtype)
        theirs = t(out)
        torch_or_skip(
            "scatter", tdist.scatter, theirs, [t(a) for a in ins] if RANK == src else None, src=src, group=gloo
        )
        dist.scatter(out, ins, src=src)
        assert_same(out, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_to_all_single_even(gloo, dtype):
    dtype = np.dtype(dtype)
    inp = rank_input(RANK, (2 * SIZE, 3), dtype)
    out = np.zeros((2 * SIZE, 3), dtype)
    theirs = t(out)
    torch_or_skip("all_to_all_single", tdist.all_to_all_single, theirs, t(inp), group=gloo)
    dist.all_to_all_single(out, inp)
    assert_same(out, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_to_all_single_uneven(gloo, dtype):
    dtype = np.dtype(dtype)
    # rank r sends (r + d) % 3 + 1 rows to rank d, so rank d receives (r + d) % 3 + 1 rows from rank r
    in_splits = [(RANK + d) % 3 + 1 for d in range(SIZE)]
    out_splits = [(r + RANK) % 3 + 1 for r in range(SIZE)]
    inp = rank_input(RANK, (sum(in_splits), 2), dtype)
    out = np.zeros((sum(out_splits), 2), dtype)
    theirs = t(out)
    torch_or_skip(
        "all_to_all_single with splits", tdist.all_to_all_single, theirs, t(inp), out_splits, in_splits, group=gloo
    )
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    assert_same(out, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_to_all(gloo, dtype):
    dtype = np.dtype(dtype)
    # gloo's all_to_all needs arrays of one size
    ins = [rank_input(RANK, (3,), dtype, salt=d) for d in range(SIZE)]
    outs = [np.zeros(3, dtype) for _ in range(SIZE)]
    theirs = [t(o) for o in outs]
    torch_or_skip("all_to_all", tdist.all_to_all, theirs, [t(a) for a in ins], group=gloo)
    dist.all_to_all(outs, ins)
    for mine, other in zip(outs, theirs):
        assert_same(mine, other)


def test_ranks_and_sizes_agree(gloo):
    assert tdist.get_rank(gloo) == dist.get_rank() == RANK
    assert tdist.get_world_size(gloo) == dist.get_world_size() == SIZE
    assert int(tdist.ReduceOp.RedOpType.SUM) == int(dist.ReduceOp.SUM)
