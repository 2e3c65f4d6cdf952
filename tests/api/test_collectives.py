"""Collectives against numpy references built from every rank's known inputs.

Every test is SPMD and runs at any world size (1 to 4 in CI). Tests that loop
over roots or cases collect their comparisons in a :class:`Checks` object and
assert at the end, so that a wrong result on one rank never leaves the other
ranks waiting in the next collective of the loop.

Tests that take the ``make`` fixture run once per array kind (numpy arrays and
torch CPU tensors, see ``helpers.KINDS``): they pass arrays of that kind to
mpidist and read the results back from those very objects (``helpers.to_numpy``).
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist.backends.mpi import type_table

from helpers import (
    ALL_DTYPES,
    ARRAY_KINDS,
    BF16,
    FAMILIES,
    Checks,
    Maker,
    assert_equal,
    assert_identical_on_all_ranks,
    copies,
    fail_together,
    inputs_of,
    kind,
    rank_input,
    reference,
    reverse_axes,
    sentinel,
    to_numpy,
)

R = dist.ReduceOp
SHAPE = (2, 3)

# ---------------------------------------------------------------------------------------
# small helpers (local to this file)
# ---------------------------------------------------------------------------------------


# Reductions valid for each dtype kind (from the spec and the ReduceOp docs), by name.
PREMUL_HALF = "PREMUL_SUM(0.5)"
PREMUL_ARRAY = "PREMUL_SUM(array[3.0])"
PREMUL_COMPLEX = "PREMUL_SUM(1-2j)"
_BITWISE = ["BAND", "BOR", "BXOR"]
VALID_OPS = {
    "b": ["SUM", "PRODUCT", "MIN", "MAX", *_BITWISE],
    "i": ["SUM", "AVG", "PRODUCT", "MIN", "MAX", *_BITWISE],
    "u": ["SUM", "AVG", "PRODUCT", "MIN", "MAX", *_BITWISE],
    "f": ["SUM", "AVG", "PRODUCT", "MIN", "MAX", PREMUL_HALF, PREMUL_ARRAY],
    "c": ["SUM", "AVG", PREMUL_HALF, PREMUL_ARRAY, PREMUL_COMPLEX],
}
INVALID_OPS = {
    "b": ["AVG", PREMUL_HALF],
    "i": [PREMUL_HALF, PREMUL_ARRAY],
    "u": [PREMUL_HALF],
    "f": [*_BITWISE, PREMUL_COMPLEX],  # a complex factor cannot scale a real array
    "c": ["PRODUCT", "MIN", "MAX", *_BITWISE],
}


def order_op(dtype: np.dtype) -> Any:
    """MAX, or SUM for complex arrays (which have no order)."""
    return R.SUM if kind(dtype) == "c" else R.MAX


def make_op(name: str) -> Any:
    if name == PREMUL_HALF:
        return dist.make_premul_sum(0.5)
    if name == PREMUL_ARRAY:
        return dist.make_premul_sum(np.array([3.0]))
    if name == PREMUL_COMPLEX:
        return dist.make_premul_sum(1 - 2j)
    return getattr(R, name)


def ref_op(name: str) -> Any:
    """The op for :func:`helpers.reference` (a plain-number factor, so shapes never broadcast)."""
    if name == PREMUL_ARRAY:
        return dist.make_premul_sum(3.0)
    return make_op(name)


def _cases(table: dict[str, list[str]]) -> list[Any]:
    out = []
    for fam, dtype in FAMILIES.items():
        for name in table[kind(dtype)]:
            out.append(pytest.param(fam, name, id=f"{fam}-{name}"))
    return out


VALID_CASES = _cases(VALID_OPS)
INVALID_CASES = _cases(INVALID_OPS)
FAM_PARAMS = [pytest.param(f, id=f) for f in FAMILIES]
DTYPE_PARAMS = [pytest.param(dt, id=dt.name) for dt in ALL_DTYPES]


# Non-contiguous layouts: (base shape for a view of ``shape``, the view of a base of any kind).
LAYOUTS: dict[str, tuple[Callable[[tuple[int, ...]], tuple[int, ...]], Callable[[Any], Any]]] = {
    "strided": (lambda s: (2 * s[0], *s[1:]), lambda b: b[::2]),
    "transposed": (lambda s: tuple(reversed(s)), reverse_axes),
    "negative": (lambda s: s, lambda b: b[::-1]),
}
LAYOUT_PARAMS = [pytest.param(k, id=k) for k in LAYOUTS]


def layout_exists(layout: str, kind_name: str) -> bool:
    """Whether arrays of this kind can be views of this layout (torch has no negative strides)."""
    return layout != "negative" or ARRAY_KINDS[kind_name].negative_strides


def skip_if_staged(make: Maker) -> None:
    """Zero-copy checks do not apply to device arrays: over a non-CUDA-aware MPI they are staged
    through host memory by design (tests/backends/test_device.py checks the direct and staged paths)."""
    if not make.kind.zero_copy:
        pytest.skip("device arrays are staged through host memory (see tests/backends/test_device.py)")


def is_c_contiguous(x: Any) -> bool:
    flags = getattr(x, "flags", None)  # numpy and the device stand-in; torch has is_contiguous()
    return bool(flags.c_contiguous) if flags is not None else bool(x.is_contiguous())


class Views:
    """Makes non-contiguous views of fresh base arrays and checks that nothing outside them changed.

    The base is made as an array of ``make``'s kind and the view is taken of that
    object, so the test passes mpidist a genuine non-contiguous array of that kind.
    """

    def __init__(self, layout: str, checks: Checks, make: Maker | None = None) -> None:
        self.layout = layout
        self.base_shape, self.view_of = LAYOUTS[layout]
        self.checks = checks
        self.make = make or Maker("numpy")
        self.made: list[tuple[Any, np.ndarray]] = []

    def __call__(self, shape: tuple[int, ...], dtype: Any, data: np.ndarray | None = None) -> Any:
        dtype = np.dtype(dtype)
        base = np.empty(self.base_shape(shape), dtype)
        base[...] = sentinel(dtype)
        if data is not None:
            self.view_of(base)[...] = data
        before = base.copy()
        kbase = self.make(base)
        v = self.view_of(kbase)
        assert tuple(v.shape) == tuple(shape)
        self.checks.true(f"view of shape {shape} should be non-contiguous", not is_c_contiguous(v))
        self.checks.equal(f"view of shape {shape} holds its data", v, self.view_of(before))
        self.made.append((kbase, before))
        return v

    def check_outside(self) -> None:
        """Elements of a base outside its view must be what they were when the view was made."""
        for i, (kbase, before) in enumerate(self.made):
            base = to_numpy(kbase)
            expected = before.copy()
            self.view_of(expected)[...] = self.view_of(base)
            self.checks.equal(f"base {i} outside its view", base, expected)


def flatten(xs: Any) -> list[Any]:
    """Flatten nested lists/tuples of outputs (work.result() lists the output arrays)."""
    if isinstance(xs, (list, tuple)):
        return [y for x in xs for y in flatten(x)]
    return [xs]


# ---------------------------------------------------------------------------------------
# broadcast
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_broadcast_every_src(fam, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    for src in range(world_size):
        x = make.input(rank, SHAPE, dtype, salt=src)
        assert dist.broadcast(x, src=src) is None
        checks.equal(f"src={src}", x, rank_input(src, SHAPE, dtype, salt=src))
        checks.identical(f"src={src}", x)
    checks.done()


def test_broadcast_group_src(make, rank, world_size, checks):
    for src in range(world_size):
        x = make.input(rank, SHAPE, np.int64, salt=src + 10)
        dist.broadcast(x, group_src=src)
        checks.equal(f"group_src={src}", x, rank_input(src, SHAPE, np.dtype(np.int64), salt=src + 10))
    checks.done()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_broadcast_every_dtype(dtype, make, rank, world_size):
    src = world_size - 1
    x = make.input(rank, (5,), dtype, salt=3)
    dist.broadcast(x, src=src)
    assert_identical_on_all_ranks(x)
    assert_equal(x, rank_input(src, (5,), dtype, salt=3))


# ---------------------------------------------------------------------------------------
# all_reduce / reduce: every op valid for each dtype family
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fam", "opname"), VALID_CASES)
def test_all_reduce_ops(fam, opname, make, rank, world_size):
    dtype = FAMILIES[fam]
    x = make.input(rank, SHAPE, dtype, salt=1)
    assert dist.all_reduce(x, op=make_op(opname)) is None
    expected = reference(inputs_of(world_size, SHAPE, dtype, 1), ref_op(opname))
    assert_identical_on_all_ranks(x)
    assert_equal(x, expected)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_all_reduce_sum_every_dtype(dtype, make, rank, world_size):
    x = make.input(rank, (7,), dtype, salt=2)
    dist.all_reduce(x)  # default op: SUM
    assert_identical_on_all_ranks(x)
    assert_equal(x, reference(inputs_of(world_size, (7,), dtype, 2), R.SUM))


def test_all_reduce_premul_factor_read_at_call_time(make, rank, world_size):
    factor = make(np.array([2.0]))
    op = dist.make_premul_sum(factor)
    factor[0] = 4.0
    x = make.input(rank, (4,), np.float32)
    dist.all_reduce(x, op=op)
    assert_equal(x, reference(inputs_of(world_size, (4,), np.dtype(np.float32)), dist.make_premul_sum(4.0)))


def test_all_reduce_avg_integer_truncates_toward_zero(make, rank, world_size):
    # rank r holds -(r + 1) and r + 1: the sums are -n(n+1)/2 and n(n+1)/2
    x = make(np.array([-(rank + 1), rank + 1, -1 if rank == 0 else 0], np.int32))
    dist.all_reduce(x, op=R.AVG)
    s = world_size * (world_size + 1) // 2
    q = s // world_size  # truncation of a positive quotient
    assert_equal(x, np.array([-q, q, -1 if world_size == 1 else 0], np.int32))


@pytest.mark.parametrize("dtype", [np.dtype(np.complex64), np.dtype(np.complex128)], ids=["complex64", "complex128"])
def test_all_reduce_avg_complex_divides_each_component(dtype, make, rank, world_size):
    """AVG of complex arrays is sum / n, correctly rounded in each component, like AVG of real arrays.

    Rank 0 holds the whole sum (7 + 1j, 1 + 7j, 10 + 20j), the other ranks zeros; at sizes
    that are not powers of two the quotient is inexact and must round like float division.
    """
    vals = np.array([7 + 1j, 1 + 7j, 10 + 20j])
    x = make((vals if rank == 0 else np.zeros(3)).astype(dtype))
    dist.all_reduce(x, op=R.AVG)
    real = np.dtype(np.float32 if dtype == np.complex64 else np.float64)
    expected = np.empty(3, dtype)
    expected.real = vals.real.astype(real) / real.type(world_size)
    expected.imag = vals.imag.astype(real) / real.type(world_size)
    assert_equal(x, expected)


@pytest.mark.parametrize(("fam", "opname"), VALID_CASES)
def test_reduce_every_dst(fam, opname, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    expected = reference(inputs_of(world_size, SHAPE, dtype, 4), ref_op(opname))
    for dst in range(world_size):
        x = make.input(rank, SHAPE, dtype, salt=4)
        assert dist.reduce(x, dst=dst, op=make_op(opname)) is None
        if rank == dst:
            checks.equal(f"dst={dst} (result)", x, expected)
        else:
            checks.equal(f"dst={dst} (non-dst unchanged)", x, rank_input(rank, SHAPE, dtype, salt=4))
    checks.done()


def test_reduce_group_dst(make, rank, world_size, checks):
    dtype = np.dtype(np.int64)
    expected = reference(inputs_of(world_size, SHAPE, dtype, 5), R.MAX)
    for dst in range(world_size):
        x = make.input(rank, SHAPE, dtype, salt=5)
        dist.reduce(x, op=R.MAX, group_dst=dst)
        checks.equal(f"group_dst={dst}", x, expected if rank == dst else rank_input(rank, SHAPE, dtype, salt=5))
    checks.done()


# ---------------------------------------------------------------------------------------
# invalid op / dtype combinations
# ---------------------------------------------------------------------------------------


def _invalid_calls(dtype: np.dtype, op: Any, n: int, make: Maker) -> list[tuple[str, Callable[[], Any]]]:
    def a() -> Any:
        return make.input(dist.get_rank(), (2,), dtype)

    return [
        ("all_reduce", lambda: dist.all_reduce(a(), op=op)),
        ("all_reduce async", lambda: dist.all_reduce(a(), op=op, async_op=True)),
        ("reduce", lambda: dist.reduce(a(), dst=0, op=op)),
        (
            "reduce_scatter_tensor",
            lambda: dist.reduce_scatter_tensor(make.empty((2,), dtype), make.zeros(2 * n, dtype), op=op),
        ),
        ("reduce_scatter", lambda: dist.reduce_scatter(make.empty((2,), dtype), [a() for _ in range(n)], op=op)),
        ("all_reduce_coalesced", lambda: dist.all_reduce_coalesced([a(), a()], op=op)),
    ]


@pytest.mark.parametrize(("fam", "opname"), INVALID_CASES)
def test_invalid_op_for_dtype_raises_before_communicating(fam, opname, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    op = make_op(opname)
    for name, call in _invalid_calls(dtype, op, world_size, make):
        try:
            call()
        except ValueError:
            pass
        except Exception as exc:  # noqa: BLE001 - record the wrong kind of error
            checks.failures.append(f"{name}: expected ValueError, got {type(exc).__name__}: {exc}")
        else:
            checks.failures.append(f"{name}: {opname} on {dtype.name} did not raise")
    # the input is untouched and the group still works (no rank is left inside a collective)
    x = make.input(rank, (2,), dtype)
    with pytest.raises(ValueError):
        dist.all_reduce(x, op=op)
    checks.equal("input after the error", x, rank_input(rank, (2,), dtype))
    y = make(np.array([rank], np.int64))
    dist.all_reduce(y)
    checks.equal("all_reduce after the errors", y, np.array([world_size * (world_size - 1) // 2], np.int64))
    checks.done()


@pytest.mark.parametrize(
    ("fam", "opname"), [("complex", "MAX"), ("float", "BAND"), ("bool", "AVG"), ("int", PREMUL_HALF)]
)
def test_invalid_op_error_names_the_function(fam, opname, make, checks):
    """The ValueError starts with the name of the function the user called (CONVENTIONS: Errors)."""
    dtype = FAMILIES[fam]
    for name, call in _invalid_calls(dtype, make_op(opname), dist.get_world_size(), make):
        fn = name.split()[0]
        try:
            call()
        except ValueError as exc:
            checks.true(f"{fn}: the message should start with '{fn}:', got {str(exc)!r}", str(exc).startswith(f"{fn}:"))
    checks.done()


@pytest.mark.parametrize("op", [R.UNUSED, R.PREMUL_SUM], ids=["UNUSED", "PREMUL_SUM-without-factor"])
def test_op_without_meaning_raises_value_error(op, make, rank, world_size):
    x = make(np.ones(3))
    with pytest.raises(ValueError):
        dist.all_reduce(x, op=op)
    with pytest.raises(ValueError):
        dist.reduce(x, dst=0, op=op)
    with pytest.raises(TypeError):
        dist.all_reduce(x, op="sum")
    dist.all_reduce(x)
    assert_equal(x, np.full(3, float(world_size)))


# ---------------------------------------------------------------------------------------
# reduce_scatter (list) and reduce_scatter_tensor
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["separate", "consecutive"])
@pytest.mark.parametrize(("fam", "opname"), VALID_CASES)
def test_reduce_scatter_list_ops(fam, opname, layout, make, rank, world_size):
    dtype = FAMILIES[fam]
    k = 3
    if layout == "separate":
        input_list = [make.input(rank, (k,), dtype, salt=j) for j in range(world_size)]
    else:  # views of one buffer, back to back
        buf = make(np.concatenate([rank_input(rank, (k,), dtype, salt=j) for j in range(world_size)]))
        input_list = [buf[j * k : (j + 1) * k] for j in range(world_size)]
    kept = [rank_input(rank, (k,), dtype, salt=j) for j in range(world_size)]
    out = make.empty((k,), dtype)
    assert dist.reduce_scatter(out, input_list, op=make_op(opname)) is None
    expected = reference(inputs_of(world_size, (k,), dtype, rank), ref_op(opname))
    assert_equal(out, expected)
    for a, b in zip(input_list, kept):
        assert_equal(a, b)  # inputs are never modified (PREMUL_SUM scales a copy)


@pytest.mark.parametrize(("fam", "opname"), VALID_CASES)
def test_reduce_scatter_tensor_ops(fam, opname, make, rank, world_size):
    dtype = FAMILIES[fam]
    k = 4
    inp = make.input(rank, (world_size * k,), dtype, salt=6)
    kept = rank_input(rank, (world_size * k,), dtype, salt=6)
    out = make.empty((k,), dtype)
    assert dist.reduce_scatter_tensor(out, inp, op=make_op(opname)) is None
    full = reference(inputs_of(world_size, (world_size * k,), dtype, 6), ref_op(opname))
    assert_equal(out, full[rank * k : (rank + 1) * k])
    assert_equal(inp, kept)


@pytest.mark.parametrize("form", ["concat", "stack", "reduce_scatter_single"])
@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_reduce_scatter_tensor_forms(fam, form, make, rank, world_size):
    dtype = FAMILIES[fam]
    fn = dist.reduce_scatter_single if form == "reduce_scatter_single" else dist.reduce_scatter_tensor
    if form == "stack":
        inp = make.input(rank, (world_size, 2, 3), dtype, salt=7)
        full = reference(inputs_of(world_size, (world_size, 2, 3), dtype, 7), R.SUM)
        expected = full[rank]
    else:
        inp = make.input(rank, (world_size * 2, 3), dtype, salt=7)
        full = reference(inputs_of(world_size, (world_size * 2, 3), dtype, 7), R.SUM)
        expected = full[2 * rank : 2 * rank + 2]
    out = make.empty((2, 3), dtype)
    fn(out, inp)
    assert_equal(out, expected)


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_reduce_scatter_list_uneven_sizes(fam, make, rank, world_size):
    """Rank j's output has its own size; input_list[j] has rank j's size on every rank."""
    dtype = FAMILIES[fam]

    def size(j: int) -> int:
        return j % 3 + 1

    input_list = [make.input(rank, (size(j),), dtype, salt=j) for j in range(world_size)]
    out = make.empty((size(rank),), dtype)
    dist.reduce_scatter(out, input_list, op=R.SUM)
    assert_equal(out, reference(inputs_of(world_size, (size(rank),), dtype, rank), R.SUM))


def test_reduce_scatter_single_is_reduce_scatter_tensor():
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor
    assert dist.all_gather_single is dist.all_gather_into_tensor


# ---------------------------------------------------------------------------------------
# all_gather (list), all_gather_into_tensor
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_all_gather_list(fam, make, rank, world_size):
    dtype = FAMILIES[fam]
    x = make.input(rank, SHAPE, dtype, salt=8)
    outs = [make.empty(SHAPE, dtype) for _ in range(world_size)]
    assert dist.all_gather(outs, x) is None
    for r in range(world_size):
        assert_identical_on_all_ranks(outs[r])
    for r in range(world_size):
        assert_equal(outs[r], rank_input(r, SHAPE, dtype, salt=8))
    assert_equal(x, rank_input(rank, SHAPE, dtype, salt=8))


def _uneven_shape(r: int) -> tuple[int, int]:
    return ((r + 1) % 3, 2)  # rank 2 (and 5, ...) sends nothing


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_all_gather_list_uneven_sizes(fam, make, rank, world_size):
    dtype = FAMILIES[fam]
    x = make.input(rank, _uneven_shape(rank), dtype, salt=9)
    outs = [make.empty(_uneven_shape(r), dtype) for r in range(world_size)]
    dist.all_gather(outs, x)
    for r in range(world_size):
        assert_equal(outs[r], rank_input(r, _uneven_shape(r), dtype, salt=9))


@pytest.mark.parametrize("form", ["concat", "stack", "all_gather_single"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_all_gather_into_tensor_every_dtype(dtype, form, make, rank, world_size):
    fn = dist.all_gather_single if form == "all_gather_single" else dist.all_gather_into_tensor
    x = make.input(rank, SHAPE, dtype, salt=10)
    parts = inputs_of(world_size, SHAPE, dtype, 10)
    if form == "stack":
        out, expected = make.empty((world_size, *SHAPE), dtype), np.stack(parts)
    else:
        out, expected = make.empty((world_size * SHAPE[0], SHAPE[1]), dtype), np.concatenate(parts)
    assert fn(out, x) is None
    assert_identical_on_all_ranks(out)
    assert_equal(out, expected)


# ---------------------------------------------------------------------------------------
# gather / scatter
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_gather_every_dst(fam, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    for dst in range(world_size):
        x = make.input(rank, SHAPE, dtype, salt=dst)
        glist = [make.empty(SHAPE, dtype) for _ in range(world_size)] if rank == dst else None
        assert dist.gather(x, glist, dst=dst) is None
        if rank == dst:
            for r in range(world_size):
                checks.equal(f"dst={dst} gather_list[{r}]", glist[r], rank_input(r, SHAPE, dtype, salt=dst))
        checks.equal(f"dst={dst} input unchanged", x, rank_input(rank, SHAPE, dtype, salt=dst))
    checks.done()


@pytest.mark.parametrize("how", ["default", "dst=0", "group_dst", "empty-list-elsewhere"])
def test_gather_root_arguments(how, make, rank, world_size, checks):
    dtype = np.dtype(np.int32)
    root = 0 if how in ("default", "dst=0") else world_size - 1
    x = make.input(rank, (3,), dtype, salt=11)
    glist = [make.empty((3,), dtype) for _ in range(world_size)] if rank == root else None
    if how == "default":
        dist.gather(x, glist)
    elif how == "dst=0":
        dist.gather(x, gather_list=glist, dst=0)
    elif how == "group_dst":
        dist.gather(x, glist, group_dst=root)
    else:
        dist.gather(x, glist if rank == root else [], dst=root)
    if rank == root:
        for r in range(world_size):
            checks.equal(f"gather_list[{r}]", glist[r], rank_input(r, (3,), dtype, salt=11))
    checks.done()


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_scatter_every_src(fam, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    for src in range(world_size):
        out = make.empty(SHAPE, dtype)
        slist = [make.input(r, SHAPE, dtype, salt=src + 20) for r in range(world_size)] if rank == src else None
        assert dist.scatter(out, slist, src=src) is None
        checks.equal(f"src={src}", out, rank_input(rank, SHAPE, dtype, salt=src + 20))
        if rank == src:
            for r in range(world_size):
                checks.equal(
                    f"src={src} scatter_list[{r}] unchanged", slist[r], rank_input(r, SHAPE, dtype, salt=src + 20)
                )
    checks.done()


@pytest.mark.parametrize("how", ["default", "src=0", "group_src", "empty-list-elsewhere"])
def test_scatter_root_arguments(how, make, rank, world_size):
    dtype = np.dtype(np.float32)
    root = 0 if how in ("default", "src=0") else world_size - 1
    out = make.empty((3,), dtype)
    slist = [make.input(r, (3,), dtype, salt=12) for r in range(world_size)] if rank == root else None
    if how == "default":
        dist.scatter(out, slist)
    elif how == "src=0":
        dist.scatter(out, scatter_list=slist, src=0)
    elif how == "group_src":
        dist.scatter(out, slist, group_src=root)
    else:
        dist.scatter(out, slist if rank == root else [], src=root)
    assert_equal(out, rank_input(rank, (3,), dtype, salt=12))


# ---------------------------------------------------------------------------------------
# all_to_all_single and all_to_all
# ---------------------------------------------------------------------------------------


def a2a_rows(r: int, rows: int, trailing: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Rank ``r``'s all_to_all input: row i of rank r holds 1000 * r + (its flat position)."""
    n = rows * int(np.prod(trailing))
    return (1000 * r + np.arange(n)).astype(dtype).reshape((rows, *trailing))


