"""``python -m mpidist.bench --tune``: measure from which size shared memory beats MPI's own calls; write the table.

For each collective of the MPI backend's shared-memory path and each size from -b to -e
(x2), the same call runs on two groups of the whole job, batches interleaved as in the
bench: one whose path takes every size from ``SETUP_FLOOR`` on, one with the path off
(``MPIDIST_SHM=0``, MPI's calls). A size is faster through shared memory where the median
of the paired per-trial ratios is at most :data:`WIN`; the range is the longest run of
consecutive faster sizes (open above if it reaches the largest size measured); none: the
path stays off for that collective. Rank 0 writes them into
``shm_tuning.tune_file()`` for this MPI library and this number of ranks on the node,
where every later job on this library reads them as a prior: in those ranges the
groups' own measuring (``backends/shm_choice.py``) takes shared memory where it is as
fast as MPI's call, instead of 10% faster (``MPIDIST_SHM_THRESHOLDS`` still wins).

Example::

    mpiexec -n 2 python -m mpidist.bench --tune              # 16 KiB .. 64 MiB
    mpiexec -n 4 python -m mpidist.bench --tune -b 64K -e 16M
"""

from __future__ import annotations

import os
from typing import Any, Callable, TextIO

import numpy as np
from mpi4py import MPI

from ..backends import shm_tuning
from .timing import format_bytes, time_run

__all__ = ["tune", "WIN", "best_range", "group_under"]

#: a size counts as faster through shared memory at this median ratio (shared memory / MPI) or below
WIN = 0.97


def group_under(dist: Any, env: dict[str, str], **kwargs: Any) -> Any:
    """A new group of the whole job (``new_group(**kwargs)``) whose shared-memory path is set up under the
    environment variables ``env`` (restored afterwards); every rank calls it. The tests use it too."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        g = dist.new_group(**kwargs)
        dist.broadcast(np.zeros(shm_tuning.SETUP_FLOOR, np.uint8), src=0, group=g)  # sets the path up
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return g


def _filled(count: int) -> np.ndarray:
    """An array of ones: written memory (an untouched np.zeros array reads the kernel's shared zero page,
    which is always in the cache and makes every copy out of it look several times faster)."""
    return np.ones(count, np.float32)


def _call(dist: Any, name: str, nbytes: int, n: int) -> Callable[[Any], None]:
    """One call of collective ``name`` on ``nbytes`` (the size its threshold measures), on a given group."""
    count = nbytes // 4
    if name == "all_reduce":
        x = _filled(count)
        return lambda g: dist.all_reduce(x, group=g, op=dist.ReduceOp.MAX)  # MAX: the values stay ones
    if name == "broadcast":
        x = _filled(count)
        return lambda g: dist.broadcast(x, src=0, group=g)
    if name == "reduce":
        x = _filled(count)
        return lambda g: dist.reduce(x, dst=0, group=g, op=dist.ReduceOp.MAX)
    big, small = _filled(count // n * n), _filled(count // n)
    if name == "all_gather_into_tensor":
        return lambda g: dist.all_gather_into_tensor(big, small, group=g)
    return lambda g: dist.reduce_scatter_tensor(small, big, group=g, op=dist.ReduceOp.MAX)


def best_range(ratios: list[tuple[int, float]]) -> shm_tuning.Range:
    """The longest run of consecutive sizes whose ratio is at most :data:`WIN` (the larger sizes on a tie);
    open above where it reaches the largest size; ``(NEVER, NEVER)`` where no size is faster."""
    ratios = sorted(ratios)
    best: tuple[int, int] | None = None  # (start, end) indexes
    start = None
    for i, (_, ratio) in enumerate(ratios + [(0, float("inf"))]):
        if ratio <= WIN and start is None:
            start = i
        elif ratio > WIN and start is not None:
            if best is None or i - 1 - start >= best[1] - best[0]:
                best = (start, i - 1)
            start = None
    if best is None:
        return (shm_tuning.NEVER, shm_tuning.NEVER)
    high = shm_tuning.NEVER if best[1] == len(ratios) - 1 else ratios[best[1]][0]
    return (ratios[best[0]][0], high)


def tune(dist: Any, sizes: list[int], trials: int, out: TextIO) -> int:
    """Measure every collective at ``sizes`` on both paths; rank 0 prints and writes the table. Exit status."""
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    say = (lambda text: print(text, file=out, flush=True)) if rank == 0 else (lambda text: None)
    every = ",".join(f"{c}={shm_tuning.SETUP_FLOOR}" for c in shm_tuning.COLLECTIVES)
    on = group_under(dist, {shm_tuning.ENV_THRESHOLDS: every})
    off = group_under(dist, {shm_tuning.ENV_SWITCH: "0"})
    from ..testing import backend_of

    path = backend_of(on).shared_memory()
    if path is None or path.way != shm_tuning.SHARED:
        say("# --tune: this job has no shared-memory path (one rank, ranks on several nodes, MPIDIST_SHM=0,")
        say("# or a rank without POSIX shared memory): nothing to tune")
        return 1
    sizes = [s for s in sizes if s >= shm_tuning.SETUP_FLOOR]
    library = MPI.Get_library_version().splitlines()[0]
    say(f"# mpidist.bench --tune: {n} ranks on one node; {library}")
    say(f"# per size: median over {trials} interleaved trials of (shared memory / MPI's call); faster: <= {WIN}")
    table: dict[str, dict[int, shm_tuning.Range]] = {}
    for name in shm_tuning.COLLECTIVES:
        ratios = []
        for nbytes in sizes:
            call = _call(dist, name, nbytes, n)
            iters = max(5, min(200, (64 << 20) // nbytes))
            calls = {"shm": lambda c=call: c(on), "mpi": lambda c=call: c(off)}
            batches = time_run(calls, iters, 2, trials, comm, comm.Barrier)
            ratio = float(np.median(np.array(batches["shm"]) / np.array(batches["mpi"])))
            ratios.append((nbytes, ratio))
        low, high = found = best_range(ratios)
        table[name] = {n: found}
        cells = "  ".join(f"{format_bytes(b)}:{r:.2f}" for b, r in ratios)
        where = "never" if low >= shm_tuning.NEVER else format_bytes(low) + ("-" if high < shm_tuning.NEVER else "+")
        where += format_bytes(high) if high < shm_tuning.NEVER else ""
        say(f"{name:24} {where:>16}   {cells}")
    if rank == 0:
        path = shm_tuning.write_table(library, table)
        say(f"# written to {path} (MPIDIST_SHM_TUNE_FILE to choose another file)")
    for g in (on, off):
        dist.destroy_process_group(g)
    return 0
