"""Object collectives against the array collectives and raw mpi4py's pickling calls, in the same run.

Run:  mpiexec -n 2 python benchmarks/bench_objects.py [--mib 256] [--trials 7] [--small-calls 2000]

Two parts, each printed as a table by rank 0:

* **Large objects**: an object holding one float32 array of ``--mib`` MiB per rank
  (``{"array": a, "rank": r}``) through ``broadcast_object_list`` (from rank 0) and
  ``all_gather_object``, against the array collective moving the same array
  (``broadcast``; ``all_gather_into_tensor``), once into an output allocated before
  the call and reused (what a program usually does) and once into an output
  allocated by the call (what an object call has to do: its result is new memory), and
  against raw mpi4py's pickle-based ``comm.bcast(obj)`` / ``comm.allgather(obj)``,
  which pickle everything into one in-band message.
* **Small objects**: a dict of four ints through every object function, against raw
  mpi4py's ``comm.bcast`` / ``allgather`` / ``gather`` / ``scatter`` / ``send``+``recv``
  (blocks of ``--small-calls`` calls per trial).

Every implementation is verified once before timing (the objects arrive equal).
Trials are interleaved (the order rotates every trial); each trial starts together
on all ranks and is timed by the slowest rank. The tables show medians over trials
and the median of the paired per-trial ratios against the reference column.

Memory (large objects only): for one extra call of each implementation, the growth
of the process's peak resident memory during the call (``VmHWM`` in
/proc/self/status, reset beforehand through /proc/self/clear_refs), as a multiple of
the bytes the call has to deliver on that rank (the array on a broadcast receiver,
``world size x array`` for all_gather; the broadcast source's growth is shown against
the array too), the largest over ranks. An array collective into a reused output
shows ~0 (its output existed before the call).

``--before FILE`` adds a column for another version of ``mpidist/objects.py`` (for
example ``git show main:mpidist/objects.py > /tmp/before.py``), loaded next to the
current one and timed in the same trials, with the paired ratio mpidist/before: on
a shared machine that is the reliable before/after comparison. (Or run the script
with another mpidist first on ``PYTHONPATH``: it uses only the public API.)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mpidist as dist

SMALL = {"step": 12, "epoch": 3, "rank": 0, "loss_milli": 734}


def load_before(path: str) -> Any:
    """Another version of mpidist/objects.py, as module ``mpidist._objects_before`` (its relative imports
    resolve in the current mpidist)."""
    spec = importlib.util.spec_from_file_location("mpidist._objects_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def small_object(rank: int) -> dict:
    return dict(SMALL, rank=rank)


# -- timing ----------------------------------------------------------------------------------
def timed(comm: MPI.Comm, fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls, started together, as the slowest rank saw them."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    took = (time.perf_counter() - t0) / calls
    return comm.allreduce(took, op=MPI.MAX)


def interleaved(comm: MPI.Comm, impls: dict[str, Callable[[], Any]], trials: int, calls: int) -> dict[str, list[float]]:
    names = list(impls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for t in range(trials):
        order = names[t % len(names) :] + names[: t % len(names)]
        for n in order:
            times[n].append(timed(comm, impls[n], calls))
            gc.collect()
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} µs"


# -- memory ----------------------------------------------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_growth(comm: MPI.Comm, fn: Callable[[], Any]) -> int:
    """Bytes the peak resident memory grew by during one call of ``fn`` (its result is kept until measured)."""
    gc.collect()
    comm.Barrier()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
    except OSError:
        return -1
    base = _status("VmRSS")
    result = fn()
    grown = _status("VmHWM") - base
    del result
    gc.collect()
    return grown


# -- large objects ---------------------------------------------------------------------------
def large_rows(
    args: argparse.Namespace, comm: MPI.Comm
) -> list[tuple[str, dict[str, list[float]], dict[str, float], str]]:
    rank, n = comm.rank, comm.size
    elems = (args.mib << 20) // 4
    a = (np.arange(elems, dtype=np.float32) % 1009) + rank  # every page touched before the calls
    nbytes = a.nbytes
    obj = {"array": a, "rank": rank}
    bcast_out = a.copy() if rank == 0 else np.empty_like(a)
    gather_out = np.empty(n * elems, np.float32)

    def bcast_object(api: Any = dist) -> Callable[[], Any]:
        def run():
            objs = [obj] if rank == 0 else [None]
            api.broadcast_object_list(objs, src=0)
            return objs

        return run

    def bcast_array():
        dist.broadcast(bcast_out, src=0)
        return bcast_out

    def bcast_array_fresh():
        out = a if rank == 0 else np.empty_like(a)
        dist.broadcast(out, src=0)
        return out

    def bcast_raw():
        return comm.bcast(obj if rank == 0 else None, root=0)

    def gather_object(api: Any = dist) -> Callable[[], Any]:
        def run():
            out = [None] * n
            api.all_gather_object(out, obj)
            return out

        return run

    def gather_array():
        dist.all_gather_into_tensor(gather_out, a)
        return gather_out

    def gather_array_fresh():
        out = np.empty(n * elems, np.float32)
        dist.all_gather_into_tensor(out, a)
        return out

    def gather_raw():
        return comm.allgather(obj)

    # verify once
    expect0 = (np.arange(elems, dtype=np.float32) % 1009) + 0
    bad = []
    for name, got in (("broadcast_object_list", bcast_object()()[0]), ("comm.bcast", bcast_raw())):
        if not (got["rank"] == 0 and np.array_equal(got["array"], expect0)):
            bad.append(name)
    for name, got in (("all_gather_object", gather_object()()), ("comm.allgather", gather_raw())):
        for r in range(n):
            if not (got[r]["rank"] == r and np.array_equal(got[r]["array"], expect0 + r)):
                bad.append(f"{name} slot {r}")
    if comm.allreduce(bool(bad), op=MPI.LOR):
        print(f"rank {rank}: wrong results: {bad}", file=sys.stderr, flush=True)
        sys.exit(1)
    gc.collect()

    rows = []
    for title, impls, deliver in (
        (
            "broadcast",
            {"object": bcast_object(), "array": bcast_array, "array_fresh": bcast_array_fresh, "raw": bcast_raw},
            nbytes,
        ),
        (
            "all_gather",
            {"object": gather_object(), "array": gather_array, "array_fresh": gather_array_fresh, "raw": gather_raw},
            n * nbytes,
        ),
    ):
        if args.before_module is not None:
            impls["before"] = (bcast_object if title == "broadcast" else gather_object)(args.before_module)
        times = interleaved(comm, impls, args.trials, 1)
        memory = {}
        for name, fn in impls.items():
            grown = peak_growth(comm, fn)
            memory[name] = comm.allreduce(grown / deliver, op=MPI.MAX) if grown >= 0 else float("nan")
        rows.append((title, times, memory, f"{args.mib} MiB"))
    return rows


def print_large(rows: list, n: int, before: bool) -> None:
    print(f"\nLarge objects: one float32 array per object, {n} ranks; time = median of trials (slowest rank)")
    print("object = mpidist object call; array = array collective into a reused output; array_fresh = into an")
    print("output allocated by the call; raw = mpi4py's pickle-based call. Memory = peak RSS growth during one")
    print(
        "call / bytes delivered on that rank (largest over ranks)"
        + ("; before = --before's object call." if before else ".")
    )
    print()
    cols = ["object", "array", "array_fresh", "raw"] + (["before"] if before else [])
    ratios = [("object", "array"), ("object", "array_fresh"), ("raw", "array")] + (
        [("before", "array")] if before else []
    )
    print(
        "| collective | array | "
        + " | ".join(cols)
        + " | "
        + " | ".join(f"{a}/{b}" for a, b in ratios)
        + " | "
        + " | ".join(f"memory {c}" for c in cols if c != "array")
        + " |"
    )
    print("|" + "---|" * (2 + len(cols) + len(ratios) + len(cols) - 1))
    for title, times, memory, size in rows:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"| {title} | {size} | "
            + " | ".join(fmt_time(med[c]) for c in cols)
            + " | "
            + " | ".join(f"{ratio(times, a, b):.2f}" for a, b in ratios)
            + " | "
            + " | ".join(f"{memory[c]:.2f}×" for c in cols if c != "array")
            + " |"
        )


# -- small objects ---------------------------------------------------------------------------
def small_rows(args: argparse.Namespace, comm: MPI.Comm) -> list[tuple[str, dict[str, list[float]]]]:
    rank, n = comm.rank, comm.size
    mine = small_object(rank)
    everyone = [small_object(r) for r in range(n)]
    nxt, prv = (rank + 1) % n, (rank - 1) % n

    def p2p(send: Callable[[], None], recv: Callable[[], Any]) -> Callable[[], Any]:
        def run():
            if n == 1:
                return None
            if rank % 2 == 0:
                send()
                return recv()
            got = recv()
            send()
            return got

        return run

    def calls(api: Any) -> dict[str, Callable[[], Any]]:
        """The five object functions of ``api`` (mpidist, or --before's module) on the small objects."""

        def bcast():
            objs = [mine] if rank == 0 else [None]
            api.broadcast_object_list(objs, src=0)
            return objs[0]

        def allgather():
            out = [None] * n
            api.all_gather_object(out, mine)
            return out

        def gather():
            out = [None] * n if rank == 0 else None
            api.gather_object(mine, out, dst=0)
            return out

        def scatter():
            out = [None]
            api.scatter_object_list(out, everyone if rank == 0 else None, src=0)
            return out[0]

        def recv():
            inp = [None]
            api.recv_object_list(inp, src=prv)
            return inp[0]

        return {
            "broadcast_object_list": bcast,
            "all_gather_object": allgather,
            "gather_object": gather,
            "scatter_object_list": scatter,
            "send/recv_object_list": p2p(lambda: api.send_object_list([mine], dst=nxt), recv),
        }

    raw = {
        "broadcast_object_list": lambda: comm.bcast(mine if rank == 0 else None, root=0),
        "all_gather_object": lambda: comm.allgather(mine),
        "gather_object": lambda: comm.gather(mine, root=0),
        "scatter_object_list": lambda: comm.scatter(everyone if rank == 0 else None, root=0),
        "send/recv_object_list": p2p(lambda: comm.send(mine, dest=nxt, tag=5), lambda: comm.recv(source=prv, tag=5)),
    }
    ours = calls(dist)
    before = calls(args.before_module) if args.before_module is not None else {}
    cases = {
        name: {"mpidist": ours[name], "raw": raw[name], **({"before": before[name]} if before else {})} for name in raw
    }
    # verify once
    bad = []
    checks = {
        "broadcast_object_list": lambda got: got == small_object(0),
        "all_gather_object": lambda got: got == everyone,
        "gather_object": lambda got: got == (everyone if rank == 0 else None),
        "scatter_object_list": lambda got: got == mine,
        "send/recv_object_list": lambda got: n == 1 or got == small_object(prv),
    }
    for name, impls in cases.items():
        for which, fn in impls.items():
            if not checks[name](fn()):
                bad.append(f"{name} ({which})")
    if comm.allreduce(bool(bad), op=MPI.LOR):
        print(f"rank {rank}: wrong results: {bad}", file=sys.stderr, flush=True)
        sys.exit(1)
    rows = []
    for name, impls in cases.items():
        if name.startswith("send") and n == 1:
            continue
        rows.append((name, interleaved(comm, impls, args.trials, args.small_calls)))
    return rows


def print_small(rows: list, n: int, before: bool) -> None:
    print(f"\nSmall objects: a dict of four ints, {n} ranks; per-call time, median of trials (slowest rank)\n")
    if before:
        print("| function | mpidist | before | raw mpi4py | mpidist/raw | before/raw | mpidist/before |")
        print("|---|---|---|---|---|---|---|")
    else:
        print("| function | mpidist | raw mpi4py | mpidist/raw |")
        print("|---|---|---|---|")
    for name, times in rows:
        med = {k: statistics.median(v) for k, v in times.items()}
        if before:
            print(
                f"| {name} | {fmt_time(med['mpidist'])} | {fmt_time(med['before'])} | {fmt_time(med['raw'])} | "
                f"{ratio(times, 'mpidist', 'raw'):.2f} | {ratio(times, 'before', 'raw'):.2f} | "
                f"{ratio(times, 'mpidist', 'before'):.2f} |"
            )
        else:
            print(
                f"| {name} | {fmt_time(med['mpidist'])} | {fmt_time(med['raw'])} | "
                f"{ratio(times, 'mpidist', 'raw'):.2f} |"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of the array in each large object (default 256)")
    p.add_argument("--trials", type=int, default=7, help="interleaved trials (default 7)")
    p.add_argument("--small-calls", type=int, default=2000, help="calls per trial for small objects (default 2000)")
    p.add_argument("--no-large", action="store_true", help="only the small objects")
    p.add_argument("--no-small", action="store_true", help="only the large objects")
    p.add_argument("--before", metavar="FILE", help="another mpidist/objects.py to time next to this one")
    args = p.parse_args()
    dist.init_process_group()
    args.before_module = load_before(args.before) if args.before else None
    comm = MPI.COMM_WORLD.Dup()
    if comm.rank == 0:
        print(f"mpidist {dist.__version__} from {dist.__file__}; {MPI.Get_library_version().splitlines()[0]}")
    large = [] if args.no_large else large_rows(args, comm)
    small = [] if args.no_small else small_rows(args, comm)
    if comm.rank == 0:
        if large:
            print_large(large, comm.size, args.before_module is not None)
        if small:
            print_small(small, comm.size, args.before_module is not None)
    comm.Free()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
