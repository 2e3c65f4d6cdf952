"""FileStore's protection is the file's permissions, and a job's secret keeps two jobs off one file.

* Files are made with mode 0600 whatever the umask; a file its group or others
  may read or write, another user's file, a symbolic link or a FIFO at the path
  are refused before anything is read from or written to it.
* Two jobs with different secrets (``MPIDIST_SECRET``, as ``mpidistrun`` gives
  each job) on one path: the second is refused while the first holds the file,
  whatever the order in which their processes arrive, and no process is given
  the other job's keys. A late joiner of the first job still joins. A file left
  by another job (its stores closed, or its processes killed) is started afresh.

The permission tests run in this process on a directory of its own. The
two-job tests start the ranks as plain processes (``subprocess``), driven
through their stdin, since the file tells worlds apart by their processes and
their secrets; they run in the world of one rank only (``one_rank``). The last
test is shared by every rank of the MPI job (one job: one secret, one file).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from datetime import timedelta

import pytest
from mpi4py import MPI

import mpidist
from mpidist import DistStoreError
from mpidist.store import FileStore
from mpidist.store import _filelog as world

from helpers import fail_together

pytestmark = [pytest.mark.timeout(60), pytest.mark.one_library]
local = pytest.mark.one_rank

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()

#: two jobs' secrets (each at least 16 bytes)
SECRET_A, SECRET_B = "secret-of-job-A-" * 2, "secret-of-job-B-" * 2
SECRET_VARS = ("MPIDIST_SECRET", "MPIDIST_SECRET_FILE")
#: the folder of the mpidist package the tests run
PACKAGE_DIR = os.path.dirname(os.path.abspath(mpidist.__file__))


@pytest.fixture
def directory():
    """A directory of this process's own, mode 0700."""
    path = tempfile.mkdtemp(prefix=f"mpidist-security-r{RANK}-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def path(directory):
    return os.path.join(directory, "store")


@pytest.fixture
def no_secret(monkeypatch):
    """This process without a job secret (whatever the environment the tests run in holds)."""
    for name in SECRET_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def kept_store_file(path: str) -> bytes:
    """Make a FileStore file that stays (world_size -1) holding key ``k``; return its bytes."""
    with FileStore(path) as store:
        store.set("k", "v")
    with open(path, "rb") as f:
        return f.read()


def content(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def header(path: str) -> dict:
    return world.read_header(content(path))[1]


# ---------------------------------------------------------------------------------------------
# 1. the mode of a new file
# ---------------------------------------------------------------------------------------------


@local
@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277], ids=lambda m: f"umask{m:03o}")
def test_a_new_file_has_mode_0600_whatever_the_umask(path, no_secret, umask):
    old = os.umask(umask)
    try:
        store = FileStore(path, 1)
    finally:
        os.umask(old)
    try:
        info = os.stat(path)
        assert stat.S_IMODE(info.st_mode) == 0o600, f"umask {umask:03o}: mode {stat.S_IMODE(info.st_mode):04o}"
        assert info.st_uid == os.geteuid()  # root's file, when root runs it: the same user
        store.set("k", "v")  # 0o277 leaves 0400 from os.open alone: the store must still write
        assert store.get("k") == b"v"
    finally:
        store.close()
    assert not os.path.exists(path)


# ---------------------------------------------------------------------------------------------
# 2. files others may read or write, another user's, links, FIFOs
# ---------------------------------------------------------------------------------------------


#: modes that let others at the keys, and how the refusal says it
LOOSE_MODES = {
    0o644: "its group can read it and others can read it",
    0o640: "its group can read it",
    0o604: "others can read it",
    0o620: "its group can write it",
    0o602: "others can write it",
    0o666: "its group can read and write it and others can read and write it",
}


@local
@pytest.mark.parametrize("mode, who", [pytest.param(m, w, id=f"{m:04o}") for m, w in LOOSE_MODES.items()])
def test_a_file_the_group_or_others_may_read_or_write_is_refused(path, no_secret, mode, who):
    before = kept_store_file(path)
    os.chmod(path, mode)
    with pytest.raises(DistStoreError) as info:
        FileStore(path)
    assert str(info.value) == (
        f"FileStore: {path!r} has mode {mode:04o}: {who}, so other users could read or change the store's keys; "
        f"FileStore makes its files with mode 0600: if the file is yours to reuse, chmod 600 {path!r}, or remove it"
    )
    assert content(path) == before  # nothing written, not even a user counter
    os.chmod(path, 0o600)  # the fix the message names
    with FileStore(path) as store:
        assert store.get("k") == b"v"


