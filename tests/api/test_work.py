"""Work and Future: completion, polling, futures and chaining, timeouts, overlap, buffer lifetime."""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import DistBackendError, Future, Work
from mpidist.testing import backend_of

from helpers import check_raises, fail_together

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
TRI = SIZE * (SIZE + 1) // 2  # sum of rank + 1 over all ranks
MAX_POLLS = 2_000_000  # safety bound for polling loops (they normally end after a few)


def poll_until_done(work: Work, max_polls: int = MAX_POLLS) -> int:
    """Poll ``is_completed()`` until it is True; return how many polls it took (bounded)."""
    for i in range(max_polls):
        if work.is_completed():
            return i + 1
    raise AssertionError(f"{work!r} did not complete after {max_polls} polls")


def started_all_reduce(n: int = 4, dtype=np.float64) -> tuple[Work, np.ndarray]:
    x = np.full(n, RANK + 1, dtype)
    w = dist.all_reduce(x, async_op=True)
    assert isinstance(w, Work)
    return w, x


# -- Work ---------------------------------------------------------------------------------


def test_blocking_collectives_return_none():
    x = np.ones(2)
    assert dist.all_reduce(x) is None
    assert dist.broadcast(x, src=0) is None
    assert dist.barrier() is None


def test_wait_returns_true_and_finishes_the_work():
    w, x = started_all_reduce()
    assert w.wait() is True
    np.testing.assert_array_equal(x, np.full(4, TRI, np.float64))
    assert w.is_completed() is True
    assert w.is_success() is True
    assert w.exception() is None
    assert w.wait() is True  # waiting again is harmless
    assert "completed" in repr(w) and "all_reduce" in repr(w)


def test_is_completed_polls_to_completion():
    w, x = started_all_reduce(1 << 12)
    polls = poll_until_done(w)
    assert polls >= 1
    assert w.is_completed() is True
    assert w.is_success() is True
    assert w.exception() is None
    np.testing.assert_array_equal(x, np.full(1 << 12, TRI, np.float64))


def test_result_lists_the_outputs(rank):
    x = np.full(3, rank + 1, np.int64)
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    out = w.result()
    assert isinstance(out, list) and len(out) == 1
    assert out[0] is x

    gathered = np.zeros(3 * SIZE, np.int64)
    w = dist.all_gather_into_tensor(gathered, np.full(3, rank, np.int64), async_op=True)
    w.wait()
    assert w.result()[0] is gathered
    np.testing.assert_array_equal(gathered, np.repeat(np.arange(SIZE), 3))

    outs = [np.zeros(2, np.int64) for _ in range(SIZE)]
    w = dist.all_gather(outs, np.full(2, rank, np.int64), async_op=True)
    w.wait()
    # the caller's arrays themselves, in a flat list, as torch's gloo gives (not the list inside a list)
    assert len(w.result()) == SIZE and all(got is o for got, o in zip(w.result(), outs))
    assert w.get_future().value() == w.result()
    for r, o in enumerate(outs):
        np.testing.assert_array_equal(o, [r, r])

    outs = [np.zeros(2, np.int64) for _ in range(SIZE)]
    w = dist.all_to_all(outs, [np.full(2, rank * 10 + r, np.int64) for r in range(SIZE)], async_op=True)
    w.wait()
    assert len(w.result()) == SIZE and all(got is o for got, o in zip(w.result(), outs))
    for r, o in enumerate(outs):
        np.testing.assert_array_equal(o, [r * 10 + rank] * 2)

    outs = [np.zeros(2, np.int64) for _ in range(SIZE)] if rank == 0 else None
    w = dist.gather(np.full(2, rank, np.int64), outs, dst=0, async_op=True)
    w.wait()
    if rank == 0:
        assert len(w.result()) == SIZE and all(got is o for got, o in zip(w.result(), outs))
    else:
        assert w.result() == []


def test_synchronize_is_wait():
    w, x = started_all_reduce()
    assert w.synchronize() is None
    assert w.is_completed()
    np.testing.assert_array_equal(x, np.full(4, TRI, np.float64))


def test_async_barrier():
    w = dist.barrier(async_op=True)
    assert isinstance(w, Work)
    poll_until_done(w)
    assert w.is_success()
    assert w.result() == []


@pytest.mark.parametrize("timeout", [timedelta(seconds=60), 60, 60.0, None, 0], ids=repr)
def test_wait_with_a_timeout_that_is_long_enough(timeout):
    w, x = started_all_reduce()
    assert w.wait(timeout=timeout) is True
    assert w.is_success()
    np.testing.assert_array_equal(x, np.full(4, TRI, np.float64))


