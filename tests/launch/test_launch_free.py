"""Worlds that no MPI launcher started: N plain ``python`` processes meet through a store.

The tests start the processes themselves (with every launcher variable removed
from their environment), so they run once, from a world of one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

from mpidist.init import _claims
from mpidist.launch import pmi, rendezvous

from helpers import clean_env, free_port, needs_pmi1, run_plain_world

# processes of its own, or parsing: once, in the world of one rank
pytestmark = [pytest.mark.timeout(180), pytest.mark.one_rank]

SIZE = MPI.COMM_WORLD.Get_size()  # the suite runs under mpiexec: MPI is initialized

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import mpidist as dist
    from mpi4py import MPI

    init_method = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None
    dist.init_process_group(init_method=init_method, timeout=60)
    rank, size = dist.get_rank(), dist.get_world_size()
    x = np.full(3, rank + 1.0)
    dist.all_reduce(x)
    gathered = [None] * size
    dist.all_gather_object(gathered, {"rank": rank})
    odd = dist.new_group([r for r in range(size) if r % 2])
    y = np.ones(2)
    dist.all_reduce(y, group=odd)
    store = dist.get_default_store()
    total = store.add("hello", rank + 1)
    dist.barrier()
    final = int(store.get("hello"))
    dist.barrier()  # rank 0 hosts the store: it closes it in destroy_process_group
    result = {
        "rank": rank, "size": size, "mpi_size": MPI.COMM_WORLD.Get_size(), "sum": x.tolist(),
        "gathered": [g["rank"] for g in gathered], "odd": y.tolist(), "store": final,
    }
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def _run_world(n: int, env_for, args_for, tmp_path) -> list[dict]:
    return run_plain_world(CHILD, [env_for(r) for r in range(n)], [args_for(r) for r in range(n)], tmp_path)


def _check(results: list[dict], n: int) -> None:
    odd = [r for r in range(n) if r % 2]
    for r, got in enumerate(results):
        assert got["rank"] == r and got["size"] == n and got["mpi_size"] == n
        assert got["sum"] == [n * (n + 1) / 2] * 3
        assert got["gathered"] == list(range(n))
        assert got["odd"] == ([float(len(odd))] * 2 if r in odd else [1.0, 1.0])
        assert got["store"] == n * (n + 1) // 2


@needs_pmi1
def test_env_init_forms_a_world_without_mpiexec(tmp_path):
    n, port = 3, free_port()

    def env_for(r: int) -> dict[str, str]:
        return clean_env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    _check(_run_world(n, env_for, lambda r: [""], tmp_path), n)


@needs_pmi1
def test_file_init_forms_a_world_without_mpiexec(tmp_path):
    n = 2
    url = f"file://{tmp_path}/rendezvous?world_size={n}"

    # each process names its rank in the URL
    _check(_run_world(n, lambda r: clean_env(), lambda r: [f"{url}&rank={r}"], tmp_path), n)


@pytest.mark.skipif(rendezvous.speaks_pmi1(), reason="this MPI library speaks PMI-1: such worlds form (tested above)")
def test_a_library_without_pmi1_refuses_plain_processes_clearly(tmp_path):
    """Open MPI: plain processes with env:// cannot form a world; each says so and how to start the job."""
    port = free_port()
    code = "import mpidist as dist\ndist.init_process_group()\n"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0
        assert "this process was not started by an MPI launcher" in err and "mpiexec -n N" in err, err[-2000:]


def test_missing_rank_without_a_launcher_is_a_clear_error(tmp_path):
    code = "import mpidist as dist\ndist.init_process_group()\n"
    env = clean_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "ValueError: init_process_group: this process was not started by an MPI launcher" in p.stderr
    assert "mpiexec -n N" in p.stderr


def test_mpi_initialized_too_early_is_a_clear_error(tmp_path):
    code = "from mpi4py import MPI\nimport mpidist as dist\ndist.init_process_group(rank=0, world_size=2)\n"
    p = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "import mpidist before mpi4py.MPI" in p.stderr


def test_a_library_without_pmi1_is_refused(monkeypatch):
    monkeypatch.setattr(MPI, "Get_library_version", lambda: "Open MPI v5.0.11, package: Open MPI\n")
    with pytest.raises(
        RuntimeError,
        match=r"^init_process_group: this process was not started by an MPI launcher, "
        r"and Open MPI v5\.0\.11.*mpiexec -n N",
    ):
        rendezvous._require_pmi1("init_process_group")


