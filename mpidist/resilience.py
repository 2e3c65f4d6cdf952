"""Going on without lost ranks: ``shrink_group`` (torch 2.13's signature) over MPI.

A healthy group shrinks on any MPI library: the remaining members make a
communicator of their own with ``MPI_Comm_create_group`` (the excluded ranks do
not call). A group with a dead member needs the library's User-Level Failure
Mitigation (``backends/ulfm.py``: Open MPI 5 under ``mpirun --with-ft ulfm``):
every survivor calls ``MPI_Comm_shrink``, which agrees on who is dead. Shrinking
the default group replaces the world: global ranks renumber, every other group
is dropped, and mpidist's control communicator and default store follow (a new
store on the new rank 0, so the old rank 0 may be the one that died).
"""

from __future__ import annotations

import time
import zlib
from typing import Any

from ._world import world
from .errors import DistBackendError
from .process_group import ProcessGroup, rank_int, resolve_group

__all__ = ["shrink_group", "SHRINK_DEFAULT", "SHRINK_ABORT"]

#: ``shrink_flags``: shrink once the excluded ranks have stopped taking part
SHRINK_DEFAULT = 0x00
#: ``shrink_flags``: revoke the group first (ULFM), so that calls pending on it end (with ``ProcessFailedError``)
SHRINK_ABORT = 0x01

_NEEDS_ULFM = (
    "shrinking a group with a dead member needs an MPI library with User-Level Failure Mitigation: "
    "Open MPI 5 started with `mpirun --with-ft ulfm` (mpidistrun --with-ft)"
)


def shrink_group(
    ranks_to_exclude: list[int],
    group: ProcessGroup | None = None,
    shrink_flags: int = SHRINK_DEFAULT,
    pg_options: Any = None,
) -> ProcessGroup:
    """Make a group of ``group``'s members without ``ranks_to_exclude``; shrinking the default group replaces it.

    Only the remaining members call it. On a group whose members are alive it works
    on any MPI library. After a member died (a ``ProcessFailedError``), it needs
    ULFM (Open MPI 5 under ``mpirun --with-ft ulfm``): the survivors agree on who
    is dead, and ``ranks_to_exclude`` (for instance ``exc.failed_group_ranks``)
    must name dead members only. The old group is destroyed. When it was the
    default group, the returned group is the new default group, global ranks are
    its ranks, and every other group is destroyed (torch does the same).

    Args:
        ranks_to_exclude: Ranks of ``group`` (group ranks) to leave out; not empty,
            not this rank, not every rank.
        group: The group to shrink; None is the default group.
        shrink_flags: ``SHRINK_DEFAULT``, or ``SHRINK_ABORT`` to revoke ``group``
            first so that calls pending on it end (with ULFM; elsewhere MPI has no
            way to end them, and it acts as ``SHRINK_DEFAULT``).
        pg_options: Passed to a registered backend's factory for the new group.

    Returns:
        The new ``ProcessGroup`` of the remaining members.

    Raises:
        TypeError: ``ranks_to_exclude`` is not a list of ints, or ``group`` is not a group.
        ValueError: ``ranks_to_exclude`` is empty, has a rank outside the group or
            twice, or names every rank; ``shrink_flags`` is not one of the two;
            ``group`` has one rank, or this rank is not its member.
        RuntimeError: this rank is in ``ranks_to_exclude``.
        DistBackendError: the group has a dead member and the MPI library has no
            ULFM, or a rank named dead was not reported dead within the group's
            timeout.

    Examples:
        >>> try:
        ...     dist.all_reduce(x)  # mpirun --with-ft ulfm -n 4: rank 2 was killed
        ... except dist.ProcessFailedError as exc:
        ...     dist.shrink_group(exc.failed_group_ranks)
        >>> dist.get_rank(), dist.get_world_size()
        (2, 3)  # the rank that was 3
    """
    fn = "shrink_group"
    pg = resolve_group(group, fn)
    if pg is None:
        raise ValueError(f"{fn}: this rank is not a member of the group to shrink")
    excluded = _checked(ranks_to_exclude, shrink_flags, pg, fn)
    from .backends import ulfm  # imports mpi4py.MPI: MPI is running once a group exists

    with world.lock:
        failed = ulfm.enabled() and _has_failed(pg, ulfm)
        if shrink_flags == SHRINK_ABORT and ulfm.enabled():
            for comm in pg.communicators():
                ulfm.revoke(comm)
            failed = True
        if failed:
            comm = _shrink_dead(pg, excluded, ulfm, fn)
            world.survived_failure = True  # MPI_Finalize may now wait for the dead (launch/abort.py)
        else:
            if pg.refusal is not None or any(b is not None and b in _timed_out() for b in pg.backends()):
                raise DistBackendError(f"{fn}: group {pg.group_name} has a call that failed or timed out; {_NEEDS_ULFM}")
            comm = _create_without(pg, excluded)
        if pg is world.default_pg:
            from .init import replace_world

            return replace_world(comm, pg_options, f"{pg.group_desc}:shrunk")
        from .groups import make_group

        remaining = [g for i, g in enumerate(pg.ranks) if i not in excluded]
        name = f"{pg.group_name}:shrunk-{zlib.crc32(repr(remaining).encode()):08x}"
        pg.abandon()
        world.groups.pop(pg.group_name, None)
        return make_group(comm, remaining, pg.devices, pg.timeout, pg_options, name, f"{pg.group_desc}:shrunk", pg.backend_name)