# -- Futures of Works ---------------------------------------------------------------------


def test_get_future_wait_value_done():
    w, x = started_all_reduce()
    fut = w.get_future()
    assert isinstance(fut, Future)
    assert w.get_future() is fut
    result = fut.wait()
    assert isinstance(result, list) and result[0] is x
    assert fut.done() is True
    assert fut.value()[0] is x
    assert w.is_completed()
    np.testing.assert_array_equal(x, np.full(4, TRI, np.float64))


def test_future_done_polls_the_operation():
    w, x = started_all_reduce(1 << 12)
    fut = w.get_future()
    for _ in range(MAX_POLLS):
        if fut.done():
            break
    assert fut.done()
    assert w.is_completed()
    np.testing.assert_array_equal(fut.value()[0], np.full(1 << 12, TRI, np.float64))


def test_get_future_after_completion_is_done_at_once():
    w, x = started_all_reduce()
    w.wait()
    fut = w.get_future()
    assert fut.done()
    assert fut.value()[0] is x


def test_then_transforms_the_value():
    w, x = started_all_reduce()
    doubled = w.get_future().then(lambda f: f.value()[0] * 2)
    np.testing.assert_array_equal(doubled.wait(), np.full(4, 2 * TRI, np.float64))
    assert w.is_completed()
    np.testing.assert_array_equal(x, np.full(4, TRI, np.float64))  # the callback did not change x


def test_then_chained_twice():
    w, x = started_all_reduce()
    chained = w.get_future().then(lambda f: f.value()[0].sum()).then(lambda f: f.value() + 1)
    assert chained.wait() == 4 * TRI + 1
    assert chained.done()
    assert chained.value() == 4 * TRI + 1


def test_then_callback_that_raises():
    w, x = started_all_reduce()

    def broken(f):
        raise KeyError("callback failed")

    child = w.get_future().then(broken)
    grandchild = child.then(lambda f: f.value() + 1)
    with pytest.raises(KeyError, match="callback failed"):
        child.wait()
    with pytest.raises(KeyError, match="callback failed"):
        child.value()
    with pytest.raises(KeyError, match="callback failed"):
        grandchild.wait()
    # the operation itself succeeded
    assert w.is_success()
    np.testing.assert_array_equal(x, np.full(4, TRI, np.float64))


def test_add_done_callback_runs_once_on_completion():
    w, x = started_all_reduce()
    fut = w.get_future()
    seen = []
    fut.add_done_callback(lambda f: seen.append((f, f.value()[0].copy())))
    fut.wait()
    assert len(seen) == 1
    assert seen[0][0] is fut
    np.testing.assert_array_equal(seen[0][1], np.full(4, TRI, np.float64))
    # a callback added after completion runs at once
    late = []
    fut.add_done_callback(late.append)
    assert late == [fut]
    assert len(seen) == 1


# -- Futures created by the user ----------------------------------------------------------


def test_user_future_set_result():
    f = Future()
    assert f.done() is False
    with pytest.raises(RuntimeError, match=r"^Future.value: not completed yet"):
        f.value()
    f.set_result(5)
    assert f.done() is True
    assert f.wait() == 5
    assert f.value() == 5
    with pytest.raises(RuntimeError, match="result already set"):
        f.set_result(6)
    with pytest.raises(RuntimeError, match="result already set"):
        f.set_exception(ValueError("late"))
    assert f.value() == 5


def test_user_future_set_exception():
    f = Future()
    f.set_exception(ValueError("boom"))
    assert f.done()
    with pytest.raises(ValueError, match="boom"):
        f.wait()
    with pytest.raises(ValueError, match="boom"):
        f.value()
    with pytest.raises(RuntimeError, match="result already set"):
        f.set_result(1)
    g = Future()
    with pytest.raises(TypeError, match=r"^Future.set_exception: expected an exception, got str"):
        g.set_exception("boom")
    assert not g.done()


def test_user_future_then_and_callbacks():
    f = Future()
    seen = []
    f.add_done_callback(lambda fut: seen.append(fut.value()))
    child = f.then(lambda fut: fut.value() * 10)
    assert not child.done()
    f.set_result(4)
    assert seen == [4]
    assert child.done()
    assert child.wait() == 40


