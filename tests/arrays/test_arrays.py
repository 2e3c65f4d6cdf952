"""Array validation and staging: clear errors for bad inputs, and the mpidist.arrays.host helpers.

Every bad-input case raises on every rank before any communication, with a message that
names the function and the argument; the group must work normally afterwards. Mismatches
are decided on all ranks together (``fail_together``) so that a wrong result on one rank
never leaves the others waiting in the next collective.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist._world import world
from mpidist.arrays import host as _arrays
from mpidist.backends.mpi_types import LARGE_COUNTS
from mpidist.errors import DistError

from helpers import check_raises, fail_together

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
PEER = (RANK + 1) % SIZE
BF16 = np.dtype(ml_dtypes.bfloat16)


def group_works() -> list[str]:
    """Run a few collectives on the default group; return what went wrong."""
    problems = []
    x = np.array([RANK + 1, 2], np.int64)
    dist.all_reduce(x)
    if x.tolist() != [SIZE * (SIZE + 1) // 2, 2 * SIZE]:
        problems.append(f"all_reduce after the error gave {x}")
    b = np.arange(3.0) if RANK == 0 else np.zeros(3)
    dist.broadcast(b, src=0)
    if b.tolist() != [0.0, 1.0, 2.0]:
        problems.append(f"broadcast after the error gave {b}")
    out = np.zeros(SIZE, np.int64)
    dist.all_gather_into_tensor(out, np.array([RANK], np.int64))
    if out.tolist() != list(range(SIZE)):
        problems.append(f"all_gather_into_tensor after the error gave {out}")
    return problems


def expect_error_then_working_group(exc: type[BaseException], match: str, fn, *args, **kwargs) -> None:
    problems = check_raises(exc, match, fn, *args, **kwargs)
    problems += group_works()
    fail_together(problems)


def readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def f64(n: int = 4) -> np.ndarray:
    return np.zeros(n, np.float64)


_NOT_ARRAYS = {
    "list": ([1.0, 2.0], r"got builtins\.list; convert it with numpy\.asarray\(\.\.\.\)"),
    "tuple": ((1.0, 2.0), r"got builtins\.tuple; convert it with numpy\.asarray\(\.\.\.\)"),
    "float": (3.0, r"got builtins\.float; convert it with numpy\.asarray\(\.\.\.\)"),
    "int": (3, r"got builtins\.int; convert it with numpy\.asarray\(\.\.\.\)"),
    "npscalar": (np.float32(1.0), r"got numpy\.float32; numpy scalars are immutable, use numpy\.array\(value\)"),
    "npint": (np.int64(1), r"got numpy\.int64; numpy scalars are immutable, use numpy\.array\(value\)"),
    "npfloat64": (np.float64(1.0), r"got numpy\.float64; (convert it with numpy\.asarray|numpy scalars are immutable)"),
    "memoryview": (memoryview(bytearray(8)), r"got builtins\.memoryview"),
    "none": (None, r"got builtins\.NoneType"),
}

_BAD_DTYPES = {
    # kind: (make(n) -> an array of n elements of that dtype, what the error says)
    "object": (lambda n=2: np.array([None] * n, dtype=object), r"has dtype object, which mpidist does not send; supported: .*float64"),
    "structured": (lambda n=2: np.zeros(n, dtype=[("a", np.int32), ("b", np.float64)]), r"has dtype structured, which mpidist does not send"),
    "str": (lambda n=2: np.full(n, "ab"), r"has dtype str\w*, which mpidist does not send"),
    "bytes": (lambda n=2: np.full(n, b"ab"), r"has dtype bytes\w*, which mpidist does not send"),
    "datetime": (lambda n=2: np.zeros(n, "datetime64[s]"), r"has dtype datetime64\[s\], which mpidist does not send"),
    "longdouble": (lambda n=2: np.zeros(n, np.longdouble), r"has dtype (float128|float96|longdouble), which mpidist does not send"),
    "clongdouble": (lambda n=2: np.zeros(n, np.clongdouble), r"has dtype (complex256|complex192|clongdouble), which"),
    "big-endian f8": (lambda n=2: np.zeros(n, ">f8"), r"has non-native byte order \(>f8\); convert it with arr\.astype\(arr\.dtype\.newbyteorder\('='\)\)"),
    "big-endian i4": (lambda n=2: np.zeros(n, ">i4"), r"has non-native byte order \(>i4\)"),
    "big-endian c16": (lambda n=2: np.zeros(n, ">c16"), r"has non-native byte order \(>c16\)"),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_NOT_ARRAYS))
@pytest.mark.parametrize("fn", ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor_in", "isend"])
def test_not_an_array(fn, kind):
    value, hint = _NOT_ARRAYS[kind]
    calls = {
        "all_reduce": (lambda: dist.all_reduce(value), "all_reduce: tensor"),
        "broadcast": (lambda: dist.broadcast(value, src=0), "broadcast: tensor"),
        "reduce": (lambda: dist.reduce(value, dst=0), "reduce: tensor"),
        "all_gather_into_tensor_in": (
            lambda: dist.all_gather_into_tensor(f64(SIZE), value),
            "all_gather_into_tensor: input_tensor",
        ),
        "isend": (lambda: dist.isend(value, dst=PEER), "isend: tensor"),
    }
    call, where = calls[fn]
    expect_error_then_working_group(
        TypeError, rf"^{where} must be an array \(numpy\.ndarray, torch\.Tensor, .*\), {hint}", call
    )


_DTYPE_CALLS = {
    # fn: (call with arrays made by ``make``, the argument named in the error)
    "all_reduce": (lambda make: dist.all_reduce(make()), "tensor"),
    "broadcast": (lambda make: dist.broadcast(make(), src=0), "tensor"),
    "reduce": (lambda make: dist.reduce(make(), dst=0), "tensor"),
    "all_gather": (lambda make: dist.all_gather([make() for _ in range(SIZE)], make()), "tensor"),
    "all_gather_into_tensor": (
        lambda make: dist.all_gather_into_tensor(make(2 * SIZE), make()),
        "(output_tensor|input_tensor)",
    ),
    "gather": (lambda make: dist.gather(make(), [make() for _ in range(SIZE)] if RANK == 0 else None, dst=0), "tensor"),
    "scatter": (
        lambda make: dist.scatter(make(), [make() for _ in range(SIZE)] if RANK == 0 else None, src=0),
        "tensor",
    ),
    "all_to_all": (
        lambda make: dist.all_to_all([make() for _ in range(SIZE)], [make() for _ in range(SIZE)]),
        r"(output_tensor_list|input_tensor_list)\[0\]",
    ),
    "all_to_all_single": (
        lambda make: dist.all_to_all_single(make(2 * SIZE), make(2 * SIZE)),
        "(output|input)",
    ),
    "reduce_scatter_tensor": (
        lambda make: dist.reduce_scatter_tensor(make(), make(2 * SIZE)),
        "(output|input)",
    ),
    "isend": (lambda make: dist.isend(make(), dst=PEER), "tensor"),
    "irecv": (lambda make: dist.irecv(make(), src=PEER), "tensor"),
}
#: collectives that move raw bytes: an object array sent through them would deliver another
#: process's pointers (memory corruption), so object dtype is covered by the other calls and
#: these are checked with the dtypes that carry no pointers
_BYTE_MOVERS = {"all_gather", "gather", "scatter", "all_to_all"}


@pytest.mark.parametrize("fn", sorted(_DTYPE_CALLS))
def test_unsupported_dtype(fn):
    """Every unsupported dtype (one call each) raises a TypeError naming ``fn`` and the argument."""
    call, arg = _DTYPE_CALLS[fn]
    problems = []
    for kind, (make, why) in sorted(_BAD_DTYPES.items()):
        if kind.startswith(("longdouble", "clongdouble")) and make().dtype in _arrays.DTYPES:
            continue  # long double is an ordinary double on this platform
        if kind == "object" and fn in _BYTE_MOVERS:
            continue  # a missed check would deliver another process's pointers: covered by the other calls
        problems += [f"{kind}: {p}" for p in check_raises(TypeError, rf"^{fn}: {arg} {why}", call, make)]
        problems += [f"after {kind}: {p}" for p in group_works()]
    fail_together(problems)


def test_masked_array():
    m = np.ma.masked_array(np.arange(4.0), mask=[0, 1, 0, 0])
    expect_error_then_working_group(
        TypeError,
        r"^all_reduce: tensor is a numpy masked array; its mask would be ignored, pass arr\.filled",
        dist.all_reduce,
        m,
    )
    expect_error_then_working_group(
        TypeError, r"^all_gather_into_tensor: output_tensor is a numpy masked array",
        dist.all_gather_into_tensor, np.ma.masked_array(np.zeros(SIZE)), np.zeros(1),
    )  # fmt: skip
    expect_error_then_working_group(
        TypeError, r"^broadcast: tensor is a numpy masked array", dist.broadcast, np.ma.masked_array(np.zeros(2)), src=0
    )


def test_masked_array_in_a_list():
    outs = [np.zeros(1) for _ in range(SIZE)]
    outs[-1] = np.ma.masked_array(outs[-1])
    expect_error_then_working_group(
        TypeError,
        rf"^all_gather: tensor_list\[{SIZE - 1}\] is a numpy masked array",
        dist.all_gather,
        outs,
        np.zeros(1),
    )


# -- read-only arrays ---------------------------------------------------------------------


def test_read_only_output_all_reduce():
    x = readonly(np.ones(4))
    expect_error_then_working_group(
        ValueError,
        r"^all_reduce: tensor is read-only; outputs must be writeable arrays \(pass a copy\)",
        dist.all_reduce,
        x,
    )
    expect_error_then_working_group(
        ValueError, r"^all_reduce: tensor is read-only", dist.all_reduce, readonly(np.ones((4, 4)))[:, 1]
    )
    np.testing.assert_array_equal(x, np.ones(4))


def test_read_only_outputs_of_list_and_tensor_collectives():
    outs = [np.zeros(2) for _ in range(SIZE)]
    readonly(outs[-1])
    expect_error_then_working_group(
        ValueError, rf"^all_gather: tensor_list\[{SIZE - 1}\] is read-only", dist.all_gather, outs, np.ones(2)
    )
    expect_error_then_working_group(
        ValueError, r"^all_gather_into_tensor: output_tensor is read-only",
        dist.all_gather_into_tensor, readonly(np.zeros(2 * SIZE)), np.ones(2),
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError, r"^reduce_scatter_tensor: output is read-only",
        dist.reduce_scatter_tensor, readonly(np.zeros(2)), np.ones(2 * SIZE),
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError, r"^reduce_scatter: output is read-only",
        dist.reduce_scatter, readonly(np.zeros(2)), [np.ones(2) for _ in range(SIZE)],
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError, r"^all_to_all_single: output is read-only",
        dist.all_to_all_single, readonly(np.zeros(SIZE)), np.ones(SIZE),
    )  # fmt: skip
    outs = [np.zeros(1) for _ in range(SIZE)]
    readonly(outs[0])
    expect_error_then_working_group(
        ValueError, r"^all_to_all: output_tensor_list\[0\] is read-only",
        dist.all_to_all, outs, [np.ones(1) for _ in range(SIZE)],
    )  # fmt: skip
    # scatter's output is checked on every rank, the source included
    scatter_list = [np.ones(1) for _ in range(SIZE)] if RANK == 0 else None
    expect_error_then_working_group(
        ValueError, r"^scatter: tensor is read-only", dist.scatter, readonly(np.zeros(1)), scatter_list, src=0
    )


@pytest.mark.mpi(min_size=2)
def test_read_only_broadcast_target_on_non_source_ranks():
    """Only the receivers fail (the source does not call here): each refuses the group afterwards,
    since in a program where the source did call, its data would wait there (tests/hostile/test_role_errors.py)."""
    g = dist.new_group()
    if RANK != 0:
        problems = check_raises(
            ValueError, r"^broadcast: tensor is read-only", dist.broadcast, readonly(np.zeros(3)), src=0, group=g
        )
        problems += check_raises(DistError, r"unusable on this rank: broadcast", dist.all_reduce, f64(), group=g)
    else:
        problems = []
    problems += group_works()
    fail_together(problems)
    dist.destroy_process_group(g)


def test_read_only_inputs_are_fine(rank, world_size):
    # broadcast from a read-only source array
    b = readonly(np.arange(5.0)) if rank == 0 else np.zeros(5)
    dist.broadcast(b, src=0)
    np.testing.assert_array_equal(b, np.arange(5.0))
    # all_gather / all_gather_into_tensor from a read-only input
    inp = readonly(np.full(2, rank, np.int64))
    outs = [np.zeros(2, np.int64) for _ in range(world_size)]
    dist.all_gather(outs, inp)
    for r, o in enumerate(outs):
        np.testing.assert_array_equal(o, [r, r])
    flat = np.zeros(2 * world_size, np.int64)
    dist.all_gather_into_tensor(flat, inp)
    np.testing.assert_array_equal(flat, np.repeat(np.arange(world_size), 2))
    # reduce: the input of non-destination ranks may be read-only
    r_in = np.full(3, rank + 1, np.int64) if rank == 0 else readonly(np.full(3, rank + 1, np.int64))
    dist.reduce(r_in, dst=0)
    if rank == 0:
        np.testing.assert_array_equal(r_in, np.full(3, world_size * (world_size + 1) // 2))
    # scatter's list, gather's input, all_to_all_single's input, reduce_scatter_tensor's input
    out = np.zeros(1, np.int64)
    dist.scatter(out, [readonly(np.array([10 * r], np.int64)) for r in range(world_size)] if rank == 0 else None, src=0)
    assert out[0] == 10 * rank
    gl = [np.zeros(1, np.int64) for _ in range(world_size)] if rank == 0 else None
    dist.gather(readonly(np.array([rank], np.int64)), gl, dst=0)
    if rank == 0:
        assert [int(g[0]) for g in gl] == list(range(world_size))
    a2a = np.zeros(world_size, np.int64)
    dist.all_to_all_single(a2a, readonly(np.arange(world_size, dtype=np.int64) + 100 * rank))
    np.testing.assert_array_equal(a2a, 100 * np.arange(world_size) + rank)
    rs = np.zeros(1, np.int64)
    dist.reduce_scatter_tensor(rs, readonly(np.arange(world_size, dtype=np.int64)))
    assert rs[0] == world_size * rank


def test_read_only_reduce_target_on_the_destination(rank):
    """Only the destination fails (the others do not call here): it refuses the group afterwards,
    since in a program where the others did call, their data would wait there (tests/hostile/test_role_errors.py)."""
    g = dist.new_group()
    if rank == 0:
        problems = check_raises(
            ValueError, r"^reduce: tensor is read-only", dist.reduce, readonly(np.ones(2)), dst=0, group=g
        )
        if SIZE > 1:
            problems += check_raises(DistError, r"unusable on this rank: reduce", dist.all_reduce, f64(), group=g)
    else:
        problems = []
    problems += group_works()
    fail_together(problems)
    dist.destroy_process_group(g)


def test_read_only_receive_targets():
    problems = check_raises(ValueError, r"^irecv: tensor is read-only", dist.irecv, readonly(np.zeros(2)), src=PEER)
    if SIZE > 1:
        problems += check_raises(ValueError, r"^recv: tensor is read-only", dist.recv, readonly(np.zeros(2)), src=PEER)
    problems += group_works()
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_batch_isend_irecv_validates_everything_before_posting():
    prev = (RANK - 1) % SIZE
    bad = [
        dist.P2POp(dist.isend, np.full(2, 111.0), PEER, tag=5),
        dist.P2POp(dist.irecv, readonly(np.zeros(2)), prev, tag=5),
    ]
    problems = check_raises(
        ValueError, r"^batch_isend_irecv: p2p_op_list\[1\] \(irecv\): tensor is read-only", dist.batch_isend_irecv, bad
    )
    # had the first send been posted, this receive would get 111s instead of the sender's rank
    got = np.zeros(2)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, np.full(2, float(RANK)), PEER, tag=5), dist.P2POp(dist.irecv, got, prev, tag=5)]
    )
    for w in works:
        w.wait()
    if got.tolist() != [float(prev)] * 2:
        problems.append(f"received {got}, expected {prev}s: a send of the failed batch was posted")
    fail_together(problems)


# -- dtypes and sizes that do not fit -----------------------------------------------------


def test_dtype_mismatch():
    cases = [
        (r"^all_gather: tensor_list\[0\] is int64 but tensor is float64; dtypes must match",
         dist.all_gather, [np.zeros(2, np.int64) for _ in range(SIZE)], np.zeros(2)),
        (r"^all_gather_into_tensor: output_tensor is float32 but input_tensor is float64; dtypes must match",
         dist.all_gather_into_tensor, np.zeros(2 * SIZE, np.float32), np.zeros(2)),
        (r"^reduce_scatter_tensor: output is int32 but input is int64; dtypes must match",
         dist.reduce_scatter_tensor, np.zeros(2, np.int32), np.zeros(2 * SIZE, np.int64)),
        (r"^reduce_scatter: input_list\[0\] is float32 but output is float64; dtypes must match",
         dist.reduce_scatter, np.zeros(2), [np.zeros(2, np.float32) for _ in range(SIZE)]),
        (r"^all_to_all_single: output is uint8 but input is int8; dtypes must match",
         dist.all_to_all_single, np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.int8)),
        (r"^all_to_all: input_tensor_list\[0\] is complex64 but output_tensor_list\[0\] is complex128",
         dist.all_to_all, [np.zeros(1, np.complex128) for _ in range(SIZE)], [np.zeros(1, np.complex64) for _ in range(SIZE)]),
    ]  # fmt: skip
    for match, fn, *args in cases:
        expect_error_then_working_group(TypeError, match, fn, *args)


def test_byte_order_mismatch_is_reported_as_byte_order():
    """A native output with a big-endian input: the error must point at the byte order, not "float64 vs float64"."""
    expect_error_then_working_group(
        TypeError, r"^all_gather_into_tensor: input_tensor has non-native byte order \(>f8\)",
        dist.all_gather_into_tensor, np.zeros(2 * SIZE), np.zeros(2, ">f8"),
    )  # fmt: skip
    expect_error_then_working_group(
        TypeError, r"^all_to_all_single: input has non-native byte order \(>i8\)",
        dist.all_to_all_single, np.zeros(SIZE, np.int64), np.zeros(SIZE, ">i8"),
    )  # fmt: skip


def test_dtype_mismatch_in_rooted_collectives():
    """Only the root calls (its list is checked there): it raises, then refuses the group it failed on."""
    g = dist.new_group()
    problems: list[str] = []
    if RANK == 0:
        problems += check_raises(
            TypeError, r"^scatter: scatter_list\[0\] is int32 but tensor is float64",
            dist.scatter, np.zeros(1), [np.zeros(1, np.int32) for _ in range(SIZE)], src=0, group=g,
        )  # fmt: skip
        problems += check_raises(
            TypeError, r"^gather: gather_list\[0\] is int32 but tensor is float64",
            dist.gather, np.zeros(1), [np.zeros(1, np.int32) for _ in range(SIZE)], dst=0, group=g,
        )  # fmt: skip
        problems += refused_after_role_failure(g)
    problems += group_works()
    fail_together(problems)
    dist.destroy_process_group(g)


def refused_after_role_failure(g) -> list[str]:
    """With peers, a group on which only this rank's role check failed refuses further calls."""
    if SIZE == 1:
        return []
    return check_raises(DistError, r"unusable on this rank: \w+ \(call #\d+\) failed on this rank only",
                        dist.all_reduce, f64(), group=g)  # fmt: skip


