"""The file format of ``FileStore``: a magic line, a header, then self-checking records.

Layout (format version 2)::

    b"mpidist-filestore-2\\n"
    a HEADER record: key "", value JSON {"format", "world_size", "created", "host", "pid", "id"}
    SET / APPEND / META records, in the order they were written

A record is a 29-byte head, then the key (UTF-8; lone surrogates pass, as on
the TCPStore wire) and the value. The head holds, little endian: the marker
``b"\\x1emdr"``, a CRC-32, the record's own byte offset in the file (u64), its
kind (u8), the key length (u32) and the value length (u64). The CRC-32 covers
everything after it (the offset, kind, lengths, key and value). A record is
valid when it is complete, its CRC-32 matches and it sits at the offset it
names.

Every write happens under an exclusive ``flock`` and every read under a
shared one, so a reader never sees a write in progress: a record that is
incomplete or fails its check is damage. :func:`scan` sorts damage in two:

* a **damaged tail**: no valid record follows it (a writer killed in the middle
  of a record, a write that failed and could not be taken back, bytes appended
  by another program). Readers stop before it; the next writer cuts it off.
* damage **in the middle**: a valid record follows it, so records were changed,
  removed or shifted. Keys may be lost; :func:`scan` raises :class:`LogError`.

A valid record that holds what no writer writes (a key that is not UTF-8, a
counter that is not an integer, an unknown kind) raises :class:`LogError` too.

Example::

    >>> data = MAGIC + encode(len(MAGIC), [(SET, "k", b"v")])
    >>> scan(data[len(MAGIC):], len(MAGIC)).records
    [(1, 'k', b'v')]
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = [
    "MAGIC",
    "VERSION",
    "SET",
    "APPEND",
    "META",
    "HEADER",
    "LogError",
    "OtherFormatError",
    "TornHeaderError",
    "Scan",
    "encode",
    "new_file",
    "read_header",
    "scan",
    "describe",
]

#: the format version this module reads and writes
VERSION = 2
#: the first bytes of every store file
MAGIC = b"mpidist-filestore-%d\n" % VERSION
_STEM = b"mpidist-filestore-"
#: the first bytes of every record
MARK = b"\x1emdr"
#: a record's head: marker, crc32, offset, kind, key length, value length
HEAD = struct.Struct("<4sIQBIQ")
_CHECKED = struct.Struct("<QBIQ")  # the part of the head the crc32 covers
SET, APPEND, META, HEADER = 1, 2, 3, 4

#: a record to write: kind, key, value
Record = tuple[int, str, bytes]


class LogError(Exception):
    """Damage that cannot be repaired: at byte ``offset`` of the file, ``why``."""

    def __init__(self, offset: int, why: str) -> None:
        super().__init__(f"byte {offset}: {why}")
        self.offset = offset
        self.why = why


class OtherFormatError(Exception):
    """The file is not in this format: ``version`` is the FileStore format it names, or None."""

    def __init__(self, version: int | None) -> None:
        super().__init__(version)
        self.version = version


class TornHeaderError(Exception):
    """The file holds only the beginning of a header: its creator died while writing it."""


def _crc(checked: bytes | memoryview, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(checked))


def encode(offset: int, records: Sequence[Record]) -> bytes:
    """Return the bytes of ``records`` written one after another from byte ``offset``."""
    parts = []
    for kind, key, value in records:
        k = key.encode("utf-8", "surrogatepass")
        checked = _CHECKED.pack(offset, kind, len(k), len(value))
        parts += [MARK, struct.pack("<I", _crc(checked, k + value)), checked, k, value]
        offset += HEAD.size + len(k) + len(value)
    return b"".join(parts)


def new_file(world_size: int) -> bytes:
    """Return the first bytes of a new store file made for ``world_size`` users."""
    info = {
        "format": VERSION,
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "id": secrets.token_hex(8),  # tells this file from one made later at the same path
    }
    return MAGIC + encode(len(MAGIC), [(HEADER, "", json.dumps(info).encode("utf-8"))])


def describe(info: dict[str, Any]) -> str:
    """Say when, where and by whom a file was made (from its header)."""
    return f"made at {info.get('created', '?')} by pid {info.get('pid', '?')} on host {info.get('host', '?')}"


def read_header(data: bytes) -> tuple[int, dict[str, Any]]:
    """Return (where the records start, the header's fields) of a file beginning with ``data``.

    Raises:
        OtherFormatError: ``data`` is not the start of a file of this format.
        TornHeaderError: ``data`` is a header cut short, and nothing follows it.
        LogError: the header record is damaged or malformed, and something follows it.
    """
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            raise TornHeaderError()
        match = re.match(rb"mpidist-filestore-(\d{1,6})\n", data)
        raise OtherFormatError(int(match.group(1)) if match else None)
    at = len(MAGIC)
    parsed = _parse(data, at, 0)
    if isinstance(parsed, str):
        if _valid_after(data, at, 0) is None:
            raise TornHeaderError()
        raise LogError(at, f"the file header is damaged ({parsed})")
    kind, key, value, end = parsed
    try:
        info = json.loads(value)
        ok = kind == HEADER and not key and isinstance(info, dict) and isinstance(info.get("world_size"), int)
    except ValueError:
        ok = False
    if not ok:
        raise LogError(at, "the first record is not a valid file header")
    return end, info


def _parse(buf: bytes, at: int, base: int) -> tuple[int, bytes, bytes, int] | str:
    """Return (kind, key, value, end) of the record at ``buf[at]`` (file offset ``base + at``), or why it is not one."""
    left = len(buf) - at
    if left < HEAD.size:
        return f"an incomplete record ({left} bytes, shorter than a record head)"
    mark, crc, offset, kind, klen, vlen = HEAD.unpack_from(buf, at)
    if mark != MARK:
        return "no record starts there"
    end = at + HEAD.size + klen + vlen
    if end > len(buf):
        return f"an incomplete record (it claims {HEAD.size + klen + vlen} bytes, the file holds {left})"
    view = memoryview(buf)
    if _crc(view[at + 8 : at + HEAD.size], view[at + HEAD.size : end]) != crc:
        return "a record that fails its checksum"
    if offset != base + at:
        return f"a record written at byte {offset} (bytes before it were removed or inserted)"
    return kind, bytes(view[at + HEAD.size : at + HEAD.size + klen]), bytes(view[at + HEAD.size + klen : end]), end


def _valid_after(buf: bytes, at: int, base: int) -> int | None:
    """Return the position of the first record after ``buf[at]`` that passes its checksum, or None.

    Its offset is not checked: a record that was shifted still shows that the
    log goes on past the damage.
    """
    q = buf.find(MARK, at + 1)
    while q != -1:
        if len(buf) - q >= HEAD.size:
            _, crc, _, _, klen, vlen = HEAD.unpack_from(buf, q)
            end = q + HEAD.size + klen + vlen
            view = memoryview(buf)
            if end <= len(buf) and _crc(view[q + 8 : q + HEAD.size], view[q + HEAD.size : end]) == crc:
                return q
        q = buf.find(MARK, q + 1)
    return None


@dataclass
class Scan:
    """What :func:`scan` found: the valid records, where they end, and where a damaged tail starts."""

    records: list[Record] = field(default_factory=list)
    end: int = 0  # file offset after the last valid record
    tail: int | None = None  # file offset of a damaged tail (== end), None when the data ends cleanly
    why: str = ""  # what the damaged tail is


def scan(buf: bytes, base: int) -> Scan:
    """Parse the records in ``buf``, which starts at byte ``base`` of the file.

    Raises:
        LogError: damage with valid records after it, or a valid record holding what no writer writes.
    """
    result = Scan(end=base)
    at = 0
    while at < len(buf):
        parsed = _parse(buf, at, base)
        if isinstance(parsed, str):
            later = _valid_after(buf, at, base)
            if later is not None:
                raise LogError(base + at, f"{parsed}, yet a valid record follows at byte {base + later}")
            result.tail, result.why = base + at, parsed
            break
        kind, key, value, end = parsed
        result.records.append((kind, _checked_key(key, base + at), _checked_value(kind, key, value, base + at)))
        at = end
        result.end = base + at
    return result


def _checked_key(key: bytes, offset: int) -> str:
    try:
        return key.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise LogError(offset, f"key is not valid UTF-8: {key[:40]!r}") from None


def _checked_value(kind: int, key: bytes, value: bytes, offset: int) -> bytes:
    if kind in (SET, APPEND):
        return value
    if kind == META:
        if not re.fullmatch(rb"-?\d{1,19}", value):
            shown = value if len(value) <= 40 else value[:40] + b"..."
            raise LogError(offset, f"counter {key.decode('utf-8', 'replace')!r} holds {shown!r}, not an integer")
        return value
    if kind == HEADER:
        raise LogError(offset, "a second file header")
    raise LogError(offset, f"unknown record kind {kind} (written by another version of mpidist?)")