@local
def test_an_empty_file_others_may_read_is_refused_before_a_header_is_written(path, no_secret):
    with open(path, "wb"):
        pass
    os.chmod(path, 0o644)
    with pytest.raises(DistStoreError, match=r"has mode 0644: its group can read it and others can read it"):
        FileStore(path, 2)
    assert content(path) == b""


@local
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user (os.chown)")
def test_a_file_another_user_owns_is_refused(path, no_secret):
    before = kept_store_file(path)
    os.chown(path, 65534, -1)  # nobody's now (root still opens it: the check is on the open file)
    with pytest.raises(DistStoreError) as info:
        FileStore(path)
    message = str(info.value)
    assert message.startswith(f"FileStore: {path!r} is owned by "), message
    assert "(uid 65534), not by this process's user " in message or "uid 65534, not by" in message, message
    assert "whoever owns the file can read and change the store's keys" in message
    assert content(path) == before


@local
def test_the_owner_is_checked_on_the_open_file(path, no_secret, monkeypatch):
    """As any user: a file whose owner is not the effective uid is refused (the same check, without root)."""
    before = kept_store_file(path)
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 4242)
    with pytest.raises(DistStoreError, match=rf"^FileStore: .* is owned by .*uid {me}\b.*, not by this process's "
                       rf"user uid {me + 4242}: "):  # fmt: skip
        FileStore(path)
    monkeypatch.undo()
    assert content(path) == before


@local
def test_a_symbolic_link_is_not_followed(directory, no_secret):
    target = os.path.join(directory, "target")
    before = kept_store_file(target)
    link = os.path.join(directory, "link")
    os.symlink(target, link)
    with pytest.raises(DistStoreError) as info:
        FileStore(link)
    assert str(info.value).startswith(f"FileStore: {link!r} is a symbolic link to {target!r}: FileStore does not "
                                      "follow a link"), str(info.value)  # fmt: skip
    assert content(target) == before
    dangling, nowhere = os.path.join(directory, "dangling"), os.path.join(directory, "nowhere")
    os.symlink(nowhere, dangling)
    with pytest.raises(DistStoreError, match=r"is a symbolic link"):
        FileStore(dangling, 2)
    assert not os.path.exists(nowhere)  # the link did not make the store create a file elsewhere


@local
def test_a_fifo_is_refused_at_once(path, no_secret):
    os.mkfifo(path, 0o600)
    result: list[BaseException] = []
    thread = threading.Thread(target=lambda: result.append(pytest.raises(DistStoreError, FileStore, path).value))
    thread.start()
    thread.join(10)
    if thread.is_alive():  # unblock the open, so the test ends
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("FileStore hung opening a FIFO")
    assert result and str(result[0]).startswith(f"FileStore: {path!r} is not a regular file (mode prw-------")


# ---------------------------------------------------------------------------------------------
# 3. the world tag: a job's secret, never the secret itself
# ---------------------------------------------------------------------------------------------


@local
def test_the_file_holds_a_tag_of_the_secret_not_the_secret(directory, monkeypatch):
    tags = {}
    for name, secret in (("a", SECRET_A), ("a-again", SECRET_A), ("b", SECRET_B)):
        monkeypatch.setenv("MPIDIST_SECRET", secret)
        path = os.path.join(directory, name)
        with FileStore(path) as store:
            store.set("k", "v")
        data = content(path)
        assert secret.encode() not in data and secret.encode().hex().encode() not in data
        tags[name] = header(path)["tag"]
    assert len(tags["a"]) == 32 and tags["a"] == tags["a-again"] != tags["b"]
    monkeypatch.delenv("MPIDIST_SECRET")
    with FileStore(os.path.join(directory, "none")) as store:
        assert header(store.path)["tag"] == ""