def split_table(n: int) -> list[list[int]]:
    """S[r][j]: rows rank r sends to rank j (uneven, with zeros)."""
    return [[(r + 2 * j) % 3 for j in range(n)] for r in range(n)]


def a2a_expected(rank: int, n: int, table: list[list[int]], trailing: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Rank ``rank``'s output: from every rank j, the rows j sends to ``rank``, in rank order."""
    blocks = []
    for j in range(n):
        inp = a2a_rows(j, sum(table[j]), trailing, dtype)
        start = sum(table[j][:rank])
        blocks.append(inp[start : start + table[j][rank]])
    return np.concatenate(blocks)


@pytest.mark.parametrize("trailing", [(), (3, 2)], ids=["1d", "rows-3x2"])
@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_all_to_all_single_even(fam, trailing, make, rank, world_size):
    dtype = FAMILIES[fam]
    if kind(dtype) == "b":
        inp = make.input(rank, (2 * world_size, *trailing), dtype, salt=13)
        parts = [rank_input(j, (2 * world_size, *trailing), dtype, salt=13) for j in range(world_size)]
    else:
        inp = make(a2a_rows(rank, 2 * world_size, trailing, dtype))
        parts = [a2a_rows(j, 2 * world_size, trailing, dtype) for j in range(world_size)]
    out = make.empty(tuple(inp.shape), dtype)
    assert dist.all_to_all_single(out, inp) is None
    expected = np.concatenate([p[2 * rank : 2 * rank + 2] for p in parts])
    assert_equal(out, expected)


@pytest.mark.parametrize("trailing", [(), (3, 2)], ids=["1d", "rows-3x2"])
@pytest.mark.parametrize(
    "dtype", [np.dtype(np.int64), np.dtype(np.complex128), BF16], ids=["int64", "complex128", "bf16"]
)
def test_all_to_all_single_uneven(dtype, trailing, make, rank, world_size):
    table = split_table(world_size)
    in_splits = table[rank]
    out_splits = [table[j][rank] for j in range(world_size)]
    inp = make(a2a_rows(rank, sum(in_splits), trailing, dtype))
    out = make.empty((sum(out_splits), *trailing), dtype)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    assert_equal(out, a2a_expected(rank, world_size, table, trailing, dtype))


def test_all_to_all_single_numpy_split_sizes(make, rank, world_size):
    """Split sizes as numpy integers or a numpy array (what code built on numpy passes) act like ints."""
    table = split_table(world_size)
    in_splits = np.array(table[rank], np.int64)
    out_splits = [np.int32(table[j][rank]) for j in range(world_size)]
    inp = make(a2a_rows(rank, int(in_splits.sum()), (), np.int64))
    out = make.empty((sum(int(s) for s in out_splits),), np.int64)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    assert_equal(out, a2a_expected(rank, world_size, table, (), np.int64))


def test_all_to_all_single_input_splits_only(make, rank, world_size):
    # every rank sends j + 1 rows to rank j, so each output splits evenly
    table = [[j + 1 for j in range(world_size)] for _ in range(world_size)]
    inp = make(a2a_rows(rank, sum(table[rank]), (2,), np.int32))
    out = make.empty((world_size * (rank + 1), 2), np.int32)
    dist.all_to_all_single(out, inp, input_split_sizes=table[rank])
    assert_equal(out, a2a_expected(rank, world_size, table, (2,), np.int32))


def test_all_to_all_single_output_splits_only(make, rank, world_size):
    # rank j sends j + 1 rows to everyone (an even split of its input)
    table = [[r + 1] * world_size for r in range(world_size)]
    inp = make(a2a_rows(rank, world_size * (rank + 1), (2,), np.int32))
    out = make.empty((sum(r + 1 for r in range(world_size)), 2), np.int32)
    dist.all_to_all_single(out, inp, output_split_sizes=[j + 1 for j in range(world_size)])
    assert_equal(out, a2a_expected(rank, world_size, table, (2,), np.int32))


def test_all_to_all_single_empty_split_lists_mean_even(make, rank, world_size):
    inp = make(a2a_rows(rank, world_size, (), np.int64))
    out = make.empty((world_size,), np.int64)
    dist.all_to_all_single(out, inp, [], [])
    assert_equal(out, np.array([1000 * j + rank for j in range(world_size)], np.int64))


def _a2a_size(src: int, dst: int) -> int:
    return (2 * src + dst) % 3  # uneven, with zeros


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_all_to_all_lists_uneven(fam, make, rank, world_size):
    dtype = FAMILIES[fam]

    def piece(src: int, dst: int) -> np.ndarray:
        return rank_input(src, (_a2a_size(src, dst), 2), dtype, salt=dst)

    ins = [make(piece(rank, j)) for j in range(world_size)]
    outs = [make.empty((_a2a_size(j, rank), 2), dtype) for j in range(world_size)]
    assert dist.all_to_all(outs, ins) is None
    for j in range(world_size):
        assert_equal(outs[j], piece(j, rank))
    for j in range(world_size):
        assert_equal(ins[j], piece(rank, j))


# ---------------------------------------------------------------------------------------
# barrier, monitored_barrier
# ---------------------------------------------------------------------------------------


def _same_host() -> bool:
    names = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())
    return len(set(names)) == 1


