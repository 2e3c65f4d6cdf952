"""torch CPU tensors against numpy arrays on mpidist's API, and both against raw mpi4py, in the same run.

Run:  mpiexec -n 2 python benchmarks/bench_torch_tensors.py [--trials 9] [--sizes 8 4096 262144]

For each collective (all_reduce, broadcast, reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single, send/recv as a ping-pong between ranks 0
and 1) and per-rank message size, the time per call of:

* ``numpy``: mpidist's call on numpy arrays;
* ``torch``: the same call on torch tensors of the same size (their numpy views are
  made per call, in C: ``arrays/_ready.c``);
* ``raw``: mpi4py's blocking call on numpy arrays (``comm.Allreduce(IN_PLACE, ...)``, ...).

Trials are interleaved (every row once per trial, in a rotating order), each a
block of calls started together on all ranks and timed by the slowest rank; the
table shows medians, and ``torch/numpy`` is the median of per-trial ratios.
Results are checked once against numpy before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

import mpidist as dist

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "send/recv")  # fmt: skip


def calls(kind: str, count: int, comm: MPI.Comm) -> dict[str, Callable[[], Any]]:
    """One call per collective on ``count`` float32 elements per rank, on arrays of ``kind``."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if kind == "torch":
        make: Callable[[int], Any] = lambda k: torch.ones(k)  # noqa: E731
    else:
        make = lambda k: np.ones(k, np.float32)  # noqa: E731
    a, gathered, scattered_in, scattered_out = make(count), make(count * n), make(count * n), make(count)
    a2a_in, a2a_out, msg = make(count * n), make(count * n), make(count)

    def ping_pong(send: Callable[[Any, int], Any], recv: Callable[[Any, int], Any]) -> Callable[[], None]:
        """Rank 0 sends ``msg`` to rank 1 and gets it back; other ranks do nothing."""

        def exchange() -> None:
            if rank < 2 and n > 1:
                first, second = (send, recv) if rank == 0 else (recv, send)
                first(msg, 1 - rank)
                second(msg, 1 - rank)

        return exchange

    if kind == "raw":
        sum_ = MPI.SUM
        raw_ping_pong = ping_pong(comm.Send, comm.Recv)
        return {
            "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, a, sum_),
            "broadcast": lambda: comm.Bcast(a, 0),
            "reduce": lambda: comm.Reduce(MPI.IN_PLACE if rank == 0 else a, a if rank == 0 else None, sum_, 0),
            "all_gather_into_tensor": lambda: comm.Allgather(a, gathered),
            "reduce_scatter_tensor": lambda: comm.Reduce_scatter_block(scattered_in, scattered_out, sum_),
            "all_to_all_single": lambda: comm.Alltoall(a2a_in, a2a_out),
            "send/recv": raw_ping_pong,
        }
    return {
        "all_reduce": lambda: dist.all_reduce(a),
        "broadcast": lambda: dist.broadcast(a, 0),
        "reduce": lambda: dist.reduce(a, 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, a),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(scattered_out, scattered_in),
        "all_to_all_single": lambda: dist.all_to_all_single(a2a_out, a2a_in),
        "send/recv": ping_pong(dist.send, dist.recv),
    }


def check(comm: MPI.Comm) -> None:
    """The tensor calls compute what the numpy calls do (one pass, before timing)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    out = torch.empty(3 * n)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank)))
    ok = t.tolist() == [n * (n + 1) / 2] * 3 and out.tolist() == [float(r) for r in range(n) for _ in range(3)]
    if not comm.allreduce(ok, op=MPI.LAND):
        sys.exit("bench_torch_tensors: a tensor collective computed a wrong result")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 4096, 262144], help="bytes per rank")
    parser.add_argument("--batch-bytes", type=int, default=16 << 20, help="about this many bytes per timed block")
    args = parser.parse_args()
    dist.init_process_group()
    comm = MPI.COMM_WORLD.Dup()  # raw calls on a communicator of their own
    check(comm)
    rows: dict[tuple[str, int, str], tuple[Callable[[], Any], int]] = {}
    for size in args.sizes:
        iters = max(20, min(2000, args.batch_bytes // max(size, 1)))
        for kind in ("numpy", "torch", "raw"):
            for name, fn in calls(kind, max(1, size // 4), comm).items():
                rows[(name, size, kind)] = (fn, iters)
    keys = list(rows)

    def block(key: tuple[str, int, str]) -> float:
        fn, iters = rows[key]
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)

    for key in keys:  # warm up
        block(key)
    samples: dict[tuple[str, int, str], list[float]] = {k: [] for k in keys}
    for trial in range(args.trials):
        shift = (trial * 7) % len(keys)
        for key in keys[shift:] + keys[:shift]:
            samples[key].append(block(key))
    if comm.Get_rank() == 0:
        n = comm.Get_size()
        print(f"{n} ranks, float32, per-rank bytes; medians of {args.trials} interleaved trials (slowest rank)")
        print("| collective | bytes | numpy us | torch us | raw us | torch/numpy | torch/raw |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name in COLLECTIVES:
            for size in args.sizes:
                s = {kind: samples[(name, size, kind)] for kind in ("numpy", "torch", "raw")}
                med = {kind: statistics.median(v) * 1e6 for kind, v in s.items()}
                tn = statistics.median(t / a for t, a in zip(s["torch"], s["numpy"]))
                tr = statistics.median(t / r for t, r in zip(s["torch"], s["raw"]))
                print(f"| {name} | {size} | {med['numpy']:.2f} | {med['torch']:.2f} | {med['raw']:.2f} "
                      f"| {tn:.2f} | {tr:.2f} |")  # fmt: skip
    comm.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
