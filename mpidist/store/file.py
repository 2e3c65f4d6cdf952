"""``FileStore``: a key-value store that processes share through one file.

The file is an append-only log (its format is in ``_filelog.py``). Every change
is one record (a key and its new value, an appended piece, or a change of the
user counters) written while an exclusive ``flock`` is held; every reader
takes a shared ``flock`` and replays the records it has not seen yet into its
own copy of the keys. ``get`` and ``wait`` poll the file until the keys appear
or the timeout passes.

Records carry their length, their offset and a CRC-32, so damage is found, not
misread. A damaged tail (a writer killed in the middle of a record, bytes
appended by another program) is skipped by readers and cut off by the next
writer. A write that fails (a full disk) is taken back by its writer and
raised as :class:`~mpidist.errors.DistStoreError`. Damage that cannot be
repaired (in the middle of the log, a file truncated below what a store has
read, another format) raises DistStoreError naming the file and the byte.

Each store registers as a user of the file when created and unregisters on
``close()`` (or when it is garbage collected, or at exit). With a fixed
``world_size``, the user that closes last, once ``world_size`` users have
closed, removes the file, so a new store on the same path starts empty.

Which world a file belongs to: the header holds a random world id, the
``world_size`` and the world tag of the job's secret (``MPIDIST_SECRET``);
fixed-size stores record their processes. A file in use by a job with another
secret, another world's file, a truncated header, a file replaced under a
running world are refused with DistStoreError; a file whose processes all died
(a killed job) is started afresh. The rule, and what it cannot tell (a late
joiner, two jobs with the same secret or none), are in ``_filelog.py``.

Permissions: the file is the store's only protection. It is created with mode
0600 whatever the umask, opened without following a symbolic link, and refused
(before anything is read from or written to it) when it is not a regular file,
another user owns it, or its group or others may read or write it.

Example (``mpiexec -n 2``, every rank)::

    >>> from mpidist.store import FileStore
    >>> with FileStore("/tmp/filestore", 2) as store:
    ...     store.add("arrived", 1)
    ...     store.wait(["arrived"])
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import stat
import threading
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

from ..errors import DistStoreError
from . import _filelog as log
from ._filelog import APPEND, META, SET
from .base import MissingKeysError, Store, compare_set_value, parse_counter

__all__ = ["FileStore"]

logger = logging.getLogger("mpidist.store")

_USERS, _CLOSED, _JOINED = "users", "closed", "joined"  # the counters kept in META records

#: polling intervals of get/wait: start, cap (seconds)
_POLL_FIRST_S, _POLL_MAX_S = 0.0005, 0.01

#: what to do about damage that cannot be repaired
_ADVICE = "remove the file (or use another path) and restart the job"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read(fd: int, start: int, end: int) -> bytes:
    chunks = []
    pos = start
    while pos < end:
        chunk = os.pread(fd, end - pos, pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks)


#: how a store file is opened: never through a symbolic link; O_NONBLOCK so a planted FIFO cannot hang the open
_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
#: the mode of every store file: the user's alone
_MODE = 0o600


def _open_locked(path: str, fn: str) -> int:
    """Open (creating, mode 0600) ``path``, check it is the user's alone, and return it holding an exclusive flock.

    If the last user removed the file between our open and our lock, open again,
    so that we never join a file that is no longer at ``path``. The mode bits
    are checked later (:meth:`_FileState.join`), once the file is known to be a
    FileStore file.

    Raises:
        DistStoreError: the file cannot be opened, is a symbolic link or not a regular file, or another user owns it.
    """
    while True:
        fd = _open_file(path, fn)
        try:
            _refuse_foreign(fd, path, fn)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _is_at_path(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _open_file(path: str, fn: str) -> int:
    """Create ``path`` with mode 0600 (whatever the umask), or open the file there; never follow a symbolic link."""
    while True:
        try:
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, _MODE)
        except FileExistsError:
            pass  # a file (or a link) is there: open it, below
        except OSError as exc:
            raise DistStoreError(_open_failed(path, fn, exc)) from exc
        else:
            try:
                os.fchmod(fd, _MODE)  # the umask may have cleared bits the user needs; it never adds any
            except OSError:
                pass  # a file system without modes: the check of the mode says so
            return fd
        try:
            return os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            continue  # removed between the two opens (its last user closed): create it
        except OSError as exc:
            raise DistStoreError(_open_failed(path, fn, exc)) from exc


def _open_failed(path: str, fn: str, exc: OSError) -> str:
    """Say why ``path`` could not be opened: a symbolic link, another user's file, or ``exc``."""
    try:
        there = os.lstat(path)
    except OSError:
        there = None
    if there is not None and stat.S_ISLNK(there.st_mode):
        try:
            target = f" to {os.readlink(path)!r}"
        except OSError:
            target = ""
        return (
            f"{fn}: {path!r} is a symbolic link{target}: FileStore does not follow a link at the file's own name "
            "(another user may have planted it to make the store read or write a file of their choosing); "
            "pass the real path, or remove the link"
        )
    if there is not None and isinstance(exc, PermissionError) and there.st_uid != os.geteuid():
        return _foreign_owner(path, fn, there.st_uid)
    return f"{fn}: cannot open {path!r}: {exc}"


