"""The MPI backend's node-leader path: all_reduce in a group that spans hosts, node by node.

In a group whose ranks sit on several nodes, MPI's all_reduce may send each rank's data
over the network (a ring sends 2(n-1)/n of the message per rank, and every pair of ranks
on different nodes adjacent in the ring crosses the link). Here each node reduces its
ranks' arrays first, only one rank per node (its *leader*, the node's lowest rank in
the group) takes part in an all_reduce between nodes, and each leader then broadcasts
the result on its node:

1. ``Ireduce`` to the leader on the node's communicator,
2. ``Iallreduce`` among the leaders (the leaders' communicator; leaders only),
3. ``Ibcast`` from the leader on the node's communicator.

So the network carries one message per node where MPI's call may carry several, at the
price of two more steps within each node. Whether that pays depends on the network, the
library (MPICH's own all_reduce may already be node-aware) and the size: the group
measures it against MPI's call where the job runs and takes it only where it wins
(``shm_choice.py``, the way :data:`LEADERS`), as it does for the shared-memory path.

The path is made by ``SharedPath.setup`` when the group's ranks turn out to span nodes
(their node keys, ``shm._node_key``, differ), at least one node holds two of them, and
every rank consents (``MPIDIST_SHM`` and ``MPIDIST_SHM_LEADERS`` not 0, no ULFM). One
nonblocking ``Iallgather`` of the keys, within the group's timeout, tells every rank
every rank's node; then two ``Split`` calls make the node and leaders' communicators
(every rank has just come to the all-gather, so they cannot hang on a missing rank).

An operation is a request like MPI's (:class:`LeaderAllReduce`): ``Test()`` tests the
step in flight and posts the next one, and never waits. Steps are posted in the same
order on every rank (MPI requires it of collectives on one communicator): an operation
posts its first step only once the group's earlier operations have posted all theirs.

Only all_reduce of host (numpy) arrays, with an op MPI reduces (``TypeEntry.fast``),
takes this path; every other collective keeps MPI's call.

Example (``mpiexec -n 4`` over two hosts, two ranks each)::

    >>> x = np.ones(1 << 20, np.float32)
    >>> for _ in range(20):
    ...     dist.all_reduce(x)  # measured: node leaders or MPI's call, whichever is faster here
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

import numpy as np
from mpi4py import MPI

from ..reduce_op import RedOpType
from ..work import poll
from . import shm_tuning
from .mpi_types import TypeEntry

__all__ = ["NodeLeaders", "LeaderAllReduce", "LeaderReduction", "LEADERS", "enabled", "nodes_of"]

_log = logging.getLogger("mpidist")
#: the way of a measured call that takes this path (beside shm_tuning's MPI_CALL, SHARED, TRIAL, ONE_COPY)
LEADERS = shm_tuning.LEADERS
#: the collectives this path never runs (MPI's call runs them): fixed, so the measuring never looks at them
_NOT_HERE = frozenset(c for c in shm_tuning.COLLECTIVES if c != "all_reduce")


def enabled() -> bool:
    """Whether this process lets its groups that span nodes measure the node-leader path."""
    return shm_tuning.leaders_enabled()


def nodes_of(keys: list[int]) -> list[int]:
    """Each rank's node, numbered by the lowest rank on it (``keys``: every rank's node key, in rank order).

    Examples:
        >>> nodes_of([7, 9, 7, 9])
        [0, 1, 0, 1]
    """
    first: dict[int, int] = {}
    return [first.setdefault(k, r) for r, k in enumerate(keys)]


class LeaderReduction:
    """One dtype and op on the node-leader path: its MPI datatype and op, and its measured size classes."""

    __slots__ = ("mtype", "mop", "label", "routes")

    def __init__(self, mtype: MPI.Datatype, mop: MPI.Op, label: str) -> None:
        self.mtype, self.mop, self.label = mtype, mop, label
        self.routes: dict[str, list[Any]] = {}  # per collective, its size classes (shm_choice.py)


class NodeLeaders:
    """A group's node and leaders' communicators, and the queue of its operations on them."""

    #: the chooser's way for this path; no one-copy variant and no --tune prior here
    way = LEADERS
    one_copy = False
    prior: dict[str, shm_tuning.Range] = {}
    #: device arrays go to MPI's calls as they are (this path does not read host memory of its own)
    host_from = shm_tuning.NEVER

    def __init__(self, node: MPI.Comm, leaders: MPI.Comm | None, limits: dict[str, shm_tuning.Range],
                 fixed: frozenset[str], nodes: int) -> None:  # fmt: skip
        self.node = node  # this rank's node's ranks of the group (the leader is rank 0 here)
        self.leaders = leaders  # the leaders of every node (None on the other ranks)
        self.nodes = nodes
        self.limits = limits
        # every collective but all_reduce is fixed to MPI's call; all_reduce too, where MPIDIST_SHM_THRESHOLDS names it
        self.fixed = fixed | _NOT_HERE
        self.smallest = limits["all_reduce"][0] if "all_reduce" in fixed else shm_tuning.SETUP_FLOOR
        self.routes: dict[str, list[Any]] = {}
        self.queue: deque[LeaderAllReduce] = deque()
        self.issued = 0  # operations issued on the path (for tests and the benchmark)
        self.lock = threading.Lock()  # Test() may run in the torch backend's progress thread
        self._reductions: dict[tuple[TypeEntry, Any], LeaderReduction | None] = {}

    @classmethod
    def setup(cls, backend: Any, fn: str, key: int, limits: dict[str, shm_tuning.Range],
              fixed: frozenset[str]) -> NodeLeaders | None:  # fmt: skip
        """Learn every rank's node and make the node and leaders' communicators; None where no node holds two
        ranks (nothing to reduce within a node). Called by every rank of a group that spans nodes, in the same
        call, after every rank consented (``SharedPath.setup``)."""
        comm, rank, size = backend.comm, backend.rank, backend.size
        mine, keys = np.array([key], np.int64), np.zeros(size, np.int64)
        req = comm.Iallgather(mine, keys)
        if not req.Test() and not poll(req.Test, backend.timeout_s, backend.spins, (backend.group_name, fn, backend.seq)):
            backend.keep_stuck([req], (mine, keys))
            raise backend.timeout_failure(fn, backend.seq, backend.timeout_s)
        nodes = nodes_of([int(k) for k in keys])
        counts = np.bincount(nodes, minlength=size)
        if counts.max() < 2:
            return None
        # every rank came to the all-gather: the splits (blocking, no timeout in MPI) cannot wait for a missing one
        node = comm.Split(nodes[rank], rank)
        leader = node.Get_rank() == 0
        split = comm.Split(0 if leader else MPI.UNDEFINED, rank)
        leaders = split if leader else None
        path = cls(node, leaders, limits, fixed, int(np.count_nonzero(counts)))
        _log.info(
            "%s: group %s spans %d nodes (%s ranks each): all_reduce may reduce within each node and between "
            "the nodes' leaders", fn, backend.group_name or "default", path.nodes,
            "/".join(str(int(c)) for c in counts if c),
        )  # fmt: skip
        return path

    def release(self) -> None:
        """Free the node and leaders' communicators (the group is being freed and has nothing in flight)."""
        for c in (self.node, self.leaders):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
        self.node = self.leaders = None  # type: ignore[assignment]

    def reducer(self, e: TypeEntry, op: Any) -> LeaderReduction | None:
        """The reduction of ``op`` on ``e``'s dtype (cached), or None where MPI's path must run it (an op with data,
        one MPI has no op for)."""
        if type(op) is not RedOpType:
            return None
        got = self._reductions.get((e, op), False)
        if got is False:
            mop = e.fast[op]
            got = None if mop is None else LeaderReduction(e.mpi, mop, f"{e.info.dtype.name} {op.name.lower()}")
            self._reductions[(e, op)] = got
        return got

    def takes(self, fn: str, nbytes: int) -> bool:
        """Whether a call of ``fn`` on ``nbytes`` runs here where it is fixed (every rank answers alike)."""
        if fn in _NOT_HERE:
            return False
        low, high = self.limits[fn]
        return low <= nbytes <= high

    def all_reduce(self, x: np.ndarray, r: LeaderReduction) -> LeaderAllReduce:
        """Queue an all_reduce of ``x`` (contiguous, in place) behind the group's earlier operations; start it."""
        op = LeaderAllReduce(self, x, r)
        with self.lock:
            self.queue.append(op)
            self.issued += 1
        op.Test()
        return op


