"""Debug levels: OFF/INFO/DETAIL, the per-call trace (INFO) and the cross-rank checks (DETAIL).

Every test is SPMD and leaves the process-wide debug level at OFF (see the
autouse fixture). Mismatch tests give each rank a different call on purpose;
the DETAIL check must raise the same DistError on every rank before any data
moves, so each of them ends with a correct collective on the same group to show
that the group (and its sequence numbers) is still in step. Problems are
collected per rank and decided together, so no rank runs ahead into a
collective while another one fails.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import numpy as np
import pytest

import mpidist as dist
from mpidist.backends.mpi import MPIBackend
from mpidist.diagnose.debug import Call, DebugBackend, verdict
from mpidist.errors import DistBackendError, DistError
from mpidist.testing import backend_of, calls_issued, p2p_calls_issued

from helpers import assert_equal, check_raises, fail_together, meet_outside_mpidist, rank_input, reference

L = dist.DebugLevel
R = dist.ReduceOp
LOGGER = logging.getLogger("mpidist")
F8 = np.dtype(np.float64)

#: the end of every trace line: bytes and a duration in microseconds
_TAIL = r"(\d+) B \d+\.\d us"


@pytest.fixture(autouse=True)
def _debug_off():
    """Leave the debug level at OFF and the ``mpidist`` logger as it was, whatever the test did."""
    handlers, level = list(LOGGER.handlers), LOGGER.level
    try:
        yield
    finally:
        try:
            dist.set_debug_level(L.OFF)
        finally:
            LOGGER.handlers[:] = handlers
            LOGGER.setLevel(level)


@pytest.fixture
def no_debug_env(monkeypatch):
    monkeypatch.delenv("MPIDIST_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    return monkeypatch


def _trace_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mpidist"]


def _world_name() -> str:
    return dist.group.WORLD.group_name


# ---------------------------------------------------------------------------------------
# DebugLevel, set/get, the environment
# ---------------------------------------------------------------------------------------


def test_debug_level_values_and_names():
    assert [(m.name, int(m)) for m in L] == [("OFF", 0), ("INFO", 1), ("DETAIL", 2)]
    assert issubclass(L, int)
    assert dist.get_debug_level() is L.OFF  # the suite runs at OFF unless a test changes it


def test_debug_level_matches_torch():
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    assert {m.name: int(m.value) for m in c10d.DebugLevel.__members__.values()} == {m.name: int(m) for m in L}


@pytest.mark.parametrize(
    "value, expected",
    [
        (L.INFO, L.INFO),
        (L.DETAIL, L.DETAIL),
        (L.OFF, L.OFF),
        ("INFO", L.INFO),
        ("info", L.INFO),
        ("Detail", L.DETAIL),
        (" detail\n", L.DETAIL),
        ("off", L.OFF),
        (0, L.OFF),
        (1, L.INFO),
        (2, L.DETAIL),
    ],
)
def test_set_and_get_debug_level(value, expected):
    dist.set_debug_level(L.INFO if expected is L.OFF else L.OFF)  # start from another level
    dist.set_debug_level(value)
    got = dist.get_debug_level()
    assert got is expected
    assert isinstance(got, L)


@pytest.mark.parametrize(
    "value, match",
    [
        ("verbose", r"^set_debug_level: debug level 'verbose' is not one of OFF, INFO, DETAIL$"),
        ("", r"^set_debug_level: debug level '' is not one of OFF, INFO, DETAIL$"),
        ("DETAILS", r"^set_debug_level: debug level 'DETAILS' is not one of OFF, INFO, DETAIL$"),
        (3, r"^set_debug_level: debug level 3 is not one of 0 \(OFF\), 1 \(INFO\), 2 \(DETAIL\)$"),
        (-1, r"^set_debug_level: debug level -1 is not one of 0 \(OFF\), 1 \(INFO\), 2 \(DETAIL\)$"),
    ],
)
def test_set_debug_level_bad_value(value, match):
    dist.set_debug_level(L.INFO)
    with pytest.raises(ValueError, match=match):
        dist.set_debug_level(value)
    assert dist.get_debug_level() is L.INFO  # unchanged


@pytest.mark.parametrize("value", [None, 1.0, True, False, [1], b"INFO"])
def test_set_debug_level_bad_type(value):
    with pytest.raises(
        TypeError,
        match=rf"^set_debug_level: level must be a DebugLevel, its name or its number, got {type(value).__name__}$",
    ):
        dist.set_debug_level(value)
    assert dist.get_debug_level() is L.OFF


@pytest.mark.parametrize(
    "mpidist_env, torch_env, expected",
    [
        ("INFO", None, L.INFO),
        ("detail", None, L.DETAIL),
        (" off ", None, L.OFF),
        (None, "DETAIL", L.DETAIL),  # torch's variable is honoured when MPIDIST_DEBUG is unset
        (None, "info", L.INFO),
        ("", "DETAIL", L.DETAIL),  # an empty MPIDIST_DEBUG counts as unset
        ("INFO", "DETAIL", L.INFO),  # MPIDIST_DEBUG takes precedence
        ("OFF", "DETAIL", L.OFF),
        ("DETAIL", "bogus", L.DETAIL),  # the variable that is not used is not read
        (None, None, L.OFF),
    ],
)
def test_set_debug_level_from_env(no_debug_env, mpidist_env, torch_env, expected):
    dist.set_debug_level(L.DETAIL if expected is not L.DETAIL else L.INFO)  # from must differ from to
    if mpidist_env is not None:
        no_debug_env.setenv("MPIDIST_DEBUG", mpidist_env)
    if torch_env is not None:
        no_debug_env.setenv("TORCH_DISTRIBUTED_DEBUG", torch_env)
    dist.set_debug_level_from_env()
    assert dist.get_debug_level() is expected


@pytest.mark.parametrize(
    "var, other, value",
    [("MPIDIST_DEBUG", None, "loud"), ("MPIDIST_DEBUG", "INFO", "3"), ("TORCH_DISTRIBUTED_DEBUG", None, "VERBOSE")],
)
def test_set_debug_level_from_env_invalid(no_debug_env, var, other, value):
    no_debug_env.setenv(var, value)
    if other is not None:
        no_debug_env.setenv("TORCH_DISTRIBUTED_DEBUG", other)
    dist.set_debug_level(L.INFO)
    with pytest.raises(ValueError, match=rf"^{var}={re.escape(repr(value))} must be OFF, INFO or DETAIL$"):
        dist.set_debug_level_from_env()
    assert dist.get_debug_level() is L.INFO  # unchanged


def test_init_process_group_reads_the_environment(no_debug_env):
    """init_process_group sets the level from the environment (MPIDIST_DEBUG over torch's)."""
    from mpidist.testing import PG_TIMEOUT_S, init_default_group

    problems: list[str] = []
    dist.destroy_process_group()
    try:
        no_debug_env.setenv("MPIDIST_DEBUG", "info")
        no_debug_env.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
        dist.init_process_group(timeout=PG_TIMEOUT_S)
        if dist.get_debug_level() is not L.INFO:
            problems.append(f"MPIDIST_DEBUG=info: level {dist.get_debug_level()!r}")
        if not isinstance(backend_of(), DebugBackend):
            problems.append(f"MPIDIST_DEBUG=info: WORLD backend is {type(backend_of()).__name__}")
        x = np.full(3, dist.get_rank() + 1.0)
        dist.all_reduce(x)
        if not np.array_equal(x, np.full(3, sum(range(1, dist.get_world_size() + 1)), F8)):
            problems.append(f"all_reduce after init at INFO: {x}")
        dist.destroy_process_group()

        no_debug_env.delenv("MPIDIST_DEBUG")
        dist.init_process_group(timeout=PG_TIMEOUT_S)
        if dist.get_debug_level() is not L.DETAIL:
            problems.append(f"TORCH_DISTRIBUTED_DEBUG=DETAIL: level {dist.get_debug_level()!r}")
        dist.destroy_process_group()

        no_debug_env.delenv("TORCH_DISTRIBUTED_DEBUG")
        dist.init_process_group(timeout=PG_TIMEOUT_S)
        if dist.get_debug_level() is not L.OFF:
            problems.append(f"no variable: level {dist.get_debug_level()!r}")
        if type(backend_of()) is not MPIBackend:
            problems.append(f"no variable: WORLD backend is {type(backend_of()).__name__}")
    finally:
        init_default_group()
    fail_together(problems)


def test_info_says_where_the_start_up_time_went(no_debug_env, caplog):
    """At INFO, init_process_group logs one line per rank: its time and each phase's (MPI start, Dup, store, ...)."""
    from mpidist.testing import PG_TIMEOUT_S, init_default_group

    caplog.set_level(logging.INFO, logger="mpidist")
    problems: list[str] = []
    dist.destroy_process_group()
    try:
        for level in ("INFO", "OFF"):
            no_debug_env.setenv("MPIDIST_DEBUG", level)
            caplog.clear()
            dist.init_process_group(timeout=PG_TIMEOUT_S)
            rank, size = dist.get_rank(), dist.get_world_size()
            lines = [line for line in _trace_lines(caplog) if line.startswith("init_process_group:")]
            dist.destroy_process_group()
            if level == "OFF":
                if lines:
                    problems.append(f"MPIDIST_DEBUG=OFF logged {lines}")
                continue
            if len(lines) != 1:
                problems.append(f"MPIDIST_DEBUG=INFO: {len(lines)} start-up lines, expected 1: {lines}")
                continue
            head = rf"^init_process_group: rank {rank} of {size} in (\d+\.\d{{3}}) s: "
            match = re.match(head, lines[0])
            phases = dict(
                re.findall(r"(?:^|, |: )([a-zA-Z][a-zA-Z ]*?) (\d+\.\d{3}) s", lines[0][len("init_process_group") :])
            )
            wanted = {
                "MPI start",
                "Idup",
                "agreement on rank and size",
                "node split",
                "Dup",
                "default store",
                "default group",
            }
            if match is None or not wanted <= set(phases):
                problems.append(f"the start-up line {lines[0]!r} lacks the total or one of {sorted(wanted)}")
            elif sum(float(v) for v in phases.values()) > float(match.group(1)) + 0.01:
                problems.append(f"the phases of {lines[0]!r} add up to more than the total")
    finally:
        no_debug_env.delenv("MPIDIST_DEBUG")
        init_default_group()
    fail_together(problems)


# ---------------------------------------------------------------------------------------
# the wrapper comes and goes with the level
# ---------------------------------------------------------------------------------------


def test_backend_is_wrapped_only_above_off(world_size):
    world = dist.group.WORLD
    assert type(backend_of(world)) is MPIBackend  # OFF: the plain backend
    before = dist.new_group()
    for level in (L.INFO, L.DETAIL):
        dist.set_debug_level(level)
        for pg in (world, before):
            assert type(backend_of(pg)) is DebugBackend, (level, pg)
            assert type(backend_of(pg).inner) is MPIBackend  # wrapped once, never twice
        during = dist.new_group()
        assert type(backend_of(during)) is DebugBackend
        assert type(backend_of(during).inner) is MPIBackend
        assert during.rank() == dist.get_rank() and during.size() == world_size  # delegated
        x = np.ones(2)
        dist.all_reduce(x, group=during)
        assert np.array_equal(x, np.full(2, float(world_size)))
    dist.set_debug_level(L.OFF)
    after = dist.new_group()
    for pg in (world, before, during, after):
        assert type(backend_of(pg)) is MPIBackend, pg


def test_set_debug_level_attaches_a_stderr_handler_once(monkeypatch):
    # nobody logs anywhere (pytest's own handlers on the root logger removed for this test)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    LOGGER.handlers[:] = []
    dist.set_debug_level(L.INFO)
    assert len(LOGGER.handlers) == 1
    assert type(LOGGER.handlers[0]) is logging.StreamHandler
    assert LOGGER.getEffectiveLevel() <= logging.INFO
    dist.set_debug_level(L.DETAIL)
    dist.set_debug_level(L.OFF)
    dist.set_debug_level(L.INFO)
    assert len(LOGGER.handlers) == 1  # not one more per call


def test_set_debug_level_leaves_configured_logging_alone(monkeypatch):
    """With the root logger configured (logging.basicConfig), lines go there once, not twice."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    monkeypatch.setattr(logging.getLogger(), "handlers", [Collect()])
    LOGGER.handlers[:] = []
    dist.set_debug_level(L.INFO)
    assert LOGGER.handlers == []  # no handler of mpidist's own: the root's prints
    dist.all_reduce(np.ones(2))
    assert len([m for m in seen if "all_reduce float64[2]" in m]) == 1


# ---------------------------------------------------------------------------------------
# INFO: one trace line per call per rank
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [L.INFO, L.DETAIL])
def test_trace_one_line_per_collective(caplog, rank, world_size, level):
    caplog.set_level(logging.INFO, logger="mpidist")
    dist.set_debug_level(level)
    n = world_size
    pg = dist.group.WORLD
    g = dist.new_group()
    seq, gseq = calls_issued(pg), calls_issued(g)
    caplog.clear()

    x = np.ones(4)
    dist.all_reduce(x)
    y = np.arange(6, dtype=np.int32).reshape(2, 3)
    dist.broadcast(y, src=n - 1)
    out = np.empty(2 * n, np.float32)
    dist.all_gather_into_tensor(out, np.ones(2, np.float32))
    dist.all_reduce(np.ones(5, np.int16), op=R.MAX, group=g)
    dist.barrier()
    w = dist.all_reduce(np.ones(3), async_op=True)
    w.wait()
    z = np.ones(4)
    dist.reduce(z, dst=0, op=R.PRODUCT)

    name, gname = pg.group_name, g.group_name
    head = rf"^\[rank {rank}\] group={name} "
    expected = [
        head + rf"#{seq + 1} all_reduce float64\[4\] op=SUM {_TAIL}$",
        head + rf"#{seq + 2} broadcast int32\[2, 3\] src={n - 1} {_TAIL}$",
        head + rf"#{seq + 3} all_gather_into_tensor float32\[2\] -> float32\[{2 * n}\] {_TAIL}$",
        rf"^\[rank {rank}\] group={gname} #{gseq + 1} all_reduce int16\[5\] op=MAX {_TAIL}$",
        head + rf"#{seq + 4} barrier {_TAIL}$",
        head + rf"#{seq + 5} all_reduce float64\[3\] op=SUM {_TAIL} \(async, posted\)$",
        head + rf"#{seq + 6} reduce float64\[4\] op=PRODUCT dst=0 {_TAIL}$",
    ]
    nbytes = [32, 24, 8, 10, 0, 24, 32]
    lines = _trace_lines(caplog)
    problems = []
    if len(lines) != len(expected):
        problems.append(f"{len(lines)} trace lines for {len(expected)} calls: {lines}")
    else:
        for line, pattern, b in zip(lines, expected, nbytes):
            m = re.search(pattern, line)
            if not m:
                problems.append(f"{line!r} does not match {pattern!r}")
            elif int(m.group(1)) != b:
                problems.append(f"{line!r}: expected {b} bytes")
    if not np.array_equal(x, np.full(4, float(n))):
        problems.append(f"all_reduce result {x}")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", [L.INFO, L.DETAIL])
def test_trace_p2p_lines(caplog, rank, world_size, level):
    """send and recv each log one line on their own rank (p2p is traced, not checked)."""
    caplog.set_level(logging.INFO, logger="mpidist")
    dist.set_debug_level(level)
    p2p = p2p_calls_issued()
    caplog.clear()
    buf = np.arange(3.0) if rank == 0 else np.zeros(3)
    got_from = None
    if rank == 0:
        dist.send(buf, dst=1, tag=7)
        dist.send(buf * 2, dst=1, tag=8)
    elif rank == 1:
        dist.recv(buf, src=0, tag=7)
        second = np.zeros(3)
        got_from = dist.recv(second, tag=8)  # any source
    lines = _trace_lines(caplog)
    name = _world_name()
    problems = []
    if rank == 0:
        expected = [
            rf"^\[rank 0\] send group={name} p2p#{p2p + 1} float64\[3\] peer=1 tag=7 {_TAIL} \(posted\)$",
            rf"^\[rank 0\] send group={name} p2p#{p2p + 2} float64\[3\] peer=1 tag=8 {_TAIL} \(posted\)$",
        ]
    elif rank == 1:
        expected = [
            rf"^\[rank 1\] recv group={name} p2p#{p2p + 1} float64\[3\] peer=0 tag=7 {_TAIL} \(posted\)$",
            rf"^\[rank 1\] recv group={name} p2p#{p2p + 2} float64\[3\] peer=any tag=8 {_TAIL} \(posted\)$",
        ]
        if not np.array_equal(buf, np.arange(3.0)) or not np.array_equal(second, np.arange(3.0) * 2) or got_from != 0:
            problems.append(f"received {buf}, {second} from {got_from}")
    else:
        expected = []
    if len(lines) != len(expected):
        problems.append(f"{len(lines)} trace lines, expected {len(expected)}: {lines}")
    for line, pattern in zip(lines, expected):
        m = re.search(pattern, line)
        if not m or int(m.group(1)) != 24:
            problems.append(f"{line!r} does not match {pattern!r} with 24 bytes")
    fail_together(problems)


@pytest.mark.mpi(min_size=3)
def test_trace_p2p_on_a_subgroup_names_the_peer_by_global_rank(caplog, rank):
    """On group [1, 2] the line of global rank 1 says peer=2, as its own "[rank 1]" and collectives' src= do.

    (A group rank there, peer=1 on global rank 1, would read as a message to itself.)
    """
    g = dist.new_group([1, 2])
    caplog.set_level(logging.INFO, logger="mpidist")
    dist.set_debug_level(L.INFO)
    caplog.clear()
    buf = np.arange(2.0) if rank == 1 else np.zeros(2)
    if rank == 1:
        dist.send(buf, dst=2, group=g)
    elif rank == 2:
        dist.recv(buf, src=1, group=g)
    lines = _trace_lines(caplog)
    problems = []
    if rank in (1, 2):
        op, peer = ("send", 2) if rank == 1 else ("recv", 1)
        pattern = (
            rf"^\[rank {rank}\] {op} group={g.group_name} p2p#1 float64\[2\] peer={peer} tag=0 {_TAIL} \(posted\)$"
        )
        if len(lines) != 1 or not re.search(pattern, lines[0]):
            problems.append(f"trace lines {lines} do not match {pattern!r}")
        if not np.array_equal(buf, np.arange(2.0)):
            problems.append(f"data {buf}")
    elif lines:
        problems.append(f"a non-member logged {lines}")
    fail_together(problems)


def test_no_trace_at_off(caplog):
    caplog.set_level(logging.INFO, logger="mpidist")
    dist.set_debug_level(L.INFO)
    dist.set_debug_level(L.OFF)
    caplog.clear()
    x = np.ones(4)
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    dist.barrier()
    assert _trace_lines(caplog) == []


def test_trace_line_for_a_subgroup_names_it_and_the_global_rank(caplog, rank, world_size):
    members = list(range(world_size))[::2]  # 0, 2, ...
    g = dist.new_group(members)
    caplog.set_level(logging.INFO, logger="mpidist")
    dist.set_debug_level(L.INFO)
    caplog.clear()
    x = np.ones(2)
    dist.all_reduce(x, group=g)
    lines = _trace_lines(caplog)
    if rank in members:
        assert len(lines) == 1, lines
        assert re.search(rf"^\[rank {rank}\] group={g.group_name} #1 all_reduce float64\[2\] op=SUM {_TAIL}$", lines[0])
        assert np.array_equal(x, np.full(2, float(len(members))))
    else:
        assert lines == []
        assert np.array_equal(x, np.ones(2))


# ---------------------------------------------------------------------------------------
# results stay correct above OFF
# ---------------------------------------------------------------------------------------


def _every_collective(rank: int, n: int) -> list[str]:
    """Run every collective once (and p2p, objects); return what differs from numpy references."""
    problems: list[str] = []

    def eq(what: str, got: Any, expected: np.ndarray) -> None:
        try:
            assert_equal(np.asarray(got), expected)
        except AssertionError as exc:
            problems.append(f"{what}: {exc}")

    shape = (2, 3)
    inputs = [rank_input(r, shape, F8) for r in range(n)]
    mine = inputs[rank]
    block = [[rank_input(r, shape, F8, salt=j) for j in range(n)] for r in range(n)]  # block[r][j]: r -> j

    for root in range(n):
        x = mine.copy()
        dist.broadcast(x, src=root)
        eq(f"broadcast src={root}", x, inputs[root])
    for op in (R.SUM, R.MAX, R.AVG, R.PRODUCT):
        x = mine.copy()
        dist.all_reduce(x, op=op)
        eq(f"all_reduce {op}", x, reference(inputs, op))
    ints = [rank_input(r, (5,), np.dtype(np.int32)) for r in range(n)]
    x = ints[rank].copy()
    dist.all_reduce(x, op=R.BXOR)
    eq("all_reduce int32 BXOR", x, reference(ints, R.BXOR))
    x = mine.copy()
    dist.reduce(x, dst=n - 1, op=R.MIN)
    eq("reduce", x, reference(inputs, R.MIN) if rank == n - 1 else mine)
    outs = [np.empty(shape) for _ in range(n)]
    dist.all_gather(outs, mine)
    for r in range(n):
        eq(f"all_gather[{r}]", outs[r], inputs[r])
    out = np.empty((2 * n, 3))
    dist.all_gather_into_tensor(out, mine)
    eq("all_gather_into_tensor", out, np.concatenate(inputs))
    gl = [np.empty(shape) for _ in range(n)] if rank == 0 else None
    dist.gather(mine, gl, dst=0)
    if rank == 0:
        for r in range(n):
            eq(f"gather[{r}]", gl[r], inputs[r])
    out = np.empty(shape)
    dist.scatter(out, list(block[n - 1]) if rank == n - 1 else None, src=n - 1)
    eq("scatter", out, block[n - 1][rank])
    out = np.empty(shape)
    dist.reduce_scatter(out, [b.copy() for b in block[rank]])
    eq("reduce_scatter", out, reference([block[r][rank] for r in range(n)], R.SUM))
    out = np.empty(shape)
    dist.reduce_scatter_tensor(out, np.concatenate(block[rank]), op=R.MAX)
    eq("reduce_scatter_tensor", out, reference([block[r][rank] for r in range(n)], R.MAX))
    out = np.empty((2 * n, 3))
    dist.all_to_all_single(out, np.concatenate(block[rank]))
    eq("all_to_all_single", out, np.concatenate([block[r][rank] for r in range(n)]))
    outs = [np.empty(shape) for _ in range(n)]
    dist.all_to_all(outs, [b.copy() for b in block[rank]])
    for r in range(n):
        eq(f"all_to_all[{r}]", outs[r], block[r][rank])
    dist.barrier()
    x = mine.copy()
    dist.all_reduce(x, async_op=True).wait()
    eq("async all_reduce", x, reference(inputs, R.SUM))
    a, b = mine.copy(), mine[0].copy()
    dist.all_reduce_coalesced([a, b])
    eq("all_reduce_coalesced[0]", a, reference(inputs, R.SUM))
    eq("all_reduce_coalesced[1]", b, reference([i[0] for i in inputs], R.SUM))
    lists = [[np.empty(shape), np.empty(3)] for _ in range(n)]
    dist.all_gather_coalesced(lists, [mine, mine[1]])
    for r in range(n):
        eq(f"all_gather_coalesced[{r}][0]", lists[r][0], inputs[r])
        eq(f"all_gather_coalesced[{r}][1]", lists[r][1], inputs[r][1])
    objs = [{"rank": rank}, "x"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    if objs != [{"rank": 0}, "x"]:
        problems.append(f"broadcast_object_list: {objs}")
    slots: list[Any] = [None] * n
    dist.all_gather_object(slots, ("r", rank))
    if slots != [("r", r) for r in range(n)]:
        problems.append(f"all_gather_object: {slots}")
    if n > 1:
        got = np.empty(shape)
        works = [dist.isend(mine, dst=(rank + 1) % n), dist.irecv(got, src=(rank - 1) % n)]
        for w in works:
            w.wait()
        eq("isend/irecv ring", got, inputs[(rank - 1) % n])
    return problems


@pytest.mark.parametrize("level", [L.OFF, L.INFO, L.DETAIL])
def test_every_collective_correct_at_each_level(rank, world_size, level, caplog):
    caplog.set_level(logging.INFO, logger="mpidist")
    dist.set_debug_level(level)
    seq = calls_issued(dist.group.WORLD)
    problems = _every_collective(rank, world_size)
    calls = calls_issued(dist.group.WORLD) - seq
    lines = _trace_lines(caplog)
    # every collective call above is one backend call; the object collectives are not traced
    want = 0 if level is L.OFF else calls + (2 if world_size > 1 else 0)
    if len(lines) != want:
        problems.append(f"{len(lines)} trace lines for {calls} collectives (+ p2p): expected {want}")
    fail_together(problems)


# ---------------------------------------------------------------------------------------
# DETAIL: mismatches raise on every rank, before any data moves
# ---------------------------------------------------------------------------------------


class Case(NamedTuple):
    call: Callable[[], Any]
    texts: list[str]  # what each rank called, as the listing shows it
    reason: str  # regex for why the calls do not fit
    untouched: list[np.ndarray]  # arrays that must keep their contents (nothing was sent)


def _filled(size: int | tuple[int, ...], rank: int, dtype: Any = F8) -> np.ndarray:
    return np.full(size, rank + 1, dtype)


def _case_collective(rank: int, n: int) -> Case:
    x = _filled(4, rank)
    if rank == 0:
        return Case(lambda: dist.broadcast(x, src=0), _texts(n, "broadcast float64[4] src=0", "all_reduce float64[4] op=SUM"),
                    "the ranks called different collectives", [x])  # fmt: skip
    return Case(lambda: dist.all_reduce(x), _texts(n, "broadcast float64[4] src=0", "all_reduce float64[4] op=SUM"),
                "the ranks called different collectives", [x])  # fmt: skip


def _case_barrier_vs_all_reduce(rank: int, n: int) -> Case:
    x = _filled(4, rank)
    call = dist.barrier if rank == 0 else (lambda: dist.all_reduce(x))
    return Case(
        call, _texts(n, "barrier", "all_reduce float64[4] op=SUM"), "the ranks called different collectives", [x]
    )


def _texts(n: int, first: str, rest: str) -> list[str]:
    return [first] + [rest] * (n - 1)


def _case_size_all_reduce(rank: int, n: int) -> Case:
    x = _filled(10 if rank == 0 else 20, rank)
    return Case(lambda: dist.all_reduce(x), _texts(n, "all_reduce float64[10] op=SUM", "all_reduce float64[20] op=SUM"),
                "the ranks passed different array sizes", [x])  # fmt: skip


def _case_size_broadcast(rank: int, n: int) -> Case:
    x = _filled(10 if rank == 0 else 20, rank)
    return Case(lambda: dist.broadcast(x, src=0), _texts(n, "broadcast float64[10] src=0", "broadcast float64[20] src=0"),
                "the ranks passed different array sizes", [x])  # fmt: skip


def _case_size_all_gather_into_tensor(rank: int, n: int) -> Case:
    m = 10 if rank == 0 else 20
    inp, out = _filled(m, rank), _filled(n * m, rank)
    return Case(
        lambda: dist.all_gather_into_tensor(out, inp),
        _texts(n, f"all_gather_into_tensor float64[10] -> float64[{10 * n}]",
               f"all_gather_into_tensor float64[20] -> float64[{20 * n}]"),
        "the ranks passed different array sizes", [out],
    )  # fmt: skip


def _case_size_reduce_scatter_tensor(rank: int, n: int) -> Case:
    m = 10 if rank == 0 else 20
    inp, out = _filled(n * m, rank), _filled(m, rank)
    return Case(
        lambda: dist.reduce_scatter_tensor(out, inp),
        _texts(n, f"reduce_scatter_tensor float64[{10 * n}] -> float64[10] op=SUM",
               f"reduce_scatter_tensor float64[{20 * n}] -> float64[20] op=SUM"),
        "the ranks passed different array sizes", [out],
    )  # fmt: skip


def _case_dtype(rank: int, n: int) -> Case:
    x = _filled(4, rank, F8 if rank == 0 else np.float32)
    return Case(lambda: dist.all_reduce(x), _texts(n, "all_reduce float64[4] op=SUM", "all_reduce float32[4] op=SUM"),
                "the ranks passed different dtypes", [x])  # fmt: skip


def _root(rank: int) -> int:
    return min(rank, 1)  # ranks 0 and 1 each think they are the root; others follow rank 1


def _case_root_broadcast(rank: int, n: int) -> Case:
    x = _filled(4, rank)
    return Case(lambda: dist.broadcast(x, src=_root(rank)), [f"broadcast float64[4] src={_root(r)}" for r in range(n)],
                r"the ranks passed different roots \(src/dst\)", [x])  # fmt: skip


def _case_root_reduce(rank: int, n: int) -> Case:
    x = _filled(4, rank)
    return Case(lambda: dist.reduce(x, dst=_root(rank)), [f"reduce float64[4] op=SUM dst={_root(r)}" for r in range(n)],
                r"the ranks passed different roots \(src/dst\)", [x])  # fmt: skip


def _case_root_gather(rank: int, n: int) -> Case:
    x = _filled(4, rank)
    gl = [_filled(4, rank) for _ in range(n)] if rank == _root(rank) else None
    return Case(lambda: dist.gather(x, gl, dst=_root(rank)), [f"gather float64[4] dst={_root(r)}" for r in range(n)],
                r"the ranks passed different roots \(src/dst\)", gl or [x])  # fmt: skip


def _case_root_scatter(rank: int, n: int) -> Case:
    out = _filled(4, rank)
    sl = [_filled(4, 10 + j) for j in range(n)] if rank == _root(rank) else None
    return Case(lambda: dist.scatter(out, sl, src=_root(rank)), [f"scatter float64[4] src={_root(r)}" for r in range(n)],
                r"the ranks passed different roots \(src/dst\)", [out])  # fmt: skip


def _case_op_all_reduce(rank: int, n: int) -> Case:
    x = _filled(4, rank)
    op = R.SUM if rank == 0 else R.MAX
    return Case(lambda: dist.all_reduce(x, op=op), _texts(n, "all_reduce float64[4] op=SUM", "all_reduce float64[4] op=MAX"),
                "the ranks passed different reduction ops", [x])  # fmt: skip


def _case_op_reduce(rank: int, n: int) -> Case:
    x = _filled(4, rank)
    op = R.MIN if rank == n - 1 else R.SUM
    return Case(lambda: dist.reduce(x, dst=0, op=op),
                [f"reduce float64[4] op={'MIN' if r == n - 1 else 'SUM'} dst=0" for r in range(n)],
                "the ranks passed different reduction ops", [x])  # fmt: skip


def _case_op_reduce_scatter_tensor(rank: int, n: int) -> Case:
    inp, out = _filled(2 * n, rank), _filled(2, rank)
    op = R.SUM if rank == 0 else R.PRODUCT
    return Case(
        lambda: dist.reduce_scatter_tensor(out, inp, op=op),
        _texts(n, f"reduce_scatter_tensor float64[{2 * n}] -> float64[2] op=SUM",
               f"reduce_scatter_tensor float64[{2 * n}] -> float64[2] op=PRODUCT"),
        "the ranks passed different reduction ops", [out],
    )  # fmt: skip


def _case_all_to_all_single_splits(rank: int, n: int) -> Case:
    """Rank 0 sends 2 rows (of 3 elements) to rank 1, which expects 1 row from rank 0."""
    in_splits = [1] * n
    if rank == 0:
        in_splits[1] = 2
    inp, out = _filled((sum(in_splits), 3), rank), _filled((n, 3), rank)
    return Case(
        lambda: dist.all_to_all_single(out, inp, output_split_sizes=[1] * n, input_split_sizes=in_splits),
        _texts(n, f"all_to_all_single float64[{n + 1}, 3] -> float64[{n}, 3]",
               f"all_to_all_single float64[{n}, 3] -> float64[{n}, 3]"),
        "all_to_all_single splits: rank 0 sends 6 elements to rank 1, which expects 3", [out],
    )  # fmt: skip


def _case_all_gather_slots(rank: int, n: int) -> Case:
    """Rank 0's slot for rank 1 has 5 elements; rank 1 sends 4."""
    outs = [_filled(5 if (rank == 0 and j == 1) else 4, rank) for j in range(n)]
    x = _filled(4, rank)
    return Case(lambda: dist.all_gather(outs, x), [f"all_gather float64[4] into {n} arrays"] * n,
                "all_gather: rank 0 expects 5 elements from rank 1, which sends 4", outs)  # fmt: skip


def _case_gather_sizes(rank: int, n: int) -> Case:
    x = _filled(4, rank)
    gl = [_filled(5 if j == 1 else 4, rank) for j in range(n)] if rank == 0 else None
    return Case(lambda: dist.gather(x, gl, dst=0), ["gather float64[4] dst=0"] * n,
                "gather: the root's array for rank 1 has 5 elements, rank 1's has 4", gl or [x])  # fmt: skip


def _case_scatter_sizes(rank: int, n: int) -> Case:
    out = _filled(4, rank)
    sl = [_filled(5 if j == 1 else 4, 10 + j) for j in range(n)] if rank == 0 else None
    return Case(lambda: dist.scatter(out, sl, src=0), ["scatter float64[4] src=0"] * n,
                "scatter: the root's array for rank 1 has 5 elements, rank 1's has 4", [out])  # fmt: skip


def _case_reduce_scatter_sizes(rank: int, n: int) -> Case:
    sizes = [5 if (rank == 0 and j == 1) else 4 for j in range(n)]
    ins, out = [_filled(s, rank) for s in sizes], _filled(4, rank)
    rank0 = [5 if j == 1 else 4 for j in range(n)]
    return Case(
        lambda: dist.reduce_scatter(out, ins), [f"reduce_scatter {n} arrays -> float64[4] op=SUM"] * n,
        re.escape(f"reduce_scatter: rank 1's inputs have sizes {[4] * n}, rank 0's {rank0}"), [out],
    )  # fmt: skip


def _case_all_to_all_sizes(rank: int, n: int) -> Case:
    """Rank 0 sends 5 elements to rank 1, which has room for 4 from rank 0."""
    ins = [_filled(5 if (rank == 0 and j == 1) else 4, rank) for j in range(n)]
    outs = [_filled(4, rank) for _ in range(n)]
    texts = [f"all_to_all float64 sizes {[5 if (r == 0 and j == 1) else 4 for j in range(n)]} -> {[4] * n}"
             for r in range(n)]  # fmt: skip
    return Case(lambda: dist.all_to_all(outs, ins), texts,
                "all_to_all: rank 0 sends 5 elements to rank 1, which expects 4", outs)  # fmt: skip


def _case_async_size(rank: int, n: int) -> Case:
    """async_op=True: the check runs (and raises) at the call, not at wait()."""
    x = _filled(10 if rank == 0 else 20, rank)
    return Case(lambda: dist.all_reduce(x, async_op=True),
                _texts(n, "all_reduce float64[10] op=SUM", "all_reduce float64[20] op=SUM"),
                "the ranks passed different array sizes", [x])  # fmt: skip


MISMATCHES = {
    "collective": _case_collective,
    "barrier-vs-all_reduce": _case_barrier_vs_all_reduce,
    "size-all_reduce": _case_size_all_reduce,
    "size-broadcast": _case_size_broadcast,
    "size-all_gather_into_tensor": _case_size_all_gather_into_tensor,
    "size-reduce_scatter_tensor": _case_size_reduce_scatter_tensor,
    "dtype-all_reduce": _case_dtype,
    "root-broadcast": _case_root_broadcast,
    "root-reduce": _case_root_reduce,
    "root-gather": _case_root_gather,
    "root-scatter": _case_root_scatter,
    "op-all_reduce": _case_op_all_reduce,
    "op-reduce": _case_op_reduce,
    "op-reduce_scatter_tensor": _case_op_reduce_scatter_tensor,
    "splits-all_to_all_single": _case_all_to_all_single_splits,
    "slots-all_gather": _case_all_gather_slots,
    "sizes-gather": _case_gather_sizes,
    "sizes-scatter": _case_scatter_sizes,
    "sizes-reduce_scatter": _case_reduce_scatter_sizes,
    "sizes-all_to_all": _case_all_to_all_sizes,
    "async-size": _case_async_size,
}


def _expect_mismatch(case: Case, rank: int, group_name: str, seq: int, reason: str | None = None) -> list[str]:
    """Run ``case.call`` under DETAIL; return what is wrong with the DistError it must raise."""
    listing = " / ".join(f"rank {i}: {text}" for i, text in enumerate(case.texts))
    op = case.texts[rank].split()[0]
    match = (
        rf"^{op} \(call #{seq}\) on group {re.escape(group_name)}: {reason or case.reason}: {re.escape(listing)}\. "
        r"Nothing was sent; the group is still usable\.$"
    )
    before = [a.copy() for a in case.untouched]
    problems = check_raises(DistError, match, case.call)
    for i, (a, b) in enumerate(zip(case.untouched, before)):
        if not np.array_equal(a, b):
            problems.append(f"array {i} changed although nothing was to be sent: {b} -> {a}")
    return problems


def _still_in_step(pg: Any, n: int, rank: int, what: str) -> list[str]:
    """A correct (checked) collective on ``pg`` right after a mismatch works and gives the right data."""
    x = np.full(3, rank + 1.0)
    try:
        dist.all_reduce(x, group=pg)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        return [f"{what}: the next all_reduce raised {type(exc).__name__}: {exc}"]
    members = dist.get_process_group_ranks(pg)
    want = float(sum(r + 1 for r in members))
    return [] if np.array_equal(x, np.full(3, want)) else [f"{what}: the next all_reduce gave {x}, expected {want}"]


def test_dist_error_is_a_runtime_error():
    assert issubclass(DistError, RuntimeError)
    assert issubclass(DistBackendError, DistError)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_detail_mismatch_raises_on_every_rank(rank, world_size, name):
    dist.set_debug_level(L.DETAIL)
    pg = dist.group.WORLD
    case = MISMATCHES[name](rank, world_size)
    seq = calls_issued(pg)
    problems = _expect_mismatch(case, rank, pg.group_name, seq + 1)
    if calls_issued(pg) != seq:
        problems.append(f"the failed call used up a sequence number: {seq} -> {calls_issued(pg)}")
    problems += _still_in_step(pg, world_size, rank, name)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_detail_dtype_mismatch_in_all_to_all_shows_each_ranks_dtype(rank, world_size):
    """The listing must show what differs: here each rank's dtype (int64 on rank 0, int32 elsewhere)."""
    dist.set_debug_level(L.DETAIL)
    n = world_size
    dt = np.int64 if rank == 0 else np.int32
    ins, outs = [_filled(2, rank, dt) for _ in range(n)], [_filled(2, rank, dt) for _ in range(n)]
    before = [o.copy() for o in outs]
    problems = check_raises(
        DistError,
        r"the ranks passed different dtypes: rank 0: all_to_all [^/]*\bint64\b[^/]* / rank 1: all_to_all [^/]*\bint32\b",
        dist.all_to_all, outs, ins,
    )  # fmt: skip
    if not all(np.array_equal(a, b) for a, b in zip(outs, before)):
        problems.append("outputs changed although nothing was to be sent")
    problems += _still_in_step(dist.group.WORLD, n, rank, "after the all_to_all dtype mismatch")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_detail_mismatches_in_a_row_keep_the_group_usable(rank, world_size):
    """Several mismatches one after the other, then correct calls: every rank stays in step."""
    dist.set_debug_level(L.DETAIL)
    pg = dist.group.WORLD
    problems: list[str] = []
    for name in ("collective", "root-scatter", "sizes-all_to_all", "op-all_reduce"):
        case = MISMATCHES[name](rank, world_size)
        problems += _expect_mismatch(case, rank, pg.group_name, calls_issued(pg) + 1)
    problems += _every_collective(rank, world_size)
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_detail_mismatch_on_a_subgroup_lists_global_ranks(rank, world_size):
    members = list(range(1, world_size)) if world_size >= 3 else [0, 1]
    g = dist.new_group(members)
    dist.set_debug_level(L.DETAIL)
    problems: list[str] = []
    if rank in members:
        grank = g.rank()
        src = members[min(grank, 1)]  # group ranks 0 and 1 each name themselves (as global ranks)
        x = _filled(4, rank)
        case = Case(lambda: dist.broadcast(x, src=src, group=g),
                    [f"broadcast float64[4] src={members[min(i, 1)]}" for i in range(len(members))],
                    r"the ranks passed different roots \(src/dst\)", [x])  # fmt: skip
        problems += _expect_mismatch(case, grank, g.group_name, calls_issued(g) + 1)
        # group_src= (a group rank) is shown as the global rank too
        y = _filled(4, rank)
        case = Case(lambda: dist.reduce(y, group_dst=min(grank, 1), group=g),
                    [f"reduce float64[4] op=SUM dst={members[min(i, 1)]}" for i in range(len(members))],
                    r"the ranks passed different roots \(src/dst\)", [y])  # fmt: skip
        problems += _expect_mismatch(case, grank, g.group_name, calls_issued(g) + 1)
        problems += _still_in_step(g, len(members), rank, "subgroup")
        z = np.arange(4.0) if rank == members[-1] else np.zeros(4)
        dist.broadcast(z, src=members[-1], group=g)
        if not np.array_equal(z, np.arange(4.0)):
            problems.append(f"broadcast on the subgroup after the mismatch gave {z}")
    problems += _still_in_step(dist.group.WORLD, world_size, rank, "world after the subgroup mismatch")
    fail_together(problems)


# ---------------------------------------------------------------------------------------
# DETAIL: compatible uneven calls pass
# ---------------------------------------------------------------------------------------


def test_detail_accepts_uneven_all_to_all_single(rank, world_size):
    """Rank i sends i + 2j + 1 rows to rank j (rows of 2 elements); each value encodes (i, j, row)."""
    n = world_size
    dist.set_debug_level(L.DETAIL)
    in_splits = [rank + 2 * j + 1 for j in range(n)]
    out_splits = [i + 2 * rank + 1 for i in range(n)]

    def rows(i: int, j: int) -> np.ndarray:
        k = i + 2 * j + 1
        base = 1000 * i + 100 * j + np.arange(k, dtype=np.float64)
        return np.stack([base, -base], axis=1)

    inp = np.concatenate([rows(rank, j) for j in range(n)])
    out = np.full((sum(out_splits), 2), np.nan)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    assert_equal(out, np.concatenate([rows(i, rank) for i in range(n)]))


def test_detail_accepts_compatible_shapes(rank, world_size):
    """Arrays of the same size but different shapes (2x3 and 6) fit: the data moves as elements."""
    dist.set_debug_level(L.DETAIL)
    x = np.arange(6.0).reshape(2, 3) if rank == 0 else np.zeros(6)
    dist.broadcast(x, src=0)
    assert_equal(x.reshape(-1), np.arange(6.0))
    y = np.ones((3, 2)) if rank % 2 else np.ones(6)
    dist.all_reduce(y)
    assert_equal(y.reshape(-1), np.full(6, float(world_size)))


def test_detail_accepts_uneven_lists(rank, world_size):
    """all_gather, gather, scatter and all_to_all with per-rank sizes that fit together."""
    n = world_size
    dist.set_debug_level(L.DETAIL)
    problems: list[str] = []

    def val(i: int, j: int = 0) -> np.ndarray:  # rank i's array (for rank j): i + j + 1 elements
        return np.arange(i + j + 1, dtype=np.int64) + 100 * i + 10 * j

    outs = [np.full(i + 1, -1, np.int64) for i in range(n)]
    dist.all_gather(outs, val(rank))
    problems += [f"all_gather[{i}] = {outs[i]}" for i in range(n) if not np.array_equal(outs[i], val(i))]
    gl = [np.full(i + 1, -1, np.int64) for i in range(n)] if rank == n - 1 else None
    dist.gather(val(rank), gl, dst=n - 1)
    if gl is not None:
        problems += [f"gather[{i}] = {gl[i]}" for i in range(n) if not np.array_equal(gl[i], val(i))]
    out = np.full(rank + 1, -1, np.int64)
    dist.scatter(out, [val(0, j) for j in range(n)] if rank == 0 else None, src=0)
    if not np.array_equal(out, val(0, rank)):
        problems.append(f"scatter: {out}")
    outs = [np.full(i + rank + 1, -1, np.int64) for i in range(n)]
    dist.all_to_all(outs, [val(rank, j) for j in range(n)])
    problems += [f"all_to_all[{i}] = {outs[i]}" for i in range(n) if not np.array_equal(outs[i], val(i, rank))]
    fail_together(problems)


def _end_after_timeout(g: dist.ProcessGroup, problems: list[str], world_size: int, rank: int) -> None:
    """Back to OFF, destroy ``g`` (unusable on the ranks that timed out), check the world still works, decide."""
    dist.set_debug_level(L.OFF)
    dist.destroy_process_group(g)
    problems += _still_in_step(dist.group.WORLD, world_size, rank, "world after the timeout")
    fail_together(problems)


# ---------------------------------------------------------------------------------------
# DETAIL: the check is bounded by the group's timeout
# ---------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_detail_check_respects_the_group_timeout(rank, world_size):
    """Rank 0 skips a collective: the others' check fails with DistBackendError after ~timeout."""
    timeout = 1.0
    g = dist.new_group(timeout=timedelta(seconds=timeout))
    dist.set_debug_level(L.DETAIL)
    problems: list[str] = []
    if rank != 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(np.ones(4), group=g)
            problems.append("all_reduce with a missing rank did not raise")
        except DistBackendError as exc:
            took = time.monotonic() - t0
            if not re.search(r"did not complete within the timeout of 1 s", str(exc)):
                problems.append(f"message does not name the timeout: {exc}")
            if not timeout * 0.9 <= took <= timeout + 2.0:
                problems.append(f"raised after {took:.2f} s; expected within {timeout} + 2 s, not before the timeout")
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            problems.append(f"raised {type(exc).__name__} instead of DistBackendError: {exc}")
    _end_after_timeout(g, problems, world_size, rank)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True])
