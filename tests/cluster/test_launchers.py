"""Each wheel's launcher with the other wheel's mpi4py: never N silent worlds of one, never an abort without a word.

    .venv/bin/python -m pytest tests/cluster/test_launchers.py

Needs both virtual environments of ``dev.py test`` (.venv: MPICH, .venv-openmpi: Open MPI); skips otherwise.
A launcher of one library with the other library's Python is what a user gets from a ``module load`` of
the wrong MPI: hydra's PMI makes Open MPI start singletons, and Open MPI's PMIx makes the MPICH wheel
abort in MPI_Init. mpidist must raise on every rank, naming the launcher's rank and the fix.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MPICH, OPENMPI = REPO / ".venv" / "bin", REPO / ".venv-openmpi" / "bin"
# one write per rank: print('WORLD', n) makes three where output is unbuffered (PYTHONUNBUFFERED=1), and the two
# ranks' pieces interleaved into "WORLDWORLD 2" once their starts ended at the same moment
PROGRAM = "import mpidist as dist; dist.init_process_group(timeout=30); print(f'WORLD {dist.get_world_size()}')"

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.one_library,  # both wheels' launchers and Pythons, whichever runs pytest: once per dev.py test
    pytest.mark.skipif(
        not ((MPICH / "python").exists() and (OPENMPI / "python").exists()),
        reason="needs both virtual environments of dev.py test (.venv and .venv-openmpi)",
    ),
]


def _env() -> dict[str, str]:
    drop = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "MPI_LOCAL", "SLURM_", "PRTE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _launch(launcher: list[str], python: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*launcher, "-n", "2", str(python), "-c", PROGRAM],
        capture_output=True, text=True, timeout=90, env=_env(),
    )  # fmt: skip


def _labelled_by_the_launcher(out: str, who: str) -> None:
    """Each error names its process by the launcher's numbers (MPI calls every world of one rank 0). The
    launcher ends the job at the first failed process, so the other's message may never be printed."""
    labels = re.findall(r"init_process_group: (rank \d+ of \d+ \([^)]*\)|rank \d+):", out)
    assert labels and set(labels) <= {f"rank 0 of 2 ({who})", f"rank 1 of 2 ({who})"}, out


HYDRA = [str(MPICH / "mpiexec")]
PRTE = [str(OPENMPI / "mpirun"), "--oversubscribe", "--allow-run-as-root"]


def test_hydra_with_open_mpi_raises_on_every_rank_naming_the_fix():
    r = _launch(HYDRA, OPENMPI / "python")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "WORLD" not in r.stdout, out
    _labelled_by_the_launcher(out, "PMI")
    assert "uses Open MPI, which speaks only PMIx" in out and "Open MPI's mpirun" in out, out


def test_open_mpi_mpirun_with_the_mpich_wheel_raises_before_mpi_aborts():
    r = _launch(PRTE, MPICH / "python")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "WORLD" not in r.stdout, out
    assert "unsupported PMI version" not in out, out  # mpidist spoke before MPICH's abort
    _labelled_by_the_launcher(out, "Open MPI")
    assert "MPICH built without PMIx" in out and "MPICH's mpiexec" in out, out


@pytest.mark.parametrize("launcher,python", [(HYDRA, MPICH / "python"), (PRTE, OPENMPI / "python")],
                         ids=["hydra-mpich", "mpirun-openmpi"])  # fmt: skip
def test_matching_launcher_forms_the_world(launcher, python):
    r = _launch(launcher, python)
    assert r.returncode == 0 and r.stdout.count("WORLD 2") == 2, r.stdout + r.stderr