def test_wrong_list_length():
    n = SIZE
    cases = [
        (ValueError, rf"^all_gather: tensor_list has {n + 1} arrays but the group has {n} ranks; pass one per rank",
         dist.all_gather, [np.zeros(1) for _ in range(n + 1)], np.zeros(1)),
        (ValueError, rf"^reduce_scatter: input_list has {n + 2} arrays but the group has {n} ranks",
         dist.reduce_scatter, np.zeros(1), [np.zeros(1) for _ in range(n + 2)]),
        (ValueError, rf"^all_to_all: output_tensor_list has {n - 1} arrays but the group has {n} ranks",
         dist.all_to_all, [np.zeros(1) for _ in range(n - 1)], [np.zeros(1) for _ in range(n)]),
        (ValueError, rf"^all_to_all: input_tensor_list has {n + 1} arrays but the group has {n} ranks",
         dist.all_to_all, [np.zeros(1) for _ in range(n)], [np.zeros(1) for _ in range(n + 1)]),
        (TypeError, r"^all_gather: tensor_list must be a list of arrays, got ndarray",
         dist.all_gather, np.zeros((n, 1)), np.zeros(1)),
    ]  # fmt: skip
    for exc, match, fn, *args in cases:
        expect_error_then_working_group(exc, match, fn, *args)


