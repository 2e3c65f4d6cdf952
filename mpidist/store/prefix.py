"""``PrefixStore``: a view of another store in which every key gets a prefix.

Example::

    >>> from mpidist.store import HashStore, PrefixStore
    >>> base = HashStore()
    >>> a, b = PrefixStore("a", base), PrefixStore("b", base)
    >>> a.set("x", "1"); b.set("x", "2")
    >>> a.get("x"), b.get("x"), base.get("a/x")
    (b'1', b'2', b'1')
"""

from __future__ import annotations

from .base import MissingKeysError, Store
from .foreign import as_store

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Wrap ``store`` so that every key ``k`` is stored as ``f"{prefix}/{k}"``.

    Stores given distinct prefixes never see each other's keys (torch gives each
    process group one). ``num_keys`` counts every key of the underlying store,
    as in torch. The timeout starts as the underlying store's and is the
    PrefixStore's own afterwards (``set_timeout`` leaves the underlying store's
    alone). ``close`` does not close the underlying store.

    Args:
        prefix: the prefix (a str).
        store: the underlying store: any :class:`~mpidist.store.Store`, a
            PrefixStore included, or a store with torch's interface (wrapped in
            a :class:`~mpidist.store.foreign.ForeignStore`).

    Raises:
        TypeError: ``prefix`` is not a str, or ``store`` not a store.

    Examples:
        >>> store = dist.PrefixStore("pg0", dist.HashStore())
        >>> store.add("count", 2)
        2
        >>> store.underlying_store.get("pg0/count")
        b'2'
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore: prefix must be a str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            try:
                store = as_store(store)
            except TypeError:
                raise TypeError(
                    "PrefixStore: store must be a key-value store (HashStore, FileStore, TCPStore, PrefixStore, "
                    f"or one with torch's set/get/add/wait), got {type(store).__name__}"
                ) from None
        super().__init__(store.timeout)
        self._prefix = prefix
        self._store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"

    @property
    def prefix(self) -> str:
        """The prefix put before every key (followed by ``/``).

        Examples:
            >>> dist.PrefixStore("pg0", dist.HashStore()).prefix
            'pg0'
        """
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The store that holds the prefixed keys.

        Examples:
            >>> inner = dist.HashStore()
            >>> dist.PrefixStore("pg0", inner).underlying_store is inner
            True
        """
        return self._store

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _unprefixed(self, missing: MissingKeysError) -> MissingKeysError:
        head = f"{self._prefix}/"
        return MissingKeysError([k[len(head) :] if k.startswith(head) else k for k in missing.keys], missing.note)

    def _set(self, key: str, value: bytes) -> None:
        self._store._set(self._key(key), value)

    def _get(self, key: str, timeout: float | None) -> bytes:
        try:
            return self._store._get(self._key(key), timeout)
        except MissingKeysError as exc:
            raise self._unprefixed(exc) from None

    def _add(self, key: str, amount: int) -> int:
        return self._store._add(self._key(key), amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store._compare_set(self._key(key), expected, desired)

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        try:
            self._store._wait([self._key(k) for k in keys], timeout)
        except MissingKeysError as exc:
            raise self._unprefixed(exc) from None

    def _check(self, keys: list[str]) -> bool:
        return self._store._check([self._key(k) for k in keys])

    def _num_keys(self) -> int:
        return self._store._num_keys()

    def _delete_key(self, key: str) -> bool:
        return self._store._delete_key(self._key(key))

    def _append(self, key: str, value: bytes) -> None:
        self._store._append(self._key(key), value)

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        try:
            return self._store._multi_get([self._key(k) for k in keys], timeout)
        except MissingKeysError as exc:
            raise self._unprefixed(exc) from None

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._store._multi_set([self._key(k) for k in keys], values)
