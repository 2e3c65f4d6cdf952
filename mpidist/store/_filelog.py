"""The file format of ``FileStore`` (a magic line, a header, self-checking records), and whose world a file is.

Layout (format version 2)::

    b"mpidist-filestore-2\\n"
    a HEADER record: key "", value JSON {"format", "world_size", "created", "host", "pid", "id", "tag"},
        padded with spaces so that the magic and the header take HEADER_SIZE (512) bytes
    SET / APPEND / META records, in the order they were written

``id`` is a random world id drawn by the store that creates the file; ``tag``
is its job's world tag (see :func:`world_tag`; "" without a job secret, and
absent from files made before it was added). The META
records hold integer counters: ``users``, ``joined`` and ``closed`` (stores) and
one ``process/[host, boot id, pid namespace, pid, start time]`` counter per
process of a fixed-size world (its open stores); see below for how they tell
a file's world apart from another's. Files written before the header
was padded and before the process counters (same format version) are still
read; they are not checked for membership.

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

Which world a file belongs to
-----------------------------

A store of a fixed-size world (``world_size > 0``) records its process in the
file as a META counter ``process/<identity>`` holding how many stores that
process has open. The identity is ``[host name, boot id, pid namespace, pid,
start time]``: on the same host, boot and pid namespace, ``os.kill(pid, 0)``
and the start time in ``/proc/<pid>/stat`` tell whether the process still
runs (a pid reused by another process, or a zombie, counts as dead); on another
host nothing can be told, and the process counts as running.

The world tag. A process whose environment holds the job's secret
(``MPIDIST_SECRET`` or ``MPIDIST_SECRET_FILE``: ``mpidistrun`` gives each job a
fresh one, ``python -m mpidist`` hands rank 0's to every rank) has a **world
tag**, an HMAC of a fixed label under that secret (never the secret itself);
without one its tag is "". Processes of one job have the same tag, processes
of two jobs with different secrets do not, whenever each opens the file. A
store of any ``world_size`` (negative ones too) whose tag is not the file's is
refused, before it reads or writes a key, while a process of the file's world
holds a store on it (or an open store is not accounted for by a recorded
process): **another world uses the file**. When none does (the other world
closed its stores, or its processes all died) the file is started afresh with
a new world id and this store's tag, with a warning, so the newcomer never
reads the other world's keys.

The rule of ``FileStore``, for a store whose tag is the file's. The header holds a
random world id drawn by the store that creates the file, and the ``world_size`` it
was made for. A store of a fixed ``world_size`` that opens the file is refused with
DistStoreError, before it reads or writes a key, when (:func:`judge_newcomer` decides
the second to fourth for a process not recorded yet):

* the file was made for another ``world_size``;
* its process is not recorded yet and ``world_size`` processes are: the file
  **belongs to another world** (another job uses it or left it behind);
* its process is not recorded, and some recorded process died with stores open
  while others still hold theirs, or cannot be told about (a job that crashed
  in part);
* the file's world is complete (``world_size`` stores joined) and some stores
  closed: a crashed job's file, or a world that has started to leave;
* the file holds only part of a header (**truncated header**: its creator died
  while writing it, or it was cut): which world it belonged to cannot be told;
  or the header is garbled (damage, another format).

A file whose recorded processes with stores open all **died** (a job killed
with SIGKILL, a node's processes lost: each dead by ``os.kill(pid, 0)`` and
``/proc`` on this host) is **taken over**: the file is cut to nothing and
started afresh with a new world id, with a warning, so a new job never reads
the old job's keys or counts its arrivals. Processes on another host cannot be
checked: they count as running, and such a file is refused (remove it).

A store that finds the path **removed or replaced** under it (another file, or
no file, at the path: its device and inode differ from the file it joined) or
the header changed raises DistStoreError at its next operation, naming both
world ids, since stores that open the path now no longer meet it.

Limits (what the file cannot tell): a process that opens the path after its
world finished and removed the file (a **late joiner**) finds no file, so it
makes a new one, alone; nothing on disk says a world used the path, and a
new job may rightly reuse it. Its ``get``/``wait`` then time out saying that
only 1 of ``world_size`` ranks joined, and that the others may have finished
before it came. A late joiner while its world still holds the file (same
tag, not all ``world_size`` processes recorded yet) joins as usual.

Two worlds **with the same tag** (both without a job secret, or given the same
one) that start on one path at the same time cannot be told apart: the file
holds nothing that says whether the first two processes to arrive are ranks
of one world or of two. They are told apart only once ``world_size``
processes joined: the processes beyond that are refused, but one that came
before may have read the other world's keys, and stores of ``world_size < 0``
join any file of their tag without these checks (as in torch, the file is then
kept and reused). Give each job a path of its own, or a secret of its own.

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

from .._auth import SecretKey, secret_from_env

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER_SIZE",
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
    "Identity",
    "this_process",
    "process_key",
    "parse_process_key",
    "alive",
    "judge_newcomer",
    "holders",
    "show_process",
    "world_tag",
    "describe_tags",
]

#: the format version this module reads and writes
VERSION = 2
#: the first bytes of every store file
MAGIC = b"mpidist-filestore-%d\n" % VERSION
_STEM = b"mpidist-filestore-"
#: bytes of the magic and the header record of a file this module makes (the JSON is padded)
HEADER_SIZE = 512
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
    """The file holds only the first ``have`` of the ``need`` bytes of a header, and nothing after."""

    def __init__(self, have: int, need: int) -> None:
        super().__init__(f"truncated header: {have} of {need} bytes")
        self.have = have
        self.need = need


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


def new_file(world_size: int, tag: str = "") -> bytes:
    """Return the first bytes of a new store file made for ``world_size`` users of world tag ``tag``."""
    info = {
        "format": VERSION,
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "id": secrets.token_hex(8),  # tells this file from one made later at the same path
        "tag": tag,  # tells this job's processes from another job's (world_tag)
    }
    value = json.dumps(info).encode("utf-8")
    room = HEADER_SIZE - len(MAGIC) - HEAD.size
    while len(value) > room:  # only a very long host name: shorten it
        info["host"] = info["host"][: len(info["host"]) - (len(value) - room)]
        value = json.dumps(info).encode("utf-8")
    return MAGIC + encode(len(MAGIC), [(HEADER, "", value.ljust(room))])


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
            raise TornHeaderError(len(data), HEADER_SIZE)
        match = re.match(rb"mpidist-filestore-(\d{1,6})\n", data)
        raise OtherFormatError(int(match.group(1)) if match else None)
    at = len(MAGIC)
    parsed = _parse(data, at, 0)
    if isinstance(parsed, str):
        if _valid_after(data, at, 0) is None:
            need = HEADER_SIZE
            if len(data) - at >= HEAD.size and data[at : at + 4] == MARK:
                _, _, _, _, klen, vlen = HEAD.unpack_from(data, at)
                need = max(at + HEAD.size + klen + vlen, len(data) + 1)
            raise TornHeaderError(len(data), need)
        raise LogError(at, f"the file header is damaged ({parsed})")
    kind, key, value, end = parsed
    try:
        info = json.loads(value)
        ok = (
            kind == HEADER
            and not key
            and isinstance(info, dict)
            and isinstance(info.get("world_size"), int)
            and isinstance(info.get("id"), str)
        )
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


# ---------------------------------------------------------------------------------------------
# which world a file belongs to: the processes recorded in it
# ---------------------------------------------------------------------------------------------

#: the META counters of processes start with this
PREFIX = "process/"

#: host name, boot id, pid namespace, pid, start time (clock ticks after boot; "" where unknown)
Identity = tuple[str, str, str, int, str]

_cached: dict[int, Identity] = {}


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or [] where unknown."""
    text = _read(f"/proc/{pid}/stat")
    return text[text.rfind(")") + 1 :].split() if ")" in text else []


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_process() -> Identity:
    """Return the identity of this process."""
    pid = os.getpid()
    if pid not in _cached:  # per pid: a forked child is another process
        fields = _stat_fields(pid)
        start = fields[19] if len(fields) > 19 else ""
        boot = _read("/proc/sys/kernel/random/boot_id")
        _cached[pid] = (socket.gethostname(), boot, _pid_namespace(), pid, start)
    return _cached[pid]


