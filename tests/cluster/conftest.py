"""Tests on real clusters: a single-node Slurm, and several hosts simulated with namespaces.

They start their own jobs (``srun``, ``sbatch``, ``mpiexec`` across hosts), so they
run once, from plain ``python -m pytest tests/cluster`` (``python3 dev.py test``
runs them after the suite, under each MPI library's virtual environment), never
under ``mpiexec``. They need root; where the tools cannot be set up they skip
with the reason.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under an MPI launcher (the main suite's runs) these tests do not belong: skip them."""
    if any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        skip = pytest.mark.skip(reason="cluster tests start their own jobs: run `python -m pytest tests/cluster`")
        for item in items:
            if "tests/cluster" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(skip)
