"""The MPI backend's shared-memory path (backends/shm.py): results, order, async, persistent, timeouts, cleanup.

Every reduction is checked against numpy (helpers.reference) and, bit for bit, against MPI's own
path on the same inputs (a group whose shared-memory path is off): NaN, -0 and the float16/bfloat16
rounding must come out as they do there. Sizes cross chunk boundaries (shm.CHUNK) and leave
segments of unequal length. A world of one rank never sets the path up.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import DistBackendError
from mpidist.backends import shm, shm_tuning
from mpidist.backends.mpi_types import type_table
from mpidist.bench.tune import group_under
from mpidist.reduce_op import OP_TABLE, RedOpType
from mpidist.testing import backend_of

from helpers import (
    ALL_DTYPES,
    Checks,
    clean_env,
    fail_together,
    inputs_of,
    kind,
    meet_outside_mpidist,
    mpiexec_command,
    nccl_reference,
    rank_input,
    reference,
    timeout_head,
)  # fmt: skip

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
R = dist.ReduceOp
#: elements of a 1-byte dtype: one chunk and a bit (every dtype gets two chunks or more)
ELEMS = shm.CHUNK + 4099

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(shm.shm_status()), reason=f"no shared-memory path here: {shm.shm_status()}"),
]


def _segments() -> set[str]:
    """mpidist's shared-memory names on this machine (POSIX shared memory lives in /dev/shm on Linux)."""
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("mpidist-")}
    except OSError:  # pragma: no cover - not Linux
        return set()


def _group_with(env: dict[str, str], **kw) -> dist.ProcessGroup:
    """A new group of the world whose shared-memory path is set up under ``env`` (on its first large call)."""
    return group_under(dist, env, **kw)


@pytest.fixture(scope="module")
def groups():
    """(a group that takes shared memory from SETUP_FLOOR on, a group whose path is off)."""
    every = ",".join(f"{c}={shm_tuning.SETUP_FLOOR}" for c in shm_tuning.COLLECTIVES)
    on = _group_with({shm_tuning.ENV_THRESHOLDS: every})
    off = _group_with({shm_tuning.ENV_SWITCH: "0"})
    yield on, off
    dist.destroy_process_group(on)
    dist.destroy_process_group(off)


def _chunks(g) -> int:
    path = backend_of(g).shared_memory()
    return -1 if path is None else path.chunks


def _valid_ops(dtype: np.dtype) -> list:
    """The ops of ``dtype`` the path runs (PREMUL_SUM stays on MPI's path, tested elsewhere)."""
    skip = (RedOpType.UNUSED, RedOpType.PREMUL_SUM)
    return [op for op in RedOpType if op not in skip and OP_TABLE[kind(dtype)][op] is not None]


def _special(a: np.ndarray, salt: int) -> np.ndarray:
    """``a`` with a NaN, -0.0 and +0.0 placed per rank (floats), so MIN/MAX rules and payloads show."""
    if a.dtype.kind == "f" or a.dtype == ALL_DTYPES[-1]:
        flat = a.reshape(-1)
        flat[(11 * RANK + salt) % 97] = np.nan
        flat[100 + RANK] = -0.0 if RANK % 2 else 0.0
        flat[-1 - RANK] = np.inf if RANK == 0 else -np.inf
    return a


