"""The handshake that opens every connection to a mpidist listener: membership proved both ways.

On the wire it is frames of ``_protocol.py``::

    client -> HELLO  [magic]                              (no key: as before; admitted at once)
    client -> HELLO  [magic, kind, client nonce]          (a job key of ``kind``, or "none")
    server -> OK     [server nonce, server's proof]       (its proof is empty where it has no key)
    client -> HELLO  [client's proof, who]                (its proof is empty where it has no key)
    server -> OK     []                                   (admitted)

The server's proof is over :func:`mpidist._auth.transcript` of the service, the
kind and both nonces; the client's over that and ``who`` (its description of
itself: rank, host, pid), so ``who`` is proved too. The client says who it is
only once the server has proved the key: a squatter on the port learns nothing
but a random nonce. A client with a key refuses an empty or wrong proof (the
listener cannot prove the secret: another process holds the port); a server
with a key answers a HELLO without one, another kind, or a wrong proof with
``ERROR`` and closes. Nothing else a client sends is read before it is admitted.

:class:`Acceptor` is the server's side as a state machine fed one frame at a
time (the TCPStore server's selector loop and the PMI server's threads use it);
:func:`client_handshake` and :func:`server_handshake` run it on blocking sockets.

Example::

    >>> from mpidist._auth import SecretKey, new_secret
    >>> key = SecretKey(new_secret())
    >>> acceptor = Acceptor(key, b"store", b"magic")
    >>> hello, nonce = hello_fields(key, b"magic", b"rank 1")
    >>> status, fields = acceptor.step(Cmd.HELLO, hello)
    >>> status == Status.OK and len(fields) == 2
    True
"""

from __future__ import annotations

import socket

from .._auth import NONCE_BYTES, JobKey, new_nonce, transcript
from . import _protocol as wire
from ._protocol import Cmd, Status

__all__ = [
    "Acceptor",
    "HandshakeRefusedError",
    "NotProvenError",
    "NotThisProtocolError",
    "hello_fields",
    "client_handshake",
    "server_handshake",
]

#: the longest ``who`` a client may send (bytes)
_MAX_WHO = 512
#: how many bytes of a foreign peer's answer an error message shows
_SHOWN_BYTES = 64


class HandshakeRefusedError(Exception):
    """The server refused this client (its ERROR message is the argument)."""


class NotProvenError(Exception):
    """The peer answered as a mpidist listener, but did not prove the job's key (the reason is the argument)."""


class NotThisProtocolError(Exception):
    """The peer's answer is no frame of this protocol (``answer``: the start of what it sent)."""

    def __init__(self, answer: bytes) -> None:
        super().__init__(answer)
        self.answer = answer


def hello_fields(key: JobKey | None, magic: bytes, who: bytes = b"") -> tuple[list[bytes], bytes]:
    """The client's first HELLO and its nonce (``b""`` for a plain HELLO without key or ``who``)."""
    if key is None and not who:
        return [magic], b""
    nonce = new_nonce()
    return [magic, (key.kind if key else "none").encode(), nonce], nonce


class Acceptor:
    """The server's side of one connection's handshake.

    Args:
        key: the job's key (None: admit every client that speaks the protocol).
        service: what the listener is (``b"store"``, ``b"pmi"``), part of what is proved.
        magic: the protocol's HELLO payload.
        name: the listener's name, which starts its messages to the clients it refuses.

    ``step`` takes each frame until :attr:`admitted` or :attr:`refused` (then
    :attr:`reason` says why, for the log) and returns the reply to send.
    """

    def __init__(self, key: JobKey | None, service: bytes, magic: bytes, name: str = "TCPStore server") -> None:
        self.key, self.service, self.magic, self.name = key, service, magic, name
        self.admitted = False
        self.refused = False
        self.reason = ""
        self.who = b""  # the client's description of itself (proved where there is a key)
        self._transcript = b""

    def step(self, code: int, fields: list[bytes]) -> tuple[Status, list[bytes]] | None:
        """The reply to a frame of the handshake (None: close without a reply)."""
        if self._transcript:
            return self._check_proof(code, fields)
        if code != Cmd.HELLO or not fields:
            return self._refuse("it did not start with HELLO", None)
        if fields[0] != self.magic:
            got = fields[0][:64]
            return self._refuse(
                f"protocol mismatch: it sent HELLO {got!r}",
                f"protocol mismatch: the server speaks {self.magic!r}, the client sent HELLO {got!r}",
            )
        if len(fields) == 1 and self.key is None:  # a plain HELLO: a client without a key or a name
            self.admitted = True
            return Status.OK, []
        if len(fields) != 3 or len(fields[2]) != NONCE_BYTES or (self.key is not None and fields[1] == b"none"):
            return self._refuse(
                "it offered no proof of membership",
                "refused: this listener serves only the processes of its job, which prove the job's secret; this "
                "client has none (set MPIDIST_SECRET as the job does, or pass secret=)",
            )
        kind = fields[1].decode("ascii", "replace")
        mine = self.key.kind if self.key is not None else "none"
        if kind != mine and self.key is not None:
            return self._refuse(
                f"it offered a {kind!r} proof, the job uses {mine!r}",
                f"refused: this listener takes {mine!r} proofs of membership, the client offered {kind!r} "
                "(start every process of the job the same way)",
            )
        server_nonce = new_nonce()
        self._transcript = transcript(self.service, kind, fields[2], server_nonce)
        proof = self.key.prove(b"server", self._transcript) if self.key is not None else b""
        return Status.OK, [server_nonce, proof]

    def _check_proof(self, code: int, fields: list[bytes]) -> tuple[Status, list[bytes]] | None:
        if code == Cmd.HELLO and len(fields) == 2 and len(fields[1]) <= _MAX_WHO:
            proved = self._transcript + b"|" + fields[1]
            if self.key is None or self.key.verify(b"client", proved, fields[0]):
                self.who, self.admitted = fields[1], True
                return Status.OK, []
        return self._refuse(
            "its proof of membership is wrong",
            "refused: the proof of membership is wrong (this process does not hold the job's secret)",
        )

    def _refuse(self, reason: str, message: str | None) -> tuple[Status, list[bytes]] | None:
        self.refused, self.reason = True, reason
        return None if message is None else (Status.ERROR, [f"{self.name}: {message}".encode()])


