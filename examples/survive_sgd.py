"""Data-parallel SGD that goes on after a rank is killed, and ends on the same parameters as a reference.

    mpidistrun --with-ft --nproc-per-node 4 examples/survive_sgd.py --kill-rank 2 --kill-step 7
    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/survive_sgd.py --kill-rank 2 --kill-step 7
    python examples/survive_sgd.py --reference --world 4 --kill-step 7   # the reference alone, one process

Linear regression in numpy on a fixed synthetic dataset, sharded with ``mpidist.DistributedSampler``;
every step averages the ranks' gradients with ``all_reduce(g, op=ReduceOp.AVG)``. At ``--kill-step``
the rank ``--kill-rank`` SIGKILLs itself just before its all_reduce. The recovery pattern:

1. keep a copy of the parameters after the last step every rank completed (``synced``);
2. the survivors' all_reduce raises ``ProcessFailedError`` (Open MPI's ULFM, within the detector's time);
3. ``shrink_group(exc.failed_group_ranks)`` makes the survivors the world (ranks renumber 0..n-2);
4. restore ``synced``, shard the epoch in progress anew over the new world (same epoch, same batch
   index), redo the failed step and finish.

Each survivor prints ``RESULT old= new= size= steps= params= loss= ref_equal= detect= recover=``;
``ref_equal`` compares the parameters bit for bit with a single-process run that simulates every rank
(``world`` ranks before the kill step, one fewer from it on). Bitwise equality holds because every sum
is exact: the data are small integers, the batch and learning rate powers of two, and the parameters
are kept on a grid of 2**-20 (fixed point), so each rank's gradient is a multiple of 2**-22 below 2**6
(under 28 significant bits; the reference checks each one) and the all-reduce adds them without
rounding in any order; only AVG's division by the world size rounds, once, as the reference's does. ``detect``: seconds from entering the failed
all_reduce to the error; ``recover``: from the error to the redone step's end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import numpy as np

import mpidist as dist

N, D, B = 96, 8, 4  # samples, features, batch per rank (a power of two: dividing by it is exact)
SEED = 7
LR = 2.0**-6
GRID = 2.0**-20  # the parameters' fixed-point grid


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """A regression problem of small integers (exactly representable, every product exact)."""
    rng = np.random.default_rng(SEED)
    x = rng.integers(-3, 4, size=(N, D)).astype(np.float64)
    w_true = rng.integers(-4, 5, size=D).astype(np.float64)
    y = x @ w_true + rng.integers(-2, 3, size=N)
    return x, y


def local_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray, idx: list[int]) -> np.ndarray:
    """Gradient of the batch's mean of ``(x w - y)**2 / 2``."""
    xb, yb = x[idx], y[idx]
    return xb.T @ (xb @ w - yb) / len(idx)


def update(w: np.ndarray, g: np.ndarray) -> np.ndarray:
    """One SGD step, rounded to the parameters' grid."""
    return np.round((w - LR * g) / GRID) * GRID


def loss(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((x @ w - y) ** 2) / 2)


def digest(w: np.ndarray) -> str:
    return hashlib.sha256(w.tobytes()).hexdigest()[:16]


def check_exact(g: np.ndarray) -> None:
    """Raise unless ``g`` is a multiple of GRID / B below 2**45: sums of a few such numbers are exact."""
    scaled = g * (B / GRID)
    if not (np.array_equal(scaled, np.round(scaled)) and np.abs(scaled).max(initial=0) < 2.0**45):
        raise AssertionError(f"a gradient is not an exact dyadic number of the grid: {g!r}")


def reference(world: int, kill_step: int, steps: int) -> np.ndarray:
    """The same training in one process: every rank's gradient computed here, ``world - 1`` ranks from ``kill_step``."""
    x, y = make_data()
    w = np.zeros(D)
    n, step, epoch, j = world, 0, 0, 0
    while step < steps:
        orders = []
        for r in range(n):
            sampler = dist.DistributedSampler(range(N), num_replicas=n, rank=r, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        per_epoch = len(orders[0]) // B
        while j < per_epoch and step < steps:
            if step == kill_step and n == world:
                n -= 1  # the world shrinks: the same epoch and batch index, sharded anew
                break
            grads = [local_grad(w, x, y, order[j * B : (j + 1) * B]) for order in orders]
            for g in grads:
                check_exact(g)
            w = update(w, np.sum(grads, axis=0) / n)  # an exact sum, then AVG's one rounding
            step, j = step + 1, j + 1
        else:
            epoch, j = epoch + 1, 0
    return w


def train(kill_rank: int, kill_step: int, steps: int) -> None:
    dist.init_process_group(timeout=60)
    old, world = dist.get_rank(), dist.get_world_size()
    x, y = make_data()
    w = np.zeros(D)
    synced = w.copy()  # the parameters after the last step every rank completed
    failed = False
    detect = recover = t_error = 0.0
    step, epoch, j = 0, 0, 0
    while step < steps:
        sampler = dist.DistributedSampler(range(N), num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                          shuffle=True, seed=SEED)  # fmt: skip
        sampler.set_epoch(epoch)
        order = list(sampler)
        per_epoch = len(order) // B
        while j < per_epoch and step < steps:
            g = local_grad(w, x, y, order[j * B : (j + 1) * B])
            if step == kill_step and old == kill_rank and not failed:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of the step
            t0 = time.monotonic()
            try:
                dist.all_reduce(g, op=dist.ReduceOp.AVG)
            except dist.ProcessFailedError as exc:
                t_error = time.monotonic()
                detect, failed = t_error - t0, True
                dist.shrink_group(exc.failed_group_ranks)  # the survivors become the world
                w = synced.copy()
                break  # shard the same epoch anew over the new world, redo step j
            w = update(w, g)
            synced = w.copy()
            if step == kill_step and failed:
                recover = time.monotonic() - t_error
            step, j = step + 1, j + 1
        else:
            epoch, j = epoch + 1, 0
    ref = reference(world, kill_step if failed else -1, steps)
    print(
        f"RESULT old={old} new={dist.get_rank()} size={dist.get_world_size()} steps={step} params={digest(w)} "
        f"loss={loss(w, x, y):.6g} ref_equal={np.array_equal(w, ref)} detect={detect:.3f} recover={recover:.3f}",
        flush=True,
    )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kill-rank", type=int, default=2, help="the rank that kills itself (default 2)")
    p.add_argument("--kill-step", type=int, default=7, help="the step it dies in; -1: none (default 7)")
    p.add_argument("--steps", type=int, default=30, help="steps in all (default 30)")
    p.add_argument("--reference", action="store_true", help="print the single-process reference only")
    p.add_argument("--world", type=int, default=4, help="with --reference: the world size before the kill")
    a = p.parse_args()
    if a.reference:
        x, y = make_data()
        w = reference(a.world, a.kill_step, a.steps)
        print(f"REFERENCE size={a.world - (0 <= a.kill_step < a.steps)} steps={a.steps} params={digest(w)} "
              f"loss={loss(w, x, y):.6g}")  # fmt: skip
    else:
        train(a.kill_rank, a.kill_step, a.steps)


if __name__ == "__main__":
    main()
