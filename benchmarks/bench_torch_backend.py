"""torch.distributed on mpidist's backend against mpidist itself, raw mpi4py and gloo, in the same run.

Run:  mpiexec -n 2 python benchmarks/bench_torch_backend.py [--trials 7] [--ddp-steps 3]

Table 1, all_reduce per call (float32, the size each rank contributes):

* ``raw``: ``comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)`` on a numpy array (blocking mpi4py);
* ``mpidist``: ``mpidist.all_reduce(t)`` on a torch tensor;
* ``backend method``: ``ProcessGroupMPIDist.allreduce([t], opts)`` with the options torch's
  blocking call passes: the backend's own share, without torch's Python wrapper;
* ``torch/mpidist``: ``torch.distributed.all_reduce(t)`` on a group of the "mpidist" backend;
* ``torch/gloo``: the same on a gloo group of the same processes (20 times fewer calls a block).

Table 2, DDP (an 8.4M-parameter MLP, batch 64, one torch thread per rank): the
step time (forward + backward, which includes DDP's gradient all-reduce) on each
backend, and the *exposed* communication: step time minus the same step under
``no_sync()`` (no communication). "alone" is one all-reduce of all the gradients
with nothing else running, and overlap is the share of it hidden behind the
backward pass (1 - exposed / alone; not shown for hooks, which send less). PowerSGD rows use torch's hook
(``matrix_approximation_rank=1``), fp16 rows ``fp16_compress_hook``. gloo runs
PowerSGD serialized (each bucket's hook completes before the next bucket's
starts): as torch schedules it, its follow-up all-reduces run on gloo's worker
threads out of bucket order, and the job aborts with "Received data size doesn't
match expected size".

Trials are interleaved (every implementation once per trial, in turn), each a
block of calls started together on all ranks and timed by the slowest rank; the
tables show medians over trials, and ratios are medians of per-trial ratios.
Every all_reduce implementation is checked once against the expected sum first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as tdist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import mpidist
import mpidist.torch  # noqa: F401 - registers the backend

COMM = MPI.COMM_WORLD
SIZES = (8, 4096, 256 << 10, 4 << 20)


def timed(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``fn`` over a block started together, as the slowest rank saw it."""
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return COMM.allreduce(time.perf_counter() - start, op=MPI.MAX) / calls


def calls_for(nbytes: int) -> int:
    return 2000 if nbytes <= 4096 else (200 if nbytes <= 256 << 10 else 30)


def verify(gloo: Any) -> None:
    n, rank = COMM.Get_size(), COMM.Get_rank()
    expected = n * (n + 1) / 2
    a = np.full(4, rank + 1.0, np.float32)
    COMM.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
    checks = {"raw": a}
    for name, call in (
        ("mpidist", mpidist.all_reduce),
        ("torch/mpidist", tdist.all_reduce),
        ("torch/gloo", lambda t: tdist.all_reduce(t, group=gloo)),
    ):
        t = torch.full((4,), rank + 1.0)
        call(t)
        checks[name] = t.numpy()
    bad = [k for k, v in checks.items() if not np.all(v == expected)]
    if any(COMM.allgather(bad)):
        sys.exit(f"wrong all_reduce results from {bad}")


