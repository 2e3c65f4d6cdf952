"""Timing the cases and reporting them: interleaved batches, the table, ``--json`` and ``--plot``.

Definitions (nccl-tests' ``doc/PERFORMANCE.md``; OSU's micro-benchmarks for the timing):

* A **batch** is ``iters`` back-to-back iterations of one implementation. Every rank
  runs the same batches; a barrier (raw MPI, untimed) starts each one, and each
  rank times its own batch, ending with a device synchronize for GPU arrays.
* **Interleaved trials**: each trial runs one mpidist batch and one raw mpi4py
  batch, in alternating order (mpidist first in even trials, raw first in odd).
* A trial's **time** is the slowest rank's batch time divided by the messages in it
  (``iters``, or ``iters x 2`` for a ping-pong, ``iters x window`` for the bandwidth
  window). The table shows the **median over trials**.
* ``algbw = S / time`` and ``busbw = algbw x factor`` in GB/s (10^9 bytes per second).
* ``mpidist/raw`` is the median over trials of the paired ratio (mpidist's batch over
  the raw batch of the same trial), which cancels most drift of a shared machine.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, TextIO

import numpy as np
from mpi4py import MPI

__all__ = ["Row", "time_run", "Table", "write_json", "write_plot", "format_bytes"]

IMPLS = ("mpidist", "raw")


def _batch(fn: Callable[[], Any], iters: int, comm: MPI.Comm, sync: Callable[[], None]) -> float:
    """This rank's seconds for ``iters`` calls of ``fn``, started together on every rank."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return time.perf_counter() - start


def time_run(
    calls: dict[str, Callable[[], Any]],
    iters: int,
    warmup: int,
    trials: int,
    comm: MPI.Comm,
    sync: Callable[[], None],
) -> dict[str, list[float]]:
    """Run ``trials`` interleaved trials of every implementation in ``calls``; seconds per batch, slowest rank.

    Every rank must call this with the same implementations and counts.
    """
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    sync()
    local = np.zeros((len(names), trials))
    for t in range(trials):
        order = names if t % 2 == 0 else names[::-1]
        for name in order:
            local[names.index(name), t] = _batch(calls[name], iters, comm, sync)
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)  # the slowest rank's time of each batch
    return {name: local[i].tolist() for i, name in enumerate(names)}


@dataclass
class Row:
    """One line of the table (and one entry of ``--json``); times are seconds per message."""

    collective: str
    bytes: int
    count: int
    dtype: str
    op: str  # "-" for a case without a reduction
    root: int | None
    busbw_factor: float
    iters: int
    messages_per_iter: int
    mpidist_s: float | None = None
    raw_s: float | None = None
    ratio: float | None = None  # median of the paired per-trial ratios mpidist/raw
    wrong_mpidist: int | None = None  # None: not checked
    wrong_raw: int | None = None
    note: str = ""  # why a column is empty (raw mpi4py cannot run it, mpidist refused it)
    mpidist_trials_s: list[float] = field(default_factory=list)
    raw_trials_s: list[float] = field(default_factory=list)

    def set_times(self, batches: dict[str, list[float]]) -> None:
        per = self.iters * self.messages_per_iter
        self.mpidist_trials_s = [b / per for b in batches["mpidist"]]
        self.mpidist_s = statistics.median(self.mpidist_trials_s)
        if "raw" in batches:
            self.raw_trials_s = [b / per for b in batches["raw"]]
            self.raw_s = statistics.median(self.raw_trials_s)
            self.ratio = statistics.median(a / b for a, b in zip(batches["mpidist"], batches["raw"]))

    def algbw(self, seconds: float | None) -> float | None:
        """GB/s; None without a time or without bytes (barrier)."""
        if seconds is None or not self.bytes:
            return None
        return self.bytes / seconds / 1e9

    def busbw(self, seconds: float | None) -> float | None:
        bw = self.algbw(seconds)
        return None if bw is None else bw * self.busbw_factor

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        for impl, seconds in (("mpidist", self.mpidist_s), ("raw", self.raw_s)):
            out[f"{impl}_time_us"] = None if seconds is None else seconds * 1e6
            out[f"{impl}_algbw_gbps"] = self.algbw(seconds)
            out[f"{impl}_busbw_gbps"] = self.busbw(seconds)
        return out


