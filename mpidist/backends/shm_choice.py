"""Which path a large collective takes, chosen by measurement where the job runs.

For each collective the shared-memory path serves (``shm.py``), each dtype and op
(a reduction's :class:`~mpidist.backends.shm.Reducer`) and each size class (the powers
of two from ``shm_tuning.SETUP_FLOOR`` up: 16-32 KiB, 32-64 KiB, ...), a group's first
:data:`ROUND` calls alternate in blocks between the shared-memory path and MPI's own
call, which give the same results: :data:`WARM` + 1 calls on one, then as many on the
other, :data:`SAMPLES` blocks of each. broadcast and all_gather_into_tensor from
:data:`ONE_COPY_FLOOR` bytes, in a group whose ranks may read each other's memory
(``SharedPath.one_copy``), have a third way in the rotation, the path's one-copy
variant (``ONE_COPY``): then a round is half as long again. Each rank times the last call of each block where
that call is blocking, from its issue to its completion: the first calls of a block take
the switch, where another rank may still be finishing the previous call on the other
path (the source of a broadcast is done long before the others), so that the timed call
is one of a run of calls on the same path. An ``async_op`` call is issued on the path
under trial and returned at once, as any async call, and gives no timing (unless it is
complete before it returns): its completion is seen only when the program tests or waits,
which would time the program, and waiting for it would block the caller.

The next call of the class (the ``ROUND + 1``-th) issues the agreement, one small
nonblocking ``Iallreduce`` (MAX) of each rank's medians (0, which leaves the maximum to
the others, for a path this rank has no timing of), and takes MPI's call, as do the
next :data:`AGREE_LAG` - 1 calls; the call after them (the :data:`CHOSEN_AT` + 1-th)
waits for the agreement, within the group's timeout, and takes the path every rank then
computes: shared memory (of its variants, the one whose slowest rank's median is
lower) only where the slowest rank's median for it is at most
:data:`MARGIN` times MPI's (:data:`PRIOR_MARGIN` where the ``--tune`` table says shared
memory wins at that size: the table is a prior, not the last word), MPI's call where no
rank timed one of the paths. So no async call waits for the other ranks, except that
one, and it waits only for every rank to have issued the ``ROUND + 1``-th call of the
class, :data:`AGREE_LAG` calls earlier: it can block only a rank that has more than
:data:`AGREE_LAG` async calls of the class in flight, not waited for, ahead of a rank
that waits for it before making its own. Later calls of the class take the chosen path;
after :data:`RECHECK_FIRST` of them (then twice as many each time, up to
:data:`RECHECK_LAST`) the class is measured again.

Every rank counts the same calls (the sizes, dtypes and ops of a group's calls are the
same on every rank; whether a call is async never counts), so every rank measures, agrees
and switches at the same call: the path of a call never differs between ranks, whatever
each rank's clock said or which calls each made async. A rank that does not come to a
measured call or to the agreement makes the others raise the group's timeout with the
usual "who is where", as any collective would (in that call, or at the latest in the
call that applies the agreement).

``MPIDIST_SHM=0`` and ``MPIDIST_SHM_THRESHOLDS`` (``shm_tuning.py``) skip all this for
the collectives they name. ``MPIDIST_DEBUG=INFO`` logs each choice once per group and
class, with the timings behind it.

Example (``mpiexec -n 2``, ``MPIDIST_DEBUG=INFO``)::

    >>> x = np.ones(1 << 20, np.float32)
    >>> for _ in range(20):
    ...     dist.all_reduce(x)
    all_reduce float32 sum, 4-8 MiB, group default, rank 0: shared memory (slowest rank's median of up to 3 ...)
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from ..work import poll
from .shm_tuning import CLASSES, LEADERS, MPI_CALL, NEVER, ONE_COPY, SHARED, TRIAL, Range

__all__ = [
    "Chooser", "Route", "MPI_CALL", "SHARED", "ONE_COPY", "LEADERS", "TRIAL", "CLASSES", "WARM", "SAMPLES", "ROUND",
    "AGREE_LAG", "CHOSEN_AT", "MARGIN", "PRIOR_MARGIN", "ONE_COPY_FLOOR", "ONE_COPY_COLLECTIVES",
]  # fmt: skip

_log = logging.getLogger("mpidist")
_perf = time.perf_counter

#: calls of each block run untimed (the switch from the other path, and the first use of new memory)
WARM = 1
#: blocks of each path, interleaved, each with one timed call, before the ranks agree
SAMPLES = 3
#: the measured calls of a class: blocks of WARM + 1 calls, SAMPLES on each path
ROUND = 2 * SAMPLES * (WARM + 1)
#: calls of a class from the one that issues the agreement (the ROUND + 1-th, nonblocking) to the one that waits for
#: it and takes the choice; those between take MPI's call
AGREE_LAG = 4
#: the calls of a round before the first that takes the agreed choice: the measured ones, then AGREE_LAG
CHOSEN_AT = ROUND + AGREE_LAG
#: shared memory is chosen where the slowest rank's median for it is at most this times MPI's: it must win
#: clearly, since MPI's call is the one that is never worse than MPI
MARGIN = 0.9
#: ... or at most this where the ``--tune`` table (the prior) says shared memory wins at that size
PRIOR_MARGIN = 1.0
#: calls of a class between its choice and its next measurement; doubles after each, up to RECHECK_LAST
RECHECK_FIRST = 256
RECHECK_LAST = 1 << 14
#: the collectives with a one-copy variant, and the smallest size class that measures it: below, a system call
#: and the kernel's page walk cost more than the copy through the (cache-resident) slots saves
ONE_COPY_COLLECTIVES = frozenset({"broadcast", "all_gather_into_tensor"})
ONE_COPY_FLOOR = 256 << 10
#: a test hook: this rank's timings of (MPI's call, shared memory) are multiplied by these factors (the one-copy
#: variant's by the second, or by a third where given)
skew: tuple[float, ...] = (1.0, 1.0)
#: where each way's timings go in Route.times (a group has the shared-memory path or the node-leader one, not both)
_SLOT = {MPI_CALL: 0, SHARED: 1, LEADERS: 1, ONE_COPY: 2}
_NAMES = {MPI_CALL: "MPI", SHARED: "shared memory", ONE_COPY: "shared memory, one copy", LEADERS: "node leaders"}
_SHORT = {MPI_CALL: "MPI", SHARED: "shared memory", ONE_COPY: "one copy", LEADERS: "node leaders"}  # in the log


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def _median(t: list[float]) -> float:
    """The median of a few timings, 0 for none (np.median's first call in a process costs 10-40 ms)."""
    if not t:
        return 0.0
    s = sorted(t)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def _us(seconds: float) -> str:
    return "-" if seconds <= 0 else f"{seconds * 1e6:.1f} us"


def _best(order: tuple[int, ...], medians: list[float], margin: float) -> int:
    """The way of the lowest median among the shared-memory ways, where it is at most ``margin`` times MPI's
    (``medians`` of the ways in ``order``, ``Route.order``: MPI's first; 0 is no timing)."""
    t_mpi = medians[0]
    shared = [(t, w) for t, w in zip(medians[1:], order[1:]) if t > 0]
    if t_mpi <= 0 or not shared:
        return MPI_CALL
    t, w = min(shared)
    return w if t <= margin * t_mpi else MPI_CALL


class Route:
    """One size class of one collective (and dtype and op): its choice, or where its measuring stands."""

    __slots__ = (
        "fn", "label", "bits", "prior", "ways", "order", "round", "way", "chosen", "left", "interval", "calls", "times",
        "told", "agreement",
    )  # fmt: skip

    def __init__(
        self, fn: str, label: str, bits: int, prior: bool, one_copy: bool = False, way: int = SHARED
    ) -> None:
        self.fn, self.label, self.bits = fn, label, bits
        self.prior = prior  # the --tune table says shared memory wins here (agreed by every rank at set-up)
        # the measured ways, in the order of their blocks: the group's path first (shared memory, or node leaders
        # where it spans nodes), then MPI, then the one-copy variant
        self.ways = (way, MPI_CALL, ONE_COPY) if one_copy else (way, MPI_CALL)
        self.order = (MPI_CALL, *(w for w in self.ways if w != MPI_CALL))  # of the medians: MPI's first
        self.round = len(self.ways) * SAMPLES * (WARM + 1)  # the measured calls (ROUND for two ways)
        self.way = TRIAL  # what the calls take now: one of ``ways`` once chosen, TRIAL while measuring
        self.chosen = TRIAL  # the last choice (TRIAL before the first): a new one is logged where it differs
        self.left = 0  # calls until the next measuring (decided) or measured calls made (measuring)
        self.interval = RECHECK_FIRST
        self.calls = 0  # measured calls issued in this round
        self.times: tuple[list[float], ...] = ([], [], [])  # this rank's timings: MPI's call, shared memory, one copy
        self.told = False  # the choice was logged
        self.agreement: tuple[Any, np.ndarray, np.ndarray] | None = None  # the Iallreduce in flight and its buffers

    def add(self, way: int, seconds: float) -> None:
        """A timing of one measured call of ``way``."""
        k = _SLOT[way]
        self.times[k].append(seconds * skew[min(k, len(skew) - 1)])

    def medians(self) -> tuple[float, ...]:
        """This rank's medians per way, MPI's first (0 where a way has no timing: the other ranks' then decide)."""
        return tuple(_median(self.times[_SLOT[w]]) for w in self.order)

    def sizes(self) -> str:
        return f"{_size(1 << (self.bits - 1))}-{_size(1 << self.bits)}"

    def describe(self) -> str:
        if self.way == TRIAL:
            if self.calls > self.round:
                chosen_at = self.round + AGREE_LAG
                return f"measuring (agreeing: the choice from call {chosen_at + 1} of the round, now {self.calls})"
            return f"measuring ({self.calls} of {self.round} calls)"
        return _NAMES[self.way]


class Chooser:
    """A group's choices of path per collective, dtype and op, and size class (see the module docstring).

    ``backend`` is the group's ``MPIBackend`` (its communicator, timeout and call numbers);
    ``prior`` the agreed ``--tune`` ranges where shared memory won; ``one_copy`` whether the
    one-copy variant may be measured (every rank can read the others' memory); ``way`` the
    group's own path (``SHARED``, or ``LEADERS`` in a group that spans nodes).
    """

    def __init__(self, backend: Any, prior: dict[str, Range], one_copy: bool = False, way: int = SHARED) -> None:
        self.backend = backend
        self.prior = prior
        #: while a measured call runs again as the path it measures: its way (SHARED, ONE_COPY or MPI_CALL)
        self.trying: int | None = None
        self.pending: tuple[Route, int, bool] | None = None  # the measured call: its route, way, whether timed
        self.routes: list[Route] = []  # every route made, for shared_memory_choices()
        self.one_copy = one_copy  # the group's ranks may read each other's memory (SharedPath.one_copy)
        self.way = way

    def _route(self, table: list[Route | None], fn: str, label: str, bits: int) -> Route:
        low, high = self.prior.get(fn, (NEVER, NEVER))
        one_copy = self.one_copy and fn in ONE_COPY_COLLECTIVES and 1 << (bits - 1) >= ONE_COPY_FLOOR
        r = table[bits] = Route(fn, label, bits, low <= 1 << (bits - 1) <= high, one_copy, self.way)
        self.routes.append(r)
        return r

    def next(self, table: list[Route | None], fn: str, label: str, nbytes: int) -> int:
        """What this call of ``fn`` on ``nbytes`` takes: MPI_CALL, a path's way, or TRIAL (then ``pending`` says which
        route and path; the caller runs the call again as that path, through :meth:`measure`).

        Every rank calls it at the same call with the same arguments and gets the same answer (whether the call
        is async is not among them). Only the call that applies the agreement may wait for the others.
        """
        bits = nbytes.bit_length()
        r = table[bits] or self._route(table, fn, label, bits)
        if r.way != TRIAL:
            r.left -= 1
            if r.left > 0:
                return r.way
            r.way, r.calls, r.times = TRIAL, 0, ([], [], [])  # measure again
        if r.calls < r.round:
            block, at = divmod(r.calls, WARM + 1)
            self.pending = (r, r.ways[block % len(r.ways)], at == WARM)  # the ways in turn; a block's last timed
            r.calls += 1
            return TRIAL
        if r.calls < r.round + AGREE_LAG:  # the agreement is in flight: MPI's call meanwhile
            if r.calls == r.round:
                self._ask(r)
            r.calls += 1
            return MPI_CALL
        self._decide(r)
        return r.way

    def measure(self, again: Any, async_op: bool) -> Any:
        """Run the measured call ``pending`` names: ``again(True)`` issues it (async) as that path.

        A blocking call waits here (within the group's timeout, as any call) and is timed from its
        issue to its completion; an ``async_op`` one returns its Work at once and gives no timing
        (it is timed only where it completed before returning): how long the program takes to test
        or wait for it says nothing of the path, and waiting here would block its caller.
        """
        r, way, timed = self.pending  # type: ignore[misc]
        self.trying = way
        start = _perf()
        try:
            work = again(True)
        finally:
            self.trying = None
        if work is None:  # complete at once
            if timed:
                r.add(way, _perf() - start)
            return None
        if async_op:
            return work
        work.wait()
        if timed:
            r.add(way, _perf() - start)
        return None

    def _ask(self, r: Route) -> None:
        """Issue the agreement of ``r`` (nonblocking): the MAX over the ranks of their medians and of their priors'
        objections; :meth:`_decide` waits for it, :data:`AGREE_LAG` calls of the class later."""
        b = self.backend
        mine = np.array([*r.medians(), 0.0 if r.prior else 1.0], np.float64)
        agreed = np.zeros_like(mine)
        try:
            req = b.comm.Iallreduce(mine, agreed, MPI.MAX)
        except MPI.Exception as exc:
            raise b.backend_error(r.fn, b.seq, exc) from exc
        r.agreement = (req, mine, agreed)

    def _decide(self, r: Route) -> None:
        """Wait for the agreement on the slowest rank's medians (within the group's timeout); choose; log it."""
        b = self.backend
        fn = r.fn
        req, mine, agreed = r.agreement  # type: ignore[misc]
        r.agreement = None
        activity = (b.group_name, fn, b.seq)
        if not req.Test() and not poll(req.Test, b.timeout_s, b.spins, activity):
            b.keep_stuck([req], (mine, agreed))
            r.way, r.left = MPI_CALL, RECHECK_LAST  # the group is unusable now; no later call waits for it again
            raise b.timeout_failure(fn, b.seq, b.timeout_s)
        *slowest, no_prior = (float(v) for v in agreed)
        margin = MARGIN if no_prior else PRIOR_MARGIN
        way = _best(r.order, slowest, margin)
        changed = r.chosen != TRIAL and way != r.chosen
        r.way = r.chosen = way
        r.left = r.interval
        r.interval = min(2 * r.interval, RECHECK_LAST)
        if not r.told or changed:
            r.told = True
            here = r.medians()
            mine_way = _NAMES[_best(r.order, list(here), margin)]
            timed = ", ".join(f"{len(r.times[_SLOT[w]])}" for w in r.order)

            def each(medians: Any) -> str:
                return ", ".join(f"{_SHORT[w]} {_us(t)}" for w, t in zip(r.order, medians))

            _log.info(
                "%s, %s, group %s, rank %d: %s%s (slowest rank's median of up to %d timed calls each: %s; here: %s "
                "(of %s blocking calls timed), alone it would take %s; shared memory needs at most %.2fx MPI's "
                "time%s); measured again after %d calls",
                f"{fn} {r.label}".strip(), r.sizes(), b.group_name or "default", b.rank, r.describe(),
                " (changed)" if changed else "", SAMPLES, each(slowest), each(here), timed, mine_way, margin,
                ", the --tune table's prior" if not no_prior else "", r.left,
            )  # fmt: skip

    def settle(self, limit_s: float) -> bool:
        """Whether every agreement this rank has issued is complete, waiting for them up to ``limit_s`` (before the
        group's communicator is freed: an Iallreduce in flight must not be)."""
        b = self.backend
        for r in self.routes:
            if r.agreement is not None:
                req = r.agreement[0]
                if not req.Test() and not poll(req.Test, limit_s, b.spins):
                    return False
        return True

    def may_share(self, table: list[Route | None], nbytes: int) -> bool:
        """Whether calls of this class may take shared memory (not yet measured, or chosen); counts nothing."""
        r = table[nbytes.bit_length()]
        return r is None or r.way != MPI_CALL

    def choices(self) -> list[tuple[str, str, str, str]]:
        """(collective, dtype and op, sizes, what the calls take now) of every class met so far."""
        return [(r.fn, r.label, r.sizes(), r.describe()) for r in self.routes]