@local
@pytest.mark.parametrize(
    "holder, newcomer, why",
    [
        (SECRET_A, SECRET_B, "its world's job secret (MPIDIST_SECRET) is not this process's"),
        (SECRET_A, None, "its world has a job secret (MPIDIST_SECRET) and this process has none"),
        (None, SECRET_B, "its world has no job secret and this process has one (MPIDIST_SECRET)"),
    ],
    ids=["A-then-B", "A-then-none", "none-then-B"],
)
@pytest.mark.parametrize("world_size", [2, -1])
def test_a_store_of_another_secret_is_refused_while_the_file_is_in_use(path, no_secret, holder, newcomer, why,
                                                                        world_size):  # fmt: skip
    if holder:
        no_secret.setenv("MPIDIST_SECRET", holder)
    held = FileStore(path, world_size)
    held.set("rank0/address", "job A")
    before = content(path)
    if newcomer:
        no_secret.setenv("MPIDIST_SECRET", newcomer)
    else:
        no_secret.delenv("MPIDIST_SECRET")
    with pytest.raises(DistStoreError) as info:
        FileStore(path, world_size)
    message = str(info.value)
    holding = f"pid {os.getpid()} on " if world_size > 0 else "1 of world_size=-1"
    assert message.startswith(f"FileStore: {path!r} is in use by another world (world id {header(path)['id']}, "
                              "made "), message  # fmt: skip
    assert f"; stores open on it: {holding}" in message and f"): {why}, so this process is not one of its " in message
    assert "may not read its keys; give each job a path of its own" in message
    assert content(path) == before
    assert held.get("rank0/address") == b"job A"
    held.close()


@local
def test_a_file_another_job_closed_is_started_afresh(path, no_secret, caplog):
    no_secret.setenv("MPIDIST_SECRET", SECRET_A)
    kept_store_file(path)  # world_size -1: the file stays after job A closed its store
    old = header(path)["id"]
    no_secret.setenv("MPIDIST_SECRET", SECRET_B)
    with caplog.at_level(logging.WARNING, logger="mpidist.store"):
        store = FileStore(path)
    with store:
        assert not store.check(["k"])  # job A's key is gone
        assert header(path)["id"] != old and header(path)["tag"] == world.world_tag("test")
    assert f"{path!r} was left by another world (world id {old}, " in caplog.text
    assert "none of its stores is open: they were closed); starting it afresh" in caplog.text


# ---------------------------------------------------------------------------------------------
# 4. two jobs, as separate processes
# ---------------------------------------------------------------------------------------------

#: a rank: the store modules only, without the package's __init__ (numpy, the array layer: 1-2 s a process)
WORKER = textwrap.dedent(
    """
    import sys, time, types
    root, path, world_size, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    for name, sub in (("mpidist", ""), ("mpidist.store", "/store")):
        package = types.ModuleType(name)
        package.__path__ = [root + sub]
        sys.modules[name] = package
    from mpidist.errors import DistStoreError
    from mpidist.store.file import FileStore

    while time.time() < go:
        pass
    try:
        store = FileStore(path, world_size, timeout=20)
    except DistStoreError as exc:
        print("refused", exc, flush=True)
        sys.exit(2)
    print("joined", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "set":
                store.set(args[0], args[1])
                print("ok", flush=True)
            elif cmd == "get":
                print("value", store.get(args[0]).decode(), flush=True)
            elif cmd == "add":
                print("value", store.add(args[0], int(args[1])), flush=True)
            elif cmd == "close":
                store.close()
                print("ok", flush=True)
        except DistStoreError as exc:
            print("error", exc, flush=True)
    """
)


class Worker:
    """A process of job ``job`` (its own MPIDIST_SECRET) holding a FileStore, driven line by line."""

    def __init__(self, path: str, world_size: int, job: str, secret: str | None, go: float = 0.0) -> None:
        env = {k: v for k, v in os.environ.items() if k not in (*SECRET_VARS, "PMI_FD")}  # not a rank of pytest's job
        if secret is not None:
            env["MPIDIST_SECRET"] = secret
        self.job = job
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, PACKAGE_DIR, path, str(world_size), str(go)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def answer(self) -> str:
        line = self.proc.stdout.readline().strip()
        assert line, f"worker {self.proc.pid} of job {self.job} ended (rc {self.proc.poll()})"
        return line

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(20)


@pytest.fixture
def workers():
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


def refused_as_another_world(answer: str, path: str) -> bool:
    return answer.startswith(f"refused FileStore: {path!r} is in use by another world (") and (
        "its world's job secret (MPIDIST_SECRET) is not this process's" in answer
    )


def play(pair: list[Worker], job: str) -> list[str]:
    """Let the two ranks of ``job`` publish and count; return what each read of the other's key and the count."""
    for r, w in enumerate(pair):
        assert w.ask(f"set rank{r}/job {job}") == "ok"
        assert w.ask("add arrived 1") in ("value 1", "value 2")
    return [pair[0].ask("get rank1/job"), pair[1].ask("get rank0/job"), pair[0].ask("add arrived 0")]


