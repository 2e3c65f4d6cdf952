"""Lightning's distributed utilities (mpidist.utils, mpidist.autograd) against numpy references.

Every rank builds its input from its rank (``helpers.rank_input``), so every rank
can compute what every other rank sent and check the whole result. The array
tests run on numpy arrays and on torch CPU tensors (the ``make`` fixture of
conftest.py) and check that the result is of the kind and dtype given. Collectives
are counted with the group's sequence number (``mpidist.testing.calls_issued(pg)``, which every
collective on the group advances by one), so the tests also pin down how many
rounds each utility costs. Tests that need the default group gone use
``no_group``; the harness re-creates the session's group afterwards.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
import mpidist.utils as utils
from mpidist.reduce_op import OP_TABLE
from mpidist.testing import calls_issued

from helpers import (
    ALL_DTYPES,
    BF16,
    HOST_KINDS,
    assert_equal,
    check_raises,
    fail_together,
    kind,
    kind_of,
    rank_input,
    reference,
    require_kind,
    reverse_axes,
    to_kind,
    to_numpy,
)


@pytest.fixture(params=HOST_KINDS)
def array_kind(request) -> str:
    """The utilities take host arrays (numpy, CPU tensors); device arrays are refused (tested below)."""
    require_kind(request.param)
    return request.param


def test_utilities_refuse_device_arrays():
    from mpidist.testing import HostCudaArray

    x = HostCudaArray(np.ones(2))
    problems = []
    for name, call in (
        ("all_gather_ddp_if_available", lambda: dist.all_gather_ddp_if_available(x)),
        ("gather_all_tensors", lambda: dist.gather_all_tensors(x)),
        ("sync_ddp", lambda: dist.sync_ddp(x)),
    ):
        problems += check_raises(TypeError, rf"^{name}: \w+ is a device array; {name} takes host arrays", call)
    fail_together(problems)


pytestmark = pytest.mark.timeout(120)

PG_TIMEOUT_S = float(os.environ.get("MPIDIST_TEST_PG_TIMEOUT", "90"))
RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
LAST = SIZE - 1
EVEN = list(range(0, SIZE, 2))
R = dist.ReduceOp

#: what ``tensor must be an array (...)`` errors say about the kinds mpidist takes
ARRAY_KINDS_RE = r"must be an array \(numpy\.ndarray, torch\.Tensor.*\), got"


@pytest.fixture
def master_env(monkeypatch):
    """MASTER_ADDR/MASTER_PORT as they were before the test, restored afterwards."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)


@pytest.fixture
def torch():
    """The torch module (the test is skipped without torch)."""
    require_kind("torch")
    import torch

    return torch


def seq(group=None) -> int:
    """Collectives issued so far on ``group`` (default: the world)."""
    pg = dist.group.WORLD if group is None else group
    return calls_issued(pg)


def even_group():
    """A group of the even global ranks (every rank calls new_group)."""
    return dist.new_group(EVEN)


def collect(problems: list[str], what: str, fn, *args) -> None:
    """Run a check, turning an AssertionError (or any other exception) into a recorded problem."""
    try:
        fn(*args)
    except AssertionError as exc:
        problems.append(f"{what}: {exc}")
    except Exception as exc:  # noqa: BLE001 - recorded, reported by fail_together
        problems.append(f"{what}: raised {type(exc).__name__}: {exc}")


def attempt(problems: list[str], what: str, fn, *args, **kwargs) -> Any:
    """Call ``fn`` and return its result; on an exception record it and return None.

    Every rank then still reaches ``fail_together``: an exception raised on one rank
    only (a wrong slice index in a backward pass, say) must not leave the other ranks
    waiting there for it.
    """
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - recorded, reported by fail_together
        problems.append(f"{what}: raised {type(exc).__name__}: {exc}")
        return None


def expect(problems: list[str], what: str, got, expected) -> None:
    """Record a problem unless ``got == expected`` (checks between collectives must not raise)."""
    if not (got == expected):
        problems.append(f"{what}: got {got!r}, expected {expected!r}")


def expect_kind(problems: list[str], what: str, got: Any, like: Any, dtype: Any = None) -> None:
    """Record a problem unless ``got`` is an array of ``like``'s kind with ``like``'s dtype (or ``dtype``)."""
    try:
        got_kind, like_kind = kind_of(got).name, kind_of(like).name
    except TypeError as exc:
        problems.append(f"{what}: {exc}")
        return
    want = like.dtype if dtype is None else dtype
    if (got_kind, got.dtype) != (like_kind, want):
        problems.append(f"{what}: got a {got_kind} array of {got.dtype}, expected a {like_kind} array of {want}")


def shares_memory(a: Any, b: Any) -> bool:
    """Whether two arrays of the same kind use overlapping memory."""
    if isinstance(a, np.ndarray):
        return np.shares_memory(a, b)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def is_c_contiguous(x: Any) -> bool:
    return x.flags.c_contiguous if isinstance(x, np.ndarray) else x.is_contiguous()


# -- distributed_available ----------------------------------------------------------------


def test_distributed_available_follows_the_default_group(no_group):
    seen = [dist.distributed_available()]
    dist.init_process_group(timeout=PG_TIMEOUT_S)
    seen.append(dist.distributed_available())
    dist.destroy_process_group()
    seen.append(dist.distributed_available())
    assert seen == [False, True, False]


# -- all_gather_ddp_if_available -------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4)], ids=["2x3", "scalar", "empty"])
def test_all_gather_ddp_stacks_every_rank(shape, make):
    problems: list[str] = []
    for dtype in ALL_DTYPES:
        x = make.input(RANK, shape, dtype)
        before = seq()
        out = dist.all_gather_ddp_if_available(x)
        expected = np.stack([rank_input(r, shape, dtype) for r in range(SIZE)])
        expect_kind(problems, f"{dtype.name}{shape}", out, x)
        collect(problems, f"{dtype.name}{shape}", assert_equal, out, expected)
        if seq() - before != 1:
            problems.append(f"{dtype.name}{shape}: {seq() - before} collectives instead of 1")
        if shares_memory(out, x):
            problems.append(f"{dtype.name}{shape}: the result shares memory with the input")
    fail_together(problems)


