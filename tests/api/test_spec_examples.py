"""The examples of the torch.distributed reference (../shared/spec/torch-distributed-reference.md).

Each example in the spec assumes a world size (2, 3 or 4 ranks). Here each is
generalized to any world size with a formula for the expected output; when the
world size matches the spec's, the result is also compared with the outputs the
spec lists, literally. Tensors become numpy arrays of the matching dtype
(torch.int64 -> int64, torch.cfloat -> complex64, torch.float -> float32).
Where the spec's example has a typo (``torch.empty([4], dtype=torch.int64)`` as the
output of a complex all_to_all, ``torch.randn`` as the receive buffer of integers),
the output array takes the input's dtype, as the listed outputs show.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpidist as dist

from helpers import assert_equal, assert_identical_on_all_ranks

I8 = np.int64
C8 = np.complex64

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def check_spec(got: np.ndarray, expected: np.ndarray, spec: dict[int, list[list]], rank: int, n: int, dtype) -> None:
    """``got`` equals the general ``expected``; at the spec's world size both equal its listed output."""
    if n in spec:
        listed = np.array(spec[n][rank], dtype)
        assert_equal(expected, listed)  # the generalization reproduces the spec
    assert_equal(got, expected)


def check_spec_list(got: list[np.ndarray], expected: list[np.ndarray], spec: dict, rank: int, n: int, dtype) -> None:
    assert len(got) == len(expected)
    if n in spec:
        listed = [np.array(a, dtype) for a in spec[n][rank]]
        assert len(listed) == len(expected)
        for e, s in zip(expected, listed):
            assert_equal(e, s)
    for g, e in zip(got, expected):
        assert_equal(g, e)


# ---------------------------------------------------------------------------------------
# all_reduce
# ---------------------------------------------------------------------------------------

SPEC_ALL_REDUCE_INT = {2: [[4, 6], [4, 6]]}
SPEC_ALL_REDUCE_CFLOAT = {2: [[4 + 4j, 6 + 6j], [4 + 4j, 6 + 6j]]}


def test_all_reduce_int64(rank, world_size):
    n = world_size
    tensor = np.arange(2, dtype=I8) + 1 + 2 * rank
    if n == 2:
        assert_equal(tensor, np.array([[1, 2], [3, 4]][rank], I8))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    # sum over r of (arange(2) + 1 + 2r) = n * (arange(2) + 1) + n (n - 1)
    expected = n * (np.arange(2, dtype=I8) + 1) + n * (n - 1)
    assert_identical_on_all_ranks(tensor)
    check_spec(tensor, expected, SPEC_ALL_REDUCE_INT, rank, n, I8)


def test_all_reduce_cfloat(rank, world_size):
    n = world_size
    tensor = np.array([1 + 1j, 2 + 2j], C8) + 2 * rank * (1 + 1j)
    if n == 2:
        assert_equal(tensor, np.array([[1 + 1j, 2 + 2j], [3 + 3j, 4 + 4j]][rank], C8))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    expected = (n * np.array([1 + 1j, 2 + 2j]) + n * (n - 1) * (1 + 1j)).astype(C8)
    assert_identical_on_all_ranks(tensor)
    check_spec(tensor, expected, SPEC_ALL_REDUCE_CFLOAT, rank, n, C8)


