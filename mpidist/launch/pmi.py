"""A small PMI-1 server: lets processes that no MPI launcher started form one MPI world.

MPI libraries learn their rank, world size and each other's addresses from the
process manager that ``mpiexec`` runs, through the PMI protocol. When the
processes were started some other way (torchrun, ``srun`` without PMI, N plain
``python`` commands with ``env://`` variables), rank 0 of the store rendezvous
runs this server in a background thread, and every process points its MPI
library at it (``PMI_PORT=host:port``, ``PMI_ID=rank``) before ``MPI_Init``.
MPICH speaks this wire protocol (version 1.1, text lines ``cmd=... key=value``);
Open MPI uses PMIx instead and cannot be started this way.

The server runs in a process of its own, started by rank 0 (``MPI_Init`` holds
the interpreter lock while it waits for PMI, so a thread of rank 0 could not
answer). It exits once every rank has finalized MPI or disconnected, or when not
every rank connected within the timeout.

The server keeps the key-value space MPI fills during start-up, answers the
rank, size and node layout, and runs the PMI barriers. It serves only the
job's processes: each connection starts with the handshake of
``store/_handshake.py`` (the job's key, given on the server's standard input,
never on its command line), in which the process also names its rank; a peer
that cannot prove the key is closed before a PMI line of it is read. The
process then hands the connected socket to MPICH (``PMI_FD``), so MPI's own
PMI client talks on a connection that is already proved.

Example (what ``init_process_group`` does; normally not called directly)::

    >>> proc, address = start_server_process("127.0.0.1", 2, ["n0", "n0"], 60, key)
    >>> env = connect(address, key, rank=0, size=2)   # {"PMI_FD": ..., "PMI_RANK": "0", "PMI_SIZE": "2"}
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from .._auth import JobKey, SecretKey
from ..store._handshake import (
    Acceptor,
    HandshakeRefusedError,
    NotProvenError,
    NotThisProtocolError,
    client_handshake,
    server_handshake,
)

__all__ = ["PMIServer", "process_mapping", "start_server_process", "connect"]

#: the handshake's HELLO payload and service name on the PMI server
MAGIC, SERVICE = b"mpidist-pmi-1", b"pmi"
#: how long a connection may take to prove membership before the server closes it (seconds)
_HANDSHAKE_S = 30.0


def process_mapping(hosts: list[str]) -> str:
    """Describe which ranks share a node, in PMI's ``(vector,(node,count,ranks),...)`` form.

    Example::

        >>> process_mapping(["a", "a", "b", "b"])
        '(vector,(0,1,2),(1,1,2))'
    """
    ids: dict[str, int] = {}
    blocks: list[list[int]] = []
    for host in hosts:
        node = ids.setdefault(host, len(ids))
        if blocks and blocks[-1][0] == node:
            blocks[-1][2] += 1
        else:
            blocks.append([node, 1, 1])
    return "(vector," + ",".join(f"({n},{c},{r})" for n, c, r in blocks) + ")"


def _fields(line: str) -> dict[str, str]:
    out = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


class PMIServer:
    """Serve PMI-1 to ``size`` MPI processes on ``host`` (a free port is picked).

    Args:
        host: address to listen on (loopback when every process is on this node).
        size: the number of processes in the world.
        hosts: each rank's host name, in rank order (for the node layout).
        key: the job's key; None: every process that speaks the handshake is served.
    """

    def __init__(self, host: str, size: int, hosts: list[str], key: JobKey | None = None) -> None:
        self.size = size
        self.key = key
        self.claims: dict[int, list[str]] = {}  # rank -> who claimed it, as each said in its handshake
        # MPICH names its shared-memory segments after the KVS: unique per world, so that a
        # crashed earlier world's leftovers are never attached
        self.kvsname = f"mpidist_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        self._kvs = {"PMI_process_mapping": process_mapping(hosts)}
        self._cond = threading.Condition()
        self._arrived = 0
        self._round = 0
        self._finished = 0
        self._connected = 0
        self._named: set[int] = set()  # PMI ids of the processes that have introduced themselves
        self._lost = False  # a process left without finalizing: no barrier can complete any more
        self._sock = socket.create_server((host, 0), backlog=max(size, 16))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, name="mpidist-pmi", daemon=True).start()

    # -- serving ------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._admit, args=(conn, peer), name="mpidist-pmi-client", daemon=True).start()

    def _admit(self, conn: socket.socket, peer: Any) -> None:
        """Serve ``conn`` once it has proved membership and named its rank; refuse (and log) it otherwise."""
        acceptor = Acceptor(self.key, SERVICE, MAGIC, "PMI server")
        conn.settimeout(_HANDSHAKE_S)
        rank = -1
        if server_handshake(conn, acceptor):
            who = acceptor.who.decode("utf-8", "replace")
            word = who.split(" ", 1)[0]
            rank = int(word[5:]) if word.startswith("rank=") and word[5:].isdigit() else -1
            if not 0 <= rank < self.size:
                acceptor.refused, acceptor.reason = True, f"it named no rank of the world ({who[:80]!r})"
        if acceptor.refused or rank < 0:
            print(f"[mpidist] PMI server: refused a connection from {peer[0]}: {acceptor.reason}", file=sys.stderr, flush=True)
            conn.close()
            return
        conn.settimeout(None)
        _keep_alive(conn)
        with self._cond:
            self._connected += 1
            self.claims.setdefault(rank, []).append(who)
            self._named.add(rank)
            self._cond.notify_all()
        self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        finalized = False
        with conn, conn.makefile("rwb", buffering=0) as stream:
            try:
                for raw in stream:
                    line = raw.decode(errors="replace").strip()
                    if not line:
                        continue
                    reply = self._answer(_fields(line))
                    if reply:
                        stream.write(reply.encode())
                    if line.startswith("cmd=finalize"):
                        finalized = True
                        break
            except OSError:
                pass
        with self._cond:
            self._finished += 1
            # a process that died (killed, os._exit) never reaches the others' next barrier: release them
            self._lost = self._lost or not finalized
            self._cond.notify_all()

    def _answer(self, msg: dict[str, str]) -> str:
        cmd = msg.get("cmd", "")
        if cmd == "initack":  # a client started with PMI_ID (the handshake named it already)
            return f"cmd=initack rc=0\ncmd=set size={self.size}\ncmd=set rank={msg.get('pmiid', 0)}\ncmd=set debug=0\n"
        if cmd == "init":
            return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n"
        if cmd == "get_maxes":
            return "cmd=maxes kvsname_max=256 keylen_max=256 vallen_max=4096 rc=0\n"
        if cmd == "get_appnum":
            return "cmd=appnum appnum=0 rc=0\n"
        if cmd == "get_my_kvsname":
            return f"cmd=my_kvsname kvsname={self.kvsname} rc=0\n"
        if cmd == "get_universe_size":
            return f"cmd=universe_size size={self.size} rc=0\n"
        if cmd == "put":
            with self._cond:
                self._kvs[msg.get("key", "")] = msg.get("value", "")
            return "cmd=put_result rc=0\n"
        if cmd == "get":
            with self._cond:
                value = self._kvs.get(msg.get("key", ""))
            if value is None:
                return "cmd=get_result rc=-1 msg=key_not_found\n"
            return f"cmd=get_result rc=0 value={value}\n"
        if cmd == "barrier_in":
            if self._barrier():
                return "cmd=barrier_out rc=0\n"
            return "cmd=barrier_out rc=-1 msg=a_process_left_without_finalizing_MPI\n"
        if cmd == "finalize":
            return "cmd=finalize_ack rc=0\n"
        if cmd == "abort":  # MPICH's client goes on after it (mpidist then ends the process itself)
            print(f"[mpidist] an MPI process aborted: {msg}", file=sys.stderr, flush=True)
            with self._cond:
                self._lost = True  # the job is over: no barrier (MPI_Finalize's) may wait for it any more
                self._cond.notify_all()
            return ""
        return f"cmd={cmd} rc=-1 msg=unsupported_by_mpidist_pmi\n"

    def _barrier(self) -> bool:
        """Wait until every process has entered this barrier (True), or one has left without finalizing (False)."""
        with self._cond:
            mine = self._round
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived = 0
                self._round += 1
                self._cond.notify_all()
            while self._round == mine:
                if self._lost:
                    return False
                self._cond.wait()
            return True

    # -- shutting down ------------------------------------------------------------------
    def wait_finished(self, timeout_s: float | None = None) -> bool:
        """Wait until every client finalized or disconnected (True) or ``timeout_s`` passes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._finished < self.size:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def named(self, timeout_s: float) -> set[int]:
        """The PMI ids that have introduced themselves, after waiting up to ``timeout_s`` for a new one."""
        with self._cond:
            before = len(self._named)
            self._cond.wait_for(lambda: len(self._named) != before, timeout_s)
            return set(self._named)

    def close(self) -> None:
        """Stop accepting connections."""
        self._sock.close()

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until every rank has connected (True) or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._connected < self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True