@pytest.mark.parametrize(
    "how", ["barrier", "barrier-async", "barrier-timeout", "monitored_barrier", "monitored_barrier-wait_all_ranks"]
)
def test_barrier_waits_for_the_last_rank(how, rank, world_size):
    """No rank leaves the barrier before the last rank (here: the slowest, last one) entered it.

    Uses CLOCK_MONOTONIC, which is one clock for all processes of a host.
    """
    if not _same_host():
        pytest.skip("needs every rank on one host (a shared monotonic clock)")
    late = world_size - 1
    dist.barrier()
    if rank == late:
        time.sleep(0.1)
    entered = time.monotonic()
    if how == "barrier":
        assert dist.barrier() is None
    elif how == "barrier-async":
        w = dist.barrier(async_op=True)
        assert isinstance(w, dist.Work)
        assert w.wait() is True
        assert w.is_completed() and w.is_success() and w.exception() is None
    elif how == "barrier-timeout":
        assert dist.barrier(timeout=timedelta(seconds=60)) is None
    elif how == "monitored_barrier":
        assert dist.monitored_barrier(timeout=timedelta(seconds=60)) is None
    else:
        assert dist.monitored_barrier(wait_all_ranks=True) is None
    left = time.monotonic()
    entries = MPI.COMM_WORLD.allgather(entered)
    assert left >= max(entries), f"left at {left}, but rank {late} entered at {entries[late]}"