def test_user_future_completed_from_another_thread():
    f = Future()
    child = f.then(lambda fut: fut.value() + 1)
    ran_in = []
    f.add_done_callback(lambda fut: ran_in.append(threading.current_thread()))
    timer = threading.Timer(0.05, f.set_result, args=(41,))
    timer.start()
    try:
        assert f.wait() == 41  # blocks until the other thread sets the result
        assert child.wait() == 42
    finally:
        timer.join()
    assert ran_in == [timer]  # callbacks run in the thread that completes the future


def test_user_future_exception_from_another_thread():
    f = Future()
    timer = threading.Timer(0.05, f.set_exception, args=(OSError("far away"),))
    timer.start()
    try:
        with pytest.raises(OSError, match="far away"):
            f.wait()
    finally:
        timer.join()


# -- timeouts -------------------------------------------------------------------------------


def test_wait_that_cannot_complete_times_out():
    """A receive nobody sends to times out within the wait's timeout (and is cancelled), leaving other groups intact."""
    groups_before = dist.get_pg_count()
    g = dist.new_group()  # a private group: its stuck receives cannot catch other tests' messages
    me = dist.get_rank(g)
    bufs = [np.zeros(3), np.zeros(3)]
    works = [dist.irecv(bufs[0], group=g, group_src=me, tag=11), dist.irecv(bufs[1], group=g, group_src=me, tag=12)]
    problems = []
    for w, timeout in zip(works, (timedelta(milliseconds=300), 0.3)):
        if w.is_completed():
            problems.append(f"{w!r} completed without a sender")
        problems += check_raises(
            TypeError, r"^Work.wait: timeout must be a datetime.timedelta or seconds", w.wait, timeout="0.3"
        )
        problems += check_raises(ValueError, r"^Work.wait: timeout must not be negative", w.wait, timeout=-1)
        if w.is_completed():
            problems.append("a wait() with a bad timeout changed the operation")
        t0 = time.perf_counter()
        try:
            w.wait(timeout=timeout)
        except DistBackendError as exc:
            elapsed = time.perf_counter() - t0
            if "did not complete within the timeout" not in str(exc):
                problems.append(f"unexpected message: {exc}")
            if not 0.25 <= elapsed < 30:
                problems.append(f"timed out after {elapsed:.3f} s, expected about 0.3 s")
        else:
            problems.append("wait() returned instead of timing out")
        if not (w.is_completed() and not w.is_success() and isinstance(w.exception(), DistBackendError)):
            problems.append(f"state after the timeout: {w!r} {w.exception()!r}")
        if "failed" not in repr(w):
            problems.append(f"repr after the timeout: {w!r}")
        try:
            w.wait()
            problems.append("a second wait() succeeded")
        except DistBackendError as exc:
            if exc is not w.exception():
                problems.append("a second wait() raised a different error")
        try:
            w.get_future().wait()
            problems.append("the future of a failed work succeeded")
        except DistBackendError:
            pass
    # the receives that timed out were cancelled: nothing is pending, and messages go to the next receives
    if backend_of(g).pending():
        problems.append("the receives that timed out are still pending")
    fresh = [np.zeros(3), np.zeros(3)]
    for i, tag in enumerate((11, 12)):
        r = dist.irecv(fresh[i], group=g, group_src=me, tag=tag)
        dist.isend(np.full(3, i + 1.0), group=g, group_dst=me, tag=tag).wait(timeout=60)
        r.wait(timeout=60)
    if not (np.array_equal(fresh[0], np.full(3, 1.0)) and np.array_equal(fresh[1], np.full(3, 2.0))):
        problems.append(f"the receives after the timeouts got {fresh}")
    if any(b.any() for b in bufs):
        problems.append(f"the arrays of the cancelled receives were written: {bufs}")
    dist.destroy_process_group(g)
    if dist.get_pg_count() != groups_before:
        problems.append(f"{dist.get_pg_count()} groups are left, expected {groups_before}")
    # the default group is unaffected
    x = np.array([RANK + 1.0])
    dist.all_reduce(x)
    assert x[0] == TRI
    fail_together(problems)


# -- overlap and many outstanding operations --------------------------------------------------


def test_async_all_reduce_overlaps_with_compute():
    n = 1 << 19  # 4 MiB of float64
    x = np.full(n, RANK + 1.0)
    work = dist.all_reduce(x, async_op=True)
    rng = np.random.default_rng(RANK)
    data = rng.standard_normal((64, 64))
    acc = np.zeros((64, 64))
    chunks = 0
    done_after = None
    for chunk in range(MAX_POLLS):
        acc += data @ data  # a chunk of unrelated compute
        chunks += 1
        if work.is_completed():
            done_after = chunk + 1
            break
    assert done_after is not None, "the all_reduce did not complete while computing"
    assert work.is_success()
    np.testing.assert_array_equal(x, np.full(n, float(TRI)))
    # the compute is right too (nothing was clobbered while communicating)
    np.testing.assert_allclose(acc, chunks * (data @ data), rtol=1e-12, atol=1e-9)
    assert work.wait() is True