def _keep_alive(conn: socket.socket) -> None:
    """Probe an idle connection, so that a host that vanished (power, cable) ends it within about 30 s."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, option):
            try:
                conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
            except OSError:
                pass


def start_server_process(
    host: str, size: int, hosts: list[str], timeout_s: float, key: JobKey | None = None
) -> tuple[subprocess.Popen, str]:
    """Start a PMI server in a process of its own; return it and its ``host:port``.

    The job's key reaches the server on its standard input (a command line is
    visible to every user). The server writes its address on its first line of
    output, then ``connected N`` as each process N > 0 introduces itself
    (:func:`wait_others_connected`).
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_MAIN, _PACKAGE_DIR, host, str(size), str(timeout_s), *hosts],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(_key_line(key))
    proc.stdin.close()
    proc._mpidist_size = size  # type: ignore[attr-defined]
    lines = _lines(proc, time.monotonic() + max(timeout_s, 30.0) + 3600.0)
    address = _next_line(lines, time.monotonic() + max(timeout_s, 30.0)) or ""
    if not address:
        raise RuntimeError(f"the PMI server did not start (exit code {proc.poll()})")
    proc._mpidist_lines = lines  # type: ignore[attr-defined]  # the rest of its output, for wait_others_connected
    return proc, address


#: the mpidist package's folder
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the server process's program: this module, imported without running the package's ``__init__`` (which
#: imports numpy and the array layer: 1-2 s on a loaded machine, on every launch-free start's critical path);
#: the server needs only this module, ``_auth`` and the store's handshake, which import the standard library
_SERVER_MAIN = (
    "import sys, types\n"
    "root = sys.argv.pop(1)\n"
    "for name, sub in (('mpidist', ''), ('mpidist.store', '/store'), ('mpidist.launch', '/launch')):\n"
    "    package = types.ModuleType(name)\n"
    "    package.__path__ = [root + sub]\n"
    "    sys.modules[name] = package\n"
    "from mpidist.launch.pmi import _main\n"
    "sys.exit(_main(sys.argv[1:]))\n"
)


def _key_line(key: JobKey | None) -> bytes:
    """How the server process learns the job's key: ``none``, ``munge`` or ``hmac <hex>``."""
    if key is None:
        return b"none\n"
    if isinstance(key, SecretKey):
        return b"hmac " + key.secret.hex().encode() + b"\n"
    return key.kind.encode() + b"\n"


def _key_from_line(line: str) -> JobKey | None:
    from .._auth import munge_key

    kind, _, value = line.strip().partition(" ")
    if kind == "hmac":
        return SecretKey(bytes.fromhex(value))
    if kind == "munge":
        key = munge_key()
        if key is None:
            raise RuntimeError("munged does not answer")
        return key
    return None


def connect(address: str, key: JobKey | None, rank: int, size: int, timeout_s: float) -> dict[str, str]:
    """Connect to the PMI server at ``address``, prove membership, and return MPICH's variables for it.

    The proved connection is handed to MPICH as ``PMI_FD`` (with ``PMI_RANK`` and
    ``PMI_SIZE``), so MPI never opens an unproved one. Retries while the server
    refuses connections, until ``timeout_s``.

    Raises:
        DistNetworkError: the server refused this process, could not prove the
            job's key (another process holds the port), or did not answer in time.
    """
    from ..errors import DistNetworkError

    host, _, port = address.rpartition(":")
    who = f"rank={rank} host={socket.gethostname()} pid={os.getpid()}".encode()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 1.0))
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise DistNetworkError(f"cannot reach rank 0's PMI server at {address}: {exc}") from None
            time.sleep(0.05)
            continue
        try:
            client_handshake(sock, key, SERVICE, MAGIC, who)
        except HandshakeRefusedError as exc:
            sock.close()
            raise DistNetworkError(f"rank 0's PMI server at {address} refused this process: {exc}") from None
        except (NotProvenError, NotThisProtocolError) as exc:
            sock.close()
            raise DistNetworkError(
                f"the process listening on {address} is not this job's PMI server ({exc or 'not a PMI server'}): "
                f"another process holds port {port}; see docs/security.md"
            ) from None
        except OSError as exc:
            sock.close()
            raise DistNetworkError(f"the handshake with rank 0's PMI server at {address} failed: {exc}") from None
        sock.settimeout(None)
        fd = sock.detach()  # MPICH's PMI client reads and writes it from now on
        return {"PMI_FD": str(fd), "PMI_RANK": str(rank), "PMI_SIZE": str(size)}