def test_wrong_list_length_on_the_root():
    """Only the root calls (its list is checked there): it raises, then refuses the group it failed on."""
    g = dist.new_group()
    problems: list[str] = []
    if RANK == 0:
        problems += check_raises(
            ValueError, rf"^gather: gather_list has {SIZE + 1} arrays but the group has {SIZE} ranks",
            dist.gather, np.zeros(1), [np.zeros(1) for _ in range(SIZE + 1)], dst=0, group=g,
        )  # fmt: skip
        problems += check_raises(
            ValueError, rf"^scatter: scatter_list has {SIZE + 1} arrays but the group has {SIZE} ranks",
            dist.scatter, np.zeros(1), [np.zeros(1) for _ in range(SIZE + 1)], src=0, group=g,
        )  # fmt: skip
        problems += refused_after_role_failure(g)
    problems += group_works()
    fail_together(problems)
    dist.destroy_process_group(g)


def test_own_slot_size_mismatch():
    outs = [np.zeros(2) for _ in range(SIZE)]
    outs[RANK] = np.zeros(3)  # every rank makes its own slot too big
    expect_error_then_working_group(
        ValueError, rf"^all_gather: tensor_list\[{RANK}\] \(this rank's slot\) has 3 elements but tensor has 2",
        dist.all_gather, outs, np.zeros(2),
    )  # fmt: skip