def test_many_outstanding_operations_complete_in_any_wait_order(rank, world_size):
    n = world_size
    works, checks = [], []

    for i, dtype in enumerate((np.int32, np.int64, np.float32, np.float64, np.uint16, np.complex64)):
        x = np.full(5 + i, rank + 1, dtype)
        works.append(dist.all_reduce(x, async_op=True))
        checks.append((x, np.full(5 + i, TRI, dtype)))
    for root in range(n):
        b = np.arange(4, dtype=np.int64) + 10 * root if rank == root else np.zeros(4, np.int64)
        works.append(dist.broadcast(b, src=root, async_op=True))
        checks.append((b, np.arange(4, dtype=np.int64) + 10 * root))
    mx = np.array([rank], np.int64)
    works.append(dist.all_reduce(mx, op=dist.ReduceOp.MAX, async_op=True))
    checks.append((mx, np.array([n - 1], np.int64)))
    g = np.zeros(2 * n, np.float64)
    works.append(dist.all_gather_into_tensor(g, np.full(2, float(rank)), async_op=True))
    checks.append((g, np.repeat(np.arange(n, dtype=np.float64), 2)))
    rs = np.zeros(3, np.int64)
    works.append(dist.reduce_scatter_tensor(rs, np.arange(3 * n, dtype=np.int64), async_op=True))
    checks.append((rs, n * np.arange(3 * rank, 3 * rank + 3, dtype=np.int64)))
    a2a = np.zeros(n, np.int64)
    works.append(dist.all_to_all_single(a2a, np.arange(n, dtype=np.int64) + 100 * rank, async_op=True))
    checks.append((a2a, 100 * np.arange(n, dtype=np.int64) + rank))
    works.append(dist.barrier(async_op=True))
    checks.append(None)

    order = list(range(len(works)))
    random.Random(rank).shuffle(order)  # every rank waits in its own order
    for i in order:
        assert works[i].wait() is True
    for w, check in zip(works, checks):
        assert w.is_success()
        if check is not None:
            got, expected = check
            np.testing.assert_array_equal(got, expected)


def test_outstanding_operations_polled_round_robin():
    xs = [np.full(1000 * (i + 1), RANK + i, np.float64) for i in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    pending = set(range(len(works)))
    for _ in range(MAX_POLLS):
        pending = {i for i in pending if not works[i].is_completed()}
        if not pending:
            break
    assert not pending
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(x, np.full(x.size, TRI - SIZE + i * SIZE, np.float64))


# -- buffers stay alive ---------------------------------------------------------------------


def test_buffers_stay_alive_until_completion():
    def launch_contiguous():
        return dist.all_reduce(np.full(1 << 14, RANK + 1.0), async_op=True)

    def launch_strided():
        base = np.arange(4000.0) * (RANK + 1)
        view = base[::2]  # staged through a contiguous copy, written back on completion
        return dist.all_reduce(view, async_op=True), weakref.ref(base)

    def launch_broadcast():
        b = np.arange(100.0) if RANK == 0 else np.zeros(100)
        return dist.broadcast(b, src=0, async_op=True)

    w1 = launch_contiguous()
    w2, base_ref = launch_strided()
    w3 = launch_broadcast()
    gc.collect()
    assert base_ref() is not None  # the Work keeps the caller's array alive
    for w in (w3, w2, w1):
        w.wait()
    np.testing.assert_array_equal(w1.result()[0], np.full(1 << 14, float(TRI)))
    np.testing.assert_array_equal(w2.result()[0], np.arange(0, 4000.0, 2) * TRI)
    np.testing.assert_array_equal(base_ref()[::2], np.arange(0, 4000.0, 2) * TRI)  # written back into the base
    np.testing.assert_array_equal(w3.result()[0], np.arange(100.0))
    # once the caller drops the Work, nothing keeps the arrays alive
    del w1, w2, w3
    gc.collect()
    assert base_ref() is None


def test_buffers_stay_alive_for_futures():
    def launch():
        x = np.full(256, RANK + 1, np.int64)
        return dist.all_reduce(x, async_op=True).get_future().then(lambda f: f.value()[0].sum())

    fut = launch()
    gc.collect()
    assert fut.wait() == 256 * TRI
