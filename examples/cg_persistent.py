"""Conjugate gradient on a distributed 1-D Poisson system, with persistent operations.

Solves A u = b for A = tridiag(-1, 2, -1) (the 1-D Laplacian, symmetric positive
definite) of N unknowns, with b = A u* for the known solution u*_i = t (1 - t) e^t at
t = (i + 1) / (N + 1). Each rank owns a contiguous block of rows. Every iteration needs

* a halo exchange for A p (one value to and from each neighbour): persistent
  ``send_init``/``recv_init`` bound to the ends of the local vector, and
* two dot products: each a persistent ``all_reduce_init`` on a one-element array.

All of them are made once, before the loop, and only started and waited for in
it; the arrays are updated in place, so the operations always see the current
values.

Run:  mpiexec -n 4 python examples/cg_persistent.py [N]      (any number of ranks)
"""

from __future__ import annotations

import contextlib
import sys
import time

import numpy as np

import mpidist as dist


def rows_of(n: int, rank: int, size: int) -> tuple[int, int]:
    """The global rows ``[lo, hi)`` this rank owns: ``n`` rows split as evenly as possible."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def exact(n: int, rows: np.ndarray) -> np.ndarray:
    """The solution u* at global ``rows`` (zero outside 0 .. n-1: the boundary values)."""
    t = (rows + 1) / (n + 1)
    return np.where((rows >= 0) & (rows < n), t * (1 - t) * np.exp(t), 0.0)


def solve(n: int = 200, tol: float = 1e-10, maxiter: int | None = None) -> tuple[np.ndarray, int, float]:
    """Run CG on the default group; return (this rank's block of the solution, iterations, relative residual)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    lo, hi = rows_of(n, rank, size)
    m = hi - lo
    maxiter = maxiter or 2 * n
    left = rank - 1 if rank > 0 and m else None  # neighbours that own rows (Dirichlet zeros beyond the ends)
    right = rank + 1 if hi < n and m else None

    rows = np.arange(lo, hi)
    b = 2 * exact(n, rows) - exact(n, rows - 1) - exact(n, rows + 1)  # b = A u*, this rank's rows
    x = np.zeros(m)
    r = b.copy()  # r = b - A x with x = 0
    pe = np.zeros(m + 2)  # the search direction with one ghost value at each end
    p = pe[1:-1]
    p[...] = r
    ap = np.empty(m)
    dot = np.zeros(1)  # the buffer of both dot products

    with contextlib.ExitStack() as ops:
        # made once, in the same order on every rank (the all_reduce is collective)
        reduce_dot = ops.enter_context(dist.all_reduce_init(dot))
        halo = []
        if left is not None:
            halo += [dist.send_init(pe[1:2], dst=left, tag=1), dist.recv_init(pe[0:1], src=left, tag=2)]
        if right is not None:
            halo += [dist.send_init(pe[-2:-1], dst=right, tag=2), dist.recv_init(pe[-1:], src=right, tag=1)]
        for h in halo:
            ops.enter_context(h)

        def global_dot(a: np.ndarray, b: np.ndarray) -> float:
            dot[0] = a @ b
            reduce_dot.start().wait()
            return float(dot[0])

        def apply_a() -> None:
            """ap = A p, after fetching the neighbours' ends of p into the ghost cells."""
            for h in halo:
                h.start()
            for h in halo:
                h.wait()
            np.subtract(2 * p, pe[:-2], out=ap)
            np.subtract(ap, pe[2:], out=ap)

        rr = global_dot(r, r)
        norm_b = np.sqrt(rr)
        iterations = 0
        while iterations < maxiter and np.sqrt(rr) > tol * norm_b:
            apply_a()
            alpha = rr / global_dot(p, ap)
            x += alpha * p
            r -= alpha * ap
            rr_new = global_dot(r, r)
            p *= rr_new / rr  # p = r + beta p, in place: the halo sends read p's memory
            p += r
            rr = rr_new
            iterations += 1
    return x, iterations, float(np.sqrt(rr) / norm_b)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    x, iterations, residual = solve(n)
    took = time.perf_counter() - start
    lo, hi = rows_of(n, rank, size)
    error = np.zeros(1)
    error[0] = np.max(np.abs(x - exact(n, np.arange(lo, hi))), initial=0.0)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"CG on the 1-D Poisson system, N = {n}, {size} ranks, persistent halo exchange and dot products")
        print(f"iterations: {iterations}")
        print(f"relative residual: {residual:.3e}")
        print(f"max error against the exact solution: {error[0]:.3e}")
        print(f"time: {took * 1e3:.1f} ms ({took / max(iterations, 1) * 1e6:.1f} us per iteration)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
