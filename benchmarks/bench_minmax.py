"""What deterministic MIN/MAX on floats costs: float32 ``all_reduce`` MAX against SUM and raw MPI_MAX.

Run:  mpiexec -n 2 python benchmarks/bench_minmax.py [--trials 15] [--op MAX]

mpidist reduces floats' MIN/MAX as integer order keys (``reduce_op.to_order_keys``) so that
NaN and +/-0 give the same bits on every rank. Three implementations run in the same
processes, in interleaved trials (the order reverses every trial), each trial a block of
back-to-back calls started together and timed by the slowest rank; the table shows medians:

* ``raw MAX``: ``comm.Iallreduce(IN_PLACE, a, MPI.MAX).Wait()`` on the floats (MPI's own op,
  whose NaN and +/-0 results depend on the reduction order);
* ``mpidist SUM``: ``dist.all_reduce(a, op=SUM)``, the path float MAX took before the keys
  (one native MPI call), so ``MAX / SUM`` is the cost of the keys;
* ``mpidist MAX``: ``dist.all_reduce(a, op=MAX)`` (keys in, integer MPI_MAX, keys out).

Each rank contributes a float32 array of the given size (random normals, no NaN).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from mpi4py import MPI

import mpidist as dist
from mpidist.bench.timing import time_run

SIZES = [8, 4 << 10, 256 << 10, 4 << 20]


def iterations(nbytes: int) -> int:
    return {8: 2000, 4 << 10: 1000, 256 << 10: 100, 4 << 20: 12}.get(nbytes, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--op", choices=["MAX", "MIN"], default="MAX")
    opts = parser.parse_args()
    dist.init_process_group()
    comm = MPI.COMM_WORLD.Dup()
    op = getattr(dist.ReduceOp, opts.op)
    raw_op = getattr(MPI, opts.op)
    rows = []
    for nbytes in SIZES:
        a = np.random.default_rng(dist.get_rank()).standard_normal(nbytes // 4).astype(np.float32)
        calls = {
            f"raw {opts.op}": lambda a=a: comm.Iallreduce(MPI.IN_PLACE, a, raw_op).Wait(),
            "mpidist SUM": lambda a=a: dist.all_reduce(a, op=dist.ReduceOp.SUM),
            f"mpidist {opts.op}": lambda a=a: dist.all_reduce(a, op=op),
        }
        iters = iterations(nbytes)
        times = time_run(calls, iters, max(3, iters // 10), opts.trials, comm, lambda: None)
        med = {name: statistics.median(t) / iters for name, t in times.items()}
        ratio = statistics.median(m / s for m, s in zip(times[f"mpidist {opts.op}"], times["mpidist SUM"]))
        rows.append((nbytes, med, ratio))
    if dist.get_rank() == 0:
        names = list(rows[0][1])
        print(f"| size | {' | '.join(names)} | {opts.op} / SUM (paired) |")
        print("|---|" + "---|" * (len(names) + 1))
        for nbytes, med, ratio in rows:
            size = (
                f"{nbytes >> 20} MiB"
                if nbytes >= 1 << 20
                else f"{nbytes >> 10} KiB"
                if nbytes >= 1024
                else f"{nbytes} B"
            )
            print(f"| {size} | " + " | ".join(f"{med[n] * 1e6:.2f} us" for n in names) + f" | {ratio:.2f} |")
    comm.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
