"""Large messages: arrays of more than 2**31 elements (over 2 GiB) in every collective and in p2p,
and objects over 2 GiB in the object collectives.

Slow and memory-hungry: every test runs only at world size 2 and only when the
node has the free memory it states (``MemAvailable`` in /proc/meminfo, read by
both ranks and decided together); otherwise it is skipped with the reason.

Memory is kept low on purpose. Arrays are int8 with N = 2**31 + 1024 elements.
Send buffers are made with ``np.zeros`` and a few markers: untouched pages of a
fresh zeroed allocation cost no memory, so only the receive buffers (filled
with -1 beforehand, so that a region MPI never wrote shows up) take real
memory. Values are checked at a few positions around the 2**31 boundary and at
the ends instead of comparing whole arrays. Each test frees its arrays and
checks that the process gave the memory back (nothing inside mpidist keeps a
large buffer alive).
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist

from helpers import fail_together

#: MPI-4 libraries (MPICH >= 4) take 64-bit counts; MPI-3 ones (Open MPI 5) at most 2**31 - 1 elements a call
LARGE_COUNTS = MPI.Get_version() >= (4, 0)

pytestmark = [
    pytest.mark.slow,
    # before any fixture (the gc.collect of _collect took ~0.5 s per test where need() then skipped it)
    pytest.mark.skipif(
        MPI.COMM_WORLD.Get_size() != 2, reason="large-message tests run at world size 2 only (sized for 2 ranks)"
    ),
    pytest.mark.skipif(
        not LARGE_COUNTS,
        reason=f"MPI {MPI.Get_version()[0]}.{MPI.Get_version()[1]} takes 32-bit counts: messages of 2**31 elements "
        "need an MPI-4 library (test_count_limit_of_an_mpi3_library_is_named checks the error)",
    ),
]

N = 2**31 + 1024  # elements (bytes) per array: more than 2**31, more than 2 GiB
#: positions that carry markers: the ends and both sides of 2**31 (and 2**30)
MARKED = (0, 1, 2**30, 2**31 - 1, 2**31, 2**31 + 1, N - 1)
#: positions that must hold the zeros the sender had there (not the receiver's -1)
ZEROS = (2, 2**31 - 2, 2**31 + 2, N - 2)
GIB = 2**30


def mark(rank: int, k: int, salt: int = 0) -> int:
    """The marker rank ``rank`` puts at MARKED[k] (of block ``salt``): small and distinct."""
    return 1 + k + 10 * rank + 30 * salt  # <= 1 + 6 + 10 + 90 = 107: fits int8, sums of 2 do not overflow


def marked(rank: int, salt: int = 0, blocks: int = 1) -> np.ndarray:
    """``blocks`` blocks of N zeros with block j marked by (rank, salt + j); only marked pages are touched."""
    a = np.zeros(blocks * N, np.int8)
    for j in range(blocks):
        for k, p in enumerate(MARKED):
            a[j * N + p] = mark(rank, k, salt + j)
    return a


def empty(elements: int) -> np.ndarray:
    """A receive buffer filled with -1, so that anything MPI did not write stands out."""
    return np.full(elements, -1, np.int8)


def check_block(what: str, a: Any, offset: int, rank: int, salt: int = 0, zero: int = 0) -> list[str]:
    """Check a block at ``offset`` of ``a`` holds rank ``rank``'s markers and ``zero`` elsewhere."""
    problems = []
    for k, p in enumerate(MARKED):
        got, want = int(a[offset + p]), mark(rank, k, salt)
        if got != want:
            problems.append(f"{what}[{offset + p}] = {got}, expected {want} (rank {rank}'s marker)")
    for p in ZEROS:
        got = int(a[offset + p])
        if got != zero:
            problems.append(f"{what}[{offset + p}] = {got}, expected {zero}")
    return problems


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    return 0.0  # pragma: no cover - every Linux kernel since 3.14 reports it


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GIB
    return 0.0  # pragma: no cover