def client_handshake(sock: socket.socket, key: JobKey | None, service: bytes, magic: bytes, who: bytes = b"") -> None:
    """Prove membership to the listener on ``sock`` and check its proof (blocking).

    Raises:
        HandshakeRefusedError: the listener refused this client (its message is the argument).
        NotProvenError: the listener answered, but cannot prove the job's key.
        NotThisProtocolError: the peer is no mpidist listener (``answer`` holds what it sent).
        OSError: the connection failed, timed out or closed before any answer.
    """
    fields, nonce = hello_fields(key, magic, who)
    sock.sendall(wire.encode(Cmd.HELLO, fields))
    status, reply, head = _answer(sock)
    if status == Status.ERROR and len(reply) == 1:
        raise HandshakeRefusedError(reply[0].decode("utf-8", "replace"))
    if status != Status.OK:
        raise NotThisProtocolError(head)
    if not nonce:  # a plain HELLO
        if reply:
            raise NotThisProtocolError(head)
        return
    if len(reply) != 2 or len(reply[0]) != NONCE_BYTES:
        raise NotThisProtocolError(head)
    proved = transcript(service, fields[1].decode(), nonce, reply[0])
    if key is None:
        if reply[1]:
            raise NotProvenError("the listener asks for a proof of membership, and this process has no secret")
        proof = b""
    elif not reply[1]:
        raise NotProvenError("it admits everyone: it was started without the job's secret")
    elif not key.verify(b"server", proved, reply[1]):
        raise NotProvenError(
            "it cannot prove the job's secret: its munge credential is not this user's (it runs as another user, or this process is not of its job)"
            if key.kind == "munge"
            else "its proof of the job's secret is wrong"
        )
    else:
        proof = key.prove(b"client", proved + b"|" + who[:_MAX_WHO])
    sock.sendall(wire.encode(Cmd.HELLO, [proof, who[:_MAX_WHO]]))
    status, reply, head = _answer(sock)
    if status == Status.ERROR and len(reply) == 1:
        raise HandshakeRefusedError(reply[0].decode("utf-8", "replace"))
    if status != Status.OK or reply:
        raise NotThisProtocolError(head)


def _answer(sock: socket.socket) -> tuple[int, list[bytes], bytes]:
    """One handshake frame from ``sock`` and its first bytes; NotThisProtocolError if what comes is not one."""
    head = b""
    while len(head) < wire.LENGTH.size:
        chunk = sock.recv(wire.LENGTH.size - len(head))
        if not chunk:
            if head:
                raise NotThisProtocolError(head)
            raise ConnectionError("the peer closed the connection during the handshake")
        head += chunk
    try:
        n = wire.frame_length(head, wire.MAX_HELLO_BYTES)
    except ValueError:
        raise NotThisProtocolError(head + _more(sock)) from None
    try:
        return (*wire.decode(wire.recv_exact(sock, n)), head)
    except ValueError:
        raise NotThisProtocolError(head) from None


def _more(sock: socket.socket) -> bytes:
    """What the peer sent next, if it comes at once (for an error message)."""
    try:
        sock.settimeout(0.05)
        return sock.recv(_SHOWN_BYTES)
    except OSError:
        return b""


def server_handshake(sock: socket.socket, acceptor: Acceptor) -> bool:
    """Run ``acceptor`` on a blocking socket until the client is admitted (True) or refused (False).

    A peer that closes, sends what is not a frame, or is too slow (the socket's
    timeout) is refused. Nothing it sent beyond the handshake is read.
    """
    try:
        while not (acceptor.admitted or acceptor.refused):
            code, fields = wire.recv_frame(sock, wire.MAX_HELLO_BYTES)
            reply = acceptor.step(code, fields)
            if reply is not None:
                sock.sendall(wire.encode(*reply))
    except (OSError, ValueError) as exc:
        if not acceptor.refused:
            acceptor.refused, acceptor.reason = True, f"the handshake failed ({type(exc).__name__}: {exc})"
    return acceptor.admitted
