"""The server behind ``TCPStore``: one thread, one selector, many clients.

The server thread owns the keys; nothing else touches them, so no lock guards
them. Requests are answered in the order each client sent them. A request that
waits (``GET``, ``WAIT``, ``MULTI_GET`` on missing keys) does not block the
thread: it is parked as a :class:`_Waiter` under one of its missing keys and
answered when that key (then every other) is set, or with ``TIMEOUT`` when its
deadline passes; meanwhile the server serves the other clients. A client's
next request is handled only once its parked one is answered.

The server holds a bounded amount for each client (see docs/stores-robustness.md):
a client that sends requests without reading the replies is dropped once more
than ``max_queued_bytes`` of replies wait for it (one reply, however large, is
always allowed), and so is a client that sends more than that while its
request is parked. A dropped client's buffers are freed at once. When
``accept()`` fails (too many open files), the server stops listening for a
pause that doubles up to a second, instead of spinning.

:data:`registry` holds the servers shared by ``multi_tenant`` stores of this
process.

Example::

    >>> server = StoreServer(listen("127.0.0.1", 0, "example"))
    >>> server.start()
    >>> server.address
    ('127.0.0.1', 40123)
    >>> server.stop()
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from typing import Callable

from .._auth import JobKey
from ..errors import DistNetworkError
from . import _protocol as wire
from ._handshake import Acceptor
from ._protocol import Cmd, Status
from .base import NotACounterError, compare_set_value, parse_counter

__all__ = ["StoreServer", "ServerRegistry", "registry", "listen", "adopt_listener", "MAX_QUEUED_BYTES"]

_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_LISTENER, _WAKE = object(), object()  # selector tags of the listening socket and the wake-up pair
_RECV_BYTES = 1 << 20
_BACKLOG = 1024
#: the longest one select() sleeps (a later deadline is simply checked again after it)
_MAX_SLEEP_S = 3600.0
#: the default bound on the replies queued for one client (bytes)
MAX_QUEUED_BYTES = 8 << 20
#: what a queued reply costs beyond its bytes (its buffer objects), so small replies count too
_REPLY_COST = 256
#: pauses after accept() fails: first, cap (seconds)
_ACCEPT_PAUSE_FIRST_S, _ACCEPT_PAUSE_MAX_S = 0.01, 1.0
#: accept() errors that concern only the connection being accepted (accept the next one at once)
_ACCEPT_SKIP = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}
#: what the store's proofs of membership name as the service
SERVICE = b"store"
#: how long a connection to a server with a key may take to prove membership (seconds)
HANDSHAKE_S = 30.0

logger = logging.getLogger("mpidist.store")


def listen(host: str, port: int, fn: str) -> socket.socket:
    """Return a socket listening on ``host`` (an address or a name, resolved) and ``port``.

    Only that address is bound: ``127.0.0.1`` stays on the loopback interface.
    Of the addresses ``host`` resolves to, the first that can be bound is used.

    Raises:
        DistNetworkError: ``host`` does not resolve, or no address can be bound.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise DistNetworkError(f"{fn}: cannot resolve host_name {host!r}: {exc}") from exc
    last: OSError | None = None
    for family, type_, proto, _, addr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(_BACKLOG)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    if last is not None and last.errno == errno.EADDRINUSE:
        raise DistNetworkError(
            f"{fn}: cannot listen on {host}:{port}: another process holds port {port} (another user's, another "
            "job's, or one left running); start the job on a free port (MASTER_PORT)"
        ) from last
    raise DistNetworkError(f"{fn}: cannot listen on {host}:{port}: {last}") from last


