"""``FileStore``: a key-value store that processes share through one file.

The file is an append-only log. Every change is one record (a key and its new
value, an appended piece, or a change of the user counters) written while an
exclusive ``flock`` is held; every reader takes a shared ``flock`` and replays
the records it has not seen yet into its own copy of the keys. ``get`` and
``wait`` poll the file until the keys appear or the timeout passes.

Each store registers as a user of the file when created and unregisters on
``close()`` (or when it is garbage collected, or at exit). With a fixed
``world_size``, the user that closes last, once ``world_size`` users have
closed, removes the file, so a new store on the same path starts empty.

Example (``mpiexec -n 2``, every rank)::

    >>> from mpidist.store import FileStore
    >>> with FileStore("/tmp/filestore", 2) as store:
    ...     store.add("arrived", 1)
    ...     store.wait(["arrived"])
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

from ..errors import DistStoreError
from .base import MissingKeysError, Store, compare_set_value, parse_counter

__all__ = ["FileStore"]

#: the first bytes of every store file (format version 1)
_MAGIC = b"mpidist-filestore-1\n"
#: a record: kind, key length, value length; then the key (UTF-8) and the value
_HEADER = struct.Struct("<BIQ")
_SET, _APPEND, _META = 1, 2, 3
_USERS, _CLOSED = "users", "closed"  # the counters kept in _META records

#: polling intervals of get/wait: start, cap (seconds)
_POLL_FIRST_S, _POLL_MAX_S = 0.0005, 0.01


def _record(kind: int, key: str, value: bytes) -> bytes:
    k = key.encode("utf-8")
    return _HEADER.pack(kind, len(k), len(value)) + k + value


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _open_locked(path: str) -> int:
    """Open (creating) ``path`` and return its descriptor holding an exclusive flock.

    If the last user removed the file between our open and our lock, open again,
    so that we never join a file that is no longer at ``path``.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _is_at_path(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _is_at_path(fd: int, path: str) -> bool:
    mine = os.fstat(fd)
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


class _FileState:
    """What a FileStore holds: the descriptor, its replay of the log, a thread lock.

    Kept apart from the store so that the finalizer can release it without
    keeping the store alive.
    """

    def __init__(self, path: str, world_size: int) -> None:
        self.path = path
        self.world_size = world_size
        self.lock = threading.Lock()  # one thread at a time on the descriptor
        self.fd: int | None = None
        self.offset = 0  # how far the log has been replayed
        self.data: dict[str, bytes] = {}
        self.meta: dict[str, int] = {}

    def refresh(self) -> None:
        """Replay the records added since the last refresh (a flock is held)."""
        fd = self.fd
        size = os.fstat(fd).st_size
        if size <= self.offset:
            return
        chunks = []
        pos = self.offset
        while pos < size:
            chunk = os.pread(fd, size - pos, pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        buf = b"".join(chunks)
        at = 0
        if self.offset == 0:
            if not buf.startswith(_MAGIC):
                raise DistStoreError(f"FileStore: {self.path!r} is not a FileStore file (it holds other data)")
            at = len(_MAGIC)
        while at + _HEADER.size <= len(buf):
            kind, klen, vlen = _HEADER.unpack_from(buf, at)
            end = at + _HEADER.size + klen + vlen
            if end > len(buf):
                break
            key = buf[at + _HEADER.size : at + _HEADER.size + klen].decode("utf-8")
            value = buf[at + _HEADER.size + klen : end]
            self.apply(kind, key, value)
            at = end
        self.offset += at

    def apply(self, kind: int, key: str, value: bytes) -> None:
        if kind == _SET:
            self.data[key] = value
        elif kind == _APPEND:
            self.data[key] = self.data.get(key, b"") + value
        elif kind == _META:
            self.meta[key] = int(value)
        else:
            raise DistStoreError(f"FileStore: {self.path!r} is corrupt (record kind {kind} at byte {self.offset})")

    def write(self, records: list[tuple[int, str, bytes]]) -> None:
        """Append ``records`` (an exclusive flock is held and the log is replayed to its end)."""
        blob = b"".join(_record(*r) for r in records)
        _write_all(self.fd, blob)
        self.offset += len(blob)
        for r in records:
            self.apply(*r)

    def bump(self, name: str, by: int) -> int:
        value = self.meta.get(name, 0) + by
        self.write([(_META, name, str(value).encode("ascii"))])
        return value

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
                self.refresh()
                closed = self.bump(_CLOSED, 1)
                users = self.bump(_USERS, -1)
                if users <= 0 and 0 < self.world_size <= closed:
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

    Args:
        file_name: path of the file (created if missing; its directory must exist).
        world_size: how many stores will use the file, in all processes; the
            file is removed when that many have closed and none is open. A
            negative value (default -1) means "not fixed": the file is kept.
        timeout: the store's timeout (timedelta or seconds; default 300 s).

    Raises:
        DistStoreError: the file cannot be opened, or holds something else.

    Example (``mpiexec -n 2``, every rank)::

        >>> store = FileStore("/tmp/filestore", 2)
        >>> if rank == 0:
        ...     store.set("first_key", "first_value")
        >>> store.get("first_key")
        b'first_value'
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
        self._state = _FileState(os.path.abspath(path), world_size)
        try:
            fd = _open_locked(self._state.path)
        except OSError as exc:
            raise DistStoreError(f"FileStore: cannot open {self._state.path!r}: {exc}") from exc
        state = self._state
        state.fd = fd
        try:
            if os.fstat(fd).st_size == 0:
                _write_all(fd, _MAGIC)
            state.refresh()
            state.bump(_USERS, 1)
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
        """The absolute path of the file."""
        return self._state.path

    @property
    def world_size(self) -> int:
        """The number of users after whose close the file is removed (negative: never)."""
        return self._state.world_size

    def close(self) -> None:
        """Unregister from the file (the last of ``world_size`` users removes it). Idempotent."""
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
                state.refresh()
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
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MissingKeysError(missing)
                pause = min(pause, left)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _set(self, key: str, value: bytes) -> None:
        with self._locked("set", exclusive=True) as state:
            state.write([(_SET, key, value)])

    def _get(self, key: str, timeout: float | None) -> bytes:
        return self._poll("get", [key], timeout)[0]

    def _add(self, key: str, amount: int) -> int:
        with self._locked("add", exclusive=True) as state:
            current = state.data.get(key)
            total = amount + (0 if current is None else parse_counter(current))
            state.write([(_SET, key, str(total).encode("ascii"))])
            return total

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked("compare_set", exclusive=True) as state:
            result, store_it = compare_set_value(state.data.get(key), expected, desired)
            if store_it:
                state.write([(_SET, key, desired)])
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
            state.write([(_APPEND, key, value)])

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        return self._poll("multi_get", keys, timeout)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self._locked("multi_set", exclusive=True) as state:
            state.write([(_SET, k, v) for k, v in zip(keys, values)])