def _lines(proc: subprocess.Popen, deadline: float):
    """The server's output lines, read from its pipe without Python's buffering, until ``deadline``."""
    import select

    fd = proc.stdout.fileno()  # type: ignore[union-attr]
    pending = b""
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield line.decode(errors="replace").strip()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        if not select.select([fd], [], [], min(left, 0.2))[0]:
            yield ""  # nothing yet: the caller may stop waiting
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # the server exited
            return
        pending += chunk


def wait_others_connected(proc: subprocess.Popen, timeout_s: float) -> list[int]:
    """Wait until every process but rank 0 has introduced itself to the server; return the ranks still missing.

    Rank 0 calls this before ``MPI_Init``: once every other process has reached the
    PMI server, none of them needs rank 0's store any more (``MPI_Init`` holds the
    interpreter lock, so the store could not answer them).
    """
    size = int(proc._mpidist_size)  # type: ignore[attr-defined]
    seen: set[int] = proc.__dict__.setdefault("_mpidist_seen", set())
    lines = proc.__dict__.setdefault("_mpidist_lines", _lines(proc, time.monotonic() + timeout_s))
    deadline = time.monotonic() + timeout_s
    while not seen >= set(range(1, size)):
        line = _next_line(lines, deadline)
        if line is None:
            break
        word, _, rank = line.partition(" ")
        if word == "connected" and rank.isdigit():
            seen.add(int(rank))
    return sorted(set(range(1, size)) - seen)