def test_wrong_output_size():
    n = SIZE
    expect_error_then_working_group(
        ValueError,
        rf"^all_gather_into_tensor: output_tensor has {2 * n + 1} elements but must have world_size \* "
        rf"input_tensor.size = {n} \* 2 = {2 * n}",
        dist.all_gather_into_tensor, np.zeros(2 * n + 1), np.zeros(2),
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError,
        rf"^reduce_scatter_tensor: input has {3 * n - 1} elements but must have world_size \* output.size = "
        rf"{n} \* 3 = {3 * n}",
        dist.reduce_scatter_tensor, np.zeros(3), np.zeros(3 * n - 1),
    )  # fmt: skip


def test_block_shapes_that_are_neither_concatenated_nor_stacked():
    """The right number of elements in the wrong shape (torch's gloo refuses it too): the inputs would land
    in flat order, not along the first dimension."""
    n = SIZE
    expect_error_then_working_group(
        ValueError,
        rf"^all_gather_into_tensor: output_tensor has shape \(3, {2 * n}\); for input_tensor of shape \(2, 3\) "
        rf"on {n} ranks it must be \({2 * n}, 3\) \(concatenated\) or \({n}, 2, 3\) \(stacked\)$",
        dist.all_gather_into_tensor, np.zeros((3, 2 * n)), np.zeros((2, 3)),
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError,
        rf"^reduce_scatter_tensor: input has shape \({6 * n},\); for output of shape \(2, 3\) on {n} ranks",
        dist.reduce_scatter_tensor, np.zeros((2, 3)), np.zeros(6 * n),
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError,  # a 0-d input has no first dimension: only the stacked form
        rf"^all_gather_into_tensor: output_tensor has shape \(1, {n}\); for input_tensor of shape \(\) on {n} "
        rf"ranks it must be \({n},\) \(stacked\)$",
        dist.all_gather_into_tensor, np.zeros((1, n)), np.zeros(()),
    )  # fmt: skip


@pytest.mark.parametrize("form", ["concatenated", "stacked"])
def test_block_shapes_of_both_forms(form):
    """Both of torch's forms: rank r's (2, 3) block lands at [r] (stacked) or rows 2r, 2r + 1 (concatenated)."""
    n = SIZE
    mine = np.arange(6.0).reshape(2, 3) + 100 * RANK
    blocks = np.stack([np.arange(6.0).reshape(2, 3) + 100 * r for r in range(n)])
    shape = (2 * n, 3) if form == "concatenated" else (n, 2, 3)
    out = np.zeros(shape)
    dist.all_gather_into_tensor(out, mine)
    problems = [] if np.array_equal(out, blocks.reshape(shape)) else [f"all_gather_into_tensor {form}: {out}"]
    part = np.zeros((2, 3))
    dist.reduce_scatter_tensor(part, blocks.reshape(shape))
    if not np.array_equal(part, n * blocks[RANK]):
        problems.append(f"reduce_scatter_tensor {form}: {part}, expected {n * blocks[RANK]}")
    x = np.zeros(n)
    dist.all_gather_into_tensor(x, np.array(float(RANK)))  # 0-d inputs, stacked
    if x.tolist() != [float(r) for r in range(n)]:
        problems.append(f"0-d inputs stacked: {x}")
    fail_together(problems)


# -- all_to_all_single split sizes --------------------------------------------------------


def test_split_sizes_that_do_not_sum_to_the_rows():
    splits = [10] + [0] * (SIZE - 1)
    expect_error_then_working_group(
        ValueError, r"^all_to_all_single: input_split_sizes sums to 10 but input has 8 rows$",
        dist.all_to_all_single, np.zeros(8), np.zeros(8), None, splits,
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError, r"^all_to_all_single: output_split_sizes sums to 10 but output has 8 rows$",
        dist.all_to_all_single, np.zeros((8, 3)), np.zeros((8, 3)), splits, [8] + [0] * (SIZE - 1),
    )  # fmt: skip


def test_wrong_number_of_splits():
    n = SIZE
    expect_error_then_working_group(
        ValueError, rf"^all_to_all_single: input_split_sizes has {n + 1} entries but the group has {n} ranks",
        dist.all_to_all_single, np.zeros(8), np.zeros(8), None, [8] + [0] * n,
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError, rf"^all_to_all_single: output_split_sizes has {n + 1} entries but the group has {n} ranks",
        dist.all_to_all_single, np.zeros(8), np.zeros(8), [8] + [0] * n, [8] + [0] * (n - 1),
    )  # fmt: skip


