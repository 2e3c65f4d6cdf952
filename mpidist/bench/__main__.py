"""mpidist's collectives against raw mpi4py on your cluster, reported as nccl-tests reports them.

    mpiexec -n 4 python -m mpidist.bench                          # every collective, 8 B to 16 MiB
    mpiexec -n 4 mpidist-bench -c all_reduce -b 8 -e 256M -f 4    # one collective, a wider sweep
    mpiexec -n 2 mpidist-bench -c p2p_latency p2p_bandwidth -e 4M
    mpiexec -n 8 mpidist-bench -d bfloat16 -o avg --check --json out.json --plot out.png
    mpiexec -n 2 mpidist-bench -c all_reduce -d float32,float16,bfloat16 -b 64K -e 64M -f 64   # dtypes side by side
    mpiexec -n 8 mpidist-bench --device cuda --backend nccl       # cupy arrays, one GPU per rank
    mpiexec -n 2 python -m mpidist.bench --torch -c all_reduce -e 4K   # torch CPU tensors
    mpiexec -n 2 python -m mpidist.bench --tune                   # shared-memory thresholds (bench/tune.py)

For each collective and size it prints the size S and count, then for mpidist and
for raw mpi4py (the blocking call on a duplicate of COMM_WORLD, or with ``--raw
nonblocking`` its I-variant followed by Test until done; timed in the same run,
batches interleaved) the time per call in microseconds, algbw = S / time and
busbw = algbw x factor in GB/s, the wrong elements found by --check, and the
median ratio mpidist/raw. Sizes and factors follow nccl-tests: S is the per-rank
buffer for all_reduce, broadcast and reduce; n x count (the gathered or
scattered buffer) for all_gather, reduce_scatter, all_to_all, gather and scatter;
the message for p2p. Factors: all_reduce 2(n-1)/n; all_gather, reduce_scatter,
all_to_all, gather, scatter (n-1)/n; broadcast, reduce, p2p 1. Time is the
slowest rank's, the median over --trials. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from .cases import CASES, DTYPES, OPS, RAW_MODES, Case, Context, Run, parse_dtype
from .devices import DEVICES, open_device
from .timing import Row, Table, format_bytes, time_run, write_json, write_plot

__all__ = ["main", "build_parser", "parse_size", "sweep", "auto_iters"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: a batch moves about this many bytes when --iters is not given (between 20 and 1000 messages)
AUTO_BATCH_BYTES = 64 << 20


def parse_size(text: str) -> int:
    """``'8'``, ``'4K'``, ``'1M'``, ``'2G'`` (binary multiples, as nccl-tests' -b/-e; ``'4KB'``, ``'4KiB'`` too)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(I?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (use e.g. 8, 4K, 1M, 2G)")
    value = int(match.group(1)) * _UNITS[match.group(2)]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _collectives(text: str) -> list[str]:
    names = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    out = []
    for name in names:
        if name == "all":
            out += list(CASES)
        elif name in CASES:
            out.append(name)
        else:
            raise argparse.ArgumentTypeError(f"unknown collective {name!r}; choose from all, {', '.join(CASES)}")
    return out


def _dtypes(text: str) -> list[str]:
    """``'float32,float16'`` -> the numpy names, in order, each once."""
    out: list[str] = []
    for name in text.split(","):
        try:
            dtype = parse_dtype(name.strip()).name
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if dtype not in out:
            out.append(dtype)
    return out


def _rank() -> int:
    """This process's rank, for printing once (without starting MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    return int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)


class _Parser(argparse.ArgumentParser):
    """argparse that prints (help, usage, errors) on rank 0 only; every rank exits alike."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if _rank() == 0:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    p = _Parser(
        prog=script if script.startswith("mpidist-bench") else "python -m mpidist.bench",
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size S (default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=16 << 20, help="largest size S (default 16M)")
    p.add_argument("-f", "--stepfactor", type=_positive, default=2, help="multiply the size by this (default 2)")
    p.add_argument(
        "-c", "--collective", dest="collectives", type=_collectives, action="extend", nargs="+", metavar="NAME",
        help=f"one or more of: all (default), {', '.join(CASES)} (spaces or commas between names)",
    )  # fmt: skip
    p.add_argument(
        "-d", "--dtype", type=_dtypes, default=["float32"],
        help=f"one or more (commas between; each size gets a row per dtype) of {', '.join(DTYPES)} (default float32)",
    )  # fmt: skip
    p.add_argument(
        "-o", "--op", choices=list(OPS), default="sum", help="reduction of all_reduce, reduce, reduce_scatter"
    )
    p.add_argument(
        "-r", "--root", type=_count, default=0, help="root of broadcast, reduce, gather, scatter (default 0)"
    )
    p.add_argument(
        "-n", "--iters", type=_positive, help="iterations per timed batch (default: ~64 MiB, 20..1000 calls)"
    )
    p.add_argument("-w", "--warmup", type=_count, default=5, help="untimed iterations before each size (default 5)")
    p.add_argument("--trials", type=_positive, default=5, help="interleaved batches of each implementation (default 5)")
    p.add_argument(
        "--raw", choices=RAW_MODES, default="blocking",
        help="raw mpi4py's calls: blocking (default) or nonblocking, the I-call then Test until done "
        "(the floor of a timeout-safe call)",
    )  # fmt: skip
    p.add_argument("--window", type=_positive, default=64, help="messages in flight for p2p_bandwidth (default 64)")
    p.add_argument("--backend", help="init_process_group's backend (default mpi; unused if a group exists)")
    p.add_argument(
        "--device", choices=DEVICES, default="cpu",
        help="cpu: numpy arrays (default); torch: torch CPU tensors; cuda: cupy arrays, one GPU per rank; "
        "standin: mpidist.testing.HostCudaArray (mpidist's device path on host memory, to test without a GPU)",
    )  # fmt: skip
    p.add_argument("--torch", action="store_true", help="torch CPU tensors: the same as --device torch")
    p.add_argument("--check", action="store_true", help="verify each size once against numpy (nccl-tests' -c)")
    p.add_argument("--json", metavar="FILE", help="write every row to FILE (rank 0)")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size to FILE.png (rank 0; needs matplotlib)")
    p.add_argument(
        "--gpu-check", action="store_true",
        help="run mpidist's GPU checks on this machine's GPU (not under mpiexec: it starts its own jobs); "
        "PASS/FAIL lines, exit status 3 where no GPU is usable",
    )  # fmt: skip
    p.add_argument(
        "--tune", action="store_true",
        help="measure from which size the shared-memory path beats MPI's calls (-b/-e: default 16K..64M, x2) "
        "and write the table the groups' own measuring starts from, for this MPI library (docs/performance.md)",
    )  # fmt: skip
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check the options that need no MPI; argparse errors name the option (exit status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minbytes > args.maxbytes:
        parser.error(f"argument -b/--minbytes: {args.minbytes} is larger than -e/--maxbytes {args.maxbytes}")
    if args.stepfactor < 2:
        parser.error("argument -f/--stepfactor: must be at least 2 (the sizes would not grow)")
    if args.torch:
        if args.device not in ("cpu", "torch"):
            parser.error(f"argument --torch: means --device torch, but --device {args.device} was given")
        args.device = "torch"
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("argument --plot: needs matplotlib, which is not installed (pip install 'mpidist[plot]')")
    chosen = [name for names in args.collectives or [list(CASES)] for name in names]  # each -c value is a list
    args.collectives = list(dict.fromkeys(chosen))
    args.parser = parser
    return args


def sweep(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """nccl-tests' sizes: ``minbytes``, times ``factor``, ... up to ``maxbytes``."""
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


def auto_iters(nbytes: int, per_iteration: int) -> int:
    """Iterations per batch when --iters is not given: about 64 MiB of messages, 20 to 1000 messages."""
    messages = max(20, min(1000, AUTO_BATCH_BYTES // max(nbytes, 1)))
    return max(1, math.ceil(messages / per_iteration))


# -- --check -----------------------------------------------------------------------------------
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52,
        "complex64": 2.0**-23, "complex128": 2.0**-52}  # fmt: skip


def count_wrong(got: np.ndarray, want: np.ndarray, ranks: int) -> int:
    """Elements of ``got`` that differ from ``want``: exactly for integers and bool, within rounding for floats."""
    got, want = np.asarray(got).ravel(), np.asarray(want).ravel()
    if got.shape != want.shape:
        return max(got.size, want.size)
    eps = _EPS.get(want.dtype.name)
    if eps is None:
        return int(np.count_nonzero(got != want))
    wide = np.complex128 if want.dtype.kind == "c" else np.float64
    g, w = got.astype(wide), want.astype(wide)
    with np.errstate(invalid="ignore"):
        close = (g == w) | (np.abs(g - w) <= eps * max(2, ranks) * np.abs(w))
    return int(np.count_nonzero(~close))


def fill(run: Run, arrays: Any) -> None:
    """Write every array of ``run``: outputs zeros, inputs their known values.

    Before timing too: an array never written reads the kernel's zero page (a broadcast's
    source only reads its array), and one array of a pair may be fresh pages while the
    other reuses memory that earlier sizes touched (glibc's heap serves allocations up to
    its mmap threshold, 32 MiB); either made one implementation look several times faster.
    """
    for outs in run.outputs.values():
        for a, _ in outs:
            arrays.clear(a)
    for a, values in run.inputs:
        arrays.upload(a, values())
    arrays.synchronize()


def check(run: Run, arrays: Any, ranks: int) -> dict[str, int]:
    """Fill every rank's known inputs, run each implementation once, count wrong elements here."""
    fill(run, arrays)
    run.mpidist()
    if run.raw is not None:
        run.raw()
    arrays.synchronize()
    wrong = {}
    for impl in ("mpidist", "raw") if run.raw is not None else ("mpidist",):
        wrong[impl] = 0
        for a, expected in run.outputs.get(impl, []):
            want = expected()
            if want is not None:
                wrong[impl] += count_wrong(arrays.download(a), want, ranks)
    return wrong


# -- the run -----------------------------------------------------------------------------------
def _header(args: argparse.Namespace, meta: dict[str, Any], table: Table) -> None:
    mpi = " ".join(MPI.Get_library_version().split("\n")[0].split())
    iters = "auto (~64 MiB per batch, 20..1000 messages)" if args.iters is None else str(args.iters)
    table.say(f"# mpidist.bench: {meta['ranks']} ranks, backend {meta['backend']}, {meta['device_detail']}")
    table.say(
        f"# dtype {meta['dtype']}, op {meta['op']}, root {meta['root']}; sizes {format_bytes(args.minbytes)} .. "
        f"{format_bytes(args.maxbytes)} x{args.stepfactor}; iters {iters}, warmup {args.warmup}, "
        f"{args.trials} interleaved trials{', checked' if args.check else ''}"
    )
    table.say("# time: per message, the slowest rank's batch, median over trials; algbw = S/time, GB = 1e9 bytes")
    calls = "blocking calls" if args.raw == "blocking" else "nonblocking calls, then Test until done"
    table.say(f"# raw mpi4py: {calls} on a duplicate of COMM_WORLD; MPI: {mpi}; mpidist {meta['mpidist']}")


def run_bench(args: argparse.Namespace, dist: Any, arrays: Any, out: Any = None) -> tuple[int, list[Row]]:
    """Run every selected case over the sweep; return (exit status, rows). Collective: every rank calls it."""
    from .._version import __version__

    comm = MPI.COMM_WORLD.Dup()
    try:
        n, rank = comm.Get_size(), comm.Get_rank()
        ctxs = [
            Context(dist=dist, comm=comm, arrays=arrays, dtype=parse_dtype(name), op=args.op, root=args.root,
                    window=args.window, raw_mode=args.raw)
            for name in args.dtype
        ]  # fmt: skip
        meta: dict[str, Any] = {
            "tool": "mpidist.bench", "mpidist": __version__, "ranks": n, "backend": str(dist.get_backend()),
            "device": arrays.name, "device_detail": arrays.describe, "dtype": ",".join(args.dtype), "op": args.op,
            "root": args.root, "iters": args.iters or "auto", "warmup": args.warmup, "trials": args.trials,
            "window": args.window, "raw": args.raw, "check": args.check, "mpi_library": MPI.Get_library_version().strip(),
            "timing": "seconds per message: the slowest rank's batch time / messages, median over interleaved trials",
        }  # fmt: skip
        table = Table(out or sys.stdout) if rank == 0 else None
        if table:
            _header(args, meta, table)
        rows: list[Row] = []
        status = 0
        sizes = sweep(args.minbytes, args.maxbytes, args.stepfactor)
        for name in args.collectives:
            case = CASES[name]
            if n < case.min_ranks:
                if table:
                    table.say(f"\n# {name}: skipped, it needs at least {case.min_ranks} ranks")
                continue
            if table:
                table.section(name, case.summary, case.factor_text, case.factor(n))
            missing = {ctx.dtype.name: "" for ctx in ctxs}
            failed: set[str] = set()
            for ctx, count, size in _interleaved(case, sizes, ctxs, n):
                if ctx.dtype.name in failed:
                    continue  # the larger sizes fail alike
                row, error = _measure(args, case, ctx, count, size)
                if error:
                    if table:
                        table.note(f"{format_bytes(size)} {ctx.dtype.name}: mpidist cannot run this: {error}")
                    status = 1
                    failed.add(ctx.dtype.name)
                    continue
                rows.append(row)
                missing[ctx.dtype.name] = missing[ctx.dtype.name] or row.note
                if (row.wrong_mpidist or 0) + (row.wrong_raw or 0):
                    status = 1
                if table:
                    table.row(row)
            if table:
                for ctx in ctxs:
                    dtype = ctx.dtype.name
                    mine = [r for r in rows if r.collective == name and r.dtype == dtype]
                    _section_footer(table, mine, missing[dtype], dtype if len(ctxs) > 1 else "")
        if table:
            _footer(args, table, rows, status)
            if args.json:
                write_json(args.json, meta, rows)
            if args.plot:
                write_plot(args.plot, meta, rows)
        return status, rows
    finally:
        comm.Free()


def _interleaved(case: Case, sizes: list[int], ctxs: list[Context], n: int) -> list[tuple[Context, int, int]]:
    """``(context, count, S)`` of each row: by size, and at each size one row per dtype (in ``-d``'s order)."""
    rows = [
        (size, k, count) for k, ctx in enumerate(ctxs) for count, size in _layouts(case, sizes, ctx.dtype.itemsize, n)
    ]
    return [(ctxs[k], count, size) for size, k, count in sorted(rows)]


def _layouts(case: Case, sizes: list[int], itemsize: int, n: int) -> list[tuple[int, int]]:
    """``(count, S)`` of each row; a size that rounds to the count of the one before is dropped."""
    if not case.sized:
        return [case.layout(0, itemsize, n)]
    out: list[tuple[int, int]] = []
    for nbytes in sizes:
        count, size = case.layout(nbytes, itemsize, n)
        if not out or out[-1][0] != count:
            out.append((count, size))
    return out


def _measure(args: argparse.Namespace, case: Case, ctx: Context, count: int, size: int) -> tuple[Row | None, str]:
    """Set up one size, check it (or make a first call), then time it: ``(row, "")``, or ``(None, why not)``.

    Collective: every rank calls it with the same arguments.
    """
    comm, arrays = ctx.comm, ctx.arrays
    error, wrong = "", {}
    try:
        if args.check:  # on separate arrays per implementation: each one's results are checked
            wrong = check(case.setup(ctx, count), arrays, ctx.size)
        # timed on the same arrays where the case can (Context.twin): the two implementations then read and
        # write the same pages, so where the allocator put them cannot favour either
        run = case.setup(replace(ctx, share=True), count)
        fill(run, arrays)
        if not args.check:  # the first call, where mpidist refuses what it cannot do (on every rank alike)
            run.mpidist()
    except Exception as exc:  # noqa: BLE001 - reported as a collective mpidist cannot run, on every rank
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        return None, errors[0]
    row = Row(
        collective=case.name, bytes=size, count=count, dtype=ctx.dtype.name, op=args.op if case.reduces else "-",
        root=args.root if case.rooted else None, busbw_factor=case.factor(ctx.size) if case.sized else 0.0,
        iters=0, messages_per_iter=case.per_iteration(ctx), note=run.raw_missing or "",
    )  # fmt: skip
    row.iters = args.iters or auto_iters(size, row.messages_per_iter)
    if args.check:
        total = np.array([wrong["mpidist"], wrong.get("raw", 0)], np.int64)
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        row.wrong_mpidist = int(total[0])
        row.wrong_raw = int(total[1]) if run.raw is not None else None
    calls = {"mpidist": run.mpidist}
    if run.raw is not None:
        calls["raw"] = run.raw
    row.set_times(time_run(calls, row.iters, args.warmup, args.trials, comm, arrays.synchronize))
    return row, ""


def _section_footer(table: Table, rows: list[Row], missing: str, dtype: str = "") -> None:
    """The section's last lines (``dtype``: for one of several dtypes' rows, named in the lines)."""
    label = f"{dtype}: " if dtype else ""
    if missing:
        table.note(f"{label}raw mpi4py: n/a ({missing})")
    sized = [r for r in rows if r.bytes]
    if not sized:
        return
    avg = []
    for impl in ("mpidist", "raw"):
        values = [r.busbw(r.mpidist_s if impl == "mpidist" else r.raw_s) for r in sized]
        values = [v for v in values if v is not None]
        avg.append("n/a" if not values else f"{sum(values) / len(values):.3f} GB/s")
    table.note(f"{label}avg busbw over {len(sized)} sizes: mpidist {avg[0]}, raw mpi4py {avg[1]}")


def _footer(args: argparse.Namespace, table: Table, rows: list[Row], status: int) -> None:
    table.say()
    if args.check:
        wrong = sum((r.wrong_mpidist or 0) + (r.wrong_raw or 0) for r in rows)
        table.say(f"# check: {wrong} wrong elements" + (" (FAILED)" if wrong else " (all results correct)"))
    else:
        table.say("# check: not run (add --check to verify every size against numpy)")
    if status:
        table.say("# exit status 1: wrong results or collectives mpidist could not run (see above)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (every rank of the job calls this); return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if "--gpu-check" in args_list:  # one command of its own, not under mpiexec: see gpu_check.py
        from .gpu_check import main as gpu_check

        return gpu_check([a for a in args_list if a != "--gpu-check"])
    args = parse_args(argv)
    parser = args.parser
    import mpidist as dist

    from ..launch.boot import mpi_initialized

    arrays, why = (None, "")
    if mpi_initialized():  # under a launcher: pick the GPU before a device backend binds to one
        arrays, why = open_device(args.device, _world())
    own = not dist.is_initialized()
    if own:
        backend = args.backend or "mpi"
        try:
            dist.init_process_group(backend=backend)
        except Exception as exc:  # noqa: BLE001 - an unknown or unavailable backend: said once, as an option error
            parser.error(
                f"argument --backend: init_process_group(backend={backend!r}) failed: {type(exc).__name__}: {exc}"
            )
    try:
        if arrays is None and not why:
            arrays, why = open_device(args.device, _world())
        if why:
            parser.error(f"argument --device: {why}")
        if hasattr(arrays, "check_cuda_aware"):
            arrays.check_cuda_aware()
        n = dist.get_world_size()
        if args.root >= n:
            parser.error(f"argument -r/--root: must be below the number of ranks ({n}), got {args.root}")
        if args.tune:
            from .tune import tune

            lo = max(args.minbytes, 16 << 10)
            hi = args.maxbytes if args.maxbytes != 16 << 20 else 64 << 20
            return tune(dist, sweep(lo, hi, 2), args.trials, sys.stdout)
        status, _ = run_bench(args, dist, arrays)
        return status
    finally:
        if own and dist.is_initialized():
            dist.destroy_process_group()


def _world() -> Any:
    return MPI.COMM_WORLD


if __name__ == "__main__":
    sys.exit(main())