@pytest.mark.mpi(min_size=2)
def test_the_path_is_set_up_once_and_leaves_no_name_behind(groups):
    """The group on shared memory has its path (and rank 0's segment name is gone); the other has none."""
    on, off = groups
    c = Checks()
    c.true("the group with thresholds at the floor has no shared-memory path", _chunks(on) >= 0)
    c.true("the group with MPIDIST_SHM=0 has a shared-memory path", backend_of(off).shared_memory() is None)
    path = backend_of(on).shared_memory()
    if path is not None:
        every = {k: (shm_tuning.SETUP_FLOOR, shm_tuning.NEVER) for k in shm_tuning.COLLECTIVES}
        c.equal("agreed thresholds", path.limits, every)
        c.equal("collectives fixed by the variable (not measured)", path.fixed, frozenset(shm_tuning.COLLECTIVES))
    pid0 = MPI.COMM_WORLD.bcast(os.getpid(), root=0)
    left = {s for s in _segments() if s.startswith(f"mpidist-{pid0}-")}
    c.true(f"names left in /dev/shm: {left}", not left)
    c.done()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_reductions_match_numpy_and_mpi_bit_for_bit(groups, dtype):
    """all_reduce, reduce (every root), reduce_scatter_tensor: every op of every dtype, against numpy and MPI's path."""
    on, off = groups
    c = Checks()
    n_elems = ELEMS // dtype.itemsize + 3
    # a 2-byte float that this MPI library cannot reduce, without mpidist's C ops (MPIDIST_C_EXTENSIONS=0):
    # MPI's path reduces a float32 copy, and the shared-memory path leaves it there
    entry = type_table()[dtype]
    declines = entry.half is None and entry.wide is not None
    for salt, op in enumerate(_valid_ops(dtype)):
        inputs = inputs_of(SIZE, (n_elems,), dtype, salt)
        want = nccl_reference(inputs, op)  # complex AVG divides per component, as mpidist does everywhere
        before = _chunks(on)
        got = inputs[RANK].copy()
        dist.all_reduce(got, op=op, group=on)
        c.equal(f"all_reduce {op!r}", got, want)
        if not declines:
            c.true(f"all_reduce {op!r} did not take shared memory", _chunks(on) > before)
        # NaN, signed zeros, infinities: the same bits as MPI's path (no numpy reference for NaN payloads)
        special = _special(rank_input(RANK, (n_elems,), dtype, salt), salt)
        a, b = special.copy(), special.copy()
        dist.all_reduce(a, op=op, group=on)
        dist.all_reduce(b, op=op, group=off)
        c.true(f"all_reduce {op!r} with NaN/-0/inf differs from MPI's path", a.tobytes() == b.tobytes())
        c.identical(f"all_reduce {op!r} with NaN/-0/inf", a)
        for root in range(SIZE):
            x = inputs[RANK].copy()
            dist.reduce(x, dst=root, op=op, group=on)
            c.equal(f"reduce {op!r} to {root}", x, want if RANK == root else inputs[RANK])
        blocks = inputs_of(SIZE, (SIZE * n_elems,), dtype, salt + 1)
        out = np.zeros(n_elems, dtype)
        dist.reduce_scatter_tensor(out, blocks[RANK], op=op, group=on)
        want = nccl_reference(blocks, op)[RANK * n_elems : (RANK + 1) * n_elems]
        c.equal(f"reduce_scatter_tensor {op!r}", out, want)
    c.done()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.int16), np.dtype(np.complex128)], ids=str)
def test_broadcast_and_all_gather_into_tensor(groups, dtype):
    """broadcast from every root, all_gather_into_tensor from apart and in place: the exact arrays."""
    on, _ = groups
    c = Checks()
    n_elems = 2 * shm.CHUNK // dtype.itemsize + 5
    for root in range(SIZE):
        x = rank_input(RANK, (n_elems,), dtype, root)
        before = _chunks(on)
        dist.broadcast(x, src=root, group=on)
        c.equal(f"broadcast from {root}", x, rank_input(root, (n_elems,), dtype, root))
        c.true(f"broadcast from {root} did not take shared memory", _chunks(on) > before)
    m = n_elems // SIZE + 1
    want = np.concatenate(inputs_of(SIZE, (m,), dtype, 7))
    out = np.zeros(SIZE * m, dtype)
    dist.all_gather_into_tensor(out, rank_input(RANK, (m,), dtype, 7), group=on)
    c.equal("all_gather_into_tensor", out, want)
    out = np.zeros(SIZE * m, dtype)
    out[RANK * m : (RANK + 1) * m] = rank_input(RANK, (m,), dtype, 7)
    dist.all_gather_into_tensor(out, out[RANK * m : (RANK + 1) * m], group=on)
    c.equal("all_gather_into_tensor in place", out, want)
    c.done()


