"""all_reduce in a group that spans nodes: the node-leader path against MPI's call, and what the measuring chose.

Run across hosts, e.g. on the simulated hosts of tools/cluster/hosts.sh, two ranks on each,
their links bounded by ``hosts.sh shape HOST 10gbit``:

    mpiexec -launcher ssh -launcher-exec tools/cluster/fake_ssh -hosts h1:2,h2:2 -n 4 \\
        python benchmarks/bench_node_leaders.py [--sizes 65536 1048576 ...] [--trials 7]

Columns, per size of the array (float32, sum): ``raw`` mpi4py's blocking ``Allreduce``
(in place) on a duplicate of COMM_WORLD; ``leaders`` mpidist's all_reduce on a group whose
path is fixed to the node leaders (``MPIDIST_SHM_THRESHOLDS=all_reduce=16K``); ``mpi`` on a
group with ``MPIDIST_SHM=0`` (MPI's call through mpidist); ``default`` on a group that
measured both on its first calls of each size class and took the faster (``shm_choice.py``),
whose choice the last column shows. Trials interleave the columns in an order that turns
around each trial; a cell is the median over trials of the slowest rank's time per call.
The bytes the hosts sent over their links per call (``/sys/class/net/eth0``, summed over
the ranks, so each host counts once per rank on it) show what the node-leader path saves.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mpidist as dist
from mpidist.backends import node_leaders, shm_choice
from mpidist.bench.tune import group_under
from mpidist.testing import backend_of

SIZES = [1 << k for k in range(16, 26, 2)]  # 64 KiB .. 16 MiB


def per_call(comm: MPI.Comm, f: Callable[[], Any], reps: int) -> float:
    """The slowest rank's seconds per call of ``reps`` back-to-back calls."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return comm.allreduce((time.perf_counter() - start) / reps, MPI.MAX)


def sent_bytes() -> int:
    """Bytes this host's eth0 has sent (0 where there is no such interface)."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes of each rank's array")
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    dist.init_process_group("mpi")
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = MPI.COMM_WORLD.Dup()
    groups = {
        "leaders": group_under(dist, {"MPIDIST_SHM_THRESHOLDS": "all_reduce=16K"}),
        "mpi": group_under(dist, {"MPIDIST_SHM": "0"}),
        "default": group_under(dist, {}),
    }
    path = backend_of(groups["leaders"]).shared_memory()
    spans = isinstance(path, node_leaders.NodeLeaders)
    node_first = comm.allgather(MPI.Get_processor_name())
    if rank == 0:
        print(f"# {n} ranks on {len(set(node_first))} hosts ({', '.join(node_first)}); "
              f"{MPI.Get_library_version().splitlines()[0]}")  # fmt: skip
        if not spans:
            print("# this group has no node-leader path (one node, no node with two ranks, or switched off)")
        print(f"{'size':>10s} {'raw (us)':>10s} {'leaders/raw':>12s} {'mpi/raw':>8s} {'default/raw':>12s} "
              f"{'sent/call: raw':>14s} {'leaders':>8s} {'mpi':>8s}  default's choice")  # fmt: skip
    for nbytes in args.sizes:
        x = np.ones(nbytes // 4, np.float32)
        reps = max(3, min(200, (32 << 20) // nbytes))
        calls = {"raw": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)}
        calls.update({k: (lambda g=g, x=x: dist.all_reduce(x, group=g)) for k, g in groups.items()})
        for _ in range(shm_choice.CHOSEN_AT + 1):  # the default group measures and chooses
            dist.all_reduce(x, group=groups["default"])
        sent = {}
        for k in ("raw", "leaders", "mpi"):
            comm.Barrier()
            before = sent_bytes()
            for _ in range(reps):
                calls[k]()
            comm.Barrier()
            sent[k] = comm.allreduce(sent_bytes() - before, MPI.SUM) / reps
        times: dict[str, list[float]] = {k: [] for k in calls}
        for trial in range(args.trials):
            for k in list(calls) if trial % 2 else list(calls)[::-1]:
                times[k].append(per_call(comm, calls[k], reps))
        med = {k: statistics.median(v) for k, v in times.items()}
        bits = nbytes.bit_length()
        choice = [w for fn, _, s, w in backend_of(groups["default"]).shared_memory_choices() if fn == "all_reduce"
                  and s == shm_choice.Route("", "", bits, False).sizes()]  # fmt: skip
        if rank == 0:
            print(
                f"{nbytes:>10d} {med['raw'] * 1e6:>10.1f} {med['leaders'] / med['raw']:>12.2f} "
                f"{med['mpi'] / med['raw']:>8.2f} {med['default'] / med['raw']:>12.2f} "
                f"{sent['raw'] / 2**20:>10.2f} MiB {sent['leaders'] / 2**20:>4.2f} MiB {sent['mpi'] / 2**20:>4.2f} MiB"
                f"  {choice[0] if choice else '-'}",
                flush=True,
            )
    for g in groups.values():
        dist.destroy_process_group(g)
    comm.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