def adopt_listener(fd: int, port: int, fn: str) -> socket.socket:
    """Return a listening socket on a duplicate of ``fd``, a TCP socket bound to ``port``.

    Raises:
        ValueError: ``fd`` is not a TCP socket, or is bound to another port.
    """
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError as exc:
        raise ValueError(f"{fn}: master_listen_fd {fd} is not an open socket: {exc}") from exc
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise ValueError(f"{fn}: master_listen_fd {fd} must be a TCP socket, got {sock.family!r} {sock.type!r}")
        bound = sock.getsockname()[1]
        if bound == 0:
            raise ValueError(f"{fn}: master_listen_fd {fd} must be bound to a port, it is not bound")
        if port not in (0, bound):
            raise ValueError(f"{fn}: master_listen_fd {fd} is bound to port {bound}, but port is {port}")
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class _Conn:
    """One client connection: its socket, unparsed input, unsent output, parked request."""

    __slots__ = ("sock", "peer", "inbuf", "pos", "out", "queued", "mask", "hello", "acceptor", "waiter", "closed")

    def __init__(self, sock: socket.socket, peer: str, acceptor: Acceptor | None = None) -> None:
        self.sock = sock
        self.peer = peer  # the client's address, for messages
        self.inbuf = bytearray()
        self.pos = 0  # start of the unparsed input in inbuf
        self.out: deque[memoryview] = deque()
        self.queued = 0  # what ``out`` holds: its bytes plus _REPLY_COST per reply
        self.mask = _READ
        self.hello = False  # admitted by the handshake
        self.acceptor = acceptor or Acceptor(None, SERVICE, wire.MAGIC)
        self.waiter: _Waiter | None = None
        self.closed = False


class _Waiter:
    """A parked GET/WAIT/MULTI_GET: answered when all ``keys`` are set, or at ``deadline``."""

    __slots__ = ("conn", "cmd", "keys", "deadline", "parked_on", "done")

    def __init__(self, conn: _Conn, cmd: Cmd, keys: list[str], deadline: float | None) -> None:
        self.conn: _Conn | None = conn  # None once done (a waiter left in the deadline heap holds nothing)
        self.cmd = cmd
        self.keys = keys
        self.deadline = deadline
        self.parked_on = ""  # the missing key it waits under
        self.done = False