def process_key(who: Identity) -> str:
    """Return the META key of process ``who``."""
    return PREFIX + json.dumps(list(who))


def parse_process_key(key: str) -> Identity | None:
    """Return the identity in a META key, or None if the key is not a process counter."""
    if not key.startswith(PREFIX):
        return None
    try:
        host, boot, ns, pid, start = json.loads(key[len(PREFIX) :])
    except (ValueError, TypeError):
        return None
    if not all(isinstance(x, str) for x in (host, boot, ns, start)) or not isinstance(pid, int):
        return None
    return host, boot, ns, pid, start


def alive(who: Identity) -> bool | None:
    """Return whether process ``who`` still runs: None where it cannot be told (another host)."""
    host, boot, ns, pid, start = who
    here = this_process()
    if (host, boot, ns) != here[:3] or not boot or not ns:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it runs, as another user
    except OSError:
        return None
    fields = _stat_fields(pid)
    if not fields:
        return True
    if fields[0] in ("Z", "X"):  # killed, not yet reaped by its parent
        return False
    return not start or len(fields) <= 19 or fields[19] == start


def show_process(who: Identity) -> str:
    """Say which process ``who`` is, for a message."""
    host, _, _, pid, _ = who
    return f"pid {pid} on {host}"


def judge_newcomer(counts: dict[Identity, int], world_size: int) -> tuple[str, list[Identity], list[Identity]]:
    """Decide about a process that is not in ``counts`` (the open stores of each recorded process).

    Returns:
        (verdict, crashed, running): verdict is "join", "take over" (a crashed
        job's file), "broken" (some died with stores open, others run) or
        "full" (``world_size`` processes are recorded already); crashed are the
        processes that died with stores open, running those with stores open
        that run or cannot be told about.
    """
    crashed, running = holders(counts)
    if crashed:
        return ("broken" if running else "take over"), crashed, running
    if len(counts) >= world_size:
        return "full", crashed, running
    return "join", crashed, running