def _user(uid: int) -> str:
    """Name ``uid`` for a message: ``alice (uid 1000)``, or ``uid 1000`` where it has no name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def _foreign_owner(path: str, fn: str, owner: int) -> str:
    return (
        f"{fn}: {path!r} is owned by {_user(owner)}, not by this process's user {_user(os.geteuid())}: "
        "whoever owns the file can read and change the store's keys; use a path in a directory only you can write "
        "(not a shared /tmp), or have its owner remove the file"
    )


def _refuse_foreign(fd: int, path: str, fn: str) -> None:
    """Raise DistStoreError unless the open file ``fd`` is a regular file owned by this process's user."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise DistStoreError(
            f"{fn}: {path!r} is not a regular file (mode {stat.filemode(info.st_mode)}, owner {_user(info.st_uid)}); "
            "use a path where FileStore can make a file of its own, or remove what is there"
        )
    if info.st_uid != os.geteuid():
        raise DistStoreError(_foreign_owner(path, fn, info.st_uid))


def _refuse_loose_mode(fd: int, path: str, fn: str) -> None:
    """Raise DistStoreError if the group or others may read or write the open file ``fd``."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if not mode & 0o066:
        return
    who = [
        f"{name} can {' and '.join(what for what, bit in (('read', 4), ('write', 2)) if mode >> shift & bit)} it"
        for name, shift in (("its group", 3), ("others", 0))
        if mode >> shift & 6
    ]
    raise DistStoreError(
        f"{fn}: {path!r} has mode {mode:04o}: {' and '.join(who)}, so other users could read or change the "
        f"store's keys; FileStore makes its files with mode 0600: if the file is yours to reuse, "
        f"chmod 600 {path!r}, or remove it"
    )


def _is_at_path(fd: int, path: str) -> bool:
    mine = os.fstat(fd)
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _peek_info(path: str) -> dict[str, Any] | None:
    """The header's fields of the file at ``path`` for a message, or None (not a link, FIFO, or unreadable file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return log.read_header(os.pread(fd, log.HEADER_SIZE * 2, 0))[1]
    except (OSError, log.LogError, log.OtherFormatError, log.TornHeaderError):
        return None
    finally:
        os.close(fd)


