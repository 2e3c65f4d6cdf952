"""Startup cost: from starting a 2-process job to its first completed collective.

Run:  python benchmarks/bench_startup.py [--trials 5] [--procs 2]

Each way of starting is a fresh job of ``--procs`` processes that imports its
library, initializes the default group and completes one all_reduce; the time is
from just before the job is started (launcher included) to the moment the last
process has its result (each process prints ``time.time()`` when done). Rows
(the program imports torch in every row but the first, as a torch program does):

* mpidist, numpy only, under mpiexec;
* mpidist (``import mpidist as dist``, ``backend="gloo"``) under mpiexec,
  launcher-free (plain processes, env://; without and with ``MPIDIST_SECRET``, the
  proofs of membership of docs/security.md) and torchrun ``--standalone``;
* torch's gloo (``import torch.distributed as dist``) under torchrun ``--standalone``
  and as plain processes with env://.

Trials are interleaved (every way once per trial); the table shows medians and
each row's ratio to gloo under torchrun.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: each process writes the moment it has its result into a file of its own (output lines of
#: processes under one launcher interleave)
STAMP = (
    "import os\n"
    "def stamp(t):\n"
    "    open(os.path.join(os.environ['STARTUP_DIR'], str(os.getpid())), 'w').write(repr(t))\n"
)
PROGRAMS = {
    "numpy": (
        STAMP + "import time, numpy as np\nimport mpidist as dist\n"
        "dist.init_process_group()\nx = np.ones(1)\ndist.all_reduce(x)\n"
        "stamp(time.time())\ndist.destroy_process_group()\n"
    ),
    "mpidist": (
        STAMP + "import time, torch\nimport mpidist as dist\n"
        "dist.init_process_group(backend='gloo')\nx = torch.ones(1)\ndist.all_reduce(x)\n"
        "stamp(time.time())\ndist.destroy_process_group()\n"
    ),
    "gloo": (
        STAMP + "import time, torch\nimport torch.distributed as dist\n"
        "dist.init_process_group(backend='gloo')\nx = torch.ones(1)\ndist.all_reduce(x)\n"
        "stamp(time.time())\ndist.destroy_process_group()\n"
    ),
}
#: the launch-free row's job secret (a fixed one: this is a benchmark)
SECRET = "startup-benchmark-secret-0123456789"
LAUNCHER_VARS = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL", "PALS_")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS) and k not in TORCHRUN_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(cmds: list[list[str]], envs: list[dict[str, str]], procs: int) -> float:
    """Start the commands together; seconds from start until the last process completed its collective."""
    with tempfile.TemporaryDirectory() as stamps:
        start = time.time()
        jobs = [
            subprocess.Popen(
                c, env={**e, "STARTUP_DIR": stamps}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for c, e in zip(cmds, envs)
        ]
        for job in jobs:
            _, err = job.communicate(timeout=300)
            if job.returncode:
                sys.exit(f"{' '.join(cmds[0])} failed ({job.returncode}):\n{err[-2000:]}")
        times = [float(p.read_text()) for p in Path(stamps).iterdir()]
    if len(times) != procs:
        sys.exit(f"{' '.join(cmds[0])}: {len(times)} of {procs} processes reported")
    return max(times) - start


def ways(files: dict[str, Path], procs: int) -> dict[str, callable]:
    py = sys.executable
    mpiexec = str(Path(py).parent / "mpiexec")
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]

    def plain(name: str, **extra: str) -> float:
        port = str(free_port())
        envs = [
            clean_env(RANK=str(r), WORLD_SIZE=str(procs), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
            for r in range(procs)
        ]
        return run_job([[py, str(files[name])]] * procs, envs, procs)

    return {
        "mpidist (numpy only), mpiexec": lambda: run_job(
            [[mpiexec, "-n", str(procs), py, str(files["numpy"])]], [clean_env()], procs
        ),
        "mpidist, mpiexec": lambda: run_job(
            [[mpiexec, "-n", str(procs), py, str(files["mpidist"])]], [clean_env()], procs
        ),
        "mpidist, launcher-free (env://)": lambda: plain("mpidist"),
        "mpidist, launcher-free (env://, MPIDIST_SECRET)": lambda: plain("mpidist", MPIDIST_SECRET=SECRET),
        "mpidist, torchrun --standalone": lambda: run_job([torchrun + [str(files["mpidist"])]], [clean_env()], procs),
        "gloo, torchrun --standalone": lambda: run_job([torchrun + [str(files["gloo"])]], [clean_env()], procs),
        "gloo, plain processes (env://)": lambda: plain("gloo"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--procs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name, text in PROGRAMS.items():
            files[name] = Path(tmp) / f"startup_{name}.py"  # not numpy.py: it would shadow numpy
            files[name].write_text(text)
        todo = ways(files, args.procs)
        got: dict[str, list[float]] = {k: [] for k in todo}
        for _ in range(args.trials):
            for name, fn in todo.items():
                got[name].append(fn())
    ref = statistics.median(got["gloo, torchrun --standalone"])
    print(f"{args.procs} processes, time from start to the first completed all_reduce, median of {args.trials}:")
    print("| how | median | min | ratio to gloo under torchrun |")
    print("|---|---:|---:|---:|")
    for name, times in got.items():
        med = statistics.median(times)
        print(f"| {name} | {med:.2f} s | {min(times):.2f} s | {med / ref:.2f} |")


if __name__ == "__main__":
    main()