def test_all_gather_ddp_non_contiguous_input(make):
    base = make(np.arange(24, dtype=np.int32).reshape(4, 6) + 100 * RANK)
    x = reverse_axes(base[:, ::2])  # (3, 4), non-contiguous
    out = dist.all_gather_ddp_if_available(x)
    expected = np.stack([(np.arange(24, dtype=np.int32).reshape(4, 6) + 100 * r)[:, ::2].T for r in range(SIZE)])
    problems: list[str] = []
    expect(problems, "the input is non-contiguous", is_c_contiguous(x), False)
    expect(problems, "the result is C-contiguous", is_c_contiguous(out), True)
    collect(problems, "values", assert_equal, out, expected)
    fail_together(problems)


def test_all_gather_ddp_on_a_subgroup(make):
    g = even_group()
    x = make(np.arange(3, dtype=np.int64) + 10 * RANK)
    out = dist.all_gather_ddp_if_available(x, group=g)
    if RANK % 2:
        assert out is None
    else:
        assert kind_of(out) is kind_of(x)
        assert_equal(out, np.stack([np.arange(3, dtype=np.int64) + 10 * m for m in EVEN]))


def test_all_gather_ddp_without_a_group_is_a_world_of_one(no_group, make):
    problems: list[str] = []
    for dtype in (np.dtype(np.float32), BF16, np.dtype(np.int16)):
        x = make.input(RANK, (2, 3), dtype)
        out = dist.all_gather_ddp_if_available(x)
        expect_kind(problems, dtype.name, out, x)
        collect(problems, dtype.name, assert_equal, out, rank_input(RANK, (2, 3), dtype)[None])
        expect(problems, f"{dtype.name}: a copy", shares_memory(out, x), False)
    scalar = dist.all_gather_ddp_if_available(make(np.array(5, np.int16)))
    collect(problems, "scalar", assert_equal, scalar, np.array([5], np.int16))
    fail_together(problems)


@pytest.mark.parametrize("initialized", [True, False])
def test_all_gather_ddp_bad_arguments(initialized, no_group, make):
    if initialized:
        dist.init_process_group(timeout=PG_TIMEOUT_S)
        before = seq()
    fn = dist.all_gather_ddp_if_available
    x = make(np.ones(3))
    problems = check_raises(
        TypeError, r"^all_gather_ddp_if_available: sync_grads must be a bool, got str", fn, x, sync_grads="no"
    )
    problems += check_raises(
        TypeError, rf"^all_gather_ddp_if_available: tensor {ARRAY_KINDS_RE} builtins.list", fn, [1.0]
    )
    problems += check_raises(TypeError, r"^all_gather_ddp_if_available: tensor has dtype object", fn, np.array([None]))
    if make.name == "numpy":
        problems += check_raises(
            TypeError,
            r"^all_gather_ddp_if_available: sync_grads=True .*needs a torch.Tensor; got a numpy.ndarray, which "
            r"carries no gradients: pass sync_grads=False",
            fn,
            x,
            sync_grads=True,
        )
    if initialized:
        problems += check_raises(
            TypeError, r"^all_gather_ddp_if_available: group must be a ProcessGroup", fn, x, group="world"
        )
        if seq() != before:
            problems.append(f"bad arguments issued {seq() - before} collectives")
    fail_together(problems)


def test_utilities_reject_tensors_mpidist_cannot_send(torch):
    """Tensor errors come from mpidist.arrays.host and name the utility and its argument; nothing is sent."""
    before = seq()
    calls = [
        ("all_gather_ddp_if_available", "tensor", dist.all_gather_ddp_if_available),
        ("gather_all_tensors", "result", dist.gather_all_tensors),
        ("sync_ddp", "result", dist.sync_ddp),
        ("sync_ddp_if_available", "result", dist.sync_ddp_if_available),
    ]
    conj = torch.tensor([1 + 2j, 3 - 1j]).conj()
    sparse = torch.eye(2).to_sparse()
    problems: list[str] = []
    for name, arg, fn in calls:
        problems += check_raises(
            TypeError, rf"^{name}: {arg} has dtype torch.float8_e5m2", fn, torch.zeros(2, dtype=torch.float8_e5m2)
        )
        problems += check_raises(TypeError, rf"^{name}: {arg} is a lazily conjugated", fn, conj)
        problems += check_raises(TypeError, rf"^{name}: {arg} is a torch.sparse_coo tensor", fn, sparse)
    if seq() != before:
        problems.append(f"bad arguments issued {seq() - before} collectives")
    fail_together(problems)


# -- gather_all_tensors ------------------------------------------------------------------------


def shape_with_zeros(r: int) -> tuple[int, ...]:
    """Differs from rank to rank in every dimension; rank 0 (and 3) has a zero-size dimension."""
    return (r + 1, (2 * r) % 3, 4 - r % 3)


def shape_without_zeros(r: int) -> tuple[int, ...]:
    return (3 - r % 3, r + 1, 1 + r % 2)


@pytest.mark.parametrize("shape_of", [shape_with_zeros, shape_without_zeros], ids=["with-zeros", "no-zeros"])
def test_gather_all_tensors_shapes_differ_in_every_dimension(shape_of, make):
    problems: list[str] = []
    shapes = [shape_of(r) for r in range(SIZE)]
    any_data = np.prod(np.max(shapes, axis=0)) > 0
    for dtype in ALL_DTYPES:
        x = make.input(RANK, shapes[RANK], dtype, salt=2)
        before = seq()
        got = dist.gather_all_tensors(x)
        rounds = seq() - before
        if rounds != 1 + any_data:  # the shapes, then the data (skipped when every array is empty)
            problems.append(f"{dtype.name}: {rounds} collectives instead of {1 + any_data}")
        if not isinstance(got, list) or len(got) != SIZE:
            problems.append(f"{dtype.name}: expected a list of {SIZE} arrays, got {got!r}")
            continue
        for r in range(SIZE):
            expect_kind(problems, f"{dtype.name} rank {r}", got[r], x)
            collect(problems, f"{dtype.name} rank {r}", assert_equal, got[r], rank_input(r, shapes[r], dtype, salt=2))
            if not is_c_contiguous(got[r]):
                problems.append(f"{dtype.name} rank {r}: not C-contiguous")
    fail_together(problems)