class _FileState:
    """What a FileStore holds: the descriptor, its replay of the log, a thread lock.

    Kept apart from the store so that the finalizer can release it without
    keeping the store alive. Every method but ``release`` runs with the thread
    lock and a flock held.
    """

    def __init__(self, path: str, world_size: int, tag: str) -> None:
        self.path = path
        self.world_size = world_size
        self.tag = tag  # this process's world tag (log.world_tag)
        self.lock = threading.Lock()  # one thread at a time on the descriptor
        self.fd: int | None = None
        self.header = b""  # the magic and header record, as read when joining
        self.info: dict[str, Any] = {}  # the header's fields
        self.offset = 0  # how far the log has been replayed: the end of the last valid record
        self.tail: int | None = None  # where a damaged tail starts (== offset), if the last replay found one
        self.tail_why = ""
        self.tail_seen: tuple[int, bytes] = (0, b"")  # (file size, first bytes of the tail) when it was found
        self.data: dict[str, bytes] = {}
        self.meta: dict[str, int] = {}
        self.inode: tuple[int, int] = (0, 0)  # (device, inode) of the file joined
        self.counted = ""  # the META key of this process, when this store counts in it

    @property
    def world_id(self) -> str:
        return str(self.info.get("id", "?"))

    def members(self) -> dict[log.Identity, int]:
        """The processes recorded in the file, with how many stores each has open."""
        found = {}
        for key, count in self.meta.items():
            who = log.parse_process_key(key)
            if who is not None:
                found[who] = count
        return found

    # ------------------------------------------------------------------ reading

    def join(self, fn: str) -> None:
        """Read (or write, for a new file) the header and replay the log (an exclusive flock is held)."""
        fd = self.fd
        stat = os.fstat(fd)
        self.inode = (stat.st_dev, stat.st_ino)
        data = _read(fd, 0, stat.st_size)
        try:
            start, info = log.read_header(data) if data else (0, {})
        except log.TornHeaderError as exc:
            raise DistStoreError(
                f"{fn}: {self.path!r} has a truncated header: {exc.have} of {exc.need} bytes (its creator died "
                "while writing it, or another program cut the file); which world it belongs to cannot be told, so "
                f"it is not reused; {_ADVICE}"
            ) from None
        except log.OtherFormatError as exc:
            if exc.version is None:
                raise DistStoreError(f"{fn}: {self.path!r} is not a FileStore file (it holds other data)") from None
            raise DistStoreError(
                f"{fn}: {self.path!r} is in FileStore format version {exc.version}, and this mpidist reads "
                f"version {log.VERSION} only: it was made by another version of mpidist; {_ADVICE}"
            ) from None
        except log.LogError as exc:
            raise DistStoreError(self._damaged(fn, exc)) from None
        _refuse_loose_mode(fd, self.path, fn)  # after the format: a file that is not a store's says so first
        if not data:
            self.start_afresh(fn)
            return
        self.header, self.info, self.offset = data[:start], info, start
        self.absorb(fn, data[start:])

    def start_afresh(self, fn: str) -> None:
        """Make the (empty, or cut to empty) file a new one, of a new world, and forget what was read."""
        data = log.new_file(self.world_size, self.tag)
        self.append_raw(fn, 0, data)
        start, info = log.read_header(data)
        self.header, self.info, self.offset = data[:start], info, start
        self.data, self.meta, self.tail = {}, {}, None

    def refresh(self, fn: str) -> None:
        """Replay the records added since the last refresh (a flock is held).

        Raises:
            DistStoreError: the file shrank below what was replayed, was replaced, or is damaged.
        """
        fd = self.fd
        self.check_path(fn)
        size = os.fstat(fd).st_size
        if size < self.offset:
            raise DistStoreError(
                f"{fn}: {self.path!r} was truncated to {size} bytes, below the {self.offset} bytes this store had "
                f"read: another program truncated or rewrote the file, and the keys it held are lost; {_ADVICE}"
            )
        if os.pread(fd, len(self.header), 0) != self.header:
            raise DistStoreError(
                f"{fn}: {self.path!r} was replaced: it no longer starts with the header this store read (the file "
                f"{log.describe(self.info)}); another program rewrote it, and the keys it held are lost; {_ADVICE}"
            )
        if size == self.offset:
            self.tail = None
            return
        if self.tail is not None and (size, os.pread(fd, 64, self.offset)) == self.tail_seen:
            return  # the same damaged tail as last time
        self.absorb(fn, _read(fd, self.offset, size))

    def check_path(self, fn: str) -> None:
        """Raise DistStoreError if the path no longer names the file this store joined."""
        try:
            there = os.lstat(self.path)
        except FileNotFoundError:
            there = None
        if there is not None and (there.st_dev, there.st_ino) == self.inode:
            return
        mine = f"the file of world id {self.world_id} ({log.describe(self.info)})"
        if there is None:
            found = "nothing is there now"
        else:
            found = f"it now names another file (inode {there.st_ino})"
            info = _peek_info(self.path)
            if info is not None:
                found += f" of world id {info.get('id', '?')} ({log.describe(info)})"
        raise DistStoreError(
            f"{fn}: {self.path!r} was removed or replaced while this store used {mine}: {found}; stores that "
            f"open the path now do not meet this one, so this world cannot go on; {_ADVICE}"
        )

    def absorb(self, fn: str, buf: bytes) -> None:
        """Apply the valid records of ``buf`` (the file from ``offset`` on); note a damaged tail."""
        try:
            found = log.scan(buf, self.offset)
        except log.LogError as exc:
            raise DistStoreError(self._damaged(fn, exc)) from None
        for record in found.records:
            self.apply(*record)
        size = self.offset + len(buf)
        self.offset = found.end
        self.tail, self.tail_why = found.tail, found.why
        if found.tail is not None:
            at = found.tail - (size - len(buf))
            self.tail_seen = (size, buf[at : at + 64])

    def apply(self, kind: int, key: str, value: bytes) -> None:
        if kind == SET:
            self.data[key] = value
        elif kind == APPEND:
            self.data[key] = self.data.get(key, b"") + value
        elif kind == META:
            self.meta[key] = int(value)  # checked by log.scan, or made by bump

    def _damaged(self, fn: str, exc: log.LogError) -> str:
        return f"{fn}: {self.path!r} is damaged at byte {exc.offset}: {exc.why}; records may be lost, {_ADVICE}"

    def world_note(self) -> str:
        """Say, for a timeout, that fewer than world_size processes joined (empty if all did)."""
        joined = len(self.members())
        if not self.counted or joined >= self.world_size:
            return ""
        return (
            f"{joined} of {self.world_size} ranks have joined {self.path!r} (world id {self.world_id}, "
            f"{log.describe(self.info)}): the others have not opened it yet, or they finished and removed the file "
            "before this process opened it, and this process made a new file alone (a late joiner)"
        )

    def tail_note(self) -> str:
        """Say, for a timeout, that the log ends in a damaged record (empty if it does not)."""
        if self.tail is None:
            return ""
        return (
            f"{self.path!r} ends in a damaged record at byte {self.tail} ({self.tail_why}): a writer may have "
            "crashed or failed in the middle of a write; the next write cuts it off"
        )

    # ------------------------------------------------------------------ writing

    def write(self, fn: str, records: list[tuple[int, str, bytes]]) -> None:
        """Append ``records`` (an exclusive flock is held and the log is replayed to its end).

        A damaged tail is cut off first. A write that fails is taken back.

        Raises:
            DistStoreError: the write failed (the file is left as it was).
        """
        if self.tail is not None:
            logger.warning(
                "FileStore: cutting off a damaged tail of %r at byte %d (%s)", self.path, self.tail, self.tail_why
            )
            self.truncate(fn, self.offset)
            self.tail = None
        blob = log.encode(self.offset, records)
        self.append_raw(fn, self.offset, blob)
        self.offset += len(blob)
        for kind, key, value in records:
            self.apply(kind, key, value)

    def append_raw(self, fn: str, start: int, blob: bytes) -> None:
        """Write ``blob`` at the end of the file (byte ``start``); on failure cut the file back to ``start``."""
        try:
            _write_all(self.fd, blob)
        except BaseException as exc:
            try:
                os.ftruncate(self.fd, start)
            except OSError:  # the next writer finds the partial record as a damaged tail and cuts it off
                logger.warning("FileStore: could not take back a failed write to %r at byte %d", self.path, start)
            if isinstance(exc, OSError):
                raise DistStoreError(
                    f"{fn}: could not write to {self.path!r} ({exc}); nothing was changed (the partial write "
                    "was taken back)"
                ) from exc
            raise

    def truncate(self, fn: str, at: int) -> None:
        try:
            os.ftruncate(self.fd, at)
        except OSError as exc:
            raise DistStoreError(f"{fn}: cannot cut {self.path!r} back to byte {at} to repair it: {exc}") from exc

    def bump(self, fn: str, changes: dict[str, int]) -> dict[str, int]:
        """Add to user counters in one record each, written together; return their new values."""
        values = {name: self.meta.get(name, 0) + by for name, by in changes.items()}
        self.write(fn, [(META, name, str(value).encode("ascii")) for name, value in values.items()])
        return values

    # ------------------------------------------------------------------ users

    def register(self, fn: str) -> None:
        """Refuse a file of another world, then join as one more user (an exclusive flock is held)."""
        if self.info.get("tag", "") != self.tag:
            self.claim(fn)
        made_for = self.info.get("world_size", -1)
        made = log.describe(self.info)
        if made_for > 0 and self.world_size > 0 and made_for != self.world_size:
            raise DistStoreError(
                f"{fn}: {self.path!r} was made for world_size={made_for} ({made}), but this store has "
                f"world_size={self.world_size}: another job uses the file, or left it behind; use another path, "
                "or remove the file"
            )
        if made_for > 0 and self.world_size > 0:
            self.admit(fn)
            made = log.describe(self.info)
        joined, closed = self.meta.get(_JOINED, 0), self.meta.get(_CLOSED, 0)
        if made_for > 0 and joined >= made_for and closed > 0:
            raise DistStoreError(
                f"{fn}: {self.path!r} was made for world_size={made_for} and {joined} stores joined it ({made}); "
                f"{closed} of them closed and {self.meta.get(_USERS, 0)} have not, so this store cannot be part of "
                f"that world: the file was left behind by a job whose stores did not all close (a crash), another "
                f"job uses it, or the stores of its previous use are still closing (then wait for them); {_ADVICE}"
            )
        changes = {_JOINED: 1, _USERS: 1}
        if made_for > 0 and self.world_size > 0:
            self.counted = log.process_key(log.this_process())
            changes[self.counted] = 1
        self.bump(fn, changes)

    def claim(self, fn: str) -> None:
        """Take over the file of a world with another tag if none of its stores is open; else refuse it.

        Raises:
            DistStoreError: a store of that world is open (its process runs, or cannot be told about).
        """
        crashed, holding = self.open_stores()
        made = f"world id {self.world_id}, {log.describe(self.info)}"
        why = log.describe_tags(str(self.info.get("tag", "")), self.tag)
        if holding:
            raise DistStoreError(
                f"{fn}: {self.path!r} is in use by another world ({made}; stores open on it: {', '.join(holding)}): "
                f"{why}, so this process is not one of its ranks and may not read its keys; give each job a "
                "path of its own (or wait until that job is over, or remove the file if it is over)"
            )
        gone = ", ".join(log.show_process(p) for p in crashed) + " died" if crashed else "they were closed"
        logger.warning(
            "FileStore: %r was left by another world (%s; %s; none of its stores is open: %s); starting it afresh",
            self.path,
            made,
            why,
            gone,
        )
        self.truncate(fn, 0)
        self.start_afresh(fn)

    def open_stores(self) -> tuple[list[log.Identity], list[str]]:
        """Return the recorded processes that died with stores open, and who else holds stores open (for a message).

        Stores of ``world_size < 0`` do not record their process; the ``users``
        counter beyond what recorded processes hold counts them.
        """
        members = self.members()
        crashed, running = log.holders(members)
        holding = [log.show_process(p) for p in running]
        unknown = self.meta.get(_USERS, 0) - sum(n for n in members.values() if n > 0)
        if unknown > 0:
            holding.append(f"{unknown} of world_size=-1, whose processes the file does not record")
        return crashed, holding

    def admit(self, fn: str) -> None:
        """Refuse a process that is not one of the file's world; take over a crashed job's file."""
        me = log.this_process()
        members = self.members()
        if me in members:
            return  # another store of a process of this world
        verdict, crashed, running = log.judge_newcomer(members, self.world_size)
        if verdict == "join":
            return
        made = f"world id {self.world_id}, {log.describe(self.info)}"
        dead = ", ".join(log.show_process(p) for p in crashed)
        if verdict == "take over":
            logger.warning(
                "FileStore: %r was left by a crashed job (%s; %s died without closing, no process of it runs); "
                "starting it afresh",
                self.path,
                made,
                dead,
            )
            self.truncate(fn, 0)
            self.start_afresh(fn)
            return
        live = ", ".join(log.show_process(p) for p in running)
        if verdict == "broken":
            raise DistStoreError(
                f"{fn}: {self.path!r} belongs to a world ({made}) in which {dead} died without closing while "
                f"{live} still hold stores on it: that job crashed in part, or another job uses the file; this "
                f"process is not one of its {self.world_size} ranks; {_ADVICE}"
            )
        raise DistStoreError(
            f"{fn}: {self.path!r} belongs to another world ({made}; {len(members)} of {self.world_size} ranks "
            f"joined: {', '.join(log.show_process(p) for p in members)}), and this process ({log.show_process(me)}) is not "
            "one of them: another job uses the file, or left it behind; give each job a path of its own, or "
            "remove the file once that job is over"
        )

    def release(self) -> None:
        """Unregister this user; the last one (see FileStore) removes the file. Idempotent."""
        with self.lock:
            fd = self.fd
            if fd is None:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not _is_at_path(fd, self.path):
                    return
                self.refresh("FileStore.close")
                changes = {_CLOSED: 1, _USERS: -1}
                if self.counted:
                    changes[self.counted] = -1
                counts = self.bump("FileStore.close", changes)
                if counts[_USERS] <= 0 and 0 < self.world_size <= counts[_CLOSED]:
                    os.unlink(self.path)
            except (OSError, DistStoreError):
                pass  # best effort: the file was removed or damaged by someone else
            finally:
                self.fd = None
                os.close(fd)  # drops the flock


