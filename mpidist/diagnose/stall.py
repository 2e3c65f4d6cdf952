"""Where is everybody? Diagnosing a call that timed out.

When a call times out, its rank wants to say which other members are waiting in
which mpidist call, and which are not answering (computing, stuck elsewhere, or
dead). It asks through the default store, never through MPI: a message to a peer
that died or whose host vanished can crash the sender inside MPI (MPICH over UCX
did: SIGSEGV in MPI_Isend), so the diagnosis of a failure must not touch the
failed peer. Every rank whose wait has lasted 0.2 s beats: it writes
``(group, op, seq, beat)`` under ``mpidist/stall/<global rank>`` every tenth of
the time it has waited (0.1 to 1 s). The rank that timed out after T reads every
member's entry twice, three beats of T apart: a member whose beat moved is
waiting in that call; one whose beat did not move is not waiting in mpidist at
all (or is dead). The store's traffic runs in a thread of its own, so a store that
is gone (its host died) delays no wait and no diagnosis by more than the window.
Without a default store the message just names no one. Nothing of this touches
a healthy job's collectives: they do not wait 0.2 s.

Example of the resulting message::

    all_reduce (call #12) on group 0 (mpi, rank 0 of 3) did not complete within
    the timeout of 2 s. Rank 1: waiting in broadcast (call #12) on group 0.
    Rank 2: no answer (not inside an mpidist call: busy elsewhere, hung or dead).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from .._world import world
from ..store.base import MissingKeysError

__all__ = ["waiting", "serve", "survey", "explain", "beat_interval", "QUIET_S"]

_KEY = "mpidist/stall/"


#: a wait beats only once it has lasted this long (seconds): the collectives of a healthy job never do
QUIET_S = 0.2


def beat_interval(waited_s: float) -> float:
    """Seconds between two beats of a rank that has waited ``waited_s``: a tenth of it, 0.1 to 1 s.

    A rank that timed out after ``timeout_s`` reads the others' beats three such
    intervals (of ``timeout_s``) apart: the ranks waiting as long as it did beat at
    least twice meanwhile.
    """
    return min(1.0, max(0.1, 0.1 * waited_s))


class waiting:  # noqa: N801 - used like a function: ``with waiting(...):``
    """Record, for the duration of a slow wait, which call this rank waits in, and since when."""

    __slots__ = ("activity", "previous")

    def __init__(self, group: str, op: str, seq: int) -> None:
        self.activity = (group, op, seq)
        self.previous: Any = None

    def __enter__(self) -> waiting:
        self.previous = (world.activity, world.activity_since)
        world.activity, world.activity_since = self.activity, time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        world.activity, world.activity_since = self.previous


class Beacon:
    """This rank's beats, written to the store by a thread of their own (a store call may block)."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store = store
        self.key = f"{_KEY}{rank}"
        self.count = 0
        self.last = -1e9
        self.broken = False  # the store failed once: no more beats (and no diagnoses through it)
        self._outbox: str | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, activity: Any, since: float, force: bool = False) -> None:
        """Hand a beat to the writer thread if one is due (never blocks)."""
        now = time.monotonic()
        if self.broken:
            return
        if not force:
            waited = now - since
            if waited < QUIET_S or now - self.last < beat_interval(waited):
                return
        self.last = now
        self.count += 1
        self._outbox = json.dumps([*activity, self.count])
        if self._thread is None:
            self._thread = threading.Thread(target=self._write, name="mpidist-stall", daemon=True)
            self._thread.start()
        self._ready.set()

    def close(self) -> None:
        """Stop the writer thread (the world is being reset)."""
        self.broken = True
        self._ready.set()

    def _write(self) -> None:
        while not self.broken:
            self._ready.wait()
            self._ready.clear()
            value, self._outbox = self._outbox, None
            if value is None:
                continue
            try:
                self.store.set(self.key, value)
            except Exception:  # noqa: BLE001 - the store is gone (closed, its host dead): stop beating
                self.broken = True


def _beacon() -> Beacon | None:
    """This world's beacon (made on first use), or None without a default store or a control communicator."""
    if world.stall is None and world.store is not None and world.control_comm is not None:
        world.stall = Beacon(world.store, world.control_comm.Get_rank())
    return world.stall


def serve(force: bool = False) -> None:
    """Beat, if due (called while a wait is slow; ``force``: now)."""
    if world.activity is None:
        return
    beacon = _beacon()
    if beacon is not None:
        beacon.beat(world.activity, world.activity_since, force)


def survey(global_ranks: list[int], wait_s: float) -> dict[int, Any]:
    """Find what ``global_ranks`` wait in; return {rank: (group, op, seq) or None} after about ``wait_s``.

    Reads the members' beats twice, ``wait_s`` apart (this rank beats meanwhile, for
    others asking at the same time); entries are read by a helper thread, so a store
    that does not answer costs at most the window.
    """
    beacon = _beacon()
    if beacon is None or beacon.broken:
        return {}
    me = world.control_comm.Get_rank()
    others = [r for r in global_ranks if r != me]
    first: dict[int, Any] = {}
    second: dict[int, Any] = {}
    reader = threading.Thread(target=_read_twice, args=(beacon.store, others, wait_s, first, second), daemon=True)
    reader.start()
    deadline = time.monotonic() + wait_s + 1.0
    interval = wait_s / 3
    next_beat = time.monotonic()
    while reader.is_alive() and time.monotonic() < deadline:
        if time.monotonic() >= next_beat:  # others timing out too read this rank: beat at their pace
            serve(force=True)
            next_beat += interval
        reader.join(min(0.02, interval))
    answers: dict[int, Any] = {r: None for r in others}
    for r, entry in second.items():
        before = first.get(r)
        if entry is not None and (before is None or entry[-1] != before[-1]):
            answers[r] = tuple(entry[:3])
    return answers


def _read_twice(store: Any, ranks: list[int], wait_s: float, first: dict, second: dict) -> None:
    """Fill ``first`` and ``second`` with the ranks' entries, read ``wait_s`` apart (missing ranks left out)."""
    for target in (first, second):
        if target is second:
            time.sleep(wait_s)
        try:
            target.update(_read(store, ranks))
        except Exception:  # noqa: BLE001 - a store that fails names no one
            return


def _read(store: Any, ranks: list[int]) -> dict[int, Any]:
    """The ranks' entries, in one store request (two when some rank never beat: its key is missing).

    Every rank that timed out reads every member's entry, so one request per key made
    the survey's traffic grow as the square of the group: with 16 ranks across 8 hosts
    on 2 cores, the readers' second pass did not end within the window and every
    member was named as not answering.
    """
    rank_of = {f"{_KEY}{r}": r for r in ranks}
    keys = list(rank_of)
    for _ in range(2):
        if not keys:
            return {}
        try:
            values = store._multi_get(keys, 0.0)  # no wait: a key that is not there is missing
        except MissingKeysError as exc:
            missing = set(exc.keys)
            keys = [k for k in keys if k not in missing]
            continue
        return {rank_of[k]: json.loads(v) for k, v in zip(keys, values)}
    return {}


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
