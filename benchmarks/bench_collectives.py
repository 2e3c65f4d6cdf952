"""Per-call time of mpidist collectives against raw mpi4py (and torch gloo) in the same run.

Run:  mpiexec -n 2 python benchmarks/bench_collectives.py [--trials 21] [--json out.json] [--markdown]

Four implementations of each collective run in the same processes:

* ``raw``: the blocking mpi4py call (``comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)``, ...);
* ``mpidist``: ``dist.all_reduce(a)`` ... on numpy arrays;
* ``mpidist_torch``: the same mpidist calls on torch CPU tensors (zero-copy views);
* ``gloo``: ``torch.distributed`` with its gloo backend on torch tensors.

For each collective and message size the implementations are timed in
interleaved trials (the order rotates every trial), each trial a block of
back-to-back calls started together on all ranks and timed by the slowest rank
(gloo's blocks make 20 times fewer calls: each of its calls takes 50-200 times longer).
The table shows the median per-call time of each and the medians over trials of
the paired ratios mpidist/raw, mpidist-torch/raw and gloo/mpidist-torch, which
cancel most of the drift of a shared, noisy machine. "Size" is the array each
rank contributes (float32). "copies" counts the staging copies mpidist made
during the timed trials of that row, numpy/torch (0 means zero-copy).

Before any timing, every row is verified once: each implementation runs on
rank-dependent inputs (small integers, exact in float32) and its result must
equal a numpy reference built from every rank's known input, so all four
compute the same thing. A row that fails this on any rank is not timed, and the
run exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mpidist as dist
from mpidist._world import world

SIZES = [8, 4 << 10, 256 << 10, 4 << 20]
OPS = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]
#: implementations, in table order; the first two are required, the torch ones optional
IMPLS = ["raw", "mpidist", "mpidist_torch", "gloo"]
TITLES = {"raw": "raw mpi4py", "mpidist": "mpidist (numpy)", "mpidist_torch": "mpidist (torch)", "gloo": "gloo (torch)"}
MPIDIST_IMPLS = ("mpidist", "mpidist_torch")
#: gloo takes 50-200x longer per call: its blocks make this many times fewer calls (keeps a run short)
GLOO_FEWER = 20


def iterations(nbytes: int) -> int:
    return {8: 2000, 4 << 10: 1000, 256 << 10: 100, 4 << 20: 12}.get(nbytes, max(5, 2_000_000 // max(nbytes, 1)))


def label(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


# -- one row: buffers, calls, reference ------------------------------------------------------
def elements(op: str, nbytes: int, n: int) -> int:
    """float32 elements each rank contributes (a multiple of n where the op splits the array)."""
    k = max(1, nbytes // 4)
    if op in ("reduce_scatter_tensor", "all_to_all_single"):
        k = max(n, k - k % n)
    return k


def pattern(k: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s input: small integers, so float32 sums are exact in any order."""
    return ((np.arange(k) * 7 + 3 * rank) % 11 + rank).astype(np.float32)


def reference(op: str, k: int, rank: int, n: int) -> np.ndarray:
    """What this rank's output must hold after ``op`` on everyone's :func:`pattern`."""
    ins = [pattern(k, r) for r in range(n)]
    if op == "all_reduce":
        return np.sum(ins, axis=0, dtype=np.float32)
    if op == "broadcast":
        return ins[0]
    if op == "all_gather_into_tensor":
        return np.concatenate(ins)
    b = k // n
    if op == "reduce_scatter_tensor":
        return np.sum(ins, axis=0, dtype=np.float32)[rank * b : (rank + 1) * b]
    return np.concatenate([x[rank * b : (rank + 1) * b] for x in ins])  # all_to_all_single


class Impl:
    """One implementation of one row: its call, its input (refilled to verify) and its output."""

    def __init__(self, call: Callable[[], Any], inp: Any, out: Any) -> None:
        self.call = call
        self.inp = inp
        self.out = out


def _host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.numpy()


