"""Test harness for running the suite under ``mpiexec -n N python -m pytest --with-mpi``.

* One default process group for the whole session (with a short timeout, so a
  broken collective fails the test instead of hanging it).
* Pass/fail is decided collectively: after each test every rank reports whether
  it failed, and a test that failed on any rank fails on all of them, naming the
  ranks. The vote itself has a deadline; past it the job is aborted rather than
  left hanging.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist

PG_TIMEOUT_S = float(os.environ.get("MPIDIST_TEST_PG_TIMEOUT", "90"))
VOTE_TIMEOUT_S = float(os.environ.get("MPIDIST_TEST_VOTE_TIMEOUT", "240"))

_VOTE_COMM = MPI.COMM_WORLD.Dup()


def _vote(failed: bool) -> list[int]:
    """Return the ranks on which the current test failed (this one included)."""
    size = _VOTE_COMM.Get_size()
    if size == 1:
        return [0] if failed else []
    flags = np.zeros(size, np.int8)
    req = _VOTE_COMM.Iallgather(np.array([int(failed)], np.int8), flags)
    deadline = time.monotonic() + VOTE_TIMEOUT_S
    while not req.Test():
        if time.monotonic() > deadline:
            sys.stderr.write(
                f"[rank {_VOTE_COMM.Get_rank()}] the other ranks did not finish the test within "
                f"{VOTE_TIMEOUT_S:g} s; aborting the job instead of hanging\n"
            )
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(70)
        os.sched_yield()
    return [i for i, f in enumerate(flags.tolist()) if f]


def _is_failure(exc: BaseException) -> bool:
    outcome = pytest.skip.Exception, pytest.xfail.Exception
    return not isinstance(exc, outcome)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    try:
        result = yield
    except BaseException as exc:
        _vote(_is_failure(exc))
        raise
    failed = _vote(False)
    if failed:
        pytest.fail(f"the test failed on rank(s) {failed} (see their reports)", pytrace=False)
    return result


def pytest_configure(config: pytest.Config) -> None:
    if MPI.COMM_WORLD.Get_rank() != 0:  # one full report (rank 0); others report failures only
        config.option.verbose = -2
        config.option.no_header = True


def init_default_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group(timeout=PG_TIMEOUT_S)


@pytest.fixture(scope="session", autouse=True)
def _session_group():
    init_default_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _group_alive():
    """Tests that destroy the default group get it back for the next test."""
    yield
    init_default_group()


@pytest.fixture
def rank() -> int:
    return dist.get_rank()


@pytest.fixture
def world_size() -> int:
    return dist.get_world_size()