def test_detail_check_is_bounded_by_the_barriers_own_timeout(rank, world_size, async_op):
    """``barrier(timeout=1 s)`` on a group whose timeout is 20 s, rank 1 late: DETAIL's check of the barrier
    gives up after the barrier's 1 s, as the barrier does at OFF, not after the group's 20 s."""
    g = dist.new_group(timeout=timedelta(seconds=20))
    dist.set_debug_level(L.DETAIL)
    problems: list[str] = []
    if rank != 1:  # rank 1 stays away (outside mpidist) until the others are done
        t0 = time.monotonic()
        try:
            w = dist.barrier(group=g, timeout=timedelta(seconds=1), async_op=async_op)
            if w is not None:
                w.wait()
            problems.append("barrier with a late rank did not raise")
        except DistBackendError as exc:
            took = time.monotonic() - t0
            text = str(exc)
            for p in (r"^barrier \(call #\d+\) on group .* within the timeout of 1 s\.", r"compared their calls"):
                if not re.search(p, text):
                    problems.append(f"message {text!r} does not match {p!r}")
            if not 0.9 <= took <= 3.0:
                problems.append(f"raised after {took:.2f} s; expected after the barrier's timeout of 1 s")
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            problems.append(f"raised {type(exc).__name__} instead of DistBackendError: {exc}")
    meet_outside_mpidist()
    _end_after_timeout(g, problems, world_size, rank)


