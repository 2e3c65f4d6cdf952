"""TCPStore against hostile peers: greedy clients, a failing accept(), services that are not stores, frozen servers.

Every test runs in one process with servers and peers of its own on loopback
ports picked by the kernel (every rank runs the same tests under mpiexec,
independently). The wire format is pinned by a reference encoder written from
its specification (see ``mpidist/store/_protocol.py``): a frame is its body
length (8 bytes, big endian), then a code (1 byte), a field count (4 bytes) and
each field as its length (8 bytes) and bytes.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Callable

import pytest

from mpidist import DistNetworkError
from mpidist.store import TCPStore
from mpidist.store._protocol import Cmd
from mpidist.store._tcp_server import StoreServer, _Conn, listen

# each rank's own servers and peers, no MPI: in the world of one rank, under one MPI library
pytestmark = [pytest.mark.timeout(30), pytest.mark.one_rank, pytest.mark.one_library]

#: an error that must come at once (not after a store timeout) comes within this many seconds
PROMPT = 1.0
#: a timeout is reported within the timeout plus this
SLACK = 1.0

# the wire format, from its specification
HELLO, SET, GET, ADD = 1, 2, 3, 4
OK, ERROR = 0, 1
MAGIC = b"mpidist-tcpstore-1"
MiB = 1 << 20


def frame(code: int, *fields: bytes) -> bytes:
    body = struct.pack("!BI", code, len(fields)) + b"".join(struct.pack("!Q", len(f)) + f for f in fields)
    return struct.pack("!Q", len(body)) + body


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    (n,) = struct.unpack("!Q", recv_exact(sock, 8))
    body = recv_exact(sock, n)
    code, count = struct.unpack_from("!BI", body)
    at, fields = 5, []
    for _ in range(count):
        (k,) = struct.unpack_from("!Q", body, at)
        fields.append(body[at + 8 : at + 8 + k])
        at += 8 + k
    assert at == len(body)
    return code, fields


def raw_client(port: int, rcvbuf: int | None = None) -> socket.socket:
    """A connection that has made the handshake, and then does what the test makes it do."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(frame(HELLO, MAGIC))
    assert read_frame(sock) == (OK, [])
    return sock


