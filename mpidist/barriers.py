"""``monitored_barrier``: a barrier that names the ranks that did not arrive.

As in torch: every rank but group rank 0 reports to rank 0; rank 0 waits for
the reports until the timeout and then releases everybody with its verdict. On
a failure rank 0 raises ``Rank 1 failed to pass monitored_barrier in 2000 ms``
(all missing ranks with ``wait_all_ranks=True``, else the first one), the ranks
that did arrive raise the same verdict, and a rank that never hears from rank 0
raises after the timeout too. The messages travel on the group's private control
communicator, numbered per barrier, and a rank that gives up withdraws its
report, so that a late or abandoned arrival from an earlier, failed barrier is
never mistaken for one of the current barrier.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ._validate import timeout_seconds
from ._world import world
from .process_group import ProcessGroup, absent, resolve_group
from .work import poll

__all__ = ["monitored_barrier"]

_ARRIVE_TAG = 0x3B01
_RELEASE_TAG = 0x3B02
_RELEASE_GRACE_S = 2.0  # non-zero ranks wait this much longer than rank 0 does


def monitored_barrier(group: ProcessGroup | None = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """Synchronize like ``barrier``, but report the ranks that fail to arrive within ``timeout``.

    Args:
        group: the group (default: the world). On ranks outside it the call does
            nothing.
        timeout: timedelta or seconds; default the group's timeout.
        wait_all_ranks: on rank 0, collect every missing rank instead of failing at the first.

    Raises:
        RuntimeError: on every rank that takes part, naming the missing ranks.
        TypeError: ``wait_all_ranks`` is not a bool, or ``timeout`` is neither a
            timedelta nor a number.
        ValueError: ``timeout`` is negative or NaN.
        DefaultGroupStateError: ``init_process_group`` has not been called.

    Examples:
        >>> dist.monitored_barrier(timeout=10)  # every rank arrives: returns None

        Under ``mpiexec -n 3``, when rank 1 does not call it:

        >>> if dist.get_rank() != 1:
        ...     dist.monitored_barrier(timeout=2)
        Traceback (most recent call last):
        RuntimeError: Rank 1 failed to pass monitored_barrier in 2000 ms  # rank 0; rank 2 adds "(reported by rank 0 of the group)"
    """
    fn = "monitored_barrier"
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    if not isinstance(wait_all_ranks, bool):
        raise TypeError(f"{fn}: wait_all_ranks must be a bool, got {type(wait_all_ranks).__name__}")
    limit = timeout_seconds(timeout, fn, pg.timeout.total_seconds())
    control = pg.control
    epoch = control.next_epoch()
    if control.size == 1:
        return None
    if control.rank == 0:
        _collect(pg, control, epoch, limit, wait_all_ranks)
    else:
        _report(pg, control, epoch, limit)
    return None


def _names(pg: ProcessGroup, ranks: list[int]) -> str:
    text = ", ".join(str(r) for r in ranks)
    if not pg.is_identity():
        text += f" (global {', '.join(str(pg.ranks[r]) for r in ranks)})"
    return text


def _verdict(pg: ProcessGroup, missing: list[int], behind: dict[int, int], epoch: int, limit: float) -> str:
    parts = []
    if missing:
        label = "Rank" if len(missing) == 1 else "Ranks"
        parts.append(f"{label} {_names(pg, missing)} failed to pass monitored_barrier in {limit * 1000:.0f} ms")
    for r, theirs in sorted(behind.items()):
        parts.append(
            f"Rank {_names(pg, [r])} is out of step: it is at its monitored_barrier #{theirs} while rank 0 is at "
            f"#{epoch} (it skipped earlier ones)"
        )
    if behind:
        parts.append("the ranks are in step again after this error")
    return "; ".join(parts)


def _collect(pg: ProcessGroup, control: Any, epoch: int, limit: float, wait_all_ranks: bool) -> None:
    """Rank 0: wait for every other rank's report, then release the reporters with the verdict.

    Each rank ``k`` sends rank 0 its barrier number when it arrives, and the
    number negated when it gives up waiting for its release (a *withdrawal*).
    Rank 0 keeps one receive posted per rank and reads every message a rank has
    sent, in order, so that a report a rank has since withdrawn (it timed out in
    an earlier barrier that rank 0 skipped) is not counted. A live report
    numbered below ``epoch`` comes from a rank that skipped barriers: rank 0
    names it as out of step. Every release carries rank 0's number, which the
    released ranks adopt; if the others are ahead, rank 0 adopts theirs.
    """
    from mpi4py import MPI

    comm = control.comm
    n = control.size
    boxes = {k: np.zeros(1, np.int64) for k in range(1, n)}
    reqs = {k: comm.Irecv(boxes[k], k, _ARRIVE_TAG) for k in range(1, n)}
    live: dict[int, int] = {}  # each rank's newest report that it has not withdrawn
    deadline = time.monotonic() + limit

    def take(k: int) -> None:
        number = int(boxes[k][0])
        if number > 0:
            live[k] = number
        elif live.get(k) == -number:
            del live[k]

    def progress() -> bool:
        fresh = False
        for k, req in reqs.items():
            if req.Test():
                take(k)
                reqs[k] = comm.Irecv(boxes[k], k, _ARRIVE_TAG)
                fresh = True
        if fresh:
            return False  # read on: a withdrawal may follow a report
        if all(live.get(k, 0) >= epoch for k in reqs):
            return True
        return not wait_all_ranks and time.monotonic() > deadline and any(k not in live for k in reqs)

    poll(progress, limit, control.spins)
    status = MPI.Status()
    for k, req in reqs.items():
        req.Cancel()
        req.Wait(status)
        if not status.Is_cancelled():  # matched a message after all
            take(k)
    arrived = {k for k, number in live.items() if number >= epoch}
    missing = sorted(k for k in reqs if k not in live)
    behind = {k: number for k, number in live.items() if number < epoch}
    if not wait_all_ranks and missing:
        missing, behind = missing[:1], {}
    ahead = max((live[k] for k in arrived), default=epoch)
    if ahead > epoch:  # rank 0 itself skipped barriers: catch up with the others
        control.sync_epoch(ahead)
        epoch = ahead
    verdict = _verdict(pg, missing, behind, epoch, limit) if missing or behind else ""
    message = np.frombuffer(f"{epoch}|{verdict}".encode(), np.uint8)
    for k in sorted(live):
        comm.Send(message, k, _RELEASE_TAG)  # small: sent eagerly
    if verdict:
        raise RuntimeError(verdict)


def _report(pg: ProcessGroup, control: Any, epoch: int, limit: float) -> None:
    """Other ranks: report to rank 0, then wait for its release (and adopt its number).

    A rank that gives up withdraws its report, so that rank 0, if it reaches this
    barrier later, does not count it.
    """
    from mpi4py import MPI

    comm = control.comm
    comm.Send(np.array([epoch], np.int64), 0, _ARRIVE_TAG)
    status = MPI.Status()
    deadline = time.monotonic() + limit + _RELEASE_GRACE_S
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poll(lambda: comm.Iprobe(0, _RELEASE_TAG, status), remaining, control.spins):
            comm.Send(np.array([-epoch], np.int64), 0, _ARRIVE_TAG)  # small: sent eagerly
            raise RuntimeError(
                f"monitored_barrier: rank 0 of the group did not release this rank (rank {control.rank}) "
                f"within {limit * 1000:.0f} ms (+{_RELEASE_GRACE_S:g} s): rank 0 gave up on this barrier "
                "before this rank arrived, has not reached it, or is stuck"
            )
        text = bytearray(status.Get_count(MPI.BYTE))
        comm.Recv(text, 0, _RELEASE_TAG)
        number, _, verdict = text.decode().partition("|")
        if int(number) >= epoch:  # older releases belong to barriers this rank gave up on
            control.sync_epoch(int(number))
            break
    if verdict:
        raise RuntimeError(f"{verdict} (reported by rank 0 of the group)")