class FileStore(Store):
    """A store shared by the processes (and threads) that open the same file.

    Locking uses ``flock``, so the processes must share a file system that
    supports it (a local disk, tmpfs; some network file systems do not).
    ``delete_key`` is not supported, as in torch. ``num_keys`` counts one key more
    than were set: the user counter, as torch's FileStore does.

    The file survives damage where it can (see docs/stores-robustness.md): a
    record cut short by a crash, or bytes another program appended, are skipped
    and then cut off; a write that fails is taken back. Damage that cannot be
    repaired raises DistStoreError naming the file and the byte offset.

    The file is the store's only protection: it is made with mode 0600, and a
    symbolic link, another user's file, or a file its group or others may read
    or write is refused. Processes of two jobs with different secrets
    (``MPIDIST_SECRET``, which ``mpidistrun`` gives each job) never share a file:
    the second job is refused while the first uses it.

    Args:
        file_name: path of the file (created if missing, mode 0600; its directory must exist: put it in a
            directory only you can write, not a shared /tmp).
        world_size: how many stores will use the file, in all processes; the
            file is removed when that many have closed and none is open. A
            negative value (default -1) means "not fixed": the file is kept.
        timeout: the store's timeout (timedelta or seconds; default 300 s).

    Raises:
        ValueError: ``MPIDIST_SECRET`` (or the file ``MPIDIST_SECRET_FILE`` names) holds a secret that is too
            short, or others can read that file.
        DistStoreError: the file cannot be opened or written; it is a symbolic
            link, not a regular file, another user's, or its group or others may
            read or write it; a job with another secret uses it; it holds something
            else, another format version, a truncated header, or damage; it was
            made for another ``world_size``; it belongs to another world (its
            ``world_size`` processes joined, or some died while others run); or
            its world is complete and some of its stores have left. A file whose
            processes all died is started afresh instead (see the module).

    Examples:
        >>> store = dist.FileStore("/tmp/filestore", 2)  # on both ranks
        >>> if dist.get_rank() == 0:
        ...     store.set("first_key", "first_value")
        >>> store.get("first_key")
        b'first_value'  # rank 0 and rank 1
        >>> store.close()
    """

    def __init__(
        self, file_name: str | os.PathLike[str], world_size: int = -1, timeout: timedelta | float | None = None
    ) -> None:
        super().__init__(timeout)
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"FileStore: file_name must be a str or path, got {type(file_name).__name__}")
        path = os.fspath(file_name)
        if not isinstance(path, str) or not path:
            raise ValueError(f"FileStore: file_name must be a non-empty str path, got {file_name!r}")
        if not isinstance(world_size, int) or isinstance(world_size, bool):
            raise TypeError(f"FileStore: world_size must be an int, got {type(world_size).__name__}")
        if world_size == 0:
            raise ValueError(
                "FileStore: world_size must be positive, or negative for a non-fixed number of users, got 0"
            )
        self._state = _FileState(os.path.abspath(path), world_size, log.world_tag("FileStore"))
        try:
            fd = _open_locked(self._state.path, "FileStore")
        except OSError as exc:
            raise DistStoreError(f"FileStore: cannot open {self._state.path!r}: {exc}") from exc
        state = self._state
        state.fd = fd
        try:
            state.join("FileStore")
            state.register("FileStore")
        except BaseException:
            state.fd = None
            os.close(fd)
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        self._finalizer = weakref.finalize(self, _FileState.release, state)

    def __repr__(self) -> str:
        return f"FileStore({self._state.path!r}, world_size={self._state.world_size})"

    @property
    def path(self) -> str:
        """The absolute path of the file.

        Examples:
            >>> dist.FileStore("/tmp/filestore-path").path
            '/tmp/filestore-path'
        """
        return self._state.path

    @property
    def world_size(self) -> int:
        """The number of users after whose close the file is removed (negative: never).

        Examples:
            >>> dist.FileStore("/tmp/filestore-size").world_size
            -1
        """
        return self._state.world_size

    def close(self) -> None:
        """Unregister from the file (the last of ``world_size`` users removes it). Idempotent.

        Examples:
            >>> store = dist.FileStore("/tmp/filestore-close", 1)
            >>> store.close()
        """
        self._finalizer()

    @contextmanager
    def _locked(self, op: str, exclusive: bool) -> Iterator[_FileState]:
        """Hold the thread lock and a flock on the file, with the log replayed to its end."""
        state = self._state
        with state.lock:
            if state.fd is None:
                raise DistStoreError(f"FileStore.{op}: the store is closed")
            fcntl.flock(state.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                state.refresh(f"FileStore.{op}")
                yield state
            finally:
                fcntl.flock(state.fd, fcntl.LOCK_UN)

    def _poll(self, op: str, keys: list[str], timeout: float | None) -> list[bytes]:
        """Return the values of ``keys`` once all are set; MissingKeysError past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _POLL_FIRST_S
        while True:
            with self._locked(op, exclusive=False) as state:
                missing = [k for k in keys if k not in state.data]
                if not missing:
                    return [state.data[k] for k in keys]
                note = "; ".join(n for n in (state.tail_note(), state.world_note()) if n)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MissingKeysError(missing, note)
                pause = min(pause, left)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _set(self, key: str, value: bytes) -> None:
        with self._locked("set", exclusive=True) as state:
            state.write("FileStore.set", [(SET, key, value)])

    def _get(self, key: str, timeout: float | None) -> bytes:
        return self._poll("get", [key], timeout)[0]

    def _add(self, key: str, amount: int) -> int:
        with self._locked("add", exclusive=True) as state:
            current = state.data.get(key)
            total = amount + (0 if current is None else parse_counter(current))
            state.write("FileStore.add", [(SET, key, str(total).encode("ascii"))])
            return total

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked("compare_set", exclusive=True) as state:
            result, store_it = compare_set_value(state.data.get(key), expected, desired)
            if store_it:
                state.write("FileStore.compare_set", [(SET, key, desired)])
            return result

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        self._poll("wait", keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        with self._locked("check", exclusive=False) as state:
            return all(k in state.data for k in keys)

    def _num_keys(self) -> int:
        with self._locked("num_keys", exclusive=False) as state:
            return len(state.data) + 1  # and the user counter, as torch counts it

    def _delete_key(self, key: str) -> bool:
        raise DistStoreError(
            "FileStore.delete_key: FileStore cannot delete keys (torch supports delete_key only on TCPStore "
            "and HashStore); use one of those, or overwrite the key with set()"
        )

    def _append(self, key: str, value: bytes) -> None:
        with self._locked("append", exclusive=True) as state:
            state.write("FileStore.append", [(APPEND, key, value)])

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        return self._poll("multi_get", keys, timeout)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self._locked("multi_set", exclusive=True) as state:
            state.write("FileStore.multi_set", [(SET, k, v) for k, v in zip(keys, values)])