@local
@pytest.mark.parametrize("world_size", [2, -1])
def test_ranks_of_two_jobs_arriving_in_turn_never_share_a_file(path, workers, world_size):
    """A0, then B0 (the file is not full yet), then A1 (a late joiner of A), then B1: only job A is on the file."""
    a0 = Worker(path, world_size, "A", SECRET_A)
    workers.append(a0)
    assert a0.answer() == "joined"
    assert a0.ask("set rank0/job A") == "ok"
    for job, secret in (("B", SECRET_B), ("A", SECRET_A), ("B", SECRET_B)):
        time.sleep(0.2)  # a late joiner
        w = Worker(path, world_size, job, secret)
        workers.append(w)
        answer = w.answer()
        if job == "A":
            assert answer == "joined", answer
        else:
            assert refused_as_another_world(answer, path), answer
            assert w.proc.wait(20) == 2
    a1 = workers[2]
    assert a1.ask("get rank0/job") == "value A"
    assert play([a0, a1], "A") == ["value A", "value A", "value 2"]  # 2 arrivals for 2 ranks, and A's keys only
    for w in (a0, a1):
        assert w.ask("close") == "ok"
    assert os.path.exists(path) == (world_size < 0)


@local
@pytest.mark.parametrize("world_size", [2, -1])
def test_two_jobs_starting_together_on_one_path_never_mix(path, workers, world_size):
    """Four processes open the path at the same instant: one job gets it whole, the other is refused whole."""
    go = time.time() + 1.0  # after every interpreter has started (0.2 s each)
    workers += [Worker(path, world_size, job, secret, go) for job, secret in (("A", SECRET_A), ("B", SECRET_B))
                for _ in range(2)]  # fmt: skip
    answers = {w: w.answer() for w in workers}
    joined = [w for w in workers if answers[w] == "joined"]
    refused = [w for w in workers if w not in joined]
    assert len(joined) == 2 and joined[0].job == joined[1].job, {w.job: a for w, a in answers.items()}
    assert all(refused_as_another_world(answers[w], path) for w in refused), [answers[w] for w in refused]
    job = joined[0].job
    assert play(joined, job) == [f"value {job}", f"value {job}", "value 2"]
    for w in joined:
        assert w.ask("close") == "ok"


@local
def test_a_file_left_by_another_killed_job_is_started_afresh(path, workers):
    old_job = [Worker(path, 2, "A", SECRET_A) for _ in range(2)]
    workers += old_job
    assert [w.answer() for w in old_job] == ["joined", "joined"]
    assert old_job[0].ask("set rank0/job A") == "ok"
    old = header(path)["id"]
    for w in old_job:
        w.stop()  # SIGKILL: the stores are never closed
    new_job = [Worker(path, 2, "B", SECRET_B) for _ in range(2)]
    workers += new_job
    assert [w.answer() for w in new_job] == ["joined", "joined"]
    assert header(path)["id"] != old
    assert play(new_job, "B") == ["value B", "value B", "value 2"]
    assert new_job[0].ask("get rank0/job") == "value B"  # job A's rank0/job was not carried over


# ---------------------------------------------------------------------------------------------
# 5. the ranks of this MPI job on one file (every world size)
# ---------------------------------------------------------------------------------------------


def test_the_ranks_of_one_job_share_one_file_of_mode_0600():
    directory = COMM.bcast(tempfile.mkdtemp(prefix="mpidist-security-") if RANK == 0 else None)
    path = os.path.join(directory, "store")
    problems: list[str] = []
    store = None
    try:
        store = FileStore(path, SIZE, timeout=timedelta(seconds=30))
        store.add("arrived", 1)
        store.set(f"rank{RANK}", json.dumps(RANK))
        store.wait([f"rank{r}" for r in range(SIZE)])
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode != 0o600:
            problems.append(f"mode {mode:04o}")
        if store.get("arrived") != str(SIZE).encode():
            problems.append(f"arrivals {store.get('arrived')!r}")
    except Exception as exc:  # noqa: BLE001 - reported through fail_together
        problems.append(f"{type(exc).__name__}: {exc}")
    COMM.Barrier()
    if store is not None:
        store.close()
    COMM.Barrier()
    if os.path.exists(path):
        problems.append("the file is still there after every rank closed")
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(directory, ignore_errors=True)
    fail_together(problems)