def _detail_call(op: str, g: dist.ProcessGroup) -> None:
    if op == "all_reduce":
        dist.all_reduce(np.ones(4), group=g)
    elif op == "barrier":
        dist.barrier(group=g)
    else:  # pragma: no cover
        raise AssertionError(op)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["all_reduce", "barrier"])
def test_detail_check_timeout_names_the_users_call(rank, world_size, op):
    """Rank 1 arrives late: the others' check times out with the error of the user's call (as at OFF), not the
    check's exchange on the control communicator; the ranks that wait in the check report the user's call."""
    timeout = 1.0
    g = dist.new_group(timeout=timedelta(seconds=timeout))
    seq = calls_issued(g) + 1
    name = re.escape(g.group_name)
    dist.set_debug_level(L.DETAIL)
    problems: list[str] = []
    if rank != 1:  # rank 1 stays away (outside mpidist) until the others are done
        try:
            _detail_call(op, g)
            problems.append(f"{op} with a late rank did not raise")
        except DistBackendError as exc:
            text = str(exc)
            patterns = [
                rf"^{op} \(call #{seq}\) on group {name} \(mpi, rank {g.rank()} of {g.size()}\) did not complete "
                rf"within the timeout of 1 s\. ",
                r"Rank 1: no answer \(not waiting in an mpidist call",
                r"The group is unusable now \(the call is still pending inside MPI\)",
            ]
            patterns += [
                rf"Rank {r}: waiting in {op} \(call #{seq}\) on group {name}\."
                for r in range(world_size)
                if r not in (1, rank)
            ]
            problems += [f"message {text!r} does not match {p!r}" for p in patterns if not re.search(p, text)]
            if "control" in text or "all_gather" in text:
                problems.append(f"message names the check's exchange: {text}")
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            problems.append(f"raised {type(exc).__name__} instead of DistBackendError: {exc}")
    meet_outside_mpidist()
    _end_after_timeout(g, problems, world_size, rank)


