"""TCPStore with a job secret: only processes that prove it get in, and clients refuse a server that cannot.

Every test runs in one process, with servers and raw peers of its own on
loopback ports the kernel picks. The raw peers speak the wire format from its
specification (``mpidist/store/_protocol.py``, ``_handshake.py``) without
mpidist's code, so that what an attacker can send is what is tested.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time

import pytest

from mpidist import DistNetworkError
from mpidist._auth import SECRET_ENV, SECRET_FILE_ENV, SecretKey, munge_key, secret_from_env
from mpidist.store import TCPStore

pytestmark = [pytest.mark.timeout(60), pytest.mark.one_rank, pytest.mark.one_library]

SECRET = b"s3cret-of-this-job-0123456789abcdef"
HELLO, SET, GET, NUM_KEYS = 1, 2, 3, 8
OK, ERROR = 0, 1
MAGIC = b"mpidist-tcpstore-1"
#: an error that must come at once comes within this many seconds
PROMPT = 1.0


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
    return code, fields


def transcript(nonce_c: bytes, nonce_s: bytes) -> bytes:
    """What the server's proof is made over (the client's: this, ``|`` and its ``who``), from the specification."""
    return b"mpidist-auth-1|store|hmac|" + nonce_c + nonce_s


def proof(secret: bytes, role: bytes, message: bytes) -> bytes:
    return hmac.new(secret, role + b"|" + message, hashlib.sha256).digest()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def closed_without_reply(sock: socket.socket) -> bool:
    """True when the server closes ``sock`` without answering anything but a refusal (ERROR) first."""
    try:
        while True:
            code, fields = read_frame(sock)
            if code != ERROR:
                return False
    except (ConnectionError, OSError):
        return True


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, None, True, 10, wait_for_workers=False, secret=SECRET)
    store.set("job_key", "mine")
    yield store
    store.close()


def test_members_get_in_and_see_each_other(master):
    client = TCPStore("127.0.0.1", master.port, None, False, 10, secret=SECRET)
    assert client.get("job_key") == b"mine"
    client.set("from_client", "1")
    assert master.get("from_client") == b"1"
    client.close()


@pytest.mark.parametrize("secret", [None, b"another-job-secret-0123456789"], ids=["no-secret", "wrong-secret"])
def test_a_non_member_is_refused_at_once_and_changes_nothing(master, secret):
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=rf"127\.0\.0\.1:{master.port}"):
        TCPStore("127.0.0.1", master.port, None, False, 10, secret=secret)
    assert time.monotonic() - start < PROMPT
    assert master.get("job_key") == b"mine"
    assert master.num_keys() == 2  # the master's join and job_key: the refused client never joined


def test_a_refused_client_is_logged_with_its_address(master, caplog):
    with caplog.at_level(logging.WARNING, logger="mpidist.store"):
        with pytest.raises(DistNetworkError, match="refused"):
            TCPStore("127.0.0.1", master.port, None, False, 10)
        deadline = time.monotonic() + 5
        while "refused a connection from 127.0.0.1:" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert f"port {master.port}: refused a connection from 127.0.0.1:" in caplog.text
    assert SECRET.decode() not in caplog.text


def test_requests_before_the_proof_are_never_served(master):
    """A raw client that skips the proof and sends requests gets no answer to any of them."""
    sock = connect(master.port)
    sock.sendall(frame(HELLO, MAGIC) + frame(GET, b"job_key", b"1000") + frame(SET, b"job_key", b"evil"))
    code, fields = read_frame(sock)
    assert code == ERROR and b"refused" in fields[0]
    assert closed_without_reply(sock)
    sock.close()
    assert master.get("job_key") == b"mine"


def test_a_replayed_handshake_is_refused(master):
    """A member's recorded handshake bytes, sent again on a new connection, do not get in (fresh server nonce)."""
    nonce_c, who = os.urandom(32), b"pid=1 host=h"
    first = connect(master.port)
    first.sendall(frame(HELLO, MAGIC, b"hmac", nonce_c))
    code, (nonce_s, server_proof) = read_frame(first)
    assert code == OK
    assert hmac.compare_digest(server_proof, proof(SECRET, b"server", transcript(nonce_c, nonce_s)))
    client_proof = proof(SECRET, b"client", transcript(nonce_c, nonce_s) + b"|" + who)
    recorded = frame(HELLO, MAGIC, b"hmac", nonce_c) + frame(HELLO, client_proof, who)
    first.sendall(frame(HELLO, client_proof, who))
    assert read_frame(first) == (OK, [])  # the member's own connection is admitted
    first.sendall(frame(GET, b"job_key", b"1000"))
    assert read_frame(first) == (OK, [b"mine"])
    first.close()

    replay = connect(master.port)
    replay.sendall(recorded + frame(SET, b"job_key", b"evil"))
    code, fields = read_frame(replay)
    assert code == OK and fields[0] != nonce_s  # a new challenge
    assert closed_without_reply(replay)
    replay.close()
    assert master.get("job_key") == b"mine"


def test_the_servers_own_proof_reflected_back_is_refused(master):
    nonce_c = os.urandom(32)
    sock = connect(master.port)
    sock.sendall(frame(HELLO, MAGIC, b"hmac", nonce_c))
    _, (nonce_s, server_proof) = read_frame(sock)
    sock.sendall(frame(HELLO, server_proof, b"") + frame(SET, b"job_key", b"evil"))
    assert closed_without_reply(sock)
    sock.close()
    assert master.get("job_key") == b"mine"