# ---------------------------------------------------------------------------------------
# coalesced collectives
# ---------------------------------------------------------------------------------------

COALESCED_SHAPES = [(3,), (2, 2), (), (0,)]


@pytest.mark.parametrize("opname", ["SUM", "order"])
@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_all_reduce_coalesced(fam, opname, make, rank, world_size):
    dtype = FAMILIES[fam]
    op = R.SUM if opname == "SUM" else order_op(dtype)
    tensors = [make.input(rank, s, dtype, salt=i) for i, s in enumerate(COALESCED_SHAPES)]
    # one non-contiguous member: a column of a 3x2 array
    holder = np.empty((3, 2), dtype)
    holder[...] = sentinel(dtype)
    holder[:, 0] = rank_input(rank, (3,), dtype, salt=9)
    holder = make(holder)
    tensors.append(holder[:, 0])
    assert dist.all_reduce_coalesced(tensors, op=op) is None
    for i, s in enumerate(COALESCED_SHAPES):
        assert_equal(tensors[i], reference(inputs_of(world_size, s, dtype, i), op))
    assert_equal(holder[:, 0], reference(inputs_of(world_size, (3,), dtype, 9), op))
    assert_equal(holder[:, 1], np.full(3, sentinel(dtype), dtype))


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_all_gather_coalesced(fam, make, rank, world_size):
    dtype = FAMILIES[fam]
    ins = [make.input(rank, s, dtype, salt=i) for i, s in enumerate(COALESCED_SHAPES)]
    outs = [[make.empty(s, dtype) for s in COALESCED_SHAPES] for _ in range(world_size)]
    # a non-contiguous input and non-contiguous outputs (every other element of a buffer)
    holder = np.empty(8, dtype)
    holder[...] = sentinel(dtype)
    holder[::2] = rank_input(rank, (4,), dtype, salt=7)
    holder = make(holder)
    ins.append(holder[::2])
    out_holders = [make.empty((8,), dtype) for _ in range(world_size)]
    for r in range(world_size):
        outs[r].append(out_holders[r][::2])
    assert dist.all_gather_coalesced(outs, ins) is None
    for r in range(world_size):
        for i, s in enumerate(COALESCED_SHAPES):
            assert_equal(outs[r][i], rank_input(r, s, dtype, salt=i))
        assert_equal(out_holders[r][::2], rank_input(r, (4,), dtype, salt=7))
        assert_equal(out_holders[r][1::2], np.full(4, sentinel(dtype), dtype))
    assert_equal(holder[::2], rank_input(rank, (4,), dtype, salt=7))


# ---------------------------------------------------------------------------------------
# non-contiguous inputs and outputs
# ---------------------------------------------------------------------------------------

F8 = np.dtype(np.float64)


def _nc_broadcast(v: Views, rank: int, n: int, checks: Checks) -> None:
    for src in range(n):
        x = v((4, 3), F8, rank_input(rank, (4, 3), F8, salt=src))
        dist.broadcast(x, src=src)
        checks.equal(f"broadcast src={src}", x, rank_input(src, (4, 3), F8, salt=src))


def _nc_all_reduce(v: Views, rank: int, n: int, checks: Checks) -> None:
    for opname in ["SUM", "AVG", "MAX", PREMUL_HALF]:
        x = v((4, 3), F8, rank_input(rank, (4, 3), F8, salt=1))
        dist.all_reduce(x, op=make_op(opname))
        checks.equal(f"all_reduce {opname}", x, reference(inputs_of(n, (4, 3), F8, 1), make_op(opname)))


def _nc_reduce(v: Views, rank: int, n: int, checks: Checks) -> None:
    expected = reference(inputs_of(n, (4, 3), F8, 2), R.SUM)
    for dst in range(n):
        x = v((4, 3), F8, rank_input(rank, (4, 3), F8, salt=2))
        dist.reduce(x, dst=dst)
        checks.equal(f"reduce dst={dst}", x, expected if rank == dst else rank_input(rank, (4, 3), F8, salt=2))


def _nc_all_gather_into_tensor(v: Views, rank: int, n: int, checks: Checks) -> None:
    x = v((2, 3), F8, rank_input(rank, (2, 3), F8, salt=3))
    out = v((2 * n, 3), F8)
    dist.all_gather_into_tensor(out, x)
    checks.equal("all_gather_into_tensor concat", out, np.concatenate(inputs_of(n, (2, 3), F8, 3)))
    if n > 1 or v.layout == "transposed":  # a (1, 2, 3) view of rows is contiguous
        out3 = v((n, 2, 3), F8)
        dist.all_gather_into_tensor(out3, x)
        checks.equal("all_gather_into_tensor stack", out3, np.stack(inputs_of(n, (2, 3), F8, 3)))


def _nc_all_gather(v: Views, rank: int, n: int, checks: Checks) -> None:
    x = v((2, 3), F8, rank_input(rank, (2, 3), F8, salt=4))
    outs = [v((2, 3), F8) for _ in range(n)]
    dist.all_gather(outs, x)
    for r in range(n):
        checks.equal(f"all_gather [{r}]", outs[r], rank_input(r, (2, 3), F8, salt=4))


def _nc_reduce_scatter_tensor(v: Views, rank: int, n: int, checks: Checks) -> None:
    inp = v((2 * n, 3), F8, rank_input(rank, (2 * n, 3), F8, salt=5))
    out = v((2, 3), F8)
    dist.reduce_scatter_tensor(out, inp)
    full = reference(inputs_of(n, (2 * n, 3), F8, 5), R.SUM)
    checks.equal("reduce_scatter_tensor", out, full[2 * rank : 2 * rank + 2])


def _nc_reduce_scatter(v: Views, rank: int, n: int, checks: Checks) -> None:
    ins = [v((2, 3), F8, rank_input(rank, (2, 3), F8, salt=j)) for j in range(n)]
    out = v((2, 3), F8)
    dist.reduce_scatter(out, ins, op=R.MIN)
    checks.equal("reduce_scatter", out, reference(inputs_of(n, (2, 3), F8, rank), R.MIN))


def _nc_gather(v: Views, rank: int, n: int, checks: Checks) -> None:
    for dst in range(n):
        x = v((2, 3), F8, rank_input(rank, (2, 3), F8, salt=dst))
        glist = [v((2, 3), F8) for _ in range(n)] if rank == dst else None
        dist.gather(x, glist, dst=dst)
        if rank == dst:
            for r in range(n):
                checks.equal(f"gather dst={dst} [{r}]", glist[r], rank_input(r, (2, 3), F8, salt=dst))


def _nc_scatter(v: Views, rank: int, n: int, checks: Checks) -> None:
    for src in range(n):
        out = v((2, 3), F8)
        slist = [v((2, 3), F8, rank_input(r, (2, 3), F8, salt=src)) for r in range(n)] if rank == src else None
        dist.scatter(out, slist, src=src)
        checks.equal(f"scatter src={src}", out, rank_input(rank, (2, 3), F8, salt=src))


def _nc_all_to_all_single(v: Views, rank: int, n: int, checks: Checks) -> None:
    inp = v((2 * n, 3, 2), F8, a2a_rows(rank, 2 * n, (3, 2), F8))
    out = v((2 * n, 3, 2), F8)
    dist.all_to_all_single(out, inp)
    table = [[2] * n for _ in range(n)]
    checks.equal("all_to_all_single even", out, a2a_expected(rank, n, table, (3, 2), F8))
    # uneven: every block at least 2 rows so that every view is non-contiguous
    table = [[2 + (r + j) % 2 for j in range(n)] for r in range(n)]
    inp = v((sum(table[rank]), 3, 2), F8, a2a_rows(rank, sum(table[rank]), (3, 2), F8))
    out_splits = [table[j][rank] for j in range(n)]
    out = v((sum(out_splits), 3, 2), F8)
    dist.all_to_all_single(out, inp, out_splits, table[rank])
    checks.equal("all_to_all_single uneven", out, a2a_expected(rank, n, table, (3, 2), F8))


def _nc_all_to_all(v: Views, rank: int, n: int, checks: Checks) -> None:
    ins = [v((2, 3), F8, rank_input(rank, (2, 3), F8, salt=j)) for j in range(n)]
    outs = [v((2, 3), F8) for _ in range(n)]
    dist.all_to_all(outs, ins)
    for j in range(n):
        checks.equal(f"all_to_all [{j}]", outs[j], rank_input(j, (2, 3), F8, salt=rank))


NONCONTIG = {
    "broadcast": _nc_broadcast,
    "all_reduce": _nc_all_reduce,
    "reduce": _nc_reduce,
    "all_gather_into_tensor": _nc_all_gather_into_tensor,
    "all_gather": _nc_all_gather,
    "reduce_scatter_tensor": _nc_reduce_scatter_tensor,
    "reduce_scatter": _nc_reduce_scatter,
    "gather": _nc_gather,
    "scatter": _nc_scatter,
    "all_to_all_single": _nc_all_to_all_single,
    "all_to_all": _nc_all_to_all,
}


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
@pytest.mark.parametrize("coll", list(NONCONTIG))
def test_non_contiguous_arrays(coll, layout, make, rank, world_size, checks):
    if not layout_exists(layout, make.name):
        pytest.skip(f"{make.name} arrays have no {layout} layout")
    v = Views(layout, checks, make)
    NONCONTIG[coll](v, rank, world_size, checks)
    v.check_outside()
    checks.done()


