"""Lightning's distributed utilities (mpidist.utils) against numpy references.

Every rank builds its input from its rank (``helpers.rank_input``), so every rank
can compute what every other rank sent and check the whole result. Collectives
are counted with the group's sequence number (``pg.impl.seq``, which every
collective on the group advances by one), so the tests also pin down how many
rounds each utility costs. Tests that need the default group gone use
``no_group``; the harness re-creates the session's group afterwards.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
import mpidist.utils as utils
from mpidist.reduce_op import OP_TABLE

from helpers import ALL_DTYPES, BF16, assert_equal, check_raises, fail_together, kind, rank_input, reference

pytestmark = pytest.mark.timeout(120)

PG_TIMEOUT_S = float(os.environ.get("MPIDIST_TEST_PG_TIMEOUT", "90"))
RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
LAST = SIZE - 1
R = dist.ReduceOp


@pytest.fixture
def master_env(monkeypatch):
    """MASTER_ADDR/MASTER_PORT as they were before the test, restored afterwards."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)


def seq(group=None) -> int:
    """Collectives issued so far on ``group`` (default: the world)."""
    pg = dist.group.WORLD if group is None else group
    return pg.impl.seq


def even_group():
    """A group of the even global ranks (every rank calls new_group)."""
    return dist.new_group(list(range(0, SIZE, 2)))


def collect(problems: list[str], what: str, fn, *args) -> None:
    """Run a check, turning an AssertionError into a recorded problem."""
    try:
        fn(*args)
    except AssertionError as exc:
        problems.append(f"{what}: {exc}")


def expect(problems: list[str], what: str, got, expected) -> None:
    """Record a problem unless ``got == expected`` (checks between collectives must not raise)."""
    if not (got == expected):
        problems.append(f"{what}: got {got!r}, expected {expected!r}")


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
def test_all_gather_ddp_stacks_every_rank(shape):
    problems: list[str] = []
    for dtype in ALL_DTYPES:
        x = rank_input(RANK, shape, dtype)
        before = seq()
        out = dist.all_gather_ddp_if_available(x)
        expected = np.stack([rank_input(r, shape, dtype) for r in range(SIZE)])
        collect(problems, f"{dtype.name}{shape}", assert_equal, out, expected)
        if seq() - before != 1:
            problems.append(f"{dtype.name}{shape}: {seq() - before} collectives instead of 1")
        if np.shares_memory(out, x):
            problems.append(f"{dtype.name}{shape}: the result shares memory with the input")
    fail_together(problems)


def test_all_gather_ddp_on_a_subgroup():
    g = even_group()
    x = np.arange(3, dtype=np.int64) + 10 * RANK
    out = dist.all_gather_ddp_if_available(x, group=g)
    if RANK % 2:
        assert out is None
    else:
        members = list(range(0, SIZE, 2))
        assert_equal(out, np.stack([np.arange(3, dtype=np.int64) + 10 * m for m in members]))


def test_all_gather_ddp_without_a_group_is_a_world_of_one(no_group):
    x = rank_input(RANK, (2, 3), np.dtype(np.float32))
    out = dist.all_gather_ddp_if_available(x)
    assert_equal(out, x[None])
    assert not np.shares_memory(out, x)
    scalar = dist.all_gather_ddp_if_available(np.array(5, np.int16))
    assert_equal(scalar, np.array([5], np.int16))


@pytest.mark.parametrize("initialized", [True, False])
def test_all_gather_ddp_bad_arguments(initialized, no_group):
    if initialized:
        dist.init_process_group(timeout=PG_TIMEOUT_S)
        before = seq()
    fn = dist.all_gather_ddp_if_available
    x = np.ones(3)
    problems = check_raises(
        TypeError, r"^all_gather_ddp_if_available: sync_grads=True needs .*torch", fn, x, sync_grads=True
    )
    problems += check_raises(
        TypeError, r"^all_gather_ddp_if_available: sync_grads must be a bool, got str", fn, x, sync_grads="no"
    )
    problems += check_raises(
        TypeError, r"^all_gather_ddp_if_available: tensor must be a numpy.ndarray, got builtins.list", fn, [1.0]
    )
    problems += check_raises(TypeError, r"^all_gather_ddp_if_available: tensor has dtype object", fn, np.array([None]))
    if initialized:
        problems += check_raises(
            TypeError, r"^all_gather_ddp_if_available: group must be a ProcessGroup", fn, x, group="world"
        )
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
def test_gather_all_tensors_shapes_differ_in_every_dimension(shape_of):
    problems: list[str] = []
    shapes = [shape_of(r) for r in range(SIZE)]
    any_data = np.prod(np.max(shapes, axis=0)) > 0
    for dtype in ALL_DTYPES:
        x = rank_input(RANK, shapes[RANK], dtype, salt=2)
        before = seq()
        got = dist.gather_all_tensors(x)
        rounds = seq() - before
        if rounds != 1 + any_data:  # the shapes, then the data (skipped when every array is empty)
            problems.append(f"{dtype.name}: {rounds} collectives instead of {1 + any_data}")
        if not isinstance(got, list) or len(got) != SIZE:
            problems.append(f"{dtype.name}: expected a list of {SIZE} arrays, got {got!r}")
            continue
        for r in range(SIZE):
            collect(problems, f"{dtype.name} rank {r}", assert_equal, got[r], rank_input(r, shapes[r], dtype, salt=2))
            if not got[r].flags.c_contiguous:
                problems.append(f"{dtype.name} rank {r}: not C-contiguous")
    fail_together(problems)