@pytest.mark.parametrize("shape", [(8,), (8, 3)], ids=["rows of one element", "rows of three"])
def test_negative_split(shape):
    """The message shows the split sizes given (rows), not element counts."""
    splits = [-1] + [9] + [0] * (SIZE - 2) if SIZE > 1 else [-1]
    expect_error_then_working_group(
        ValueError, rf"^all_to_all_single: input_split_sizes must not contain negative sizes, got \{splits}$",
        dist.all_to_all_single, np.zeros(shape), np.zeros(shape), None, splits,
    )  # fmt: skip


def test_split_sizes_of_the_wrong_type():
    expect_error_then_working_group(
        TypeError, r"^all_to_all_single: input_split_sizes must be a list of ints, got str",
        dist.all_to_all_single, np.zeros(8), np.zeros(8), None, "8",
    )  # fmt: skip
    expect_error_then_working_group(
        TypeError, r"^all_to_all_single: input_split_sizes must be an int",
        dist.all_to_all_single, np.zeros(8), np.zeros(8), None, [8.0] + [0] * (SIZE - 1),
    )  # fmt: skip
    # every entry is converted before the sizes are judged: a float after a negative size is the TypeError
    expect_error_then_working_group(
        TypeError, r"^all_to_all_single: input_split_sizes must be an int",
        dist.all_to_all_single, np.zeros(8), np.zeros(8), None, [-1, 9.0] + [0] * (SIZE - 2) if SIZE > 1 else [-1.0],
    )  # fmt: skip


@pytest.mark.mpi(min_size=2)
def test_rows_that_do_not_split_evenly():
    rows = 2 * SIZE + 1
    expect_error_then_working_group(
        ValueError, rf"^all_to_all_single: input has {rows} rows, which do not split evenly over {SIZE} ranks; pass input_split_sizes",
        dist.all_to_all_single, np.zeros(rows), np.zeros(rows),
    )  # fmt: skip


def test_row_shapes_that_differ():
    expect_error_then_working_group(
        ValueError, r"^all_to_all_single: rows of output \(3,\) and input \(2,\) must have the same shape",
        dist.all_to_all_single, np.zeros((SIZE, 3)), np.zeros((SIZE, 2)),
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError, r"^all_to_all_single: output and input need at least one dimension",
        dist.all_to_all_single, np.zeros(()), np.zeros(()),
    )  # fmt: skip
    expect_error_then_working_group(
        ValueError, rf"^all_to_all_single: output has {2 * SIZE} rows but input has {SIZE}; with even splits they must match",
        dist.all_to_all_single, np.zeros(2 * SIZE), np.zeros(SIZE),
    )  # fmt: skip


# -- ranks ---------------------------------------------------------------------------------


_BAD_RANKS = {
    "broadcast src": (
        lambda: dist.broadcast(f64(), src=SIZE),
        rf"^broadcast: src={SIZE} is not a member of process group",
    ),
    "broadcast src -1": (lambda: dist.broadcast(f64(), src=-1), r"^broadcast: src=-1 is not a member"),
    "broadcast group_src": (
        lambda: dist.broadcast(f64(), group_src=SIZE),
        rf"^broadcast: group_src={SIZE} is out of range for a group of size {SIZE}",
    ),
    "reduce dst": (lambda: dist.reduce(f64(), dst=SIZE + 3), rf"^reduce: dst={SIZE + 3} is not a member"),
    "reduce group_dst": (lambda: dist.reduce(f64(), group_dst=-1), r"^reduce: group_dst=-1 is out of range"),
    "gather dst": (lambda: dist.gather(f64(), None, dst=SIZE), rf"^gather: dst={SIZE} is not a member"),
    "scatter src": (lambda: dist.scatter(f64(), None, src=SIZE), rf"^scatter: src={SIZE} is not a member"),
    "isend dst": (lambda: dist.isend(f64(), dst=SIZE), rf"^isend: dst={SIZE} is not a member"),
    "irecv src": (lambda: dist.irecv(f64(), src=SIZE), rf"^irecv: src={SIZE} is not a member"),
    "send group_dst": (lambda: dist.send(f64(), group_dst=SIZE), rf"^send: group_dst={SIZE} is out of range"),
    "recv src": (lambda: dist.recv(f64(), src=SIZE + 1), rf"^recv: src={SIZE + 1} is not a member"),
}


@pytest.mark.parametrize("case", sorted(_BAD_RANKS))
def test_rank_out_of_range(case):
    call, match = _BAD_RANKS[case]
    problems = check_raises(dist.RankNotInGroupError, match, call)
    try:
        call()
    except ValueError:  # RankNotInGroupError is a ValueError ...
        pass
    except Exception as e:  # noqa: BLE001
        problems.append(f"not a ValueError: {e!r}")
    try:
        call()
    except RuntimeError:  # ... and a RuntimeError, as torch documents
        pass
    except Exception as e:  # noqa: BLE001
        problems.append(f"not a RuntimeError: {e!r}")
    problems += group_works()
    fail_together(problems)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: dist.broadcast(f64(), src="0"), r"^broadcast: src must be an int rank, got str"),
        (lambda: dist.broadcast(f64(), src=0.0), r"^broadcast: src must be an int rank, got float"),
        (lambda: dist.reduce(f64(), group_dst=True), r"^reduce: group_dst must be an int rank, got bool"),
    ],
    ids=["str", "float", "bool"],
)
def test_rank_of_the_wrong_type(call, match):
    expect_error_then_working_group(TypeError, match, call)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: dist.broadcast(f64(), src=0, group_src=0), r"^broadcast: pass either src \(global rank\) or group_src \(group rank\), not both"),
        (lambda: dist.reduce(f64(), dst=0, group_dst=0), r"^reduce: pass either dst \(global rank\) or group_dst \(group rank\), not both"),
        (lambda: dist.gather(f64(), None, dst=0, group_dst=0), r"^gather: pass either dst .* not both"),
        (lambda: dist.scatter(f64(), None, src=0, group_src=0), r"^scatter: pass either src .* not both"),
        (lambda: dist.isend(f64(), dst=PEER, group_dst=PEER), r"^isend: pass either dst .* not both"),
        (lambda: dist.irecv(f64(), src=PEER, group_src=PEER), r"^irecv: pass either src .* not both"),
        (lambda: dist.broadcast_object_list([1], src=0, group_src=0), r"^broadcast_object_list: pass either src .* not both"),
        (lambda: dist.broadcast(f64()), r"^broadcast: src \(a global rank\) or group_src \(a group rank\) is required"),
        (lambda: dist.reduce(f64()), r"^reduce: dst \(a global rank\) or group_dst \(a group rank\) is required"),
    ],
    ids=["broadcast", "reduce", "gather", "scatter", "isend", "irecv", "broadcast_object_list", "no-src", "no-dst"],
)  # fmt: skip
def test_src_and_group_src_together(call, match):
    expect_error_then_working_group(ValueError, match, call)


