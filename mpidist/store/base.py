"""``Store``: the interface every key-value store implements, and its shared helpers.

The public methods (``set``, ``get``, ``add``, ``wait``, ...) live here: they
check their arguments, turn values into ``bytes`` and timeouts into seconds,
then call the store's protected primitives (``_set``, ``_get``, ``_add``, ...),
which each store implements. A primitive that waits gets its timeout in seconds
(``None``: wait forever) and raises :class:`MissingKeysError` when it passes; the
public method turns that into a :class:`~mpidist.errors.DistStoreError` that
names the store, the method, the keys and the timeout.

Example::

    >>> from mpidist.store import HashStore
    >>> store = HashStore()
    >>> store.set("first_key", "first_value")
    >>> store.get("first_key")
    b'first_value'
"""

from __future__ import annotations

import operator
from datetime import timedelta
from typing import Any, Sequence, Union

from ..errors import DistStoreError

__all__ = [
    "Store",
    "MissingKeysError",
    "DEFAULT_TIMEOUT",
    "Value",
    "as_bytes",
    "check_key",
    "check_keys",
    "seconds_of",
    "NotACounterError",
    "parse_counter",
    "compare_set_value",
]

#: the default timeout of every store (torch's ``kDefaultTimeout``)
DEFAULT_TIMEOUT = timedelta(seconds=300)

#: what a value may be: text (stored UTF-8 encoded) or bytes-like
Value = Union[str, bytes, bytearray, memoryview]


class MissingKeysError(Exception):
    """Raised by a store's waiting primitive when keys are still missing at its deadline.

    Internal: the public methods of :class:`Store` turn it into ``DistStoreError``.
    ``note``, when given, says what else the store knows about why the keys may
    be missing (e.g. a FileStore whose file ends in a damaged record); it is
    added to the message.
    """

    def __init__(self, keys: Sequence[str], note: str = "") -> None:
        super().__init__(list(keys))
        self.keys = list(keys)
        self.note = note


class NotACounterError(Exception):
    """Raised by a store's ``_add`` when the key holds a value that is not an integer.

    Internal: :meth:`Store.add` turns it into ``DistStoreError``.
    """

    def __init__(self, value: bytes) -> None:
        super().__init__(value)
        self.value = value


def as_bytes(value: Any, fn: str, name: str = "value") -> bytes:
    """Return ``value`` (str, bytes, bytearray or memoryview) as ``bytes``.

    Args:
        value: a str (encoded as UTF-8) or a bytes-like object.
        fn: the calling method, for the error message (``"TCPStore.set"``).
        name: the argument's name, for the error message.

    Raises:
        TypeError: ``value`` is of another type.

    Example::

        >>> as_bytes("7", "HashStore.set")
        b'7'
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(
        f"{fn}: {name} must be a str or bytes-like (bytes, bytearray, memoryview), got {type(value).__name__}"
    )


def check_key(key: Any, fn: str, name: str = "key") -> str:
    """Return ``key`` if it is a str, else raise a TypeError naming ``fn`` and ``name``.

    Example::

        >>> check_key(3, "TCPStore.set")
        Traceback (most recent call last):
        TypeError: TCPStore.set: key must be a str, got int
    """
    if not isinstance(key, str):
        raise TypeError(f"{fn}: {name} must be a str, got {type(key).__name__}")
    return key


def check_keys(keys: Any, fn: str, name: str = "keys") -> list[str]:
    """Return ``keys`` (a list or tuple of str) as a list; a lone str is refused.

    Example::

        >>> check_keys("abc", "HashStore.wait")
        Traceback (most recent call last):
        TypeError: HashStore.wait: keys must be a list of str, got str (wrap a single key in a list)
    """
    if not isinstance(keys, (list, tuple)):
        hint = " (wrap a single key in a list)" if isinstance(keys, str) else ""
        raise TypeError(f"{fn}: {name} must be a list of str, got {type(keys).__name__}{hint}")
    for i, key in enumerate(keys):
        check_key(key, fn, f"{name}[{i}]")
    return list(keys)


def seconds_of(timeout: Any, fn: str, name: str = "timeout") -> float:
    """Return a timeout (``timedelta`` or seconds as int/float) in seconds.

    Raises:
        TypeError: ``timeout`` is neither a timedelta nor a number.
        ValueError: ``timeout`` is negative.

    Example::

        >>> seconds_of(timedelta(milliseconds=1500), "HashStore.set_timeout")
        1.5
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{fn}: {name} must be a datetime.timedelta or seconds (int/float), got {type(timeout).__name__}"
        )
    if not seconds >= 0:  # also refuses NaN
        raise ValueError(f"{fn}: {name} must not be negative, got {seconds} s")
    return seconds


