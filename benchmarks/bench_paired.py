"""Per-call time of this checkout's mpidist against another version of it, in the same processes.

Run:  git worktree add /tmp/before <commit>
      mpiexec -n 2 python benchmarks/bench_paired.py --before /tmp/before [--sizes 8 4096 262144] [--trials 41]
          [--collectives all_reduce ... all_to_all_single_uneven all_reduce_coalesced batch_isend_irecv]

On a shared machine two runs of the same code differ by more than a small
regression, so a before/after comparison made of two separate runs cannot show
one. This script loads the other checkout's package next to this one (as module
``mpidist_before``: mpidist imports itself relatively) and times, for each
collective and size, five implementations in the same trials, in an order that
rotates every trial:

* ``raw``: the blocking mpi4py call; ``raw_nb``: its nonblocking variant, then
  ``Test`` until done (the floor of a call with a timeout); for calls no single
  mpi4py call does (``all_reduce_coalesced``: pack, reduce, unpack;
  ``batch_isend_irecv``: ``Isend`` + ``Irecv``), the code a user would write;
* ``now`` and ``before``: ``dist.<collective>(...)`` of this checkout and of ``--before``;

each a batch of back-to-back calls started together on every rank (a raw
barrier first) and timed by the slowest rank. The table shows the median
per-call time of each and the medians over trials of the paired ratios
now/raw, before/raw, now/raw_nb and now/before, which cancel the machine's drift.
``--same`` loads this checkout twice: its now/before column is the noise of the
method itself (it should be 1.00).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mpidist as dist

COLLECTIVES = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]
#: more calls, on request (--collectives): raw is what a user of mpi4py would write for the same result
OTHERS = ["all_to_all_single_uneven", "all_reduce_coalesced", "batch_isend_irecv"]
IMPLS = ["raw", "raw_nb", "now", "before"]


def load_package(root: Path, name: str) -> Any:
    """The ``mpidist`` package under ``root``, imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(
        name, root / "mpidist" / "__init__.py", submodule_search_locations=[str(root / "mpidist")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def nonblocking(start: Callable[..., MPI.Request], *args: Any) -> Callable[[], None]:
    def call() -> None:
        req = start(*args)
        while not req.Test():
            pass

    return call


def calls(
    name: str, nbytes: int, comm: MPI.Comm, apis: dict[str, Any], tensors: bool = False
) -> dict[str, Callable[[], Any]]:
    """The implementations of ``name`` at ``nbytes`` per rank (float32), each on its own arrays (``tensors``:
    mpidist's calls get torch CPU tensors, ``torch.from_numpy`` of them; raw mpi4py keeps numpy arrays)."""
    n = comm.Get_size()
    count = max(1, nbytes // 4)
    f32 = MPI.FLOAT
    out: dict[str, Callable[[], Any]] = {}
    for impl in IMPLS:
        if tensors and impl in apis:
            import torch

            def new(shape: int, dtype: Any, fill: Callable[..., np.ndarray] = np.ones) -> Any:
                return torch.from_numpy(fill(shape, dtype))
        else:

            def new(shape: int, dtype: Any, fill: Callable[..., np.ndarray] = np.ones) -> Any:
                return fill(shape, dtype)

        a = new(count, np.float32)
        if name == "all_reduce":
            raw = (MPI.IN_PLACE, [a, f32], MPI.SUM)
            block, start = comm.Allreduce, comm.Iallreduce
            mine = lambda api, a=a: api.all_reduce(a)  # noqa: E731
        elif name == "broadcast":
            raw = ([a, f32], 0)
            block, start = comm.Bcast, comm.Ibcast
            mine = lambda api, a=a: api.broadcast(a, 0)  # noqa: E731
        elif name == "all_gather_into_tensor":
            o = new(count * n, np.float32, np.empty)
            raw = ([a, f32], [o, f32])
            block, start = comm.Allgather, comm.Iallgather
            mine = lambda api, a=a, o=o: api.all_gather_into_tensor(o, a)  # noqa: E731
        elif name == "reduce_scatter_tensor":
            i = new(count * n, np.float32)
            raw = ([i, f32], [a, f32], MPI.SUM)
            block, start = comm.Reduce_scatter_block, comm.Ireduce_scatter_block
            mine = lambda api, a=a, i=i: api.reduce_scatter_tensor(a, i)  # noqa: E731
        elif name == "all_to_all_single":
            i, o = new(count * n, np.float32), new(count * n, np.float32, np.empty)
            raw = ([i, f32], [o, f32])
            block, start = comm.Alltoall, comm.Ialltoall
            mine = lambda api, o=o, i=i: api.all_to_all_single(o, i)  # noqa: E731
        elif name == "all_to_all_single_uneven":  # split sizes given (equal here, so raw is the same call)
            i, o = new(count * n, np.float32), new(count * n, np.float32, np.empty)
            sizes, displs = [count] * n, [count * r for r in range(n)]
            raw = ([i, sizes, displs, f32], [o, sizes, displs, f32])
            block, start = comm.Alltoallv, comm.Ialltoallv
            mine = lambda api, o=o, i=i, s=sizes: api.all_to_all_single(o, i, s, s)  # noqa: E731
        elif name == "all_reduce_coalesced":  # two arrays of count / 2 elements: pack, reduce, unpack
            b, c = new((count + 1) // 2, np.float32), new(count // 2, np.float32)
            packed = np.empty(len(b) + len(c), np.float32)
            raw = (b, c, packed)
            block = start = None
            mine = lambda api, b=b, c=c: api.all_reduce_coalesced([b, c])  # noqa: E731
        else:  # batch_isend_irecv: send to the next rank, receive from the previous one
            o = new(count, np.float32, np.empty)
            nxt, prv = (comm.Get_rank() + 1) % n, (comm.Get_rank() - 1) % n
            raw = (a, o, nxt, prv)
            block = start = None
            mine = lambda api, a=a, o=o, nxt=nxt, prv=prv: ring(api, a, o, nxt, prv)  # noqa: E731
        if impl in apis:
            api = apis[impl]
            out[impl] = lambda mine=mine, api=api: mine(api)
        elif block is None:  # no one mpi4py call does it
            out[impl] = by_hand(name, comm, impl, *raw)
        elif impl == "raw":
            out[impl] = lambda block=block, raw=raw: block(*raw)
        else:
            out[impl] = nonblocking(start, *raw)
    return out


def ring(api: Any, a: np.ndarray, o: np.ndarray, nxt: int, prv: int) -> None:
    """One ring exchange through ``api.batch_isend_irecv``, waited for."""
    for w in api.batch_isend_irecv([api.P2POp(api.isend, a, nxt), api.P2POp(api.irecv, o, prv)]):
        w.wait()


def by_hand(name: str, comm: MPI.Comm, impl: str, *arrays: Any) -> Callable[[], None]:
    """The mpi4py code a user would write for ``name`` (an entry of OTHERS): blocking (``raw``) or
    nonblocking and tested until done (``raw_nb``)."""
    f32 = MPI.FLOAT
    if name == "all_reduce_coalesced":
        b, c, packed = arrays
        reduce = comm.Allreduce if impl == "raw" else nonblocking(comm.Iallreduce, MPI.IN_PLACE, [packed, f32], MPI.SUM)

        def coalesced() -> None:
            packed[: b.size] = b
            packed[b.size :] = c
            if impl == "raw":
                reduce(MPI.IN_PLACE, [packed, f32], MPI.SUM)
            else:
                reduce()
            b[...] = packed[: b.size]
            c[...] = packed[b.size :]

        return coalesced
    a, o, nxt, prv = arrays
    smsg, rmsg = [a, f32], [o, f32]

    def exchange() -> None:
        reqs = [comm.Isend(smsg, nxt), comm.Irecv(rmsg, prv)]
        if impl == "raw":
            MPI.Request.Waitall(reqs)
        else:
            while not MPI.Request.Testall(reqs):
                pass

    return exchange


def paired(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over trials of ``a``'s time over ``b``'s in the same trial."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def batch(call: Callable[[], Any], iters: int, comm: MPI.Comm) -> float:
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(iters):
        call()
    mine = time.perf_counter() - t
    return comm.allreduce(mine, op=MPI.MAX) / iters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, help="a checkout of another mpidist version (its root directory)")
    p.add_argument("--same", action="store_true", help="compare this checkout with itself (the method's noise)")
    p.add_argument("--sizes", nargs="*", type=int, default=[8, 4096, 262144], help="bytes per rank")
    p.add_argument("--collectives", nargs="*", default=COLLECTIVES, choices=COLLECTIVES + OTHERS)
    p.add_argument("--trials", type=int, default=41, help="interleaved trials (odd: a true median)")
    p.add_argument("--torch", action="store_true", help="mpidist's calls on torch CPU tensors (raw: numpy arrays)")
    args = p.parse_args()
    if (args.before is None) == (not args.same):
        p.error("give --before DIR or --same")
    root = Path(dist.__file__).resolve().parent.parent if args.same else args.before.resolve()
    before = load_package(root, "mpidist_before")
    dist.init_process_group()
    before.init_process_group()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    apis = {"now": dist, "before": before}
    if rank == 0:
        print(f"# {comm.Get_size()} ranks; now: {Path(dist.__file__).parent}; before: {root / 'mpidist'}")
        print("# per-call us (median of trials); ratios: medians of the per-trial paired ratios")
        print(f"{'collective':24s} {'size':>8s} {'raw':>8s} {'raw_nb':>8s} {'now':>8s} {'before':>8s}"
              f" {'now/raw':>8s} {'bef/raw':>8s} {'now/nb':>8s} {'now/bef':>8s}")  # fmt: skip
    for name in args.collectives:
        for nbytes in args.sizes:
            impls = calls(name, nbytes, comm, apis, args.torch)
            iters = max(20, min(2000, (16 << 20) // max(nbytes, 1)))
            for f in impls.values():  # warm-up
                for _ in range(5):
                    f()
            times: dict[str, list[float]] = {k: [] for k in IMPLS}
            for trial in range(args.trials):
                order = IMPLS[trial % len(IMPLS) :] + IMPLS[: trial % len(IMPLS)]
                for impl in order:
                    times[impl].append(batch(impls[impl], iters, comm))
            if rank == 0:
                med = {k: statistics.median(v) * 1e6 for k, v in times.items()}

                print(f"{name:24s} {nbytes:8d} {med['raw']:8.2f} {med['raw_nb']:8.2f} {med['now']:8.2f}"
                      f" {med['before']:8.2f} {paired(times, 'now', 'raw'):8.2f} {paired(times, 'before', 'raw'):8.2f}"
                      f" {paired(times, 'now', 'raw_nb'):8.2f} {paired(times, 'now', 'before'):8.3f}", flush=True)  # fmt: skip
    before.destroy_process_group()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
