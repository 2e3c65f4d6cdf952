"""Per-call time of mpidist collectives against raw mpi4py (and torch gloo) in the same run.

Run:  mpiexec -n 2 python benchmarks/bench_collectives.py [--trials 21] [--json out.json]

For each collective and message size the three implementations are timed in
interleaved trials (the order rotates every trial), each trial a block of
back-to-back calls started together on all ranks. The table shows the median
per-call time of each and the median over trials of the paired ratio
mpidist/raw, which cancels most of the drift of a shared, noisy machine.
"Size" is the array each rank contributes (float32). "copies" counts staging
copies mpidist made over the whole run of that row (0 means zero-copy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import mpidist as dist
from mpidist._world import world

SIZES = [8, 4 << 10, 256 << 10, 4 << 20]
OPS = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]


def iterations(nbytes: int) -> int:
    return {8: 2000, 4 << 10: 1000, 256 << 10: 100, 4 << 20: 12}.get(nbytes, max(5, 2_000_000 // max(nbytes, 1)))


def label(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def build(op: str, nbytes: int, comm: MPI.Comm, tdist) -> dict[str, Callable[[], None]]:
    """Return {implementation: zero-argument call} for one collective and size."""
    n = comm.Get_size()
    k = max(1, nbytes // 4)
    if op == "reduce_scatter_tensor":
        k = max(n, k - k % n)
    a = np.ones(k, np.float32)
    calls: dict[str, Callable[[], None]] = {}
    if op == "all_reduce":
        calls["raw"] = lambda: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
        calls["mpidist"] = lambda: dist.all_reduce(a)
    elif op == "broadcast":
        calls["raw"] = lambda: comm.Bcast(a, 0)
        calls["mpidist"] = lambda: dist.broadcast(a, 0)
    elif op == "all_gather_into_tensor":
        out = np.empty(k * n, np.float32)
        calls["raw"] = lambda: comm.Allgather(a, out)
        calls["mpidist"] = lambda: dist.all_gather_into_tensor(out, a)
    elif op == "reduce_scatter_tensor":
        out = np.empty(k // n, np.float32)
        calls["raw"] = lambda: comm.Reduce_scatter_block(a, out, MPI.SUM)
        calls["mpidist"] = lambda: dist.reduce_scatter_tensor(out, a)
    elif op == "all_to_all_single":
        k = max(n, k - k % n)
        a = np.ones(k, np.float32)
        out = np.empty(k, np.float32)
        calls["raw"] = lambda: comm.Alltoall(a, out)
        calls["mpidist"] = lambda: dist.all_to_all_single(out, a)
    if tdist is not None:
        calls["gloo"] = gloo_call(op, k, n, tdist)
    return calls


def gloo_call(op: str, k: int, n: int, tdist) -> Callable[[], None]:
    import torch

    t = torch.ones(k, dtype=torch.float32)
    if op == "all_reduce":
        return lambda: tdist.all_reduce(t)
    if op == "broadcast":
        return lambda: tdist.broadcast(t, 0)
    if op == "all_gather_into_tensor":
        out = torch.empty(k * n, dtype=torch.float32)
        return lambda: tdist.all_gather_into_tensor(out, t)
    if op == "reduce_scatter_tensor":
        out = torch.empty(k // n, dtype=torch.float32)
        return lambda: tdist.reduce_scatter_tensor(out, t)
    out = torch.empty(k, dtype=torch.float32)
    return lambda: tdist.all_to_all_single(out, t)


def time_block(fn: Callable[[], None], iters: int, comm: MPI.Comm) -> float:
    """Seconds per call of ``iters`` back-to-back calls, the slowest rank's view."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - start) / iters
    return comm.allreduce(elapsed, op=MPI.MAX)


def start_gloo(comm: MPI.Comm):
    """Initialize torch.distributed's gloo backend in these processes, or return None."""
    if os.environ.get("MPIDIST_BENCH_NO_GLOO"):
        return None
    try:
        import torch.distributed as tdist
    except ImportError:
        return None
    path = comm.bcast(tempfile.mktemp(prefix="mpidist-gloo-") if comm.Get_rank() == 0 else None)
    tdist.init_process_group("gloo", init_method=f"file://{path}", rank=comm.Get_rank(), world_size=comm.Get_size())
    return tdist


def check_supported(calls: dict[str, Callable[[], None]], comm: MPI.Comm) -> dict[str, Callable[[], None]]:
    """Drop implementations that fail on any rank (e.g. a collective gloo lacks)."""
    ok = {}
    for name, fn in calls.items():
        try:
            fn()
            good = True
        except Exception:
            good = False
        if comm.allreduce(good, op=MPI.LAND):
            ok[name] = fn
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=21, help="interleaved trials per row (odd: a true median)")
    parser.add_argument("--ops", nargs="*", default=OPS, choices=OPS)
    parser.add_argument("--sizes", nargs="*", type=int, default=SIZES, help="bytes per rank")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch.distributed gloo")
    args = parser.parse_args()

    dist.init_process_group()
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    tdist = None if args.no_gloo else start_gloo(comm)
    rows = []
    for op in args.ops:
        for nbytes in args.sizes:
            calls = check_supported(build(op, nbytes, comm, tdist), comm)
            iters = iterations(nbytes)
            names = list(calls)
            for name in names:  # warm-up
                time_block(calls[name], max(2, iters // 10), comm)
            samples: dict[str, list[float]] = {name: [] for name in names}
            copies_before = world.stats.copies
            for trial in range(args.trials):
                order = names[trial % len(names) :] + names[: trial % len(names)]
                for name in order:
                    samples[name].append(time_block(calls[name], iters, comm))
            ratios = [m / r for m, r in zip(samples["mpidist"], samples["raw"])]
            row = {
                "op": op,
                "bytes": nbytes,
                "ranks": n,
                "median_s": {name: statistics.median(v) for name, v in samples.items()},
                "ratio_vs_raw": statistics.median(ratios),
                "copies": world.stats.copies - copies_before,
            }
            if "gloo" in samples:
                row["gloo_over_mpidist"] = statistics.median(
                    g / m for g, m in zip(samples["gloo"], samples["mpidist"])
                )
            rows.append(row)
            if rank == 0:
                print_row(row, first=len(rows) == 1)
    if rank == 0:
        print(f"\n{n} ranks, {args.trials} interleaved trials per row; MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    if tdist is not None:
        tdist.destroy_process_group()
    dist.destroy_process_group()
    return 0


def fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:8.2f} us" if us < 1000 else f"{us / 1000:8.3f} ms"


def print_row(row: dict, first: bool) -> None:
    if first:
        print(f"{'collective':24s} {'size':>8s} {'raw mpi4py':>12s} {'mpidist':>12s} {'ratio':>6s} "
              f"{'gloo':>12s} {'gloo/mpidist':>12s} {'copies':>6s}")  # fmt: skip
    med = row["median_s"]
    gloo = fmt_time(med["gloo"]) if "gloo" in med else "         n/a"
    speedup = f"{row['gloo_over_mpidist']:11.1f}x" if "gloo_over_mpidist" in row else "         n/a"
    print(
        f"{row['op']:24s} {label(row['bytes']):>8s} {fmt_time(med['raw']):>12s} {fmt_time(med['mpidist']):>12s} "
        f"{row['ratio_vs_raw']:6.2f} {gloo:>12s} {speedup:>12s} {row['copies']:6d}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