def _describe(seconds: float | None) -> str:
    return "no timeout" if seconds is None else f"the timeout of {timedelta(seconds=seconds)}"


def _noted(exc: MissingKeysError) -> str:
    return f" ({exc.note})" if exc.note else ""


class Store:
    """Base class of the key-value stores (``torch.distributed.Store``).

    Keys are ``str``; values are given as ``str`` (stored UTF-8 encoded) or
    bytes-like and are always returned as ``bytes``. Counters made by
    :meth:`add` are stored as their decimal text, so ``get`` returns ``b"7"``.

    The timeout (default 300 s) bounds :meth:`get`, :meth:`wait` without an
    explicit timeout, :meth:`multi_get` and, for stores that connect, their
    start. A timeout of zero means "wait forever", as torch's ``kNoTimeout``.

    Subclasses implement the protected primitives ``_set``, ``_get``, ``_add``,
    ``_compare_set``, ``_wait``, ``_check``, ``_num_keys``, ``_delete_key`` and
    ``_append`` (and may override ``_multi_get``, ``_multi_set`` and
    ``close``). They receive validated arguments: keys as ``str``, values as
    ``bytes``, timeouts in seconds (``None`` for no timeout).

    Every store is a context manager that calls :meth:`close` on exit.

    The examples of the methods below use ``store = dist.HashStore()``; every
    store behaves alike (``FileStore`` cannot delete keys).

    Examples:
        >>> with dist.HashStore() as store:
        ...     store.add("counter", 1)
        ...     store.add("counter", 6)
        ...     store.get("counter")
        1
        7
        b'7'
    """

    def __init__(self, timeout: timedelta | float | None = None) -> None:
        """Create a store with ``timeout`` (timedelta or seconds; None: 300 s).

        Args:
            timeout: The store's timeout; zero means no timeout.

        Raises:
            TypeError: ``timeout`` is neither a timedelta nor a number.
            ValueError: ``timeout`` is negative or not finite.
        """
        self._timeout_s = DEFAULT_TIMEOUT.total_seconds()
        if timeout is not None:
            self._timeout_s = seconds_of(timeout, type(self).__name__)

    # ------------------------------------------------------------------ timeouts

    @property
    def timeout(self) -> timedelta:
        """The store's timeout for ``get``, ``wait`` and ``multi_get`` (zero: none).

        Examples:
            >>> dist.HashStore(timeout=30).timeout
            datetime.timedelta(seconds=30)
        """
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the store's default timeout (a timedelta, or seconds; zero: wait forever).

        Args:
            timeout: The new timeout.

        Raises:
            TypeError: ``timeout`` is neither a timedelta nor a number.
            ValueError: ``timeout`` is negative or not finite.

        Examples:
            >>> store.set_timeout(timedelta(seconds=10))
            >>> store.wait(["bad_key"])  # raises DistStoreError after 10 seconds
        """
        self._timeout_s = seconds_of(timeout, self._fn("set_timeout"))

    def _wait_seconds(self, timeout: Any, fn: str) -> float | None:
        """The wait bound in seconds for ``timeout`` (None: the store's), ``None`` for no bound."""
        seconds = self._timeout_s if timeout is None else seconds_of(timeout, fn)
        return seconds if seconds > 0 else None

    def _fn(self, method: str) -> str:
        return f"{type(self).__name__}.{method}"

    # ------------------------------------------------------------------ public API

    def set(self, key: str, value: Value) -> None:
        """Set ``key`` to ``value``, overwriting any previous value.

        Args:
            key: the key.
            value: a str (stored UTF-8 encoded) or bytes-like value.

        Raises:
            TypeError: ``key`` is not a str, or ``value`` neither a str nor bytes-like.
            DistStoreError: the store failed (a damaged file, a server that is gone).

        Examples:
            >>> store.set("first_key", "first_value")
        """
        fn = self._fn("set")
        self._set(check_key(key, fn), as_bytes(value, fn))

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store's timeout for it to be set.

        Args:
            key: the key.

        Returns:
            The value, as bytes (a counter made by ``add`` as its decimal text).

        Raises:
            DistStoreError: ``key`` was not set within the timeout.
            TypeError: ``key`` is not a str.

        Examples:
            >>> store.set("first_key", "first_value")
            >>> store.get("first_key")
            b'first_value'
        """
        fn = self._fn("get")
        check_key(key, fn)
        wait_s = self._wait_seconds(None, fn)
        try:
            return self._get(key, wait_s)
        except MissingKeysError as exc:
            raise DistStoreError(f"{fn}: key {key!r} was not set within {_describe(wait_s)}{_noted(exc)}") from None

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (created at 0) and return the new value.

        The counter is stored as its decimal text: ``get`` returns ``b"7"``.

        Args:
            key: the counter's key.
            amount: the int to add (negative to subtract).

        Returns:
            The counter's new value.

        Raises:
            DistStoreError: ``key`` holds a value that is not an integer (it is left unchanged).
            TypeError: ``key`` is not a str, or ``amount`` not an int.

        Examples:
            >>> store.add("first_key", 1)
            1
            >>> store.add("first_key", 6)
            7
        """
        fn = self._fn("add")
        check_key(key, fn)
        if isinstance(amount, bool):
            raise TypeError(f"{fn}: amount must be an int, got bool")
        try:
            amount = operator.index(amount)
        except TypeError:
            raise TypeError(f"{fn}: amount must be an int, got {type(amount).__name__}") from None
        try:
            return self._add(key, amount)
        except NotACounterError as exc:
            shown = exc.value if len(exc.value) <= 40 else exc.value[:40] + b"..."
            raise DistStoreError(
                f"{fn}: key {key!r} holds {shown!r}, not an integer counter "
                f"(make counters with add(), or set() a decimal number)"
            ) from None

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return the value now.

        As torch: a missing key is set when ``expected_value`` is empty; when the
        key is missing and ``expected_value`` is not empty, nothing is set and
        ``expected_value`` is returned.

        Args:
            key: the key.
            expected_value: the value ``key`` must hold (str or bytes-like).
            desired_value: the value to set (str or bytes-like).

        Returns:
            The value ``key`` holds afterwards (see above for a missing key).

        Raises:
            TypeError: ``key`` is not a str, or a value neither a str nor bytes-like.

        Examples:
            >>> store.set("key", "first_value")
            >>> store.compare_set("key", "first_value", "second_value")
            b'second_value'
            >>> store.compare_set("key", "first_value", "third_value")
            b'second_value'
        """
        fn = self._fn("compare_set")
        check_key(key, fn)
        expected = as_bytes(expected_value, fn, "expected_value")
        desired = as_bytes(desired_value, fn, "desired_value")
        return self._compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Wait until every key of ``keys`` is set.

        Args:
            keys: the keys to wait for.
            timeout: how long (timedelta or seconds); None: the store's timeout.

        Raises:
            DistStoreError: some keys were not set within the timeout (they are named).
            TypeError: ``keys`` is not a list of str (a lone str is refused).

        Examples:
            >>> store.wait(["bad_key"], timedelta(seconds=10))  # raises after 10 seconds
        """
        fn = self._fn("wait")
        keys = check_keys(keys, fn)
        wait_s = self._wait_seconds(timeout, fn)
        try:
            self._wait(keys, wait_s)
        except MissingKeysError as exc:
            raise DistStoreError(
                f"{fn}: keys {exc.keys} were not set within {_describe(wait_s)}{_noted(exc)}"
            ) from None

    def check(self, keys: list[str]) -> bool:
        """Return whether every key of ``keys`` is set (without waiting).

        Args:
            keys: the keys.

        Returns:
            True if every key is set.

        Raises:
            TypeError: ``keys`` is not a list of str.

        Examples:
            >>> store.set("first_key", "x")
            >>> store.check(["first_key"]), store.check(["first_key", "bad_key"])
            (True, False)
        """
        return self._check(check_keys(keys, self._fn("check")))

    def num_keys(self) -> int:
        """Return the number of keys in the store.

        ``TCPStore`` and ``FileStore`` count one more key than were set, the one
        that counts their users (as torch documents).

        Returns:
            The number of keys.

        Examples:
            >>> store = dist.HashStore()
            >>> store.set("a", "1")
            >>> store.add("b", 1)
            1
            >>> store.num_keys()
            2
        """
        return self._num_keys()

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed.

        Args:
            key: the key.

        Returns:
            True if ``key`` existed.

        Raises:
            DistStoreError: the store cannot delete keys (``FileStore``).
            TypeError: ``key`` is not a str.

        Examples:
            >>> store.set("first_key", "x")
            >>> store.delete_key("first_key")
            True
            >>> store.delete_key("bad_key")
            False
        """
        return self._delete_key(check_key(key, self._fn("delete_key")))

    def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the value of ``key`` (set it if ``key`` is missing).

        Args:
            key: the key.
            value: a str (UTF-8 encoded) or bytes-like value.

        Raises:
            TypeError: ``key`` is not a str, or ``value`` neither a str nor bytes-like.

        Examples:
            >>> store.append("log", "a")
            >>> store.append("log", "b")
            >>> store.get("log")
            b'ab'
        """
        fn = self._fn("append")
        self._append(check_key(key, fn), as_bytes(value, fn))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Return the values of ``keys``, waiting up to the store's timeout for all of them.

        Args:
            keys: the keys.

        Returns:
            Their values, as bytes, in the order of ``keys``.

        Raises:
            DistStoreError: some keys were not set within the timeout (they are named).
            TypeError: ``keys`` is not a list of str.

        Examples:
            >>> store.multi_set(["a", "b"], ["1", "2"])
            >>> store.multi_get(["a", "b"])
            [b'1', b'2']
        """
        fn = self._fn("multi_get")
        keys = check_keys(keys, fn)
        wait_s = self._wait_seconds(None, fn)
        try:
            return self._multi_get(keys, wait_s)
        except MissingKeysError as exc:
            raise DistStoreError(
                f"{fn}: keys {exc.keys} were not set within {_describe(wait_s)}{_noted(exc)}"
            ) from None

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        """Set each key of ``keys`` to the value at the same position of ``values``.

        Args:
            keys: the keys.
            values: one str or bytes-like value per key.

        Raises:
            ValueError: ``keys`` and ``values`` differ in length.
            TypeError: ``keys`` is not a list of str, or ``values`` not a list of
                str or bytes-like values.

        Examples:
            >>> store.multi_set(["a", "b"], ["1", b"2"])
            >>> store.get("b")
            b'2'
        """
        fn = self._fn("multi_set")
        keys = check_keys(keys, fn)
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"{fn}: values must be a list, got {type(values).__name__}")
        if len(values) != len(keys):
            raise ValueError(f"{fn}: values must have one entry per key: {len(keys)} keys but {len(values)} values")
        self._multi_set(keys, [as_bytes(v, fn, f"values[{i}]") for i, v in enumerate(values)])

    def close(self) -> None:
        """Release what the store holds (sockets, files, server). Idempotent; a no-op here.

        Examples:
            >>> store.close()
        """

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ primitives

    def _set(self, key: str, value: bytes) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement set")

    def _get(self, key: str, timeout: float | None) -> bytes:
        """Return the value of ``key``; raise MissingKeysError([key]) once ``timeout`` seconds pass."""
        raise NotImplementedError(f"{type(self).__name__} does not implement get")

    def _add(self, key: str, amount: int) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not implement add")

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise NotImplementedError(f"{type(self).__name__} does not implement compare_set")

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        """Return once every key is set; raise MissingKeysError(missing keys) once ``timeout`` passes."""
        raise NotImplementedError(f"{type(self).__name__} does not implement wait")

    def _check(self, keys: list[str]) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not implement check")

    def _num_keys(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not implement num_keys")

    def _delete_key(self, key: str) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not implement delete_key")

    def _append(self, key: str, value: bytes) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement append")

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        """Wait for all ``keys`` (MissingKeysError past ``timeout``), then get each (overridable)."""
        self._wait(keys, timeout)
        return [self._get(key, timeout) for key in keys]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values):
            self._set(key, value)


def parse_counter(current: bytes) -> int:
    """Return the integer a counter value holds; NotACounterError if it holds something else.

    Example::

        >>> parse_counter(b"7")
        7
    """
    try:
        return int(current.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise NotACounterError(current) from None


def compare_set_value(current: bytes | None, expected: bytes, desired: bytes) -> tuple[bytes, bool]:
    """torch's compare_set rule: return (the value to report, whether to store ``desired``).

    Example::

        >>> compare_set_value(None, b"", b"v")
        (b'v', True)
        >>> compare_set_value(None, b"x", b"v")
        (b'x', False)
    """
    if current is None:
        return (desired, True) if not expected else (expected, False)
    if current == expected:
        return desired, True
    return current, False
