"""One-way point-to-point latency: mpidist's send/recv and isend/irecv against raw mpi4py, interleaved.

Run:  mpiexec -n 2 python benchmarks/bench_p2p.py [--sizes 8 4096 32768 262144 4194304] [--trials 7]
          [--iters 2000] [--before /path/to/other/checkout]

Ranks 0 and 1 ping-pong (OSU's osu_latency); each trial times a batch of round trips of
every implementation, in an order that rotates every trial, and the table shows the
median one-way time (round trip / 2) of each and the medians of the paired ratios
against raw mpi4py's nonblocking calls (``Isend``/``Irecv`` then ``Test`` until done:
the floor of a call with a timeout) and its blocking ``Send``/``Recv``:

* ``raw``: ``Send``/``Recv``; ``raw_nb``: ``Isend``/``Irecv`` + ``Test`` loop;
* ``send``: ``dist.send``/``dist.recv``; ``isend``: ``dist.isend``/``dist.irecv`` + ``wait()``;
* with ``--before DIR``, ``b_send`` and ``b_isend``: the same calls of another checkout's
  mpidist, loaded next to this one (as ``bench_paired.py`` does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mpidist as dist

sys.path.insert(0, str(Path(__file__).parent))
from bench_paired import load_package  # noqa: E402


def ping_pong(me: int, first: Callable[[], Any], second: Callable[[], Any]) -> Callable[[], None]:
    """Rank 0: ``first`` (its send) then ``second`` (its receive); rank 1 the other way round."""
    if me == 0:

        def one() -> None:
            first()
            second()

    else:

        def one() -> None:
            second()
            first()

    return one


def impls(me: int, nbytes: int, comm: MPI.Comm, apis: dict[str, Any]) -> dict[str, Callable[[], None]]:
    peer = 1 - me
    n = max(1, nbytes // 4)
    out: dict[str, Callable[[], None]] = {}
    s, r = np.ones(n, np.float32), np.empty(n, np.float32)
    smsg, rmsg = [s, MPI.FLOAT], [r, MPI.FLOAT]
    out["raw"] = ping_pong(me, lambda: comm.Send(smsg, peer), lambda: comm.Recv(rmsg, peer))
    isend, irecv = comm.Isend, comm.Irecv

    def nb_send() -> None:
        q = isend(smsg, peer)
        while not q.Test():
            pass

    def nb_recv() -> None:
        q = irecv(rmsg, peer)
        while not q.Test():
            pass

    out["raw_nb"] = ping_pong(me, nb_send, nb_recv)
    for prefix, api in apis.items():
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        send, recv, ise, ire = api.send, api.recv, api.isend, api.irecv
        out[prefix + "send"] = ping_pong(me, lambda send=send, a=a: send(a, peer), lambda recv=recv, b=b: recv(b, peer))
        out[prefix + "isend"] = ping_pong(
            me, lambda ise=ise, a=a: ise(a, peer).wait(), lambda ire=ire, b=b: ire(b, peer).wait()
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 4096, 32768, 262144, 4194304])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--iters", type=int, default=2000, help="round trips per batch at 8 B (fewer for large sizes)")
    p.add_argument("--before", type=Path, help="another checkout, timed as b_send/b_isend")
    args = p.parse_args()
    dist.init_process_group()
    apis: dict[str, Any] = {"": dist}
    if args.before is not None:
        before = load_package(args.before, "mpidist_before")
        before.init_process_group()
        apis["b_"] = before
    comm = MPI.COMM_WORLD.Dup()
    me = comm.Get_rank()
    if me == 0:
        print(f"# bench_p2p: {comm.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0]}")
        print(f"# one-way us (median of {args.trials} trials); ratios: medians of paired per-trial ratios")
    for nbytes in args.sizes:
        iters = max(20, min(args.iters, int(args.iters * 4096 / max(nbytes, 4096))))
        if me > 1:
            fns: dict[str, Callable[[], None]] = {}
        else:
            fns = impls(me, nbytes, comm, apis)
        names = list(impls(0, 8, comm, apis)) if me > 1 else list(fns)
        times: dict[str, list[float]] = {k: [] for k in names}
        for k in names:  # warm up
            if me <= 1:
                for _ in range(20):
                    fns[k]()
        for t in range(args.trials):
            order = names[t % len(names) :] + names[: t % len(names)]
            for k in order:
                comm.Barrier()
                t0 = time.perf_counter()
                if me <= 1:
                    f = fns[k]
                    for _ in range(iters):
                        f()
                dt = (time.perf_counter() - t0) / iters / 2 * 1e6
                times[k].append(comm.allreduce(dt, MPI.MAX))
        if me == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            cols = "  ".join(f"{k}={med[k]:.2f}" for k in names)
            ratios = []
            for k in names:
                if k in ("raw", "raw_nb"):
                    continue
                nb = statistics.median(a / b for a, b in zip(times[k], times["raw_nb"]))
                bl = statistics.median(a / b for a, b in zip(times[k], times["raw"]))
                ratios.append(f"{k}/nb={nb:.2f} {k}/raw={bl:.2f}")
            print(f"{nbytes:>8} B  {cols}  |  " + "  ".join(ratios), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
