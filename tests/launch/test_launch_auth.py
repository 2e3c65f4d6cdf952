"""Worlds formed without an MPI launcher admit only their own processes.

The store rendezvous and rank 0's PMI server take the job's key
(``MPIDIST_SECRET`` here); a process without it is refused before anything it
sends is read, a squatter on the port is named, two processes claiming one
rank stop the start on every rank, and a start without a secret warns. The
tests start plain ``python`` processes themselves, so they run once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from mpidist import DistNetworkError
from mpidist._auth import SecretKey
from mpidist.launch import pmi
from mpidist.store._handshake import client_handshake

from helpers import clean_env, free_port, needs_pmi1

pytestmark = [pytest.mark.timeout(180), pytest.mark.one_rank]

SECRET = "a-secret-of-this-test-job-0123456789"
KEY = SecretKey(SECRET.encode())

CHILD = textwrap.dedent(
    """
    import os, sys, time
    time.sleep(float(os.environ.get("LATE", "0")))
    import mpidist as dist
    dist.init_process_group(timeout=40)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, dist.get_rank())
    print("RESULT", dist.get_rank(), got, flush=True)
    dist.destroy_process_group()
    """
)


def start(script_path, envs: list[dict[str, str]]) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, str(script_path)], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)  # fmt: skip
        for e in envs
    ]


def finish(procs: list[subprocess.Popen], timeout: float = 90) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process; every one is killed at ``timeout``."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process did not finish within {timeout} s")
        out.append((p.returncode, o, e))
    return out


def env_of(rank: int, size: int, port: int, **extra: str) -> dict[str, str]:
    return clean_env(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)


@pytest.mark.one_library  # mpidist's own PMI server: no MPI library involved
def test_the_pmi_server_answers_no_pmi_line_before_the_proof():
    server = pmi.PMIServer("127.0.0.1", 2, ["h", "h"], KEY)
    host, port = server.address.rsplit(":", 1)
    try:
        raw = socket.create_connection((host, int(port)), timeout=10)
        raw.sendall(b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=get_my_kvsname\ncmd=barrier_in\n")
        answer = b""
        try:
            while chunk := raw.recv(4096):
                answer += chunk
        except ConnectionResetError:  # closed with the lines unread
            pass
        raw.close()
        assert b"cmd=" not in answer and answer == b""

        keyless = socket.create_connection((host, int(port)), timeout=10)
        with pytest.raises(Exception, match="refused"):
            client_handshake(keyless, None, pmi.SERVICE, pmi.MAGIC, b"rank=1 host=h pid=1")
        keyless.close()

        member = socket.create_connection((host, int(port)), timeout=10)
        client_handshake(member, KEY, pmi.SERVICE, pmi.MAGIC, b"rank=1 host=h pid=1")
        member.sendall(b"cmd=get_my_kvsname\n")
        assert member.makefile("rb").readline().startswith(b"cmd=my_kvsname kvsname=mpidist_")
        member.close()
        assert server.claims == {1: ["rank=1 host=h pid=1"]}
    finally:
        server.close()


@pytest.mark.one_library
def test_a_process_with_the_secret_refuses_a_squatting_pmi_server():
    squatter = pmi.PMIServer("127.0.0.1", 2, ["h", "h"])  # no key: another user's server on the port
    try:
        with pytest.raises(DistNetworkError, match=r"is not this job's PMI server .*another process holds port"):
            pmi.connect(squatter.address, KEY, 1, 2, 10)
        assert squatter.claims == {}
    finally:
        squatter.close()


@needs_pmi1
def test_a_process_without_the_secret_is_refused_and_the_world_forms(tmp_path):
    """An impostor for rank 2 (no secret) arrives before the real rank 2: it is refused, the job runs as it should."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    port = free_port()
    job = start(script, [env_of(0, 3, port, MPIDIST_SECRET=SECRET), env_of(1, 3, port, MPIDIST_SECRET=SECRET),
                         env_of(2, 3, port, MPIDIST_SECRET=SECRET, LATE="4")])  # fmt: skip
    time.sleep(1.0)
    impostor = start(script, [env_of(2, 3, port)])
    (code, _, err), = finish(impostor, 60)
    results = finish(job)
    assert code != 0 and "refused this process" in err and "DistNetworkError" in err, err[-2000:]
    for rank, (rc, out, e) in enumerate(results):
        assert rc == 0, e[-3000:]
        assert f"RESULT {rank} [0, 1, 2]" in out
    assert "not authenticated" not in results[0][2]


@needs_pmi1
def test_two_claims_of_one_rank_stop_the_start_on_every_rank(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    port = free_port()
    envs = [env_of(0, 3, port, MPIDIST_SECRET=SECRET), env_of(2, 3, port, MPIDIST_SECRET=SECRET),
            env_of(2, 3, port, MPIDIST_SECRET=SECRET, LATE="0.5"), env_of(1, 3, port, MPIDIST_SECRET=SECRET, LATE="3")]  # fmt: skip
    results = finish(start(script, envs))
    pids = []
    for rc, out, err in results:
        assert rc != 0 and "RESULT" not in out
        assert "DistNetworkError: init_process_group: rank 2 is claimed by two processes: host " in err, err[-2000:]
        pids.append(err)
    line = [x for x in results[0][2].splitlines() if "claimed by two" in x][0]
    assert line.count(" pid ") == 2


@needs_pmi1
def test_a_start_without_a_secret_works_and_rank0_warns_once(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    port = free_port()
    results = finish(start(script, [env_of(0, 2, port), env_of(1, 2, port)]))
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, err[-3000:]
        assert f"RESULT {rank} [0, 1]" in out
    warned = [line for line in results[0][2].splitlines() if "this start is not authenticated" in line]
    assert warned and "MPIDIST_SECRET" in warned[0] and "docs/security.md" in warned[0]
    assert sum("RuntimeWarning" in line for line in warned) == 1
    assert "not authenticated" not in results[1][2]


@needs_pmi1
def test_a_wrong_secret_file_is_named_before_anything_starts(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    os.chmod(secret, 0o644)
    results = finish(start(script, [env_of(0, 1, free_port(), MPIDIST_SECRET_FILE=str(secret)),
                                    env_of(0, 2, free_port(), MPIDIST_SECRET_FILE=str(secret))]))  # fmt: skip
    rc, _, err = results[1]
    assert rc != 0 and "MPIDIST_SECRET_FILE" in err and "chmod 600" in err, err[-2000:]
    assert SECRET not in err
