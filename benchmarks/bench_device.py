"""Bandwidth of mpidist collectives on device (GPU) buffers, reported as nccl-tests reports it.

Run:  mpiexec -n 2 python benchmarks/bench_device.py [--backend nccl|mpi|cpu:mpi,cuda:nccl]
      mpiexec -n 2 python benchmarks/bench_device.py --host      # the same table on numpy arrays
      mpiexec -n 2 python benchmarks/bench_device.py --standin   # on mpidist's device stand-in

Each rank allocates its buffers with ``cupy.empty`` on the GPU of its node-local
rank (local rank modulo the GPUs it sees). Without cupy or a CUDA device the
script prints one line, ``skipped: no GPU (cupy/CUDA not available)``, and exits 0;
``--host`` runs the identical table on numpy arrays instead (it tests the script
anywhere and gives the host baseline), and ``--standin`` on
``mpidist.testing.HostCudaArray`` (host memory that mpidist treats as device memory,
so the device path of the MPI backend runs without a GPU).

Definitions (nccl-tests, doc/PERFORMANCE.md), for a collective over n ranks:

* ``size`` S (bytes) is the per-rank buffer size as nccl-tests defines it for the
  collective: for all_reduce, broadcast and reduce the (in-place) buffer; for
  all_gather the *output* buffer, ``sendcount * n * sizeof(dtype)``; for
  reduce_scatter the *input* buffer, ``recvcount * n * sizeof(dtype)``; for
  all_to_all the send (= receive) buffer. Element counts are rounded down to a
  multiple of n where the buffer is split over the ranks (at least n elements),
  and the printed size is the rounded one.
* ``time`` t: seconds per call, the mean of a block of back-to-back calls that
  ends with a device synchronize, taken by the slowest rank (nccl-tests averages
  over ranks by default; the slowest rank is the conservative reading); the
  median over ``--trials`` such blocks.
* ``algbw = S / t`` in GB/s (10^9 bytes per second, as nccl-tests).
* ``busbw = algbw * factor``, the factor making it comparable with the hardware's
  link bandwidth whatever n is: all_reduce ``2(n-1)/n``; all_gather,
  reduce_scatter and all_to_all ``(n-1)/n``; broadcast and reduce ``1``.
* ``#wrong``: elements that differ from the expected result in one verification
  call per row (inputs are small integers, exact in every dtype; summed over
  ranks). A row with wrong elements is not timed, and the run exits with status 1.
* ``copies``: staging buffers mpidist counted per call on this rank (``world.stats``;
  0: the buffers went to the library as they are, as with NCCL or a CUDA-aware MPI;
  the MPI backend over an MPI that is not CUDA-aware stages device arrays through
  host memory).

All operations run out of place except all_reduce, broadcast and reduce, which
mpidist (like torch.distributed) defines in place. Sizes go from ``--min-bytes``
to ``--max-bytes`` (default 8 B to 256 MiB) multiplying by ``--factor`` (2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import numpy as np

OPS = ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]
DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "int32": np.int32, "int64": np.int64}
SKIP_LINE = "skipped: no GPU (cupy/CUDA not available)"


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth correction factor for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n  # all_gather, reduce_scatter, all_to_all


def parse_bytes(text: str) -> int:
    """``'256M'`` -> 268435456 (K, M, G are binary multiples, as nccl-tests' -b/-e)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if mult > 1 else text
    try:
        value = int(number) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 8, 4K, 256M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"byte sizes must be positive, got {text!r}")
    return value


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out = []
    s = lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


# -- arrays: numpy on the host, cupy on the device ------------------------------------------
class Host:
    """Array namespace for --host: numpy, nothing to synchronize."""

    name = "host (numpy)"

    def __init__(self) -> None:
        self.xp = np

    def empty(self, k: int, dtype: Any) -> Any:
        return np.empty(k, dtype)

    def upload(self, dst: Any, src: np.ndarray) -> None:
        dst[...] = src

    def download(self, a: Any) -> np.ndarray:
        return a

    def synchronize(self) -> None:
        pass


class StandIn:
    """Array namespace for --standin: ``mpidist.testing.HostCudaArray``, host memory that mpidist treats as GPU memory."""

    name = "device stand-in (HostCudaArray: host memory through the device path)"

    def __init__(self) -> None:
        from mpidist.testing import HostCudaArray

        self.cls = HostCudaArray

    def empty(self, k: int, dtype: Any) -> Any:
        return self.cls(np.empty(k, dtype))

    def upload(self, dst: Any, src: np.ndarray) -> None:
        dst.host[...] = src

    def download(self, a: Any) -> np.ndarray:
        return a.get()

    def synchronize(self) -> None:
        pass