@pytest.mark.mpi(min_size=2)
def test_detail_rank_waiting_in_the_check_reports_the_users_call(rank, world_size):
    """Rank 1's receive times out while the others wait in DETAIL's check of an all_reduce: its error says
    they wait in that all_reduce on the group (as at OFF), not in the check's exchange."""
    g = dist.new_group(timeout=timedelta(seconds=30))
    seq = calls_issued(g) + 1
    dist.set_debug_level(L.DETAIL)
    problems: list[str] = []
    if rank == 1:
        try:
            dist.irecv(np.empty(1), src=0, tag=7, group=g).wait(timeout=timedelta(seconds=1))
            problems.append("irecv without a send did not time out")
        except DistBackendError as exc:
            text = str(exc)
            for r in range(world_size):
                want = rf"Rank {r}: waiting in all_reduce \(call #{seq}\) on group {re.escape(g.group_name)}\."
                if r != 1 and not re.search(want, text):
                    problems.append(f"message {text!r} does not match {want!r}")
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            problems.append(f"irecv raised {type(exc).__name__} instead of DistBackendError: {exc}")
    x = np.full(3, rank + 1.0)
    try:
        dist.all_reduce(x, group=g)  # rank 1 joins the others, who waited in the check meanwhile
        want = world_size * (world_size + 1) / 2
        if not np.array_equal(x, np.full(3, want)):
            problems.append(f"all_reduce gave {x}, expected {want}")
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        problems.append(f"all_reduce raised {type(exc).__name__}: {exc}")
    dist.set_debug_level(L.OFF)
    dist.destroy_process_group(g)
    fail_together(problems)


