"""Where is everybody? Diagnosing a call that timed out.

When a call times out, its rank asks every other member of the group which
mpidist call it is waiting in, over the world's private control communicator,
and gives them a moment to answer. Every rank that is itself waiting inside
mpidist (the slow phase of ``work.poll``) answers with its current call: group,
operation and sequence number. A rank that does not answer is outside mpidist
(computing, stuck in other code, or dead). None of this costs anything on the
fast path: a rank records what it waits for only once its wait has become slow.

Example of the resulting message::

    all_reduce (call #12) on group 0 (mpi, rank 0 of 3) did not complete within
    the timeout of 2 s. Rank 1: waiting in broadcast (call #12) on group 0.
    Rank 2: no answer (not inside an mpidist call: busy elsewhere, hung or dead).
"""

from __future__ import annotations

import time
from typing import Any

from .._world import world

__all__ = ["waiting", "serve", "survey", "explain"]

_REQUEST_TAG = 0x5A11
_REPLY_TAG = 0x5A12


class waiting:  # noqa: N801 - used like a function: ``with waiting(...):``
    """Record, for the duration of a slow wait, which call this rank waits in."""

    __slots__ = ("activity", "previous")

    def __init__(self, group: str, op: str, seq: int) -> None:
        self.activity = (group, op, seq)
        self.previous: Any = None

    def __enter__(self) -> waiting:
        self.previous = world.activity
        world.activity = self.activity
        return self

    def __exit__(self, *exc: object) -> None:
        world.activity = self.previous


def _comm() -> Any:
    return world.control_comm


def serve() -> None:
    """Answer every pending "where are you?" request (called while waiting)."""
    comm = _comm()
    if comm is None:
        return
    from mpi4py import MPI

    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, _REQUEST_TAG, status):
        token = comm.recv(source=status.Get_source(), tag=_REQUEST_TAG)
        if world.activity is not None:  # not waiting in mpidist: stay silent, like a busy rank
            _post(comm.isend((token, world.activity), dest=status.Get_source(), tag=_REPLY_TAG))


def _post(request: Any) -> None:
    """Let a small message go out on its own: never wait for it (its peer may be dead or unreachable).

    A blocking send to a peer that died or whose host vanished can hang or crash
    inside MPI; the request is kept (a few bytes each) and dropped once MPI
    completes it.
    """
    world.unsent = [r for r in world.unsent if not _done(r)]
    if not _done(request):
        world.unsent.append(request)


def _done(request: Any) -> bool:
    try:
        return bool(request.Test())
    except Exception:  # noqa: BLE001 - MPI gave up on it (the peer is gone): nothing more to wait for
        return True


def survey(global_ranks: list[int], wait_s: float) -> dict[int, Any]:
    """Ask ``global_ranks`` what they wait in; return {rank: activity or None} after ``wait_s``."""
    comm = _comm()
    if comm is None:
        return {}
    from mpi4py import MPI

    me = comm.Get_rank()
    others = [r for r in global_ranks if r != me]
    world.survey_count += 1
    token = (me, world.survey_count)
    for r in others:
        _post(comm.isend(token, dest=r, tag=_REQUEST_TAG))
    answers: dict[int, Any] = {r: None for r in others}
    pending = set(others)
    status = MPI.Status()
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        serve()  # others may be asking us at the same time
        while comm.Iprobe(MPI.ANY_SOURCE, _REPLY_TAG, status):
            source = status.Get_source()
            got_token, activity = comm.recv(source=source, tag=_REPLY_TAG)
            if got_token == token and source in pending:  # drop answers to older surveys
                answers[source] = activity
                pending.discard(source)
        time.sleep(0.001)
    return answers


def explain(answers: dict[int, Any], group_ranks: list[int]) -> str:
    """Turn survey answers into sentences, one per rank (group ranks in the text)."""
    index = {g: i for i, g in enumerate(group_ranks)}
    parts = []
    for global_rank in sorted(answers, key=lambda r: index.get(r, r)):
        activity = answers[global_rank]
        who = f"Rank {index.get(global_rank, global_rank)}"
        if global_rank != index.get(global_rank, global_rank):
            who += f" (global rank {global_rank})"
        if activity is None:
            parts.append(f"{who}: no answer (not waiting in an mpidist call: busy elsewhere, hung or dead).")
        else:
            group, op, seq = activity
            parts.append(f"{who}: waiting in {op} (call #{seq}) on group {group}.")
    return " ".join(parts)