def _checked(ranks: Any, flags: Any, pg: ProcessGroup, fn: str) -> set[int]:
    """``ranks_to_exclude`` as a set of group ranks, after torch's checks (on every rank alike)."""
    if not isinstance(ranks, list):
        raise TypeError(f"{fn}: ranks_to_exclude must be a list of group ranks, got {type(ranks).__name__}")
    if not ranks:
        raise ValueError(f"{fn}: ranks_to_exclude must not be empty: name the ranks to leave out, e.g. [failed_rank]")
    if isinstance(flags, bool) or flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(f"{fn}: shrink_flags must be SHRINK_DEFAULT (0) or SHRINK_ABORT (1), got {flags!r}")
    n = pg.size()
    if n <= 1:
        raise ValueError(f"{fn}: group {pg.group_name} has {n} rank; a group to shrink has at least 2")
    out: set[int] = set()
    for i, r in enumerate(ranks):
        r = rank_int(r, fn, f"ranks_to_exclude[{i}]")
        if not 0 <= r < n:
            raise ValueError(f"{fn}: ranks_to_exclude[{i}] = {r} is outside group {pg.group_name} of size {n}")
        if r in out:
            raise ValueError(f"{fn}: ranks_to_exclude lists rank {r} more than once")
        out.add(r)
    if len(out) >= n:
        raise ValueError(f"{fn}: ranks_to_exclude names all {n} ranks of group {pg.group_name}; at least one must remain")
    if pg.rank() in out:
        raise RuntimeError(
            f"{fn}: this rank ({pg.rank()} of group {pg.group_name}) is in ranks_to_exclude; only the remaining "
            "ranks call shrink_group (an excluded rank should end, or go on without the group)"
        )
    return out


def _timed_out() -> list[Any]:
    return [backend for backend, _, _ in world.timed_out]


def _has_failed(pg: ProcessGroup, ulfm: Any) -> bool:
    """Whether the group met a dead member here: a communicator revoked, or a death reported."""
    for comm in pg.communicators():
        if comm.Is_revoked() or ulfm.failed_members(comm, 0.0):
            return True
    return False


def _shrink_dead(pg: ProcessGroup, excluded: set[int], ulfm: Any, fn: str) -> Any:
    """The survivors' communicator (ULFM's shrink), once every excluded rank is reported dead."""
    deadline = time.monotonic() + pg.timeout.total_seconds()
    comm = pg.mpi_comm if pg.mpi_comm is not None else pg.control.comm
    alive = excluded
    while True:
        alive = excluded - set(ulfm.failed_members(comm, 0.0))
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if alive:
        raise DistBackendError(
            f"{fn}: rank(s) {sorted(alive)} of group {pg.group_name} were not reported dead within the group's "
            f"timeout of {pg.timeout}; after a failure, shrink_group leaves out dead ranks only (shrink the "
            "survivors' group again to leave out a live rank)"
        )
    for c in pg.communicators():
        ulfm.revoke(c)  # any call still pending on the old group ends
    return ulfm.shrink(comm)[0]  # members that died meanwhile are left out too: every survivor agrees


def _create_without(pg: ProcessGroup, excluded: set[int]) -> Any:
    """A communicator of ``pg``'s members outside ``excluded``, made by those members alone."""
    comm = pg.mpi_comm if pg.mpi_comm is not None else pg.control.comm
    keep = [r for r in range(pg.size()) if r not in excluded]
    everyone = comm.Get_group()
    try:
        members = everyone.Incl(keep)
    finally:
        everyone.Free()
    try:
        return comm.Create_group(members, zlib.crc32(repr(keep).encode()) % 32768)
    finally:
        members.Free()
