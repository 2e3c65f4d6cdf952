"""A pytest plugin for testing code that uses mpidist under ``mpiexec``.

Enable it in your ``conftest.py``::

    pytest_plugins = ["mpidist.testing"]

and run ``mpiexec -n 4 python -m pytest --with-mpi`` (pytest-mpi's flag; plain
``python -m pytest`` is a world of one rank). It gives you:

* **Collective pass/fail.** After each test every rank reports whether it failed;
  a test that failed on any rank fails on all of them and names the ranks, so one
  rank's failed assertion never leaves the others waiting in their next
  collective. The vote runs on a private communicator with a deadline
  (``MPIDIST_TEST_VOTE_TIMEOUT``, default 240 s); if the other ranks never get
  there (a rank hangs), the job is aborted with a message instead of hanging.
* **A default process group** for the session (fixture ``dist_world``, used
  automatically), created with the timeout ``MPIDIST_TEST_PG_TIMEOUT`` (default
  90 s) so a broken collective fails its test instead of hanging it; tests that
  destroy it get it back before the next test.
* **Quiet ranks.** Only rank 0 prints the full report; the others print failures.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

from .standin import HostCudaArray

__all__ = ["vote", "init_default_group", "calls_issued", "mpi_calls", "mpi4py_calls", "HostCudaArray"]

PG_TIMEOUT_S = float(os.environ.get("MPIDIST_TEST_PG_TIMEOUT", "90"))
VOTE_TIMEOUT_S = float(os.environ.get("MPIDIST_TEST_VOTE_TIMEOUT", "240"))


class _Voter:
    """Holds the private communicator the votes run on (created on first use)."""

    comm = None

    @classmethod
    def get(cls):
        if cls.comm is None:
            from ..launch.rendezvous import start_world

            cls.comm = start_world("mpidist.testing").COMM_WORLD.Dup()
        return cls.comm


def calls_issued(group: Any = None) -> int:
    """How many collectives ``group`` (default: the world) has issued on this rank.

    Its next call is "call #N+1" in timeout and DETAIL messages. Test support:
    tests check with it that a refused call sent nothing and that ranks stayed in
    step, without reaching into the backends.
    """
    return _member(group, "calls_issued").calls_issued()


def p2p_calls_issued(group: Any = None) -> int:
    """How many sends and receives this rank posted on ``group`` (default: the world). Test support."""
    return _member(group, "p2p_calls_issued").p2p_calls_issued()


def backend_of(group: Any = None, device: str = "cpu") -> Any:
    """The backend a call on ``device`` ("cpu"/"cuda") arrays of ``group`` runs on now (a ``DebugBackend``
    around it at a debug level above OFF; None if none was made yet). Test support: which backend serves a
    group, with what timeout."""
    return _member(group, "backend_of").backend(device)


def mpi_calls(group: Any = None) -> str:
    """How ``group``'s MPI backend (default: the world's) makes its hot collectives' MPI calls: ``"direct"``
    (the C module, ``backends/direct.py``) or ``"mpi4py"``. Test support."""
    return backend_of(group).mpi_calls()


@contextmanager
def mpi4py_calls() -> Iterator[None]:
    """Groups made inside this block call MPI through mpi4py, as with ``MPIDIST_DIRECT_MPI=0``.

    Test support: the same calls on a group made inside and one made outside must
    give the same results. Groups keep their calls when the block ends.
    """
    from .._world import world
    from ..backends.direct import DirectState, bind

    saved = bind()
    world.direct = DirectState(None, "made inside mpidist.testing.mpi4py_calls()")
    try:
        yield
    finally:
        world.direct = saved


def _member(group: Any, fn: str) -> Any:
    from ..process_group import resolve_group

    pg = resolve_group(group, fn)
    if pg is None:
        raise ValueError(f"{fn}: this rank is not a member of the group")
    return pg


def vote(failed: bool) -> list[int]:
    """Tell every rank whether this one failed; return the ranks that did (collective)."""
    import numpy as np
    from mpi4py import MPI

    comm = _Voter.get()
    size = comm.Get_size()
    if size == 1:
        return [0] if failed else []
    flags = np.zeros(size, np.int8)
    req = comm.Iallgather(np.array([int(failed)], np.int8), flags)
    deadline = time.monotonic() + VOTE_TIMEOUT_S
    while not req.Test():
        if time.monotonic() > deadline:
            sys.stderr.write(
                f"[rank {comm.Get_rank()}] mpidist.testing: the other ranks did not finish the test "
                f"within {VOTE_TIMEOUT_S:g} s; aborting the job instead of hanging\n"
            )
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(70)
        os.sched_yield()
    return [i for i, f in enumerate(flags.tolist()) if f]


def _is_failure(exc: BaseException) -> bool:
    return not isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    try:
        result = yield
    except BaseException as exc:
        vote(_is_failure(exc))
        raise
    failed = vote(False)
    if failed:
        pytest.fail(f"the test failed on rank(s) {failed} (see their reports)", pytrace=False)
    return result


def pytest_configure(config: pytest.Config) -> None:
    if _Voter.get().Get_rank() != 0:  # one full report (rank 0); the others report failures only
        config.option.verbose = -2
        config.option.no_header = True


def init_default_group() -> None:
    """Initialize mpidist's default group for tests (if it is not initialized)."""
    import mpidist

    if not mpidist.is_initialized():
        mpidist.init_process_group(timeout=PG_TIMEOUT_S)


@pytest.fixture(scope="session", autouse=True)
def dist_world():
    """The default process group, for the whole session."""
    import mpidist

    init_default_group()
    yield mpidist.group.WORLD
    if mpidist.is_initialized():
        mpidist.destroy_process_group()
    # Every rank got here together (each test ends with a vote), so MPI_Finalize cannot wait for a rank that
    # never comes: calls that tests made time out on purpose need not abort the job at exit (launch/abort.py: exit_check).
    from .._world import world

    world.timed_out.clear()


@pytest.fixture(autouse=True)
def _dist_world_alive():
    """Tests that destroy the default group get it back for the next test."""
    yield
    init_default_group()