@pytest.mark.mpi(min_size=2)
def test_non_contiguous_arrays_are_written_back(groups):
    """A column view as all_reduce's array and as reduce_scatter_tensor's output: results land in the view."""
    on, _ = groups
    c = Checks()
    n_elems = shm.CHUNK // 8 + 3
    big = np.full((n_elems, 2), -7.0)
    big[:, 0] = rank_input(RANK, (n_elems,), np.dtype(np.float64), 3)
    dist.all_reduce(big[:, 0], group=on)
    c.equal("all_reduce into a column", big[:, 0], reference(inputs_of(SIZE, (n_elems,), np.float64, 3), R.SUM))
    c.equal("the other column", big[:, 1], np.full(n_elems, -7.0))
    out = np.full((n_elems, 2), -7.0)
    blocks = inputs_of(SIZE, (SIZE * n_elems,), np.float64, 4)
    dist.reduce_scatter_tensor(out[:, 1], blocks[RANK], group=on)
    c.equal(
        "reduce_scatter_tensor into a column",
        out[:, 1],
        reference(blocks, R.SUM)[RANK * n_elems : (RANK + 1) * n_elems],
    )
    c.done()


@pytest.mark.mpi(min_size=2)
def test_fixed_order_same_bits_everywhere_and_every_run(groups):
    """Random float32 sums (rounding depends on order): rank order, the same bits on every rank and run."""
    on, _ = groups
    c = Checks()
    n_elems = 3 * shm.CHUNK // 4 + 17
    inputs = [np.random.default_rng(100 + r).standard_normal(n_elems).astype(np.float32) for r in range(SIZE)]
    fold = inputs[0].copy()
    for a in inputs[1:]:
        fold = fold + a  # float32, in rank order
    results = []
    for _ in range(2):
        x = inputs[RANK].copy()
        dist.all_reduce(x, group=on)
        results.append(x)
        c.identical("all_reduce of random float32", x)
    c.equal("the sum in rank order", results[0], fold)
    c.true("two runs differ", results[0].tobytes() == results[1].tobytes())
    c.done()


@pytest.mark.mpi(min_size=2)
def test_async_operations_complete_in_any_wait_order(groups):
    """Four async calls in flight, waited for last to first; a persistent all_reduce takes the same path."""
    on, _ = groups
    c = Checks()
    n_elems = shm.CHUNK // 4 + 1000
    xs = [rank_input(RANK, (n_elems,), np.dtype(np.float32), s) for s in range(3)]
    bc = rank_input(RANK, (n_elems,), np.dtype(np.int32), 9)
    works = [dist.all_reduce(x, group=on, async_op=True) for x in xs]
    works.append(dist.broadcast(bc, src=SIZE - 1, group=on, async_op=True))
    for w in reversed(works):
        c.true("wait() returned False", w.wait() is True)
    for s, x in enumerate(xs):
        c.equal(f"async all_reduce {s}", x, reference(inputs_of(SIZE, (n_elems,), np.float32, s), R.SUM))
    c.equal("async broadcast", bc, rank_input(SIZE - 1, (n_elems,), np.dtype(np.int32), 9))
    x = np.zeros(n_elems, np.float64)
    p = dist.all_reduce_init(x, group=on)
    for k in range(3):
        x[:] = rank_input(RANK, (n_elems,), np.dtype(np.float64), k)
        before = _chunks(on)
        p.start()
        p.wait()
        c.equal(f"persistent all_reduce run {k}", x, reference(inputs_of(SIZE, (n_elems,), np.float64, k), R.SUM))
        c.true(f"persistent run {k} did not take shared memory", _chunks(on) > before)
    p.free()
    c.done()


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_never_arrives_gives_the_timeout_and_diagnosis():
    """Rank 1 stays outside mpidist: the others, inside the shared-memory step, raise the group's timeout."""
    every = ",".join(f"{c}={shm_tuning.SETUP_FLOOR}" for c in shm_tuning.COLLECTIVES)
    g = _group_with({shm_tuning.ENV_THRESHOLDS: every}, timeout=1.0)
    problems: list[str] = []
    x = np.ones(shm.CHUNK // 4 * 3, np.float32)
    if RANK != 1:
        start = time.monotonic()
        try:
            dist.all_reduce(x, group=g)
            problems.append("all_reduce with rank 1 away completed")
        except DistBackendError as exc:
            took = time.monotonic() - start
            for pattern in (timeout_head("all_reduce", 2, g), r"Rank 1: no answer"):
                if not re.search(pattern, str(exc)):
                    problems.append(f"message {str(exc)!r} does not match {pattern!r}")
            if took > 3.0:
                problems.append(f"the error came after {took:.2f} s")
        if backend_of(g).shared_memory() is None or backend_of(g).shared_memory().queue[0].c != 0:
            problems.append("the call did not wait in the shared-memory step")
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)


