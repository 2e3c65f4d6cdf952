"""``HashStore``: a thread-safe key-value store inside one process.

Example::

    >>> import threading
    >>> from mpidist.store import HashStore
    >>> store = HashStore()
    >>> threading.Thread(target=store.set, args=("ready", "yes")).start()
    >>> store.get("ready")           # blocks until the other thread has set it
    b'yes'
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from .base import MissingKeysError, Store, compare_set_value, parse_counter

__all__ = ["HashStore"]


class HashStore(Store):
    """A thread-safe store on a dict, for the threads of one process.

    ``get``, ``wait`` and ``multi_get`` block on a condition variable until the
    keys are set by another thread or the timeout passes. It cannot be shared
    between processes (use :class:`~mpidist.store.FileStore` or
    :class:`~mpidist.store.TCPStore`).

    Args:
        timeout: the store's timeout (timedelta or seconds; default 300 s).

    Raises:
        TypeError: ``timeout`` is neither a timedelta nor a number.
        ValueError: ``timeout`` is negative or not finite.

    Examples:
        >>> store = dist.HashStore()
        >>> store.set("first_key", "first_value")
        >>> store.compare_set("first_key", "first_value", "second_value")
        b'second_value'
        >>> store.num_keys()
        1
    """

    def __init__(self, timeout: timedelta | float | None = None) -> None:
        super().__init__(timeout)
        self._cond = threading.Condition(threading.Lock())
        self._data: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return f"HashStore(keys={len(self._data)}, timeout={self.timeout})"

    def _wait_locked(self, keys: list[str], timeout: float | None) -> None:
        """Wait (holding the condition) until every key is set; MissingKeysError past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            if deadline is None:
                self._cond.wait()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise MissingKeysError(missing)
            self._cond.wait(left)

    def _set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def _get(self, key: str, timeout: float | None) -> bytes:
        with self._cond:
            self._wait_locked([key], timeout)
            return self._data[key]

    def _add(self, key: str, amount: int) -> int:
        with self._cond:
            current = self._data.get(key)
            total = amount + (0 if current is None else parse_counter(current))
            self._data[key] = str(total).encode("ascii")
            self._cond.notify_all()
            return total

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._cond:
            result, store_it = compare_set_value(self._data.get(key), expected, desired)
            if store_it:
                self._data[key] = desired
                self._cond.notify_all()
            return result

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        with self._cond:
            self._wait_locked(keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def _num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def _delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def _append(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = self._data.get(key, b"") + value
            self._cond.notify_all()

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        with self._cond:
            self._wait_locked(keys, timeout)
            return [self._data[k] for k in keys]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self._cond:
            self._data.update(zip(keys, values))
            self._cond.notify_all()