def build(op: str, nbytes: int, comm: MPI.Comm, torch: Any, tdist: Any, impls: list[str]) -> dict[str, Impl]:
    """Return {implementation: Impl} for one collective and size."""
    n = comm.Get_size()
    k = elements(op, nbytes, n)
    out_k = {"all_gather_into_tensor": k * n, "reduce_scatter_tensor": k // n, "all_to_all_single": k}.get(op)
    rows: dict[str, Impl] = {}
    for name in impls:
        if name in ("raw", "mpidist"):
            a = np.ones(k, np.float32)
            out = None if out_k is None else np.empty(out_k, np.float32)
        else:
            a = torch.ones(k, dtype=torch.float32)
            out = None if out_k is None else torch.empty(out_k, dtype=torch.float32)
        lib = {"raw": None, "mpidist": dist, "mpidist_torch": dist, "gloo": tdist}[name]
        rows[name] = Impl(_call(op, name, lib, comm, a, out), a, a if out is None else out)
    return rows


def _call(op: str, name: str, lib: Any, comm: MPI.Comm, a: Any, out: Any) -> Callable[[], Any]:
    if name == "raw":
        if op == "all_reduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
        if op == "broadcast":
            return lambda: comm.Bcast(a, 0)
        if op == "all_gather_into_tensor":
            return lambda: comm.Allgather(a, out)
        if op == "reduce_scatter_tensor":
            return lambda: comm.Reduce_scatter_block(a, out, MPI.SUM)
        return lambda: comm.Alltoall(a, out)
    # mpidist (numpy or torch) and torch.distributed share one vocabulary
    if op == "all_reduce":
        return lambda: lib.all_reduce(a)
    if op == "broadcast":
        return lambda: lib.broadcast(a, 0)
    if op == "all_gather_into_tensor":
        # torch >= 2.13 deprecates all_gather_into_tensor (a warning per call) for all_gather_single
        gather = getattr(lib, "all_gather_single", None) if name == "gloo" else None
        gather = gather or lib.all_gather_into_tensor
        return lambda: gather(out, a)
    if op == "reduce_scatter_tensor":
        scatter = getattr(lib, "reduce_scatter_single", None) if name == "gloo" else None
        scatter = scatter or lib.reduce_scatter_tensor
        return lambda: scatter(out, a)
    return lambda: lib.all_to_all_single(out, a)


# -- checks before timing ----------------------------------------------------------------------
def check_supported(op: str, nbytes: int, impls: dict[str, Impl], comm: MPI.Comm) -> dict[str, Impl]:
    """Drop implementations that raise on any rank (e.g. a collective gloo lacks)."""
    ok = {}
    for name, impl in impls.items():
        try:
            impl.call()
            error = ""
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        errors = [e for e in comm.allgather(error) if e]
        if not errors:
            ok[name] = impl
        elif comm.Get_rank() == 0:
            print(f"note: {TITLES[name]} dropped for {op} {label(nbytes)}: {errors[0].splitlines()[0]}", flush=True)
    return ok


def verify(op: str, impls: dict[str, Impl], comm: MPI.Comm) -> list[str]:
    """Run each implementation once on known inputs; return those whose result is wrong on any rank."""
    rank, n = comm.Get_rank(), comm.Get_size()
    wrong = []
    for name, impl in impls.items():
        src = _host(impl.inp)
        src[...] = pattern(src.size, rank)
        if impl.out is not impl.inp:
            _host(impl.out)[...] = np.nan  # a result left unwritten cannot pass
        impl.call()
        good = np.array_equal(_host(impl.out), reference(op, src.size, rank, n))
        if not comm.allreduce(good, op=MPI.LAND):
            wrong.append(name)
    return wrong


# -- timing ------------------------------------------------------------------------------------
def time_block(fn: Callable[[], Any], iters: int, comm: MPI.Comm) -> float:
    """Seconds per call of ``iters`` back-to-back calls, the slowest rank's view."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - start) / iters
    return comm.allreduce(elapsed, op=MPI.MAX)


def paired(samples: dict[str, list[float]], num: str, den: str) -> float | None:
    """Median over trials of the per-trial ratio num/den (None if either is missing)."""
    if num not in samples or den not in samples:
        return None
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


def spread(v: list[float]) -> float | None:
    """Interquartile range over median of one implementation's trials (how noisy the row was)."""
    if len(v) < 2:
        return None
    q1, _, q3 = statistics.quantiles(v, n=4)
    return round((q3 - q1) / statistics.median(v), 3)


def run_row(op: str, nbytes: int, impls: dict[str, Impl], trials: int, comm: MPI.Comm) -> dict[str, Any]:
    names = list(impls)
    iters = iterations(nbytes)
    count = {name: max(3, iters // GLOO_FEWER) if name == "gloo" else iters for name in names}
    for name in names:  # warm-up
        time_block(impls[name].call, max(2, count[name] // 10), comm)
    samples: dict[str, list[float]] = {name: [] for name in names}
    copies = {name: 0 for name in names if name in MPIDIST_IMPLS}
    for trial in range(trials):
        order = names[trial % len(names) :] + names[: trial % len(names)]
        for name in order:
            before = world.stats.copies
            samples[name].append(time_block(impls[name].call, count[name], comm))
            if name in copies:
                copies[name] += world.stats.copies - before
    row: dict[str, Any] = {
        "op": op,
        "bytes": nbytes,
        "ranks": comm.Get_size(),
        "trials": trials,
        "iters": count,
        "verified": True,
        "median_s": {name: statistics.median(v) for name, v in samples.items()},
        "ratio_vs_raw": paired(samples, "mpidist", "raw"),
        "torch_ratio_vs_raw": paired(samples, "mpidist_torch", "raw"),
        "torch_over_numpy": paired(samples, "mpidist_torch", "mpidist"),
        "gloo_over_mpidist": paired(samples, "gloo", "mpidist"),
        "gloo_over_mpidist_torch": paired(samples, "gloo", "mpidist_torch"),
        "copies": copies.get("mpidist", 0),
        "copies_torch": copies.get("mpidist_torch"),
        "spread": {name: spread(v) for name, v in samples.items()},
    }
    return row


# -- setup -------------------------------------------------------------------------------------
def import_torch(wanted: bool) -> Any:
    if not wanted:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def start_gloo(comm: MPI.Comm, torch: Any) -> Any:
    """Initialize torch.distributed's gloo backend in these processes, or return None."""
    if torch is None or os.environ.get("MPIDIST_BENCH_NO_GLOO"):
        return None
    import torch.distributed as tdist

    if not tdist.is_available() or not tdist.is_gloo_available():
        return None
    path = comm.bcast(tempfile.mktemp(prefix="mpidist-gloo-") if comm.Get_rank() == 0 else None)
    tdist.init_process_group("gloo", init_method=f"file://{path}", rank=comm.Get_rank(), world_size=comm.Get_size())
    return tdist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=21, help="interleaved trials per row (odd: a true median)")
    parser.add_argument("--ops", nargs="*", default=OPS, choices=OPS)
    parser.add_argument("--sizes", nargs="*", type=int, default=SIZES, help="bytes per rank")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    parser.add_argument(
        "--markdown", nargs="?", const="-", metavar="PATH",
        help="also write the table as markdown to PATH (rank 0; '-' or no PATH: standard output at the end)",
    )  # fmt: skip
    parser.add_argument("--no-gloo", action="store_true", help="skip torch.distributed gloo")
    parser.add_argument(
        "--no-torch", action="store_true", help="skip both torch implementations (mpidist on tensors, gloo)"
    )
    args = parser.parse_args()

    dist.init_process_group()
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    torch = import_torch(not args.no_torch)
    tdist = None if args.no_gloo else start_gloo(comm, torch)
    wanted = [i for i in IMPLS if (i != "mpidist_torch" or torch is not None) and (i != "gloo" or tdist is not None)]
    rows: list[dict[str, Any]] = []
    status = 0
    for op in args.ops:
        for nbytes in args.sizes:
            impls = check_supported(op, nbytes, build(op, nbytes, comm, torch, tdist, wanted), comm)
            missing = [name for name in ("raw", "mpidist") if name not in impls]
            wrong = verify(op, impls, comm)
            if missing or wrong:
                if rank == 0:
                    print(
                        f"error: {op} {label(nbytes)}: "
                        + "; ".join(
                            [f"{TITLES[m]} failed to run" for m in missing]
                            + [f"{TITLES[w]} computed a wrong result" for w in wrong]
                        )
                        + " (nothing timed for this row)",
                        flush=True,
                    )
                status = 1
                continue
            row = run_row(op, nbytes, impls, args.trials, comm)
            rows.append(row)
            if rank == 0:
                print_row(row, first=len(rows) == 1)
    if rank == 0:
        mpi = MPI.Get_library_version().splitlines()[0].strip()
        print(f"\n{n} ranks, {args.trials} interleaved trials per row, every row verified; MPI: {mpi}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if args.markdown:
            text = markdown(rows)
            if args.markdown == "-":
                print("\n" + text, end="")
            else:
                with open(args.markdown, "w") as f:
                    f.write(text)
    if tdist is not None:
        tdist.destroy_process_group()
    dist.destroy_process_group()
    return status


# -- output ------------------------------------------------------------------------------------
def fmt_time(seconds: float | None, micro: str = "us") -> str:
    if seconds is None:
        return "n/a"
    us = seconds * 1e6
    return f"{us:.2f} {micro}" if us < 1000 else f"{us / 1000:.3f} ms"


def fmt_ratio(r: float | None, suffix: str = "") -> str:
    if r is None:
        return "n/a"
    return f"{r:.1f}{suffix}" if r >= 10 else f"{r:.2f}{suffix}"


def fmt_copies(row: dict[str, Any]) -> str:
    torch_copies = row["copies_torch"]
    return f"{row['copies']}/{'-' if torch_copies is None else torch_copies}"


HEADER = ["collective", "size", "raw mpi4py", "mpidist np", "mpidist torch", "gloo torch",
          "np/raw", "torch/raw", "gloo/torch", "copies np/torch"]  # fmt: skip
WIDTHS = [24, 8, 11, 11, 13, 11, 7, 9, 10, 15]


def cells(row: dict[str, Any], micro: str = "us", times: str = "x") -> list[str]:
    med = row["median_s"]
    return [
        row["op"],
        label(row["bytes"]),
        *(fmt_time(med.get(name), micro) for name in IMPLS),
        fmt_ratio(row["ratio_vs_raw"]),
        fmt_ratio(row["torch_ratio_vs_raw"]),
        fmt_ratio(row["gloo_over_mpidist_torch"], times),
        fmt_copies(row),
    ]


def print_row(row: dict[str, Any], first: bool) -> None:
    if first:
        print(" ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(HEADER, WIDTHS))))
    print(" ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells(row), WIDTHS))), flush=True)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["collective", "size", *(TITLES[i] for i in IMPLS),
            "mpidist-numpy / raw", "mpidist-torch / raw", "gloo / mpidist-torch", "copies (numpy/torch)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join(cells(row, "µs", "×")) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