def test_async_all_reduce_then_use_output(rank, world_size):
    """The 'Synchronous and asynchronous collective operations' example, on host arrays.

    After ``handle.wait()`` the output is final (the spec's nondeterminism is about
    CUDA streams), so adding 100 gives the spec's 101 on rank 0 with 2 ranks.
    """
    n = world_size
    output = np.array([rank], I8)
    handle = dist.all_reduce(output, async_op=True)
    handle.wait()
    output += 100
    check_spec(output, np.array([n * (n - 1) // 2 + 100], I8), {2: [[101], [101]]}, rank, n, I8)


# ---------------------------------------------------------------------------------------
# all_gather, all_gather_into_tensor
# ---------------------------------------------------------------------------------------

SPEC_ALL_GATHER_INT = {2: [[[1, 2], [3, 4]], [[1, 2], [3, 4]]]}
SPEC_ALL_GATHER_CFLOAT = {2: [[[1 + 1j, 2 + 2j], [3 + 3j, 4 + 4j]]] * 2}


def test_all_gather_int64(rank, world_size):
    n = world_size
    tensor_list = [np.zeros(2, dtype=I8) for _ in range(n)]
    tensor = np.arange(2, dtype=I8) + 1 + 2 * rank
    dist.all_gather(tensor_list, tensor)
    expected = [np.arange(2, dtype=I8) + 1 + 2 * r for r in range(n)]
    check_spec_list(tensor_list, expected, SPEC_ALL_GATHER_INT, rank, n, I8)


def test_all_gather_cfloat(rank, world_size):
    n = world_size
    tensor_list = [np.zeros(2, dtype=C8) for _ in range(n)]
    tensor = np.array([1 + 1j, 2 + 2j], C8) + 2 * rank * (1 + 1j)
    dist.all_gather(tensor_list, tensor)
    expected = [(np.array([1 + 1j, 2 + 2j]) + 2 * r * (1 + 1j)).astype(C8) for r in range(n)]
    check_spec_list(tensor_list, expected, SPEC_ALL_GATHER_CFLOAT, rank, n, C8)


SPEC_AGIT_CONCAT = {2: [[1, 2, 3, 4]] * 2}
SPEC_AGIT_STACK = {2: [[[1, 2], [3, 4]]] * 2}


def test_all_gather_into_tensor_concat_and_stack(rank, world_size):
    n = world_size
    tensor_in = np.arange(2, dtype=I8) + 1 + 2 * rank
    tensor_out = np.zeros(n * 2, dtype=I8)
    dist.all_gather_into_tensor(tensor_out, tensor_in)
    check_spec(tensor_out, np.arange(2 * n, dtype=I8) + 1, SPEC_AGIT_CONCAT, rank, n, I8)
    tensor_out2 = np.zeros((n, 2), dtype=I8)
    dist.all_gather_into_tensor(tensor_out2, tensor_in)
    check_spec(tensor_out2, (np.arange(2 * n, dtype=I8) + 1).reshape(n, 2), SPEC_AGIT_STACK, rank, n, I8)


# ---------------------------------------------------------------------------------------
# reduce_scatter_tensor
# ---------------------------------------------------------------------------------------

SPEC_RST = {2: [[0, 2], [4, 6]]}


@pytest.mark.parametrize("form", ["concat", "stack"])
def test_reduce_scatter_tensor(form, rank, world_size):
    n = world_size
    tensor_out = np.zeros(2, dtype=I8)
    tensor_in = np.arange(n * 2, dtype=I8)
    if form == "stack":
        tensor_in = tensor_in.reshape(n, 2)
    dist.reduce_scatter_tensor(tensor_out, tensor_in)
    # every rank holds arange(2n): block r of the sum is n * [2r, 2r + 1]
    check_spec(tensor_out, n * np.array([2 * rank, 2 * rank + 1], I8), SPEC_RST, rank, n, I8)


# ---------------------------------------------------------------------------------------
# all_to_all_single and all_to_all
# ---------------------------------------------------------------------------------------

SPEC_A2A_EVEN = {4: [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]}
SPEC_A2A_CFLOAT = {
    4: [
        [1 + 1j, 5 + 5j, 9 + 9j, 13 + 13j],
        [2 + 2j, 6 + 6j, 10 + 10j, 14 + 14j],
        [3 + 3j, 7 + 7j, 11 + 11j, 15 + 15j],
        [4 + 4j, 8 + 8j, 12 + 12j, 16 + 16j],
    ]
}
#: the spec's uneven example (4 ranks): rows rank r sends to rank j
SPEC_INPUT_SPLITS = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]]
SPEC_A2A_UNEVEN_INPUT = {
    4: [
        [0, 1, 2, 3, 4, 5],
        [10, 11, 12, 13, 14, 15, 16, 17, 18],
        [20, 21, 22, 23, 24],
        [30, 31, 32, 33, 34, 35, 36],
    ]
}
SPEC_OUTPUT_SPLITS = {4: [[2, 3, 2, 2], [2, 2, 1, 2], [1, 2, 1, 2], [1, 2, 1, 1]]}
SPEC_A2A_UNEVEN = {
    4: [
        [0, 1, 10, 11, 12, 20, 21, 30, 31],
        [2, 3, 13, 14, 22, 32, 33],
        [4, 15, 16, 23, 34, 35],
        [5, 17, 18, 24, 36],
    ]
}
SPEC_A2A_UNEVEN_LIST = {
    4: [
        [[0, 1], [10, 11, 12], [20, 21], [30, 31]],
        [[2, 3], [13, 14], [22], [32, 33]],
        [[4], [15, 16], [23], [34, 35]],
        [[5], [17, 18], [24], [36]],
    ]
}
SPEC_A2A_INPUT_LIST = {
    4: [
        [[0, 1], [2, 3], [4], [5]],
        [[10, 11, 12], [13, 14], [15, 16], [17, 18]],
        [[20, 21], [22], [23], [24]],
        [[30, 31], [32, 33], [34, 35], [36]],
    ]
}


def split_table(n: int) -> list[list[int]]:
    """Rows rank r sends to rank j: the spec's table at 4 ranks, a similar uneven one otherwise."""
    if n == 4:
        return SPEC_INPUT_SPLITS
    return [[1 + (2 * r + j) % 3 for j in range(n)] for r in range(n)]


def uneven_input(r: int, table: list[list[int]]) -> np.ndarray:
    """Rank r's input in the spec's uneven example: 10 r + arange(rows)."""
    return 10 * r + np.arange(sum(table[r]), dtype=I8)


def uneven_pieces(r: int, table: list[list[int]]) -> list[np.ndarray]:
    """``input.split(input_splits)`` on rank r."""
    return np.split(uneven_input(r, table), np.cumsum(table[r])[:-1])


def test_all_to_all_single_even(rank, world_size):
    n = world_size
    inp = np.arange(n, dtype=I8) + rank * n
    if n == 4:
        assert_equal(inp, np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]][rank], I8))
    output = np.empty([n], dtype=I8)
    dist.all_to_all_single(output, inp)
    # element j comes from rank j, which sent its element `rank`: j n + rank
    check_spec(output, np.arange(n, dtype=I8) * n + rank, SPEC_A2A_EVEN, rank, n, I8)


