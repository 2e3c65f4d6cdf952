"""Hostile-input reproductions of issue 13 that no other module covered in the issue's exact form.

Each test is the few-line scenario the issue describes, asserting the fixed (or
documented) behaviour; the map from each finding to its tests is in the closing
note of the issue. Every test runs on a group of its own with a short timeout,
so a failure cannot block later tests, and problems are decided together.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import DistBackendError
from mpidist.testing import backend_of, calls_issued

from helpers import REPO, Checks, check_raises, clean_env, mpiexec_command, sum_ok

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()

pytestmark = pytest.mark.timeout(60)


# -- finding 1: a check that fails on the root only, at debug level DETAIL -------------------------


@pytest.mark.mpi(min_size=2)
def test_detail_gather_object_with_a_wrong_list_on_the_root_leaves_nothing_for_the_next_calls(fresh):
    """Before: the next all_gather_object returned rank 1's stale payload, and under DETAIL the next call
    raised AttributeError ('dict' object has no attribute 'op') from the checker unpickling the leftover."""
    c = Checks()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    slots = [None] * (SIZE + 1) if RANK == 0 else None
    c.raises(ValueError, f"has {SIZE + 1} slots", dist.gather_object, {"secret": "from-failed-gather"}, slots,
             dst=0, group=fresh)  # fmt: skip
    sum_ok(c, fresh)
    out: list = [None] * SIZE
    dist.all_gather_object(out, ("after", RANK), group=fresh)
    c.equal("all_gather_object afterwards", out, [("after", r) for r in range(SIZE)])
    c.done()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", ["OFF", "DETAIL"])
def test_broadcast_object_list_of_other_lengths_raises_at_once_and_leaves_the_group_usable(fresh, level):
    """Receivers whose list has another length than the source's raise ValueError as soon as the broadcast
    arrives (not at the timeout), their lists untouched; at DETAIL every rank raises, the source too, naming
    the lengths. The group carries the next calls correctly."""
    c = Checks()
    dist.set_debug_level(level)
    objs = ["a", "b", "c"] if RANK == 0 else ["keep"] * (2 + RANK % 2 * 2)  # 2 or 4 items, never 3
    if level == "DETAIL":
        c.raises(ValueError, r"object_list has 3 items on the source rank 0 but 4 on rank 1\b", dist.broadcast_object_list,
                 objs, src=0, group=fresh)  # fmt: skip
        c.equal("the list", objs, ["a", "b", "c"] if RANK == 0 else ["keep"] * len(objs))
    elif RANK == 0:
        dist.broadcast_object_list(objs, src=0, group=fresh)
        c.equal("the source's list", objs, ["a", "b", "c"])
    else:
        c.raises(ValueError, r"object_list has \d items here but 3 on the source rank", dist.broadcast_object_list,
                 objs, src=0, group=fresh)  # fmt: skip
        c.equal("the receiver's list", objs, ["keep"] * len(objs))
    after = ["ok", RANK] if RANK == 0 else [None, None]
    dist.broadcast_object_list(after, src=0, group=fresh)
    c.equal("broadcast_object_list afterwards", after, ["ok", 0])
    sum_ok(c, fresh)
    c.done()


# -- finding 2: what a timed-out receive and a timed-out send leave behind ---------------------------


@pytest.mark.mpi(min_size=2)
def test_recv_object_list_that_timed_out_leaves_nothing_and_the_next_one_gets_the_objects():
    """docs/sharp-bits.md lists recv_object_list among the receives a timeout leaves nothing of: rank 1's
    receive times out (rank 0 has not sent), then rank 0's objects arrive in rank 1's next receive."""
    g = dist.new_group(timeout=timedelta(seconds=1))
    c = Checks()
    if RANK == 1:
        got: list = [None]
        c.raises(DistBackendError, r"still usable\.$", dist.recv_object_list, got, src=0, group=g)
        c.equal("the list after the timeout", got, [None])
    dist.barrier()
    if RANK == 0:
        dist.send_object_list([{"late": 1}], dst=1, group=g)
    elif RANK == 1:
        got = [None]
        c.equal("the sender", dist.recv_object_list(got, src=0, group=g), 0)
        c.equal("the objects", got, [{"late": 1}])
        c.true("a receive is left pending", not g.control.pending())
    dist.barrier()
    dist.destroy_process_group(g)
    c.done()


@pytest.mark.mpi(min_size=2)
def test_a_send_that_timed_out_stays_pending_and_a_later_receive_gets_its_message():
    """docs/sharp-bits.md: MPI cannot cancel a send, so an isend whose wait times out stays posted (the group
    is unusable) and a matching receive the peer posts later gets that old message; the send then completes."""
    g = dist.new_group(timeout=timedelta(seconds=30))
    c = Checks()
    big = 4 << 20  # 32 MiB of float64: far above any eager limit, so the send needs its receiver
    if RANK == 0:
        w = dist.isend(np.arange(big, dtype=np.float64), dst=1, group=g, tag=5)
        c.raises(DistBackendError, r"did not complete within the timeout of 0\.5 s\..*The group is unusable now",
                 w.wait, timeout=0.5)  # fmt: skip
        c.true("the timed-out send is not pending", backend_of(g).pending())
    dist.barrier()
    if RANK == 1:
        got = np.zeros(big)
        dist.recv(got, src=0, group=g, tag=5)
        c.true("the later receive did not get the old message", np.array_equal(got, np.arange(big, dtype=np.float64)))
    dist.barrier()
    if RANK == 0:
        c.true("the send is still pending after its message was received", not backend_of(g).pending())
    dist.destroy_process_group(g)
    c.done()


# -- finding 8: arguments checked before anything is posted -----------------------------------------


@pytest.mark.parametrize(
    ("bad", "kind", "text"),
    [("1s", TypeError, "must be a datetime.timedelta or seconds, got str"), (-1, ValueError, "must not be negative"),
     (float("nan"), ValueError, "must be a number of seconds, got nan")],
    ids=["str", "negative", "nan"],
)  # fmt: skip
@pytest.mark.parametrize("async_op", [False, True])
def test_barrier_with_a_bad_timeout_names_barrier_and_posts_nothing(fresh, bad, kind, text, async_op):
    """Before: barrier(timeout="1s") and timeout=-1 raised from Work.wait, with the barrier already posted."""
    c = Checks()
    before = calls_issued(fresh)
    c.raises(kind, "^barrier: timeout " + re.escape(text), dist.barrier, group=fresh, async_op=async_op, timeout=bad)
    c.equal("calls issued by the refused barrier", calls_issued(fresh) - before, 0)
    dist.barrier(group=fresh, timeout=30)
    sum_ok(c, fresh)
    c.done()


@pytest.mark.mpi(min_size=2)
def test_an_async_barrier_waits_as_long_as_its_timeout():
    """barrier(timeout=0.5, async_op=True): the Work's wait() without a timeout ends at 0.5 s, not the group's 30 s
    (before: the timeout was ignored, unchecked, with async_op=True). The late ranks then join and it completes."""
    g = dist.new_group(timeout=timedelta(seconds=30))
    c = Checks()
    if RANK == 0:
        w = dist.barrier(group=g, async_op=True, timeout=0.5)
        c.raises(DistBackendError, r"^barrier \(call #1\) .* did not complete within the timeout of 0\.5 s\.", w.wait)
    dist.barrier()
    if RANK != 0:
        c.true("the late barrier", dist.barrier(group=g, async_op=True, timeout=timedelta(seconds=30)).wait())
    dist.barrier()
    dist.destroy_process_group(g)
    c.done()


def test_work_wait_with_a_nan_timeout_is_refused_not_the_group_timeout(fresh):
    c = Checks()
    x = np.full(2, RANK + 1.0)
    w = dist.all_reduce(x, group=fresh, async_op=True)
    c.raises(ValueError, r"^Work\.wait: timeout must be a number of seconds, got nan$", w.wait, timeout=float("nan"))
    w.wait()
    c.equal("the all_reduce", x, np.full(2, SIZE * (SIZE + 1) / 2))
    c.done()


@pytest.mark.parametrize("fn", ["recv", "recv_object_list"])
def test_a_receive_from_this_rank_itself_raises_at_once_and_posts_nothing(fresh, fn):
    """Before: recv(src=self) raised at once, recv_object_list(src=self) waited the timeout and left a receive."""
    c = Checks()
    arg = np.zeros(2) if fn == "recv" else [None]
    problems = check_raises(ValueError, f"^{fn}: .*this process itself", getattr(dist, fn), arg, src=RANK, group=fresh)
    c.failures += problems
    c.true("a receive is left pending", not fresh.control.pending() and not backend_of(fresh).pending())
    sum_ok(c, fresh)
    c.done()


# -- a fuzz of arguments: wrong kinds refused before anything is posted -------------------------------


def _calls() -> dict:
    """The arguments (but the group) of a correct call of every collective that takes ``async_op``, by name."""
    n, k = SIZE, 3

    def t():
        return np.full(k, RANK + 1.0)

    return {
        "broadcast": dict(tensor=t(), src=0),
        "all_reduce": dict(tensor=t()),
        "reduce": dict(tensor=t(), dst=0),
        "all_gather": dict(tensor_list=[np.zeros(k) for _ in range(n)], tensor=t()),
        "all_gather_into_tensor": dict(output_tensor=np.zeros(n * k), input_tensor=t()),
        "gather": dict(tensor=t(), gather_list=[np.zeros(k) for _ in range(n)] if RANK == 0 else None, dst=0),
        "scatter": dict(tensor=np.zeros(k), scatter_list=[t() for _ in range(n)] if RANK == 0 else None, src=0),
        "reduce_scatter": dict(output=np.zeros(k), input_list=[t() for _ in range(n)]),
        "reduce_scatter_tensor": dict(output=np.zeros(k), input=np.ones(n * k)),
        "all_to_all_single": dict(output=np.zeros(n * k), input=np.ones(n * k)),
        "all_to_all": dict(
            output_tensor_list=[np.zeros(k) for _ in range(n)], input_tensor_list=[t() for _ in range(n)]
        ),
        "barrier": {},
        "all_reduce_coalesced": dict(tensors=[t(), t()]),
        "all_gather_coalesced": dict(output_tensor_lists=[[np.zeros(k)] for _ in range(n)], input_tensor_list=[t()]),
    }


COLLECTIVES = list(_calls())


@pytest.mark.parametrize("fn", COLLECTIVES)
def test_async_op_that_is_not_a_bool_is_refused_before_anything_is_posted(fresh, fn):
    """Before: async_op=np.array([...]) raised numpy's "truth value is ambiguous" after the call was posted, and
    the lost Work's buffers were freed while MPI wrote into them (heap corruption, then a crash); async_op="x"
    or nan counted as True. numpy's bool is a bool, and an int counts by its truth (torch takes 1 and 0)."""
    c = Checks()
    for bad in ("x", float("nan"), np.zeros(3, dtype=object), None, 1.0):
        before = calls_issued(fresh)
        c.raises(TypeError, f"^{fn}: async_op must be a bool, got {type(bad).__name__}$", getattr(dist, fn),
                 group=fresh, async_op=bad, **_calls()[fn])  # fmt: skip
        c.equal(f"calls issued by the refused {fn}(async_op={bad!r})", calls_issued(fresh) - before, 0)
    w = getattr(dist, fn)(group=fresh, async_op=np.bool_(True), **_calls()[fn])
    c.true("async_op=numpy.True_ gives a Work", w is not None and w.wait())
    w = getattr(dist, fn)(group=fresh, async_op=1, **_calls()[fn])
    c.true("async_op=1 gives a Work", w is not None and w.wait())
    c.true("async_op=0 waits and returns None", getattr(dist, fn)(group=fresh, async_op=0, **_calls()[fn]) is None)
    sum_ok(c, fresh)
    c.done()