def test_gather_all_tensors_uses_one_shapes_round_and_one_data_round(monkeypatch, make):
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = utils.all_gather_into_tensor

    def counting(out, inp, group=None, async_op=False):
        calls.append((tuple(out.shape), tuple(inp.shape)))
        return real(out, inp, group=group, async_op=async_op)

    monkeypatch.setattr(utils, "all_gather_into_tensor", counting)
    got = dist.gather_all_tensors(make(np.full((RANK + 1, 2), RANK, np.int32)))
    assert [a.tolist() for a in got] == [[[r, r]] * (r + 1) for r in range(SIZE)]
    assert calls == [((SIZE, utils._HEADER), (utils._HEADER,)), ((SIZE, SIZE, 2), (SIZE, 2))]


def test_gather_all_tensors_scalars_and_equal_shapes(make):
    problems: list[str] = []
    got = dist.gather_all_tensors(make(np.array(RANK * 1.5)))
    for r in range(SIZE):
        collect(problems, f"scalar of rank {r}", assert_equal, got[r], np.array(r * 1.5))
    x = make.input(RANK, (3, 2), np.complex128)
    got = dist.gather_all_tensors(x)
    for r in range(SIZE):
        expect_kind(problems, f"rank {r}", got[r], x)
        collect(problems, f"rank {r}", assert_equal, got[r], rank_input(r, (3, 2), np.dtype(np.complex128)))
    fail_together(problems)


def test_gather_all_tensors_one_dimensional_and_non_contiguous(make):
    def values(r: int) -> np.ndarray:
        return np.arange(40, dtype=np.float64).reshape(4, 10) + 100 * r

    x = reverse_axes(make(values(RANK))[:, : RANK + 2 : 2])  # non-contiguous, shape differs per rank
    got = dist.gather_all_tensors(x)
    problems: list[str] = []
    for r in range(SIZE):
        collect(problems, f"rank {r}", assert_equal, got[r], np.ascontiguousarray(values(r)[:, : r + 2 : 2].T))
    if make.name == "numpy":  # negative strides (torch has none)
        y = values(RANK)[:, : RANK + 2 : 2][:, ::-1].T
        got = dist.gather_all_tensors(y)
        for r in range(SIZE):
            collect(
                problems,
                f"reversed, rank {r}",
                assert_equal,
                got[r],
                np.ascontiguousarray(values(r)[:, : r + 2 : 2][:, ::-1].T),
            )
    lengths = dist.gather_all_tensors(make(np.arange(RANK, dtype=np.uint8)))  # rank 0 sends nothing
    problems += [f"1-D rank {r}" for r in range(SIZE) if lengths[r].tolist() != list(range(r))]
    fail_together(problems)


def test_gather_all_tensors_on_a_subgroup(make):
    g = even_group()
    got = dist.gather_all_tensors(make(np.full(RANK + 1, RANK, np.int64)), group=g)
    if RANK % 2:
        assert got is None
    else:
        assert [a.tolist() for a in got] == [[m] * (m + 1) for m in EVEN]


@pytest.mark.mpi(min_size=2)
def test_gather_all_tensors_ndim_mismatch_raises_on_every_rank(make):
    x = make(np.zeros(3) if RANK == LAST else np.zeros((1, 3)))
    before = seq()
    problems = check_raises(
        ValueError,
        r"^gather_all_tensors: every rank's result must have the same number of dimensions; got rank 0: 2, ",
        dist.gather_all_tensors,
        x,
    )
    if seq() - before != 1:
        problems.append(f"{seq() - before} collectives instead of 1 (the shapes round only)")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_gather_all_tensors_dtype_mismatch_raises_on_every_rank(make):
    x = make(np.zeros(3, BF16 if RANK == LAST else np.float32))
    before = seq()
    problems = check_raises(
        TypeError,
        rf"^gather_all_tensors: every rank's result must have the same dtype; got rank 0: float32, .*rank {LAST}: bfloat16",
        dist.gather_all_tensors,
        x,
    )
    if seq() - before != 1:
        problems.append(f"{seq() - before} collectives instead of 1 (the shapes round only)")
    fail_together(problems)


def test_gather_all_tensors_bad_arguments_raise_before_communicating(make):
    before = seq()
    fn = dist.gather_all_tensors
    problems = check_raises(TypeError, rf"^gather_all_tensors: result {ARRAY_KINDS_RE} builtins.float", fn, 1.0)
    problems += check_raises(TypeError, r"^gather_all_tensors: result has dtype object", fn, np.array([None, 1]))
    problems += check_raises(TypeError, r"^gather_all_tensors: result has dtype str", fn, np.array(["a"]))
    problems += check_raises(
        TypeError, r"^gather_all_tensors: group must be a ProcessGroup", fn, make(np.ones(2)), group=3
    )
    if seq() != before:
        problems.append(f"bad arguments issued {seq() - before} collectives")
    fail_together(problems)


def test_gather_all_tensors_needs_a_group(no_group, make):
    fail_together(
        check_raises(
            RuntimeError,
            r"^gather_all_tensors: the default process group is not initialized",
            dist.gather_all_tensors,
            make(np.ones(2)),
        )
    )


# -- sync_ddp --------------------------------------------------------------------------------