def test_all_to_all_single_equals_scatter_loop(rank, world_size):
    """The spec's "essentially similar to" loop of scatters gives the same output."""
    n = world_size
    inp = np.arange(2 * n, dtype=I8) + rank * 2 * n
    output = np.empty(2 * n, dtype=I8)
    dist.all_to_all_single(output, inp)
    scatter_list = list(np.split(inp, n))
    by_scatter = np.full(2 * n, -1, I8)
    gather_list = list(np.split(by_scatter, n))  # views of by_scatter
    for i in range(n):
        dist.scatter(gather_list[i], scatter_list if i == rank else [], src=i)
    assert_equal(by_scatter, output)
    assert_equal(output, np.concatenate([2 * n * j + 2 * rank + np.arange(2, dtype=I8) for j in range(n)]))


def test_all_to_all_single_uneven(rank, world_size):
    n = world_size
    table = split_table(n)
    inp = uneven_input(rank, table)
    input_splits = table[rank]
    output_splits = [table[j][rank] for j in range(n)]
    if n == 4:
        assert_equal(inp, np.array(SPEC_A2A_UNEVEN_INPUT[4][rank], I8))
        assert output_splits == SPEC_OUTPUT_SPLITS[4][rank]
    output = np.full(sum(output_splits), -1, I8)
    dist.all_to_all_single(output, inp, output_splits, input_splits)
    # from each rank j, in rank order: the rows j sends to `rank` (after those it sends to lower ranks)
    expected = np.concatenate([uneven_pieces(j, table)[rank] for j in range(n)])
    check_spec(output, expected, SPEC_A2A_UNEVEN, rank, n, I8)