class StoreServer:
    """Serve TCPStore clients on ``listener`` from a background thread.

    Args:
        listener: a listening TCP socket; the server owns and closes it.
        max_queued_bytes: drop a client once the replies it has not read
            exceed this many bytes (beyond one reply), or once it sends this
            many bytes while a request of its is parked.
        key: the job's key: every client must prove it holds it before any
            request of its is read (see ``_handshake.py``); None: every client
            that speaks the protocol is served.
        handshake_s: with a key, close a connection that has not proved
            membership this many seconds after it was accepted (so that
            peers that connect and say nothing cannot pile up).

    Example::

        >>> server = StoreServer(listen("127.0.0.1", 0, "example"))
        >>> server.start()
        >>> server.port > 0
        True
        >>> server.stop()
    """

    def __init__(
        self,
        listener: socket.socket,
        *,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        key: JobKey | None = None,
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        if not isinstance(max_queued_bytes, int) or isinstance(max_queued_bytes, bool):
            raise TypeError(f"StoreServer: max_queued_bytes must be an int, got {type(max_queued_bytes).__name__}")
        if max_queued_bytes <= 0:
            raise ValueError(f"StoreServer: max_queued_bytes must be positive, got {max_queued_bytes}")
        self._max_queued = max_queued_bytes
        self._key = key
        self._handshake_s = handshake_s
        self._unproved: deque[tuple[float, _Conn]] = deque()  # (deadline, connection) in accept order
        self._listener = listener
        self._listener.setblocking(False)
        self.address: tuple[str, int] = tuple(listener.getsockname()[:2])  # type: ignore[assignment]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._listener, _READ, _LISTENER)
        self._sel.register(self._wake_r, _READ, _WAKE)
        self._stopping = False
        self._closed = False
        self._data: dict[str, bytes] = {}
        self._parked: dict[str, list[_Waiter]] = {}  # missing key -> waiters parked under it
        self._deadlines: list[tuple[float, int, _Waiter]] = []  # heap
        self._done_in_heap = 0  # entries of _deadlines whose waiter is done
        self._accept_pause = 0.0  # the last pause after accept() failed (0: accepting works)
        self._accept_at: float | None = None  # when to listen again, while paused
        self.dropped = 0  # clients dropped for exceeding max_queued_bytes (for tests and monitoring)
        self._seq = itertools.count()
        self._resume: deque[_Conn] = deque()  # connections whose parked request was answered
        self._conns: set[_Conn] = set()
        self._thread = threading.Thread(
            target=self._run, name=f"mpidist-tcpstore-server-{self.address[1]}", daemon=True
        )
        self._handlers: dict[int, Callable[[_Conn, list[bytes]], tuple[Status, list[bytes]] | None]] = {
            Cmd.SET: self._on_set,
            Cmd.GET: self._on_get,
            Cmd.ADD: self._on_add,
            Cmd.COMPARE_SET: self._on_compare_set,
            Cmd.WAIT: self._on_wait,
            Cmd.CHECK: self._on_check,
            Cmd.NUM_KEYS: self._on_num_keys,
            Cmd.DELETE_KEY: self._on_delete_key,
            Cmd.APPEND: self._on_append,
            Cmd.MULTI_GET: self._on_multi_get,
            Cmd.MULTI_SET: self._on_multi_set,
        }

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self.address[1]

    def start(self) -> None:
        """Start serving (in a daemon thread)."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket. Idempotent."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_all()

    # ------------------------------------------------------------------ event loop

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._dispatch(self._sel.select(self._next_timeout()))
                self._expire()
                self._close_unproved()
                if self._accept_at is not None and time.monotonic() >= self._accept_at:
                    self._resume_accepting()
                while self._resume:
                    self._process(self._resume.popleft())
        finally:
            self._close_all()

    def _dispatch(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """Handle the events of one select.

        A method of its own, so that no local variable keeps a dropped
        connection alive while the loop waits for the next event.
        """
        for key, mask in events:
            tag = key.data
            if tag is _LISTENER:
                self._accept()
            elif tag is _WAKE:
                self._drain_wake()
            else:
                if mask & _READ:
                    self._read(tag)
                if mask & _WRITE and not tag.closed:
                    self._flush(tag)

    def _close_all(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns):
            self._drop(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError, OSError):
                pass
            sock.close()
        self._sel.close()

    def _next_timeout(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
            self._done_in_heap -= 1
        wake = [self._deadlines[0][0]] if self._deadlines else []
        if self._unproved:
            wake.append(self._unproved[0][0])
        if self._accept_at is not None:
            wake.append(self._accept_at)
        # capped: a far deadline (a client's wait of a year) would overflow poll()'s int of milliseconds
        return min(max(0.0, min(wake) - time.monotonic()), _MAX_SLEEP_S) if wake else None

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_SKIP:
                    continue  # that connection is gone; the next may be fine
                self._pause_accepting(exc)  # e.g. too many open files: the connection waits in the backlog
                return
            self._accept_pause = 0.0
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            conn = _Conn(sock, peer, Acceptor(self._key, SERVICE, wire.MAGIC))
            self._conns.add(conn)
            if self._key is not None:
                self._unproved.append((time.monotonic() + self._handshake_s, conn))
            self._sel.register(sock, _READ, conn)

    def _close_unproved(self) -> None:
        """Close the connections that have not proved membership within the handshake's time (logged)."""
        now = time.monotonic()
        while self._unproved and (self._unproved[0][1].hello or self._unproved[0][1].closed or self._unproved[0][0] <= now):
            _, conn = self._unproved.popleft()
            if not conn.hello and not conn.closed:
                logger.warning(
                    "TCPStore server on port %d: closed a connection from %s that did not prove membership within "
                    "%g s", self.address[1], conn.peer, self._handshake_s,
                )  # fmt: skip
                self._drop(conn)

    def _pause_accepting(self, exc: OSError) -> None:
        """Stop listening for a while (doubling from 10 ms to 1 s), so a failing accept() does not spin."""
        if not self._accept_pause:
            logger.warning(
                "TCPStore server on port %d cannot accept connections (%s); new clients wait in the backlog, "
                "retried every %g s at most",
                self.port,
                exc,
                _ACCEPT_PAUSE_MAX_S,
            )
        self._accept_pause = min(max(self._accept_pause * 2, _ACCEPT_PAUSE_FIRST_S), _ACCEPT_PAUSE_MAX_S)
        self._accept_at = time.monotonic() + self._accept_pause
        self._sel.unregister(self._listener)

    def _resume_accepting(self) -> None:
        self._accept_at = None
        self._sel.register(self._listener, _READ, _LISTENER)
        self._accept()

    def _drop(self, conn: _Conn) -> None:
        """Close ``conn`` and free its buffers and parked request at once. Idempotent."""
        if conn.closed:
            return
        self._conns.discard(conn)
        if conn.waiter is not None:
            self._unpark(conn.waiter)
            conn.waiter = None
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        conn.inbuf = bytearray()
        conn.pos = 0
        conn.out.clear()
        conn.queued = 0
        conn.closed = True  # last: another thread that sees it sees everything above done

    def _drop_greedy(self, conn: _Conn, what: str) -> None:
        """Drop a client that made the server hold more than ``max_queued_bytes`` for it."""
        logger.warning(
            "TCPStore server on port %d: dropped the client at %s: %s, more than the limit of %d bytes "
            "(a TCPStore client sends one request at a time and reads its reply)",
            self.port,
            conn.peer,
            what,
            self._max_queued,
        )
        self._drop(conn)
        self.dropped += 1

    def connection_stats(self) -> list[tuple[str, int, int]]:
        """Return (client address, bytes of unparsed input, bytes of queued replies) of each open connection.

        The reply count includes a fixed cost per queued reply (see ``_REPLY_COST``).
        Safe to call from any thread (a snapshot; the numbers may be a moment old).
        """
        return [(c.peer, len(c.inbuf) - c.pos, c.queued) for c in list(self._conns)]

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not chunk:
            self._drop(conn)
            return
        conn.inbuf += chunk
        del chunk
        if conn.waiter is not None and len(conn.inbuf) - conn.pos > self._max_queued:
            self._drop_greedy(conn, f"it sent {len(conn.inbuf) - conn.pos} bytes while a request of its was parked")
            return
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Handle the complete requests in ``conn``'s input, up to one that parks."""
        buf = conn.inbuf
        while not conn.closed and conn.waiter is None:
            if len(buf) - conn.pos < wire.LENGTH.size:
                break
            (n,) = wire.LENGTH.unpack_from(buf, conn.pos)
            if not conn.hello and n > wire.MAX_HELLO_BYTES:
                self._drop(conn)  # not a TCPStore client
                return
            start = conn.pos + wire.LENGTH.size
            if len(buf) - start < n:
                break
            body = memoryview(buf)[start : start + n]
            try:
                code, fields = wire.decode(body)
            except ValueError:
                body.release()
                self._drop(conn)
                return
            body.release()
            conn.pos = start + n
            self._handle(conn, code, fields)
        if conn.pos and not conn.closed:
            del buf[: conn.pos]
            conn.pos = 0

    def _handle(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        if not conn.hello:
            self._handshake(conn, code, fields)
            return
        handler = self._handlers.get(code)
        if handler is None:
            self._send(conn, Status.ERROR, [f"TCPStore server: unknown request code {code}".encode()])
            return
        try:
            reply = handler(conn, fields)
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            self._send(conn, Status.ERROR, [f"TCPStore server: malformed request {code}: {exc}".encode()])
            return
        except NotACounterError as exc:
            self._send(conn, Status.NOT_A_COUNTER, [exc.value])
            return
        except Exception as exc:  # noqa: BLE001 - a bug must fail the request, not kill the server
            self._send(conn, Status.ERROR, [f"TCPStore server: {type(exc).__name__}: {exc}".encode()])
            return
        if reply is not None:
            self._send(conn, *reply)

    def _handshake(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        """One frame of a connection's handshake: admit it, or refuse it (logged) and close it."""
        acceptor = conn.acceptor
        reply = acceptor.step(code, fields)
        if reply is not None:
            self._send(conn, *reply)
        if acceptor.admitted:
            conn.hello = True
        elif acceptor.refused:
            if self._key is not None:
                logger.warning(
                    "TCPStore server on port %d: refused a connection from %s: %s", self.address[1], conn.peer,
                    acceptor.reason,
                )  # fmt: skip
            self._drop(conn)

    def _send(self, conn: _Conn, status: Status, fields: list[bytes]) -> None:
        """Queue a reply and send what the socket takes; drop a client that lets replies pile up."""
        if conn.closed:
            return
        frame = wire.encode(status, fields)
        conn.out.append(memoryview(frame))
        conn.queued += len(frame) + _REPLY_COST
        del frame
        self._flush(conn)
        if not conn.closed and len(conn.out) > 1 and conn.queued > self._max_queued:
            self._drop_greedy(conn, f"{len(conn.out)} replies it has not read hold {conn.queued} bytes")

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.out:
                head = conn.out[0]
                n = conn.sock.send(head)
                if n < len(head):
                    conn.out[0] = head[n:]
                    conn.queued -= n
                    break
                conn.out.popleft()
                conn.queued -= n + _REPLY_COST
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
            return
        want = _READ | _WRITE if conn.out else _READ
        if want != conn.mask:
            conn.mask = want
            self._sel.modify(conn.sock, want, conn)

    # ------------------------------------------------------------------ parked requests

    def _park(self, conn: _Conn, cmd: Cmd, keys: list[str], timeout: float | None) -> tuple[Status, list[bytes]] | None:
        """Answer now if every key is set, else park the request (and return None)."""
        missing = [k for k in keys if k not in self._data]
        if not missing:
            return Status.OK, self._answer(cmd, keys)
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = _Waiter(conn, cmd, keys, deadline)
        conn.waiter = waiter
        self._park_under(waiter, missing[0])
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, next(self._seq), waiter))
        return None

    def _park_under(self, waiter: _Waiter, key: str) -> None:
        waiter.parked_on = key
        self._parked.setdefault(key, []).append(waiter)

    def _unpark(self, waiter: _Waiter) -> None:
        """Mark ``waiter`` done and forget it: it keeps no connection, keys or heap room alive."""
        if waiter.done:
            return
        waiter.done = True
        waiter.conn = None
        if waiter.deadline is not None:
            self._done_in_heap += 1
            if self._done_in_heap > 1024 and 2 * self._done_in_heap > len(self._deadlines):
                self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
                heapq.heapify(self._deadlines)
                self._done_in_heap = 0
        parked = self._parked.get(waiter.parked_on)
        if parked is not None:
            try:
                parked.remove(waiter)
            except ValueError:
                pass
            if not parked:
                del self._parked[waiter.parked_on]
        waiter.keys = []

    def _answer(self, cmd: Cmd, keys: list[str]) -> list[bytes]:
        if cmd == Cmd.GET or cmd == Cmd.MULTI_GET:
            return [self._data[k] for k in keys]
        return []  # WAIT

    def _finish(self, waiter: _Waiter, status: Status, fields: list[bytes]) -> None:
        conn = waiter.conn
        self._unpark(waiter)
        if conn is None:
            return
        conn.waiter = None
        self._send(conn, status, fields)
        self._resume.append(conn)  # its next requests, read while it was parked

    def _changed(self, key: str) -> None:
        """``key`` was set: answer or re-park the requests parked under it."""
        parked = self._parked.pop(key, None)
        if not parked:
            return
        for waiter in parked:
            if waiter.done:
                continue
            missing = [k for k in waiter.keys if k not in self._data]
            if missing:
                self._park_under(waiter, missing[0])
            else:
                self._finish(waiter, Status.OK, self._answer(waiter.cmd, waiter.keys))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if waiter.done:
                self._done_in_heap -= 1
                continue
            waiter.deadline = None  # out of the heap now
            missing = [k for k in waiter.keys if k not in self._data]
            if missing:
                self._finish(waiter, Status.TIMEOUT, [wire.key_field(k) for k in missing])
            else:
                self._finish(waiter, Status.OK, self._answer(waiter.cmd, waiter.keys))

    # ------------------------------------------------------------------ requests

    def _store(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._changed(key)

    def _on_set(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]]:
        key, value = f
        self._store(wire.key_of(key), value)
        return Status.OK, []

    def _on_get(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]] | None:
        key, timeout = f
        return self._park(conn, Cmd.GET, [wire.key_of(key)], wire.timeout_of(timeout))

    def _on_add(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]]:
        key, amount = wire.key_of(f[0]), wire.int_of(f[1])
        current = self._data.get(key)
        total = amount + (0 if current is None else parse_counter(current))
        self._store(key, wire.int_field(total))
        return Status.OK, [wire.int_field(total)]

    def _on_compare_set(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]]:
        key, expected, desired = wire.key_of(f[0]), f[1], f[2]
        result, store_it = compare_set_value(self._data.get(key), expected, desired)
        if store_it:
            self._store(key, desired)
        return Status.OK, [result]

    def _on_wait(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]] | None:
        return self._park(conn, Cmd.WAIT, [wire.key_of(k) for k in f[1:]], wire.timeout_of(f[0]))

    def _on_check(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]]:
        present = all(wire.key_of(k) in self._data for k in f)
        return Status.OK, [b"1" if present else b"0"]

    def _on_num_keys(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]]:
        return Status.OK, [wire.int_field(len(self._data))]

    def _on_delete_key(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]]:
        (key,) = f
        existed = self._data.pop(wire.key_of(key), None) is not None
        return Status.OK, [b"1" if existed else b"0"]

    def _on_append(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]]:
        key, value = wire.key_of(f[0]), f[1]
        self._store(key, self._data.get(key, b"") + value)
        return Status.OK, []

    def _on_multi_get(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]] | None:
        return self._park(conn, Cmd.MULTI_GET, [wire.key_of(k) for k in f[1:]], wire.timeout_of(f[0]))

    def _on_multi_set(self, conn: _Conn, f: list[bytes]) -> tuple[Status, list[bytes]]:
        if len(f) % 2:
            raise ValueError("MULTI_SET needs key/value pairs")
        pairs = [(wire.key_of(f[i]), f[i + 1]) for i in range(0, len(f), 2)]
        self._data.update(pairs)
        for key, _ in pairs:
            self._changed(key)
        return Status.OK, []


