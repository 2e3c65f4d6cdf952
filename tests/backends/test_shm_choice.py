"""The choice between MPI's call and the shared-memory path by measurement (backends/shm_choice.py).

A group's first calls of each collective and size class alternate between the two paths; then the
ranks agree on one. Results must be right on every call, during and after measuring; ranks whose
clocks disagree must still take the same path; an async call never waits for the other ranks, at any
call of the measuring; a rank that stops during the measuring calls gives the others the group's
timeout; MPIDIST_SHM_THRESHOLDS skips the measuring; INFO logs each choice.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import DistBackendError
from mpidist.backends import shm, shm_choice, shm_tuning
from mpidist.bench.tune import group_under
from mpidist.testing import backend_of

from helpers import Checks, fail_together, meet_outside_mpidist, timeout_head

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
#: the calls of one class before the choice: every measured call, then the one that issues the agreement and those
#: until the one that applies it
MEASURED = shm_choice.CHOSEN_AT
#: elements of float32 in the arrays: 64 KiB, in one size class, cheap on either path
N = (64 << 10) // 4

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(shm.shm_status()), reason=f"no shared-memory path here: {shm.shm_status()}"),
]


def _expect_rank_1_timeout(problems: list[str], g: Any, call: Callable[[], Any], what: str) -> None:
    """``call()`` (an all_reduce on ``g``) must raise the group's timeout within 3 s, naming rank 1 as not answering."""
    seq = backend_of(g).calls_issued() + 1
    start = time.monotonic()
    try:
        call()
        problems.append(f"{what} returned")
    except DistBackendError as exc:
        for pattern in (timeout_head("all_reduce", seq, g), r"Rank 1: no answer"):
            if not re.search(pattern, str(exc)):
                problems.append(f"message {str(exc)!r} does not match {pattern!r}")
        if time.monotonic() - start > 3.0:
            problems.append(f"the error came after {time.monotonic() - start:.2f} s")


def _chunks(g) -> int:
    path = backend_of(g).shared_memory()
    return -1 if path is None else path.chunks


def _calls(g, async_op: bool) -> dict[str, str]:
    """One call of each collective of the path at 64 KiB on ``g``, checked: name -> its check's problem or ''."""
    m = N // SIZE
    got = {}
    x = np.full(N, RANK + 1, np.float32)
    w = dist.all_reduce(x, group=g, async_op=async_op)
    w and w.wait()
    got["all_reduce"] = "" if (x == SIZE * (SIZE + 1) / 2).all() else f"all_reduce gave {x[:3]}"
    x = np.full(N, RANK + 1, np.float32)
    w = dist.reduce(x, dst=SIZE - 1, group=g, async_op=async_op)
    w and w.wait()
    ok = (x == (SIZE * (SIZE + 1) / 2 if RANK == SIZE - 1 else RANK + 1)).all()
    got["reduce"] = "" if ok else f"reduce gave {x[:3]}"
    x = np.full(N, RANK, np.float32)
    w = dist.broadcast(x, src=SIZE - 1, group=g, async_op=async_op)
    w and w.wait()
    got["broadcast"] = "" if (x == SIZE - 1).all() else f"broadcast gave {x[:3]}"
    out = np.zeros(m * SIZE, np.float32)
    w = dist.all_gather_into_tensor(out, np.full(m, RANK, np.float32), group=g, async_op=async_op)
    w and w.wait()
    ok = (out.reshape(SIZE, m) == np.arange(SIZE, dtype=np.float32)[:, None]).all()
    got["all_gather_into_tensor"] = "" if ok else f"all_gather_into_tensor gave {out[::m]}"
    out = np.zeros(m, np.float32)
    w = dist.reduce_scatter_tensor(out, np.full(m * SIZE, RANK + 1, np.float32), group=g, async_op=async_op)
    w and w.wait()
    got["reduce_scatter_tensor"] = "" if (out == SIZE * (SIZE + 1) / 2).all() else f"reduce_scatter gave {out[:3]}"
    return got