def _pmi_client(address: str, rank: int) -> tuple[Any, Any]:
    """A connection to the PMI server that made the handshake as ``rank`` (no key), then speaks PMI lines."""
    import socket

    from mpidist.store._handshake import client_handshake

    host, port = address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=20)
    client_handshake(conn, None, pmi.SERVICE, pmi.MAGIC, f"rank={rank} host=h pid=1".encode())
    return conn, conn.makefile("rwb", buffering=0)


@pytest.mark.one_library  # mpidist's own PMI server or parsing: no MPI library involved
def test_pmi_barrier_is_released_when_a_process_leaves_without_finalizing():
    """Rank 1 dies (no finalize) while rank 0 waits in a PMI barrier (MPI_Finalize has one): rank 0 gets an error
    instead of waiting forever, and the server sees every process gone (it used to stay up for good)."""
    server = pmi.PMIServer("127.0.0.1", 2, ["h", "h"])
    problems = []
    try:
        a, a_stream = _pmi_client(server.address, 0)
        b, b_stream = _pmi_client(server.address, 1)
        b_stream.write(b"cmd=barrier_in\n")
        a_stream.write(b"cmd=barrier_in\n")
        if a_stream.readline() != b"cmd=barrier_out rc=0\n" or b_stream.readline() != b"cmd=barrier_out rc=0\n":
            problems.append("a barrier both processes entered did not complete")
        a_stream.write(b"cmd=barrier_in\n")  # rank 0 enters the next one (in MPI_Finalize, say) ...
        b_stream.close()
        b.close()  # ... and rank 1 dies
        reply = a_stream.readline()
        if not reply.startswith(b"cmd=barrier_out rc=-1"):
            problems.append(f"the waiting process got {reply!r}, not an error")
        a_stream.close()
        a.close()
        if not server.wait_finished(10.0):
            problems.append("the server still counts a process as running")
    finally:
        server.close()
    assert not problems, problems


@pytest.mark.one_library  # mpidist's own PMI server or parsing: no MPI library involved
def test_rank0_starts_mpi_only_once_every_other_rank_reached_the_pmi_server():
    """Rank 0 enters MPI_Init (which holds the interpreter lock, so its store stops answering) only once every
    other rank has introduced itself to the PMI server: wait_others_connected returns the ranks still missing,
    and [] only after the last one arrived (a started-then-killed server process is used, as init uses it)."""
    proc, address = pmi.start_server_process("127.0.0.1", 3, ["h", "h", "h"], timeout_s=30)
    problems, clients = [], []
    try:
        one = _pmi_client(address, 1)
        clients.append(one)
        started = time.monotonic()
        missing = pmi.wait_others_connected(proc, 1.5)
        if missing != [2] or time.monotonic() - started < 1.4:
            problems.append(f"with rank 2 absent: missing={missing} after {time.monotonic() - started:.1f} s")
        two = _pmi_client(address, 2)
        clients.append(two)
        missing = pmi.wait_others_connected(proc, 10.0)
        if missing:
            problems.append(f"every other rank connected, yet missing={missing}")
    finally:
        for conn, stream in clients:
            stream.close()
            conn.close()
        proc.kill()
        proc.wait()
    assert not problems, problems


