"""Which path a large collective takes, chosen by measurement where the job runs.

For each collective the shared-memory path serves (``shm.py``), each dtype and op
(a reduction's :class:`~mpidist.backends.shm.Reducer`) and each size class (the powers
of two from ``shm_tuning.SETUP_FLOOR`` up: 16-32 KiB, 32-64 KiB, ...), a group's first
:data:`ROUND` calls alternate in blocks between the shared-memory path and MPI's own
call, which give the same results: :data:`WARM` + 1 calls on one, then as many on the
other, :data:`SAMPLES` blocks of each. Each rank times the last call of each block (issue
to completion; an ``async_op`` call until a test sees it complete): the first calls of a
block take the switch, where another rank may still be finishing the previous call on
the other path (the source of a broadcast is done long before the others), so that
the timed call is one of a run of calls on the same path. The next call of that class
agrees with the group's other ranks on one small ``Iallreduce`` (MAX)
of each rank's medians, within the group's timeout, and takes the path every rank then
computes: shared memory only where the slowest rank's median for it is at most
:data:`MARGIN` times MPI's (:data:`PRIOR_MARGIN` where the ``--tune`` table says shared
memory wins at that size: the table is a prior, not the last word). Later calls of the
class take that path; after :data:`RECHECK_FIRST` of them (then twice as many each time,
up to :data:`RECHECK_LAST`) the class is measured again.

Every rank counts the same calls (the sizes, dtypes and ops of a group's calls are the
same on every rank), so every rank measures, agrees and switches at the same call: the
path of a call never differs between ranks, whatever each rank's clock said. A rank that
does not come to a measured call or to the agreement makes the others raise the group's
timeout with the usual "who is where", as any collective would.

``MPIDIST_SHM=0`` and ``MPIDIST_SHM_THRESHOLDS`` (``shm_tuning.py``) skip all this for
the collectives they name. ``MPIDIST_DEBUG=INFO`` logs each choice once per group and
class, with the timings behind it.

Example (``mpiexec -n 2``, ``MPIDIST_DEBUG=INFO``)::

    >>> x = np.ones(1 << 20, np.float32)
    >>> for _ in range(10):
    ...     dist.all_reduce(x)
    all_reduce float32 sum, 4-8 MiB, group default: shared memory (slowest rank's median of 3 timed calls each: ...)
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from ..work import poll
from .shm_tuning import NEVER, Range

__all__ = ["Chooser", "Route", "MPI_CALL", "SHARED", "TRIAL", "WARM", "SAMPLES", "ROUND", "MARGIN", "PRIOR_MARGIN"]

_log = logging.getLogger("mpidist")
_perf = time.perf_counter

#: what a call takes: MPI's own call, the shared-memory path, or a measured call of either (see Chooser.next)
MPI_CALL, SHARED, TRIAL = 0, 1, 2
#: calls of each block run untimed (the switch from the other path, and the first use of new memory)
WARM = 1
#: blocks of each path, interleaved, each with one timed call, before the ranks agree
SAMPLES = 3
#: the measured calls of a class: blocks of WARM + 1 calls, SAMPLES on each path
ROUND = 2 * SAMPLES * (WARM + 1)
#: shared memory is chosen where the slowest rank's median for it is at most this times MPI's: it must win
#: clearly, since MPI's call is the one that is never worse than MPI
MARGIN = 0.9
#: ... or at most this where the ``--tune`` table (the prior) says shared memory wins at that size
PRIOR_MARGIN = 1.0
#: calls of a class between its choice and its next measurement; doubles after each, up to RECHECK_LAST
RECHECK_FIRST = 256
RECHECK_LAST = 1 << 14
#: the size classes: a call of n bytes is in class n.bit_length() (2**(k-1) <= n < 2**k)
CLASSES = 64
#: a test hook: this rank's timings of (MPI's call, shared memory) are multiplied by these factors
skew = (1.0, 1.0)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def _us(seconds: float) -> str:
    return "-" if seconds <= 0 else f"{seconds * 1e6:.1f} us"


class Route:
    """One size class of one collective (and dtype and op): its choice, or where its measuring stands."""

    __slots__ = ("fn", "label", "bits", "prior", "way", "left", "interval", "calls", "times", "told")

    def __init__(self, fn: str, label: str, bits: int, prior: bool) -> None:
        self.fn, self.label, self.bits = fn, label, bits
        self.prior = prior  # the --tune table says shared memory wins here (agreed by every rank at set-up)
        self.way = TRIAL  # what the calls take now: MPI_CALL or SHARED once chosen, TRIAL while measuring
        self.left = 0  # calls until the next measuring (decided) or measured calls made (measuring)
        self.interval = RECHECK_FIRST
        self.calls = 0  # measured calls issued in this round
        self.times: tuple[list[float], list[float]] = ([], [])  # this rank's timings: MPI's call, shared memory
        self.told = False  # the choice was logged

    def add(self, shared: bool, seconds: float) -> None:
        """A timing of one measured call (from the thread that saw it complete)."""
        self.times[shared].append(seconds * skew[shared])

    def medians(self) -> tuple[float, float]:
        """This rank's medians (0 where a path has no timing: the other ranks' then decide)."""
        return tuple(float(np.median(t)) if t else 0.0 for t in self.times)  # type: ignore[return-value]

    def sizes(self) -> str:
        return f"{_size(1 << (self.bits - 1))}-{_size(1 << self.bits)}"

    def describe(self) -> str:
        if self.way == TRIAL:
            return f"measuring ({self.calls} of {ROUND} calls)"
        return "shared memory" if self.way == SHARED else "MPI"


class _Timed:
    """A request (MPI's, or a ``shm.SharedOp``) whose first successful test records the call's time."""

    __slots__ = ("req", "route", "shared", "start")

    def __init__(self, req: Any, route: Route, shared: bool, start: float) -> None:
        self.req, self.route, self.shared, self.start = req, route, shared, start

    def Test(self, *args: Any) -> bool:  # noqa: N802 - MPI's request method, which Work and poll call
        if not self.req.Test(*args):
            return False
        if self.route is not None:
            self.route.add(self.shared, _perf() - self.start)
            self.route = None
        return True

    def Cancel(self) -> None:  # noqa: N802 - as MPI's request
        self.req.Cancel()


class Chooser:
    """A group's choices of path per collective, dtype and op, and size class (see the module docstring).

    ``backend`` is the group's ``MPIBackend`` (its communicator, timeout and call numbers);
    ``prior`` the agreed ``--tune`` ranges where shared memory won.
    """

    def __init__(self, backend: Any, prior: dict[str, Range]) -> None:
        self.backend = backend
        self.prior = prior
        #: while a measured call runs again as the path it measures: True (shared memory) or False (MPI)
        self.trying: bool | None = None
        self.pending: tuple[Route, bool, bool] | None = None  # the measured call: its route, path, whether timed
        self.routes: list[Route] = []  # every route made, for shared_memory_choices()

    def _route(self, table: list[Route | None], fn: str, label: str, bits: int) -> Route:
        low, high = self.prior.get(fn, (NEVER, NEVER))
        r = table[bits] = Route(fn, label, bits, low <= 1 << (bits - 1) <= high)
        self.routes.append(r)
        return r

    def next(self, table: list[Route | None], fn: str, label: str, nbytes: int) -> int:
        """What this call of ``fn`` on ``nbytes`` takes: MPI_CALL, SHARED, or TRIAL (then ``pending`` says which
        route and path; the caller runs the call again as that path, through :meth:`measure`).

        Every rank calls it at the same call with the same arguments and gets the same answer.
        """
        bits = nbytes.bit_length()
        r = table[bits] or self._route(table, fn, label, bits)
        if r.way != TRIAL:
            r.left -= 1
            if r.left > 0:
                return r.way
            r.way, r.calls, r.times = TRIAL, 0, ([], [])  # measure again
        if r.calls < ROUND:
            block, at = divmod(r.calls, WARM + 1)
            self.pending = (r, not block & 1, at == WARM)  # shared memory first, then MPI, ...; the last one timed
            r.calls += 1
            return TRIAL
        self._decide(r)
        return r.way

    def measure(self, again: Any, async_op: bool) -> Any:
        """Run the measured call ``pending`` names: ``again(True)`` issues it (async) as that path; time it.

        A blocking call waits here (within the group's timeout, as any call); an ``async_op`` one
        returns its Work, whose first successful test records the time.
        """
        r, shared, timed = self.pending  # type: ignore[misc]
        self.trying = shared
        start = _perf()
        try:
            work = again(True)
        finally:
            self.trying = None
        if work is None:  # complete at once
            if timed:
                r.add(shared, _perf() - start)
            return None
        if timed:
            work._reqs = [_Timed(work._reqs[0], r, shared, start)]
        if async_op:
            return work
        work.wait()
        return None

    def _decide(self, r: Route) -> None:
        """Agree with the group's other ranks on the slowest rank's medians; choose; log it."""
        b = self.backend
        fn = r.fn
        mine = np.array([*r.medians(), 0.0 if r.prior else 1.0], np.float64)
        agreed = np.zeros_like(mine)
        activity = (b.group_name, fn, b.seq)
        try:
            req = b.comm.Iallreduce(mine, agreed, MPI.MAX)
        except MPI.Exception as exc:
            raise b.backend_error(fn, b.seq, exc) from exc
        if not req.Test() and not poll(req.Test, b.timeout_s, b.spins, activity):
            b.keep_stuck([req], (mine, agreed))
            raise b.timeout_failure(fn, b.seq, b.timeout_s)
        t_mpi, t_shm, no_prior = (float(v) for v in agreed)
        margin = MARGIN if no_prior else PRIOR_MARGIN
        way = SHARED if t_mpi > 0 and 0 < t_shm <= margin * t_mpi else MPI_CALL
        changed = way != r.way and r.told
        r.way = way
        r.left = r.interval
        r.interval = min(2 * r.interval, RECHECK_LAST)
        if not r.told or changed:
            r.told = True
            here_mpi, here_shm = r.medians()
            mine_way = "shared memory" if 0 < here_shm <= margin * here_mpi else "MPI"
            _log.info(
                "%s, %s, group %s, rank %d: %s%s (slowest rank's median of %d timed calls each: MPI %s, shared "
                "memory %s; here: MPI %s, shared memory %s, alone it would take %s; shared memory needs at most "
                "%.2fx MPI's time%s); measured again after %d calls",
                f"{fn} {r.label}".strip(), r.sizes(), b.group_name or "default", b.rank, r.describe(),
                " (changed)" if changed else "", SAMPLES, _us(t_mpi), _us(t_shm), _us(here_mpi), _us(here_shm),
                mine_way, margin, ", the --tune table's prior" if not no_prior else "", r.left,
            )  # fmt: skip

    def may_share(self, table: list[Route | None], nbytes: int) -> bool:
        """Whether calls of this class may take shared memory (not yet measured, or chosen); counts nothing."""
        r = table[nbytes.bit_length()]
        return r is None or r.way != MPI_CALL

    def choices(self) -> list[tuple[str, str, str, str]]:
        """(collective, dtype and op, sizes, what the calls take now) of every class met so far."""
        return [(r.fn, r.label, r.sizes(), r.describe()) for r in self.routes]
