"""Test harness: mpidist's own pytest plugin (collective pass/fail, a session
process group, quiet ranks; see mpidist/testing/) plus a few fixtures.

Run under ``mpiexec -n N python -m pytest --with-mpi`` for N = 1..4.
"""

from __future__ import annotations

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

from helpers import KINDS, Maker, require_kind  # noqa: E402 - after the sys.path line

pytest_plugins = ["mpidist.testing"]


@pytest.fixture
def rank() -> int:
    return dist.get_rank()


@pytest.fixture
def world_size() -> int:
    return dist.get_world_size()


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