@pytest.mark.parametrize("fn", ["broadcast", "reduce", "broadcast_object_list"])
def test_a_root_that_is_an_array_is_a_type_error_naming_the_function(fresh, fn):
    """Before: numpy's "only integer scalar arrays can be converted to a scalar index", naming no function."""
    c = Checks()
    arg, first = ("dst", np.zeros(2)) if fn == "reduce" else ("src", [1] if fn.endswith("list") else np.zeros(2))
    c.raises(TypeError, f"^{fn}: {arg} must be an int rank, got ndarray$", getattr(dist, fn), first,
             group=fresh, **{arg: np.zeros(3, dtype=object)})  # fmt: skip
    sum_ok(c, fresh)
    c.done()


@pytest.mark.parametrize("fn", ["isend", "irecv"])  # send and recv check the tag alike, after self (n = 1)
def test_a_tag_that_is_an_array_is_a_type_error_naming_the_function(fresh, fn):
    """Before: numpy's "only integer scalar arrays can be converted to a scalar index", naming no function."""
    c = Checks()
    peer = {"dst": (RANK + 1) % SIZE} if fn.endswith("send") else {"src": (RANK - 1) % SIZE}
    c.raises(TypeError, f"^{fn}: tag must be an int, got ndarray$", getattr(dist, fn), np.zeros(2), group=fresh,
             tag=np.zeros(3, dtype=object), **peer)  # fmt: skip
    sum_ok(c, fresh)
    c.done()