def test_a_squatter_on_the_port_gets_no_key_and_the_client_fails_at_once():
    """A keyless mpidist server (another user's, holding the port) is refused by a client with the secret."""
    squatter = TCPStore("127.0.0.1", 0, None, True, 10, wait_for_workers=False)
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=rf"Another process holds port {squatter.port}"):
        TCPStore("127.0.0.1", squatter.port, None, False, 10, secret=SECRET)
    assert time.monotonic() - start < PROMPT
    assert squatter.num_keys() == 1  # only its own join
    with pytest.raises(DistNetworkError, match=rf"another process holds port {squatter.port}"):
        TCPStore("127.0.0.1", squatter.port, None, True, 10, secret=SECRET)  # and the master cannot bind it
    squatter.close()


def test_a_squatter_that_fakes_the_challenge_learns_nothing_usable():
    """A raw listener answering with a made-up proof: the client fails at once and sends no request."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: list[tuple[int, list[bytes]]] = []

    def serve() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        with conn:
            seen.append(read_frame(conn))
            conn.sendall(frame(OK, os.urandom(32), os.urandom(32)))
            try:
                seen.append(read_frame(conn))
            except (ConnectionError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=rf"Another process holds port {port}"):
        TCPStore("127.0.0.1", port, None, False, 10, secret=SECRET)
    assert time.monotonic() - start < PROMPT
    thread.join(5)
    listener.close()
    assert len(seen) == 1  # the HELLO with a nonce, nothing after it
    code, fields = seen[0]
    assert code == HELLO and fields[0] == MAGIC and fields[1] == b"hmac" and len(fields) == 3  # no name, no proof


def test_a_stalled_handshake_holds_up_no_member(master):
    """Peers that connect and never finish the handshake do not delay the job's own clients."""
    stalled = [connect(master.port) for _ in range(20)]
    for sock in stalled[:10]:
        sock.sendall(frame(HELLO, MAGIC, b"hmac", os.urandom(32)))  # then never the proof
    start = time.monotonic()
    client = TCPStore("127.0.0.1", master.port, None, False, 10, secret=SECRET)
    assert client.get("job_key") == b"mine"
    assert time.monotonic() - start < PROMPT
    client.close()
    for sock in stalled:
        sock.close()


def test_a_key_of_another_kind_is_refused_with_the_reason():
    key = munge_key()
    if key is None:
        pytest.skip("munged does not answer on this machine (tests/cluster starts it with Slurm)")
    master = TCPStore("127.0.0.1", 0, None, True, 10, wait_for_workers=False, secret=key)
    try:
        member = TCPStore("127.0.0.1", master.port, None, False, 10, secret=key)
        member.set("k", "v")
        assert master.get("k") == b"v"
        with pytest.raises(DistNetworkError, match="'munge' proofs of membership, the client offered 'hmac'"):
            TCPStore("127.0.0.1", master.port, None, False, 10, secret=SECRET)
    finally:
        master.close()


@pytest.mark.parametrize("bad", [b"short", 7], ids=["too-short", "not-bytes"])
def test_a_bad_secret_argument_is_named(bad):
    with pytest.raises((TypeError, ValueError), match="^TCPStore: secret must"):
        TCPStore("127.0.0.1", 0, None, True, 10, wait_for_workers=False, secret=bad)


def test_the_secret_from_the_environment_and_from_a_file(tmp_path):
    assert secret_from_env("f", {}) is None
    assert secret_from_env("f", {SECRET_ENV: "x" * 20}) == b"x" * 20
    with pytest.raises(ValueError, match=f"^f: the secret in {SECRET_ENV} must be at least 16 bytes"):
        secret_from_env("f", {SECRET_ENV: "short"})
    path = tmp_path / "secret"
    path.write_text("y" * 40 + "\n")
    path.chmod(0o600)
    assert secret_from_env("f", {SECRET_FILE_ENV: str(path)}) == b"y" * 40
    path.chmod(0o640)
    with pytest.raises(ValueError, match="readable by no one else .*mode 640.*chmod 600"):
        secret_from_env("f", {SECRET_FILE_ENV: str(path)})
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ValueError, match="cannot read"):
        secret_from_env("f", {SECRET_FILE_ENV: str(link)})


def test_the_secret_is_never_in_a_repr_or_message(master):
    assert SECRET.decode() not in repr(SecretKey(SECRET))
    try:
        TCPStore("127.0.0.1", master.port, None, False, 10, secret=b"another-job-secret-0123456789")
    except DistNetworkError as exc:
        assert SECRET.decode() not in str(exc) and "another-job-secret" not in str(exc)


def test_a_connection_that_never_proves_membership_is_closed_in_time(caplog):
    """Peers that connect and say nothing cannot pile up: each is closed after the handshake's time (logged)."""
    from mpidist._auth import SecretKey
    from mpidist.store._tcp_server import StoreServer, listen

    server = StoreServer(listen("127.0.0.1", 0, "test"), key=SecretKey(SECRET), handshake_s=0.3)
    server.start()
    try:
        with caplog.at_level(logging.WARNING, logger="mpidist.store"):
            silent = [connect(server.port) for _ in range(5)]
            start = time.monotonic()
            assert all(closed_without_reply(sock) for sock in silent)
            assert 0.2 < time.monotonic() - start < 3.0
        assert caplog.text.count("did not prove membership within 0.3 s") == 5
        assert len(server.connection_stats()) == 0
    finally:
        server.stop()
        for sock in silent:
            sock.close()
