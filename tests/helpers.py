"""Shared helpers for the tests: dtype families, deterministic inputs, reference reductions."""

from __future__ import annotations

import re
from functools import reduce as _fold
from typing import Callable

import ml_dtypes
import numpy as np
from mpi4py import MPI

import mpidist as dist

BF16 = np.dtype(ml_dtypes.bfloat16)

#: one representative per dtype family, and every supported dtype
FAMILIES = {
    "bool": np.dtype(np.bool_),
    "int": np.dtype(np.int32),
    "uint": np.dtype(np.uint16),
    "f16": np.dtype(np.float16),
    "bf16": BF16,
    "float": np.dtype(np.float64),
    "complex": np.dtype(np.complex64),
}
ALL_DTYPES = [
    np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64, np.complex64, np.complex128,
    )
] + [BF16]  # fmt: skip


def kind(dtype: np.dtype) -> str:
    if dtype == BF16:
        return "f"
    return {"b": "b", "i": "i", "u": "u", "f": "f", "c": "c"}[dtype.kind]


def rank_input(rank: int, shape: tuple[int, ...], dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """A deterministic array for ``rank``: small values, exactly representable in every dtype."""
    n = int(np.prod(shape)) if shape else 1
    base = (np.arange(n) * 7 + rank * 3 + salt * 5) % 5 + 1  # 1..5
    if dtype.kind == "b":
        a = (np.arange(n) + rank + salt) % 3 == 0
    elif dtype.kind == "c":
        a = base + 1j * ((np.arange(n) + rank) % 3)
    elif dtype.kind == "i":
        a = base * (-1) ** ((np.arange(n) + rank) % 2)
    else:
        a = base
    return np.asarray(a).astype(dtype).reshape(shape)


def _ufunc(op, k: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    R = dist.ReduceOp
    if k == "b":
        table = {R.SUM: np.logical_or, R.PRODUCT: np.logical_and, R.MIN: np.logical_and, R.MAX: np.logical_or,
                 R.BAND: np.logical_and, R.BOR: np.logical_or, R.BXOR: np.logical_xor}  # fmt: skip
    else:
        table = {R.SUM: np.add, R.AVG: np.add, R.PRODUCT: np.multiply, R.MIN: np.minimum, R.MAX: np.maximum,
                 R.BAND: np.bitwise_and, R.BOR: np.bitwise_or, R.BXOR: np.bitwise_xor}  # fmt: skip
    return table[op]


def reference(arrays: list[np.ndarray], op) -> np.ndarray:
    """The result a reduction of ``arrays`` must give, computed with numpy.

    Low-precision floats are reduced in float64 and rounded once (mpidist
    rounds bfloat16 reductions once; the small test values make float16 exact).
    AVG truncates integer quotients toward zero.
    """
    dtype = arrays[0].dtype
    k = kind(dtype)
    premul = None
    if isinstance(op, dist.ReduceOp) and op.op == dist.ReduceOp.PREMUL_SUM:
        premul, op = op.factor, dist.ReduceOp.SUM
    wide = np.complex128 if k == "c" else (np.float64 if k == "f" else None)
    work = [a.astype(wide) if wide is not None else a.copy() for a in arrays]
    if premul is not None:
        work = [w * premul for w in work]
    out = _fold(_ufunc(op, k), work)
    if op == dist.ReduceOp.AVG:
        n = len(arrays)
        if k in "iu":
            q = np.abs(out.astype(np.int64)) // n * np.sign(out.astype(np.int64))
            out = q
        else:
            out = out / n
    return np.asarray(out).astype(dtype)


def gather_all(a: np.ndarray, comm: MPI.Comm | None = None) -> list[np.ndarray]:
    """Collect every rank's copy of ``a`` with raw mpi4py (to compare across ranks)."""
    comm = comm or MPI.COMM_WORLD
    return comm.allgather(np.ascontiguousarray(a).tobytes())


def assert_identical_on_all_ranks(a: np.ndarray) -> None:
    blobs = gather_all(a)
    assert all(b == blobs[0] for b in blobs), "result differs between ranks"


def assert_equal(got: np.ndarray, expected: np.ndarray) -> None:
    """Exact equality, dtype included (NaN-free inputs)."""
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.array_equal(got, expected), f"\n got {got}\n expected {expected}"


def fail_together(problems: list[str]) -> None:
    """Fail on every rank if any rank found a problem (so no rank runs ahead into a collective)."""
    everyone = MPI.COMM_WORLD.allgather(problems)
    bad = {r: p for r, p in enumerate(everyone) if p}
    assert not bad, f"problems by rank: {bad}"


def check_raises(exc: type[BaseException], match: str, fn, *args, **kwargs) -> list[str]:
    """Call ``fn``; return what is wrong (no exception, another type, another message) instead of raising."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        fn(*args, **kwargs)
    except exc as e:
        if not re.search(match, str(e)):
            return [f"{name}: {type(e).__name__} message {str(e)!r} does not match {match!r}"]
        return []
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        return [f"{name}: raised {type(e).__name__}: {e} instead of {exc.__name__}"]
    return [f"{name}: did not raise {exc.__name__}"]