def all_reduce_table(gloo: Any, trials: int) -> list[str]:
    rows = [
        "| size | raw mpi4py | mpidist | backend method | torch/mpidist | torch/gloo | method ÷ mpidist "
        "| torch/mpidist ÷ mpidist | ÷ raw | gloo ÷ torch/mpidist |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pg = tdist.group.WORLD
    sync = tdist.AllreduceOptions()
    sync.asyncOp = False  # what torch.distributed.all_reduce(t) hands the group
    for nbytes in SIZES:
        a = np.ones(max(nbytes // 4, 1), np.float32)
        t = torch.ones(max(nbytes // 4, 1))
        calls = calls_for(nbytes)
        impls = {
            "raw": (lambda a=a: COMM.Allreduce(MPI.IN_PLACE, a, MPI.SUM), calls),
            "mpidist": (lambda t=t: mpidist.all_reduce(t), calls),
            "method": (lambda ts=[t]: pg.allreduce(ts, sync), calls),  # the backend without torch's wrapper
            "torch": (lambda t=t: tdist.all_reduce(t), calls),
            "gloo": (lambda t=t: tdist.all_reduce(t, group=gloo), max(calls // 20, 3)),
        }
        for fn, n in impls.values():  # warm up
            for _ in range(min(n, 20)):
                fn()
        got: dict[str, list[float]] = {k: [] for k in impls}
        names = list(impls)
        for trial in range(trials):
            for k in names[trial % len(names) :] + names[: trial % len(names)]:
                got[k].append(timed(*impls[k]))
        med = {k: statistics.median(v) * 1e6 for k, v in got.items()}

        def ratio(x: str, y: str, got: dict[str, list[float]] = got) -> float:
            return statistics.median(p / q for p, q in zip(got[x], got[y]))

        rows.append(
            f"| {nbytes:,} B | {med['raw']:.2f} us | {med['mpidist']:.2f} us | {med['method']:.2f} us | "
            f"{med['torch']:.2f} us | {med['gloo']:.1f} us | {ratio('method', 'mpidist'):.2f} | "
            f"{ratio('torch', 'mpidist'):.2f} | {ratio('torch', 'raw'):.2f} | {ratio('gloo', 'torch'):.1f} |"
        )
    return rows


def serialized(hook: Callable) -> Callable:
    def run(state, bucket):  # noqa: ANN001 - DDP accepts no annotation but GradBucket here
        fut = hook(state, bucket)
        fut.wait()
        return fut

    return run


def make_ddp(group: Any, hook: str, serialize: bool = False) -> Any:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 1024),
    )  # fmt: skip
    model = torch.nn.parallel.DistributedDataParallel(net, process_group=group)
    if hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powerSGD":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)
        fn = powerSGD_hook.powerSGD_hook
        model.register_comm_hook(state, serialized(fn) if serialize else fn)
    return model


def ddp_table(gloo: Any, trials: int, steps: int) -> list[str]:
    rows = [
        "| DDP hook | step mpidist | step gloo | no-comm step | exposed comm mpidist | exposed comm gloo | ratio "
        "| gradients all-reduced alone, mpidist | overlap mpidist |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if COMM.Get_rank() == 0:
        print("\n".join(rows), flush=True)  # then each row as it is measured
    x = torch.randn(64, 1024)
    for hook in ("none", "fp16", "powerSGD"):
        models = {"mpidist": make_ddp(tdist.group.WORLD, hook), "gloo": make_ddp(gloo, hook, serialize=True)}

        def step(model: Any, sync: bool = True) -> None:
            if sync:
                model(x).sum().backward()
            else:
                with model.no_sync():
                    model(x).sum().backward()

        for m in models.values():
            for _ in range(3):
                step(m)
        impls = {
            "mpidist": lambda m=models["mpidist"]: step(m),
            "gloo": lambda m=models["gloo"]: step(m),
            "nocomm": lambda m=models["mpidist"]: step(m, sync=False),
        }
        grads = torch.zeros(sum(p.numel() for p in models["mpidist"].parameters()))
        impls["alone"] = lambda g=grads: tdist.all_reduce(g)  # the same bytes, nothing else running
        got: dict[str, list[float]] = {k: [] for k in impls}
        for _ in range(trials):
            for k, fn in impls.items():
                got[k].append(timed(fn, steps))
        exposed = {k: [s - n for s, n in zip(got[k], got["nocomm"])] for k in ("mpidist", "gloo")}
        med = {k: statistics.median(v) * 1e3 for k, v in got.items()}
        ex = {k: statistics.median(v) * 1e3 for k, v in exposed.items()}
        rows.append(
            f"| {hook} | {med['mpidist']:.1f} ms | {med['gloo']:.1f} ms | {med['nocomm']:.1f} ms | "
            f"{ex['mpidist']:.1f} ms | {ex['gloo']:.1f} ms | {ex['mpidist'] / ex['gloo']:.2f} | "
            + (
                f"{med['alone']:.1f} ms | {max(0.0, 1 - ex['mpidist'] / med['alone']):.0%} |"
                if hook == "none"
                else "— | — |"
            )
        )
        if COMM.Get_rank() == 0:
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--ddp-steps", type=int, default=3)
    parser.add_argument("--skip-ddp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    tdist.init_process_group("mpidist")
    gloo = tdist.new_group(backend="gloo")
    verify(gloo)
    if COMM.Get_rank() == 0:
        print(f"{COMM.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0]}, torch {torch.__version__}")
    rows = all_reduce_table(gloo, args.trials)
    if COMM.Get_rank() == 0:
        print("\n".join(rows) + "\n", flush=True)
    if not args.skip_ddp:
        ddp_table(gloo, args.trials, args.ddp_steps)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