@pytest.mark.one_library  # mpidist's own PMI server or parsing: no MPI library involved
def test_pmi_server_leaves_when_rank0_is_gone():
    """The server is bounded by its job: started by a process that then dies (rank 0), with a client that
    never finalizes, it exits on its own (it used to wait for every client forever)."""
    root = str(Path(pmi.__file__).resolve().parents[2])
    code = (
        f"import sys, time; sys.path[:0] = [{root!r}]\n"
        "from mpidist.launch import pmi\n"
        "proc, address = pmi.start_server_process('127.0.0.1', 2, ['h', 'h'], timeout_s=30)\n"
        "print(proc.pid, address, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server_pid, address = parent.stdout.readline().split()
    clients = [_pmi_client(address, rank) for rank in range(2)]
    parent.kill()  # rank 0 dies; rank 1 stays connected and silent
    parent.wait()
    deadline = time.monotonic() + pmi._AFTER_RANK0_S + 15
    alive = True
    while alive and time.monotonic() < deadline:
        alive = os.path.exists(f"/proc/{server_pid}") and "zombie" not in _state(server_pid)
        time.sleep(0.5)
    for conn, stream in clients:
        stream.close()
        conn.close()
    if alive:
        os.kill(int(server_pid), 9)
    assert not alive, "the PMI server outlived rank 0 by more than its grace period"


def _state(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:
        return "zombie"


@pytest.mark.one_library  # mpidist's own PMI server or parsing: no MPI library involved
@pytest.mark.parametrize(
    "hosts, expected",
    [
        (["a"], "(vector,(0,1,1))"),
        (["a", "a", "a"], "(vector,(0,1,3))"),
        (["a", "a", "b", "b"], "(vector,(0,1,2),(1,1,2))"),
        (["a", "b", "a"], "(vector,(0,1,1),(1,1,1),(0,1,1))"),
    ],
)
def test_process_mapping(hosts, expected):
    assert pmi.process_mapping(hosts) == expected


@pytest.mark.one_library  # mpidist's own PMI server or parsing: no MPI library involved
@pytest.mark.parametrize(
    "url, rank, size, expected",
    [
        ("tcp://10.0.0.1:29500?rank=2&world_size=4", -1, -1, ("tcp", 2, 4, "10.0.0.1", 29500, None)),
        ("tcp://h:1", 1, 3, ("tcp", 1, 3, "h", 1, None)),
        ("file:///tmp/x?world_size=2", 0, -1, ("file", 0, 2, None, None, "/tmp/x")),
    ],
)
def test_plan_from_url(url, rank, size, expected):
    claims = _claims(url, rank, size, "init_process_group")
    plan = rendezvous.plan_from(url, None, claims, "init_process_group")
    assert (plan.scheme, plan.rank, plan.world_size, plan.host, plan.port, plan.path) == expected


@pytest.mark.one_library  # mpidist's own PMI server or parsing: no MPI library involved
def test_plan_from_env(monkeypatch):
    for var, value in (("RANK", "3"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "1234")):
        monkeypatch.setenv(var, value)
    plan = rendezvous.plan_from(None, None, _claims(None, -1, -1, "f"), "f")
    assert (plan.scheme, plan.rank, plan.world_size, plan.host, plan.port) == ("env", 3, 8, "node0", 1234)
    assert (
        rendezvous.plan_from(None, None, _claims(None, 5, 9, "f"), "f").rank == 5
    )  # arguments win over the environment


@pytest.mark.one_library  # mpidist's own PMI server or parsing: no MPI library involved
def test_master_port_that_is_not_a_number(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match=r"^f: environment variable MASTER_PORT='http' is not a port number$"):
        rendezvous.plan_from(None, None, [], "f")


@pytest.mark.parametrize(
    "launcher",
    [
        {},
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"},
        {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "vm", "SLURM_JOB_ID": "5"},
        {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "vm", "SLURM_JOB_ID": "5",
         "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9"},
        {"PMIX_RANK": "1", "PMIX_NAMESPACE": "x", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
    ],
    ids=["none", "hydra", "srun-mpi-none", "srun-mpi-pmi2", "mpirun"],
)  # fmt: skip
def test_import_mpidist_leaves_mpi_uninitialized_and_imports_no_torch(launcher):
    """import mpidist starts nothing: no mpi4py.MPI (so a launcher-free world can still form), no torch or
    cupy; under a launcher (srun with a PMI plugin included) it only copies the launcher's rank variables into
    torchrun's names: a child process of a rank that imports mpidist must not start MPI."""
    code = (
        "import os, sys, json, mpidist\n"
        "print(json.dumps([sorted(m for m in ('mpi4py.MPI', 'torch', 'cupy') if m in sys.modules),"
        " os.environ.get('RANK'), os.environ.get('LOCAL_RANK')]))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(**launcher), capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    expected = [[], "1", "1"] if launcher else [[], None, None]
    assert json.loads(p.stdout) == expected


@pytest.mark.parametrize("url", ["file://{tmp}/rdv", "tcp://127.0.0.1:1"])
def test_tcp_or_file_without_world_size_and_no_launcher_is_refused(url, tmp_path):
    """RANK/WORLD_SIZE in the environment are not read with file:// or tcp:// (as in torch): without them in
    the URL or the arguments, every process would have started a world of its own; it raises instead."""
    code = f"import mpidist as dist; dist.init_process_group(init_method={url.format(tmp=tmp_path)!r}, timeout=10)"
    p = subprocess.run([sys.executable, "-c", code], env=clean_env(RANK="1", WORLD_SIZE="3"),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode != 0 and "needs the world size and this process's rank" in p.stderr, p.stderr[-2000:]
