"""The MPI backend's shared-memory path: large collectives among the ranks of one node at memory speed.

On one node a large collective is bounded by memory bandwidth, and MPI's algorithms
move each byte through small shared cells several times. Here the ranks of a group
that share a node map one shared segment and move each chunk of a message once:

* **all_reduce**: every rank reduces one segment of each chunk. A rank copies the
  segments the others reduce into its slot (its own it reads where it is), reduces
  its segment from every rank's copy in rank order into its result area (and into
  its own array), then copies the others' results into its array. Per rank that is
  (n-1)/n of the message copied in, one reduction of 1/n, (n-1)/n copied out.
* **reduce**: the same, but only the destination copies results out.
* **broadcast**: the source copies each chunk into its slot, the others copy it out.
* **all_gather_into_tensor**: each rank copies its input into its slot, every rank
  copies every slot into its output.
* **reduce_scatter_tensor**: each rank copies the blocks others reduce into its slot
  and reduces its own block straight into its output.

broadcast and all_gather_into_tensor also have a **one-copy** variant: each rank reads
the source's (every other rank's) array straight from its memory (``_shm.read_from``,
the kernel's ``process_vm_readv``), where every rank could read every other's probe
word at set-up; the measuring (``shm_choice.py``) decides when it runs.

A message goes in chunks (:data:`CHUNK` bytes, or less where the node's budget is
tight, down to :data:`MIN_CHUNK`) through two slots per rank (double buffering), so
one phase of a chunk overlaps the next chunk's copy. Ranks announce
each phase by raising a counter in the segment (``_shm.c``: a release store, read
with acquire loads) and numbered chunks never repeat, so no counter is ever reset.

Every result is computed once, by one rank, in rank order (bit-identical on every
rank and from run to run), with numpy's vectorized loops, mpidist's C ops for
float16/bfloat16 (``halfops.py``), and order keys for float MIN/MAX (``reduce_op``).

An operation is a request like MPI's (:class:`SharedOp`): ``Test()`` does whatever
the other ranks' counters allow and never waits, so ``work.poll`` (with its
yields, the group's timeout and the "who is where" diagnosis) and ``Work`` (async_op)
drive it as they drive MPI's requests; a blocking wait polls ``spin()`` instead, which
waits in C (bounded, GIL released) where no phase can move. A group's operations run in
issue order.

The segment is POSIX shared memory: the group's rank 0 creates it, every rank maps
it, and rank 0 unlinks its name as soon as all have (milliseconds later), so a
crash or a kill leaves nothing behind; the memory goes when the last rank unmaps it.
Extra memory per group: n x (2 x chunk + 2 x chunk/n + 4 KiB) on its node (6 MiB for 2
ranks, 10 MiB for 4 with 1 MiB chunks), whatever the message size. Every group of a node
together takes at most ``shm_tuning.node_budget()`` (half of ``/dev/shm``, at most 256 MiB,
or ``MPIDIST_SHM_NODE_BYTES``): each rank may hold its share of it (the budget over the
node's ranks) across its groups; a group whose ranks have less room left takes smaller
chunks, and one without room for the smallest keeps MPI's calls.

Example (``mpiexec -n 2``, after ``init_process_group``): an all_reduce of 4 MiB takes
this path where the group measured it faster than MPI's call (``shm_choice.py``)::

    >>> x = np.ones(1 << 20, np.float32)
    >>> dist.all_reduce(x); x[:2]
    array([2., 2.], dtype=float32)
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import platform
import secrets
import socket
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from mpi4py import MPI

from .._validate import c_extension_refused
from .._world import world
from ..errors import DistBackendError
from ..reduce_op import OP_TABLE, Post, Prim, RedOpType, divide_average, from_order_keys, to_order_keys
from ..work import poll
from . import shm_tuning, ulfm
from .mpi_types import TypeEntry

if TYPE_CHECKING:
    from .node_leaders import NodeLeaders

_log = logging.getLogger("mpidist")

try:  # the POSIX shared-memory calls multiprocessing.shared_memory uses (no resource tracker here)
    import _posixshmem
except ImportError:  # pragma: no cover - not a POSIX system
    _posixshmem = None

__all__ = ["SharedPath", "SharedOp", "Reducer", "CHUNK", "MIN_CHUNK", "chunk_for", "shm_status"]

#: bytes of a message per chunk and slot (measured on 2 ranks, 4 and 64 MiB all_reduce: 256 KiB chunks
#: took 1.2x the time of 1 MiB ones, 2 MiB ones 0.95-1.05x; 1 MiB keeps the segment small)
CHUNK = 1 << 20
#: the smallest chunk a group takes where the node's budget leaves less room (below it: MPI's calls)
MIN_CHUNK = 64 << 10
#: per rank: four counters a cache line apart (deposited, combined, collected, attached), then the slots and
#: result areas. Each rank's region is whole pages: with regions of other sizes one rank's counters shared a
#: page (and lines nearby) with the other rank's result area, and depositing 2 MiB took 0.93 ms instead of
#: 0.07 in 3 launches of 4 (AMD EPYC). Slots and result areas start half a page into a page, away from the
#: page offsets large arrays have (0 to 64 bytes).
_HEADER = 2048
_PAGE = 4096
#: A ufunc writing ``out`` while it reads a source that lies 1 to this many bytes before ``out`` modulo a page
#: stalls on every store (the same 4K aliasing): reduce_scatter_tensor into an output numpy's allocator
#: placed 32 bytes past a page multiple from the input took 1.17 ms for 4 MiB instead of 0.21 (AMD EPYC).
#: Such a reduction runs into a scratch buffer placed clear of every source, then is copied out.
_ALIAS_WINDOW = 1024
_DEPOSITED, _COMBINED, _COLLECTED, _ATTACHED = 0, 64, 128, 192
#: also in each rank's header: its pid and the address of its probe word (written once, before it attaches), and
#: per slot parity the address of the array a one-copy operation's chunk reads from it (written before the deposit
#: counter that announces it)
_PID, _PROBE, _ADDRESS = 256, 264, 320
#: A blocking call waits for the next phase in C (``_shm.await_any``, GIL released) for up to this long (ns) per
#: test; with more ranks than cores it yields the CPU between looks. ``poll`` counts each such wait as one test:
#: it looks at the clock and answers the stall diagnosis every 64 tests (16 with more ranks than cores, after
#: 144 first), so these stay short: 64 x 50 us = 3.2 ms, 16 x 200 us = 3.2 ms. (10 ms, as the direct calls
#: wait in C once, made a timeout 1.4 s late at 3 ranks on 2 cores: the first clock check came 144 tests in.)
SPINNING_WAIT_NS = 50_000
YIELDING_WAIT_NS = 200_000

_UFUNCS = {
    Prim.SUM: np.add, Prim.PROD: np.multiply, Prim.MIN: np.minimum, Prim.MAX: np.maximum,
    Prim.BAND: np.bitwise_and, Prim.BOR: np.bitwise_or, Prim.BXOR: np.bitwise_xor,
    Prim.LAND: np.logical_and, Prim.LOR: np.logical_or, Prim.LXOR: np.logical_xor,
}  # fmt: skip


def _counters() -> tuple[Callable[[int, int], None], Callable[[int, int, int], int], Any, Any, str]:
    """``(publish, least, await_any, read_from, why not)``: the C counters, or ctypes ones where the CPU keeps
    order (x86-64), which have no ``await_any`` (None: a blocking call's wait tests from Python) and no
    ``read_from`` (None: no one-copy variant)."""
    refused = c_extension_refused()
    if not refused:
        try:
            from . import _shm

            return _shm.publish, _shm.least, _shm.await_any, _shm.read_from, ""
        except ImportError:
            refused = "the C module mpidist.backends._shm was not built"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        why = f"{refused}, and this CPU ({platform.machine()}) reorders memory accesses"
        return _no_publish, _no_least, None, None, why
    import ctypes

    cell = ctypes.c_int64.from_address

    def publish(address: int, value: int) -> None:
        cell(address).value = value

    def least(address: int, count: int, stride: int) -> int:
        return min(cell(address + k * stride).value for k in range(count))

    return publish, least, None, None, ""


def _no_publish(address: int, value: int) -> None:  # pragma: no cover - the path is off where these are chosen
    raise RuntimeError("no ordered counters on this CPU")


def _no_least(address: int, count: int, stride: int) -> int:  # pragma: no cover
    raise RuntimeError("no ordered counters on this CPU")


_publish, _least, _await_any, _read_from, _COUNTERS_MISSING = _counters()


def shm_status() -> str:
    """Why the shared-memory path cannot run in this process ('' if it can; ``MPIDIST_SHM`` aside)."""
    if _posixshmem is None:  # pragma: no cover
        return "this Python has no POSIX shared memory (_posixshmem)"
    return _COUNTERS_MISSING


def _node_key() -> int:
    """A number that differs between hosts (and between IPC/mount namespaces of one host), 62 bits."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    for ns in ("ipc", "mnt"):
        try:
            parts.append(f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}")
        except OSError:
            pass
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


#: a reducer not made yet (SharedPath.reducer)
_UNSET: Any = object()


class Reducer:
    """How the shared-memory path reduces one dtype with one op: ``deposit``, ``reduce``, ``finish``."""

    __slots__ = ("ufunc", "keys", "kdt", "mop", "mtype", "divide", "n", "label", "routes")

    def __init__(self, ufunc: Any, keys: Prim | None, kdt: Any, mop: Any, mtype: Any, divide: Any, n: int) -> None:
        self.ufunc = ufunc  # numpy's loop (on values, or on order keys)
        self.keys = keys  # Prim.MIN/MAX: every rank deposits order keys, the reducer turns them back
        self.kdt = kdt  # the keys' integer dtype
        self.mop, self.mtype = mop, mtype  # mpidist's C op (float16/bfloat16) and the datatype it is called with
        self.divide = divide  # AVG's division of the sum, or None
        self.n = n
        self.label = ""  # the dtype and op, for the log of the choices (set by SharedPath.reducer)
        self.routes: dict[str, list[Any]] = {}  # per collective, its size classes (shm_choice.py)

    @classmethod
    def of(cls, e: TypeEntry, op: Any, n: int) -> Reducer | None:
        """The reducer of ``op`` on ``e``'s dtype, or None where MPI's path must run it (PREMUL_SUM, an invalid op)."""
        if type(op) is not RedOpType:
            return None
        entry = OP_TABLE[e.info.kind][op]
        if entry is None:
            return None  # MPI's path raises the error
        prim, post = entry
        if post is Post.PREMUL:
            return None
        divide = None
        if post is Post.AVG:
            divide = e.half.divide if e.half is not None else (lambda a, k: divide_average(a, k, np))
        if e.half is not None:
            mop = e.fast[RedOpType.SUM if post is Post.AVG else op]
            return None if mop is None else cls(None, None, None, mop, e.mpi, divide, n)
        if e.wide is not None:  # pragma: no cover - a library that cannot reduce this float natively
            return None
        if post is Post.KEYS:
            kdt = np.dtype(f"i{e.info.dtype.itemsize}")
            return cls(_UFUNCS[prim], prim, kdt, None, None, None, n)
        return cls(_UFUNCS[prim], None, None, None, None, divide, n)

    def deposit(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Put ``src`` where the reducing rank reads it: a copy, or its order keys."""
        if self.keys is None:
            np.copyto(dst, src)
        else:
            to_order_keys(src, dst, self.keys, np)

    def reduce(self, dst: np.ndarray, sources: list[np.ndarray]) -> None:
        """``dst = sources[0] op sources[1] op ...`` in that order, then AVG's division or the keys turned back."""
        if self.mop is not None:
            np.copyto(dst, sources[0])
            for s in sources[1:]:  # the C op computes dst = s op dst: commutative, exactly
                self.mop.Reduce_local([s, self.mtype], [dst, self.mtype])
        else:
            ufunc = self.ufunc
            if self.keys is not None:
                kdt = self.kdt
                out, sources = dst.view(kdt), [s.view(kdt) for s in sources]
            else:
                out = dst
            with np.errstate(all="ignore"):  # overflow to inf is a result, as in MPI
                ufunc(sources[0], sources[1], out=out)
                for s in sources[2:]:
                    ufunc(out, s, out=out)
            if self.keys is not None:
                from_order_keys(out, dst.dtype, self.keys, np)
                return
        if self.divide is not None:
            self.divide(dst, self.n)

    @property
    def own_in_place(self) -> bool:
        """Whether the reducing rank reads its own part where it is (not for keys: those are deposited)."""
        return self.keys is None


class SharedPath:
    """One group's shared segment: the ranks' regions, their counters, and the queue of operations."""

    #: the measuring's way for this path (shm_choice.py); the one-copy variant is ONE_COPY
    way = shm_tuning.SHARED

    def __init__(
        self,
        rank: int,
        size: int,
        mem: mmap.mmap,
        limits: dict[str, shm_tuning.Range],
        fixed: frozenset[str] = frozenset(),
        prior: dict[str, shm_tuning.Range] | None = None,
        chunk: int = CHUNK,
    ) -> None:
        self.rank, self.size = rank, size
        self.chunk = chunk  # bytes of a message per chunk and slot (chunk_for: what the node's budget allows)
        # the collectives MPIDIST_SHM_THRESHOLDS fixes, and the sizes (from, up to) at which each comes here
        # (agreed by every rank); the others are measured (shm_choice.py) from SETUP_FLOOR on
        self.fixed = fixed
        self.limits = limits
        self.prior = prior or {}  # the --tune table's ranges, agreed: a prior of the measuring
        self.smallest = min(low if name in fixed else shm_tuning.SETUP_FLOOR for name, (low, _) in limits.items())
        self.host_from = self.smallest  # device arrays from this size are staged: the path reads host memory
        self.routes: dict[str, list[Any]] = {}  # broadcast's and all_gather_into_tensor's size classes (shm_choice)
        self.per, self.result_bytes = _region_sizes(size, chunk)  # one rank's region (whole pages), a result area
        # how long a blocking call's wait stays in C (SharedOp.spin) before poll looks at the clock again
        self.wait_ns = -YIELDING_WAIT_NS if world.init_info.oversubscribed else SPINNING_WAIT_NS
        self.mem = mem
        self.share = len(mem) // size  # this rank's part of the node's budget (shm_tuning.node_budget)
        world.shm_share += self.share
        self.bytes = np.frombuffer(mem, np.uint8)
        self.base = self.bytes.ctypes.data
        self.mine = self.base + rank * self.per
        self.chunks = 0  # chunks issued on this path so far (the same on every rank)
        self.queue: deque[SharedOp] = deque()
        # Test() may run in another thread than the call that issued the operation (the torch backend's
        # progress thread completes Works): one thread at a time advances the queue
        self.lock = threading.Lock()
        self._scratch = np.empty(chunk + 2 * _PAGE, np.uint8)  # see reduce_into
        self._scratch_page = (-self._scratch.ctypes.data) % _PAGE
        self._views: dict[np.dtype, tuple[list[list[np.ndarray]], list[list[np.ndarray]]]] = {}
        # a word the other ranks read with read_from at set-up (_agree_one_copy); whether they all could
        self._probe = np.zeros(1, np.int64)
        self._nonce = 0
        self.one_copy = False
        self._reducers: dict[TypeEntry, list[Any]] = {}

    # -- set-up ---------------------------------------------------------------------------------------
    @classmethod
    def setup(cls, backend: Any, fn: str) -> SharedPath | NodeLeaders | None:
        """Agree with the group's other ranks whether and from which sizes to use shared memory; map it.

        Called by every rank in the same call (the first of at least ``SETUP_FLOOR`` bytes). One
        nonblocking MPI_Iallreduce, polled within the group's timeout, carries each rank's
        consent, its node's key and its size ranges, and rank 0's segment name; a rank that does
        not come makes the call time out as any collective would. Returns None where the path is
        off (a rank refuses, one rank); where the ranks span nodes, the node-leader path
        (``node_leaders.py``) where every rank consents and a node holds two of them, else None.
        """
        comm, rank, size = backend.comm, backend.rank, backend.size
        library = MPI.Get_library_version().splitlines()[0] if MPI.Get_library_version() else ""
        # under ULFM MPI's calls report a dead member at once; a wait on shared counters would only time out
        willing = size > 1 and shm_tuning.enabled() and not shm_status() and not ulfm.enabled()
        leaders = size > 2 and shm_tuning.leaders_enabled() and not ulfm.enabled()  # where the ranks span nodes
        fixed = shm_tuning.overrides()
        prior = shm_tuning.prior(size, library)
        # this rank's room: its part of the node's budget, less what its other groups' segments hold
        budget = shm_tuning.node_budget() if willing else 0
        room = budget // max(1, world.init_info.node_size) - world.shm_share
        chunk = chunk_for(size, room) if willing else 0
        if willing and not chunk:
            willing = False
            _log.warning(
                "%s: group %s keeps MPI's calls: rank %d has %.1f MiB left of its part of the node's shared-memory "
                "budget (%.1f MiB over %d ranks; MPIDIST_SHM_NODE_BYTES), less than the %.1f MiB a group of %d "
                "ranks needs at the least", fn, backend.group_name or "default", rank, max(room, 0) / 2**20,
                budget / 2**20, world.init_info.node_size, _region_sizes(size, MIN_CHUNK)[0] / 2**20, size,
            )  # fmt: skip
        per = _region_sizes(size, chunk)[0] if chunk else 0
        name, mem, nonce = "", None, 0
        if willing and rank == 0:
            nonce = secrets.randbits(62)
            name = f"/mpidist-{os.getpid()}-{nonce:x}"
            try:
                mem = _create(name, size * per)
            except OSError as exc:
                willing, name = False, ""
                _log.warning(
                    "%s: group %s keeps MPI's calls: no room for %.1f MiB of shared memory for %d ranks (%s)",
                    fn, backend.group_name or "default", size * per / 2**20, size, exc,
                )  # fmt: skip
        key = _node_key()
        # per collective: fixed anywhere; MAX of the fixed lows, MIN of their highs; the same of the priors
        ranges = []
        for c in shm_tuning.COLLECTIVES:
            low, high = fixed.get(c, (shm_tuning.SETUP_FLOOR, shm_tuning.NEVER))
            ranges += [int(c in fixed), low, -high, prior[c][0], -prior[c][1]]
        # the chunk: the smallest any rank has room for (MAX of the negatives); the segment's, rank 0's
        chunks = [-chunk, chunk if name else 0]
        mine = np.array(
            [-int(willing), key, -key, os.getpid() if name else 0, nonce, *chunks, -int(leaders), *ranges], np.int64
        )
        agreed = np.zeros_like(mine)
        try:
            req = comm.Iallreduce(mine, agreed, MPI.MAX)
            if not req.Test() and not poll(
                req.Test, backend.timeout_s, backend.spins, (backend.group_name, fn, backend.seq)
            ):
                backend.keep_stuck([req], (mine, agreed))
                raise backend.timeout_failure(fn, backend.seq, backend.timeout_s)
        except BaseException:
            if name:
                _unlink(name)
            raise
        ends = [int(v) for v in agreed[8:]]
        cols = list(enumerate(shm_tuning.COLLECTIVES))
        limits = {c: (ends[5 * i + 1], -ends[5 * i + 2]) for i, c in cols}
        fixed = frozenset(c for i, c in cols if ends[5 * i])
        if agreed[0] != -1 or agreed[1] != -agreed[2]:  # someone refused, or not every rank is on this node
            if name:
                _unlink(name)
            if agreed[1] != -agreed[2] and agreed[7] == -1:  # the ranks span nodes, and all may take node leaders
                from .node_leaders import NodeLeaders

                return NodeLeaders.setup(backend, fn, key, limits, fixed)
            return None
        name = name or f"/mpidist-{int(agreed[3])}-{int(agreed[4]):x}"
        chunk, made = -int(agreed[5]), int(agreed[6])  # made >= chunk: a rank with less room asks for less
        try:
            if mem is None:
                mem = _attach(name, size * _region_sizes(size, made)[0])
        except OSError as exc:
            raise DistBackendError(
                f"{fn}: rank {rank} of group {backend.group_name or 'default'} could not map the group's shared "
                f"memory {name} ({exc}); set MPIDIST_SHM=0 to use MPI's calls only"
            ) from exc
        prior = {c: (ends[5 * i + 3], -ends[5 * i + 4]) for i, c in cols if ends[5 * i + 3] < shm_tuning.NEVER}
        path = cls(rank, size, mem, limits, fixed, prior, chunk)
        path._announce(int(agreed[4]))
        _publish(path.mine + _ATTACHED, 1)
        try:  # every rank has mapped it (or the wait ran out): rank 0 unlinks the name
            if not poll(
                lambda: _least(path.base + _ATTACHED, size, path.per) >= 1,
                backend.timeout_s, backend.spins, (backend.group_name, fn, backend.seq),
            ):  # fmt: skip
                raise backend.timeout_failure(fn, backend.seq, backend.timeout_s)
        finally:
            if rank == 0:
                _unlink(name)
        path.one_copy = path._agree_one_copy(backend, fn)
        return path

    def _announce(self, nonce: int) -> None:
        """Write this rank's pid and its probe word's address into its header (before it attaches); the word
        holds a value made of the pid, the rank and the segment's ``nonce``, which a process read by mistake
        (ranks in different PID namespaces see other processes under the pids written here) does not hold."""
        self._nonce = nonce
        self._probe[0] = _probe_value(os.getpid(), self.rank, nonce)
        _publish(self.mine + _PID, os.getpid())
        _publish(self.mine + _PROBE, self._probe.ctypes.data)

    def _agree_one_copy(self, backend: Any, fn: str) -> bool:
        """Whether every rank read every other rank's probe word with ``read_from`` (the kernel may forbid it:
        Yama's ptrace_scope, a container's seccomp filter, another user): one Iallreduce (MIN) of each rank's
        answer, polled within the group's timeout. The one-copy variant is measured only where it is True."""
        ok = _read_from is not None and shm_tuning.one_copy_enabled()
        got = np.zeros(1, np.int64)
        for k in range(self.size):
            if not ok:
                break
            if k == self.rank:
                continue
            at = self.base + k * self.per
            pid = _least(at + _PID, 1, self.per)
            try:
                _read_from(pid, _least(at + _PROBE, 1, self.per), got.ctypes.data, 8)
            except OSError as exc:
                _log.info("%s: group %s, rank %d: no one-copy variant: reading rank %d's memory failed (%s)",
                          fn, backend.group_name or "default", self.rank, k, exc)  # fmt: skip
                ok = False
            else:
                ok = int(got[0]) == _probe_value(pid, k, self._nonce)
        mine, agreed = np.array([int(ok)], np.int64), np.zeros(1, np.int64)
        req = backend.comm.Iallreduce(mine, agreed, MPI.MIN)
        if not req.Test() and not poll(req.Test, backend.timeout_s, backend.spins, (backend.group_name, fn, backend.seq)):
            backend.keep_stuck([req], (mine, agreed))
            raise backend.timeout_failure(fn, backend.seq, backend.timeout_s)
        return bool(agreed[0])

    def release(self) -> None:
        """Give this rank's part of the segment back to the node's budget (the group is being freed)."""
        world.shm_share -= self.share
        self.share = 0

    # -- what the collectives use ---------------------------------------------------------------------
    def views(self, dtype: np.dtype) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
        """Per rank and slot: the slot and the result area as arrays of ``dtype`` (made once per dtype)."""
        got = self._views.get(dtype)
        if got is None:
            slots, results = [], []
            isz = dtype.itemsize
            for k in range(self.size):
                at = k * self.per + _HEADER
                c = self.chunk
                slots.append([self.bytes[at + p * c : at + (p + 1) * c].view(dtype) for p in (0, 1)])
                at += 2 * c
                rb = self.result_bytes // isz * isz
                results.append(
                    [self.bytes[at + p * self.result_bytes : at + p * self.result_bytes + rb].view(dtype) for p in (0, 1)]
                )
            got = self._views[dtype] = (slots, results)
        return got

    def reducer(self, e: TypeEntry, op: Any) -> Reducer | None:
        """The reducer of ``op`` on ``e``'s dtype (cached), or None: MPI's path runs that reduction."""
        if type(op) is not RedOpType:
            return None  # an op with data (PREMUL_SUM) or not an op: MPI's path
        per_op = self._reducers.get(e)  # by the dtype's TypeEntry (one per dtype in the group's type table)
        if per_op is None:
            per_op = self._reducers[e] = [_UNSET] * len(RedOpType)
        r = per_op[op]  # a list indexed by the op: hashing an IntEnum member costs a Python call
        if r is _UNSET:
            r = per_op[op] = Reducer.of(e, op, self.size)
            if r is not None:
                r.label = f"{e.info.dtype.name} {op.name.lower()}"
        return r

    def reduce_into(self, r: Reducer, dst: np.ndarray, sources: list[np.ndarray]) -> None:
        """``r.reduce(dst, sources)``, through a scratch buffer where ``dst`` would alias a source (``_ALIAS_WINDOW``)."""
        addrs = [a.ctypes.data for a in sources]
        if not any(_aliases(dst.ctypes.data, a) for a in addrs):
            r.reduce(dst, sources)
            return
        start = self._scratch_page
        for offset in range(0, _PAGE, 256):
            if not any(_aliases(self._scratch.ctypes.data + start + offset, a) for a in addrs):
                start += offset
                break
        tmp = self._scratch[start : start + dst.nbytes].view(dst.dtype)
        r.reduce(tmp, sources)
        np.copyto(dst, tmp)

    def takes(self, fn: str, nbytes: int) -> bool:
        """Whether a call of ``fn`` on ``nbytes`` is in the range ``MPIDIST_SHM_THRESHOLDS`` fixed (every rank
        answers alike)."""
        low, high = self.limits[fn]
        return low <= nbytes <= high

    def issue(self, op: SharedOp) -> SharedOp:
        """Queue ``op`` behind the group's earlier operations and start it (without waiting)."""
        with self.lock:
            op.base = self.chunks
            self.chunks += op.nchunks
            self.queue.append(op)
        op.Test()
        return op

    def all_reduce(self, x: np.ndarray, r: Reducer) -> SharedOp:
        return self.issue(_AllReduce(self, _flat(x), r, None))

    def reduce(self, x: np.ndarray, r: Reducer, root: int) -> SharedOp:
        return self.issue(_AllReduce(self, _flat(x), r, root))

    def broadcast(self, x: np.ndarray, root: int, one_copy: bool = False) -> SharedOp:
        """Broadcast through the slots, or (``one_copy``, where ``self.one_copy``) each rank reading the root's
        array straight from its memory."""
        kind = _OneCopyBroadcast if one_copy else _Broadcast
        return self.issue(kind(self, _flat(x), root))

    def all_gather(self, out: np.ndarray, inp: np.ndarray | None, one_copy: bool = False) -> SharedOp:
        """all_gather_into_tensor through the slots, or (``one_copy``) each rank reading the others' inputs."""
        kind = _OneCopyAllGather if one_copy else _AllGather
        return self.issue(kind(self, _flat(out), inp))

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, r: Reducer) -> SharedOp:
        return self.issue(_ReduceScatter(self, _flat(out), _flat(inp), r))


def _probe_value(pid: int, rank: int, nonce: int) -> int:
    """What rank ``rank``'s probe word holds in the segment of ``nonce``: a number a misread is unlikely to give."""
    digest = hashlib.blake2b(f"{pid}:{rank}:{nonce}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _flat(x: np.ndarray) -> np.ndarray:
    """``x`` as one dimension, the same memory (the backend hands the path contiguous arrays only)."""
    if not x.flags.c_contiguous:  # pragma: no cover - a caller's bug, not a user's
        raise RuntimeError("the shared-memory path was handed a non-contiguous array")
    return x.reshape(-1)


def _aliases(out: int, source: int) -> bool:
    """Whether writing at address ``out`` while reading at ``source`` stalls on 4K aliasing."""
    return 0 < (out - source) % _PAGE <= _ALIAS_WINDOW


def _region_sizes(size: int, chunk: int) -> tuple[int, int]:
    """(bytes of one rank's region, bytes of one result area) for ``size`` ranks and ``chunk``: whole pages each."""
    result = -(-(chunk // size + 16) // _PAGE) * _PAGE
    return _HEADER + 2 * chunk + 2 * result + (_PAGE - _HEADER), result


def chunk_for(size: int, room: int) -> int:
    """The largest chunk (a power of two from :data:`MIN_CHUNK` to :data:`CHUNK`) whose region of a group of
    ``size`` ranks fits in ``room`` bytes (a rank's part of the segment); 0 where none does.

    Examples:
        >>> chunk_for(2, 8 << 20), chunk_for(32, 1 << 20), chunk_for(4, 100 << 10)
        (1048576, 262144, 0)
    """
    chunk = CHUNK
    while chunk >= MIN_CHUNK:
        if _region_sizes(size, chunk)[0] <= room:
            return chunk
        chunk //= 2
    return 0


def _create(name: str, nbytes: int) -> mmap.mmap:
    """A new segment of ``nbytes``, its memory reserved now (OSError where /dev/shm has no room for it).

    ``ftruncate`` alone makes a sparse file: on a small ``/dev/shm`` (a container's 64 MB, a
    tmpfs of a few MB) the first write past what is free then kills the process with SIGBUS,
    inside a collective. ``posix_fallocate`` reserves every page here, or fails with ENOSPC.
    """
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        _reserve(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    except OSError:
        _unlink(name)
        raise
    finally:
        os.close(fd)


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate the segment's pages (ENOSPC where they do not fit; a no-op where the call is missing)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # pragma: no cover - not on Linux
        return
    try:
        fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it: as before
            return
        raise


def _attach(name: str, nbytes: int) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_RDWR, 0o600)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink(name)
    except OSError:
        pass


class SharedOp:
    """One collective on a group's shared segment, as a request: ``Test()`` makes progress, never waits.

    Chunk ``g`` (numbered across the group's operations) goes through three phases on each rank,
    each announced by a counter: *deposit* (into slot ``g % 2``, once every rank has collected
    chunk ``g - 2`` from it), *combine* (once every rank has deposited ``g``, or the one rank whose
    deposit it reads: broadcast's source), *collect* (once every rank has combined ``g``; where an
    operation has no collect phase its combine ends the chunk). Subclasses say what each phase
    does; a phase may do nothing, but every rank raises every counter for every chunk.
    """

    __slots__ = ("path", "base", "nchunks", "a", "b", "c", "done")

    def __init__(self, path: SharedPath, nchunks: int) -> None:
        self.path = path
        self.base = 0
        self.nchunks = nchunks
        self.a = self.b = self.c = 0  # chunks deposited, combined, collected here
        self.done = False

    def Test(self, *_: Any) -> bool:  # noqa: N802 - MPI's request method, which Work and poll call
        """Advance the group's queue up to this operation; return True once it is complete. Never waits."""
        return self._progress(0)

    def spin(self) -> bool:
        """``Test()`` for a caller that waits for this operation: where no phase can move, wait in C (GIL
        released) for a counter that lets one move, for at most the path's ``wait_ns``, instead of returning.
        ``poll`` calls it in a loop as it calls ``Test``: the timeout and the stall diagnosis still act."""
        return self._progress(self.path.wait_ns)

    def _progress(self, wait_ns: int) -> bool:
        if self.done:
            return True
        with self.path.lock:
            queue = self.path.queue
            while queue:
                head = queue[0]
                if not head._advance(wait_ns):
                    return False
                queue.popleft()
                if head is self:
                    return True
        return self.done  # another thread completed it meanwhile

    #: whether the operation has a collect phase (all_reduce, reduce); without one, a rank's combine ends
    #: its chunk and the wait for every rank's combine is skipped
    collects = True

    def _gate(self) -> int:
        """The address of the deposit counters a combine waits for, and (in ``_gate_count``) how many."""
        return self.path.base + _DEPOSITED

    _gate_count = -1  # every rank's; a subclass waiting for one rank's deposit sets 1 (and _gate)

    def _advance(self, wait_ns: int = 0) -> bool:
        """Do every phase the counters allow; where none can move and ``wait_ns`` is not 0, wait in C
        (``_shm.await_any``) until one can or that time has passed (negative: yielding the CPU)."""
        path = self.path
        n, per, mine, base, count = path.size, path.per, path.mine, path.base, self.nchunks
        a, b, c, first = self.a, self.b, self.c, self.base
        gate, gates = self._gate(), (n if self._gate_count < 0 else self._gate_count)
        collects = self.collects
        while True:
            moved = False
            if a < count and a - c < 2 and _least(base + _COLLECTED, n, per) >= first + a - 1:
                self._deposit(a, (first + a) & 1)
                a += 1
                _publish(mine + _DEPOSITED, first + a)
                moved = True
            if b < a and _least(gate, gates, per) >= first + b + 1:
                self._combine(b, (first + b) & 1)
                b += 1
                _publish(mine + _COMBINED, first + b)
                if not collects:
                    c = b
                    _publish(mine + _COLLECTED, first + c)
                moved = True
            if c < b and _least(base + _COMBINED, n, per) >= first + c + 1:
                self._collect(c, (first + c) & 1)
                c += 1
                _publish(mine + _COLLECTED, first + c)
                moved = True
            if not moved:
                if c == count or not wait_ns or _await_any is None:
                    break
                # the three conditions above, as (counters, how many, target); 0 counters: not waited for
                may_deposit = a < count and a - c < 2
                if not _await_any(
                    per, wait_ns,
                    base + _COLLECTED, n if may_deposit else 0, first + a - 1,
                    gate, gates if b < a else 0, first + b + 1,
                    base + _COMBINED, n if c < b else 0, first + c + 1,
                ):  # fmt: skip
                    break
        self.a, self.b, self.c = a, b, c
        if c == count:
            self.done = True
        return self.done

    def _deposit(self, i: int, p: int) -> None:  # pragma: no cover - every subclass defines the three
        raise NotImplementedError

    def _combine(self, i: int, p: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def _collect(self, i: int, p: int) -> None:  # pragma: no cover
        raise NotImplementedError


def _bounds(m: int, n: int) -> list[int]:
    """Where each of ``n`` ranks' segments of a chunk of ``m`` elements starts (and the end)."""
    return [k * m // n for k in range(n + 1)]


class _AllReduce(SharedOp):
    """all_reduce, or reduce to ``root``: rank k reduces segment k of every chunk."""

    __slots__ = ("x", "r", "root", "elems", "slots", "results")

    def __init__(self, path: SharedPath, x: np.ndarray, r: Reducer, root: int | None) -> None:
        self.elems = path.chunk // x.itemsize
        super().__init__(path, -(-x.size // self.elems))
        self.x, self.r, self.root = x, r, root
        self.slots, self.results = path.views(x.dtype)

    def _chunk(self, i: int) -> tuple[int, list[int]]:
        lo = i * self.elems
        return lo, _bounds(min(self.x.size - lo, self.elems), self.path.size)

    def _deposit(self, i: int, p: int) -> None:
        lo, b = self._chunk(i)
        me, x, slot, r = self.path.rank, self.x, self.slots[self.path.rank][p], self.r
        for k in range(self.path.size):
            if k != me or not r.own_in_place:
                r.deposit(slot[b[k] : b[k + 1]], x[lo + b[k] : lo + b[k + 1]])

    def _combine(self, i: int, p: int) -> None:
        lo, b = self._chunk(i)
        me, x, r = self.path.rank, self.x, self.r
        s, e = b[me], b[me + 1]
        own = r.own_in_place
        sources = [x[lo + s : lo + e] if k == me and own else self.slots[k][p][s:e] for k in range(self.path.size)]
        result = self.results[me][p][: e - s]
        self.path.reduce_into(r, result, sources)
        if self.root is None or self.root == me:
            np.copyto(x[lo + s : lo + e], result)

    def _collect(self, i: int, p: int) -> None:
        me = self.path.rank
        if self.root is not None and self.root != me:
            return
        lo, b = self._chunk(i)
        x = self.x
        for k in range(self.path.size):
            if k != me:
                np.copyto(x[lo + b[k] : lo + b[k + 1]], self.results[k][p][: b[k + 1] - b[k]])


class _Broadcast(SharedOp):
    """broadcast: the source deposits each chunk, the others copy it out as soon as the source's is there."""

    __slots__ = ("x", "root", "elems", "slots")
    collects = False
    _gate_count = 1

    def _gate(self) -> int:
        return self.path.base + self.root * self.path.per + _DEPOSITED

    def __init__(self, path: SharedPath, x: np.ndarray, root: int) -> None:
        self.elems = path.chunk // x.itemsize
        super().__init__(path, -(-x.size // self.elems))
        self.x, self.root = x, root
        self.slots = path.views(x.dtype)[0]

    def _deposit(self, i: int, p: int) -> None:
        if self.path.rank == self.root:
            lo = i * self.elems
            hi = min(self.x.size, lo + self.elems)
            np.copyto(self.slots[self.root][p][: hi - lo], self.x[lo:hi])

    def _combine(self, i: int, p: int) -> None:
        if self.path.rank != self.root:
            lo = i * self.elems
            hi = min(self.x.size, lo + self.elems)
            np.copyto(self.x[lo:hi], self.slots[self.root][p][: hi - lo])

    def _collect(self, i: int, p: int) -> None:
        pass


class _AllGather(SharedOp):
    """all_gather_into_tensor: each rank deposits its input's chunk, every rank copies every one out.

    ``inp`` is None where the input already is this rank's block of ``out`` (in place).
    """

    __slots__ = ("out", "inp", "m", "elems", "slots", "in_place")
    collects = False

    def __init__(self, path: SharedPath, out: np.ndarray, inp: np.ndarray | None) -> None:
        self.in_place = inp is None
        self.m = out.size // path.size
        self.inp = out[path.rank * self.m : (path.rank + 1) * self.m] if inp is None else inp.reshape(-1)
        self.elems = path.chunk // out.itemsize
        super().__init__(path, -(-self.m // self.elems))
        self.out = out
        self.slots = path.views(out.dtype)[0]

    def _deposit(self, i: int, p: int) -> None:
        lo = i * self.elems
        hi = min(self.m, lo + self.elems)
        np.copyto(self.slots[self.path.rank][p][: hi - lo], self.inp[lo:hi])

    def _combine(self, i: int, p: int) -> None:
        lo = i * self.elems
        hi = min(self.m, lo + self.elems)
        me, m, out = self.path.rank, self.m, self.out
        for k in range(self.path.size):
            dst = out[k * m + lo : k * m + hi]
            if k != me:
                np.copyto(dst, self.slots[k][p][: hi - lo])
            elif not self.in_place:
                np.copyto(dst, self.inp[lo:hi])

    def _collect(self, i: int, p: int) -> None:
        pass


class _ReduceScatter(SharedOp):
    """reduce_scatter_tensor: rank k reduces block k; a chunk is one piece of every block."""

    __slots__ = ("out", "inp", "r", "m", "piece", "slots")
    collects = False

    def __init__(self, path: SharedPath, out: np.ndarray, inp: np.ndarray, r: Reducer) -> None:
        self.m = out.size
        self.piece = path.chunk // out.itemsize // path.size
        super().__init__(path, -(-self.m // self.piece))
        self.out, self.inp, self.r = out, inp, r
        self.slots = path.views(out.dtype)[0]

    def _deposit(self, i: int, p: int) -> None:
        lo = i * self.piece
        hi = min(self.m, lo + self.piece)
        me, m, q, slot, r = self.path.rank, self.m, self.piece, self.slots[self.path.rank][p], self.r
        for k in range(self.path.size):
            if k != me or not r.own_in_place:
                r.deposit(slot[k * q : k * q + hi - lo], self.inp[k * m + lo : k * m + hi])

    def _combine(self, i: int, p: int) -> None:
        lo = i * self.piece
        hi = min(self.m, lo + self.piece)
        me, m, q, r = self.path.rank, self.m, self.piece, self.r
        own = r.own_in_place
        sources = [
            self.inp[me * m + lo : me * m + hi] if k == me and own else self.slots[k][p][me * q : me * q + hi - lo]
            for k in range(self.path.size)
        ]
        self.path.reduce_into(r, self.out[lo:hi], sources)

    def _collect(self, i: int, p: int) -> None:
        pass


class _OneCopyBroadcast(SharedOp):
    """broadcast in one copy: the root announces its array's address, every other rank reads the whole message
    from the root's memory (``_shm.read_from``), and the root completes once every rank has read it."""

    __slots__ = ("x", "root")
    _gate_count = 1

    def _gate(self) -> int:
        return self.path.base + self.root * self.path.per + _DEPOSITED

    def __init__(self, path: SharedPath, x: np.ndarray, root: int) -> None:
        super().__init__(path, 1)
        self.x, self.root = x, root

    def _deposit(self, i: int, p: int) -> None:
        if self.path.rank == self.root:
            _publish(self.path.mine + _ADDRESS + 8 * p, self.x.ctypes.data)

    def _combine(self, i: int, p: int) -> None:
        path = self.path
        if path.rank != self.root and self.x.nbytes:
            _read(path, self.root, p, self.x.ctypes.data, self.x.nbytes)

    def _collect(self, i: int, p: int) -> None:
        pass  # the collect phase's wait (every rank has combined) is what keeps the root's array until all read it


class _OneCopyAllGather(SharedOp):
    """all_gather_into_tensor in one copy: each rank announces its input's address and reads every other rank's
    input straight into its output; each completes once every rank has read its input."""

    __slots__ = ("out", "inp", "m", "in_place")

    def __init__(self, path: SharedPath, out: np.ndarray, inp: np.ndarray | None) -> None:
        super().__init__(path, 1)
        self.in_place = inp is None
        self.m = out.size // path.size
        self.out = out
        self.inp = out[path.rank * self.m : (path.rank + 1) * self.m] if inp is None else _flat(inp)

    def _deposit(self, i: int, p: int) -> None:
        _publish(self.path.mine + _ADDRESS + 8 * p, self.inp.ctypes.data)

    def _combine(self, i: int, p: int) -> None:
        path, m, out = self.path, self.m, self.out
        nbytes = self.inp.nbytes
        for k in range(path.size):
            block = out[k * m : (k + 1) * m]
            if k != path.rank:
                if nbytes:
                    _read(path, k, p, block.ctypes.data, nbytes)
            elif not self.in_place:
                np.copyto(block, self.inp)

    def _collect(self, i: int, p: int) -> None:
        pass  # as _OneCopyBroadcast's: the wait for every rank's combine keeps this rank's input until all read it


def _read(path: SharedPath, k: int, p: int, into: int, nbytes: int) -> None:
    """Copy ``nbytes`` from the array rank ``k`` announced for slot parity ``p`` to address ``into``."""
    at = path.base + k * path.per
    try:
        _read_from(_least(at + _PID, 1, path.per), _least(at + _ADDRESS + 8 * p, 1, path.per), into, nbytes)
    except OSError as exc:
        raise DistBackendError(
            f"the shared-memory path's one-copy read of {nbytes} bytes from rank {k} failed ({exc}), although it "
            "worked when the group was set up; set MPIDIST_SHM=0 to use MPI's calls only"
        ) from exc