def format_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


# -- the table ---------------------------------------------------------------------------------
#: (title, width) of each column; the time/algbw/busbw/#wrong group repeats for mpidist and raw
_LEFT = (("size", 12), ("count", 12), ("type", 9), ("redop", 6), ("root", 5))
_GROUP = (("time", 10), ("algbw", 8), ("busbw", 8), ("#wrong", 7))
_UNITS = {"size": "(B)", "count": "(elements)", "time": "(us)", "algbw": "(GB/s)", "busbw": "(GB/s)"}
RATIO = ("mpidist/raw", 12)
#: the column names of a data line, in order (what a program reading the table splits on)
COLUMNS = [t for t, _ in _LEFT] + [f"mpidist_{t}" for t, _ in _GROUP] + [f"raw_{t}" for t, _ in _GROUP] + ["ratio"]


def _num(value: float | None, width: int, digits: int = 2) -> str:
    return ("n/a" if value is None else f"{value:.{digits}f}").rjust(width)


class Table:
    """Prints the nccl-tests-style table, one section per collective (rank 0 only)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def section(self, name: str, summary: str, factor_text: str, factor: float) -> None:
        self.say()
        busbw = f"busbw = algbw x {factor_text} = {factor:.4g}" if factor_text != "-" else "time only"
        self.say(f"# {name}: {summary}; {busbw}")
        left = sum(w for _, w in _LEFT) + len(_LEFT) - 1
        group = sum(w for _, w in _GROUP) + len(_GROUP) - 1
        self.say(("#" + " " * (left - 1) + " " + "mpidist".center(group) + " " + "raw mpi4py".center(group)).rstrip())
        titles = [t.rjust(w) for t, w in _LEFT] + [t.rjust(w) for t, w in _GROUP] * 2 + [RATIO[0].rjust(RATIO[1])]
        units = [_UNITS.get(t, "").rjust(w) for t, w in _LEFT] + [_UNITS.get(t, "").rjust(w) for t, w in _GROUP] * 2
        self.say("#" + " ".join(titles)[1:])
        self.say(("#" + " ".join(units)[1:]).rstrip())

    def row(self, row: Row) -> None:
        cells = [
            str(row.bytes).rjust(12),
            str(row.count).rjust(12),
            (row.dtype if row.bytes else "-").rjust(9),
            row.op.rjust(6),
            ("-" if row.root is None else str(row.root)).rjust(5),
        ]
        for seconds, wrong in ((row.mpidist_s, row.wrong_mpidist), (row.raw_s, row.wrong_raw)):
            cells += [
                _num(None if seconds is None else seconds * 1e6, 10),
                _num(row.algbw(seconds), 8),
                _num(row.busbw(seconds), 8),
                ("N/A" if wrong is None else str(wrong)).rjust(7),
            ]
        cells.append(_num(row.ratio, RATIO[1]))
        self.say(" ".join(cells))

    def note(self, text: str) -> None:
        self.say(f"#   {text}")


# -- files ---------------------------------------------------------------------------------------
def write_json(path: str, meta: dict[str, Any], rows: list[Row]) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "columns": COLUMNS, "rows": [r.as_json() for r in rows]}, f, indent=1)
        f.write("\n")


def write_plot(path: str, meta: dict[str, Any], rows: list[Row]) -> None:
    """busbw against size, one panel per collective: mpidist solid, raw mpi4py dashed (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in dict.fromkeys(r.collective for r in rows) if any(r.bytes for r in rows if r.collective == n)]
    if not names:
        names = ["(no sized rows)"]
    cols = min(3, len(names))
    lines = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(lines, cols, figsize=(5 * cols, 3.6 * lines), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        mine = [r for r in rows if r.collective == name and r.bytes]
        for impl, style in (("mpidist", "-o"), ("raw mpi4py", "--s")):
            pts = [(r.bytes, r.busbw(r.mpidist_s if impl == "mpidist" else r.raw_s)) for r in mine]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=impl, markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("size S (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"mpidist.bench: {meta['ranks']} ranks, backend {meta['backend']}, {meta['device']}, {meta['dtype']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