# -- a posted receive of a message that is not a whole number of its elements ------------------------

RAGGED_IRECV = """\
import numpy as np
import mpidist as dist

dist.init_process_group(timeout=20)
receives = {
    "irecv": lambda out: dist.irecv(out, src=0).wait(),
    "recv_init": lambda out: dist.recv_init(out, src=0).start().wait(),
    "batch_isend_irecv": lambda out: [w.wait() for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, 0)])],
}
for name, receive in receives.items():
    if dist.get_rank() == 0:
        dist.isend(np.zeros(3, np.float32), dst=1).wait()  # 12 bytes
    else:
        out = np.full(3, -1.0)
        try:
            receive(out)  # 3 float64: 12 bytes are 1.5 elements
            print(f"RESULT {name} received {out.tolist()}", flush=True)
        except ValueError as exc:
            print(f"RESULT {name} ValueError {exc}", flush=True)
    dist.barrier()
x = np.arange(4.0) if dist.get_rank() == 0 else np.zeros(4)
if dist.get_rank() == 0:
    dist.send(x, dst=1)
else:
    dist.recv(x, src=0)
    print(f"RESULT afterwards {x.tolist()}", flush=True)
dist.barrier()
"""


@pytest.mark.skipif(not (Path(sys.executable).parent / "mpiexec").exists(), reason="no mpiexec next to the interpreter")
@pytest.mark.one_rank  # a job of its own (mpiexec -n 2)
def test_a_posted_receive_of_a_message_that_is_not_whole_elements_raises(tmp_path):
    """Before: a blocking recv raised ValueError, but a posted receive (irecv, recv_init, batch_isend_irecv) of
    12 bytes into float64 was unpacked by MPI itself, and MPICH 5 failed an assertion and aborted the job.
    Posted as bytes, each raises the ValueError naming the 12 bytes, and the job goes on. Run in a job of its own
    (rank 0 of this one), so that a regression ends that job only."""
    c = Checks()
    if RANK == 0:
        script = tmp_path / "ragged.py"
        script.write_text(RAGGED_IRECV)
        env = clean_env(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run([*mpiexec_command(2), sys.executable, str(script)], env=env, capture_output=True,
                                  text=True, timeout=90)  # fmt: skip
        except subprocess.TimeoutExpired:
            c.failures.append("the job did not end within 90 s")
        else:
            out = proc.stdout + proc.stderr
            c.equal(f"exit status; output: {out[-2000:]}", proc.returncode, 0)
            for name in ("irecv", "recv_init", "batch_isend_irecv"):
                c.true(f"{name}: ValueError naming the 12 bytes; output: {out[-2000:]}",
                       f"RESULT {name} ValueError recv: expected 3 elements of float64 from rank 0 (group rank) "
                       "but 12 bytes arrived" in out)  # fmt: skip
            c.true("a correct receive afterwards", "RESULT afterwards [0.0, 1.0, 2.0, 3.0]" in out)
    c.done()


# -- a message nobody received on a destroyed group ---------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["isend", "send_object_list", "send_init"])
def test_a_message_nobody_received_never_reaches_a_later_group(how):
    """Found by the fuzz: rank 0 sent on group A (eagerly: the send completed) and nobody received it; A was
    destroyed, its communicator freed, and MPICH gave group B the same context, so rank 1's recv on B got A's
    [42, 42]. destroy_process_group now frees a group's communicators only when the messages sent on it
    were all received (summed over the members); else it leaves them allocated."""
    c = Checks()
    a = dist.new_group(timeout=timedelta(seconds=5))
    if RANK == 0:
        if how == "isend":
            dist.isend(np.full(2, 42.0), dst=1, group=a)
        elif how == "send_object_list":
            dist.send_object_list([np.full(2, 42.0)], dst=1, group=a)
        else:
            with dist.send_init(np.full(2, 42.0), dst=1, group=a) as p:
                p.start().wait()  # completes eagerly
    dist.barrier()
    dist.destroy_process_group(a)
    b = dist.new_group(timeout=timedelta(seconds=5))
    if RANK == 0:
        dist.send(np.full(2, 7.0), dst=1, group=b)
    elif RANK == 1:
        x = np.zeros(2)
        dist.recv(x, src=0, group=b)
        c.equal("the message received on the new group", x.tolist(), [7.0, 7.0])
    sum_ok(c, b)
    dist.destroy_process_group(b)
    c.done()
