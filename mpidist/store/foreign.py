"""``ForeignStore``: any store with torch's interface seen as an mpidist store.

torch's stores (``torch.distributed.TCPStore`` joined under torchrun, the store
torch's ``init_process_group`` made) and third-party ones speak the same
methods as mpidist's (``set``, ``get``, ``add``, ``wait``, ...). Wrapping one
lets mpidist put a :class:`~mpidist.store.PrefixStore` on it per process group
and bound every wait by its own timeout.

Example::

    >>> import torch.distributed as tdist
    >>> store = ForeignStore(tdist.HashStore())
    >>> store.set("k", "v"); store.get("k")
    b'v'
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .base import MissingKeysError, Store

__all__ = ["ForeignStore", "REQUIRED_METHODS"]

#: what an object must have to be used as a store
REQUIRED_METHODS = ("set", "get", "add", "wait")
#: a wait "forever" for stores that need a finite timeout
_FOREVER = timedelta(days=365)


def _timed_out(exc: BaseException) -> bool:
    """True for the error a foreign store raises when a wait runs out of time."""
    return isinstance(exc, TimeoutError) or type(exc).__name__ in ("DistStoreError", "StoreTimeoutError")


class ForeignStore(Store):
    """Adapt ``store`` (an object with torch's Store methods) to mpidist's :class:`Store`."""

    def __init__(self, store: Any) -> None:
        missing = [m for m in REQUIRED_METHODS if not callable(getattr(store, m, None))]
        if missing:
            raise TypeError(
                f"ForeignStore: store must have the methods {', '.join(REQUIRED_METHODS)} (torch's Store "
                f"interface); {type(store).__name__} lacks {', '.join(missing)}"
            )
        timeout = getattr(store, "timeout", None)
        super().__init__(timeout if isinstance(timeout, timedelta) else None)
        self._store = store

    def __repr__(self) -> str:
        return f"ForeignStore({self._store!r})"

    @property
    def underlying_store(self) -> Any:
        """The wrapped store."""
        return self._store

    def _wait_for(self, keys: list[str], timeout: float | None) -> None:
        try:
            self._store.wait(keys, _FOREVER if timeout is None else timedelta(seconds=timeout))
        except Exception as exc:
            if _timed_out(exc):
                raise MissingKeysError([k for k in keys if not self._check([k])] or keys) from exc
            raise

    def _set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def _get(self, key: str, timeout: float | None) -> bytes:
        self._wait_for([key], timeout)
        return bytes(self._store.get(key))

    def _add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self._store.compare_set(key, expected, desired))

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        self._wait_for(keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        return bool(self._store.check(keys))

    def _num_keys(self) -> int:
        return int(self._store.num_keys())

    def _delete_key(self, key: str) -> bool:
        return bool(self._store.delete_key(key))

    def _append(self, key: str, value: bytes) -> None:
        self._store.append(key, value)

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        self._wait_for(keys, timeout)
        return [bytes(v) for v in self._store.multi_get(keys)]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._store.multi_set(keys, values)


def as_store(store: Any) -> Store:
    """Return ``store`` if it is an mpidist store, else a :class:`ForeignStore` around it."""
    return store if isinstance(store, Store) else ForeignStore(store)