# -- mpidist.arrays.host ---------------------------------------------------------------------


class CopyCounter:
    """Count the staging copies recorded in world.stats while in the block."""

    def __enter__(self):
        self.copies0, self.bytes0 = world.stats.copies, world.stats.copied_bytes
        return self

    def __exit__(self, *exc):
        self.copies = world.stats.copies - self.copies0
        self.bytes = world.stats.copied_bytes - self.bytes0
        return False


def test_prepare_input_passes_contiguous_arrays_through():
    for a in (np.arange(6.0), np.arange(6.0).reshape(2, 3), np.array(3.0), np.zeros(0), readonly(np.ones(4))):
        with CopyCounter() as c:
            assert _arrays.prepare_input(a, "fn", "arg") is a
        assert c.copies == 0 and c.bytes == 0


@pytest.mark.parametrize(
    "make",
    [lambda: np.arange(12.0)[::2], lambda: np.arange(12.0).reshape(3, 4).T, lambda: np.asfortranarray(np.ones((3, 4))),
     lambda: np.arange(24, dtype=np.int32).reshape(4, 6)[:, 1:3]],
    ids=["strided", "transposed", "fortran", "column-slice"],
)  # fmt: skip
def test_prepare_input_stages_non_contiguous_arrays(make):
    a = make()
    with CopyCounter() as c:
        buf = _arrays.prepare_input(a, "fn", "arg")
    assert buf is not a
    assert buf.flags.c_contiguous
    assert buf.dtype == a.dtype and buf.shape == a.shape
    np.testing.assert_array_equal(buf, a)
    assert not np.shares_memory(buf, a)
    assert (c.copies, c.bytes) == (1, a.nbytes)


def test_prepare_inout():
    a = np.arange(6.0)
    with CopyCounter() as c:
        buf, target = _arrays.prepare_inout(a, "fn", "arg")
    assert buf is a and target is None and c.copies == 0
    s = np.arange(12.0)[::2]
    with CopyCounter() as c:
        buf, target = _arrays.prepare_inout(s, "fn", "arg")
    assert target is s
    assert buf.flags.c_contiguous and not np.shares_memory(buf, s)
    np.testing.assert_array_equal(buf, s)  # an in/out buffer starts with the data
    assert (c.copies, c.bytes) == (1, s.nbytes)
    with pytest.raises(ValueError, match=r"^fn: arg is read-only; outputs must be writeable arrays"):
        _arrays.prepare_inout(readonly(np.ones(3)), "fn", "arg")
    with pytest.raises(ValueError, match=r"^fn: arg is read-only"):
        _arrays.prepare_inout(readonly(np.ones(6))[::2], "fn", "arg")


def test_prepare_output():
    a = np.zeros((2, 3), np.int16)
    buf, target = _arrays.prepare_output(a, "fn", "arg")
    assert buf is a and target is None
    s = np.zeros((4, 6), np.int16)[:, ::2]
    with CopyCounter() as c:
        buf, target = _arrays.prepare_output(s, "fn", "arg")
    assert target is s
    assert buf.shape == s.shape and buf.dtype == s.dtype and buf.flags.c_contiguous
    assert not np.shares_memory(buf, s)
    assert (c.copies, c.bytes) == (1, s.nbytes)
    with pytest.raises(ValueError, match=r"^fn: arg is read-only"):
        _arrays.prepare_output(readonly(np.zeros(2)), "fn", "arg")


def test_prepare_functions_name_the_function_and_argument():
    cases = [
        (
            [1, 2],
            r"^myfn: myarg must be an array \(numpy\.ndarray, torch\.Tensor, .*\), got builtins\.list; convert it with numpy\.asarray",
        ),
        (np.array([None, 1]), r"^myfn: myarg has dtype object"),
        (np.zeros(3, dtype=[("a", "i4")]), r"^myfn: myarg has dtype structured"),
        (np.zeros(3, ">f4"), r"^myfn: myarg has non-native byte order \(>f4\)"),
        (np.zeros(3, ">f4")[::2], r"^myfn: myarg has non-native byte order \(>f4\)"),
        (np.ma.masked_array(np.zeros(3)), r"^myfn: myarg is a numpy masked array"),
    ]
    problems = []
    for prep in (_arrays.prepare_input, _arrays.prepare_inout, _arrays.prepare_output):
        for value, match in cases:
            problems += [
                f"{prep.__name__}({_arrays.describe(value)}): {p}"
                for p in check_raises(TypeError, match, prep, value, "myfn", "myarg")
            ]
    assert not problems, problems


def test_prepare_lists():
    xs = [np.zeros(2), np.zeros(4)[::2], np.zeros(2)]
    with CopyCounter() as c:
        bufs = _arrays.prepare_input_list(xs, "fn", "xs", 3)
    assert bufs[0] is xs[0] and bufs[2] is xs[2] and bufs[1] is not xs[1]
    assert c.copies == 1
    bufs, backs = _arrays.prepare_output_list(xs, "fn", "xs", 3)
    assert len(backs) == 1 and backs[0][1] is xs[1] and backs[0][0] is bufs[1]
    with pytest.raises(ValueError, match=r"^fn: xs has 3 arrays but the group has 2 ranks; pass one per rank"):
        _arrays.prepare_input_list(xs, "fn", "xs", 2)
    with pytest.raises(TypeError, match=r"^fn: xs\[1\] must be an array \(numpy\.ndarray, torch\.Tensor, .*\), got"):
        _arrays.prepare_input_list([np.zeros(1), 5], "fn", "xs")
    with pytest.raises(ValueError, match=r"^fn: xs\[0\] is read-only"):
        _arrays.prepare_output_list([readonly(np.zeros(1))], "fn", "xs")
    with pytest.raises(TypeError, match=r"^fn: xs must be a list of arrays, got dict"):
        _arrays.prepare_output_list({}, "fn", "xs")


def test_write_back():
    target = np.zeros((4, 6))[:, 1::2]
    buf = np.arange(12.0)
    _arrays.write_back(buf, target)
    np.testing.assert_array_equal(target, np.arange(12.0).reshape(4, 3))
    target2 = np.zeros(5)[::2]
    _arrays.write_back(np.array([1.0, 2.0, 3.0]), target2)
    np.testing.assert_array_equal(target2, [1.0, 2.0, 3.0])


