"""The examples compute what they say, at any world size (run in-process on the session's default group)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import mpidist as dist
from mpidist.testing import calls_issued

from helpers import REPO, fail_together

pytestmark = pytest.mark.timeout(120)

EXAMPLES = REPO / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n", [1, 3, 64])
def test_cg_persistent_solves_the_poisson_system(n, rank, world_size):
    """CG with persistent dot products and halo exchanges converges to the known solution; the persistent
    all_reduce is made once (one call of the group), not once per iteration."""
    cg = _load("cg_persistent")
    before = calls_issued()
    x, iterations, residual = cg.solve(n)
    lo, hi = cg.rows_of(n, rank, world_size)
    problems = []
    if x.shape != (hi - lo,):
        problems.append(f"block of shape {x.shape}, expected {(hi - lo,)}")
    error = float(np.max(np.abs(x - cg.exact(n, np.arange(lo, hi))), initial=0.0))
    if error > 1e-9:
        problems.append(f"max error {error:.3e} against the exact solution")
    if residual > 1e-10 or not 1 <= iterations <= n:
        problems.append(f"{iterations} iterations, relative residual {residual:.3e}")
    if calls_issued() - before != 1:
        problems.append(f"{calls_issued() - before} collectives issued, expected 1 (the persistent all_reduce)")
    fail_together(problems)
    assert dist.is_initialized()
