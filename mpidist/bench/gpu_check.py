"""``python -m mpidist.bench --gpu-check``: mpidist's GPU paths on a real GPU, PASS/FAIL lines (issue 34).

One command, under 8 minutes on a single GPU. It runs each part below as its own
job (``mpiexec -n 1`` or ``-n 2``, a time limit each) and prints one line per check:

* ``nccl``: every dtype and ReduceOp through NCCL at 1 rank (all_reduce against
  numpy; a refused combination must raise the documented TypeError/ValueError),
  broadcast, all_gather_into_tensor, reduce_scatter_tensor;
* ``mpi-staged``, ``mpi-cuda-aware``: cupy arrays over the MPI backend at 2 ranks
  on one GPU, staged through host memory and (if the MPI library is CUDA-aware)
  CUDA-aware, small and from the shared-memory threshold;
* ``streams``: Work.wait orders the current stream (finding 2): a call issued on a
  side stream, waited for on another, read there;
* ``oom``: a temporary that cannot be allocated raises DistBackendError and
  breaks the group (finding 5);
* ``two-on-one``: two ranks on one GPU get the clear error on both (finding 4);
* ``graph``: an all_reduce captured in a ``torch.cuda.graph`` and replayed (needs
  torch with CUDA).

Exit status: 0 if every check passed, 1 if one failed, 3 if it cannot run here
(no cupy, no CUDA device, no mpiexec): it says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

__all__ = ["main", "NO_GPU", "PARTS"]

#: the exit status when there is no GPU to check (argparse's errors are 2)
NO_GPU = 3
#: part -> (ranks, time limit in seconds, environment)
PARTS: dict[str, tuple[int, int, dict[str, str]]] = {
    "nccl": (1, 120, {}),
    "mpi-staged": (2, 60, {"MPIDIST_CUDA_AWARE": "0", "MPIDIST_DEVICE_STAGING": "quiet"}),
    "mpi-cuda-aware": (2, 60, {"MPIDIST_DEVICE_STAGING": "quiet"}),
    "streams": (1, 40, {}),
    "oom": (1, 40, {}),
    "two-on-one": (2, 60, {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}),
    "graph": (1, 60, {}),
}


def why_not_here() -> str:
    """Why the check cannot run on this machine ('' if it can)."""
    try:
        import cupy
    except ImportError as exc:
        return f"cupy is not installed ({exc}); pip install 'mpidist[gpu]' on a machine with a GPU"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device: said as it is
        return f"no CUDA device is usable: {type(exc).__name__}: {exc}"
    if count < 1:
        return "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"
    if _mpiexec() is None:
        return "no mpiexec found next to this Python or on PATH"
    return ""


def _mpiexec() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def main(argv: list[str]) -> int:
    """Run the check (``argv``: nothing, or ``--part NAME`` inside a job); return the exit status."""
    if argv[:1] == ["--part"] and len(argv) == 2:
        return _run_part(argv[1])
    why = why_not_here()
    if why:
        print(f"gpu-check: cannot run here: {why}", flush=True)
        return NO_GPU
    runner = [_mpiexec() or "mpiexec"]
    if "Open MPI" in subprocess.run([runner[0], "--version"], capture_output=True, text=True).stdout:
        runner += ["--oversubscribe", "--allow-run-as-root"]
    failed = 0
    start = time.monotonic()
    for name, (ranks, limit, env) in PARTS.items():
        cmd = [*runner, "-n", str(ranks), sys.executable, "-m", "mpidist.bench", "--gpu-check", "--part", name]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env={**os.environ, **env})
            text, rc = out.stdout + out.stderr, out.returncode
        except subprocess.TimeoutExpired as exc:
            text, rc = f"{exc.stdout or ''}\nFAIL {name}: did not finish within {limit} s (hung)", 1
        lines = [ln for ln in str(text).splitlines() if ln.startswith(("PASS", "FAIL", "SKIP"))]
        if rc != 0 and not any(ln.startswith("FAIL") for ln in lines):
            lines.append(f"FAIL {name}: exit status {rc}: {str(text).strip()[-800:]}")
        for ln in dict.fromkeys(lines):  # each rank prints: once per distinct line
            print(ln, flush=True)
        failed += sum(ln.startswith("FAIL") for ln in dict.fromkeys(lines))
    print(f"gpu-check: {'FAIL' if failed else 'PASS'} ({failed} failed) in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


# -- the parts (each runs inside its own mpiexec job) ----------------------------------------------


class _Report:
    def __init__(self, part: str) -> None:
        self.part, self.failed = part, 0

    def check(self, what: str, fn: Callable[[], str | None]) -> None:
        """Run ``fn``: None or '' is PASS, a string starting with 'SKIP' is SKIP, other text FAIL."""
        try:
            problem = fn()
        except Exception as exc:  # noqa: BLE001 - a check that raised failed
            problem = f"raised {type(exc).__name__}: {exc}"
        if not problem:
            print(f"PASS {self.part}: {what}", flush=True)
        elif problem.startswith("SKIP"):
            print(f"SKIP {self.part}: {what}: {problem[4:].strip()}", flush=True)
        else:
            self.failed += 1
            print(f"FAIL {self.part}: {what}: {problem}", flush=True)


def _run_part(name: str) -> int:
    import cupy as cp
    from mpi4py import MPI

    import mpidist as dist

    rank = MPI.COMM_WORLD.Get_rank()
    cp.cuda.Device(0).use()  # one GPU for every rank (the check runs on a single GPU)
    rep = _Report(name)
    part = {
        "nccl": _nccl,
        "mpi-staged": _mpi,
        "mpi-cuda-aware": _mpi,
        "streams": _streams,
        "oom": _oom,
        "two-on-one": _two_on_one,
        "graph": _graph,
    }[name]
    try:
        part(rep, dist, cp, rank)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001
                print(f"FAIL {name}: destroy_process_group raised {exc!r}", flush=True)
                rep.failed += 1
    return 1 if rep.failed else 0


def _nccl(rep: _Report, dist: Any, cp: Any, rank: int) -> None:
    dist.init_process_group(backend="cpu:mpi,cuda:nccl")
    red = dist.ReduceOp
    premul = dist.make_premul_sum(2.0)
    dtypes = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
              np.float16, np.float32, np.float64, np.complex64, np.complex128]  # fmt: skip
    ops = [red.SUM, red.PRODUCT, red.MIN, red.MAX, red.AVG, red.BAND, red.BOR, red.BXOR, premul]
    for dt in map(np.dtype, dtypes):
        host = np.arange(8) % 2 == 0 if dt.kind == "b" else (np.arange(1, 9) % 3).astype(dt)
        for op in ops:

            def one(dt: np.dtype = dt, op: Any = op, host: np.ndarray = host) -> str | None:
                x = cp.asarray(host)
                try:
                    dist.all_reduce(x, op=op)
                except (TypeError, ValueError) as exc:
                    return f"SKIP refused as documented: {exc}"
                got = cp.asnumpy(x)
                want = (host * 2).astype(dt) if op is premul else host  # one rank: the input (AVG: / 1)
                return None if np.array_equal(got, want) else f"got {got[:4]}, expected {want[:4]}"

            rep.check(f"all_reduce {dt.name} {'PREMUL_SUM' if op is premul else op.name}", one)
    rep.check("all_reduce bfloat16", lambda: "SKIP cupy has no bfloat16 arrays (torch tensors take that path)")
    x = cp.arange(16, dtype=cp.float32)

    def bcast() -> str | None:
        y = x.copy()
        dist.broadcast(y, 0)
        return None if bool((y == x).all()) else "broadcast changed the data"

    def gather() -> str | None:
        out = cp.empty(16, cp.float32)
        dist.all_gather_into_tensor(out, x)
        return None if bool((out == x).all()) else f"got {out[:4]}"

    def scatter() -> str | None:
        out = cp.empty(16, cp.float32)
        dist.reduce_scatter_tensor(out, x)
        return None if bool((out == x).all()) else f"got {out[:4]}"

    rep.check("broadcast float32", bcast)
    rep.check("all_gather_into_tensor float32", gather)
    rep.check("reduce_scatter_tensor float32", scatter)


def _mpi(rep: _Report, dist: Any, cp: Any, rank: int) -> None:
    from ..arrays.device import mpi_cuda_aware

    dist.init_process_group(backend="mpi")
    n = dist.get_world_size()
    if rep.part == "mpi-cuda-aware" and not mpi_cuda_aware():
        rep.check("CUDA-aware MPI", lambda: "SKIP the MPI library is not CUDA-aware (MPIX_Query_cuda_support)")
        return
    for count in (4, 1 << 18):
        x = cp.full(count, rank + 1, cp.float32)

        def red(x: Any = x) -> str | None:
            dist.all_reduce(x)
            return None if bool((x == n * (n + 1) / 2).all()) else f"got {x[:4]}"

        def bc(count: int = count) -> str | None:
            y = cp.full(count, rank, cp.int32)
            dist.broadcast(y, 0)
            return None if bool((y == 0).all()) else f"got {y[:4]}"

        def lst(count: int = count) -> str | None:
            outs = [cp.empty(count, cp.float32) for _ in range(n)]
            dist.all_gather(outs, cp.full(count, rank, cp.float32))
            return None if all(bool((o == r).all()) for r, o in enumerate(outs)) else "wrong blocks"

        rep.check(f"all_reduce {count * 4} bytes", red)
        rep.check(f"broadcast {count * 4} bytes", bc)
        rep.check(f"all_gather list {count * 4} bytes", lst)


def _streams(rep: _Report, dist: Any, cp: Any, rank: int) -> None:
    dist.init_process_group(backend="cpu:mpi,cuda:nccl")

    def ordered() -> str | None:
        side, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        with side:
            x = cp.ones(1 << 22, cp.float32)
            cp.cuda.Device().synchronize()
            x *= 3  # produced on the side stream
            work = dist.all_reduce(x, async_op=True)
        with other:
            work.wait()  # orders `other`, the stream current now
            y = x * 1  # on `other`: must see the result
            got = float(y[-1].get())
        return None if got == 3.0 else f"read {got} on the waiting stream, expected 3.0"

    rep.check("wait() orders the current stream", ordered)


def _oom(rep: _Report, dist: Any, cp: Any, rank: int) -> None:
    dist.init_process_group(backend="cpu:mpi,cuda:nccl")
    pool = cp.get_default_memory_pool()

    def oom() -> str | None:
        out = cp.empty(1 << 20, cp.float32)
        inp = out[1 : (1 << 20) // dist.get_world_size() + 1]  # overlaps the output: a temporary copy
        pool.set_limit(size=pool.used_bytes() + 1024)
        try:
            dist.all_gather_into_tensor(out, inp)
            return "no error though the temporary could not be allocated"
        except dist.DistBackendError:
            pass
        finally:
            pool.set_limit(size=0)
        try:
            dist.all_reduce(cp.ones(4, cp.float32))
            return "the group still takes calls after the failure"
        except dist.DistBackendError:
            return None

    rep.check("out of memory raises DistBackendError and breaks the group", oom)


def _two_on_one(rep: _Report, dist: Any, cp: Any, rank: int) -> None:
    def refused() -> str | None:
        try:
            dist.init_process_group(backend="cpu:mpi,cuda:nccl")
        except dist.DistBackendError as exc:
            return None if "cuda:0" in str(exc) and "ranks [0, 1]" in str(exc) else f"unclear error: {exc}"
        return "two ranks on one GPU were accepted"

    rep.check("two ranks on one GPU: the clear error on every rank", refused)


def _graph(rep: _Report, dist: Any, cp: Any, rank: int) -> None:
    try:
        import torch
    except ImportError:
        rep.check("torch.cuda.graph", lambda: "SKIP torch is not installed")
        return
    if not torch.cuda.is_available():
        rep.check("torch.cuda.graph", lambda: "SKIP this torch has no CUDA")
        return
    torch.cuda.set_device(0)
    dist.init_process_group(backend="cpu:mpi,cuda:nccl")

    def captured() -> str | None:
        x = torch.ones(1024, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dist.all_reduce(x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dist.all_reduce(x)
        x.fill_(2.0)
        g.replay()
        torch.cuda.synchronize()
        want = 2.0 * dist.get_world_size()
        return None if float(x[0]) == want else f"replay gave {float(x[0])}, expected {want}"

    rep.check("all_reduce captured in torch.cuda.graph and replayed", captured)