class Device:
    """Array namespace for the GPU: cupy arrays on the device of this node-local rank."""

    def __init__(self, cupy: Any, local_rank: int) -> None:
        self.cp = cupy
        count = cupy.cuda.runtime.getDeviceCount()
        self.index = local_rank % count
        self.device = cupy.cuda.Device(self.index)
        self.device.use()
        props = cupy.cuda.runtime.getDeviceProperties(self.index)
        name = props.get("name", b"GPU")
        self.name = f"device {self.index} ({name.decode() if isinstance(name, bytes) else name})"

    def empty(self, k: int, dtype: Any) -> Any:
        return self.cp.empty(k, dtype)

    def upload(self, dst: Any, src: np.ndarray) -> None:
        dst.set(src)
        self.synchronize()

    def download(self, a: Any) -> np.ndarray:
        self.synchronize()
        return self.cp.asnumpy(a)

    def synchronize(self) -> None:
        self.device.synchronize()


def find_gpu() -> tuple[Any, str]:
    """Return (cupy, '') if a CUDA device is usable here, else (None, why not)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a cupy built for a CUDA that is missing
        return None, f"{type(exc).__name__}: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        return None, f"{type(exc).__name__}: {exc}"
    if count < 1:
        return None, "no CUDA device visible"
    return cupy, ""


# -- one collective: buffers, call, expected result --------------------------------------------
def pattern(k: int, rank: int, dtype: Any) -> np.ndarray:
    """Rank ``rank``'s input: small integers (exact in every dtype, sums too)."""
    index = np.arange(k, dtype=np.int32 if k < (1 << 28) else np.int64)  # half the memory for most sizes
    return ((index * 7 + 3 * rank) % 11 + rank).astype(dtype)


class Case:
    """Buffers and the call for one collective at one size."""

    def __init__(self, op: str, nbytes: int, n: int, rank: int, dtype: Any, arrays: Any, dist: Any) -> None:
        itemsize = np.dtype(dtype).itemsize
        count = max(1, nbytes // itemsize)
        if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            count = max(n, count - count % n)
        self.op, self.n, self.rank, self.dtype, self.arrays = op, n, rank, dtype, arrays
        self.count = count  # elements of the buffer that defines S
        self.bytes = count * itemsize  # S
        part = count // n
        in_k, out_k = {
            "all_gather_into_tensor": (part, count),
            "reduce_scatter_tensor": (count, part),
            "all_to_all_single": (count, count),
        }.get(op, (count, None))
        self.inp = arrays.empty(in_k, dtype)
        self.out = self.inp if out_k is None else arrays.empty(out_k, dtype)
        inp, out = self.inp, self.out
        self.call: Callable[[], Any] = {
            "all_reduce": lambda: dist.all_reduce(inp),
            "broadcast": lambda: dist.broadcast(inp, 0),
            "reduce": lambda: dist.reduce(inp, 0),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, inp),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, inp),
            "all_to_all_single": lambda: dist.all_to_all_single(out, inp),
        }[op]

    def expected(self) -> np.ndarray | None:
        """This rank's output after the call (None: not defined here, e.g. reduce off the root)."""
        k, n, r, op = self.inp.size, self.n, self.rank, self.op
        ins = [pattern(k, q, self.dtype) for q in range(n)]
        part = self.count // n
        if op == "all_reduce" or (op == "reduce" and r == 0):
            return np.sum(ins, axis=0).astype(self.dtype)
        if op == "reduce":
            return None
        if op == "broadcast":
            return ins[0]
        if op == "all_gather_into_tensor":
            return np.concatenate(ins)
        if op == "reduce_scatter_tensor":
            return np.sum(ins, axis=0).astype(self.dtype)[r * part : (r + 1) * part]
        return np.concatenate([x[r * part : (r + 1) * part] for x in ins])

    def verify(self) -> int:
        """Run the call once on known inputs; return how many output elements are wrong here."""
        self.arrays.upload(self.inp, pattern(self.inp.size, self.rank, self.dtype))
        if self.out is not self.inp:
            self.arrays.upload(self.out, np.zeros(self.out.size, self.dtype))
        self.call()
        want = self.expected()
        if want is None:
            self.arrays.synchronize()
            return 0
        got = self.arrays.download(self.out)
        return int(np.count_nonzero(got != want))


# -- timing ------------------------------------------------------------------------------------
def time_block(fn: Callable[[], Any], iters: int, arrays: Any, comm: Any, mpi_max: Any) -> float:
    """Seconds per call over ``iters`` calls ending with a device synchronize, slowest rank."""
    arrays.synchronize()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    arrays.synchronize()
    elapsed = (time.perf_counter() - start) / iters
    return comm.allreduce(elapsed, op=mpi_max)