def need(gib: float) -> None:
    """Skip (on every rank) unless the world has 2 ranks and the node has ``gib`` GiB free for both."""
    size = dist.get_world_size()
    if size != 2:
        pytest.skip(f"large-message tests run at world size 2 only (sized for 2 ranks in 24 GiB); this is {size}")
    free = MPI.COMM_WORLD.allreduce(available_gib(), op=MPI.MIN)  # the same decision on both ranks
    if free < gib:
        pytest.skip(f"needs {gib:g} GiB of free memory for 2 ranks, the node has {free:.1f} GiB available")


def released(problems: list[str]) -> None:
    """After the test dropped its arrays: this process holds no large buffer any more; decide together."""
    gc.collect()
    held = rss_gib()
    if held > 1.0:
        problems.append(f"{held:.2f} GiB still resident after the arrays were dropped (a large buffer is kept alive)")
    fail_together(problems)


@pytest.fixture(autouse=True)
def _collect():
    yield
    gc.collect()


# ---------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------


def test_all_reduce_sum(rank):
    """2 ranks x (N + MPICH's temporary N): about 6 GiB."""
    need(8)
    x = np.ones(N, np.int8)
    for k, p in enumerate(MARKED):
        x[p] = 1 + k + rank
    dist.all_reduce(x)
    problems = [f"all_reduce[{p}] = {int(x[p])}, expected {2 * (1 + k) + 1}" for k, p in enumerate(MARKED)
                if int(x[p]) != 2 * (1 + k) + 1]  # fmt: skip
    problems += [f"all_reduce[{p}] = {int(x[p])}, expected 2" for p in ZEROS if int(x[p]) != 2]
    del x
    released(problems)


