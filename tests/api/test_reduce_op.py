"""ReduceOp: numbering, construction, premultiplied sums, the deprecated alias, op validation."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import ReduceOp
from mpidist.reduce_op import RedOpType

from helpers import raises_together

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()

TORCH_NUMBERING = {
    "SUM": 0,
    "AVG": 1,
    "PRODUCT": 2,
    "MIN": 3,
    "MAX": 4,
    "BAND": 5,
    "BOR": 6,
    "BXOR": 7,
    "PREMUL_SUM": 8,
}


def check_group_works() -> None:
    x = np.array([RANK + 1.0])
    dist.all_reduce(x)
    assert x[0] == SIZE * (SIZE + 1) / 2


# -- numbering and identity ---------------------------------------------------------------


@pytest.mark.parametrize("name, number", sorted(TORCH_NUMBERING.items(), key=lambda kv: kv[1]))
def test_numbering_matches_torch(name, number):
    op = getattr(ReduceOp, name)
    assert op == number
    assert int(op) == number
    assert op is RedOpType[name]
    assert ReduceOp.RedOpType[name] is op
    assert getattr(dist.ReduceOp, name).name == name


def test_numbering_matches_installed_torch():
    torch_dist = pytest.importorskip("torch.distributed")
    if not torch_dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    torch_ops = torch_dist.ReduceOp.RedOpType
    for name, number in TORCH_NUMBERING.items():
        assert int(getattr(torch_ops, name)) == number == int(getattr(ReduceOp, name))
    for name, member in torch_ops.__members__.items():
        assert int(getattr(ReduceOp, name)) == int(member), name


def test_reduce_op_of_a_reduce_op_is_equal():
    assert ReduceOp(ReduceOp.MAX) == ReduceOp.MAX
    assert ReduceOp.MAX == ReduceOp(ReduceOp.MAX)
    assert ReduceOp(ReduceOp(ReduceOp.MIN)) == ReduceOp.MIN
    assert ReduceOp(4) == ReduceOp.MAX
    assert ReduceOp() == ReduceOp.SUM
    assert ReduceOp(ReduceOp.MAX) != ReduceOp.MIN
    assert ReduceOp(ReduceOp.MAX) != ReduceOp(ReduceOp.SUM)
    assert ReduceOp(ReduceOp.MAX).op is RedOpType.MAX
    assert ReduceOp(ReduceOp.MAX).factor is None
    assert hash(ReduceOp(ReduceOp.MAX)) == hash(ReduceOp.MAX)
    assert {ReduceOp(ReduceOp.BXOR): 1}[ReduceOp(ReduceOp.BXOR)] == 1


def test_reduce_op_constructor_rejects_bad_values():
    with pytest.raises(TypeError, match=r"^ReduceOp: op must be a ReduceOp.RedOpType, got 'sum'"):
        ReduceOp("sum")
    with pytest.raises(TypeError, match=r"^ReduceOp: op must be a ReduceOp.RedOpType"):
        ReduceOp(True)
    with pytest.raises(TypeError, match=r"^ReduceOp: op must be a ReduceOp.RedOpType"):
        ReduceOp(1.0)
    with pytest.raises(ValueError, match=r"^ReduceOp: no reduction numbered 42"):
        ReduceOp(42)


def test_repr():
    assert repr(ReduceOp(ReduceOp.MAX)) == "ReduceOp.MAX"
    assert repr(ReduceOp(ReduceOp.SUM)) == "ReduceOp.SUM"
    assert repr(dist.make_premul_sum(2.0)) == "ReduceOp.PREMUL_SUM(2.0)"
    assert repr(dist.make_premul_sum(3)) == "ReduceOp.PREMUL_SUM(3)"
    assert repr(dist.make_premul_sum(np.array([0.5]))) == "ReduceOp.PREMUL_SUM(0.5)"
    assert "SUM" in repr(ReduceOp.SUM)


# -- premultiplied sums -------------------------------------------------------------------


@pytest.mark.parametrize(
    "factor, value",
    [(2.0, 2.0), (3, 3), (1 + 2j, 1 + 2j), (np.array([0.25]), 0.25), (np.float32(1.5), 1.5), (np.array(4.0), 4.0)],
    ids=["float", "int", "complex", "array1", "npfloat32", "array0d"],
)
@pytest.mark.parametrize("maker", [dist.make_premul_sum, dist._make_nccl_premul_sum], ids=["make", "nccl"])
def test_make_premul_sum(maker, factor, value):
    op = maker(factor)
    assert isinstance(op, ReduceOp)
    assert op.op is RedOpType.PREMUL_SUM
    assert op.factor is factor  # kept as given: arrays are read when the collective runs
    assert op == maker(value)
    assert op != ReduceOp.PREMUL_SUM  # a bare PREMUL_SUM has no factor
    assert op != maker(value + 1)
    assert dist.supports_complex(op)


@pytest.mark.parametrize(
    "factor, match",
    [
        ("2.0", r"got str$"),
        (np.array([1.0, 2.0]), r"got ndarray with 2 elements"),
        (np.zeros((0,)), r"got ndarray with 0 elements"),
        (None, r"got NoneType"),
        (True, r"got bool"),
        ([2.0], r"got list"),
    ],
    ids=["str", "array2", "array0", "none", "bool", "list"],
)
def test_make_premul_sum_rejects_bad_factors(factor, match):
    with pytest.raises(
        TypeError,
        match=r"^make_premul_sum: factor must be a real or complex number or a 1-element array, .*" + match,
    ):
        dist.make_premul_sum(factor)
    with pytest.raises(TypeError, match=match):
        dist._make_nccl_premul_sum(factor)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128])
def test_premul_sum_all_reduce(dtype):
    x = np.full(5, RANK + 1, dtype)
    dist.all_reduce(x, op=dist.make_premul_sum(0.5))
    np.testing.assert_array_equal(x, np.full(5, 0.5 * SIZE * (SIZE + 1) / 2, dtype))


def test_premul_sum_array_factor_is_read_when_the_collective_runs():
    factor = np.array([2.0])
    op = dist.make_premul_sum(factor)
    factor[0] = 3.0
    x = np.full(3, RANK + 1, np.float64)
    dist.all_reduce(x, op=op)
    np.testing.assert_array_equal(x, np.full(3, 3.0 * SIZE * (SIZE + 1) / 2))


def test_premul_sum_complex_factor_on_real_array():
    raises_together(
        ValueError, r"^all_reduce: PREMUL_SUM factor .*complex but the array is float64", dist.all_reduce,
        np.ones(2), op=dist.make_premul_sum(1j),
    )  # fmt: skip
    check_group_works()


def test_premul_sum_needs_a_factor():
    for op in (ReduceOp.PREMUL_SUM, ReduceOp(ReduceOp.PREMUL_SUM)):
        raises_together(
            ValueError,
            r"^all_reduce: ReduceOp.PREMUL_SUM needs a factor.*make_premul_sum",
            dist.all_reduce,
            np.ones(2),
            op=op,
        )
    check_group_works()


def test_premul_sum_on_integers_is_rejected():
    raises_together(
        ValueError, r"^all_reduce: ReduceOp.PREMUL_SUM is not defined for int64 arrays", dist.all_reduce,
        np.ones(2, np.int64), op=dist.make_premul_sum(2),
    )  # fmt: skip
    check_group_works()


# -- deprecated reduce_op -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["SUM", "PRODUCT", "MIN", "MAX"])
def test_deprecated_reduce_op_warns_and_forwards(name):
    with pytest.warns(FutureWarning, match="reduce_op is deprecated, use mpidist.ReduceOp"):
        value = getattr(dist.reduce_op, name)
    assert value == getattr(ReduceOp, name)
    assert value is getattr(ReduceOp, name)


def test_deprecated_reduce_op_works_in_all_reduce():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        op = dist.reduce_op.MAX
    x = np.array([RANK], np.int64)
    dist.all_reduce(x, op=op)
    assert x[0] == SIZE - 1


def test_deprecated_reduce_op_unknown_name():
    with pytest.raises(AttributeError):
        dist.reduce_op.NOT_AN_OP  # noqa: B018
    assert "deprecated" in repr(dist.reduce_op)


# -- supports_complex ---------------------------------------------------------------------


def test_supports_complex():
    assert dist.supports_complex(ReduceOp.SUM)
    assert dist.supports_complex(ReduceOp.AVG)
    assert dist.supports_complex(ReduceOp.PREMUL_SUM)
    assert dist.supports_complex(ReduceOp(ReduceOp.SUM))
    for name in ("MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"):
        assert not dist.supports_complex(getattr(ReduceOp, name)), name
        assert not dist.supports_complex(ReduceOp(getattr(ReduceOp, name))), name


@pytest.mark.parametrize("name", sorted(TORCH_NUMBERING))
def test_supports_complex_agrees_with_all_reduce(name):
    """An op that supports_complex() accepts works on complex arrays; any other raises ValueError everywhere."""
    op = dist.make_premul_sum(1.0) if name == "PREMUL_SUM" else getattr(ReduceOp, name)
    x = np.full(3, RANK + 1 + 1j, np.complex128)
    if dist.supports_complex(op):
        dist.all_reduce(x, op=op)
        total = SIZE * (SIZE + 1) / 2 + 1j * SIZE
        expected = total / SIZE if name == "AVG" else total
        np.testing.assert_allclose(x, np.full(3, expected), rtol=0, atol=1e-12)
    else:
        raises_together(
            ValueError, rf"^all_reduce: ReduceOp.{name} is not defined for complex128 arrays", dist.all_reduce, x, op=op
        )
        np.testing.assert_array_equal(x, np.full(3, RANK + 1 + 1j))  # untouched
        check_group_works()


# -- invalid op arguments -----------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", 0, 4, 1.0, None, "ReduceOp.SUM", np.int64(0)], ids=repr)
@pytest.mark.parametrize("fn", ["all_reduce", "reduce", "reduce_scatter_tensor"])
def test_op_that_is_not_a_reduce_op(fn, op):
    x = np.ones(SIZE * 2)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x, op=op),
        "reduce": lambda: dist.reduce(x, dst=0, op=op),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(np.zeros(2), x, op=op),
    }
    raises_together(
        TypeError, rf"^{fn}: op must be a ReduceOp such as ReduceOp.SUM, got {re.escape(repr(op))}", calls[fn]
    )
    np.testing.assert_array_equal(x, np.ones(SIZE * 2))
    check_group_works()


def test_unused_is_not_a_reduction():
    raises_together(
        ValueError, r"^all_reduce: ReduceOp.UNUSED is not a reduction", dist.all_reduce, np.ones(1), op=ReduceOp.UNUSED
    )
    check_group_works()


@pytest.mark.parametrize(
    "name, value",
    [("SUM", lambda s: s * (s + 1) // 2), ("PRODUCT", lambda s: int(np.prod(np.arange(1, s + 1)))),
     ("MIN", lambda s: 1), ("MAX", lambda s: s)],
)  # fmt: skip
def test_reduce_op_instance_and_enum_member_give_the_same_result(name, value):
    a = np.array([RANK + 1], np.int64)
    b = a.copy()
    dist.all_reduce(a, op=getattr(ReduceOp, name))
    dist.all_reduce(b, op=ReduceOp(getattr(ReduceOp, name)))
    assert a[0] == b[0] == value(SIZE)


def _avg_inputs(dtype: np.dtype) -> tuple[np.ndarray, list[int]]:
    """This rank's values near the top of ``dtype`` (beyond 2**53: float64 would round them) and the exact AVG."""
    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    info = np.iinfo(dtype)
    big = info.max // size - 10  # the sum of every rank's value stays in range

    def value(r: int, j: int) -> int:
        v = big - 3 * r - j
        return -v if (dtype.kind == "i" and j % 2) else v

    mine = np.array([value(rank, j) for j in range(4)], dtype)
    sums = [sum(value(r, j) for r in range(size)) for j in range(4)]
    exact = [s // size if s >= 0 else -((-s) // size) for s in sums]  # truncation toward zero
    return mine, exact


@pytest.mark.parametrize("dtype", [np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.int32)], ids=str)
def test_avg_is_exact_for_every_integer_width(dtype, monkeypatch):
    """AVG divides in integer arithmetic on every path (host arrays, device arrays over MPI)."""
    from mpidist._world import world
    from mpidist.testing import HostCudaArray

    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    problems = []
    for path in ("host", "device staged", "device CUDA-aware"):
        monkeypatch.setattr(world, "cuda_aware", path == "device CUDA-aware")  # then AVG divides on the device
        mine, exact = _avg_inputs(dtype)
        arr = mine.copy() if path == "host" else HostCudaArray(mine.copy(), 7)
        dist.all_reduce(arr, op=ReduceOp.AVG)
        got = (arr if path == "host" else arr.host).tolist()
        if got != exact:
            problems.append(f"{path} {dtype}: got {got}, expected {exact}")
    everyone = MPI.COMM_WORLD.allgather(problems)
    assert not any(everyone), everyone