def holders(counts: dict[Identity, int]) -> tuple[list[Identity], list[Identity]]:
    """Split the recorded processes with stores open into those that died and those that run.

    Args:
        counts: the open stores of each recorded process.

    Returns:
        (crashed, running): running also holds the processes that cannot be told about (another host).
    """
    crashed = [p for p, n in counts.items() if n > 0 and alive(p) is False]
    running = [p for p, n in counts.items() if n > 0 and p not in crashed]
    return crashed, running


# ---------------------------------------------------------------------------------------------
# which job a process belongs to: the world tag
# ---------------------------------------------------------------------------------------------

#: what the world tag is an HMAC of (under the job's secret); no handshake proves this message
_TAG_ROLE, _TAG_LABEL = b"filestore", b"mpidist-filestore-world-tag-1"


def world_tag(fn: str) -> str:
    """Return this process's world tag: 32 hex digits derived from the job's secret, or "" without one.

    The secret comes from ``MPIDIST_SECRET`` or ``MPIDIST_SECRET_FILE``. The tag
    is an HMAC-SHA256 of a fixed label under it, so the file never holds the
    secret, and the tag proves nothing in a handshake.

    Args:
        fn: the function to name in an error.

    Raises:
        ValueError: the secret in the environment is too short, or its file cannot be read safely.

    Example::

        >>> len(world_tag("FileStore")) in (0, 32)  # 0 where MPIDIST_SECRET is not set
        True
    """
    secret = secret_from_env(fn)
    if secret is None:
        return ""
    return SecretKey(secret).prove(_TAG_ROLE, _TAG_LABEL).hex()[:32]


def describe_tags(file_tag: str, my_tag: str) -> str:
    """Say how the file's world tag and this process's differ (they must differ), for a message."""
    if file_tag and my_tag:
        return "its world's job secret (MPIDIST_SECRET) is not this process's"
    if file_tag:
        return "its world has a job secret (MPIDIST_SECRET) and this process has none"
    return "its world has no job secret and this process has one (MPIDIST_SECRET)"
