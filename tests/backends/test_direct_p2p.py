"""Point-to-point on the direct route (backends/_direct_p2p.c) against the same calls through mpi4py.

Groups made inside ``mpidist.testing.mpi4py_calls()`` take mpidist's Python paths (as with
``MPIDIST_C_EXTENSIONS=0``); the others send, receive and post receives from C. Both must
deliver the same data, return the same sources and raise the same errors. The blocking
``recv`` has two routes in C (a scratch buffer up to 16 KiB, a probe above): each must leave
the array untouched for a message of another size also when that message arrives after the
receive started, which is when the size can only be checked after the receive.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist.backends import direct as direct_module
from mpidist.errors import DistBackendError
from mpidist.testing import mpi_calls

from helpers import Checks, rank_input

pytestmark = [pytest.mark.timeout(120), pytest.mark.mpi(min_size=2)]

#: the sizes of the blocking recv's routes: through the scratch buffer up to 16 KiB, probed above
SCRATCH_MAX = direct_module.SCRATCH_MAX  # the size classes the test crosses (on Open MPI every recv probes)


def _pair(rank: int) -> int | None:
    """Ranks 0 and 1 talk to each other; the others sit the tests out (None)."""
    return 1 - rank if rank < 2 else None


@pytest.mark.parametrize("nbytes", [0, 8, 4096, SCRATCH_MAX, SCRATCH_MAX + 8, 1 << 20])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.complex128, np.bool_], ids=str)
def test_send_recv_isend_irecv_agree_on_both_routes(two_groups, nbytes, dtype, rank):
    c = Checks()
    peer = _pair(rank)
    n = nbytes // np.dtype(dtype).itemsize
    for g in two_groups:
        if peer is None:
            continue
        where = f"{mpi_calls(g)} {nbytes} B {np.dtype(dtype)}"
        mine, theirs = rank_input(rank, (n,), np.dtype(dtype)), rank_input(peer, (n,), np.dtype(dtype))
        got = np.zeros(n, dtype)
        if rank == 0:
            dist.send(mine, dst=peer, group=g, tag=5)
            source = dist.recv(got, src=peer, group=g, tag=5)
        else:
            source = dist.recv(got, group=g, tag=5)  # any source
            dist.send(mine, dst=peer, group=g, tag=5)
        c.equal(f"{where}: recv's data", got, theirs)
        c.equal(f"{where}: recv's source", source, peer)
        got = np.zeros(n, dtype)
        works = [dist.irecv(got, src=peer, group=g, tag=6), dist.isend(mine, dst=peer, group=g, tag=6)]
        for w in works:
            w.wait()
        c.equal(f"{where}: irecv's data", got, theirs)
        c.equal(f"{where}: irecv's source", works[0].source_rank(), peer)
    c.done()


#: (array elements of float64, what is sent, its dtype) for a blocking recv: both routes, each way wrong
LATE = {
    "scratch-shorter": (5, 3, np.float64),
    "scratch-longer": (5, 8, np.float64),
    "scratch-ragged": (5, 7, np.int8),
    "scratch-far-longer": (5, 20000, np.float64),  # more than the scratch buffer holds: MPI truncates it
    "probed-shorter": (4096, 4000, np.float64),
    "probed-longer": (4096, 5000, np.float64),
}


def _size_error(case: str, size: int, sent: int, dtype: type, src: int, direct: bool) -> str:
    if case == "scratch-far-longer" and direct and direct_module.scratch_max():
        return f"recv: a message from rank {src} (group rank) is larger than the {size} elements of float64 expected"
    arrived = f"{sent * np.dtype(dtype).itemsize} bytes" if dtype != np.float64 else str(sent)
    return f"recv: expected {size} elements of float64 from rank {src} (group rank) but {arrived} arrived"


@pytest.mark.parametrize("case", list(LATE))
def test_a_message_of_another_size_that_comes_late_leaves_the_array_untouched(two_groups, case, rank):
    """Rank 1 is in recv before rank 0 sends a message of another size (0.2 s later): the ValueError names
    the function, the sender and both sizes (the scratch route cannot know the size of a message larger
    than its buffer, which MPI truncates: it says larger, as irecv does), the array keeps its contents, and
    the next message arrives whole."""
    size, sent, dtype = LATE[case]
    c = Checks()
    peer = _pair(rank)
    for g in two_groups:
        if peer is None:
            continue
        where = f"{mpi_calls(g)} {case}"
        if rank == 0:
            time.sleep(0.2)
            dist.send(np.arange(sent).astype(dtype), dst=1, group=g, tag=9)
            dist.send(np.arange(size, dtype=np.float64), dst=1, group=g, tag=9)
        else:
            inp = np.full(size, -1.0)
            error = _size_error(case, size, sent, dtype, 0, mpi_calls(g) == "direct")
            want = "^" + re.escape(error + "; sizes must match") + "$"
            c.raises(ValueError, want, dist.recv, inp, src=0, group=g, tag=9)
            c.equal(f"{where}: the array after the error", inp, np.full(size, -1.0))
            c.equal(f"{where}: the next recv's source", dist.recv(inp, src=0, group=g, tag=9), 0)
            c.equal(f"{where}: the next message", inp, np.arange(size, dtype=np.float64))
    c.done()


@pytest.mark.parametrize("size", [5, 4096], ids=["scratch", "probed"])
def test_a_blocking_recv_still_times_out_and_leaves_nothing_posted(size, rank):
    """No message within the group's timeout: DistBackendError, nothing left posted (the group stays usable),
    and the message sent afterwards arrives in the next recv, on either route."""
    g = dist.new_group(timeout=1)
    c = Checks()
    if rank == 1:
        inp = np.full(size, -1.0)
        try:
            dist.recv(inp, src=0, group=g, tag=3)
            c.true("recv returned without a message", False)
        except DistBackendError as exc:
            c.true(f"the error says nothing is left posted: {exc}", "nothing is left posted" in str(exc))
            c.true(f"the error says the group is usable: {exc}", "The group is still usable" in str(exc))
        c.equal("the array after the timeout", inp, np.full(size, -1.0))
    MPI.COMM_WORLD.Barrier()
    if rank == 0:
        dist.send(np.arange(size, dtype=np.float64), dst=1, group=g, tag=3)
    elif rank == 1:
        c.equal("the next recv's source", dist.recv(inp, src=0, group=g, tag=3), 0)
        c.equal("the next message", inp, np.arange(size, dtype=np.float64))
    c.done()
    dist.destroy_process_group(g)


def test_a_staged_and_a_read_only_array_keep_their_rules_on_both_routes(two_groups, rank):
    """A non-contiguous array is received through a staged copy and written back; a read-only one is refused."""
    c = Checks()
    peer = _pair(rank)
    for g in two_groups:
        if peer is None:
            continue
        base = np.full((4, 2), -1.0)
        view = base[:, 0]
        if rank == 0:
            dist.send(np.arange(4.0), dst=1, group=g)
        else:
            c.equal("recv's source", dist.recv(view, src=0, group=g), 0)
            c.equal("the strided view", base, np.array([[0.0, -1], [1, -1], [2, -1], [3, -1]]))
            frozen = np.zeros(2)
            frozen.flags.writeable = False
            c.raises(ValueError, "read-only", dist.recv, frozen, src=0, group=g)
    c.done()


def test_wait_tests_mpi4py_s_request_in_place_and_fills_its_status(rank):
    # Work.wait's first test (Sent, Receive): Direct.wait on an mpi4py Request, as its own Test would
    comm = MPI.COMM_SELF
    calls = direct_module.make_calls(comm)
    status, got = MPI.Status(), np.zeros(3)
    req = comm.Irecv([got, MPI.DOUBLE], 0, 9)
    assert calls.wait(req, status, 4) is False  # nothing sent yet: still pending
    assert calls.wait(req, None, -2) is False  # the yielding tests (more ranks than cores) end too
    assert req != MPI.REQUEST_NULL
    comm.Isend([np.arange(3.0) + rank, MPI.DOUBLE], 0, 9).Wait()
    assert calls.wait(req, status, 1 << 20) is True
    assert req == MPI.REQUEST_NULL  # completed in place: the handle is freed, as after Test
    assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.DOUBLE)) == (0, 9, 3)
    assert got.tolist() == [rank, rank + 1.0, rank + 2.0]
    assert calls.wait(req, None, 1) is True  # a null request is complete
    assert calls.wait(req, status, 2.5) is True  # an argument C does not take: mpi4py's Test
