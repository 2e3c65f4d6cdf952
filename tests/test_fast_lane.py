"""The MPI backend's fast lane takes exactly the arrays the general lane would pass through.

The fast_* methods complete the common case in one Python call; everything they
decline goes through mpidist._arrays (staging, validation, errors). These tests
pin the contract down: the fast lane never accepts an array that the general lane
would stage or reject, and it accepts every plain ready array.
"""

import ml_dtypes
import numpy as np
import pytest

import mpidist as dist
from mpidist import _arrays
from mpidist.backends.base import BaseBackend
from mpidist.backends.mpi import MPIBackend
from mpidist.errors import DistError


def _readonly(a):
    a.setflags(write=False)
    return a


VARIANTS = {
    "contiguous": lambda: np.arange(6, dtype=np.float64),
    "int32": lambda: np.arange(6, dtype=np.int32),
    "bool": lambda: np.arange(6) % 2 == 0,
    "complex": lambda: np.arange(6, dtype=np.complex64),
    "float16": lambda: np.arange(6, dtype=np.float16),
    "bfloat16": lambda: np.arange(6).astype(ml_dtypes.bfloat16),
    "zero-d": lambda: np.array(3.0),
    "empty": lambda: np.zeros(0),
    "2-d": lambda: np.arange(6.0).reshape(2, 3),
    "strided": lambda: np.arange(12.0)[::2],
    "fortran": lambda: np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    "reversed": lambda: np.arange(6.0)[::-1],
    "read-only": lambda: _readonly(np.arange(6.0)),
    "view": lambda: np.arange(12.0)[6:],
    "big-endian": lambda: np.arange(6, dtype=">f8"),
    "object": lambda: np.array([1, "a", None], dtype=object),
    "memmap-like subclass": lambda: np.arange(6.0).view(np.recarray),
    "list": lambda: [1.0, 2.0],
}


def _ready_for_inout(x) -> bool:
    copies = _arrays.world.stats.copies
    try:
        buf, target = _arrays.prepare_inout(x, "t", "x")
    except (TypeError, ValueError):
        return False
    return buf is x and target is None and _arrays.world.stats.copies == copies


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_all_reduce_accepts_only_ready_arrays(variant):
    impl = dist.group.WORLD.impl
    x = VARIANTS[variant]()
    ready = _ready_for_inout(x)
    accepted = impl.fast_all_reduce(x, dist.ReduceOp.SUM, False) is not NotImplemented
    assert not accepted or ready, f"fast lane took {variant}, which the general lane would stage or reject"
    native = ready and impl._types[x.dtype].wide is None  # bfloat16 sums need the float32 detour
    if type(x) is np.ndarray and native:
        assert accepted, f"fast lane declined a ready plain array ({variant})"


def _ready_for_input(x) -> bool:
    copies = _arrays.world.stats.copies
    try:
        buf = _arrays.prepare_input(x, "t", "x")
    except (TypeError, ValueError):
        return False
    return buf is x and _arrays.world.stats.copies == copies


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "read-only"])
def test_fast_broadcast_accepts_only_ready_arrays(variant, rank):
    # every rank decides alike for these variants, so a decline never leaves the root alone
    impl = dist.group.WORLD.impl
    x = VARIANTS[variant]()
    ready = _ready_for_input(x) if rank == 0 else _ready_for_inout(x)
    accepted = impl.fast_broadcast(x, 0, False) is not NotImplemented
    assert not accepted or ready
    if type(x) is np.ndarray and ready:
        assert accepted


def test_fast_broadcast_takes_a_read_only_array_on_its_root(rank):
    mine, _ = dist.new_subgroups(1)  # a group of one: this rank is the root
    x = _readonly(np.arange(4.0))
    assert mine.impl.fast_broadcast(x, 0, False) is None
    np.testing.assert_array_equal(x, np.arange(4.0))
    dist.destroy_process_group(mine)


def test_fast_lane_declines_ops_it_cannot_do_in_one_call():
    impl = dist.group.WORLD.impl
    x = np.arange(4.0)
    assert impl.fast_all_reduce(x, dist.ReduceOp.AVG, False) is NotImplemented
    assert impl.fast_all_reduce(x, dist.make_premul_sum(2.0), False) is NotImplemented
    assert impl.fast_all_reduce(np.arange(4), dist.ReduceOp.AVG, False) is NotImplemented
    assert impl.fast_all_reduce(x, "sum", False) is NotImplemented
    bf = np.ones(4, ml_dtypes.bfloat16)  # MPICH cannot reduce bfloat16: reduced in float32 by the general lane
    assert impl.fast_all_reduce(bf, dist.ReduceOp.SUM, False) is NotImplemented


def test_fast_pair_lanes_decline_aliasing_and_size_mismatch(world_size):
    impl = dist.group.WORLD.impl
    n = world_size
    out = np.zeros(2 * n)
    assert impl.fast_all_gather_into_tensor(out, out[:2], False) is NotImplemented  # input is a view of the output
    assert impl.fast_all_gather_into_tensor(out, np.zeros(3), False) is NotImplemented  # wrong size
    assert impl.fast_all_gather_into_tensor(out, np.zeros(2, np.float32), False) is NotImplemented  # dtypes differ
    assert impl.fast_reduce_scatter_tensor(np.zeros(2), np.zeros(2 * n + 1), dist.ReduceOp.SUM, False) is NotImplemented
    assert impl.fast_all_to_all_single(np.zeros(n + 1), np.zeros(n + 1), False) is (NotImplemented if n > 1 else None)
    a = np.zeros(2 * n)
    assert impl.fast_all_to_all_single(a, a, False) is NotImplemented


def test_fast_lane_results_match_the_general_lane(rank, world_size):
    n = world_size
    x = np.arange(8.0) + rank
    strided = np.zeros(16)[::2]
    strided[:] = x
    dist.all_reduce(x)  # fast lane
    dist.all_reduce(strided)  # general lane (staged)
    np.testing.assert_array_equal(x, strided)
    inp = np.arange(2 * n, dtype=np.int64) + 10 * rank
    fast_out, general_out = np.zeros(2, np.int64), np.zeros(4, np.int64)[::2]
    dist.reduce_scatter_tensor(fast_out, inp)
    dist.reduce_scatter_tensor(general_out, inp)
    np.testing.assert_array_equal(fast_out, general_out)
    expected = sum(np.arange(2 * n, dtype=np.int64) + 10 * r for r in range(n))[2 * rank : 2 * rank + 2]
    np.testing.assert_array_equal(fast_out, expected)


def test_subclass_overrides_switch_their_fast_lane_off():
    class CountingBroadcast(MPIBackend):
        def broadcast(self, buf, backs, root, async_op):
            return super().broadcast(buf, backs, root, async_op)

    class FastToo(MPIBackend):
        def broadcast(self, buf, backs, root, async_op):
            return super().broadcast(buf, backs, root, async_op)

        def fast_broadcast(self, tensor, root, async_op):
            return super().fast_broadcast(tensor, root, async_op)

    assert CountingBroadcast.fast_broadcast is BaseBackend.fast_broadcast
    assert CountingBroadcast.fast_all_reduce is MPIBackend.fast_all_reduce  # untouched ops keep theirs
    assert FastToo.fast_broadcast is not BaseBackend.fast_broadcast


def test_fast_lane_errors_are_backend_errors():
    assert issubclass(DistError, RuntimeError)  # what _fail wraps MPI errors into
