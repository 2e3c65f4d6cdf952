"""Many ranks on few cores: small calls and start-up, mpidist against raw mpi4py, from 2 to 32 ranks.

Run:  python benchmarks/bench_scale.py [--ranks 2 4 8 16 32] [--trials 11] [--launches 3]
      python benchmarks/bench_scale.py --hosts 8 --ranks 16     # across 8 simulated hosts (root)
      python benchmarks/bench_scale.py --before /tmp/old --no-startup  # another checkout in the same trials

For each rank count, one job (``mpiexec -n N``, the launcher beside this Python) times
an 8-byte all_reduce and a barrier: ``dist.all_reduce``/``dist.barrier`` against the
blocking mpi4py calls (``Allreduce``, ``Barrier``) on a duplicate of the world, in
trials whose order rotates; each trial is a batch of back-to-back calls started
together (a raw barrier first) and timed by the slowest rank. The table shows the
medians over trials and the median of the paired ratios.

Start-up is timed in jobs of their own, alternating: ``init_process_group()`` from a
process where MPI has not started, against MPI's own start (``MPI.Init_thread``) plus a
``Dup`` of the world; both after the same imports (``import mpidist`` included, so that the
ranks reach MPI's start as unevenly in both), each the slowest rank's time; medians over
``--launches`` launches of each. ``MPIDIST_DEBUG=INFO`` prints where mpidist's start-up
time went. mpidist's bytecode is written first, as pip writes it when it installs a package
(``--no-compile``: not, so that under ``PYTHONDONTWRITEBYTECODE=1`` every rank compiles what it
imports at every start).

``--hosts H`` runs the same across H simulated hosts (``tools/cluster/hosts.sh``, needs
root; MPICH's hydra over ``tools/cluster/fake_ssh``), N/H ranks per host. It brings the
hosts up under MPIDIST_CLUSTER_PREFIX (default here ``mpb``) and MPIDIST_CLUSTER_NET
(default ``10.213.9``) and takes them down afterwards.

The machine's noise shows in the spread: run it more than once, and compare within
one run (the ratio column) rather than across runs.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
BIN = Path(sys.executable).parent
HOSTS_SH = REPO / "tools" / "cluster" / "hosts.sh"
FAKE_SSH = REPO / "tools" / "cluster" / "fake_ssh"
LAUNCHER_VARS = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL", "PALS_")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# -- inside the job ------------------------------------------------------------------------------------
def batch_calls(ranks: int) -> int:
    """Calls per timed batch: ~tens of ms per batch at any rank count on 2 cores."""
    return max(20, int(2000 / ranks**1.5))


def load_package(root: Path, name: str) -> Any:
    """The ``mpidist`` package under ``root``, imported as module ``name`` (as bench_paired.py does)."""
    spec = importlib.util.spec_from_file_location(
        name, root / "mpidist" / "__init__.py", submodule_search_locations=[str(root / "mpidist")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def worker_calls(trials: int, before: str | None) -> None:
    import numpy as np
    from mpi4py import MPI

    import mpidist as dist

    dist.init_process_group()
    comm = MPI.COMM_WORLD.Dup()
    size = comm.Get_size()
    x = np.ones(1, np.float64)  # 8 bytes
    calls = batch_calls(size)
    impls = {
        "all_reduce mpidist": lambda: dist.all_reduce(x),
        "all_reduce raw": lambda: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
        "barrier mpidist": lambda: dist.barrier(),
        "barrier raw": lambda: comm.Barrier(),
    }
    old = None
    if before:
        old = load_package(Path(before).resolve(), "mpidist_before")
        old.init_process_group()
        impls["all_reduce before"] = lambda: old.all_reduce(x)
        impls["barrier before"] = lambda: old.barrier()
    names = list(impls)
    for f in impls.values():  # warm up: connections, first-call paths
        for _ in range(5):
            f()
    times: dict[str, list[float]] = {n: [] for n in names}
    for t in range(trials):
        order = names[t % len(names) :] + names[: t % len(names)]
        for name in order:
            f = impls[name]
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            dt = (time.perf_counter() - t0) / calls
            times[name].append(comm.allreduce(dt, op=MPI.MAX))
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"ranks": size, "times": times}), flush=True)
    comm.Free()
    if old is not None:
        old.destroy_process_group()
    dist.destroy_process_group()


def worker_start(kind: str) -> None:
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    import mpidist as dist  # in both jobs: the ranks arrive at MPI's start as unevenly in each

    if kind == "mpidist":
        t0 = time.perf_counter()
        dist.init_process_group()
        dt = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        MPI.COMM_WORLD.Dup()
        dt = time.perf_counter() - t0
    worst = MPI.COMM_WORLD.allreduce(dt, op=MPI.MAX)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps({"kind": kind, "seconds": worst}), flush=True)
    if kind == "mpidist":
        dist.destroy_process_group()
    # rc.initialize = False above leaves finalizing to this program (mpi4py's rule): unfinalized, every job left
    # one of MPICH's segments in /dev/shm
    MPI.Finalize()


# -- the driver ------------------------------------------------------------------------------------
def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS) and k not in TORCHRUN_VARS}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def launcher(ranks: int, hosts: int) -> list[str]:
    mpiexec = str(BIN / "mpiexec")
    if not hosts:
        oversubscribe = ["--oversubscribe"] if (BIN / "ompi_info").exists() else []
        return [mpiexec, *oversubscribe, "-n", str(ranks)]
    per = -(-ranks // hosts)
    spec = ",".join(f"h{k}:{per}" for k in range(1, hosts + 1))
    return ["bash", str(HOSTS_SH), "exec", "h1", mpiexec, "-launcher", "ssh", "-launcher-exec", str(FAKE_SSH),
            "-hosts", spec, "-n", str(ranks)]  # fmt: skip


def run_job(ranks: int, hosts: int, args: list[str], timeout: float, env: dict[str, str]) -> dict:
    cmd = [*launcher(ranks, hosts), sys.executable, str(HERE), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    sys.exit(
        f"bench_scale: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )


def ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def us(v: list[float]) -> str:
    return f"{statistics.median(v) * 1e6:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--trials", type=int, default=11, help="interleaved trials per collective job")
    ap.add_argument("--launches", type=int, default=3, help="start-up jobs of each kind per rank count")
    ap.add_argument("--hosts", type=int, default=0, help="spread the ranks over this many simulated hosts")
    ap.add_argument("--no-startup", action="store_true", help="time the calls only")
    ap.add_argument("--no-calls", action="store_true", help="time the start-up only")
    ap.add_argument("--before", help="another checkout of mpidist (its root): its calls in the same trials")
    ap.add_argument(
        "--no-compile", action="store_true",
        help="time start-up with mpidist's bytecode not written beforehand (each rank compiles what it imports)",
    )  # fmt: skip
    ap.add_argument("--worker", choices=["calls", "start-mpidist", "start-raw"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "calls":
        return worker_calls(a.trials, a.before)
    if a.worker:
        return worker_start(a.worker.split("-")[1])

    env = clean_env()
    if not a.no_startup and not a.no_compile:
        # as pip installs a package: its bytecode written once, so a rank's start loads it rather than compiling it
        # each time (an editable checkout under PYTHONDONTWRITEBYTECODE=1, as here, compiles at every start)
        compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "mpidist"), quiet=1)
    if a.hosts:
        env.setdefault("MPIDIST_CLUSTER_PREFIX", "mpb")
        env.setdefault("MPIDIST_CLUSTER_NET", "10.213.9")
        up = subprocess.run(["bash", str(HOSTS_SH), "up", str(a.hosts)], env=env, capture_output=True, text=True)
        if up.returncode:
            sys.exit(f"bench_scale: hosts.sh up {a.hosts} failed ({up.returncode}): {up.stderr.strip()}")
    where = f"{a.hosts} simulated hosts" if a.hosts else f"{os.cpu_count()} cores"
    try:
        print(f"# 8-byte all_reduce and barrier, us per call (slowest rank; medians of {a.trials} interleaved "
              f"trials); init_process_group vs MPI start + Dup, s (medians of {a.launches} launches); {where}")  # fmt: skip
        head = "| ranks | all_reduce mpidist / raw | ratio | barrier mpidist / raw | ratio | init mpidist / MPI+Dup | ratio |"
        print(head)
        print("|" + "---|" * 7)
        for n in a.ranks:
            extra = ["--before", a.before] if a.before else []
            calls = None
            if not a.no_calls:
                calls = run_job(n, a.hosts, ["--worker", "calls", "--trials", str(a.trials), *extra], 600, env)
                calls = calls["times"]
            start = "-"
            rstart = "-"
            if not a.no_startup:
                got: dict[str, list[float]] = {"mpidist": [], "raw": []}
                for i in range(a.launches):
                    for kind in ("mpidist", "raw") if i % 2 == 0 else ("raw", "mpidist"):
                        got[kind].append(run_job(n, a.hosts, ["--worker", f"start-{kind}"], 300, env)["seconds"])
                md, mr = statistics.median(got["mpidist"]), statistics.median(got["raw"])
                start, rstart = f"{md:.2f} / {mr:.2f}", f"{md / mr:.2f}x"
            if calls is None:
                print(f"| {n} | - | - | - | - | {start} | {rstart} |", flush=True)
                continue
            ar, br = calls["all_reduce mpidist"], calls["all_reduce raw"]
            bm, bw = calls["barrier mpidist"], calls["barrier raw"]
            print(f"| {n} | {us(ar)} / {us(br)} | {ratio(ar, br):.2f}x | {us(bm)} / {us(bw)} | {ratio(bm, bw):.2f}x "
                  f"| {start} | {rstart} |", flush=True)  # fmt: skip
            if a.before:
                ao, bo = calls["all_reduce before"], calls["barrier before"]
                print(f"|   before | {us(ao)} / {us(br)} | {ratio(ao, br):.2f}x | {us(bo)} / {us(bw)} | "
                      f"{ratio(bo, bw):.2f}x | now/before: all_reduce {ratio(ar, ao):.2f}x, barrier "
                      f"{ratio(bm, bo):.2f}x | |", flush=True)  # fmt: skip
    finally:
        if a.hosts:
            subprocess.run(["bash", str(HOSTS_SH), "down"], env=env, capture_output=True)


if __name__ == "__main__":
    main()