def _next_line(lines: Any, deadline: float) -> str | None:
    """The server's next line, or None at ``deadline`` or once it has no more."""
    while time.monotonic() < deadline:
        line = next(lines, None)
        if line != "":  # "" only while no line has come yet
            return line
    return None


def _main(argv: list[str]) -> int:
    host, size, timeout_s, hosts = argv[0], int(argv[1]), float(argv[2]), argv[3:]
    parent = os.getppid()  # rank 0
    server = PMIServer(host, size, hosts, _key_from_line(sys.stdin.readline()))
    print(server.address, flush=True)
    others, told = set(range(1, size)), set()
    deadline = time.monotonic() + timeout_s
    while not others <= told:  # tell rank 0 as the others arrive: it starts MPI once all have
        for rank in sorted(server.named(0.5) - told):
            print(f"connected {rank}", flush=True)
            told.add(rank)
        if os.getppid() != parent or time.monotonic() > deadline:
            print(f"[mpidist] PMI server: ranks {sorted(others - told)} did not connect", file=sys.stderr)
            return 1
    sys.stdout.close()
    if not server.wait_connected(max(deadline - time.monotonic(), 1.0)):
        print(f"[mpidist] PMI server: not every rank connected within {timeout_s:g} s", file=sys.stderr)
        return 1
    gone_at = None
    while not server.wait_finished(1.0):
        # bounded by the job: once rank 0 (which started this server and hosts the job's store) is gone,
        # the others get a short while to finish, then the server leaves
        if os.getppid() != parent:
            gone_at = gone_at or time.monotonic()
            if time.monotonic() - gone_at > _AFTER_RANK0_S:
                break
    server.close()
    return 0


#: how long the server stays once rank 0 has exited, for the other processes to finish
_AFTER_RANK0_S = 10.0