def averaged(total: np.ndarray, n: int) -> np.ndarray:
    """``total / n`` in ``total``'s dtype, each component of a complex number divided on its own."""
    out = total.copy()
    if out.dtype.kind == "c":
        out.real = total.real / out.real.dtype.type(n)
        out.imag = total.imag / out.real.dtype.type(n)
    else:
        out[...] = total / n
    return out


def expected_reduction(inputs: list[np.ndarray], op) -> np.ndarray:
    """helpers.reference, except complex AVG divides each component (numpy's complex division rounds differently)."""
    if op == R.AVG and inputs[0].dtype.kind == "c":
        return averaged(reference(inputs, R.SUM), len(inputs))
    return reference(inputs, op)


#: every way to name a reduction: (reduce_op argument, the ReduceOp it means)
NAMED_OPS = [
    (None, R.SUM), ("sum", R.SUM), ("SUM", R.SUM), (R.SUM, R.SUM),
    ("max", R.MAX), ("Max", R.MAX), (R.MAX, R.MAX), ("min", R.MIN), (R.MIN, R.MIN),
    ("product", R.PRODUCT), (R.PRODUCT, R.PRODUCT),
    ("band", R.BAND), ("bor", R.BOR), ("BXOR", R.BXOR), (R.BXOR, R.BXOR), (R.AVG, R.AVG),
]  # fmt: skip


@pytest.mark.parametrize("reduce_op,op", NAMED_OPS, ids=[repr(a) for a, _ in NAMED_OPS])
def test_sync_ddp_every_named_op_every_dtype(reduce_op, op, make):
    problems: list[str] = []
    for dtype in ALL_DTYPES:
        k = kind(dtype)
        x = make.input(RANK, (2, 3), dtype)
        if OP_TABLE[k][op] is None:
            problems += check_raises(
                ValueError,
                rf"^sync_ddp: ReduceOp.{op.name} is not defined for {dtype.name}",
                dist.sync_ddp,
                x,
                reduce_op=reduce_op,
            )
            continue
        before = seq()
        out = dist.sync_ddp(x, reduce_op=reduce_op)
        if out is not x:
            problems.append(f"{dtype.name}: sync_ddp did not return its (in-place reduced) input")
        expected = expected_reduction([rank_input(r, (2, 3), dtype) for r in range(SIZE)], op)
        collect(problems, dtype.name, assert_equal, x, expected)
        if seq() - before != 1:
            problems.append(f"{dtype.name}: {seq() - before} collectives instead of 1")
    fail_together(problems)


def test_sync_ddp_premul_sum(make):
    x = make.input(RANK, (4,), np.float64)
    out = dist.sync_ddp(x, reduce_op=dist.make_premul_sum(2.0))
    assert out is x
    assert_equal(x, 2.0 * sum(rank_input(r, (4,), np.dtype(np.float64)) for r in range(SIZE)))


def test_sync_ddp_non_contiguous_tensor_is_reduced_in_place(make):
    base = make(np.zeros((3, 4), np.float32) + RANK + 1)
    x = reverse_axes(base[:, ::2])
    out = dist.sync_ddp(x, reduce_op="mean")
    problems: list[str] = []
    expect(problems, "returns its input", out is x, True)
    expected = np.full((3, 4), 1.0 + RANK, np.float32)
    expected[:, ::2] = (SIZE + 1) / 2
    collect(problems, "the base holds the mean in the viewed elements only", assert_equal, base, expected)
    fail_together(problems)


@pytest.mark.parametrize("reduce_op", ["avg", "mean", "AVG", "Mean"])
def test_sync_ddp_mean(reduce_op, make):
    problems: list[str] = []
    for dtype in ALL_DTYPES:
        k = kind(dtype)
        x = make.input(RANK, (2, 3), dtype)
        if k == "b":
            problems += check_raises(
                ValueError,
                r"^sync_ddp: reduce_op='\w+' averages, which is not defined for bool",
                dist.sync_ddp,
                x,
                reduce_op=reduce_op,
            )
            continue
        before = seq()
        out = dist.sync_ddp(x, reduce_op=reduce_op)
        inputs = [rank_input(r, (2, 3), dtype) for r in range(SIZE)]
        total = reference(inputs, R.SUM)
        exact_mean = sum(a.astype(np.complex128 if k == "c" else np.float64) for a in inputs) / SIZE
        if k in "fc":  # divided in place, in the array's dtype
            if out is not x:
                problems.append(f"{dtype.name}: the mean was not computed in place")
            collect(problems, dtype.name, assert_equal, x, averaged(total, SIZE))
            eps = float(ml_dtypes.finfo(dtype).eps)
            if not np.allclose(to_numpy(x).astype(exact_mean.dtype), exact_mean, rtol=4 * eps, atol=0):
                problems.append(f"{dtype.name}: mean {x} is not close to {exact_mean}")
        else:  # integers: the input keeps the sum, the mean comes back as a new array (true division)
            collect(problems, f"{dtype.name} input", assert_equal, x, total)
            if make.name == "torch":  # Lightning's result / world_size: torch's default float dtype
                import torch

                mean = to_numpy(torch.true_divide(make(total), SIZE))
                expect_kind(problems, f"{dtype.name} mean", out, x, dtype=torch.get_default_dtype())
            else:
                mean = total.astype(np.float64) / SIZE
            collect(problems, f"{dtype.name} mean", assert_equal, out, mean)
            collect(problems, f"{dtype.name} mean is exact", assert_equal, mean, (exact_mean).astype(mean.dtype))
        if seq() - before != 1:
            problems.append(f"{dtype.name}: {seq() - before} collectives instead of 1")
    fail_together(problems)


