"""torch's own distributed test suite (``distributed_test._DistTestBase``) over mpidist, as torch ran its MPI backend.

``tools/torch_suite.py`` starts ``mpiexec -n 3`` with ``BACKEND=mpi`` and
``init_process_group("mpi")``; every test that runs must pass (the others are
skipped by torch itself for the MPI backend: DDP, CUDA, gloo- or NCCL-only tests).
It takes about a minute, so it runs in the world of one rank only.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import REPO, clean_env

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="torch's test utilities need expecttest (pip install expecttest)")



@pytest.mark.timeout(900)
@pytest.mark.one_rank  # starts its own mpiexec -n 3
def test_every_test_of_torchs_suite_that_runs_passes():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "torch_suite.py")], env=clean_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=840)  # fmt: skip
    out = proc.stdout + proc.stderr
    counts = re.search(r"passed (\d+), failed (\d+), skipped (\d+)", out)
    assert counts is not None, out[-5000:]
    passed, failed, skipped = map(int, counts.groups())
    assert failed == 0 and proc.returncode == 0, out[-8000:]
    assert passed > 0, out[-3000:]
    if torch.__version__.startswith("2.13."):  # 285 tests, of which 91 run on the MPI backend
        assert passed >= 91 and passed + skipped == 285, out[-3000:]