def test_may_overlap():
    a = np.arange(10.0)
    b = np.arange(10.0)
    assert _arrays.may_overlap(a, b) is False  # separate allocations
    assert _arrays.may_overlap(a, a) is True
    assert _arrays.may_overlap(a, a[3:5]) is True
    assert _arrays.may_overlap(a[2:6], a[4:8]) is True
    assert _arrays.may_overlap(a.reshape(2, 5), a[7:]) is True
    assert _arrays.may_overlap(a.reshape(2, 5).T, a) is True
    assert _arrays.may_overlap(a[:5], b[5:]) is False


def _c_and_python():
    """(name, C function, Python function) of the array layer's checks; skipped where the C module is not built."""
    names = ("prepare_input", "prepare_output", "prepare_inout", "prepare_pair", "may_overlap", "byte_spans")
    if _arrays.prepare_input is _arrays.IN_PYTHON[0]:
        pytest.skip("mpidist.arrays._ready was not built")
    return [(n, getattr(_arrays, n), py) for n, py in zip(names, _arrays.IN_PYTHON)]


class _Sub(np.ndarray):
    pass


def _array_cases() -> list:
    """Arrays ready as they are and arrays that are not, for each reason."""
    base = np.arange(24.0)
    readonly = np.arange(4)
    readonly.flags.writeable = False
    cases = [
        np.ones(3), np.zeros((2, 3), np.float32), np.empty(0), np.array(5, np.int8), base[4:10],  # ready
        np.ones(3, ml_dtypes.bfloat16), np.zeros(2, np.complex64), np.zeros(4, bool),
        base[::2], base.reshape(4, 6).T, readonly,  # strided, transposed, read-only
        np.array(["a"]), np.zeros(2, ">f8"), np.zeros(2, [("x", "i4")]),  # unsupported dtypes
        np.ma.masked_array([1.0, 2.0], mask=[0, 1]), np.ones(2).view(_Sub),  # subclasses
        [1.0, 2.0], 3.0, None,  # not arrays
    ]  # fmt: skip
    return cases


def _outcome(fn, *args):
    """What ``fn(*args)`` gives: its result (arrays by identity or values) or the exception it raises."""
    try:
        result = fn(*args)
    except (TypeError, ValueError) as exc:
        return (type(exc), str(exc))
    parts = result if isinstance(result, tuple) else (result,)
    return tuple(
        ("same", id(p)) if any(p is a for a in args) else (type(p), None if p is None else np.asarray(p).tobytes())
        for p in parts
    )


def test_the_checks_in_c_answer_as_the_python_functions():
    """arrays/_ready.c answers ready arrays itself and must agree with host.py on every case, either way."""
    checks = _c_and_python()
    cases = _array_cases()
    for name, c, py in checks:
        if name == "byte_spans":
            base = np.arange(24.0)
            lists = [
                [], [np.ones(3)], [np.ones(3), np.zeros(0), np.arange(4, dtype=np.int8)],  # separate, one empty
                [base[:12], base[12:]], [base[12:], base[:13]], [base[:6], base[6:12], base[3:4]],  # views: apart, not
                [np.zeros(0), np.zeros(0)], [base, base], (base[:2], base[4:8]),  # only empty; twice the same; tuple
                [base[::2]], [base.reshape(4, 6).T],  # not C-contiguous: Python's answer
            ]  # fmt: skip
            for arrays in lists:
                assert c(arrays) == py(arrays), [a.shape for a in arrays]
            counts, addrs, lo, hi, apart = c([base[4:8], base[:2]])
            start = base.__array_interface__["data"][0]
            assert (counts, addrs, lo, hi, apart) == ([32, 16], [start + 32, start], start, start + 64, True)
            continue
        if name == "may_overlap":
            base = np.arange(24.0)
            pairs = [
                (base, base), (base[:12], base[12:]), (base[:13], base[12:]), (base[::2], base[1::2]),
                (base.reshape(4, 6).T, base[23:]), (base[::-1], base[:1]), (base[:0], base), (base, np.arange(3.0)),
                (base.reshape(4, 6)[:, :2], base.reshape(4, 6)[:, 2:]),
            ]  # fmt: skip
            for a, b in pairs:
                assert c(a, b) is py(a, b) is bool(np.may_share_memory(a, b)), (a.shape, b.shape)
            continue
        for x in cases:
            if name == "prepare_pair":
                for y in cases[:8]:
                    assert _outcome(c, x, y, "f", "o", "i") == _outcome(py, x, y, "f", "o", "i"), (name, x, y)
            else:
                assert _outcome(c, x, "f", "a") == _outcome(py, x, "f", "a"), (name, x)
                assert _outcome(c, x, "f", "a", 3) == _outcome(py, x, "f", "a", 3), (name, x)


def _tensor_cases(torch) -> list:
    """CPU tensors the C check makes views of, and tensors it must leave to host.py, for each reason."""
    base = torch.arange(24.0)
    z = torch.tensor([1 + 2j, 3 - 4j])
    cases = [
        torch.ones(3), base.reshape(4, 6), base[4:10], torch.tensor(2.5), torch.ones(0, 3), torch.ones(3, 1, 2),
        torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16), z, torch.zeros(2, dtype=torch.bool),
        torch.arange(5, dtype=torch.uint8), torch.ones(2, requires_grad=True), torch.nn.Parameter(torch.ones(2)),
        base.reshape(4, 6).T, base[::2], torch.ones(1).expand(4),  # not C-contiguous: staged by host.py
        z.conj(), z.conj().imag, torch.ones(2).to_sparse(),  # conjugate / negative bit, sparse
        torch.ones(2, dtype=torch.float8_e4m3fn) if hasattr(torch, "float8_e4m3fn") else None,  # not sent by mpidist
    ]  # fmt: skip
    class Sub(torch.Tensor):
        pass

    return [c for c in cases if c is not None] + [torch.ones(2).as_subclass(Sub)]


def test_the_checks_in_c_make_torch_views_as_host_py_does():
    """Plain CPU tensors: the view made in C (arrays/_ready.c tensor_view) has host_view's dtype, shape, strides,
    address and base, writes land in the tensor, the storage stays resizable; every other tensor goes to
    host.py, so both answer (results or errors) the same."""
    torch = pytest.importorskip("torch")
    checks = _c_and_python()
    from mpidist.arrays import _ready

    _arrays.host_view(torch.ones(1))  # binds torch in C
    for t in _tensor_cases(torch):
        view = _ready.tensor_view(t)
        plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided
        fast = plain and t.is_contiguous() and not (t.is_conj() or t.is_neg()) and t.dtype in world.torch_dtypes
        fast = fast and t.data_ptr() != 0  # empty tensors: host.py
        assert (view is not None) == fast, (t.dtype, t.shape, view)
        if fast:
            ref = _arrays.host_view(t)
            assert (view.dtype, view.shape, view.strides) == (ref.dtype, ref.shape, ref.strides), t
            assert view.__array_interface__["data"][0] == t.data_ptr() and view.base is t
            assert view.flags.writeable and view.flags.c_contiguous
        for name, c, py in checks:
            if name in ("may_overlap", "byte_spans"):
                continue
            if name == "prepare_pair":
                for u in (torch.ones(3), torch.arange(6.0)[::2], np.ones(2)):
                    assert _outcome(c, t, u, "f", "o", "i") == _outcome(py, t, u, "f", "o", "i"), (t, u)
                    assert _outcome(c, u, t, "f", "o", "i") == _outcome(py, u, t, "f", "o", "i"), (u, t)
            else:
                assert _outcome(c, t, "f", "a") == _outcome(py, t, "f", "a"), (name, t)
    t = torch.zeros(4)
    view = _arrays.prepare_inout(t, "f", "a")[0]
    view += 3
    assert t.tolist() == [3.0] * 4, "the view does not write into the tensor"
    del view
    t.resize_(100)  # gloo leaves tensors resizable (DDP's PowerSGD hook resizes its buffers): so must mpidist
    assert t.shape == (100,)