def test_all_reduce_max_async(rank):
    """async_op=True and a reduction other than SUM, through the same large-count path: about 6 GiB."""
    need(8)
    x = marked(rank)
    x[N // 2] = 50 * rank  # a touched page in the middle too
    work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    problems = check_block("all_reduce MAX", x, 0, 1)  # rank 1's markers are the larger ones
    if int(x[N // 2]) != 50:
        problems.append(f"all_reduce MAX[{N // 2}] = {int(x[N // 2])}, expected 50")
    del x, work
    released(problems)


def test_broadcast(rank):
    """The receiver's N: about 3 GiB."""
    need(4)
    problems: list[str] = []
    for src in (0, 1):
        x = marked(src) if rank == src else empty(N)
        dist.broadcast(x, src=src)
        problems += check_block(f"broadcast src={src}", x, 0, src)
        del x
        gc.collect()
    released(problems)


def test_all_gather_into_tensor(rank):
    """Input of N elements, output of 2N (about 4.3 GB) per rank: about 9 GiB."""
    need(10)
    inp, out = marked(rank), empty(2 * N)
    dist.all_gather_into_tensor(out, inp)
    problems = check_block("all_gather_into_tensor", out, 0, 0) + check_block("all_gather_into_tensor", out, N, 1)
    del inp, out
    released(problems)


def test_reduce_scatter_tensor(rank):
    """Input of 2N elements (mostly untouched zeros), output N, MPICH's temporary buffer: about 9 GiB."""
    need(10)
    inp, out = marked(rank, blocks=2), empty(N)
    dist.reduce_scatter_tensor(out, inp)
    problems = []
    for k, p in enumerate(MARKED):
        want = mark(0, k, rank) + mark(1, k, rank)
        if int(out[p]) != want:
            problems.append(f"reduce_scatter_tensor[{p}] = {int(out[p])}, expected {want}")
    problems += [f"reduce_scatter_tensor[{p}] = {int(out[p])}, expected 0" for p in ZEROS if int(out[p]) != 0]
    del inp, out
    released(problems)


def test_all_to_all_single(rank):
    """Each rank sends N elements to each rank (2N in, 2N out per rank): about 9 GiB."""
    need(10)
    inp, out = marked(rank, blocks=2), empty(2 * N)
    dist.all_to_all_single(out, inp)
    problems = check_block("all_to_all_single", out, 0, 0, salt=rank)
    problems += check_block("all_to_all_single", out, N, 1, salt=rank)
    del inp, out
    released(problems)


def test_all_to_all_single_uneven(rank):
    """Split sizes over 2**31: rank 0 sends N + 1 elements to rank 1, rank 1 sends 1 element back: about 3 GiB."""
    need(4)
    n_in = [1, N + 1] if rank == 0 else [1, 1]
    n_out = [1, 1] if rank == 0 else [N + 1, 1]
    inp = np.zeros(sum(n_in), np.int8)
    inp[0] = 100 + rank
    if rank == 0:
        for k, p in enumerate(MARKED):
            inp[1 + p] = mark(0, k)
        inp[-1] = 99
    else:
        inp[1] = 101
    out = empty(sum(n_out))
    dist.all_to_all_single(out, inp, output_split_sizes=n_out, input_split_sizes=n_in)
    problems = []
    if rank == 0:
        if [int(out[0]), int(out[1])] != [100, 101]:
            problems.append(f"rank 0 received {[int(out[0]), int(out[1])]}, expected [100, 101]")
    else:
        problems += check_block("all_to_all_single uneven", out, 0, 0)
        if [int(out[N]), int(out[N + 1])] != [99, 101]:
            problems.append(f"rank 1's last two elements {[int(out[N]), int(out[N + 1])]}, expected [99, 101]")
    del inp, out
    released(problems)


def test_all_gather_into_a_list(rank):
    """Two outputs of N per rank: about 9 GiB."""
    need(10)
    inp, outs = marked(rank), [empty(N), empty(N)]
    dist.all_gather(outs, inp)
    problems = check_block("all_gather[0]", outs[0], 0, 0) + check_block("all_gather[1]", outs[1], 0, 1)
    del inp, outs
    released(problems)


def test_gather(rank):
    """The root's two outputs of N: about 5 GiB."""
    need(6)
    inp = marked(rank)
    outs = [empty(N), empty(N)] if rank == 1 else None
    dist.gather(inp, outs, dst=1)
    problems = []
    if rank == 1:
        problems += check_block("gather[0]", outs[0], 0, 0) + check_block("gather[1]", outs[1], 0, 1)
    del inp, outs
    released(problems)


def test_scatter(rank):
    """Each rank's output of N (the root's inputs are mostly untouched zeros): about 5 GiB."""
    need(6)
    ins = [marked(0, salt=j) for j in range(2)] if rank == 0 else None
    out = empty(N)
    dist.scatter(out, ins, src=0)
    problems = check_block("scatter", out, 0, 0, salt=rank)
    del ins, out
    released(problems)


def test_reduce(rank):
    """reduce to rank 1 (in place there): about 5 GiB."""
    need(6)
    x = marked(rank)
    dist.reduce(x, dst=1)
    problems = []
    if rank == 1:
        for k, p in enumerate(MARKED):
            want = mark(0, k) + mark(1, k)
            if int(x[p]) != want:
                problems.append(f"reduce[{p}] = {int(x[p])}, expected {want}")
    else:
        problems += check_block("reduce input on rank 0 (unchanged)", x, 0, 0)
    del x
    released(problems)


# ---------------------------------------------------------------------------------------
# point-to-point
# ---------------------------------------------------------------------------------------


def test_send_recv(rank):
    """Rank 0 sends N elements to rank 1 (blocking), then rank 1 answers with isend/irecv: about 5 GiB."""
    need(6)
    problems = []
    if rank == 0:
        x = marked(0)
        dist.send(x, dst=1)
        y = empty(N)
        dist.irecv(y, src=1, tag=3).wait()
        problems += check_block("irecv from rank 1", y, 0, 1)
    else:
        x = empty(N)
        got = dist.recv(x, src=None)
        if got != 0:
            problems.append(f"recv returned sender {got}, expected 0")
        problems += check_block("recv from rank 0", x, 0, 0)
        y = marked(1)
        dist.isend(y, dst=0, tag=3).wait()
    del x, y
    released(problems)


# ---------------------------------------------------------------------------------------
# objects over 2 GiB
# ---------------------------------------------------------------------------------------


def test_broadcast_object_list_with_a_large_array(rank):
    """A dict holding an int8 array of N elements, out of band: rank 0 sends from the array itself (its
    untouched zero pages cost nothing), rank 1 receives into one buffer of N: about 2.2 GiB."""
    need(4)
    objs: list[Any] = [{"name": "big", "arr": marked(0)}, 42] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    problems = []
    big = objs[0]
    if not (isinstance(big, dict) and big.get("name") == "big" and objs[1] == 42):
        problems.append(f"broadcast_object_list gave {type(big).__name__} and {objs[1]!r}")
    else:
        arr = big["arr"]
        if arr.dtype != np.int8 or arr.shape != (N,):
            problems.append(f"array arrived as {arr.dtype}{arr.shape}, expected int8({N},)")
        else:
            problems += check_block("broadcast_object_list array", arr, 0, 0)
        del arr
    del objs, big
    released(problems)


def test_all_gather_object_with_large_arrays(rank):
    """Every rank contributes a dict with an array of N, sent from the array itself: the gathered 2N per rank,
    about 8.6 GiB."""
    need(10)
    slots: list[Any] = [None, None]
    dist.all_gather_object(slots, {"rank": rank, "arr": marked(rank)})
    problems = []
    for r, obj in enumerate(slots):
        if not (isinstance(obj, dict) and obj.get("rank") == r):
            problems.append(f"slot {r}: {type(obj).__name__}")
            continue
        arr = obj["arr"]
        if arr.dtype != np.int8 or arr.shape != (N,):
            problems.append(f"slot {r}: array arrived as {arr.dtype}{arr.shape}, expected int8({N},)")
        else:
            problems += check_block(f"all_gather_object slot {r}", arr, 0, r)
        del arr
    del slots, obj
    released(problems)


def _big_bytes() -> bytes:
    buf = bytearray(N)
    for k, p in enumerate(MARKED):
        buf[p] = mark(0, k)
    return bytes(buf)


def test_broadcast_object_list_with_large_bytes(rank):
    """A bytes object of N bytes (pickled in band): the bytes and the stream on the source, the stream and the
    bytes on the other rank, about 8.6 GiB."""
    need(10)
    objs: list[Any] = [_big_bytes(), "tail"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    problems = []
    data = objs[0]
    if type(data) is not bytes or len(data) != N or objs[1] != "tail":
        problems.append(f"broadcast_object_list gave {type(data).__name__} of {len(data or b'')} bytes, {objs[1]!r}")
    else:
        problems += check_block("broadcast_object_list bytes", data, 0, 0)
    del objs, data
    released(problems)


def test_send_recv_object_list_with_a_large_array(rank):
    """send_object_list/recv_object_list: sent from the array itself, received into one buffer of N: about
    2.2 GiB."""
    need(4)
    problems = []
    if rank == 0:
        dist.send_object_list([{"arr": marked(0)}], dst=1)
    else:
        objs: list[Any] = [None]
        sender = dist.recv_object_list(objs, src=0)
        if sender != 0:
            problems.append(f"recv_object_list returned {sender}, expected 0")
        arr = objs[0]["arr"]
        problems += check_block("recv_object_list array", arr, 0, 0)
        del objs, arr
    released(problems)


def test_gather_and_scatter_objects_with_large_arrays(rank):
    """gather_object to rank 0 (2N there, sent from the arrays themselves), then scatter_object_list from it
    (N received on each rank): about 4.3 GiB at the most."""
    need(6)
    problems = []
    slots: list[Any] | None = [None, None] if rank == 0 else None
    dist.gather_object({"arr": marked(rank)}, slots, dst=0)
    if rank == 0:
        for r in range(2):
            problems += check_block(f"gather_object slot {r}", slots[r]["arr"], 0, r)
    del slots
    gc.collect()
    ins = [{"arr": marked(0, salt=j)} for j in range(2)] if rank == 0 else None
    out: list[Any] = [None]
    dist.scatter_object_list(out, ins, src=0)
    problems += check_block("scatter_object_list", out[0]["arr"], 0, 0, salt=rank)
    del ins, out
    released(problems)
