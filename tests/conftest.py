"""Test harness: mpidist's own pytest plugin (collective pass/fail, a session
process group, quiet ranks; see mpidist/testing/) plus a few fixtures.

Run under ``mpiexec -n N python -m pytest --with-mpi`` for N = 1..4.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest

import mpidist as dist

# The tests live in folders by layer (tests/api, tests/backends, ...) and import helpers.py and
# nccl_fake.py from here: tests/ goes first on sys.path whatever pytest's import mode. (No folder has
# an __init__.py, so two test modules may not share a basename; none is named after a package they
# import: a folder tests/torch would make `import torch` find it where torch is not installed.)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import KINDS, Checks, Maker, require_kind  # noqa: E402 - after the sys.path line

pytest_plugins = ["mpidist.testing"]

#: MPIDIST_TEST_ONE_LIBRARY=0 leaves out the tests marked one_library (dev.py test sets it for its second library)
ONE_LIBRARY_ENV = "MPIDIST_TEST_ONE_LIBRARY"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the work another run of ``dev.py test`` already does: the same on every rank.

    The suite runs at world sizes 1 to 4, under MPICH and under Open MPI. Two markers say what a
    larger world or another library would only repeat (they are deselected, not skipped):

    * ``one_rank``: the test talks to no other rank (a store of its own, argument parsing, a C check
      against Python, ...) or starts processes or jobs of its own (mpiexec, torchrun, plain python):
      at world size N each rank would do the same work again, or ranks 1..N-1 would wait at a
      barrier. It runs in the world of one rank only.
    * ``one_library``: the test does not depend on the MPI library (the docs, the import graph, the
      stores, Slurm's variables): under ``MPIDIST_TEST_ONE_LIBRARY=0`` (dev.py's second library) it
      is left out.

    A test that checks anything across ranks through MPI (a collective, a group, an error every
    rank raises together, a timeout's diagnosis) takes neither: it runs at every world size, under
    both libraries. Mark only what would be repeated unchanged; a pure local check that costs
    nothing measurable may stay unmarked.
    """
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    one_library_done = os.environ.get(ONE_LIBRARY_ENV, "1").strip() == "0"
    keep, drop = [], []
    for item in items:
        if (size > 1 and item.get_closest_marker("one_rank")) or (
            one_library_done and item.get_closest_marker("one_library")
        ):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def rank() -> int:
    return dist.get_rank()


@pytest.fixture
def world_size() -> int:
    return dist.get_world_size()


@pytest.fixture
def checks() -> Checks:
    """The test's failed checks, collected (helpers.Checks); the test ends with ``checks.done()``, a collective
    that fails every rank together if any rank has one."""
    return Checks()


@pytest.fixture(params=KINDS)
def array_kind(request) -> str:
    """The kind of array a test passes to mpidist ("numpy", "torch"); skipped if its library is missing."""
    require_kind(request.param)
    return request.param


@pytest.fixture
def make(array_kind) -> Maker:
    """Makes arrays of the test's ``array_kind`` from numpy values (see helpers.Maker)."""
    return Maker(array_kind)


@pytest.fixture
def no_group():
    """Run the test without a default group; leave none behind for the harness to re-create."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def fresh():
    """A new group of every rank (5 s timeout), destroyed afterwards; the debug level is OFF after the test.

    For tests that may leave their group refused or timed out (tests/hostile/: test_role_errors.py, test_hostile.py,
    test_fuzz.py): the default group and the other tests are not affected.
    """
    g = dist.new_group(timeout=timedelta(seconds=5))
    try:
        yield g
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
        if not g.destroyed:
            dist.destroy_process_group(g)


@pytest.fixture(autouse=True)
def _destroy_new_groups():
    """Free the groups a test created, so communicators do not pile up."""
    from mpidist._world import world

    before = set(world.groups)
    yield
    for name, pg in list(world.groups.items()):
        if name not in before and not pg.destroyed:
            dist.destroy_process_group(pg)
