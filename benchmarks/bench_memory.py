"""The memory-speed limit of a collective on one node: numpy copies and adds, on every rank at once.

Run:  mpiexec -n 2 python benchmarks/bench_memory.py [--sizes 4194304 67108864] [--trials 11]

A large collective among the ranks of one node is bounded by how fast the ranks, all
at the same time, can move memory. For each size (bytes of float32 per rank) every
rank times, started together, a copy (``np.copyto``) and an add (``np.add(a, b,
out=c)``) of that size; the table shows the median of the slowest rank's time and
what it implies for the shared-memory path of mpidist's MPI backend (backends/shm.py),
whose all_reduce of S bytes on n ranks costs each rank (n-1)/n S copied in, a
reduction of S/n (n reads, one write), S/n copied to its own array and (n-1)/n S
copied out:

    floor = 2 (n-1)/n copy(S) + add(S/n) x (n-1) + copy(S/n)

(a copy of S bytes in the time the table measures for S). See docs/performance.md.
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
    n = comm.Get_size()
    if comm.Get_rank() == 0:
        print(f"# {n} ranks copying and adding at once; float32; median of {args.trials} trials, slowest rank")
        print(f"| size | copy (ms) | copy (GB/s) | add (ms) | all_reduce floor on {n} ranks (ms) |")
        print("|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        count = size // 4
        a, b, c = (np.ones(count, np.float32) for _ in range(3))
        part = count // n
        pa, pb, pc = a[:part], b[:part], c[:part]
        reps = max(3, (256 << 20) // size)
        copy = _time(lambda: np.copyto(c, a), comm, args.trials, reps)
        add = _time(lambda: np.add(a, b, out=c), comm, args.trials, reps)
        part_copy = _time(lambda: np.copyto(pc, pa), comm, args.trials, reps * n)
        part_add = _time(lambda: np.add(pa, pb, out=pc), comm, args.trials, reps * n)
        floor = 2 * (n - 1) / n * copy + (n - 1) * part_add + part_copy
        if comm.Get_rank() == 0:
            print(
                f"| {size >> 20} MiB | {copy * 1e3:.3f} | {size / copy / 1e9:.1f} | {add * 1e3:.3f} | {floor * 1e3:.3f} |"
            )


if __name__ == "__main__":
    main()
