"""FileStore knows its world: another world's file, a crashed job's, a torn header, a late joiner, a replaced file.

The ranks of a world are separate processes here (workers started with
``subprocess``, driven through their stdin), because the file tells worlds
apart by the processes recorded in it. The test process itself plays the
process of the other world, the new job or the late joiner. Every test runs
in one process of its own world (``one_rank``) on a directory of its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from mpidist import DistStoreError
from mpidist.store import FileStore
from mpidist.store import _filelog as world

pytestmark = [pytest.mark.timeout(60), pytest.mark.one_rank, pytest.mark.one_library]

#: a store timeout for waits that are meant to time out
SHORT = 0.3

WORKER = textwrap.dedent(
    """
    import sys
    from mpidist import DistStoreError
    from mpidist.store import FileStore

    try:
        store = FileStore(sys.argv[1], int(sys.argv[2]), timeout=float(sys.argv[3]))
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
    """A process holding a FileStore, driven line by line."""

    def __init__(self, path: str, world_size: int, timeout: float = 20.0) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        env.pop("PMI_FD", None)  # not a rank of the pytest's MPI job
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, path, str(world_size), str(timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def answer(self) -> str:
        line = self.proc.stdout.readline().strip()
        assert line, f"worker {self.pid} ended (rc {self.proc.poll()})"
        return line

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def kill(self) -> None:
        """SIGKILL it (it never closes its store), and reap it."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(20)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(20)


def start(path: str, world_size: int, count: int) -> list[Worker]:
    """Start ``count`` workers on ``path`` (together) and wait until each joined."""
    workers = [Worker(path, world_size) for _ in range(count)]
    for w in workers:
        assert w.answer() == "joined"
    return workers


@pytest.fixture
def path():
    directory = tempfile.mkdtemp(prefix="mpidist-world-")
    yield os.path.join(directory, "store")
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def workers():
    started: list[Worker] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            w.kill()


def world_id(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(512)
    return json.loads(head[len(world.MAGIC) + world.HEAD.size :].decode())["id"]


def shown(w: Worker) -> str:
    return rf"pid {w.pid} on {re.escape(world.this_process()[0])}"


# ---------------------------------------------------------------------------------------------
# 1. a file another world uses now
# ---------------------------------------------------------------------------------------------


def test_a_process_of_another_world_is_refused_on_a_file_in_use(path, workers):
    workers += start(path, 2, 2)
    assert workers[0].ask("set rank0/address world-A") == "ok"
    size = os.path.getsize(path)
    with pytest.raises(DistStoreError) as info:
        FileStore(path, 2)  # world B's rank 0
    message = str(info.value)
    assert message.startswith(f"FileStore: {path!r} belongs to another world (world id {world_id(path)}, made ")
    assert re.search(rf"2 of 2 ranks joined: ({shown(workers[0])}, {shown(workers[1])}|"
                     rf"{shown(workers[1])}, {shown(workers[0])})\)", message), message  # fmt: skip
    assert f"this process (pid {os.getpid()} " in message
    assert os.path.getsize(path) == size  # the refused process wrote nothing
    assert workers[1].ask("get rank0/address") == "value world-A"
    for w in workers:
        assert w.ask("close") == "ok"
    assert not os.path.exists(path)


# ---------------------------------------------------------------------------------------------
# 2. a file left behind by a crashed job
# ---------------------------------------------------------------------------------------------


def test_a_file_left_by_a_killed_job_is_taken_over_afresh(path, workers, caplog):
    workers += start(path, 2, 2)
    assert workers[0].ask("set rank0/address old-job") == "ok"
    assert [w.ask("add arrived 1") for w in workers] == ["value 1", "value 2"]
    old_id = world_id(path)
    for w in workers:
        w.kill()
    assert os.path.exists(path)
    with caplog.at_level(logging.WARNING, logger="mpidist.store"):
        first = FileStore(path, 2, timeout=20)  # the new job's rank 0
    assert re.search(rf"{re.escape(repr(path))} was left by a crashed job \(world id {old_id}, .*"
                     rf"{shown(workers[0])}.* died without closing.*starting it afresh", caplog.text), caplog.text  # fmt: skip
    assert world_id(path) != old_id
    assert not first.check(["rank0/address", "arrived"])
    assert first.add("arrived", 1) == 1
    second = Worker(path, 2)  # the new job's rank 1 joins the new world
    workers.append(second)
    assert second.answer() == "joined"
    assert second.ask("add arrived 1") == "value 2"  # 2 arrivals for 2 ranks
    assert second.ask("close") == "ok"
    first.close()
    assert not os.path.exists(path)


def test_a_file_of_a_job_that_crashed_in_part_is_refused(path, workers):
    workers += start(path, 2, 2)
    dead, live = workers
    dead.kill()
    with pytest.raises(DistStoreError) as info:
        FileStore(path, 2)
    assert re.match(rf"FileStore: {re.escape(repr(path))} belongs to a world \(world id {world_id(path)}, .*\) in "
                    rf"which {shown(dead)} died without closing while {shown(live)} still hold stores on it",
                    str(info.value)), str(info.value)  # fmt: skip
    assert live.ask("close") == "ok"


# ---------------------------------------------------------------------------------------------
# 3. a truncated or garbled header
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [7, 50, 300])
def test_a_truncated_header_is_refused(path, cut):
    with FileStore(path) as store:  # world_size -1: the file stays
        store.set("k", "v")
    os.truncate(path, cut)
    with pytest.raises(DistStoreError, match=rf"^FileStore: {re.escape(repr(path))} has a truncated header: "
                       rf"{cut} of 512 bytes"):  # fmt: skip
        FileStore(path, 2)
    assert os.path.getsize(path) == cut


def test_a_garbled_header_is_refused(path):
    with FileStore(path) as store:
        store.set("k", "v")
    with open(path, "r+b") as f:
        f.seek(60)
        f.write(b"#")  # inside the header's JSON: its checksum fails, and records follow
    with pytest.raises(DistStoreError, match=rf"^FileStore: {re.escape(repr(path))} is damaged at byte 20: the "
                       r"file header is damaged \(a record that fails its checksum\)"):  # fmt: skip
        FileStore(path, 2)


# ---------------------------------------------------------------------------------------------
# 4. a late joiner, after the others removed the file
# ---------------------------------------------------------------------------------------------


def test_a_late_joiner_after_the_file_was_removed_times_out_saying_so(path, workers):
    workers += start(path, 2, 2)
    assert workers[0].ask("set rank0/address early") == "ok"
    for w in workers:
        assert w.ask("close") == "ok"
    assert not os.path.exists(path)  # the world ended and removed its file
    with FileStore(path, 2, timeout=SHORT) as late:  # it cannot know: it makes a new file alone
        start_s = time.monotonic()
        with pytest.raises(DistStoreError) as info:
            late.get("rank0/address")
        assert time.monotonic() - start_s < SHORT + 5
    message = str(info.value)
    assert message.startswith("FileStore.get: key 'rank0/address' was not set within ")
    assert f"1 of 2 ranks have joined {path!r} (world id " in message
    assert "finished and removed the file before this process opened it" in message and "late joiner" in message


# ---------------------------------------------------------------------------------------------
# 5. a file removed or replaced under a running world
# ---------------------------------------------------------------------------------------------


def test_a_file_replaced_under_a_running_world_is_refused(path, workers):
    workers += start(path, 2, 1)
    mine = FileStore(path, 2, timeout=20)
    assert workers[0].ask("set rank0/address before") == "ok"
    assert mine.get("rank0/address") == b"before"
    old_id, old_inode = world_id(path), os.stat(path).st_ino
    os.unlink(path)
    with FileStore(path, 1) as intruder:  # someone else makes a new file at the path
        intruder.set("rank0/address", "intruder")
        new_id = world_id(path)
        expected = (rf"^FileStore\.{{op}}: {re.escape(repr(path))} was removed or replaced while this store used the "
                    rf"file of world id {old_id} \(made .*\): it now names another file \(inode \d+\) of world id "
                    rf"{new_id} \(made ")  # fmt: skip
        with pytest.raises(DistStoreError, match=expected.format(op="get")):
            mine.get("rank0/address")
        with pytest.raises(DistStoreError, match=expected.format(op="set")):
            mine.set("k", "v")
        answer = workers[0].ask("get rank0/address")
        assert re.match(r"error " + expected[1:].format(op="get"), answer), answer
        assert os.stat(path).st_ino != old_inode or new_id != old_id
    mine.close()
    assert workers[0].ask("close") == "ok"


def test_a_file_removed_under_a_running_world_is_refused(path):
    a, b = FileStore(path, 2), FileStore(path, 2)
    os.unlink(path)
    with pytest.raises(DistStoreError, match=rf"^FileStore\.check: {re.escape(repr(path))} was removed or replaced "
                       r"while this store used the file of world id \w+ \(made .*\): nothing is there now"):  # fmt: skip
        a.check(["k"])
    a.close()
    b.close()
    assert not os.path.exists(path)


# ---------------------------------------------------------------------------------------------
# the rule, on identities
# ---------------------------------------------------------------------------------------------


def start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_liveness_of_recorded_processes():
    me = world.this_process()
    assert world.alive(me) is True
    assert world.parse_process_key(world.process_key(me)) == me
    assert world.alive(("another-host", "boot", "ns", 1, "1")) is None  # cannot be told: counts as running
    assert world.alive(me[:4] + ("not-its-start-time",)) is False  # the pid was reused
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = me[:3] + (child.pid, start_time(child.pid))  # with its start time: a reused pid is another process
    assert world.alive(killed) is True
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while world.alive(killed) is not False and time.monotonic() < deadline:
        time.sleep(0.01)  # killed, not reaped yet: a zombie, dead all the same
    assert world.alive(killed) is False
    child.wait(20)
    assert world.alive(killed) is False  # reaped
    reaped = killed
    other_host = ("another-host", "boot", "ns", 1, "1")
    assert world.judge_newcomer({me: 1}, 2)[0] == "join"
    assert world.judge_newcomer({me: 1, other_host: 1}, 2)[0] == "full"
    assert world.judge_newcomer({reaped: 1}, 2)[0] == "take over"
    assert world.judge_newcomer({reaped: 1, me: 0}, 2)[0] == "take over"  # the others left normally
    assert world.judge_newcomer({reaped: 1, other_host: 1}, 2)[0] == "broken"  # one may still run