_LOST = """
import os, signal, sys, time
import numpy as np
from mpi4py import MPI
import mpidist as dist
from mpidist import DistBackendError
mode = sys.argv[1]
dist.init_process_group("mpi", timeout=3)
rank = dist.get_rank()
x = np.ones(1 << 21, np.float32)
dist.all_reduce(x)  # sets the path up; every rank on it
pids = MPI.COMM_WORLD.allgather(os.getpid())
print(f"RANK {rank} up", flush=True)
if rank == 1:
    time.sleep(0.5)  # the others are waiting in the shared-memory step by now
    os.kill(os.getpid(), signal.SIGSTOP if mode == "stopped" else signal.SIGKILL)
start = time.monotonic()
try:
    dist.all_reduce(x)
    print(f"RANK {rank} completed", flush=True)
except DistBackendError as exc:
    print(f"RANK {rank} raised after {time.monotonic() - start:.1f} s: {str(exc)!r}", flush=True)
if rank == 0:
    time.sleep(2)  # rank 2 has printed too (it timed out at the same time)
    os.kill(pids[1], signal.SIGKILL)  # the stopped rank: end the job
else:  # a rank that exits ends the job under Open MPI's prterun: not before rank 0, raising at the same time, printed
    time.sleep(1)
os._exit(0)
"""


@pytest.mark.one_rank
@pytest.mark.parametrize("mode", ["stopped", "killed"])
def test_a_lost_rank_gives_an_error_and_leaves_no_shared_memory(tmp_path, mode):
    """A job of 3 whose rank 1 stops (or dies) while the others wait in a shared-memory all_reduce.

    Stopped (no launcher notices): ranks 0 and 2 raise the group's timeout naming rank 1. Killed: the
    launcher ends the job (or they raise first). Either way no hang, and nothing left in /dev/shm.
    """
    script = tmp_path / "lost.py"
    script.write_text(_LOST)
    before = _segments()
    start = time.monotonic()
    proc = subprocess.run(
        [*mpiexec_command(3), sys.executable, str(script), mode], capture_output=True, text=True, timeout=90,
        env=clean_env(),
    )  # fmt: skip
    out = proc.stdout
    assert out.count(" up") == 3, (out, proc.stderr[-3000:])
    assert "completed" not in out, out
    if mode == "stopped":
        for r in (0, 2):
            m = re.search(rf"RANK {r} raised after (\d+\.\d) s: '(.*)'", out)
            assert m, (out, proc.stderr[-3000:])
            assert float(m.group(1)) < 3 + 5, f"rank {r} raised after {m.group(1)} s"
            assert "all_reduce (call #2)" in m.group(2) and "Rank 1: no answer" in m.group(2), m.group(2)
    else:
        assert proc.returncode != 0 or out.count("raised") == 2, (proc.returncode, out)
    assert time.monotonic() - start < 60
    assert _segments() - before == set(), f"left in /dev/shm: {_segments() - before}"


