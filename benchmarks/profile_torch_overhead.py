"""Where the extra time of a small collective on a torch CPU tensor goes, against a numpy array.

Run:  mpiexec -n 2 python benchmarks/profile_torch_overhead.py [--trials 15] [--cprofile]

Three parts, all on 8-byte float32 messages:

1. End to end (both ranks, interleaved trials, slowest rank, medians) for all_reduce,
   broadcast and all_gather_into_tensor: a numpy array; a plain torch tensor (the fast
   lane, through ``_arrays.host_view``); the backend's fast lane on a numpy view made once
   (the bound on what caching views could save); tensors that ``Tensor.numpy()`` refuses
   (``requires_grad=True``, bfloat16), which ``host_view`` routes without raising.
2. The pieces (rank 0 while the others sleep, timeit minimum of 5 repeats): what each
   step costs on its own (``Tensor.numpy()``, ``host_view``, the general adapter, ...).
3. With ``--cprofile``: rank 0's profile of 20,000 torch all_reduce calls, top functions
   by own time (cProfile's per-call overhead inflates small functions; use it for the
   shape of the call tree, parts 1 and 2 for the numbers).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import timeit
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

import mpidist as dist
from mpidist._world import world
from mpidist.arrays import host as _arrays
from mpidist.reduce_op import ReduceOp

SUM = ReduceOp.SUM


def time_block(fn: Callable[[], Any], iters: int, comm: MPI.Comm) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def end_to_end(comm: MPI.Comm, trials: int, iters: int) -> dict[str, float]:
    n, rank = comm.Get_size(), comm.Get_rank()
    pg = world.default_pg
    a = np.ones(2, np.float32)
    t = torch.ones(2)
    g = torch.ones(2, requires_grad=True)
    h = torch.ones(2, dtype=torch.bfloat16)
    v = t.numpy()  # made once
    ga, gao = np.ones(2, np.float32), np.empty(2 * n, np.float32)
    gt, gto = torch.ones(2), torch.empty(2 * n)
    gg, ggo = torch.ones(2, requires_grad=True), torch.empty(2 * n, requires_grad=True)
    gv, gvo = gt.numpy(), gto.numpy()
    calls = {
        "all_reduce numpy": lambda: dist.all_reduce(a),
        "all_reduce torch": lambda: dist.all_reduce(t),
        "all_reduce bound: the group's call on a view made once": lambda: pg.all_reduce(v, None, SUM, False),
        "all_reduce torch requires_grad": lambda: dist.all_reduce(g),
        "all_reduce torch bfloat16": lambda: dist.all_reduce(h),
        "broadcast numpy": lambda: dist.broadcast(a, 0),
        "broadcast torch": lambda: dist.broadcast(t, 0),
        "broadcast bound: the group's call on a view made once": lambda: pg.broadcast(v, None, 0, False),
        "broadcast torch requires_grad": lambda: dist.broadcast(g, 0),
        "all_gather_into_tensor numpy": lambda: dist.all_gather_into_tensor(gao, ga),
        "all_gather_into_tensor torch": lambda: dist.all_gather_into_tensor(gto, gt),
        "all_gather_into_tensor bound: views made once": lambda: pg.all_gather_into_tensor(gvo, None, gv, False),
        "all_gather_into_tensor torch requires_grad": lambda: dist.all_gather_into_tensor(ggo, gg),
    }
    with torch.no_grad():  # tensors that numpy() refuses still get correct results
        g.fill_(1 + rank)
        h.fill_(1 + rank)
        gg.copy_(torch.tensor([1.0, 2.0]) + rank)
    dist.all_reduce(g)
    dist.all_reduce(h)
    dist.all_gather_into_tensor(ggo, gg)
    want = [float(sum(range(1, n + 1)))] * 2
    gathered = [x + r for r in range(n) for x in (1.0, 2.0)]
    ok = g.tolist() == want and h.float().tolist() == want and ggo.tolist() == gathered
    if not comm.allreduce(ok, op=MPI.LAND):
        raise SystemExit("profile_torch_overhead: a torch collective computed a wrong result")
    for fn in calls.values():
        time_block(fn, iters // 10, comm)
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(trials):
        for name in names[trial % len(names) :] + names[: trial % len(names)]:
            samples[name].append(time_block(calls[name], iters, comm))
    return {name: statistics.median(v) for name, v in samples.items()}


def quiet_barrier(comm: MPI.Comm) -> None:
    """A barrier that sleeps instead of spinning, so waiting ranks leave rank 0's timings alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def pieces() -> list[tuple[str, float]]:
    t = torch.ones(2, dtype=torch.float32)
    o = torch.empty(4)
    g = torch.ones(2, requires_grad=True)
    h = torch.ones(2, dtype=torch.bfloat16)
    a = np.ones(2, np.float32)
    v, w = t.numpy(), o.numpy()
    stmts = [
        "t.numpy()",
        "_arrays.host_view(t)",
        "_arrays.host_view(a)",
        "_arrays.host_view(g)  # requires_grad: a detached view",
        "_arrays.host_view(h)  # bfloat16: left to the general lane, without raising",
        "_arrays.prepare_inout(t, 'all_reduce', 'tensor')",
        "_arrays.prepare_inout(g, 'all_reduce', 'tensor')",
        "_arrays.prepare_inout(h, 'all_reduce', 'tensor')",
        "_arrays.prepare_inout(a, 'all_reduce', 'tensor')",
        "np.may_share_memory(w, v)",
        "o.data_ptr() < t.data_ptr() + t.nbytes and t.data_ptr() < o.data_ptr() + o.nbytes",
        "MPI.buffer.fromaddress(t.data_ptr(), t.nbytes)",
        "t.layout; t.is_cpu; t.requires_grad; t.is_contiguous(); t.is_conj(); t.is_neg(); t.dtype",
        "t.device.type",
    ]
    env = {
        "t": t, "o": o, "g": g, "h": h, "a": a, "v": v, "w": w, "np": np, "_arrays": _arrays, "MPI": MPI,
    }  # fmt: skip
    out = []
    for stmt in stmts:
        n = 20_000
        best = min(timeit.repeat(stmt, globals=env, number=n, repeat=5)) / n
        out.append((stmt, best))
    return out


def profile(comm: MPI.Comm, calls: int) -> str:
    t = torch.ones(2, dtype=torch.float32)
    prof = cProfile.Profile()
    comm.Barrier()
    prof.enable()
    for _ in range(calls):
        dist.all_reduce(t)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return buf.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--iters", type=int, default=2000, help="calls per timed block")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()

    e2e = end_to_end(comm, args.trials, args.iters)
    if rank == 0:
        print(f"end to end, 8 B, {comm.Get_size()} ranks, median of {args.trials} interleaved trials:")
        for op in ("all_reduce", "broadcast", "all_gather_into_tensor"):
            base = e2e[f"{op} numpy"]
            for name, sec in e2e.items():
                if name.startswith(op + " "):
                    print(f"  {name:54s} {sec * 1e6:7.2f} us   {(sec - base) * 1e6:+7.2f} us vs numpy")
    if rank == 0:
        print("\npieces (rank 0 alone, timeit, best of 5):")
        for stmt, sec in pieces():
            print(f"  {sec * 1e9:7.0f} ns  {stmt}")
    quiet_barrier(comm)
    if args.cprofile:
        text = profile(comm, 20_000)
        if rank == 0:
            print("\ncProfile, rank 0, 20,000 x dist.all_reduce(torch tensor, 8 B):")
            print(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