def test_all_to_all_single_cfloat(rank, world_size):
    n = world_size
    inp = ((np.arange(n) + 1) * (1 + 1j) + n * rank * (1 + 1j)).astype(C8)
    if n == 4:
        assert_equal(inp, (np.arange(4) + 1 + 4 * rank).astype(C8) * C8(1 + 1j))
    output = np.empty([n], dtype=C8)
    dist.all_to_all_single(output, inp)
    expected = ((np.arange(n) * n + rank + 1) * (1 + 1j)).astype(C8)
    check_spec(output, expected, SPEC_A2A_CFLOAT, rank, n, C8)


SPEC_A2A_LIST_EVEN = {4: [[[v] for v in row] for row in SPEC_A2A_EVEN[4]]}
SPEC_A2A_LIST_CFLOAT = {4: [[[v] for v in row] for row in SPEC_A2A_CFLOAT[4]]}


def test_all_to_all_list_even(rank, world_size):
    n = world_size
    inp = list(np.split(np.arange(n, dtype=I8) + rank * n, n))  # input.chunk(4)
    buf = np.empty([n], dtype=I8)
    output = list(np.split(buf, n))  # torch.empty([4]).chunk(4): views of one array
    dist.all_to_all(output, inp)
    expected = [np.array([j * n + rank], I8) for j in range(n)]
    check_spec_list(output, expected, SPEC_A2A_LIST_EVEN, rank, n, I8)
    assert_equal(buf, np.arange(n, dtype=I8) * n + rank)


def test_all_to_all_list_equals_scatter_loop(rank, world_size):
    n = world_size
    scatter_list = list(np.split(np.arange(n, dtype=I8) + rank * n, n))
    output = [np.empty(1, I8) for _ in range(n)]
    dist.all_to_all(output, scatter_list)
    gather_list = [np.full(1, -1, I8) for _ in range(n)]
    for i in range(n):
        dist.scatter(gather_list[i], scatter_list if i == rank else [], src=i)
    for g, o in zip(gather_list, output):
        assert_equal(g, o)


def test_all_to_all_list_uneven(rank, world_size):
    n = world_size
    table = split_table(n)
    inp = uneven_pieces(rank, table)  # list(input.split(input_splits))
    if n == 4:
        listed = [np.array(a, I8) for a in SPEC_A2A_INPUT_LIST[4][rank]]
        for a, b in zip(inp, listed):
            assert_equal(a, b)
    output = [np.full(table[j][rank], -1, I8) for j in range(n)]
    dist.all_to_all(output, inp)
    expected = [uneven_pieces(j, table)[rank] for j in range(n)]
    check_spec_list(output, expected, SPEC_A2A_UNEVEN_LIST, rank, n, I8)


def test_all_to_all_list_cfloat(rank, world_size):
    n = world_size
    values = ((np.arange(n) + 1) * (1 + 1j) + n * rank * (1 + 1j)).astype(C8)
    inp = list(np.split(values, n))
    output = list(np.split(np.empty([n], dtype=C8), n))
    dist.all_to_all(output, inp)
    expected = [np.array([(j * n + rank + 1) * (1 + 1j)], C8) for j in range(n)]
    check_spec_list(output, expected, SPEC_A2A_LIST_CFLOAT, rank, n, C8)


# ---------------------------------------------------------------------------------------
# scatter
# ---------------------------------------------------------------------------------------


