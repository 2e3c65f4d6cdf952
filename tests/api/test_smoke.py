"""A first check that the harness and the default group work at every world size."""

import numpy as np

import mpidist as dist

from helpers import assert_equal, assert_identical_on_all_ranks


def test_world_matches_mpi(rank, world_size):
    from mpi4py import MPI

    assert rank == MPI.COMM_WORLD.Get_rank()
    assert world_size == MPI.COMM_WORLD.Get_size()
    assert dist.get_backend() == "mpi"


def test_all_reduce_sum_of_ranks(rank, world_size):
    x = np.array([rank, 1], np.int64)
    dist.all_reduce(x)
    assert_equal(x, np.array([world_size * (world_size - 1) // 2, world_size], np.int64))
    assert_identical_on_all_ranks(x)