@pytest.mark.parametrize("coll", ["all_gather", "gather", "scatter", "all_to_all"])
def test_list_collectives_through_one_staging_buffer(coll, make, rank, world_size, checks, monkeypatch):
    """Arrays of a list more than 2**31 bytes apart, on an MPI library without MPI-4 large counts
    (Open MPI 5), go through one staging buffer; non-contiguous outputs still get the results.

    Forced here by a zero offset limit. The staging buffer must be copied into the list's arrays
    before those are written back into the caller's views (in the other order the views got the
    bytes of freed temporaries: Open MPI, 2 ranks, after the large-message tests)."""
    import mpidist.backends.mpi as mpi_backend

    real, staged = mpi_backend._vector, []

    def spy(arrays: Any, fn: str, arg: str, output: bool) -> Any:
        msg, addrs, backs = real(arrays, fn, arg, output)
        staged.append(addrs is None)
        return msg, addrs, backs

    monkeypatch.setattr(mpi_backend, "LARGE_COUNTS", False)
    monkeypatch.setattr(mpi_backend, "_INT_MAX", 0)
    monkeypatch.setattr(mpi_backend, "_vector", spy)
    v = Views("strided", checks, make)
    NONCONTIG[coll](v, rank, world_size, checks)
    v.check_outside()
    checks.true(f"{coll}: the list went through the staging buffer", any(staged))
    checks.done()


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_all_reduce_non_contiguous_every_family(fam, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    for layout in [lay for lay in LAYOUTS if layout_exists(lay, make.name)]:
        v = Views(layout, checks, make)
        x = v((4, 3), dtype, rank_input(rank, (4, 3), dtype, salt=3))
        dist.all_reduce(x, op=order_op(dtype))
        checks.equal(layout, x, reference(inputs_of(world_size, (4, 3), dtype, 3), order_op(dtype)))
        v.check_outside()
    checks.done()


# ---------------------------------------------------------------------------------------
# contiguous arrays: zero staging copies
# ---------------------------------------------------------------------------------------


def _zc_broadcast(make: Maker, rank: int, n: int, checks: Checks):
    x = make.input(rank, (4, 3), F8, salt=1)
    src = n - 1

    def run() -> None:
        dist.broadcast(x, src=src)

    def check() -> None:
        checks.equal("broadcast", x, rank_input(src, (4, 3), F8, salt=1))

    return run, check


def _zc_all_reduce(make: Maker, rank: int, n: int, checks: Checks):
    x = make.input(rank, (4, 3), F8, salt=2)
    return (lambda: dist.all_reduce(x)), (
        lambda: checks.equal("all_reduce", x, reference(inputs_of(n, (4, 3), F8, 2), R.SUM))
    )


def _zc_all_gather_into_tensor(make: Maker, rank: int, n: int, checks: Checks):
    x = make.input(rank, (2, 3), F8, salt=3)
    out = make.zeros((n, 2, 3))
    return (lambda: dist.all_gather_into_tensor(out, x)), (
        lambda: checks.equal("all_gather_into_tensor", out, np.stack(inputs_of(n, (2, 3), F8, 3)))
    )


def _zc_reduce_scatter_tensor(make: Maker, rank: int, n: int, checks: Checks):
    inp = make.input(rank, (2 * n, 3), F8, salt=4)
    out = make.zeros((2, 3))
    full = reference(inputs_of(n, (2 * n, 3), F8, 4), R.SUM)
    return (lambda: dist.reduce_scatter_tensor(out, inp)), (
        lambda: checks.equal("reduce_scatter_tensor", out, full[2 * rank : 2 * rank + 2])
    )


def _zc_all_to_all_single(make: Maker, rank: int, n: int, checks: Checks):
    table = split_table(n)
    inp = make(a2a_rows(rank, sum(table[rank]), (3,), F8))
    out_splits = [table[j][rank] for j in range(n)]
    out = make.zeros((sum(out_splits), 3))
    evens = make(a2a_rows(rank, 2 * n, (3,), F8))
    eout = make.zeros((2 * n, 3))

    def run() -> None:
        dist.all_to_all_single(out, inp, out_splits, table[rank])
        dist.all_to_all_single(eout, evens)

    def check() -> None:
        checks.equal("all_to_all_single uneven", out, a2a_expected(rank, n, table, (3,), F8))
        checks.equal("all_to_all_single even", eout, a2a_expected(rank, n, [[2] * n] * n, (3,), F8))

    return run, check


def _zc_all_gather(make: Maker, rank: int, n: int, checks: Checks):
    x = make.input(rank, (2, 3), F8, salt=5)
    outs = [make.zeros((2, 3)) for _ in range(n)]

    def check() -> None:
        for r in range(n):
            checks.equal(f"all_gather [{r}]", outs[r], rank_input(r, (2, 3), F8, salt=5))

    return (lambda: dist.all_gather(outs, x)), check


def _zc_gather(make: Maker, rank: int, n: int, checks: Checks):
    x = make.input(rank, (2, 3), F8, salt=6)
    dst = n - 1
    glist = [make.zeros((2, 3)) for _ in range(n)] if rank == dst else None

    def check() -> None:
        if rank == dst:
            for r in range(n):
                checks.equal(f"gather [{r}]", glist[r], rank_input(r, (2, 3), F8, salt=6))

    return (lambda: dist.gather(x, glist, dst=dst)), check


def _zc_scatter(make: Maker, rank: int, n: int, checks: Checks):
    out = make.zeros((2, 3))
    src = n - 1
    slist = [make.input(r, (2, 3), F8, salt=7) for r in range(n)] if rank == src else None
    return (lambda: dist.scatter(out, slist, src=src)), (
        lambda: checks.equal("scatter", out, rank_input(rank, (2, 3), F8, salt=7))
    )


def _zc_all_to_all(make: Maker, rank: int, n: int, checks: Checks):
    ins = [make.input(rank, (_a2a_size(rank, j),), F8, salt=j) for j in range(n)]
    outs = [make.zeros(_a2a_size(j, rank)) for j in range(n)]

    def check() -> None:
        for j in range(n):
            checks.equal(f"all_to_all [{j}]", outs[j], rank_input(j, (_a2a_size(j, rank),), F8, salt=rank))

    return (lambda: dist.all_to_all(outs, ins)), check


ZERO_COPY = {
    "broadcast": _zc_broadcast,
    "all_reduce": _zc_all_reduce,
    "all_gather_into_tensor": _zc_all_gather_into_tensor,
    "reduce_scatter_tensor": _zc_reduce_scatter_tensor,
    "all_to_all_single": _zc_all_to_all_single,
    "all_gather": _zc_all_gather,
    "gather": _zc_gather,
    "scatter": _zc_scatter,
    "all_to_all": _zc_all_to_all,
}


@pytest.mark.parametrize("coll", list(ZERO_COPY))
def test_contiguous_arrays_cause_no_copies(coll, make, rank, world_size, checks):
    skip_if_staged(make)
    run, check = ZERO_COPY[coll](make, rank, world_size, checks)
    before = copies()
    run()
    after = copies()
    check()
    checks.true(f"{coll}: {after - before} staging copies for contiguous arrays (expected 0)", after == before)
    checks.done()


# ---------------------------------------------------------------------------------------
# aliasing between inputs and outputs
# ---------------------------------------------------------------------------------------


def test_all_gather_into_tensor_input_in_own_slot(make, rank, world_size):
    skip_if_staged(make)
    k = 3
    out = np.full(world_size * k, -1.0)
    out[rank * k : (rank + 1) * k] = rank_input(rank, (k,), F8, salt=1)
    out = make(out)
    mine = out[rank * k : (rank + 1) * k]
    before = copies()
    dist.all_gather_into_tensor(out, mine)
    assert copies() == before, "the input already is this rank's block: no copy needed"
    assert_equal(out, np.concatenate(inputs_of(world_size, (k,), F8, 1)))


def test_all_gather_into_tensor_input_in_another_slot(make, rank, world_size):
    # every rank's input is block 0 of its own output, which the gather overwrites
    k = 3
    out = np.full(world_size * k, -1.0)
    out[:k] = rank_input(rank, (k,), F8, salt=2)
    out = make(out)
    dist.all_gather_into_tensor(out, out[:k])
    assert_equal(out, np.concatenate(inputs_of(world_size, (k,), F8, 2)))


def test_all_gather_tensor_list_slot_is_tensor(make, rank, world_size):
    skip_if_staged(make)
    x = make.input(rank, (2, 2), np.int16, salt=3)
    outs = [make.zeros((2, 2), np.int16) for _ in range(world_size)]
    outs[rank] = x
    before = copies()
    dist.all_gather(outs, x)
    assert copies() == before
    assert outs[rank] is x
    for r in range(world_size):
        assert_equal(outs[r], rank_input(r, (2, 2), np.dtype(np.int16), salt=3))


def test_all_gather_tensor_is_another_ranks_slot(make, rank, world_size):
    # the input lives in slot (rank + 1) % n of the output list, which receives another rank's data
    n = world_size
    slot = (rank + 1) % n
    outs = [make.zeros(3, np.int32) if j != slot else make.input(rank, (3,), np.int32, salt=4) for j in range(n)]
    dist.all_gather(outs, outs[slot])
    for r in range(n):
        assert_equal(outs[r], rank_input(r, (3,), np.dtype(np.int32), salt=4))


def test_gather_list_slot_is_tensor(make, rank, world_size, checks):
    for dst in range(world_size):
        x = make.input(rank, (3,), F8, salt=dst)
        glist = None
        if rank == dst:
            glist = [make.zeros(3) for _ in range(world_size)]
            glist[dst] = x
        dist.gather(x, glist, dst=dst)
        if rank == dst:
            for r in range(world_size):
                checks.equal(f"dst={dst} [{r}]", glist[r], rank_input(r, (3,), F8, salt=dst))
    checks.done()


def test_scatter_list_src_slot_is_output(make, rank, world_size, checks):
    skip_if_staged(make)
    for src in range(world_size):
        out = make.zeros(3)
        slist = None
        if rank == src:
            slist = [make.input(r, (3,), F8, salt=src) for r in range(world_size)]
            out = slist[src]
        before = copies()
        dist.scatter(out, slist, src=src)
        checks.true(f"src={src}: no copy expected", copies() == before)
        checks.equal(f"src={src}", out, rank_input(rank, (3,), F8, salt=src))
    checks.done()


@pytest.mark.mpi(min_size=2)
def test_scatter_output_aliases_another_ranks_block(make, rank, world_size):
    # on the source, the output is the block meant for the next rank
    src = 0
    out = make.zeros(3)
    slist = None
    if rank == src:
        slist = [make.input(r, (3,), F8, salt=5) for r in range(world_size)]
        out = slist[1]
    dist.scatter(out, slist, src=src)
    assert_equal(out, rank_input(rank, (3,), F8, salt=5))


def test_reduce_scatter_tensor_output_is_block_of_input(make, rank, world_size):
    k = 2
    inp = make.input(rank, (world_size * k,), np.int64, salt=6)
    full = reference(inputs_of(world_size, (world_size * k,), np.dtype(np.int64), 6), R.SUM)
    out = inp[rank * k : (rank + 1) * k]
    dist.reduce_scatter_tensor(out, inp)
    assert_equal(out, full[rank * k : (rank + 1) * k])


def test_all_to_all_single_in_place(make, rank, world_size):
    x = make(a2a_rows(rank, 2 * world_size, (2,), np.int64))
    dist.all_to_all_single(x, x)
    assert_equal(x, a2a_expected(rank, world_size, [[2] * world_size] * world_size, (2,), np.int64))


def test_all_to_all_output_list_is_input_list(make, rank, world_size):
    # symmetric sizes, so that the arrays a rank sends to j have the size of those it receives from j
    def size(a: int, b: int) -> int:
        return (a + b) % 3 + 1

    arrays = [make.input(rank, (size(rank, j),), F8, salt=j) for j in range(world_size)]
    dist.all_to_all(arrays, arrays)
    for j in range(world_size):
        assert_equal(arrays[j], rank_input(j, (size(j, rank),), F8, salt=rank))


# ---------------------------------------------------------------------------------------
# async_op=True
# ---------------------------------------------------------------------------------------


def _async_broadcast(make, rank, n, checks):
    x = make.input(rank, (3,), F8, salt=1)
    w = dist.broadcast(x, src=n - 1, async_op=True)
    return w, [x], lambda: checks.equal("broadcast", x, rank_input(n - 1, (3,), F8, salt=1))


def _async_all_reduce(make, rank, n, checks):
    base = make(rank_input(rank, (4, 3), F8, salt=2).T.copy())
    x = reverse_axes(base)  # non-contiguous: the result is written back only on completion
    w = dist.all_reduce(x, op=R.AVG, async_op=True)
    return w, [x], lambda: checks.equal("all_reduce", x, reference(inputs_of(n, (4, 3), F8, 2), R.AVG))


def _async_reduce(make, rank, n, checks):
    x = make.input(rank, (3,), F8, salt=3)
    w = dist.reduce(x, dst=0, op=R.PRODUCT, async_op=True)
    expected = reference(inputs_of(n, (3,), F8, 3), R.PRODUCT) if rank == 0 else rank_input(rank, (3,), F8, salt=3)
    return w, [x], lambda: checks.equal("reduce", x, expected)


def _async_all_gather(make, rank, n, checks):
    x = make.input(rank, _uneven_shape(rank), F8, salt=4)
    outs = [make.zeros(_uneven_shape(r)) for r in range(n)]
    w = dist.all_gather(outs, x, async_op=True)

    def check():
        for r in range(n):
            checks.equal(f"all_gather [{r}]", outs[r], rank_input(r, _uneven_shape(r), F8, salt=4))

    return w, outs, check


def _async_all_gather_into_tensor(make, rank, n, checks):
    x = make.input(rank, (2,), F8, salt=5)
    out = make.zeros(2 * n)
    w = dist.all_gather_into_tensor(out, x, async_op=True)
    return w, [out], lambda: checks.equal("all_gather_into_tensor", out, np.concatenate(inputs_of(n, (2,), F8, 5)))


def _async_gather(make, rank, n, checks):
    dst = n - 1
    x = make.input(rank, (2,), F8, salt=6)
    glist = [make.zeros(2) for _ in range(n)] if rank == dst else None
    w = dist.gather(x, glist, dst=dst, async_op=True)

    def check():
        if rank == dst:
            for r in range(n):
                checks.equal(f"gather [{r}]", glist[r], rank_input(r, (2,), F8, salt=6))

    return w, (glist if rank == dst else []), check


def _async_scatter(make, rank, n, checks):
    out = make.zeros(2)
    slist = [make.input(r, (2,), F8, salt=7) for r in range(n)] if rank == 0 else None
    w = dist.scatter(out, slist, async_op=True)
    return w, [out], lambda: checks.equal("scatter", out, rank_input(rank, (2,), F8, salt=7))


def _async_reduce_scatter(make, rank, n, checks):
    out = make.zeros(2)
    ins = [make.input(rank, (2,), F8, salt=j) for j in range(n)]
    w = dist.reduce_scatter(out, ins, op=R.MAX, async_op=True)
    return w, [out], lambda: checks.equal("reduce_scatter", out, reference(inputs_of(n, (2,), F8, rank), R.MAX))


def _async_reduce_scatter_tensor(make, rank, n, checks):
    out = make.zeros(2)
    inp = make.input(rank, (2 * n,), F8, salt=8)
    full = reference(inputs_of(n, (2 * n,), F8, 8), R.SUM)
    w = dist.reduce_scatter_tensor(out, inp, async_op=True)
    return w, [out], lambda: checks.equal("reduce_scatter_tensor", out, full[2 * rank : 2 * rank + 2])


def _async_all_to_all_single(make, rank, n, checks):
    table = split_table(n)
    inp = make(a2a_rows(rank, sum(table[rank]), (), F8))
    out_splits = [table[j][rank] for j in range(n)]
    out = make.zeros(sum(out_splits))
    w = dist.all_to_all_single(out, inp, out_splits, table[rank], async_op=True)
    return w, [out], lambda: checks.equal("all_to_all_single", out, a2a_expected(rank, n, table, (), F8))


def _async_all_to_all(make, rank, n, checks):
    ins = [make.input(rank, (_a2a_size(rank, j),), F8, salt=j) for j in range(n)]
    outs = [make.zeros(_a2a_size(j, rank)) for j in range(n)]
    w = dist.all_to_all(outs, ins, async_op=True)

    def check():
        for j in range(n):
            checks.equal(f"all_to_all [{j}]", outs[j], rank_input(j, (_a2a_size(j, rank),), F8, salt=rank))

    return w, outs, check


def _async_all_reduce_coalesced(make, rank, n, checks):
    ts = [make.input(rank, (3,), F8, salt=1), make.input(rank, (2, 2), F8, salt=2)]
    w = dist.all_reduce_coalesced(ts, async_op=True)

    def check():
        checks.equal("coalesced [0]", ts[0], reference(inputs_of(n, (3,), F8, 1), R.SUM))
        checks.equal("coalesced [1]", ts[1], reference(inputs_of(n, (2, 2), F8, 2), R.SUM))

    return w, ts, check


def _async_all_gather_coalesced(make, rank, n, checks):
    ins = [make.input(rank, (3,), F8, salt=1), make.input(rank, (2,), F8, salt=2)]
    outs = [[make.zeros(3), make.zeros(2)] for _ in range(n)]
    w = dist.all_gather_coalesced(outs, ins, async_op=True)

    def check():
        for r in range(n):
            checks.equal(f"[{r}][0]", outs[r][0], rank_input(r, (3,), F8, salt=1))
            checks.equal(f"[{r}][1]", outs[r][1], rank_input(r, (2,), F8, salt=2))

    return w, [a for lst in outs for a in lst], check


def _async_barrier(make, rank, n, checks):
    return dist.barrier(async_op=True), [], lambda: None


ASYNC = {
    "broadcast": _async_broadcast,
    "all_reduce": _async_all_reduce,
    "reduce": _async_reduce,
    "all_gather": _async_all_gather,
    "all_gather_into_tensor": _async_all_gather_into_tensor,
    "gather": _async_gather,
    "scatter": _async_scatter,
    "reduce_scatter": _async_reduce_scatter,
    "reduce_scatter_tensor": _async_reduce_scatter_tensor,
    "all_to_all_single": _async_all_to_all_single,
    "all_to_all": _async_all_to_all,
    "all_reduce_coalesced": _async_all_reduce_coalesced,
    "all_gather_coalesced": _async_all_gather_coalesced,
    "barrier": _async_barrier,
}


@pytest.mark.parametrize("coll", list(ASYNC))
def test_async_op_returns_work(coll, make, rank, world_size, checks):
    work, outputs, check = ASYNC[coll](make, rank, world_size, checks)
    checks.true(f"expected a Work, got {type(work).__name__}", isinstance(work, dist.Work))
    if not all(MPI.COMM_WORLD.allgather(isinstance(work, dist.Work))):  # stop together
        checks.done()
    checks.true("wait() should return True", work.wait() is True)
    checks.true("is_completed() after wait()", work.is_completed())
    checks.true("is_success() after wait()", work.is_success())
    checks.true("exception() is None", work.exception() is None)
    check()
    got = flatten(work.result())
    checks.true(
        f"result() should list the outputs: {len(got)} items for {len(outputs)} outputs",
        [id(a) for a in got] == [id(a) for a in outputs],
    )
    fut = work.get_future()
    value = flatten(fut.wait())
    checks.true("get_future().wait() should give the outputs", [id(a) for a in value] == [id(a) for a in outputs])
    checks.true("future done", fut.done())
    checks.done()


def test_async_several_in_flight_complete_in_any_wait_order(make, rank, world_size):
    xs = [make.input(rank, (4,), F8, salt=i) for i in range(3)]
    works = [dist.all_reduce(x, op=R.SUM, async_op=True) for x in xs]
    for w in reversed(works):
        w.wait()
    for i, x in enumerate(xs):
        assert_equal(x, reference(inputs_of(world_size, (4,), F8, i), R.SUM))


# ---------------------------------------------------------------------------------------
# 0-d and empty arrays
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_zero_dim_arrays(fam, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    n = world_size

    x = make.input(rank, (), dtype, salt=1)
    dist.broadcast(x, src=n - 1)
    checks.equal("broadcast", x, rank_input(n - 1, (), dtype, salt=1))

    x = make.input(rank, (), dtype, salt=2)
    dist.all_reduce(x, op=order_op(dtype))
    checks.equal("all_reduce", x, reference(inputs_of(n, (), dtype, 2), order_op(dtype)))

    x = make.input(rank, (), dtype, salt=3)
    dist.reduce(x, dst=0, op=R.SUM)
    checks.equal(
        "reduce", x, reference(inputs_of(n, (), dtype, 3), R.SUM) if rank == 0 else rank_input(rank, (), dtype, salt=3)
    )

    x = make.input(rank, (), dtype, salt=4)
    out = make.empty((n,), dtype)
    dist.all_gather_into_tensor(out, x)
    checks.equal("all_gather_into_tensor", out, np.stack(inputs_of(n, (), dtype, 4)))

    outs = [make.empty((), dtype) for _ in range(n)]
    dist.all_gather(outs, x)
    for r in range(n):
        checks.equal(f"all_gather [{r}]", outs[r], rank_input(r, (), dtype, salt=4))

    glist = [make.empty((), dtype) for _ in range(n)] if rank == 0 else None
    dist.gather(x, glist)
    if rank == 0:
        for r in range(n):
            checks.equal(f"gather [{r}]", glist[r], rank_input(r, (), dtype, salt=4))

    y = make.empty((), dtype)
    slist = [make.input(r, (), dtype, salt=5) for r in range(n)] if rank == 0 else None
    dist.scatter(y, slist)
    checks.equal("scatter", y, rank_input(rank, (), dtype, salt=5))

    y = make.empty((), dtype)
    dist.reduce_scatter_tensor(y, make.input(rank, (n,), dtype, salt=6), op=order_op(dtype))
    checks.equal("reduce_scatter_tensor", y, reference(inputs_of(n, (n,), dtype, 6), order_op(dtype))[rank])

    ins = [make.input(rank, (), dtype, salt=j) for j in range(n)]
    outs = [make.empty((), dtype) for _ in range(n)]
    dist.all_to_all(outs, ins)
    for j in range(n):
        checks.equal(f"all_to_all [{j}]", outs[j], rank_input(j, (), dtype, salt=rank))
    checks.done()


def test_all_to_all_single_rejects_zero_dim(make, rank, world_size):
    with pytest.raises(ValueError):
        dist.all_to_all_single(make.zeros(()), make.zeros(()))
    x = make(np.array([1.0]))
    dist.all_reduce(x)
    assert_equal(x, np.array([float(world_size)]))


@pytest.mark.parametrize("fam", FAM_PARAMS)
def test_empty_arrays(fam, make, rank, world_size, checks):
    dtype = FAMILIES[fam]
    n = world_size
    e = make.empty((0, 3), dtype)

    dist.broadcast(e, src=0)
    checks.equal("broadcast", e, np.empty((0, 3), dtype))
    dist.all_reduce(e)
    checks.equal("all_reduce", e, np.empty((0, 3), dtype))
    dist.reduce(e, dst=0)
    checks.equal("reduce", e, np.empty((0, 3), dtype))

    out = make.empty((0, 3), dtype)
    dist.all_gather_into_tensor(out, e)
    checks.equal("all_gather_into_tensor", out, np.empty((0, 3), dtype))

    outs = [make.empty((0, 3), dtype) for _ in range(n)]
    dist.all_gather(outs, e)
    checks.true("all_gather keeps shapes", all(tuple(o.shape) == (0, 3) for o in outs))

    glist = [make.empty((0, 3), dtype) for _ in range(n)] if rank == 0 else None
    dist.gather(e, glist)
    slist = [make.empty((0, 3), dtype) for _ in range(n)] if rank == 0 else None
    dist.scatter(e, slist)

    dist.reduce_scatter_tensor(make.empty((0, 3), dtype), make.empty((0, 3), dtype))
    dist.reduce_scatter(make.empty((0,), dtype), [make.empty((0,), dtype) for _ in range(n)])

    out = make.empty((0, 3), dtype)
    dist.all_to_all_single(out, make.empty((0, 3), dtype))
    dist.all_to_all_single(out, make.empty((0, 3), dtype), [0] * n, [0] * n)
    outs = [make.empty((0,), dtype) for _ in range(n)]
    dist.all_to_all(outs, [make.empty((0,), dtype) for _ in range(n)])

    # the group is intact after all the empty operations: a real one gives the right answer
    x = make.input(rank, (3,), dtype, salt=1)
    dist.all_reduce(x, op=order_op(dtype))
    checks.equal("all_reduce after", x, reference(inputs_of(n, (3,), dtype, 1), order_op(dtype)))
    checks.done()


# ---------------------------------------------------------------------------------------
# op spellings, argument errors, larger arrays
# ---------------------------------------------------------------------------------------


def test_op_spellings_give_the_same_reduction(make, rank, world_size):
    """RedOpType members, ReduceOp instances and the premul-sum aliases are interchangeable."""
    dtype = np.dtype(np.float32)
    expected_max = reference(inputs_of(world_size, (4,), dtype), R.MAX)
    expected_premul = reference(inputs_of(world_size, (4,), dtype), dist.make_premul_sum(2.0))
    spellings = [
        (R.MAX, expected_max),
        (dist.ReduceOp(R.MAX), expected_max),
        (dist.ReduceOp.RedOpType.MAX, expected_max),
        (dist.make_premul_sum(2.0), expected_premul),
        (dist._make_nccl_premul_sum(2.0), expected_premul),
        (dist.make_premul_sum(np.float32(2.0)), expected_premul),
    ]
    results = []
    for op, _ in spellings:
        x = make.input(rank, (4,), dtype)
        dist.all_reduce(x, op=op)
        results.append(x)
    with pytest.warns(FutureWarning):
        deprecated = dist.reduce_op.MAX
    x = make.input(rank, (4,), dtype)
    dist.all_reduce(x, op=deprecated)
    results.append(x)
    spellings.append((deprecated, expected_max))
    for (_op, expected), got in zip(spellings, results):
        assert_equal(got, expected)


def test_numpy_integer_roots(make, rank, world_size):
    src = np.int64(world_size - 1)
    x = make.input(rank, (3,), F8, salt=1)
    dist.broadcast(x, src=src)
    assert_equal(x, rank_input(world_size - 1, (3,), F8, salt=1))
    y = make.input(rank, (3,), F8, salt=2)
    dist.reduce(y, dst=np.int32(0))
    expected = reference(inputs_of(world_size, (3,), F8, 2), R.SUM) if rank == 0 else rank_input(rank, (3,), F8, salt=2)
    assert_equal(y, expected)


def _bad_calls(n: int, make: Maker) -> list[tuple[str, type, Callable[[], Any]]]:
    """Calls that must raise, with arrays of ``make``'s kind (numpy-only cases only for numpy)."""
    f8, i4 = make.zeros(2), make.zeros(2, np.int32)

    def zeros(shape: Any, dtype: Any = np.float64) -> Any:
        return make.zeros(shape, dtype)

    calls = [
        (
            "all_gather_into_tensor: output too small",
            ValueError,
            lambda: dist.all_gather_into_tensor(zeros(2 * n - 1), f8),
        ),
        ("all_gather_into_tensor: dtypes differ", TypeError, lambda: dist.all_gather_into_tensor(zeros(2 * n), i4)),
        (
            "reduce_scatter_tensor: input too small",
            ValueError,
            lambda: dist.reduce_scatter_tensor(f8, zeros(2 * n + 1)),
        ),
        (
            "reduce_scatter_tensor: dtypes differ",
            TypeError,
            lambda: dist.reduce_scatter_tensor(f8, zeros(2 * n, np.float32)),
        ),
        ("all_gather: list too short", ValueError, lambda: dist.all_gather([zeros(2)] * (n - 1), f8)),
        ("all_gather: own slot size", ValueError, lambda: dist.all_gather([zeros(3) for _ in range(n)], f8)),
        (
            "all_gather: dtypes differ",
            TypeError,
            lambda: dist.all_gather([zeros(2, np.int32) for _ in range(n)], f8),
        ),
        ("reduce_scatter: list too long", ValueError, lambda: dist.reduce_scatter(f8, [zeros(2)] * (n + 1))),
        (
            "all_to_all_single: splits sum",
            ValueError,
            lambda: dist.all_to_all_single(zeros(n), zeros(n), [1] * n, [2] * n),
        ),
        (
            "all_to_all_single: splits length",
            ValueError,
            lambda: dist.all_to_all_single(zeros(n), zeros(n), [1] * (n + 1), [1] * (n + 1)),
        ),
        (
            "all_to_all_single: negative split",
            ValueError,
            lambda: dist.all_to_all_single(zeros(n), zeros(n), [1] * n, [-1] + [1] * (n - 1)),
        ),
        (
            "all_to_all_single: row shapes",
            ValueError,
            lambda: dist.all_to_all_single(zeros((n, 2)), zeros((n, 3))),
        ),
        ("all_to_all: list too short", ValueError, lambda: dist.all_to_all([zeros(1)] * (n - 1), [zeros(1)] * n)),
        ("broadcast: src out of range", ValueError, lambda: dist.broadcast(zeros(2), src=n)),
        ("broadcast: src and group_src", ValueError, lambda: dist.broadcast(zeros(2), src=0, group_src=0)),
        ("broadcast: no src", ValueError, lambda: dist.broadcast(zeros(2))),
        (
            "all_reduce_coalesced: dtypes differ",
            TypeError,
            lambda: dist.all_reduce_coalesced([zeros(2), zeros(2, np.int32)]),
        ),
        (
            "all_gather_coalesced: sizes differ",
            ValueError,
            lambda: dist.all_gather_coalesced([[zeros(3)] for _ in range(n)], [f8]),
        ),
    ]
    if make.name == "numpy":  # read-only flags, lists and object arrays are numpy's own
        ro = np.zeros(2)
        ro.flags.writeable = False
        calls += [
            ("all_reduce: read-only", ValueError, lambda: dist.all_reduce(ro)),
            ("all_reduce: a list", TypeError, lambda: dist.all_reduce([1.0, 2.0])),
            ("all_reduce: object dtype", TypeError, lambda: dist.all_reduce(np.array([1, "a"], object))),
        ]
    if n > 1:  # rows that do not split evenly over the ranks
        calls.append(
            (
                "all_to_all_single: uneven rows",
                ValueError,
                lambda: dist.all_to_all_single(zeros(n + 1), zeros(n + 1)),
            )
        )
    return calls


def test_invalid_arguments_raise_on_every_rank_before_communicating(make, rank, world_size, checks):
    """Local validation, identical on every rank: all raise, nobody waits in a collective."""
    for what, exc_type, call in _bad_calls(world_size, make):
        try:
            call()
        except exc_type:
            pass
        except Exception as exc:  # noqa: BLE001 - record the wrong kind of error
            checks.failures.append(f"{what}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}")
        else:
            checks.failures.append(f"{what}: did not raise")
    x = make(np.array([1.0, rank]))
    dist.all_reduce(x)
    checks.equal("all_reduce after the errors", x, np.array([world_size, world_size * (world_size - 1) / 2]))
    checks.done()


@pytest.mark.mpi(min_size=2)
def test_all_gather_overlapping_outputs_raise(make, rank, world_size):
    buf = make.zeros(2)
    with pytest.raises(ValueError):
        dist.all_gather([buf] * world_size, make(np.ones(2)))
    x = make(np.ones(1))
    dist.all_reduce(x)
    assert_equal(x, np.array([float(world_size)]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fn", ["all_gather", "all_to_all"])
def test_list_outputs_that_are_overlapping_views_raise(fn, rank, world_size):
    """Views of one buffer (not the same object twice) that overlap: the span check, not the identity shortcut.

    (gather's root-only failure is tests/hostile/test_role_errors.py's subject.)
    """
    buf = np.zeros(world_size + 1)
    outs = [buf[i : i + 2] for i in range(world_size)]  # neighbours share one element
    with pytest.raises(ValueError, match=re.escape(f"{fn}: ") + r".*\[0\] and .*\[1\] overlap in memory"):
        if fn == "all_gather":
            dist.all_gather(outs, np.ones(2))
        else:
            dist.all_to_all(outs, [np.ones(2) for _ in range(world_size)])
    assert np.all(buf == 0), "nothing may be written when the outputs are refused"
    y = np.ones(1)
    dist.all_reduce(y)
    assert_equal(y, np.array([float(world_size)]))


@pytest.mark.parametrize("fn", ["all_gather", "gather", "all_to_all"])
def test_list_outputs_that_are_disjoint_views_of_one_buffer(fn, rank, world_size):
    """Disjoint views of one buffer, in reverse order: written in place, each with its own rank's block."""
    buf = np.full(2 * world_size, -1.0)
    outs = [buf[2 * (world_size - 1 - i) : 2 * (world_size - i)] for i in range(world_size)]
    if fn == "all_gather":
        dist.all_gather(outs, np.array([rank, 10.0 * rank]))
        expected = [np.array([r, 10.0 * r]) for r in range(world_size)]
    elif fn == "gather":
        dist.gather(np.array([rank, 10.0 * rank]), outs if rank == 0 else None, dst=0)
        expected = (
            [np.array([r, 10.0 * r]) for r in range(world_size)] if rank == 0 else [np.full(2, -1.0)] * world_size
        )
    else:
        dist.all_to_all(outs, [np.array([rank, 100.0 * j]) for j in range(world_size)])
        expected = [np.array([r, 100.0 * rank]) for r in range(world_size)]
    for i in range(world_size):
        assert_equal(outs[i], expected[i])


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.int64)], ids=["float32", "bf16", "int64"])
def test_larger_arrays(dtype, make, rank, world_size):
    """2**16 elements: several MPI segments and pipeline stages."""
    m = 1 << 16
    base = (np.arange(m) % 7).astype(dtype)
    x = make(base + np.asarray(rank, dtype))
    dist.all_reduce(x)
    expected = (np.arange(m) % 7 * world_size + world_size * (world_size - 1) // 2).astype(dtype)
    assert_equal(x, expected)
    out = make.empty((world_size * m,), dtype)
    dist.all_gather_into_tensor(out, make(base + np.asarray(rank, dtype)))
    assert_equal(out, np.concatenate([base + np.asarray(r, dtype) for r in range(world_size)]))
    a2a_out = make.empty((world_size * m,), dtype)
    dist.all_to_all_single(a2a_out, out)  # every rank sends block j (rank j's data) to rank j
    assert_equal(a2a_out, np.concatenate([base + np.asarray(rank, dtype)] * world_size))


# ---------------------------------------------------------------------------------------
# float16 / bfloat16 rounding
# ---------------------------------------------------------------------------------------


def test_float16_sum_rounds_to_nearest_even(make, rank, world_size):
    """float16 sums whose exact value is not representable.

    Only rank 0 contributes the large values and only the last rank the small
    ones (everyone else adds zeros), so every order of the pairwise additions,
    and rounding once or after each step, gives the same float16 result.
    """
    big = np.array([2048.0, 2048.0, 1.0, 1024.0], np.float16)  # ulp(2048) = 2, ulp(1) = 2**-10
    small = np.array([1.0, 3.0, 2.0**-11, 0.25], np.float16)
    x = np.zeros(4, np.float16)
    if rank == 0:
        x += big
    if rank == world_size - 1:
        x += small  # at size 1 the addition happens here, in float16, rounded once
    x = make(x)
    dist.all_reduce(x)
    # 2049 -> 2048 (tie to even), 2051 -> 2052, 1 + 2**-11 -> 1 (tie to even), 1024.25 -> 1024
    expected = (big.astype(np.float64) + small.astype(np.float64)).astype(np.float16)
    assert_equal(x, expected)
    if world_size > 1:
        assert_equal(expected, np.array([2048.0, 2052.0, 1.0, 1024.0], np.float16))


def _bf16_step_sums(values: list[float]) -> set[float]:
    """Every result of summing ``values`` two at a time in any order and grouping, each sum rounded to bfloat16."""
    if len(values) == 1:
        return {values[0]}
    out: set[float] = set()
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            rest = [v for k, v in enumerate(values) if k not in (i, j)]
            pair = float(np.array(values[i] + values[j], np.float32).astype(BF16))
            out |= _bf16_step_sums(rest + [pair])
    return out


def test_bfloat16_sum_rounds_once(make, rank, world_size):
    """bfloat16 sums: with mpidist's C ops (backends/halfops.py) each combine is rounded to bfloat16, as gloo
    and NCCL do; without them mpidist reduces in float32 and rounds once when MPI has no native bfloat16.

    Rank 0 holds 256 and every other rank 1 (ulp(256) = 2 in bfloat16): summing
    in bfloat16 step by step loses a 1 added to 256 alone (256 + 1 -> 256), so the
    result depends on the order MPI combines in (256 or 258 for n = 3; 256, 258 or 260
    for n = 4); rounding once gives bfloat16(256 + n - 1): 256, 256, 258, 260 for
    n = 1, 2, 3, 4. Both agree for n <= 2.
    """
    entry = type_table()[BF16]
    native = entry.wide is None
    x = make(np.array([256.0 if rank == 0 else 1.0, 1.0, 0.5], BF16))
    dist.all_reduce(x)
    n = world_size
    exact = np.array([256.0 + (n - 1), float(n), 0.5 * n])
    expected = exact.astype(np.float32).astype(BF16)
    if entry.half is not None:  # each combine rounded: one of the orders' results
        assert_equal(x[1:], expected[1:])
        orders = _bf16_step_sums([256.0] + [1.0] * (n - 1))
        assert float(to_numpy(x)[0]) in orders, (to_numpy(x), orders)
        if n <= 2:
            assert_equal(x, expected)
    elif native:  # pragma: no cover - this MPI reduces bfloat16 itself: only the order-free values
        assert_equal(x[1:], expected[1:])
    else:
        assert_equal(x, expected)
    assert_identical_on_all_ranks(x)
    spelled_out = {1: 256.0, 2: 256.0, 3: 258.0, 4: 260.0}
    if n in spelled_out:
        assert float(expected[0]) == spelled_out[n]


def test_bfloat16_avg_and_premul_round_once(make, rank, world_size):
    """AVG divides the sum (with mpidist's C ops a sum rounded at each combine, then rounded again by the
    division); PREMUL_SUM keeps the float32 copy where MPI cannot reduce bfloat16: rounded once."""
    n = world_size
    x = make(np.array([1.0, 3.0, 100.0], BF16) + rank)
    dist.all_reduce(x, op=R.AVG)
    exact = np.array([1.0, 3.0, 100.0]) + (n - 1) / 2
    if type_table()[BF16].half is not None:
        sums = [_bf16_step_sums([v + r for r in range(n)]) for v in (1.0, 3.0, 100.0)]
        got = to_numpy(x)
        for k, possible in enumerate(sums):
            averages = {float(np.array(np.float32(s) / np.float32(n)).astype(BF16)) for s in possible}
            assert float(got[k]) in averages, (got, k, averages)
        if n <= 2:
            assert_equal(x, exact.astype(BF16))
        assert_identical_on_all_ranks(x)
    else:
        assert_equal(x, exact.astype(BF16))
    y = make(np.array([1.0, 3.0, 100.0], BF16) + rank)
    dist.all_reduce(y, op=dist.make_premul_sum(0.5))
    exact = (np.array([1.0, 3.0, 100.0]) * n + n * (n - 1) / 2) * 0.5
    assert_equal(y, exact.astype(BF16))


@pytest.mark.skipif(MPI.Get_version() >= (4, 0), reason="an MPI-4 library takes 64-bit counts (tests/api/test_large.py)")
def test_count_limit_of_an_mpi3_library_is_named(rank, world_size):
    """An MPI-3 library (Open MPI 5) refuses a message of 2**31 elements with MPI_ERR_ARG: every rank raises a
    DistBackendError that says why, and the group stays usable (nothing was posted).

    On a group whose shared-memory path is off: that path (backends/shm.py) moves such an all_reduce in
    chunks, with no count limit, and would write all 2 GiB of the array.
    """
    from mpidist.backends import shm_tuning
    from mpidist.bench.tune import group_under

    g = group_under(dist, {shm_tuning.ENV_SWITCH: "0"})
    x = np.zeros(2**31 + 8, np.int8)  # the untouched pages of a fresh zeroed array cost no memory
    note = r"implements MPI 3\.\d, whose calls take counts below 2\*\*31: a message of 2\*\*31 elements or more"
    problems = []
    calls = (("all_reduce", lambda: dist.all_reduce(x, group=g)), ("broadcast", lambda: dist.broadcast(x, 0, g)))
    for name, call in calls:
        try:
            call()
            problems.append(f"{name} of 2**31 + 8 elements did not raise")
        except dist.DistBackendError as exc:
            if not re.search(note, str(exc)):
                problems.append(f"{name}: {exc}")
    y = np.ones(2)
    dist.all_reduce(y, group=g)
    if y.tolist() != [float(world_size)] * 2:
        problems.append(f"the group after the errors: {y.tolist()}")
    dist.destroy_process_group(g)
    fail_together(problems)