def test_the_checks_in_c_pass_ready_arrays_through_without_a_copy():
    _c_and_python()
    a, b = np.ones(4), np.zeros(4)
    assert _arrays.prepare_input(a, "f", "a") is a
    assert _arrays.prepare_output(a, "f", "a") == (a, None)
    assert _arrays.prepare_output(a, "f", "a")[0] is a
    out, target, inp = _arrays.prepare_pair(a, b, "f", "o", "i")
    assert out is a and target is None and inp is b
    assert _arrays.prepare_input(a, "f", arg="a") is a  # keywords reach the same answer


def test_dtype_info():
    expected_kinds = {
        np.bool_: "b", np.int8: "i", np.int16: "i", np.int32: "i", np.int64: "i",
        np.uint8: "u", np.uint16: "u", np.uint32: "u", np.uint64: "u",
        np.float16: "f", np.float32: "f", np.float64: "f", np.complex64: "c", np.complex128: "c",
    }  # fmt: skip
    for t, k in expected_kinds.items():
        info = _arrays.dtype_info(np.dtype(t), "fn", "arg")
        assert info.kind == k and info.dtype == np.dtype(t) and info.name == np.dtype(t).name
    bf = _arrays.dtype_info(BF16, "fn", "arg")
    assert bf.kind == "f" and bf.name == "bfloat16"
    assert set(_arrays.DTYPES) == {np.dtype(t) for t in expected_kinds} | {BF16}
    assert _arrays.dtype_info(np.dtype("<f8"), "fn", "arg").name == "float64"  # native order spelled out
    with pytest.raises(
        TypeError, match=r"^fn: arg has dtype object, which mpidist does not send; supported: .*bfloat16"
    ):
        _arrays.dtype_info(np.dtype(object), "fn", "arg")
    with pytest.raises(TypeError, match=r"^fn: arg has non-native byte order \(>u2\)"):
        _arrays.dtype_info(np.dtype(">u2"), "fn", "arg")
    with pytest.raises(TypeError, match=r"^fn: arg has dtype structured"):
        _arrays.dtype_info(np.dtype([("a", "i4")]), "fn", "arg")
    assert "float64" in repr(_arrays.dtype_info(np.dtype(np.float64), "fn", "arg"))


def test_describe_and_as_array():
    assert _arrays.describe(np.zeros((4, 2))) == "float64[4, 2]"
    assert _arrays.describe(np.zeros((), np.int8)) == "int8[]"
    assert _arrays.describe([1, 2]) == "list"
    s = np.arange(10.0)[::3]
    assert _arrays.as_array(s, "fn", "arg") is s  # any layout, no staging
    with pytest.raises(ValueError, match=r"^fn: arg is read-only"):
        _arrays.as_array(readonly(np.zeros(2)), "fn", "arg", writeable=True)
    with pytest.raises(TypeError, match=r"^fn: arg has dtype str"):
        _arrays.as_array(np.array(["x"]), "fn", "arg")


# -- staging counted through collectives ---------------------------------------------------


def test_contiguous_arrays_are_not_copied(rank, world_size):
    x = np.full(1000, rank + 1.0)
    with CopyCounter() as c:
        dist.all_reduce(x)
        b = np.arange(100.0) if rank == 0 else np.zeros(100)
        dist.broadcast(b, src=0)
        out = np.zeros(10 * world_size)
        dist.all_gather_into_tensor(out, np.full(10, float(rank)))
    assert (c.copies, c.bytes) == (0, 0)
    np.testing.assert_array_equal(x, np.full(1000, world_size * (world_size + 1) / 2))
    np.testing.assert_array_equal(b, np.arange(100.0))
    np.testing.assert_array_equal(out, np.repeat(np.arange(float(world_size)), 10))


def test_non_contiguous_arrays_are_staged_once(rank, world_size):
    base = np.zeros((50, 2))
    base[:, 0] = rank + 1
    x = base[:, 0]  # strided column
    with CopyCounter() as c:
        dist.all_reduce(x)
    assert (c.copies, c.bytes) == (1, x.nbytes)
    np.testing.assert_array_equal(base[:, 0], np.full(50, world_size * (world_size + 1) / 2))
    np.testing.assert_array_equal(base[:, 1], np.zeros(50))  # the other column is untouched

    bbase = np.zeros((20, 3))
    if rank == 0:
        bbase[:, 1] = np.arange(20.0)
    with CopyCounter() as c:
        dist.broadcast(bbase[:, 1], src=0)
    assert (c.copies, c.bytes) == (1, 20 * 8)
    np.testing.assert_array_equal(bbase[:, 1], np.arange(20.0))
    np.testing.assert_array_equal(bbase[:, [0, 2]], np.zeros((20, 2)))

    grid = np.full((4, world_size + 1), -1, np.int64)
    outs = [grid[:, r] for r in range(world_size)]  # one non-contiguous column per rank (and a spare)
    with CopyCounter() as c:
        dist.all_gather(outs, np.full(4, rank, np.int64))
    staged = (world_size, world_size * 4 * 8)  # each column once
    # An MPI-3 library (Open MPI 5: no large counts) cannot address arrays more than 2 GiB apart in one call, so the
    # list collectives then put the whole message through one buffer (mpi.py's _vector, one copy more). The staged
    # columns are fresh arrays: where they landed far apart (CI saw it on 2 of 4 ranks, late in the suite), that
    # copy is made and counted.
    allowed = [staged] if LARGE_COUNTS else [staged, (world_size + 1, 2 * staged[1])]
    assert (c.copies, c.bytes) in allowed, ((c.copies, c.bytes), allowed)
    np.testing.assert_array_equal(grid[:, :world_size], np.tile(np.arange(world_size), (4, 1)))
    np.testing.assert_array_equal(grid[:, world_size], np.full(4, -1))