def until(condition: Callable[[], bool], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture
def server_with_cap():
    """server_with_cap(cap) starts a StoreServer dropping clients past ``cap`` queued bytes."""
    servers: list[StoreServer] = []

    def start(cap: int, listener: socket.socket | None = None) -> StoreServer:
        server = StoreServer(listener or listen("127.0.0.1", 0, "test"), max_queued_bytes=cap)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def the_conn(server: StoreServer, client: socket.socket):
    """The server's record of ``client``'s connection (white box: to see what it still holds)."""
    peer = "{}:{}".format(*client.getsockname()[:2])
    assert until(lambda: any(c.peer == peer for c in list(server._conns)))
    return next(c for c in list(server._conns) if c.peer == peer)


# ---------------------------------------------------------------------------------------------
# item 6: the server holds a bounded amount for each client
# ---------------------------------------------------------------------------------------------


def test_a_client_that_pipelines_gets_and_never_reads_is_dropped(server_with_cap, caplog):
    cap = 4 * MiB
    server = server_with_cap(cap)
    with TCPStore("127.0.0.1", server.port, timeout=10) as store:
        store.set("big", b"x" * MiB)
        greedy = raw_client(server.port, rcvbuf=32 * 1024)
        with caplog.at_level(logging.WARNING, logger="mpidist.store"):
            greedy.sendall(frame(GET, b"big", b"-1") * 400)  # 400 MiB of replies if all were queued
            assert until(lambda: server.dropped == 1), server.connection_stats()
        (held,) = [int(n) for n in re.findall(r"replies it has not read hold (\d+) bytes", caplog.text)]
        assert cap < held <= cap + MiB + 1024  # the limit, passed by one reply at most
        assert all(queued <= cap for _, _, queued in server.connection_stats())
        # the greedy client gets what the kernel held for it, then the end: far from 400 replies
        replies = 0
        try:
            while True:
                code, fields = read_frame(greedy)
                assert (code, len(fields[0])) == (OK, MiB)
                replies += 1
        except (ConnectionError, OSError):
            pass
        assert replies < 30
        greedy.close()
        assert store.get("big") == b"x" * MiB  # well-behaved clients are served as before
        assert server.dropped == 1


def test_one_reply_larger_than_the_limit_is_sent_not_dropped(server_with_cap):
    server = server_with_cap(MiB)
    with TCPStore("127.0.0.1", server.port, timeout=10) as store:
        store.set("big", b"y" * (8 * MiB))
        slow = raw_client(server.port, rcvbuf=32 * 1024)
        slow.sendall(frame(GET, b"big", b"-1"))
        conn = the_conn(server, slow)
        assert until(lambda: conn.queued > MiB)  # most of the reply waits in the server for the slow reader
        time.sleep(0.2)
        assert server.dropped == 0 and not conn.closed
        assert read_frame(slow) == (OK, [b"y" * (8 * MiB)])
        assert until(lambda: conn.queued == 0)
        slow.close()
        assert store.get("big") == b"y" * (8 * MiB)


def test_a_client_that_sends_while_its_get_is_parked_is_dropped(server_with_cap):
    server = server_with_cap(MiB)
    with TCPStore("127.0.0.1", server.port, timeout=10) as store:
        pushy = raw_client(server.port)
        pushy.sendall(frame(GET, b"never", b"300000"))  # parked for 300 s
        conn = the_conn(server, pushy)
        assert until(lambda: conn.waiter is not None)
        try:
            pushy.sendall(frame(SET, b"k", b"z" * (3 * MiB)))
        except OSError:
            pass  # dropped while sending
        assert until(lambda: server.dropped == 1)
        assert conn.closed and len(conn.inbuf) == 0 and conn.waiter is None
        assert "never" not in server._parked
        pushy.close()
        assert not store.check(["k"])
        store.set("k", "v")
        assert store.get("k") == b"v"


def test_a_dropped_connection_frees_its_buffers_and_parked_request_at_once(server_with_cap):
    server = server_with_cap(64 * MiB)
    with TCPStore("127.0.0.1", server.port, timeout=10):
        partial = raw_client(server.port)
        request = frame(SET, b"k", b"p" * (32 * MiB))
        partial.sendall(request[: 8 * MiB])  # a large request, cut short
        conn = the_conn(server, partial)
        assert until(lambda: len(conn.inbuf) >= 8 * MiB)
        partial.close()
        assert until(lambda: conn.closed)
        assert len(conn.inbuf) == 0 and conn.queued == 0 and not conn.out

        parked = raw_client(server.port)
        parked.sendall(frame(GET, b"missing", b"300000"))  # a deadline 300 s away, in the server's heap
        conn = the_conn(server, parked)
        assert until(lambda: conn.waiter is not None)
        waiter = conn.waiter
        parked.close()
        assert until(lambda: conn.closed)
        assert waiter.done and waiter.conn is None and waiter.keys == []  # the heap entry holds nothing
        assert "missing" not in server._parked
        assert all(entry[2].conn is not conn for entry in server._deadlines)


def test_answered_requests_do_not_pile_up_in_the_deadline_heap():
    server = StoreServer(listen("127.0.0.1", 0, "test"))  # not started: driven from this thread
    mine, theirs = socket.socketpair()
    mine.setblocking(False)
    theirs.setblocking(False)
    conn = _Conn(mine, "test")
    server._sel.register(mine, selectors.EVENT_READ, conn)
    longest = 0
    for i in range(3000):  # each get parks with a deadline 300 s away, then is answered at once
        assert server._park(conn, Cmd.GET, [f"k{i}"], 300.0) is None
        server._store(f"k{i}", b"v")
        assert conn.waiter is None
        longest = max(longest, len(server._deadlines))
        if i % 50 == 0:  # read the replies, as a client does
            try:
                while theirs.recv(1 << 20):
                    pass
            except BlockingIOError:
                pass
    assert longest <= 1025  # entries of answered requests are swept, not kept for 300 s
    assert server._done_in_heap == sum(entry[2].done for entry in server._deadlines)
    server.stop()
    mine.close()
    theirs.close()


class FlakyListener(socket.socket):
    """A listening socket whose accept() fails with EMFILE while ``failing`` is set, counting the calls."""

    failing = True
    calls = 0

    def accept(self):
        self.calls += 1
        if self.failing:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return super().accept()


def test_accept_failing_with_emfile_backs_off_instead_of_spinning(server_with_cap, caplog):
    listener = FlakyListener(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    with caplog.at_level(logging.WARNING, logger="mpidist.store"):
        server = server_with_cap(MiB, listener)
        waiting = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # left in the backlog
        time.sleep(0.6)
    assert 2 <= listener.calls <= 15, listener.calls  # spinning would make thousands of calls
    assert "cannot accept connections" in caplog.text
    listener.failing = False
    start = time.monotonic()
    with TCPStore("127.0.0.1", server.port, timeout=10) as store:  # served once accept() works again
        store.set("k", "v")
        assert store.get("k") == b"v"
    assert time.monotonic() - start < 1.0 + SLACK  # within the longest pause
    waiting.sendall(frame(HELLO, MAGIC))  # the connection that waited in the backlog is served too
    assert read_frame(waiting) == (OK, [])
    waiting.close()


REAL_EMFILE = """
import os, resource, socket, sys, time
from mpidist.store._tcp_server import StoreServer, listen
server = StoreServer(listen("127.0.0.1", 0, "emfile"))  # its descriptors are made before the limit
clients = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]  # in the backlog
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, hard))  # no descriptor left
server.start()
time.sleep(0.1)
start = time.process_time()
time.sleep(0.5)
cpu = time.process_time() - start
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
for sock in clients:  # served once descriptors are free again
    sock.settimeout(5)
    sock.sendall(bytes.fromhex(sys.argv[1]))
    assert sock.recv(100) == bytes.fromhex(sys.argv[2])
print(cpu)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd (Linux)")
def test_a_real_emfile_does_not_make_the_server_spin():
    hello, ok = frame(HELLO, MAGIC).hex(), frame(OK).hex()
    child = subprocess.run([sys.executable, "-c", REAL_EMFILE, hello, ok], capture_output=True, text=True, timeout=20)
    assert child.returncode == 0, child.stderr
    assert "cannot accept connections ([Errno 24] Too many open files)" in child.stderr
    assert float(child.stdout) < 0.15  # CPU seconds in 0.5 s; a spinning accept loop takes about 0.5


def test_server_tells_a_client_of_another_protocol_version_why(server_with_cap):
    server = server_with_cap(MiB)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(frame(HELLO, b"mpidist-tcpstore-2"))
    code, fields = read_frame(sock)
    assert code == ERROR and b"protocol mismatch" in fields[0] and MAGIC in fields[0]
    assert sock.recv(10) == b""  # then dropped
    sock.close()


# ---------------------------------------------------------------------------------------------
# item 7: the client validates the handshake and frame sizes, and honours its timeout
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_peer():
    """fake_peer(handler) listens on a loopback port and runs handler(conn, stop) on each connection."""
    stop = threading.Event()
    sockets: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def run(handler: Callable[[socket.socket, threading.Event], None], conn: socket.socket) -> None:
        try:
            handler(conn, stop)
        except OSError:
            pass

    def start(handler: Callable[[socket.socket, threading.Event], None]) -> int:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.05)
        sockets.append(listener)

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                conn.settimeout(0.05)
                sockets.append(conn)
                worker = threading.Thread(target=run, args=(handler, conn), daemon=True)
                threads.append(worker)
                worker.start()

        thread = threading.Thread(target=serve, daemon=True)
        threads.append(thread)
        thread.start()
        return listener.getsockname()[1]

    yield start
    stop.set()
    for thread in threads:
        thread.join(5)
    for sock in sockets:
        sock.close()


def read_some(conn: socket.socket, stop: threading.Event) -> bytes:
    while not stop.is_set():
        try:
            return conn.recv(4096)
        except socket.timeout:
            continue
    return b""


def linger(conn: socket.socket, stop: threading.Event) -> None:
    """Read and ignore whatever comes, until the client closes or the test ends."""
    while not stop.is_set():
        try:
            if not conn.recv(65536):
                return
        except socket.timeout:
            continue


def http_server(conn: socket.socket, stop: threading.Event) -> None:
    read_some(conn, stop)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    conn.close()


def ssh_server(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")  # a banner, before the client says anything
    linger(conn, stop)


def short_answer(conn: socket.socket, stop: threading.Event) -> None:
    read_some(conn, stop)
    conn.sendall(b"\x00\x01")
    conn.close()


def odd_frame(conn: socket.socket, stop: threading.Event) -> None:
    read_some(conn, stop)
    conn.sendall(frame(7, b"hello?"))  # a well-formed frame, but not a reply a TCPStore server gives
    linger(conn, stop)


def other_version(conn: socket.socket, stop: threading.Event) -> None:
    read_some(conn, stop)
    conn.sendall(frame(ERROR, b"TCPStore server: protocol mismatch: speaking b'mpidist-tcpstore-9'"))
    conn.close()


@pytest.mark.parametrize(
    ("handler", "answer"),
    [
        (http_server, r"b'HTTP/1\.1 400 Bad Request"),
        (ssh_server, r"b'SSH-2\.0-OpenSSH_9\.6\\r\\n'"),
        (short_answer, r"b'\\x00\\x01'"),
        (odd_frame, r"b'\\x00"),
    ],
    ids=["http", "ssh", "two-bytes", "odd-frame"],
)
def test_a_service_that_is_not_a_store_is_named_at_once(fake_peer, handler, answer):
    port = fake_peer(handler)
    start = time.monotonic()
    with pytest.raises(
        DistNetworkError,
        match=rf"^TCPStore: the peer at 127\.0\.0\.1:{port} is not a mpidist store: it answered the handshake "
        rf"with {answer}.*check host_name and port",
    ):
        TCPStore("127.0.0.1", port, timeout=20)
    assert time.monotonic() - start < PROMPT


def test_a_server_of_another_version_is_named_at_once(fake_peer):
    port = fake_peer(other_version)
    start = time.monotonic()
    with pytest.raises(
        DistNetworkError,
        match=rf"^TCPStore: the TCPStore server at 127\.0\.0\.1:{port} refused the handshake \(TCPStore "
        r"server: protocol mismatch.*\); run the same mpidist version",
    ):
        TCPStore("127.0.0.1", port, timeout=20)
    assert time.monotonic() - start < PROMPT


def joins_then(reply: bytes | None, close: bool = False) -> Callable[[socket.socket, threading.Event], None]:
    """A peer that makes the handshake and answers the store's join, then sends ``reply`` (None: nothing)
    to the next request, and closes the connection if ``close``."""

    def handler(conn: socket.socket, stop: threading.Event) -> None:
        conn.settimeout(5)
        assert read_frame(conn) == (HELLO, [MAGIC])
        conn.sendall(frame(OK))
        assert read_frame(conn)[0] == ADD
        conn.sendall(frame(OK, b"1"))
        conn.settimeout(0.05)
        read_some(conn, stop)
        if reply is not None:
            conn.sendall(reply)
        if close:
            conn.close()
            return
        linger(conn, stop)

    return handler


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (
            b"HTTP/1.1 200 OK\r\n\r\n",
            rf"malformed reply \(it announced a frame of {int.from_bytes(b'HTTP/1.1', 'big')} ",
        ),
        (struct.pack("!Q", 1 << 50), r"malformed reply \(it announced a frame of 1125899906842624 bytes; frames hold "),
        (struct.pack("!Q", 100 << 30) + b"\x00" * 1000, r"lost the connection .*after 1000 of 107374182400 bytes"),
    ],
    ids=["text", "over-1-TiB", "100-GiB-then-closed"],
)
def test_a_bogus_frame_size_fails_the_request_without_allocating_it(fake_peer, reply, error):
    port = fake_peer(joins_then(reply, close=True))
    store = TCPStore("127.0.0.1", port, timeout=3)
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=rf"^TCPStore\.set: .*{error}"):
        store.set("k", "v")  # a bare MemoryError before
    elapsed = time.monotonic() - start
    store.close()
    assert elapsed < 3  # not the store's timeout: the peer closed, or said something impossible


def test_a_frozen_server_fails_set_and_add_within_the_store_timeout(fake_peer):
    timeout = 1.0  # the least a reply may take (shorter store timeouts are for waits)
    port = fake_peer(joins_then(None))
    for call in (lambda s: s.set("k", "v"), lambda s: s.add("n", 1), lambda s: s.wait(["k"], 0.3)):
        store = TCPStore("127.0.0.1", port, timeout=timeout)
        start = time.monotonic()
        with pytest.raises(
            DistNetworkError, match=r"^TCPStore\.(set|add|wait): the TCPStore server at .* did not reply within 0:00:01"
        ):
            call(store)
        elapsed = time.monotonic() - start
        assert timeout * 0.9 <= elapsed < timeout + 0.3 + SLACK  # the store's timeout, not a 30 s floor
        with pytest.raises(DistNetworkError, match=r"was lost earlier \(no reply within"):
            store.get("k")  # the store says at once that it cannot be used any more
        store.close()


def test_a_frozen_handshake_times_out_as_configured(fake_peer):
    port = fake_peer(linger)  # accepts, never answers
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=r"^TCPStore: could not connect to a TCPStore server at .* within"):
        TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - start < 0.5 + SLACK
