"""Where the extra time of a small collective on a torch CPU tensor goes, against a numpy array.

Run:  mpiexec -n 2 python benchmarks/profile_torch_overhead.py [--trials 15] [--cprofile]

Three parts, all on 8-byte float32 messages:

1. End to end (both ranks, interleaved trials, slowest rank, medians) for all_reduce,
   broadcast and all_gather_into_tensor: a numpy array; a plain torch tensor (the fast
   lane, through ``_arrays.host_view``); a tensor with ``requires_grad=True`` (refused by
   ``Tensor.numpy()``, so it takes the general lane); and two bounds that exist only in
   this script: the backend's fast lane on a numpy view made once (what caching views
   could at most save) and, for the pair collective, the fast lane with a ``data_ptr``
   interval test in place of ``numpy.may_share_memory``.
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
from mpidist import _arrays
from mpidist._world import world
from mpidist.reduce_op import ReduceOp

SUM = ReduceOp.SUM


def time_block(fn: Callable[[], Any], iters: int, comm: MPI.Comm) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def interval_pair_all_gather(out: Any, inp: Any) -> None:
    """Bound: all_gather_into_tensor's fast lane with an exact aliasing test on the tensors' memory.

    The views of two contiguous tensors occupy ``[data_ptr, data_ptr + nbytes)``; two
    interval comparisons replace ``numpy.may_share_memory`` (needed today because a
    tensor's view always has a base). Plain contiguous float32 tensors only.
    """
    impl = world.default_pg.impl
    o, i = out.numpy(), inp.numpy()
    po, pi = out.data_ptr(), inp.data_ptr()
    if po < pi + inp.nbytes and pi < po + out.nbytes:
        raise RuntimeError("overlapping buffers: not what this bound measures")
    impl.seq += 1
    req = impl._iallgather(i, o)
    if not req.Test():
        impl._wait("all_gather_into_tensor", req, (i, o))


def end_to_end(comm: MPI.Comm, trials: int, iters: int) -> dict[str, float]:
    n = comm.Get_size()
    impl = world.default_pg.impl
    a = np.ones(2, np.float32)
    t = torch.ones(2)
    g = torch.ones(2, requires_grad=True)
    v = t.numpy()  # made once
    ga, gao = np.ones(2, np.float32), np.empty(2 * n, np.float32)
    gt, gto = torch.ones(2), torch.empty(2 * n)
    gg, ggo = torch.ones(2, requires_grad=True), torch.empty(2 * n, requires_grad=True)
    gv, gvo = gt.numpy(), gto.numpy()
    calls = {
        "all_reduce numpy": lambda: dist.all_reduce(a),
        "all_reduce torch": lambda: dist.all_reduce(t),
        "all_reduce torch requires_grad (general lane)": lambda: dist.all_reduce(g),
        "all_reduce bound: fast lane on a view made once": lambda: impl.fast_all_reduce(v, SUM, False),
        "broadcast numpy": lambda: dist.broadcast(a, 0),
        "broadcast torch": lambda: dist.broadcast(t, 0),
        "broadcast torch requires_grad (general lane)": lambda: dist.broadcast(g, 0),
        "broadcast bound: fast lane on a view made once": lambda: impl.fast_broadcast(v, 0, False),
        "all_gather_into_tensor numpy": lambda: dist.all_gather_into_tensor(gao, ga),
        "all_gather_into_tensor torch": lambda: dist.all_gather_into_tensor(gto, gt),
        "all_gather_into_tensor torch requires_grad (general lane)": lambda: dist.all_gather_into_tensor(ggo, gg),
        "all_gather_into_tensor bound: views made once": lambda: impl.fast_all_gather_into_tensor(gvo, gv, False),
        "all_gather_into_tensor bound: data_ptr aliasing test": lambda: interval_pair_all_gather(gto, gt),
    }
    # every variant computes the same thing (checked once, on all ranks, before timing)
    ok = True
    for name in ("all_gather_into_tensor torch", "all_gather_into_tensor bound: data_ptr aliasing test"):
        with torch.no_grad():
            gt[...] = torch.tensor([1.0, 2.0]) + comm.Get_rank()
            gto.zero_()
        ga[...] = gt.numpy()
        calls[name]()
        dist.all_gather_into_tensor(gao, ga)
        ok = ok and np.array_equal(gto.numpy(), gao)
    if not comm.allreduce(ok, op=MPI.LAND):
        raise SystemExit("profile_torch_overhead: a variant computed a different result")
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
    a = np.ones(2, np.float32)
    v, w = t.numpy(), o.numpy()
    stmts = [
        "t.numpy()",
        "_arrays.host_view(t)",
        "_arrays.host_view(a)",
        "_arrays.host_view(g)  # numpy() raises: caught",
        "_arrays.prepare_inout(t, 'all_reduce', 'tensor')",
        "_arrays.prepare_inout(g, 'all_reduce', 'tensor')",
        "_arrays.prepare_inout(a, 'all_reduce', 'tensor')",
        "np.may_share_memory(w, v)",
        "o.data_ptr() < t.data_ptr() + t.nbytes and t.data_ptr() < o.data_ptr() + o.nbytes",
        "MPI.buffer.fromaddress(t.data_ptr(), t.nbytes)",
        "t.layout; t.is_cpu; t.requires_grad; t.is_contiguous(); t.is_conj(); t.is_neg(); t.dtype",
        "t.device.type",
    ]
    env = {"t": t, "o": o, "g": g, "a": a, "v": v, "w": w, "np": np, "_arrays": _arrays, "MPI": MPI}
    out = []
    for stmt in stmts:
        n = 100_000
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
                    print(f"  {name:58s} {sec * 1e6:7.2f} us   {(sec - base) * 1e6:+6.2f} us vs numpy")
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
