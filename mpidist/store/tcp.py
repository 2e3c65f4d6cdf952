"""``TCPStore``: a key-value store served over TCP by the master process.

The master starts a server thread (see ``_tcp_server.py``) that holds the
keys; every store, the master's included, is a client with one connection to
it. Example (``mpiexec -n 2``)::

    >>> from mpi4py import MPI
    >>> from mpidist.store import TCPStore
    >>> rank = MPI.COMM_WORLD.Get_rank()
    >>> if rank == 0:
    ...     store = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
    ...     MPI.COMM_WORLD.bcast(store.port)
    ... else:
    ...     store = TCPStore("127.0.0.1", MPI.COMM_WORLD.bcast(None), world_size=2)
    >>> store.add("arrived", 1)
    >>> store.wait(["arrived"])
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from datetime import timedelta

from .._auth import JobKey, as_key
from ..errors import DistNetworkError, DistStoreError
from . import _protocol as wire
from ._handshake import HandshakeRefusedError, NotProvenError, NotThisProtocolError, client_handshake
from ._protocol import Cmd, Status
from ._tcp_server import SERVICE, StoreServer, adopt_listener, listen, registry
from .base import MissingKeysError, NotACounterError, Store

__all__ = ["TCPStore"]

#: the key counting the stores that joined (torch's ``initKey_``)
_INIT_KEY = "init/"
#: retry pauses while connecting or waiting for workers: first, cap (seconds)
_RETRY_FIRST_S, _RETRY_MAX_S = 0.01, 0.25
#: the least time a reply may take before the server counts as not answering (seconds): a store
#: whose timeout is meant for short waits must not give up on a server that is merely busy
_REPLY_FLOOR_S = 1.0


class _Client:
    """The connections of one TCPStore to its server, one request at a time on each.

    A request takes an idle connection (or opens another one when every
    connection is busy with another thread's request), so a thread parked in
    ``get`` never holds up the store's other threads. A lock guards the pool.
    """

    def __init__(
        self, host: str, port: int, timeout: float | None, fn: str, key: JobKey | None, connect: bool = True
    ) -> None:
        self.host, self.port = host, port
        self.key = key
        self._lock = threading.Lock()
        self._closed = False
        self._lost = ""  # why the connection to the server was lost, once it was
        # connect=False: the first request opens the first connection (as it opens any further one)
        self._idle: list[socket.socket] = [_connect(host, port, timeout, fn, key)] if connect else []
        self._open: set[socket.socket] = set(self._idle)

    def _take(self, fn: str, connect_timeout: float | None) -> socket.socket:
        with self._lock:
            if self._closed:
                raise DistStoreError(f"{fn}: the store is closed")
            if self._lost:
                raise DistNetworkError(
                    f"{fn}: the connection to the TCPStore server at {self._where} was lost earlier ({self._lost})"
                )
            if self._idle:
                return self._idle.pop()
        sock = _connect(self.host, self.port, connect_timeout, fn, self.key)  # every connection is busy: open another
        with self._lock:
            if self._closed:
                sock.close()
                raise DistStoreError(f"{fn}: the store is closed")
            self._open.add(sock)
        return sock

    def _give_back(self, sock: socket.socket, ok: bool) -> None:
        with self._lock:
            if ok and not self._closed:
                self._idle.append(sock)
                return
            self._open.discard(sock)
        sock.close()

    def request(
        self, fn: str, cmd: Cmd, fields: list[bytes], io_timeout: float | None, connect_timeout: float | None
    ) -> list[bytes]:
        """Send a request and return the reply's fields.

        Raises:
            MissingKeysError: the server answered TIMEOUT (a parked request's deadline passed).
            NotACounterError: ADD found a value that is not an integer.
            DistStoreError: the server refused the request, or the store is closed.
            DistNetworkError: the connection failed or the reply did not come within ``io_timeout``.
        """
        sock = self._take(fn, connect_timeout)
        try:
            sock.settimeout(io_timeout)
            sock.sendall(wire.encode(cmd, fields))
            status, reply = wire.recv_frame(sock)
        except (OSError, ValueError) as exc:
            self._give_back(sock, ok=False)
            if self._closed:
                raise DistStoreError(f"{fn}: the store was closed during the request") from None
            if isinstance(exc, socket.timeout):
                self._lost = f"no reply within {timedelta(seconds=io_timeout or 0)}"
                raise DistNetworkError(
                    f"{fn}: the TCPStore server at {self._where} did not reply within "
                    f"{timedelta(seconds=io_timeout or 0)} (the store's timeout, plus the wait the request asked "
                    "for); the server is frozen, overloaded or unreachable, and this store can no longer be used"
                ) from None
            if isinstance(exc, ValueError):
                self._lost = f"a malformed reply: {exc}"
                raise DistNetworkError(
                    f"{fn}: the TCPStore server at {self._where} sent a malformed reply ({exc}); is the peer a "
                    "mpidist store of the same version?"
                ) from None
            self._lost = f"{type(exc).__name__}: {exc}"
            raise DistNetworkError(
                f"{fn}: lost the connection to the TCPStore server at {self._where} ({self._lost}); "
                "was the master store closed?"
            ) from exc
        self._give_back(sock, ok=True)
        if status == Status.OK:
            return reply
        if status == Status.TIMEOUT:
            raise MissingKeysError([wire.key_of(k) for k in reply])
        if status == Status.NOT_A_COUNTER:
            raise NotACounterError(reply[0])
        message = reply[0].decode("utf-8", "replace") if reply else "unknown error"
        raise DistStoreError(f"{fn}: {message}")

    @property
    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Close every connection (requests in progress in other threads fail). Idempotent."""
        with self._lock:
            self._closed = True
            busy = self._open.difference(self._idle)
            idle, self._idle = self._idle, []
            self._open = set()
        for sock in busy:  # wake the threads using them; they close them
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for sock in idle:
            sock.close()


def _connect(host: str, port: int, timeout: float | None, fn: str, key: JobKey | None) -> socket.socket:
    """Connect to a TCPStore server, retrying until ``timeout`` (None: forever) passes.

    Every address ``host`` resolves to is tried on each round; the server may
    start after the client. A peer that answers the handshake as no mpidist
    server does (an HTTP or SSH server, say), a server that refuses this client,
    and, with a ``key``, a listener that cannot prove it (another process holds
    the port) fail the call at once.

    Raises:
        DistNetworkError: no connection within the timeout (the last error is
            named), the peer is not a mpidist store, or the handshake failed.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = _RETRY_FIRST_S
    last: Exception | None = None
    while True:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            infos, last = [], exc
        for family, type_, proto, _, addr in infos:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            sock = socket.socket(family, type_, proto)
            try:
                sock.settimeout(None if left is None else min(left, 10.0))
                sock.connect(addr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client_handshake(sock, key, SERVICE, wire.MAGIC, _who() if key else b"")
                return sock
            except (HandshakeRefusedError, NotProvenError, NotThisProtocolError) as exc:
                sock.close()
                raise DistNetworkError(_handshake_failure(fn, host, port, exc)) from None
            except OSError as exc:
                sock.close()
                last = exc
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise DistNetworkError(
                f"{fn}: could not connect to a TCPStore server at {host}:{port} within "
                f"{timedelta(seconds=timeout or 0)} (last error: {last}); is the master store running there?"
                + _loopback_hint(infos)
            )
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, _RETRY_MAX_S)


def _handshake_failure(fn: str, host: str, port: int, exc: Exception) -> str:
    """The message of a connection whose handshake failed (never names the secret)."""
    if isinstance(exc, HandshakeRefusedError):
        if "protocol mismatch" in str(exc):
            return (
                f"{fn}: the TCPStore server at {host}:{port} refused the handshake ({exc}); "
                "run the same mpidist version in every process"
            )
        return f"{fn}: the TCPStore server at {host}:{port} refused this process: {exc}"
    if isinstance(exc, NotProvenError):
        return (
            f"{fn}: the process listening on {host}:{port} is not this job's store: {exc}. Another process holds "
            f"port {port} (another user's or another job's); nothing was sent to it. Start the job on a free port "
            "(MASTER_PORT), and see docs/security.md"
        )
    answer = getattr(exc, "answer", b"")
    return (
        f"{fn}: the peer at {host}:{port} is not a mpidist store: it answered the handshake with "
        f"{answer!r}; check host_name and port (another service listens there)"
    )


def _who() -> bytes:
    """How a client describes itself in the handshake (proved with its key; for the server's log)."""
    return f"pid={os.getpid()} host={socket.gethostname()}".encode()


def _loopback_hint(infos: list) -> str:
    """A sentence for a server address that is loopback here: processes on other hosts never reach it."""
    import ipaddress

    if not any(ipaddress.ip_address(addr[0]).is_loopback for *_, addr in infos):
        return ""
    return (
        " That address is loopback on this host (127.x, ::1; on Debian a host name may resolve to 127.0.1.1): "
        "if the server runs on another host, give its address that other hosts reach (MASTER_ADDR)"
    )


def _shutdown(client: _Client | None, server: StoreServer | None, shared: bool) -> None:
    """Close the client, then stop (or release, if shared) the server."""
    if client is not None:
        client.close()
    if server is not None:
        if shared:
            registry.release(server)
        else:
            server.stop()


class TCPStore(Store):
    """A store whose keys are held by a server in the master process, reached over TCP.

    The master (``is_master=True``) starts the server in a background thread:
    one selector serves every client, and a ``get``/``wait`` on a missing key is
    parked in the server, so it never holds up the other clients. Every store,
    the master's included, then connects as a client, retrying until the
    timeout (the server may start after its clients). The server stops when
    the master store is closed or garbage collected. Threads may share a
    store: requests made at the same time travel on separate connections, so a
    thread blocked in ``get`` holds up no other thread.

    Without ``secret`` (torch's behaviour) there is no authentication: anyone
    who can reach the port can read and change every key. With one, only
    processes that hold it get in (there is no encryption). The server
    binds only the address it is given (``127.0.0.1`` stays on the loopback
    interface; a host name is resolved and its first bindable address used;
    ``"0.0.0.0"`` listens on every interface).

    Every store adds 1 to the key ``"init/"`` when it joins (so ``num_keys`` is
    one more than the keys set, as torch documents). With a fixed
    ``world_size`` and ``wait_for_workers=True``, the master's constructor
    returns once ``world_size`` stores (itself included) have joined.

    Args:
        host_name: the server's address or host name.
        port: the server's port; 0 on the master picks a free one (see :attr:`port`).
        world_size: the number of stores (clients + the master); None: not fixed.
        is_master: start the server in this process.
        timeout: bounds connecting, waiting for workers, ``get`` and ``wait``
            (timedelta or seconds; zero: no bound), and how long a reply of
            the server may take: ``set``/``add``/... on a server that does not
            answer fail after it (at least 1 s), ``get``/``wait`` after their
            wait plus it. Default 300 s.
        wait_for_workers: on the master with a fixed ``world_size``, wait for
            every store to join.
        multi_tenant: master stores of this process with the same host_name and
            port share one server (it stops when the last of them closes).
        master_listen_fd: a TCP socket already bound to ``port`` for the server
            to listen on (it listens on a duplicate; close yours when you like).
            Reserving the port this way avoids races between picking and binding.
        use_libuv: accepted for compatibility with torch, and ignored.
        secret: the job's secret (bytes or text of at least 16 bytes), mpidist's
            own: the server then serves only clients that prove they hold it, and
            a client refuses a server that cannot prove it (a process squatting
            on the port) at once. Both prove it over fresh nonces; the secret
            never crosses the wire. None (the default): torch's behaviour, no
            proof. See docs/security.md.
        _connect_later: mpidist's own (its default store): the store opens its
            connection with its first request, and does not count itself into
            the master's ``world_size``; a server that is not there fails that request.

    Raises:
        DistNetworkError: the server cannot listen; no server answered within
            the timeout; or the peer at host_name:port is not a mpidist store
            (raised at once).
        DistStoreError: the master's ``world_size`` stores did not join within the timeout.

    Examples:
        >>> store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
        >>> store.set("first_key", "first_value")
        >>> store.get("first_key")
        b'first_value'
        >>> store.num_keys()
        2
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta | float = timedelta(seconds=300),  # noqa: B008 - immutable, as torch's default
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        secret: bytes | str | JobKey | None = None,
        _connect_later: bool = False,
    ) -> None:
        fn = "TCPStore"
        super().__init__(timeout)
        key = as_key(secret, fn)
        if not isinstance(host_name, str):
            raise TypeError(f"{fn}: host_name must be a str, got {type(host_name).__name__}")
        if not host_name:
            raise ValueError(f"{fn}: host_name must not be empty (use '0.0.0.0' to listen on every interface)")
        if not isinstance(port, int) or isinstance(port, bool):
            raise TypeError(f"{fn}: port must be an int, got {type(port).__name__}")
        if not 0 <= port <= 65535:
            raise ValueError(f"{fn}: port must be in 0..65535, got {port}")
        if world_size is not None:
            if not isinstance(world_size, int) or isinstance(world_size, bool):
                raise TypeError(f"{fn}: world_size must be an int or None, got {type(world_size).__name__}")
            if world_size == 0:
                raise ValueError(f"{fn}: world_size must be positive (or None when not fixed), got 0")
            if world_size < 0:
                world_size = None  # torch's convention for "not fixed"
        if port == 0 and not is_master:
            raise ValueError(f"{fn}: a client (is_master=False) needs the server's port, got 0")
        if master_listen_fd is not None:
            if not isinstance(master_listen_fd, int) or isinstance(master_listen_fd, bool):
                raise TypeError(f"{fn}: master_listen_fd must be an int, got {type(master_listen_fd).__name__}")
            if not is_master:
                raise ValueError(f"{fn}: master_listen_fd is only for the master (is_master=True)")
        self._host = host_name
        self._world_size = world_size
        self._is_master = bool(is_master)
        server: StoreServer | None = None
        if is_master:

            def create() -> StoreServer:
                if master_listen_fd is not None:
                    return StoreServer(adopt_listener(master_listen_fd, port, fn), key=key)
                return StoreServer(listen(host_name, port, fn), key=key)

            if multi_tenant:
                server = registry.acquire(host_name, port, create)
            else:
                server = create()
                server.start()
            port = server.port
        self._port = port
        self._server = server
        wait_s = self._wait_seconds(None, fn)
        later = _connect_later
        try:
            self._client = _Client(host_name, port, wait_s, fn, key, connect=not later)
        except BaseException:
            _shutdown(None, server, multi_tenant)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._client, server, multi_tenant)
        if later:  # mpidist's default store: the first request connects (init.py)
            return
        try:
            joined = self._request(fn, Cmd.ADD, [wire.key_field(_INIT_KEY), b"1"])
            if is_master and wait_for_workers and world_size is not None:
                self._wait_for_workers(int(joined[0]), world_size, wait_s, fn)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        role = "master" if self._is_master else "client"
        return f"TCPStore({self._host!r}, {self._port}, world_size={self._world_size}, {role})"

    @property
    def host(self) -> str:
        """The host name the store was given.

        Examples:
            >>> dist.TCPStore("127.0.0.1", 0, 1, True).host
            '127.0.0.1'
        """
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one picked, on a master created with port 0).

        Examples:
            >>> master = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
            >>> client = dist.TCPStore("127.0.0.1", master.port, 2, False)
        """
        return self._port

    @property
    def server_address(self) -> tuple[str, int] | None:
        """The (address, port) the master's server listens on; None on clients.

        Examples:
            >>> dist.TCPStore("127.0.0.1", 0, 1, True).server_address
            ('127.0.0.1', 45678)  # the port the system picked
        """
        return None if self._server is None else self._server.address

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's name
        """False: the server is mpidist's own (torch reports whether it uses libuv).

        Examples:
            >>> dist.TCPStore("127.0.0.1", 0, 1, True).libuvBackend
            False
        """
        return False

    def close(self) -> None:
        """Close the connection; on the master, stop the server (other stores lose it). Idempotent.

        Examples:
            >>> store = dist.TCPStore("127.0.0.1", 0, 1, True)
            >>> store.close()
        """
        self._finalizer()

    def _wait_for_workers(self, joined: int, world_size: int, wait_s: float | None, fn: str) -> None:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        pause = _RETRY_FIRST_S
        while joined < world_size:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DistStoreError(
                    f"{fn}: only {joined} of world_size={world_size} stores (the master and {world_size - 1} "
                    f"clients) joined within {timedelta(seconds=wait_s or 0)}; start the other processes, "
                    f"or pass wait_for_workers=False"
                )
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, _RETRY_MAX_S)
            joined = int(self._request(fn, Cmd.ADD, [wire.key_field(_INIT_KEY), b"0"])[0])

    def _request(self, fn: str, cmd: Cmd, fields: list[bytes], wait_s: float | None = 0.0) -> list[bytes]:
        """Send one request; the reply must come within ``wait_s`` (what the server may wait for keys;
        None: no bound) plus the store's timeout (None: no bound; at least _REPLY_FLOOR_S)."""
        store_s = self._wait_seconds(None, fn)
        io = None if store_s is None or wait_s is None else wait_s + max(store_s, _REPLY_FLOOR_S)
        return self._client.request(fn, cmd, fields, io, store_s)

    def _set(self, key: str, value: bytes) -> None:
        self._request("TCPStore.set", Cmd.SET, [wire.key_field(key), value])

    def _get(self, key: str, timeout: float | None) -> bytes:
        fields = [wire.key_field(key), wire.timeout_field(timeout)]
        return self._request("TCPStore.get", Cmd.GET, fields, timeout)[0]

    def _add(self, key: str, amount: int) -> int:
        return wire.int_of(self._request("TCPStore.add", Cmd.ADD, [wire.key_field(key), wire.int_field(amount)])[0])

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._request("TCPStore.compare_set", Cmd.COMPARE_SET, [wire.key_field(key), expected, desired])[0]

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        fields = [wire.timeout_field(timeout)] + [wire.key_field(k) for k in keys]
        self._request("TCPStore.wait", Cmd.WAIT, fields, timeout)

    def _check(self, keys: list[str]) -> bool:
        return self._request("TCPStore.check", Cmd.CHECK, [wire.key_field(k) for k in keys])[0] == b"1"

    def _num_keys(self) -> int:
        return wire.int_of(self._request("TCPStore.num_keys", Cmd.NUM_KEYS, [])[0])

    def _delete_key(self, key: str) -> bool:
        return self._request("TCPStore.delete_key", Cmd.DELETE_KEY, [wire.key_field(key)])[0] == b"1"

    def _append(self, key: str, value: bytes) -> None:
        self._request("TCPStore.append", Cmd.APPEND, [wire.key_field(key), value])

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        fields = [wire.timeout_field(timeout)] + [wire.key_field(k) for k in keys]
        return self._request("TCPStore.multi_get", Cmd.MULTI_GET, fields, timeout)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        fields: list[bytes] = []
        for key, value in zip(keys, values):
            fields += [wire.key_field(key), value]
        self._request("TCPStore.multi_set", Cmd.MULTI_SET, fields)