class LeaderAllReduce:
    """One all_reduce on the node-leader path, as a request: ``Test()`` advances it and never waits."""

    __slots__ = ("path", "steps", "step", "req", "posted", "done", "x")

    def __init__(self, path: NodeLeaders, x: np.ndarray, r: LeaderReduction) -> None:
        self.path = path
        self.x = x
        msg = [x, r.mtype]
        node, leaders = path.node, path.leaders
        steps = []
        if node.Get_size() > 1:
            if leaders is not None:
                steps.append(lambda: node.Ireduce(MPI.IN_PLACE, msg, r.mop, 0))
            else:
                steps.append(lambda: node.Ireduce(msg, None, r.mop, 0))
        if leaders is not None:
            steps.append(lambda: leaders.Iallreduce(MPI.IN_PLACE, msg, r.mop))
        if node.Get_size() > 1:
            steps.append(lambda: node.Ibcast(msg, 0))
        self.steps = steps
        self.step = -1  # the step in flight (-1: none posted yet)
        self.req: MPI.Request | None = None
        self.posted = False  # every step is posted: the next operation may post its first
        self.done = False

    def Test(self, *_: Any) -> bool:  # noqa: N802 - MPI's request method, which Work and poll call
        """Advance the group's operations, in order, up to this one; True once this one is complete."""
        if self.done:
            return True
        path = self.path
        with path.lock:
            for op in path.queue:
                op._advance()
                if not op.posted or op is self:
                    break
            queue = path.queue
            while queue and queue[0].done:
                queue.popleft()
        return self.done

    def _advance(self) -> None:
        while not self.done:
            if self.req is not None:
                if not self.req.Test():
                    return
                self.req = None
            self.step += 1
            if self.step == len(self.steps):
                self.done = True
                return
            self.req = self.steps[self.step]()
            self.posted = self.step == len(self.steps) - 1