def test_gather_all_tensors_uses_one_shapes_round_and_one_data_round(monkeypatch):
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = utils.all_gather_into_tensor

    def counting(out, inp, group=None, async_op=False):
        calls.append((out.shape, inp.shape))
        return real(out, inp, group=group, async_op=async_op)

    monkeypatch.setattr(utils, "all_gather_into_tensor", counting)
    got = dist.gather_all_tensors(np.full((RANK + 1, 2), RANK, np.int32))
    assert [a.tolist() for a in got] == [[[r, r]] * (r + 1) for r in range(SIZE)]
    assert calls == [((SIZE, utils._HEADER), (utils._HEADER,)), ((SIZE, SIZE, 2), (SIZE, 2))]


def test_gather_all_tensors_scalars_and_equal_shapes():
    problems: list[str] = []
    got = dist.gather_all_tensors(np.array(RANK * 1.5))
    for r in range(SIZE):
        collect(problems, f"scalar of rank {r}", assert_equal, got[r], np.array(r * 1.5))
    x = rank_input(RANK, (3, 2), np.dtype(np.complex128))
    got = dist.gather_all_tensors(x)
    for r in range(SIZE):
        collect(problems, f"rank {r}", assert_equal, got[r], rank_input(r, (3, 2), np.dtype(np.complex128)))
    fail_together(problems)


def test_gather_all_tensors_one_dimensional_and_non_contiguous():
    base = np.arange(40, dtype=np.float64).reshape(4, 10) + 100 * RANK
    x = base[:, : RANK + 2 : 2][:, ::-1].T  # non-contiguous, shape differs per rank
    got = dist.gather_all_tensors(x)
    problems: list[str] = []
    for r in range(SIZE):
        b = np.arange(40, dtype=np.float64).reshape(4, 10) + 100 * r
        collect(problems, f"rank {r}", assert_equal, got[r], np.ascontiguousarray(b[:, : r + 2 : 2][:, ::-1].T))
    lengths = dist.gather_all_tensors(np.arange(RANK, dtype=np.uint8))  # rank 0 sends nothing
    problems += [f"1-D rank {r}" for r in range(SIZE) if lengths[r].tolist() != list(range(r))]
    fail_together(problems)


def test_gather_all_tensors_on_a_subgroup():
    g = even_group()
    members = list(range(0, SIZE, 2))
    got = dist.gather_all_tensors(np.full(RANK + 1, RANK, np.int64), group=g)
    if RANK % 2:
        assert got is None
    else:
        assert [a.tolist() for a in got] == [[m] * (m + 1) for m in members]


@pytest.mark.mpi(min_size=2)
def test_gather_all_tensors_ndim_mismatch_raises_on_every_rank():
    x = np.zeros(3) if RANK == LAST else np.zeros((1, 3))
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
def test_gather_all_tensors_dtype_mismatch_raises_on_every_rank():
    x = np.zeros(3, BF16 if RANK == LAST else np.float32)
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


def test_gather_all_tensors_bad_arguments_raise_before_communicating():
    before = seq()
    fn = dist.gather_all_tensors
    problems = check_raises(
        TypeError, r"^gather_all_tensors: result must be a numpy.ndarray, got builtins.float", fn, 1.0
    )
    problems += check_raises(TypeError, r"^gather_all_tensors: result has dtype object", fn, np.array([None, 1]))
    problems += check_raises(TypeError, r"^gather_all_tensors: result has dtype str", fn, np.array(["a"]))
    problems += check_raises(TypeError, r"^gather_all_tensors: group must be a ProcessGroup", fn, np.ones(2), group=3)
    if seq() != before:
        problems.append(f"bad arguments issued {seq() - before} collectives")
    fail_together(problems)