# ---------------------------------------------------------------------------------------
# verdict: the rules on plain data (rank-local)
# ---------------------------------------------------------------------------------------


def _c(op: str, seq: int = 1, **kw: Any) -> Call:
    return Call(op, seq, op, **kw)


def test_verdict_rules():
    assert verdict([_c("barrier"), _c("barrier")]) is None
    assert verdict([_c("barrier"), _c("all_reduce")]) == "the ranks called different collectives"
    assert verdict([_c("barrier", 3), _c("barrier", 4)]) == (
        "the ranks are at different calls of this group (sequence numbers differ)"
    )
    same = dict(reduce="SUM", dtype="float64", size=4)
    assert verdict([_c("all_reduce", **same), _c("all_reduce", **same)]) is None
    assert verdict([_c("all_reduce", **same), _c("all_reduce", **{**same, "size": 5})]) == (
        "the ranks passed different array sizes"
    )
    a2a = [_c("all_to_all_single", dtype="f", sizes=[1, 2], other=[1, 5]),
           _c("all_to_all_single", dtype="f", sizes=[5, 3], other=[2, 3])]  # fmt: skip
    assert verdict(a2a) is None
    a2a[1].sizes = [4, 3]
    assert verdict(a2a) == "all_to_all_single splits: rank 1 sends 4 elements to rank 0, which expects 5"
    gather = [_c("gather", root=1, dtype="f", size=2), _c("gather", root=1, dtype="f", size=3, sizes=[2, 3])]
    assert verdict(gather) is None
    gather[0].size = 7
    assert verdict(gather) == "gather: the root's array for rank 0 has 2 elements, rank 0's has 7"


def test_call_pickles():
    import pickle

    c = Call("scatter", 9, "scatter float64[4] src=2", root=2, dtype="float64", size=4, sizes=[4, 4])
    d = pickle.loads(pickle.dumps(c))
    assert [getattr(d, k) for k in Call.__slots__] == [getattr(c, k) for k in Call.__slots__]