@pytest.mark.one_rank
def test_one_rank_never_sets_the_path_up():
    """A world of one: calls of any size stay on MPI's path."""
    x = np.ones(shm.CHUNK, np.float32)
    dist.all_reduce(x)
    assert backend_of().shared_memory() is None
    assert x[0] == 1.0


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_thresholds_agree_on_the_largest():
    """Each rank sets another range: the group takes the largest lower and the smallest upper end; a rank that
    turns the path off wins."""
    low, high = shm_tuning.SETUP_FLOOR * (1 + RANK), (8 << 20) * (1 + RANK)
    g = _group_with({shm_tuning.ENV_THRESHOLDS: f"all_reduce={low}-{high}"})
    c = Checks()
    path = backend_of(g).shared_memory()
    c.true("no path", path is not None)
    if path is not None:
        c.equal("agreed all_reduce range", path.limits["all_reduce"], (shm_tuning.SETUP_FLOOR * SIZE, 8 << 20))
        before = path.chunks
        dist.all_reduce(np.ones((8 << 20) // 4 + 1, np.float32), group=g)
        c.equal("a call above the range took shared memory", path.chunks, before)
    off = _group_with({shm_tuning.ENV_SWITCH: "0" if RANK == SIZE - 1 else "1"})
    c.true("one rank's MPIDIST_SHM=0 left the path on", backend_of(off).shared_memory() is None)
    c.done()
    dist.destroy_process_group(g)
    dist.destroy_process_group(off)


@pytest.mark.one_rank
def test_prior_from_the_table_and_overrides_from_the_environment(tmp_path, monkeypatch):
    """No static defaults: without a table there is no prior; the tune table (only for its own library) is the
    prior; the variable fixes what it names (nothing else); bad words name the variable."""
    monkeypatch.setenv(shm_tuning.ENV_TUNE_FILE, str(tmp_path / "t.json"))
    monkeypatch.delenv(shm_tuning.ENV_THRESHOLDS, raising=False)
    never = shm_tuning.NEVER
    assert set(shm_tuning.prior(2, "lib A").values()) == {(never, never)}
    assert shm_tuning.overrides() == {}
    shm_tuning.write_table("lib A", {"all_reduce": {2: (1 << 20, never), 4: (2 << 20, 8 << 20)}})
    assert shm_tuning.prior(2, "lib A")["all_reduce"] == (1 << 20, never)
    assert shm_tuning.prior(8, "lib A")["all_reduce"] == (2 << 20, 8 << 20)  # the nearest count below
    assert shm_tuning.prior(2, "lib A")["broadcast"] == (never, never)
    assert shm_tuning.prior(2, "lib B")["all_reduce"] == (never, never)
    monkeypatch.setenv(shm_tuning.ENV_THRESHOLDS, "all_reduce=4M, broadcast=off,reduce=1,all_gather_into_tensor=1K-2M")
    t = shm_tuning.overrides()
    assert t["all_reduce"] == (4 << 20, never) and t["broadcast"] == (never, never)
    assert t["reduce"] == (shm_tuning.SETUP_FLOOR, never)
    assert t["all_gather_into_tensor"] == (shm_tuning.SETUP_FLOOR, 2 << 20)
    assert "reduce_scatter_tensor" not in t  # measured
    for bad in ("all_reduce", "allreduce=4M", "all_reduce=4Q", "all_reduce=-1", "all_reduce=1M-"):
        monkeypatch.setenv(shm_tuning.ENV_THRESHOLDS, bad)
        with pytest.raises(ValueError, match=shm_tuning.ENV_THRESHOLDS):
            shm_tuning.overrides()
    from mpidist.bench.tune import best_range

    k = 1 << 10
    assert best_range([(16 * k, 1.2), (32 * k, 0.9), (64 * k, 0.8), (128 * k, 1.1), (256 * k, 0.9)]) == (32 * k, 64 * k)
    assert best_range([(16 * k, 1.2), (32 * k, 0.9), (64 * k, 0.8)]) == (32 * k, never)
    assert best_range([(16 * k, 1.2), (32 * k, 1.0)]) == (never, never)
    monkeypatch.setenv(shm_tuning.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match=shm_tuning.ENV_SWITCH):
        shm_tuning.enabled()


@pytest.mark.one_rank
def test_the_chunk_is_the_largest_that_fits_and_the_budget_defaults_to_half_of_dev_shm(monkeypatch):
    """chunk_for: powers of two from MIN_CHUNK to CHUNK; node_budget: MPIDIST_SHM_NODE_BYTES, else half of
    /dev/shm up to NODE_BUDGET_MAX."""
    region = lambda n, c: shm._region_sizes(n, c)[0]  # noqa: E731 - a rank's part of a group's segment
    assert shm.chunk_for(2, region(2, shm.CHUNK)) == shm.CHUNK
    assert shm.chunk_for(2, region(2, shm.CHUNK) - 1) == shm.CHUNK // 2
    assert shm.chunk_for(32, region(32, 256 << 10)) == 256 << 10
    assert shm.chunk_for(4, region(4, shm.MIN_CHUNK)) == shm.MIN_CHUNK
    assert shm.chunk_for(4, region(4, shm.MIN_CHUNK) - 1) == 0
    monkeypatch.setenv("MPIDIST_SHM_NODE_BYTES", "48M")
    assert shm_tuning.node_budget() == 48 << 20
    monkeypatch.setenv("MPIDIST_SHM_NODE_BYTES", "lots")
    with pytest.raises(ValueError, match="MPIDIST_SHM_NODE_BYTES"):
        shm_tuning.node_budget()
    monkeypatch.delenv("MPIDIST_SHM_NODE_BYTES")
    fs = os.statvfs("/dev/shm")
    assert shm_tuning.node_budget() == min(shm_tuning.NODE_BUDGET_MAX, fs.f_blocks * fs.f_frsize // 2)


@pytest.mark.mpi(min_size=2)
def test_the_nodes_budget_bounds_every_group_together(groups, caplog):
    """MPIDIST_SHM_NODE_BYTES bounds the segments of all of a node's groups together: a group takes the largest
    chunk its ranks have room for, its results are right across chunks, a group without room keeps MPI's calls
    (and says so), and a freed group gives its part back."""
    import logging

    from mpidist._world import world

    caplog.set_level(logging.WARNING, logger="mpidist")
    c = Checks()
    chunk = 256 << 10
    held = world.shm_share  # the module's groups' parts
    budget = world.init_info.node_size * (held + shm._region_sizes(SIZE, chunk)[0])  # room for one such group
    every = ",".join(f"{k}={shm_tuning.SETUP_FLOOR}" for k in shm_tuning.COLLECTIVES)
    env = {shm_tuning.ENV_THRESHOLDS: every, shm_tuning.ENV_NODE_BYTES: str(budget)}

    def right_on(g, what: str) -> None:
        n = 2 * chunk // 4 + 4099  # float32 elements: more than two chunks, the last one short
        x = np.full(n, RANK + 1.0, np.float32)
        dist.all_reduce(x, group=g)
        c.true(f"{what}: all_reduce", (x == SIZE * (SIZE + 1) / 2).all())
        x = np.full(n, float(RANK), np.float32)
        dist.broadcast(x, src=SIZE - 1, group=g)
        c.true(f"{what}: broadcast", (x == SIZE - 1).all())
        out = np.zeros(n * SIZE, np.float32)
        dist.all_gather_into_tensor(out, np.full(n, float(RANK), np.float32), group=g)
        c.true(f"{what}: all_gather_into_tensor", (out.reshape(SIZE, n) == np.arange(SIZE)[:, None]).all())
        out = np.zeros(n, np.float32)
        dist.reduce_scatter_tensor(out, np.full(n * SIZE, RANK + 1.0, np.float32), group=g)
        c.true(f"{what}: reduce_scatter_tensor", (out == SIZE * (SIZE + 1) / 2).all())

    first = _group_with(env)
    path = backend_of(first).shared_memory()
    c.true("the first group under the budget has no path", path is not None)
    c.equal("its chunk", None if path is None else path.chunk, chunk)
    right_on(first, "the first group")
    caplog.clear()
    second = _group_with(env)
    c.true("a second group found room the first one holds", backend_of(second).shared_memory() is None)
    said = [r.getMessage() for r in caplog.records if "keeps MPI's calls" in r.getMessage()]
    c.true(f"no warning says why the second group keeps MPI's calls: {said}", any("budget" in m for m in said))
    right_on(second, "the group without room")
    dist.destroy_process_group(first)
    c.equal("this rank's part after the first group is freed", world.shm_share, held)
    third = _group_with(env)
    path = backend_of(third).shared_memory()
    c.equal("the chunk of a group made after the first was freed", None if path is None else path.chunk, chunk)
    dist.destroy_process_group(second)
    dist.destroy_process_group(third)
    c.done()


@pytest.mark.one_rank
@pytest.mark.skipif(shm._await_any is None, reason="the C counters are not built (a blocking wait tests from Python)")
def test_await_any_looks_at_the_counters_it_is_given_and_stays_bounded():
    """``_shm.await_any``: True as soon as one condition holds (the least of its counters reaches the target),
    a condition of 0 counters is never looked at, and with none met it returns False once its budget is spent,
    spinning or (negative budget) yielding."""
    cells = np.zeros(8 * 3, np.int64)  # three counters 64 bytes apart
    base, stride = cells.ctypes.data, 64
    cells[0], cells[8], cells[16] = 5, 7, 9
    never = 1 << 62
    c = Checks()
    c.true("the least of 3 counters (5) reached 5", shm._await_any(stride, 10**6, base, 3, 5, 0, 0, 0, 0, 0, 0))
    c.true("the second condition (the counter at 64 bytes reached 7)",
           shm._await_any(stride, 10**6, base, 3, never, base + 64, 1, 7, 0, 0, 0))  # fmt: skip
    c.true("a condition of 0 counters was looked at", not shm._await_any(stride, 10**6, base, 0, 0, 0, 0, 0, 0, 0, 0))
    for budget in (2 * 10**6, -2 * 10**6):
        start = time.perf_counter()
        met = shm._await_any(stride, budget, base, 3, 6, base + 128, 1, 10, 0, 0, 0)
        took = time.perf_counter() - start
        c.true(f"budget {budget} ns: a condition not met was reported met", not met)
        c.true(f"budget {budget} ns: returned after {took * 1e3:.2f} ms, before its budget or far after",
               0.002 <= took < 1.0)  # fmt: skip
    c.done()


@pytest.mark.mpi(min_size=2)
def test_a_blocking_call_waits_for_a_late_rank_in_c(groups, monkeypatch):
    """While rank 0 comes late, the others' blocking calls (and an async call's wait) wait in C
    (``SharedOp.spin`` through ``_shm.await_any``), and every result is right."""
    if shm._await_any is None:
        pytest.skip("the C counters are not built")
    on, _ = groups
    calls = [0]
    real = shm._await_any

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(shm, "_await_any", counted)
    c = Checks()
    n = shm.CHUNK // 4 * 2 + 1000  # float32: three chunks
    for k, kind_of_wait in enumerate(["blocking", "async"]):
        MPI.COMM_WORLD.Barrier()
        if RANK == 0:
            time.sleep(0.2)
        x = rank_input(RANK, (n,), np.dtype(np.float32), k)
        if kind_of_wait == "blocking":
            dist.all_reduce(x, group=on)
        else:
            dist.all_reduce(x, group=on, async_op=True).wait()
        c.equal(f"{kind_of_wait} all_reduce", x, reference(inputs_of(SIZE, (n,), np.float32, k), R.SUM))
        if RANK != 0:
            c.true(f"{kind_of_wait}: rank {RANK} waited for rank 0 without _shm.await_any", calls[0] > 0)
        calls[0] = 0
    out = np.zeros(n, np.float32)
    if RANK == 0:
        time.sleep(0.2)
    dist.reduce_scatter_tensor(out, np.full(n * SIZE, RANK + 1.0, np.float32), group=on)
    c.true("reduce_scatter_tensor after a late rank", (out == SIZE * (SIZE + 1) / 2).all())
    c.done()


def blocked_elsewhere(g, what: str) -> list[str]:
    """Every rank issues an async all_reduce on ``g``'s path (fixed to it); rank 0 then blocks in another call (a
    barrier; a recv from rank 1) before waiting for it, the others wait for it first. Rank 0's blocked call must
    advance its part of the async operation (the others' waits need it), not time out. Returns the problems."""
    problems = []
    n = (1 << 20) // 4  # one chunk and more: every rank's part moves the operation on
    for blocking in ("barrier", "recv"):
        x = np.full(n, RANK + 1, np.float32)
        token = np.zeros(1, np.int64)
        try:
            w = dist.all_reduce(x, group=g, async_op=True)
            if RANK == 0:
                if blocking == "barrier":
                    dist.barrier(group=g)
                else:
                    dist.irecv(token, src=1, group=g).wait()
                w.wait()
            else:
                w.wait()
                if blocking == "barrier":
                    dist.barrier(group=g)
                elif RANK == 1:
                    dist.send(np.ones(1, np.int64), dst=0, group=g)
        except DistBackendError as exc:
            problems.append(f"{what}, rank 0 in a {blocking}: {str(exc)[:300]}")
            break
        if not (x == SIZE * (SIZE + 1) / 2).all():
            problems.append(f"{what}, rank 0 in a {blocking}: all_reduce gave {x[:3]}")
    return problems


@pytest.mark.mpi(min_size=2)
def test_a_rank_blocked_in_another_call_advances_its_async_operation():
    """The shared-memory path's operation moves only when its rank tests it: a rank blocked in a barrier or a recv
    that the others reach only after the operation completes must test it meanwhile (MPIBackend.advancing)."""
    g = group_under(dist, {"MPIDIST_SHM_THRESHOLDS": "all_reduce=16K"}, timeout=10.0)
    problems = blocked_elsewhere(g, "shared memory")
    meet_outside_mpidist()
    dist.barrier()
    dist.destroy_process_group(g)
    fail_together(problems)
