"""The shared-memory path's two ways of moving a broadcast and an all_gather_into_tensor, against MPI's call.

Run:  mpiexec -n 2 python benchmarks/bench_one_copy.py [--sizes 262144 1048576 ...] [--trials 7]

Each group measures its ways on its first calls of a size class and takes the fastest
(``backends/shm_choice.py``). To time each way alone, this script makes two groups and
makes each choose one way, by the measuring's test hook (``shm_choice.skew``: one way's
timings count 10^4 times): ``copy`` moves each chunk through the group's segment (the
source copies it in, the others copy it out), ``one copy`` has each rank read the
source's array straight from its memory (``process_vm_readv``). ``raw`` is mpi4py's
blocking call on a duplicate of COMM_WORLD. Trials interleave the three in an order
that turns around each trial; each cell is the median over trials of the slowest
rank's time per call. Where the kernel forbids one rank to read another's memory
(Yama's ptrace_scope, a container's seccomp filter), the one-copy column says so.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mpidist as dist
from mpidist.backends import shm_choice
from mpidist.testing import backend_of

SIZES = [1 << k for k in range(18, 27, 2)]  # 256 KiB .. 64 MiB


def forced(skew: tuple[float, ...], sizes: list[int], n: int) -> Any:
    """A group of every rank whose measuring chose the way ``skew`` favours, for every size and both calls."""
    g = dist.new_group(list(range(n)))
    shm_choice.skew = skew
    try:
        for nbytes in sizes:
            x = np.ones(nbytes // 4, np.float32)
            out = np.zeros(nbytes // 4 * n, np.float32)
            for _ in range(3 * shm_choice.SAMPLES * (shm_choice.WARM + 1) + shm_choice.AGREE_LAG + 1):
                dist.broadcast(x, src=0, group=g)
                dist.all_gather_into_tensor(out, x, group=g)
    finally:
        shm_choice.skew = (1.0, 1.0)
    return g


def per_call(comm: MPI.Comm, f: Callable[[], Any], reps: int) -> float:
    """The slowest rank's seconds per call of ``reps`` back-to-back calls."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return comm.allreduce((time.perf_counter() - start) / reps, MPI.MAX)


def calls_of(coll: str, x: np.ndarray, out: np.ndarray, comm: MPI.Comm, groups: dict[str, Any]) -> dict[str, Any]:
    """One call of ``coll`` per column: raw mpi4py's, then mpidist's on each of ``groups``."""
    if coll == "broadcast":
        calls = {"raw": lambda: comm.Bcast(x, 0)}
        calls.update({k: (lambda g=g: dist.broadcast(x, 0, group=g)) for k, g in groups.items()})
    else:
        calls = {"raw": lambda: comm.Allgather(x, out)}
        calls.update({k: (lambda g=g: dist.all_gather_into_tensor(out, x, group=g)) for k, g in groups.items()})
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes per rank's array")
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    dist.init_process_group("mpi")
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = MPI.COMM_WORLD.Dup()
    one = forced((1e4, 1e4, 1.0), args.sizes, n)
    two = forced((1e4, 1.0, 1e4), args.sizes, n)
    path = backend_of(one).shared_memory()
    if rank == 0:
        print(f"# {n} ranks; {MPI.Get_library_version().splitlines()[0]}")
        if path is None:
            print("# no shared-memory path in this job (several nodes, or MPIDIST_SHM=0)")
        elif not path.one_copy:
            print("# the ranks may not read each other's memory here: 'one copy' is the copy through the segment")
        print(f"{'collective':24s} {'size':>10s} {'raw (us)':>10s} {'copy/raw':>9s} {'one copy/raw':>13s}")
    for coll in ("broadcast", "all_gather_into_tensor"):
        for nbytes in args.sizes:
            x = np.ones(nbytes // 4, np.float32)
            out = np.zeros(nbytes // 4 * n, np.float32)
            reps = max(5, (64 << 20) // (nbytes * (1 if coll == "broadcast" else n)))
            calls = calls_of(coll, x, out, comm, {"copy": two, "one": one})
            times: dict[str, list[float]] = {k: [] for k in calls}
            for f in calls.values():
                f()
            for trial in range(args.trials):
                for k in list(calls) if trial % 2 else list(calls)[::-1]:
                    times[k].append(per_call(comm, calls[k], reps))
            med = {k: statistics.median(v) for k, v in times.items()}
            if rank == 0:
                print(
                    f"{coll:24s} {nbytes:>10d} {med['raw'] * 1e6:>10.1f} {med['copy'] / med['raw']:>9.2f} "
                    f"{med['one'] / med['raw']:>13.2f}",
                    flush=True,
                )
    for g in (one, two):
        dist.destroy_process_group(g)
    comm.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
