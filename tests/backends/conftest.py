"""Fixtures shared by the backend tests."""

from __future__ import annotations

import pytest

import mpidist as dist
from mpidist.testing import mpi4py_calls


@pytest.fixture(scope="module")
def two_groups():
    """(a group calling MPI from C where it is built, one calling it through mpi4py), over every rank."""
    direct = dist.new_group()
    with mpi4py_calls():
        through = dist.new_group()
    yield direct, through
    dist.destroy_process_group(direct)
    dist.destroy_process_group(through)
