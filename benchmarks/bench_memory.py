"""The memory-speed limit of a collective on one node: numpy copies and adds, on every rank at once.

Run:  mpiexec -n 2 python benchmarks/bench_memory.py [--sizes 4194304 67108864] [--trials 11]

A large collective among the ranks of one node is bounded by how fast the ranks, all
at the same time, can move memory. For each size (bytes of float32 per rank) every
rank times, started together, a copy (``np.copyto``) and an add (``np.add(a, b,
out=c)``) of that size; the table shows the median of the slowest rank's time.

The floor of any all_reduce (and broadcast, reduce, ...) of S bytes per rank is one
copy of S on every rank at once: each rank must read its array once and write its
result once. The shared-memory path of mpidist's MPI backend (backends/shm.py) moves a
message through slots of 1 MiB that stay in the cache, so beyond the cache its time
approaches that floor; within the cache, its extra copies show (each rank copies
(n-1)/n of S in and out and reduces 1/n of it). See docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI


def _time(fn, comm: MPI.Comm, trials: int, reps: int) -> float:
    """Median over trials of the slowest rank's seconds per call (ranks start each trial together)."""
    out = []
    for _ in range(trials):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append(comm.allreduce((time.perf_counter() - start) / reps, op=MPI.MAX))
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="*", type=int, default=[4 << 20, 64 << 20])
    p.add_argument("--trials", type=int, default=11)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        print(f"# {comm.Get_size()} ranks copying and adding at once; float32; median of {args.trials} trials, slowest rank")
        print("| size | copy = floor (ms) | copy (GB/s) | add (ms) |")
        print("|---:|---:|---:|---:|")
    for size in args.sizes:
        copy, add = _measure(size, comm, args.trials)
        if comm.Get_rank() == 0:
            print(f"| {size >> 20} MiB | {copy * 1e3:.3f} | {size / copy / 1e9:.1f} | {add * 1e3:.3f} |")


def _measure(size: int, comm: MPI.Comm, trials: int) -> tuple[float, float]:
    """(copy, add) seconds for ``size`` bytes of float32 per rank, every rank at once."""
    a, b, c = (np.ones(size // 4, np.float32) for _ in range(3))
    reps = max(3, (256 << 20) // size)
    return (
        _time(lambda: np.copyto(c, a), comm, trials, reps),
        _time(lambda: np.add(a, b, out=c), comm, trials, reps),
    )

if __name__ == "__main__":
    main()