def test_scatter_ones_and_fives(rank, world_size):
    n = world_size
    tensor_size = 2
    output_tensor = np.zeros(tensor_size, np.float32)
    # the spec scatters [ones, fives] over 2 ranks; generally rank i gets (1 + 4 i) * ones
    scatter_list = [np.ones(tensor_size, np.float32) * (1 + 4 * i) for i in range(n)] if rank == 0 else None
    if rank == 0 and n == 2:
        assert_equal(scatter_list[0], np.ones(2, np.float32))
        assert_equal(scatter_list[1], np.ones(2, np.float32) * 5)
    dist.scatter(output_tensor, scatter_list, src=0)
    expected = np.full(tensor_size, 1 + 4 * rank, np.float32)
    if n == 2 and rank == 1:
        assert_equal(expected, np.array([5.0, 5.0], np.float32))
    assert_equal(output_tensor, expected)


# ---------------------------------------------------------------------------------------
# object collectives
# ---------------------------------------------------------------------------------------

SPEC_OBJECTS = ["foo", 12, {1: 2}]


def objects_for(n: int) -> list:
    """The spec's three objects for 3 ranks; more ranks get more (distinct) objects."""
    return [SPEC_OBJECTS[r] if r < len(SPEC_OBJECTS) else ("rank", r, [r] * r) for r in range(n)]


def test_broadcast_object_list(rank, world_size):
    if rank == 0:
        objects = ["foo", 12, {1: 2}]  # any picklable object
    else:
        objects = [None, None, None]
    dist.broadcast_object_list(objects, src=0, device="cpu")
    assert objects == ["foo", 12, {1: 2}]


def test_broadcast_object_list_every_src(rank, world_size):
    results = []
    for src in range(world_size):
        objects = [f"from {src}", src, {src: [src] * 3}] if rank == src else [None, None, None]
        dist.broadcast_object_list(objects, src=src)
        results.append(objects)
    for src, objects in enumerate(results):
        assert objects == [f"from {src}", src, {src: [src] * 3}]


def test_all_gather_object(rank, world_size):
    gather_objects = objects_for(world_size)
    output = [None for _ in gather_objects]
    dist.all_gather_object(output, gather_objects[dist.get_rank()])
    assert output == gather_objects
    if world_size == 3:
        assert output == ["foo", 12, {1: 2}]


def test_gather_object(rank, world_size):
    gather_objects = objects_for(world_size)
    output = [None for _ in gather_objects]
    dist.gather_object(gather_objects[dist.get_rank()], output if dist.get_rank() == 0 else None, dst=0)
    if rank == 0:
        assert output == gather_objects
        if world_size == 3:
            assert output == ["foo", 12, {1: 2}]
    else:
        assert output == [None] * world_size  # non-destination ranks passed None: untouched


def test_scatter_object_list(rank, world_size):
    if dist.get_rank() == 0:
        objects = objects_for(world_size)
    else:
        # can be any list on non-src ranks, elements are not used
        objects = [None] * world_size
    output_list = [None]
    dist.scatter_object_list(output_list, objects, src=0)
    assert output_list == [objects_for(world_size)[rank]]
    if world_size == 3 and rank == 2:
        assert output_list == [{1: 2}]


# ---------------------------------------------------------------------------------------
# batch_isend_irecv
# ---------------------------------------------------------------------------------------

SPEC_RING = {2: [[2, 3], [0, 1]]}


def test_batch_isend_irecv_ring(rank, world_size):
    n = world_size
    send_tensor = np.arange(2, dtype=I8) + 2 * rank
    recv_tensor = np.full(2, -1, I8)
    send_op = dist.P2POp(dist.isend, send_tensor, (rank + 1) % n)
    recv_op = dist.P2POp(dist.irecv, recv_tensor, (rank - 1 + n) % n)
    reqs = dist.batch_isend_irecv([send_op, recv_op])
    assert len(reqs) == 2
    for req in reqs:
        req.wait()
    assert all(req.is_completed() for req in reqs)
    expected = np.arange(2, dtype=I8) + 2 * ((rank - 1 + n) % n)
    check_spec(recv_tensor, expected, SPEC_RING, rank, n, I8)