def iterations(nbytes: int, requested: int | None) -> int:
    """Calls per timed block: --iters, or about 20 MB of traffic per block (between 5 and 1000 calls)."""
    if requested:
        return requested
    return max(5, min(1000, (20 << 20) // nbytes))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend", help="init_process_group backend (default: 'cpu:mpi,cuda:nccl'; 'mpi' with --host)"
    )
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--host", action="store_true", help="numpy arrays instead of cupy device arrays")
    kind.add_argument(
        "--standin",
        action="store_true",
        help="mpidist.testing.HostCudaArray instead of cupy: mpidist's device path on host memory (tests it without a GPU)",
    )
    parser.add_argument("--ops", nargs="*", default=OPS, choices=OPS)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("-b", "--min-bytes", type=parse_bytes, default=8, help="smallest size S (default 8)")
    parser.add_argument("-e", "--max-bytes", type=parse_bytes, default=256 << 20, help="largest size S (default 256M)")
    parser.add_argument("-f", "--factor", type=int, default=2, help="size multiplier between rows (default 2)")
    parser.add_argument("-n", "--iters", type=int, help="calls per timed block (default: ~20 MB of traffic, 5..1000)")
    parser.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls before each row (default 5)")
    parser.add_argument(
        "--trials", type=int, default=5, help="timed blocks per row; the median is reported (default 5)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="mpidist group timeout in seconds (default 300)")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    args = parser.parse_args()
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")

    from mpi4py import MPI

    world_comm = MPI.COMM_WORLD
    rank, n = world_comm.Get_rank(), world_comm.Get_size()
    arrays: Any
    if args.host:
        arrays = Host()
    elif args.standin:
        arrays = StandIn()
    else:
        cupy, why = find_gpu()
        whys = world_comm.allgather(why)
        if any(whys):
            if rank == 0:
                bad = [r for r, w in enumerate(whys) if w]
                where = "" if len(bad) == n else f" on rank(s) {bad}"
                print(f"{SKIP_LINE}{where} [{next(w for w in whys if w)}]", flush=True)
            return 0
        local_rank = world_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank).Get_rank()
        arrays = Device(cupy, local_rank)  # chosen before init_process_group: a device backend may bind to it

    import mpidist as dist
    from mpidist._world import world

    stats = world.stats  # staging copies (device arrays through host memory), per call in the table

    backend = args.backend or ("mpi" if args.host or args.standin else "cpu:mpi,cuda:nccl")
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=args.timeout))
    except Exception as exc:
        if rank == 0:
            print(f"error: init_process_group(backend={backend!r}) failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    comm = world_comm.Dup()
    dtype = DTYPES[args.dtype]
    if rank == 0:
        print(
            f"# bench_device: {n} ranks, backend {backend!r}, {arrays.name} on rank 0, dtype {args.dtype}, "
            f"median of {args.trials} timed blocks, slowest rank\n"
            "# size S and busbw factor per collective as nccl-tests defines them (see --help)",
            flush=True,
        )
    rows: list[dict[str, Any]] = []
    status = 0
    for op in args.ops:
        if rank == 0:
            print(f"\n# {op} (busbw factor {busbw_factor(op, n):.3g})")
            print(f"# {'size (B)':>12s} {'count':>12s} {'type':>8s} {'time (us)':>11s} "
                  f"{'algbw GB/s':>11s} {'busbw GB/s':>11s} {'#wrong':>7s} {'copies':>7s}", flush=True)  # fmt: skip
        for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
            case = Case(op, nbytes, n, rank, dtype, arrays, dist)
            try:
                wrong, error = case.verify(), ""
            except Exception as exc:  # e.g. a backend without device arrays yet: same on every rank
                wrong, error = 0, f"{type(exc).__name__}: {exc}"
            errors = [e for e in comm.allgather(error) if e]
            wrong = comm.allreduce(wrong)
            if errors:
                if rank == 0:
                    print(
                        f"  {case.bytes:12d} {case.count:12d} {args.dtype:>8s}   unsupported: {errors[0].splitlines()[0]}"
                    )
                status = 1
                break  # the other sizes fail the same way
            row: dict[str, Any] = {"op": op, "bytes": case.bytes, "count": case.count, "dtype": args.dtype,
                                   "ranks": n, "backend": backend, "wrong": wrong}  # fmt: skip
            if wrong:
                status = 1
                if rank == 0:
                    print(f"  {case.bytes:12d} {case.count:12d} {args.dtype:>8s} {'not timed':>11s} "
                          f"{'':>11s} {'':>11s} {wrong:7d}", flush=True)  # fmt: skip
                rows.append(row)
                continue
            iters = iterations(case.bytes, args.iters)
            for _ in range(args.warmup):
                case.call()
            copies_before = stats.copies
            t = statistics.median(time_block(case.call, iters, arrays, comm, MPI.MAX) for _ in range(args.trials))
            copies = (stats.copies - copies_before) / (iters * args.trials)
            algbw = case.bytes / t / 1e9
            busbw = algbw * busbw_factor(op, n)
            row.update(
                time_s=t, iters=iters, trials=args.trials, algbw_gbps=algbw, busbw_gbps=busbw, copies_per_call=copies
            )
            rows.append(row)
            if rank == 0:
                print(f"  {case.bytes:12d} {case.count:12d} {args.dtype:>8s} {t * 1e6:11.2f} "
                      f"{algbw:11.3f} {busbw:11.3f} {wrong:7d} {copies:7.3g}", flush=True)  # fmt: skip
            del case
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if status:
            print("\n# some rows were wrong or unsupported (exit status 1)")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