class ServerRegistry:
    """The servers shared by ``multi_tenant`` TCPStores of this process, by (host, port).

    Example::

        >>> server = registry.acquire("127.0.0.1", 0, lambda: StoreServer(listen("127.0.0.1", 0, "x")))
        >>> registry.acquire("127.0.0.1", server.port, None) is server
        True
        >>> registry.release(server); registry.release(server)   # the last release stops it
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: dict[tuple[str, int], tuple[StoreServer, int]] = {}

    def acquire(self, host: str, port: int, create: Callable[[], StoreServer] | None) -> StoreServer:
        """Return the running server for (host, port), or start one with ``create()``."""
        with self._lock:
            entry = self._servers.get((host, port)) if port else None
            if entry is not None:
                server, users = entry
                self._servers[(host, port)] = (server, users + 1)
                return server
            if create is None:
                raise KeyError((host, port))
            server = create()
            server.start()
            self._servers[(host, server.port)] = (server, 1)
            return server

    def release(self, server: StoreServer) -> None:
        """Drop one user of ``server``; stop it when it has none."""
        with self._lock:
            for key, (known, users) in self._servers.items():
                if known is server:
                    if users > 1:
                        self._servers[key] = (server, users - 1)
                        return
                    del self._servers[key]
                    break
        server.stop()


#: the one registry of this process
registry = ServerRegistry()