def test_sync_ddp_numbers():
    problems: list[str] = []
    got = dist.sync_ddp(RANK + 1)
    collect(problems, "int", assert_equal, got, np.array(SIZE * (SIZE + 1) // 2))
    got = dist.sync_ddp(float(RANK + 1), reduce_op="mean")
    collect(problems, "float mean", assert_equal, got, np.array((SIZE + 1) / 2))
    got = dist.sync_ddp(np.float32(RANK), reduce_op="max")
    collect(problems, "float32 max", assert_equal, got, np.array(LAST, np.float32))
    got = dist.sync_ddp(np.int16(RANK + 1), reduce_op="avg")
    collect(problems, "int16 avg", assert_equal, got, np.array((SIZE + 1) / 2))
    fail_together(problems)


def test_sync_ddp_on_a_subgroup_leaves_non_members_alone(make):
    g = even_group()
    problems: list[str] = []
    x = make(np.array([RANK + 1.0, 2.0]))
    out = dist.sync_ddp(x, group=g, reduce_op="mean")
    expect(problems, "float: returns its input", out is x, True)
    mean = sum(m + 1 for m in EVEN) / len(EVEN)
    expect(problems, "float mean", x.tolist(), [RANK + 1.0, 2.0] if RANK % 2 else [mean, 2.0])
    i = make(np.array([RANK + 1], np.int64))
    out = dist.sync_ddp(i, group=g, reduce_op="avg")
    if RANK % 2:
        expect(problems, "int: non-member gets its input back unchanged", (out is i, i.tolist()), (True, [RANK + 1]))
    else:
        expect(problems, "int mean", out.tolist(), [mean])
        expect_kind(problems, "int mean", out, i, dtype=out.dtype if make.name == "torch" else np.float64)
        expect(problems, "int mean is a float", kind(to_numpy(out).dtype), "f")
    fail_together(problems)


def test_sync_ddp_bad_arguments_raise_before_communicating(make):
    before = seq()
    fn = dist.sync_ddp
    x = make(np.ones(3))
    problems = check_raises(
        ValueError,
        r"^sync_ddp: reduce_op='median' is not a reduction; expected None .*'mean'",
        fn,
        x,
        reduce_op="median",
    )
    problems += check_raises(
        ValueError, r"^sync_ddp: reduce_op='premul_sum' is not a reduction", fn, x, reduce_op="premul_sum"
    )
    problems += check_raises(
        TypeError, r"^sync_ddp: reduce_op must be None, a ReduceOp .* got builtins.int", fn, x, reduce_op=0
    )
    problems += check_raises(
        ValueError, r"^sync_ddp: ReduceOp.BAND is not defined for float64", fn, x, reduce_op="band"
    )
    problems += check_raises(
        ValueError,
        r"^sync_ddp: ReduceOp.MAX is not defined for complex64",
        fn,
        make(np.ones(3, np.complex64)),
        reduce_op="max",
    )
    cast = r"result\.astype\(numpy\.int64\)" if make.name == "numpy" else r"result\.long\(\)"
    problems += check_raises(
        ValueError,
        rf"^sync_ddp: reduce_op='mean' averages, which is not defined for bool arrays; .*e\.g\. {cast}$",
        fn,
        make(np.ones(3, bool)),
        reduce_op="mean",
    )
    problems += check_raises(ValueError, r"^sync_ddp: ReduceOp.UNUSED is not a reduction", fn, x, reduce_op=R.UNUSED)
    problems += check_raises(TypeError, rf"^sync_ddp: result {ARRAY_KINDS_RE} builtins.list", fn, [1.0])
    problems += check_raises(TypeError, r"^sync_ddp: result has dtype object", fn, np.array([None]))
    problems += check_raises(TypeError, r"^sync_ddp: group must be a ProcessGroup", fn, x, group="world")
    problems += check_raises(
        TypeError, r"^sync_ddp_if_available: reduce_op must be None", dist.sync_ddp_if_available, x, reduce_op=1.5
    )
    if seq() != before:
        problems.append(f"bad arguments issued {seq() - before} collectives")
    if x.tolist() != [1.0, 1.0, 1.0]:
        problems.append(f"a failed call changed its input: {x}")
    fail_together(problems)


def test_sync_ddp_if_available_reduces_when_initialized(make):
    problems: list[str] = []
    x = make(np.array([RANK, 1], np.int32))
    before = seq()
    out = dist.sync_ddp_if_available(x, reduce_op="sum")
    expect(problems, "sum", (out is x, x.tolist(), seq() - before), (True, [SIZE * (SIZE - 1) // 2, SIZE], 1))
    y = make(np.array([RANK + 1.0]))
    out = dist.sync_ddp_if_available(y, reduce_op="mean")
    expect(problems, "mean", (out is y, y.tolist()), (True, [(SIZE + 1) / 2]))
    fail_together(problems)


def test_sync_ddp_if_available_without_a_group_returns_the_input(no_group, make):
    problems: list[str] = []
    x = make(np.array([RANK, 1.0]))
    expect(problems, "sum", dist.sync_ddp_if_available(x) is x, True)
    expect(problems, "mean", dist.sync_ddp_if_available(x, reduce_op="mean") is x, True)
    expect(problems, "values", x.tolist(), [RANK, 1.0])
    expect(problems, "a number", dist.sync_ddp_if_available(3), 3)
    problems += check_raises(
        ValueError, r"^sync_ddp_if_available: reduce_op='bogus'", dist.sync_ddp_if_available, x, reduce_op="bogus"
    )
    problems += check_raises(RuntimeError, r"^sync_ddp: the default process group is not initialized", dist.sync_ddp, x)
    fail_together(problems)


# -- gradients through the gather: AllGatherGrad ---------------------------------------------------
#
# The backward pass is a collective, and an exception in it may hit one rank only (a wrong
# slice index, say), so these tests run forward and backward through ``attempt`` and check
# afterwards: every rank reaches ``fail_together`` whatever happened.


def weights(q: int, n: int, shape: tuple[int, ...]) -> np.ndarray:
    """Global rank ``q``'s weights for the ``n`` rows of a gathered tensor: small integers, rank-dependent."""
    j = np.arange(int(np.prod(shape))).reshape(shape)
    return np.stack([((q + 1) * (i + 2) + j) % 7 + 1 for i in range(n)]).astype(np.float64)


def backward(loss_of, gathered) -> bool:
    """Backpropagate ``loss_of(gathered)``; False (nothing done) when the gather failed."""
    if gathered is None:
        return False
    loss_of(gathered).backward()
    return True


GRAD_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), BF16]


@pytest.mark.parametrize("grouping", ["world", "even"])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=[d.name for d in GRAD_DTYPES])
def test_all_gather_grad_sums_every_ranks_gradient(torch, dtype, grouping):
    """d/dx_r of sum_q (gathered_q * W_q).sum() is the sum over the members q of W_q[group rank of r]."""
    g = even_group() if grouping == "even" else None
    members = EVEN if grouping == "even" else list(range(SIZE))
    shape = (3, 2)
    x = to_kind(rank_input(RANK, shape, dtype), "torch").clone().requires_grad_()
    problems: list[str] = []
    if RANK not in members:  # no communication, no graph
        out = attempt(problems, "non-member", dist.all_gather_ddp_if_available, x, group=g, sync_grads=True)
        expect(problems, "non-member result", out, None)
        fail_together(problems)
        return
    n, me = len(members), members.index(RANK)
    pg = g if g is not None else dist.group.WORLD
    w = to_kind(weights(RANK, n, shape).astype(dtype), "torch")
    start = seq(pg)
    gathered = attempt(problems, "forward", dist.all_gather_ddp_if_available, x, group=g, sync_grads=True)
    forward_rounds = seq(pg) - start
    attempt(problems, "backward", backward, lambda t: (t * w).sum(), gathered)
    backward_rounds = seq(pg) - start - forward_rounds
    expect(problems, "collectives (forward all-gather, backward all-reduce)", (forward_rounds, backward_rounds), (1, 1))
    if gathered is not None:
        expect_kind(problems, "gathered", gathered, x)
        expect(problems, "gathered has a grad_fn", gathered.grad_fn is not None, True)
        collect(problems, "gathered", assert_equal, gathered, np.stack([rank_input(m, shape, dtype) for m in members]))
        expected = sum(weights(q, n, shape) for q in members)[me].astype(dtype)
        collect(problems, "x.grad", assert_equal, x.grad, expected)
        if x.grad is not None:
            expect_kind(problems, "x.grad", x.grad, x)
    fail_together(problems)


def test_all_gather_grad_through_nonlinear_use_of_a_non_contiguous_view(torch):
    """loss_q = (q + 1) * sum(gathered ** 2): d/dx_r of the sum of every loss is 2 x_r * sum_q (q + 1)."""
    values = rank_input(RANK, (2, 3), np.dtype(np.float64))
    base = to_kind(values, "torch").clone().requires_grad_()
    x = base.T  # (3, 2), non-contiguous
    problems: list[str] = []
    gathered = attempt(problems, "forward", dist.all_gather_ddp_if_available, x, sync_grads=True)
    attempt(problems, "backward", backward, lambda t: (t**2).sum() * (RANK + 1), gathered)
    expect(problems, "x is non-contiguous", x.is_contiguous(), False)
    expected = np.stack([rank_input(r, (2, 3), np.dtype(np.float64)).T for r in range(SIZE)])
    collect(problems, "gathered", assert_equal, gathered, expected)
    collect(problems, "base.grad", assert_equal, base.grad, 2 * values * sum(q + 1 for q in range(SIZE)))
    fail_together(problems)


def test_all_gather_grad_expanded_upstream_gradient_and_local_use(torch):
    """An expanded (stride-0) upstream gradient, a local use adding its own, a caller's gradient left alone."""
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_()
    y = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_()
    problems: list[str] = []
    gathered = attempt(problems, "forward", dist.all_gather_ddp_if_available, x, sync_grads=True)
    attempt(problems, "backward", backward, lambda t: t.sum(), gathered)
    gathered = attempt(problems, "forward, y", dist.all_gather_ddp_if_available, y, sync_grads=True)
    attempt(problems, "backward, y", backward, lambda t: t.sum() + (y * 3).sum(), gathered)
    # an upstream gradient the caller holds: summed across the ranks, but left as the caller passed it
    z = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    upstream = torch.full((SIZE, 3), RANK + 1.0, dtype=torch.float64)
    gathered = attempt(problems, "forward, z", dist.all_gather_ddp_if_available, z, sync_grads=True)
    if gathered is not None:
        attempt(problems, "backward, z", gathered.backward, upstream)
    collect(problems, "x.grad", assert_equal, x.grad, np.full((2, 3), SIZE, np.float32))
    collect(problems, "y.grad", assert_equal, y.grad, np.full((2, 3), SIZE + 3, np.float32))
    collect(problems, "z.grad", assert_equal, z.grad, np.full(3, SIZE * (SIZE + 1) / 2))
    collect(problems, "the caller's upstream gradient", assert_equal, upstream, np.full((SIZE, 3), RANK + 1.0))
    collect(problems, "x is unchanged", assert_equal, x, values)
    if x.grad is not None:  # this rank's row, not a view keeping the world_size times larger sum alive
        expect(problems, "x.grad's memory", x.grad.untyped_storage().nbytes(), x.numel() * x.element_size())
    fail_together(problems)


def test_all_gather_without_sync_grads_is_detached(torch):
    x = to_kind(rank_input(RANK, (4,), np.dtype(np.float64)), "torch").clone().requires_grad_()
    problems: list[str] = []
    out = attempt(problems, "sync_grads=False", dist.all_gather_ddp_if_available, x, sync_grads=False)
    plain = torch.ones(2)  # sync_grads=True on a tensor without gradients: nothing to record
    out_plain = attempt(problems, "no grad needed", dist.all_gather_ddp_if_available, plain, sync_grads=True)
    expected = np.stack([rank_input(r, (4,), np.dtype(np.float64)) for r in range(SIZE)])
    if out is not None:
        expect(problems, "grad_fn", out.grad_fn, None)
        expect(problems, "requires_grad", out.requires_grad, False)
        collect(problems, "values", assert_equal, out, expected)
    if out_plain is not None:
        expect(problems, "no grad needed: grad_fn", out_plain.grad_fn, None)
        collect(problems, "no grad needed: values", assert_equal, out_plain, np.ones((SIZE, 2), np.float32))
    fail_together(problems)


def test_all_gather_grad_without_a_group_is_a_world_of_one(no_group, torch):
    problems: list[str] = []
    for dtype in GRAD_DTYPES:
        what = dtype.name
        x = to_kind(rank_input(RANK, (3, 2), dtype), "torch").clone().requires_grad_()
        w = to_kind(weights(RANK, 1, (3, 2)).astype(dtype), "torch")
        out = attempt(problems, what, dist.all_gather_ddp_if_available, x, sync_grads=True)
        attempt(problems, f"{what} backward", backward, lambda t, w=w: (t * w).sum(), out)
        detached = attempt(problems, what, dist.all_gather_ddp_if_available, x, sync_grads=False)
        if out is None or detached is None:
            continue
        expect_kind(problems, f"{what} sync_grads=True", out, x)
        expect(problems, f"{what}: a copy", shares_memory(out, x), False)
        expect(problems, f"{what}: grad_fn", out.grad_fn is not None, True)
        collect(problems, f"{what} values", assert_equal, out, rank_input(RANK, (3, 2), dtype)[None])
        collect(problems, f"{what} x.grad", assert_equal, x.grad, weights(RANK, 1, (3, 2))[0].astype(dtype))
        expect_kind(problems, f"{what} sync_grads=False", detached, x)
        expect(problems, f"{what} sync_grads=False: grad_fn", detached.grad_fn, None)
        expect(problems, f"{what} sync_grads=False: a copy", shares_memory(detached, x), False)
        collect(problems, f"{what} sync_grads=False", assert_equal, detached, rank_input(RANK, (3, 2), dtype)[None])
    fail_together(problems)


def test_all_gather_grad_class(torch):
    from mpidist.autograd import AllGatherGrad

    problems: list[str] = []
    expect(problems, "mpidist.utils.AllGatherGrad", utils.AllGatherGrad is AllGatherGrad, True)
    expect(problems, "a torch.autograd.Function", issubclass(AllGatherGrad, torch.autograd.Function), True)
    x = torch.full((2,), 1.0 + RANK, dtype=torch.float64, requires_grad=True)
    gathered = attempt(problems, "apply", AllGatherGrad.apply, x)  # the default group
    attempt(problems, "backward", backward, lambda t: (t * (RANK + 1)).sum(), gathered)
    collect(problems, "gathered", assert_equal, gathered, np.repeat(np.arange(1.0, SIZE + 1), 2).reshape(SIZE, 2))
    collect(problems, "x.grad", assert_equal, x.grad, np.full(2, SIZE * (SIZE + 1) / 2))
    g = even_group()
    if RANK % 2:
        expect(problems, "non-member", attempt(problems, "non-member", AllGatherGrad.apply, x, g), None)
    problems += check_raises(
        TypeError, r"^AllGatherGrad: tensor must be a torch.Tensor, got numpy.ndarray", AllGatherGrad.apply, np.ones(2)
    )
    problems += check_raises(
        TypeError, r"^AllGatherGrad: group must be a ProcessGroup", AllGatherGrad.apply, x, "world"
    )
    problems += check_raises(
        TypeError,
        r"^AllGatherGrad: tensor has dtype torch.float8_e5m2",
        AllGatherGrad.apply,
        torch.zeros(2, dtype=torch.float8_e5m2),
    )
    problems += check_raises(AttributeError, r"has no attribute 'Nothing'", getattr, utils, "Nothing")
    fail_together(problems)


def test_all_gather_grad_is_once_differentiable(torch):
    x = torch.full((3,), 2.0 + RANK, dtype=torch.float64, requires_grad=True)
    problems: list[str] = []
    gathered = attempt(problems, "forward", dist.all_gather_ddp_if_available, x, sync_grads=True)
    if gathered is not None:  # the first derivative, with a graph: a collective on every rank
        grads = attempt(problems, "grad", torch.autograd.grad, (gathered**2).sum(), x, create_graph=True)
        if grads is not None:
            collect(problems, "first derivative", assert_equal, grads[0].detach(), np.full(3, 2 * SIZE * (2.0 + RANK)))
            problems += check_raises(RuntimeError, r"once_differentiable", grads[0].sum().backward)
    fail_together(problems)


def test_all_gather_grad_backward_after_the_group_is_destroyed(torch):
    g = even_group()
    x = torch.ones(2, requires_grad=True)
    problems: list[str] = []
    gathered = attempt(problems, "forward", dist.all_gather_ddp_if_available, x, group=g, sync_grads=True)
    if RANK % 2:
        expect(problems, "non-member", gathered, None)
    elif gathered is not None:
        dist.destroy_process_group(g)
        problems += check_raises(
            RuntimeError, r"^AllGatherGrad.backward: process group .* has been destroyed", gathered.sum().backward
        )
    fail_together(problems)


def test_sync_ddp_and_gather_on_tensors_that_require_grad(torch):
    """Like torch.distributed: the data is reduced or gathered without autograd."""
    x = torch.tensor([RANK + 1.0, 2.0], requires_grad=True)
    problems: list[str] = []
    out = attempt(problems, "sync_ddp", dist.sync_ddp, x, reduce_op="mean")
    parts = attempt(problems, "gather_all_tensors", dist.gather_all_tensors, x) or []
    expect(problems, "sync_ddp returns its input", out is x, True)
    leaf = (x.is_leaf, x.requires_grad, x.grad_fn)
    expect(problems, "x is still a leaf that requires grad", leaf, (True, True, None))
    expect(problems, "mean", x.tolist(), [(SIZE + 1) / 2, 2.0])
    expect(problems, "gathered parts carry no gradients", [p.requires_grad for p in parts], [False] * SIZE)
    expect(problems, "gathered parts", [p.tolist() for p in parts], [[(SIZE + 1) / 2, 2.0]] * SIZE)
    fail_together(problems)


# -- init_dist_connection and MPIEnvironment ---------------------------------------------------


class FakeEnvironment:
    """A cluster environment with fixed answers (Lightning's ClusterEnvironment interface)."""

    def __init__(self, rank: int = RANK, size: int = SIZE, address: str = "10.1.2.3", port: int = 29512) -> None:
        self._rank, self._size, self._address, self._port = rank, size, address, port

    @property
    def main_address(self):
        return self._address

    @property
    def main_port(self):
        return self._port

    def global_rank(self):
        return self._rank

    def world_size(self):
        return self._size


def test_init_dist_connection_with_mpi_environment(no_group, master_env):
    env = dist.MPIEnvironment()
    returned = dist.init_dist_connection(env, "mpi", timeout=PG_TIMEOUT_S)
    master = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    everyone = MPI.COMM_WORLD.allgather(master)
    x = np.array([RANK + 1])
    dist.all_reduce(x)  # the group works
    assert returned is None
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
    assert dist.group.WORLD.timeout == timedelta(seconds=PG_TIMEOUT_S)
    assert master == (env.main_address, str(env.main_port))
    assert all(e == everyone[0] for e in everyone), everyone
    assert x.tolist() == [SIZE * (SIZE + 1) // 2]


def test_init_dist_connection_when_already_initialized_does_nothing_else(master_env):
    pg = dist.group.WORLD
    dist.init_dist_connection(FakeEnvironment(rank=RANK + 100), "gloo")  # neither is checked: no init happens
    assert dist.group.WORLD is pg
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.1.2.3", "29512")  # as Lightning


def test_init_dist_connection_arguments_override_the_environment(no_group, master_env):
    env = FakeEnvironment(rank=RANK + 7, size=SIZE + 3)
    dist.init_dist_connection(env, None, global_rank=RANK, world_size=SIZE, timeout=PG_TIMEOUT_S)
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (RANK, SIZE, "mpi")


def test_init_dist_connection_wrong_rank_on_one_rank_raises_everywhere(no_group, master_env):
    env = FakeEnvironment(rank=SIZE + 3 if RANK == LAST else RANK)
    problems = check_raises(
        ValueError,
        rf"^init_process_group: .*rank={SIZE + 3} but MPI says {LAST}",
        dist.init_dist_connection,
        env,
        "mpi",
        timeout=PG_TIMEOUT_S,
    )
    if dist.is_initialized():
        problems.append("the default group is initialized after the failure")
    fail_together(problems)


def test_init_dist_connection_bad_arguments(no_group, master_env):
    fn = dist.init_dist_connection

    class NoPort:
        main_address = "127.0.0.1"

        def global_rank(self):
            return RANK

        def world_size(self):
            return SIZE

    problems = check_raises(
        TypeError,
        r"^init_dist_connection: cluster_environment must provide .*; NoPort has no main_port",
        fn,
        NoPort(),
        "mpi",
    )
    problems += check_raises(
        TypeError, r"^init_dist_connection: torch_distributed_backend must be a backend name", fn, FakeEnvironment(), 3
    )
    problems += check_raises(
        TypeError, r"^init_dist_connection: global_rank must be an int, got str", fn, FakeEnvironment(rank="0"), "mpi"
    )
    problems += check_raises(
        TypeError,
        r"^init_dist_connection: world_size must be an int, got bool",
        fn,
        FakeEnvironment(),
        "mpi",
        world_size=True,
    )
    problems += check_raises(
        ValueError,
        r"^init_dist_connection: world_size must be a non-negative int, got -1",
        fn,
        FakeEnvironment(size=-1),
        "mpi",
    )
    problems += check_raises(
        TypeError,
        r"^init_dist_connection: cluster_environment.main_address must be a non-empty str",
        fn,
        FakeEnvironment(address=""),
        "mpi",
    )
    problems += check_raises(
        TypeError,
        r"^init_dist_connection: cluster_environment.main_port must be an int, got str",
        fn,
        FakeEnvironment(port="80"),
        "mpi",
    )
    problems += check_raises(
        ValueError,
        r"^init_dist_connection: cluster_environment.main_port must be in 0..65535, got 70000",
        fn,
        FakeEnvironment(port=70000),
        "mpi",
    )
    problems += check_raises(
        ValueError, r"^init_process_group: .*ucc", fn, FakeEnvironment(), "ucc", timeout=PG_TIMEOUT_S
    )
    if dist.is_initialized():
        problems.append("a failed call initialized the default group")
    fail_together(problems)


def test_mpi_environment_describes_the_mpi_world():
    env = dist.MPIEnvironment()
    # the collectives first (the environment's first access to main_address is one), then the checks
    hosts = MPI.COMM_WORLD.allgather(socket.gethostname())
    everyone = MPI.COMM_WORLD.allgather((env.main_address, env.main_port))
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    node_rank = node.Get_rank()
    node.Free()
    unique = sorted(set(hosts))
    assert env.creates_processes_externally is True
    assert (env.global_rank(), env.world_size()) == (RANK, SIZE)
    assert dist.MPIEnvironment.detect() is (SIZE > 1)
    env.set_world_size(SIZE + 5)
    env.set_global_rank(RANK + 5)
    assert (env.global_rank(), env.world_size()) == (RANK, SIZE)
    assert all(e == everyone[0] for e in everyone), everyone
    assert env.main_address == ("127.0.0.1" if len(unique) == 1 else hosts[0])
    assert isinstance(env.main_port, int) and 0 < env.main_port < 65536
    assert env.node_rank() == unique.index(hosts[RANK])
    assert env.local_rank() == hosts[:RANK].count(hosts[RANK])
    if len(unique) == 1:  # one host: its ranks share memory
        assert env.local_rank() == node_rank
    assert repr(env) == f"MPIEnvironment(global_rank={RANK}, world_size={SIZE})"
    env.validate_settings(num_devices=1, num_nodes=1)
    env.teardown()