@pytest.mark.mpi(min_size=2)
def test_results_are_right_while_measuring_and_after():
    """Every collective of the path, blocking and async in turn: right on every call; both paths measured; one choice
    per collective after MEASURED calls, the same on every rank."""
    g = group_under(dist, {})  # its first broadcast (group_under's) is broadcast's first measured call
    c = Checks()
    before = _chunks(g)
    for k in range(MEASURED + 2):
        for problem in _calls(g, async_op=bool(k % 2)).values():
            c.true(f"call {k}: {problem}", not problem)
    c.true("no measured call took shared memory", _chunks(g) > before)
    choices = backend_of(g).shared_memory_choices()
    decided = {fn: way for fn, _, _, way in choices}
    c.equal("collectives with a choice", sorted(decided), sorted(shm_tuning.COLLECTIVES))
    c.true(f"a class still measuring: {choices}", all(not w.startswith("measuring") for w in decided.values()))
    c.identical("the choices", np.frombuffer(repr(sorted(choices)).encode().ljust(2000), np.uint8))
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
def test_ranks_whose_timings_disagree_take_the_same_path(monkeypatch, caplog):
    """Rank 0's clock says MPI wins by far, every other rank's that shared memory does: one choice for all, logged
    once per class at INFO with the timings; later calls take it on every rank."""
    monkeypatch.setattr(shm_choice, "skew", (1.0, 1e4) if RANK == 0 else (1e4, 1.0))
    caplog.set_level(logging.INFO, logger="mpidist")
    g = group_under(dist, {})
    c = Checks()
    x = np.ones(N, np.float32)
    for _ in range(MEASURED + 1):
        dist.all_reduce(x, group=g)
    c.equal("all_reduce's results", x, np.full(N, float(SIZE ** (MEASURED + 1)), np.float32))
    (choice,) = [way for fn, _, _, way in backend_of(g).shared_memory_choices() if fn == "all_reduce"]
    c.true(
        f"the choices differ between ranks: {MPI.COMM_WORLD.allgather(choice)}",
        len(set(MPI.COMM_WORLD.allgather(choice))) == 1,
    )
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("all_reduce float32 sum, 64 KiB-128 KiB")
    ]
    c.equal("log lines of all_reduce's choice", len(lines), 1)
    alone = "MPI" if RANK == 0 else "shared memory"
    c.true(
        f"the log line {lines} does not say this rank alone would take {alone}",
        any(f"alone it would take {alone};" in s for s in lines),
    )
    c.true(
        f"the log line {lines} does not name the choice {choice}", any(f"rank {RANK}: {choice} (" in s for s in lines)
    )
    before = _chunks(g)
    for _ in range(3):
        dist.all_reduce(x, group=g)
    took = _chunks(g) - before
    c.identical("chunks moved by the calls after the choice", np.array([took]))
    c.equal("shared memory taken as chosen", took > 0, choice == "shared memory")
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
def test_the_environment_override_skips_measuring():
    """MPIDIST_SHM_THRESHOLDS fixes what it names (no measured call, no choice); the others are measured."""
    g = group_under(dist, {shm_tuning.ENV_THRESHOLDS: "all_reduce=off,reduce=16K"})
    c = Checks()
    for k in range(MEASURED + 1):
        before = _chunks(g)
        x = np.ones(N, np.float32)
        dist.all_reduce(x, group=g)
        c.equal(f"all_reduce {k} moved chunks", _chunks(g), before)
        dist.reduce(x, dst=0, group=g)
        c.true(f"reduce {k} did not take shared memory", _chunks(g) > before)
        x = np.ones(N, np.float32)
        dist.reduce_scatter_tensor(x[: N // SIZE], x[: N // SIZE * SIZE].copy(), group=g)
    fns = {fn for fn, _, _, _ in backend_of(g).shared_memory_choices()}
    c.equal("collectives measured", sorted(fns), ["broadcast", "reduce_scatter_tensor"])
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_an_async_call_waits_for_no_other_rank(monkeypatch):
    """Rank 0 makes an async all_reduce, then sends rank 1 the message rank 1 waits for before making its own
    (blocking) call, then waits for its Work: legal in MPI (and with MPIDIST_SHM=0), so on every call of the class:
    the measured ones, the one that issues the agreement, the one that applies it, those after the choice, and a
    second round of measuring (RECHECK_FIRST made short). Results against numpy on every call."""
    recheck = 4
    monkeypatch.setattr(shm_choice, "RECHECK_FIRST", recheck)
    g = group_under(dist, {}, timeout=20.0)
    c = Checks()
    calls = (MEASURED + 1) + (recheck - 1) + (MEASURED + 1) + 2  # a round, its choice, another round, its choice
    problems: list[str] = []
    for k in range(calls):
        x = np.full(N, RANK + k, np.float32)
        y = np.full(4, k, np.int64) if RANK == 0 else np.full(4, -1, np.int64)
        try:
            if RANK == 0:
                w = dist.all_reduce(x, group=g, async_op=True)
                dist.send(y, dst=1, group=g)
                w.wait()
            elif RANK == 1:
                dist.recv(y, src=0, group=g)
                dist.all_reduce(x, group=g)
            else:
                dist.all_reduce(x, group=g)
        except DistBackendError as exc:
            problems.append(f"call {k}: {exc}")
            break
        c.equal(f"all_reduce {k}", x, np.full(N, SIZE * k + SIZE * (SIZE - 1) // 2, np.float32))
        if RANK == 1:
            c.equal(f"the message before all_reduce {k}", y, np.full(4, k, np.int64))
    fail_together(problems)
    (choice,) = [way for fn, _, _, way in backend_of(g).shared_memory_choices() if fn == "all_reduce"]
    c.true(f"all_reduce still measuring: {choice}", not choice.startswith("measuring"))
    c.identical("the choice", np.frombuffer(choice.encode().ljust(100), np.uint8))
    c.done()
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "calls_first", [3, shm_choice.ROUND, MEASURED], ids=["measured-call", "agreement-issued", "agreement-applied"]
)
def test_a_rank_stopped_during_measuring_gives_the_timeout(calls_first):
    """Rank 1 makes ``calls_first`` all_reduce calls and stays away: the others, in the next measured call, in the
    call that issues the agreement or in the one that applies it, raise the group's timeout naming rank 1."""
    g = group_under(dist, {}, timeout=1.0)
    x = np.ones(N, np.float32)
    for _ in range(calls_first):
        dist.all_reduce(x, group=g)
    problems: list[str] = []
    if RANK != 1:
        _expect_rank_1_timeout(problems, g, lambda: dist.all_reduce(x, group=g), "all_reduce with rank 1 away")
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_the_agreement_of_a_rank_that_stayed_away_times_out_where_it_is_applied():
    """Rank 1 makes the measured calls and stays away: the others' next AGREE_LAG calls, async, return at once (the
    first issues the agreement); the call after them waits for the agreement and raises the group's timeout naming
    rank 1."""
    g = group_under(dist, {}, timeout=1.0)
    x = np.ones(N, np.float32)
    for _ in range(shm_choice.ROUND):
        dist.all_reduce(x, group=g)
    problems: list[str] = []
    if RANK != 1:
        works = []
        start = time.monotonic()
        for _ in range(shm_choice.AGREE_LAG):
            works.append(dist.all_reduce(np.ones(N, np.float32), group=g, async_op=True))
        if time.monotonic() - start > 0.5:
            problems.append(f"{shm_choice.AGREE_LAG} async calls took {time.monotonic() - start:.2f} s")
        applying = lambda: dist.all_reduce(x, group=g, async_op=True)  # noqa: E731
        _expect_rank_1_timeout(problems, g, applying, "the call that applies the agreement, with rank 1 away,")
        del works  # never complete: the group keeps their buffers (and is not freed)
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)


class _Alone:
    """What a Chooser reads of its backend, on MPI_COMM_SELF: the agreement is this process's own numbers."""

    comm, timeout_s, spins, group_name, rank, seq = MPI.COMM_SELF, 5.0, 16, "alone", 0, 1


def _choose(
    prior: dict, mpi_s: float | None, shm_s: float | None, nbytes: int = 64 << 10
) -> tuple[int, shm_choice.Route]:
    """Step a Chooser through one round of measured calls with these timings (None: that path's calls were async,
    untimed), then the calls while the agreement is in flight; return what the next call takes."""
    ch = shm_choice.Chooser(_Alone(), prior)
    table = [None] * shm_choice.CLASSES
    for _ in range(shm_choice.ROUND):
        assert ch.next(table, "all_reduce", "float32 sum", nbytes) == shm_choice.TRIAL
        route, shared, timed = ch.pending
        seconds = shm_s if shared else mpi_s
        if timed and seconds is not None:
            route.add(shared, seconds)
    for _ in range(shm_choice.AGREE_LAG):
        assert ch.next(table, "all_reduce", "float32 sum", nbytes) == shm_choice.MPI_CALL
    assert route.agreement is not None
    return ch.next(table, "all_reduce", "float32 sum", nbytes), route


@pytest.mark.one_rank
def test_the_margin_the_prior_and_the_checks_again():
    """Shared memory only where it wins by the margin (by any amount where the --tune prior says it wins), MPI's call
    where a path has no timing; the agreement is applied AGREE_LAG calls after it is issued; the choice holds
    RECHECK_FIRST calls, then the class is measured again; other classes are their own."""
    never = shm_tuning.NEVER
    assert _choose({}, 1.0, 0.85)[0] == shm_choice.SHARED
    assert _choose({}, 1.0, 0.95)[0] == shm_choice.MPI_CALL  # not clearly faster: MPI's call
    assert _choose({"all_reduce": (16 << 10, never)}, 1.0, 0.95)[0] == shm_choice.SHARED  # the prior
    assert _choose({"all_reduce": (1 << 20, never)}, 1.0, 0.95)[0] == shm_choice.MPI_CALL  # a prior elsewhere
    assert _choose({"all_reduce": (16 << 10, never)}, 1.0, 1.05)[0] == shm_choice.MPI_CALL  # not the last word
    assert _choose({}, None, None)[0] == shm_choice.MPI_CALL  # no timing at all (every call async): MPI's call
    assert _choose({"all_reduce": (16 << 10, never)}, None, 0.5)[0] == shm_choice.MPI_CALL  # only one path timed
    way, route = _choose({}, 1.0, 0.5)
    ch = shm_choice.Chooser(_Alone(), {})
    table = [None] * shm_choice.CLASSES
    table[route.bits] = route
    takes = [ch.next(table, "all_reduce", "float32 sum", 100 << 10) for _ in range(shm_choice.RECHECK_FIRST)]
    assert takes[:-1] == [shm_choice.SHARED] * (shm_choice.RECHECK_FIRST - 1) and takes[-1] == shm_choice.TRIAL
    assert ch.next(table, "all_reduce", "float32 sum", 200 << 10) == shm_choice.TRIAL  # another class


@pytest.mark.one_rank
def test_a_choice_is_logged_once_and_again_only_where_a_check_changes_it(caplog):
    """INFO logs the first choice of a class; a later check logs only where it chose the other path ("changed")."""
    caplog.set_level(logging.INFO, logger="mpidist")
    ch = shm_choice.Chooser(_Alone(), {})
    table: list[Any] = [None] * shm_choice.CLASSES
    nbytes = 64 << 10

    def one_round(mpi_s: float, shm_s: float) -> int:
        """From a class's (re)measuring to its choice: the measured calls with these timings, the agreement."""
        while ch.next(table, "all_reduce", "float32 sum", nbytes) != shm_choice.TRIAL:
            pass  # the calls the last choice holds, up to the check
        for k in range(shm_choice.ROUND):
            if k:
                assert ch.next(table, "all_reduce", "float32 sum", nbytes) == shm_choice.TRIAL
            route, shared, timed = ch.pending
            if timed:
                route.add(shared, shm_s if shared else mpi_s)
        for _ in range(shm_choice.AGREE_LAG):
            assert ch.next(table, "all_reduce", "float32 sum", nbytes) == shm_choice.MPI_CALL
        return ch.next(table, "all_reduce", "float32 sum", nbytes)

    def logged() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("all_reduce float32 sum")]
        caplog.clear()
        return lines

    assert one_round(1.0, 0.5) == shm_choice.SHARED
    first = logged()
    assert len(first) == 1 and ": shared memory (" in first[0] and "(changed)" not in first[0], first
    assert one_round(1.0, 0.6) == shm_choice.SHARED
    assert logged() == []  # the same choice again: nothing new to say
    assert one_round(1.0, 2.0) == shm_choice.MPI_CALL
    again = logged()
    assert len(again) == 1 and ": MPI (changed) (" in again[0], again


def _round_of(ch: shm_choice.Chooser, fn: str, nbytes: int, seconds: dict[int, float]) -> int:
    """Step ``ch`` through one round of measured calls of ``fn`` (timings per way), then the agreement; return
    what the next call takes."""
    table = [None] * shm_choice.CLASSES
    assert ch.next(table, fn, "", nbytes) == shm_choice.TRIAL
    route = table[nbytes.bit_length()]
    for k in range(route.round):
        if k:
            assert ch.next(table, fn, "", nbytes) == shm_choice.TRIAL
        r, way, timed = ch.pending
        if timed:
            r.add(way, seconds[way])
    for _ in range(shm_choice.AGREE_LAG):
        assert ch.next(table, fn, "", nbytes) == shm_choice.MPI_CALL
    return ch.next(table, fn, "", nbytes)


@pytest.mark.one_rank
def test_three_ways_where_the_one_copy_variant_is_measured():
    """broadcast and all_gather_into_tensor from ONE_COPY_FLOOR, in a group whose ranks may read each other's
    memory, measure three ways in turn (a round half as long again) and take the fastest shared-memory way where
    it beats MPI's call by the margin; other collectives, smaller classes and other groups measure two."""
    mpi, shared, one = shm_choice.MPI_CALL, shm_choice.SHARED, shm_choice.ONE_COPY
    big = shm_choice.ONE_COPY_FLOOR
    for fn in sorted(shm_choice.ONE_COPY_COLLECTIVES):
        assert _round_of(shm_choice.Chooser(_Alone(), {}, True), fn, big, {mpi: 1.0, shared: 0.95, one: 0.5}) == one
        assert _round_of(shm_choice.Chooser(_Alone(), {}, True), fn, big, {mpi: 1.0, shared: 0.5, one: 0.6}) == shared
        assert _round_of(shm_choice.Chooser(_Alone(), {}, True), fn, big, {mpi: 1.0, shared: 0.97, one: 0.95}) == mpi
    ch = shm_choice.Chooser(_Alone(), {}, True)
    table = [None] * shm_choice.CLASSES
    ch.next(table, "broadcast", "", big)
    ways = [ch.pending[1]]
    route = table[big.bit_length()]
    assert route.round == 3 * shm_choice.SAMPLES * (shm_choice.WARM + 1)
    for _ in range(route.round - 1):
        ch.next(table, "broadcast", "", big)
        ways.append(ch.pending[1])
    assert ways.count(one) == ways.count(shared) == ways.count(mpi) == route.round // 3, ways
    assert route.describe().startswith("measuring (")
    for fn, nbytes, one_copy in [("broadcast", big // 2, True), ("all_reduce", big, True), ("broadcast", big, False)]:
        table = [None] * shm_choice.CLASSES
        shm_choice.Chooser(_Alone(), {}, one_copy).next(table, fn, "", nbytes)
        assert table[nbytes.bit_length()].ways == (shared, mpi), (fn, nbytes, one_copy)


def _one_copy_calls(g: Any, c: Checks, what: str, nbytes: int, k: int) -> None:
    """broadcast from every root and all_gather_into_tensor (in place, not) of ``nbytes`` on ``g``, checked; call
    ``k`` 1 (one measured call of each class: no timing, a way keeps others) and 99 are async."""
    m = nbytes // 4
    for root in range(SIZE):
        x = np.full(m, RANK * 10.0 + k, np.float32)
        if k in (1, 99) and (root == 0 or k == 99):
            dist.broadcast(x, src=root, group=g, async_op=True).wait()
        else:
            dist.broadcast(x, src=root, group=g)
        c.true(f"{what}: broadcast {k} from {root}", (x == root * 10.0 + k).all())
    out = np.zeros(m * SIZE, np.float32)
    mine = np.arange(m, dtype=np.float32) + RANK * 1000 + k
    expected = np.concatenate([np.arange(m, dtype=np.float32) + r * 1000 + k for r in range(SIZE)])
    dist.all_gather_into_tensor(out, mine, group=g)
    c.true(f"{what}: all_gather_into_tensor {k}", (out == expected).all())
    out[:] = 0
    out[RANK * m : (RANK + 1) * m] = mine
    if k in (1, 99):
        dist.all_gather_into_tensor(out, out[RANK * m : (RANK + 1) * m], group=g, async_op=True).wait()
    else:
        dist.all_gather_into_tensor(out, out[RANK * m : (RANK + 1) * m], group=g)
    c.true(f"{what}: all_gather_into_tensor {k} in place", (out == expected).all())


@pytest.mark.mpi(min_size=2)
def test_the_one_copy_variant_is_chosen_where_it_measures_fastest_and_is_right(monkeypatch, caplog):
    """Where this rank's clock makes the one-copy variant fastest on every rank, every rank takes it (and INFO
    logs the three ways' timings); results are right on every call (every root, in place, async) during the
    measuring and after it; calls after the choice move no chunk through the slots. Where ranks' clocks
    disagree, they still agree."""
    if shm._read_from is None:
        pytest.skip("the C module is not built: no one-copy variant")
    caplog.set_level(logging.INFO, logger="mpidist")
    c = Checks()
    for label, skew in [
        ("one copy fastest everywhere", (1e4, 1e4, 1.0)),
        ("ranks disagree", (1e4, 1.0, 1e4) if RANK == 0 else (1e4, 1e4, 1.0)),
    ]:
        monkeypatch.setattr(shm_choice, "skew", skew)
        g = group_under(dist, {})
        nbytes = shm_choice.ONE_COPY_FLOOR + 4096
        for k in range(3 * shm_choice.SAMPLES * (shm_choice.WARM + 1) + shm_choice.AGREE_LAG + 1):
            _one_copy_calls(g, c, label, nbytes, k)
        path = backend_of(g).shared_memory()
        c.true(f"{label}: the group's ranks could not read each other's memory", path is not None and path.one_copy)
        setup = f"{shm_tuning.SETUP_FLOOR >> 10} KiB-"  # group_under's call that set the path up
        choices = sorted((fn, way) for fn, _, sizes, way in backend_of(g).shared_memory_choices() if setup not in sizes)
        c.identical(f"{label}: the choices", np.frombuffer(repr(choices).encode().ljust(400), np.uint8))
        if label.startswith("one copy"):
            c.equal(f"{label}: the choices", choices,
                    [("all_gather_into_tensor", "shared memory, one copy"), ("broadcast", "shared memory, one copy")])  # fmt: skip
            said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("broadcast, 256 KiB-512 KiB")]
            c.true(f"{label}: the log of broadcast's choice: {said}",
                   len(said) == 1 and ": shared memory, one copy (" in said[0] and "; here: MPI " in said[0]
                   and ", one copy " in said[0])  # fmt: skip
            before = _chunks(g)
            _one_copy_calls(g, c, label + ", after the choice", nbytes, 99)
            c.equal(f"{label}: chunks through the segment after the choice (one per call)", _chunks(g) - before,
                    SIZE + 2)  # fmt: skip
        dist.destroy_process_group(g)
    c.done()


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_may_not_read_the_others_keeps_the_group_off_the_one_copy_variant(monkeypatch):
    """Where the kernel refuses one rank's read of another's memory (Yama, seccomp, another user), or a rank sets
    MPIDIST_SHM_ONE_COPY=0, no rank of the group measures the variant, and every result is right."""
    if shm._read_from is None:
        pytest.skip("the C module is not built: no one-copy variant")

    def refused(*_: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    c = Checks()
    monkeypatch.setattr(shm_choice, "skew", (1e4, 1e4, 1.0))
    for label, env in [("rank 1 refused", {}), ("rank 1 sets MPIDIST_SHM_ONE_COPY=0", {"MPIDIST_SHM_ONE_COPY": "0"})]:
        with monkeypatch.context() as m:
            if RANK == 1 and not env:
                m.setattr(shm, "_read_from", refused)
            g = group_under(dist, env if RANK == 1 else {})
            nbytes = shm_choice.ONE_COPY_FLOOR
            for k in range(shm_choice.CHOSEN_AT + 1):
                _one_copy_calls(g, c, label, nbytes, k)
        path = backend_of(g).shared_memory()
        c.true(f"{label}: the group measures the one-copy variant", path is not None and not path.one_copy)
        ways = [way for _, _, _, way in backend_of(g).shared_memory_choices()]
        c.true(f"{label}: no class measured: {ways}", len(ways) >= 3)
        c.true(f"{label}: a choice of one copy: {ways}", all("one copy" not in w for w in ways))
        dist.destroy_process_group(g)
    c.done()
