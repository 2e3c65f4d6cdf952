"""The wire format between ``TCPStore`` clients and their server.

Every message is a frame: its body length (8 bytes, big endian), then the body:
a one-byte code (a :class:`Cmd` in requests, a :class:`Status` in replies), the
number of fields (4 bytes), and each field as its length (8 bytes) and bytes.
Keys travel UTF-8 encoded, integers and timeouts as decimal text (timeouts in
milliseconds, ``-1`` for none). A connection starts with ``HELLO`` carrying
:data:`MAGIC`; the server drops a connection that starts otherwise (after an
``ERROR`` reply if it was a ``HELLO`` of another version). The client accepts
no handshake reply longer than :data:`MAX_HELLO_BYTES`, and no frame longer
than :data:`MAX_FRAME_BYTES`; a frame is read as its bytes arrive, so a bogus
length never allocates memory it does not fill.

Example::

    >>> frame = encode(Cmd.SET, [b"key", b"value"])
    >>> decode(frame[LENGTH.size:])
    (2, [b'key', b'value'])
"""

from __future__ import annotations

import math
import socket
import struct
from enum import IntEnum
from typing import Sequence

__all__ = [
    "Cmd",
    "Status",
    "MAGIC",
    "MAX_HELLO_BYTES",
    "MAX_FRAME_BYTES",
    "LENGTH",
    "encode",
    "decode",
    "recv_frame",
    "recv_exact",
    "frame_length",
    "key_field",
    "key_of",
    "int_field",
    "int_of",
    "timeout_field",
    "timeout_of",
]

#: the payload of the HELLO request (protocol version 1)
MAGIC = b"mpidist-tcpstore-1"
#: the largest frame accepted before HELLO (a stray connection cannot make the server buffer more)
MAX_HELLO_BYTES = 1024
#: the largest frame a client accepts (1 TiB): a longer length means the stream is not this protocol
MAX_FRAME_BYTES = 1 << 40
#: frames up to this size are read into one buffer allocated at once; longer ones grow as bytes arrive
_PREALLOC_BYTES = 64 << 20

LENGTH = struct.Struct("!Q")
_HEAD = struct.Struct("!BI")


class Cmd(IntEnum):
    """Request codes."""

    HELLO = 1
    SET = 2
    GET = 3  # key, timeout
    ADD = 4  # key, amount
    COMPARE_SET = 5  # key, expected, desired
    WAIT = 6  # timeout, *keys
    CHECK = 7  # *keys
    NUM_KEYS = 8
    DELETE_KEY = 9  # key
    APPEND = 10  # key, value
    MULTI_GET = 11  # timeout, *keys
    MULTI_SET = 12  # key0, value0, key1, value1, ...


class Status(IntEnum):
    """Reply codes."""

    OK = 0
    ERROR = 1  # one field: the message
    TIMEOUT = 2  # fields: the keys still missing
    NOT_A_COUNTER = 3  # ADD on a value that is not an integer; one field: the value


def encode(code: int, fields: Sequence[bytes]) -> bytes:
    """Return the frame of a message with ``code`` and ``fields``."""
    parts = [b"", _HEAD.pack(code, len(fields))]
    for f in fields:
        parts.append(LENGTH.pack(len(f)))
        parts.append(f)
    body_len = sum(len(p) for p in parts)
    parts[0] = LENGTH.pack(body_len)
    return b"".join(parts)


def decode(body: bytes | bytearray | memoryview) -> tuple[int, list[bytes]]:
    """Return (code, fields) of a frame's body; ValueError if it is malformed."""
    view = memoryview(body)
    if len(view) < _HEAD.size:
        raise ValueError("truncated message header")
    code, count = _HEAD.unpack_from(view, 0)
    at = _HEAD.size
    fields = []
    for _ in range(count):
        if at + LENGTH.size > len(view):
            raise ValueError("truncated field length")
        (n,) = LENGTH.unpack_from(view, at)
        at += LENGTH.size
        if at + n > len(view):
            raise ValueError("truncated field")
        fields.append(bytes(view[at : at + n]))
        at += n
    if at != len(view):
        raise ValueError("trailing bytes after the last field")
    return code, fields


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Read exactly ``n`` bytes; ConnectionError if the peer closes first."""
    if n > _PREALLOC_BYTES:
        return _recv_growing(sock, n)
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def _recv_growing(sock: socket.socket, n: int) -> bytearray:
    """Read exactly ``n`` bytes into a buffer that doubles as they arrive (from _PREALLOC_BYTES)."""
    buf = bytearray(_PREALLOC_BYTES)
    got = 0
    while got < n:
        if got == len(buf):
            buf += bytes(min(len(buf), n - got))
        k = sock.recv_into(memoryview(buf)[got:])
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def frame_length(head: bytes | bytearray, limit: int) -> int:
    """Return the body length a frame's first 8 bytes announce; ValueError outside ``_HEAD.size..limit``."""
    (n,) = LENGTH.unpack(head)
    if n < _HEAD.size or n > limit:
        raise ValueError(f"it announced a frame of {n} bytes; frames hold {_HEAD.size} to {limit} bytes")
    return n


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> tuple[int, list[bytes]]:
    """Read one frame of at most ``limit`` bytes from a blocking socket and return (code, fields).

    Raises:
        ConnectionError: the peer closed the connection (OSError: the socket failed or timed out).
        ValueError: the bytes are not a frame of this protocol, or it is longer than ``limit``.
    """
    n = frame_length(recv_exact(sock, LENGTH.size), limit)
    return decode(recv_exact(sock, n))


def key_field(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def key_of(field: bytes) -> str:
    return field.decode("utf-8", "surrogatepass")


def int_field(n: int) -> bytes:
    return str(n).encode("ascii")


def int_of(field: bytes) -> int:
    return int(field.decode("ascii"))


def timeout_field(seconds: float | None) -> bytes:
    """Encode a wait bound (None: no bound) as whole milliseconds, rounded up."""
    return b"-1" if seconds is None else int_field(max(1, math.ceil(seconds * 1000)))


def timeout_of(field: bytes) -> float | None:
    ms = int_of(field)
    return None if ms < 0 else ms / 1000.0