def test_gather_all_tensors_needs_a_group(no_group):
    fail_together(
        check_raises(
            RuntimeError,
            r"^gather_all_tensors: the default process group is not initialized",
            dist.gather_all_tensors,
            np.ones(2),
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
def test_sync_ddp_every_named_op_every_dtype(reduce_op, op):
    problems: list[str] = []
    for dtype in ALL_DTYPES:
        k = kind(dtype)
        x = rank_input(RANK, (2, 3), dtype)
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


def test_sync_ddp_premul_sum():
    x = rank_input(RANK, (4,), np.dtype(np.float64))
    out = dist.sync_ddp(x, reduce_op=dist.make_premul_sum(2.0))
    assert out is x
    assert_equal(x, 2.0 * sum(rank_input(r, (4,), np.dtype(np.float64)) for r in range(SIZE)))


@pytest.mark.parametrize("reduce_op", ["avg", "mean", "AVG", "Mean"])
def test_sync_ddp_mean(reduce_op):
    problems: list[str] = []
    for dtype in ALL_DTYPES:
        k = kind(dtype)
        x = rank_input(RANK, (2, 3), dtype)
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
            if not np.allclose(x.astype(exact_mean.dtype), exact_mean, rtol=4 * eps, atol=0):
                problems.append(f"{dtype.name}: mean {x} is not close to {exact_mean}")
        else:  # integers: the input keeps the sum, the mean comes back as float64 (true division)
            collect(problems, f"{dtype.name} input", assert_equal, x, total)
            collect(problems, f"{dtype.name} mean", assert_equal, out, total.astype(np.float64) / SIZE)
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


def test_sync_ddp_on_a_subgroup_leaves_non_members_alone():
    g = even_group()
    members = list(range(0, SIZE, 2))
    problems: list[str] = []
    x = np.array([RANK + 1.0, 2.0])
    out = dist.sync_ddp(x, group=g, reduce_op="mean")
    expect(problems, "float: returns its input", out is x, True)
    mean = sum(m + 1 for m in members) / len(members)
    expect(problems, "float mean", x.tolist(), [RANK + 1.0, 2.0] if RANK % 2 else [mean, 2.0])
    i = np.array([RANK + 1], np.int64)
    out = dist.sync_ddp(i, group=g, reduce_op="avg")
    if RANK % 2:
        expect(problems, "int: non-member gets its input back unchanged", (out is i, i.tolist()), (True, [RANK + 1]))
    else:
        expect(problems, "int mean", (out.tolist(), out.dtype), ([mean], np.float64))
    fail_together(problems)


def test_sync_ddp_bad_arguments_raise_before_communicating():
    before = seq()
    fn = dist.sync_ddp
    x = np.ones(3)
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
        ValueError, r"^sync_ddp: ReduceOp.MAX is not defined for complex64", fn, x.astype(np.complex64), reduce_op="max"
    )
    problems += check_raises(ValueError, r"^sync_ddp: ReduceOp.UNUSED is not a reduction", fn, x, reduce_op=R.UNUSED)
    problems += check_raises(TypeError, r"^sync_ddp: result must be a numpy.ndarray, got builtins.list", fn, [1.0])
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


def test_sync_ddp_if_available_reduces_when_initialized():
    problems: list[str] = []
    x = np.array([RANK, 1], np.int32)
    before = seq()
    out = dist.sync_ddp_if_available(x, reduce_op="sum")
    expect(problems, "sum", (out is x, x.tolist(), seq() - before), (True, [SIZE * (SIZE - 1) // 2, SIZE], 1))
    y = np.array([RANK + 1.0])
    out = dist.sync_ddp_if_available(y, reduce_op="mean")
    expect(problems, "mean", (out is y, y.tolist()), (True, [(SIZE + 1) / 2]))
    fail_together(problems)


def test_sync_ddp_if_available_without_a_group_returns_the_input(no_group):
    problems: list[str] = []
    x = np.array([RANK, 1.0])
    expect(problems, "sum", dist.sync_ddp_if_available(x) is x, True)
    expect(problems, "mean", dist.sync_ddp_if_available(x, reduce_op="mean") is x, True)
    expect(problems, "values", x.tolist(), [RANK, 1.0])
    expect(problems, "a number", dist.sync_ddp_if_available(3), 3)
    problems += check_raises(
        ValueError, r"^sync_ddp_if_available: reduce_op='bogus'", dist.sync_ddp_if_available, x, reduce_op="bogus"
    )
    problems += check_raises(RuntimeError, r"^sync_ddp: the default process group is not initialized", dist.sync_ddp, x)
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
        ValueError, r"^init_process_group: .*gloo", fn, FakeEnvironment(), "gloo", timeout=PG_TIMEOUT_S
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
