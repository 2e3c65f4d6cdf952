#!/usr/bin/env python3
"""Set up and run mpidist from a fresh checkout; needs only Python 3.9+.

    python3 dev.py example         # .venv with mpidist + MPICH, then mpiexec -n 4 examples/quickstart.py
    python3 dev.py test [ARGS]     # .venv with test tools, then the suite at world sizes 1, 2, 3, 4
    python3 dev.py bench [ARGS]    # the benchmarks on 2 ranks (see benchmarks/): collectives, the mpidist.bench
                                   # sweep (every collective, 8 B to 4 MiB, checked), then the torch backend
    python3 dev.py run-tests       # the suite with the current interpreter (used by tox and CI)

Extra ARGS go to pytest (test) or the benchmark script (bench). Environment:
MPIDIST_TEST_SIZES="1 2" picks the world sizes; MPIEXEC names another launcher.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
SIZE_TIMEOUT_S = 40 * 60
#: `dev.py bench`'s sweep of `python -m mpidist.bench` (docs/performance.md): every collective, 8 B to 4 MiB
BENCH_SWEEP = ["-b", "8", "-e", "4M", "-f", "8", "--check"]


def say(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def run(cmd: list[str], **kw) -> int:
    say("$ " + " ".join(str(c) for c in cmd))
    return subprocess.call([str(c) for c in cmd], **kw)


def must(cmd: list[str]) -> None:
    rc = run(cmd)
    if rc:
        sys.exit(f"[dev] command failed with exit code {rc}")


def setup(extras: str, torch: bool = False) -> Path:
    """Create .venv and install mpidist[extras] (re-install when pyproject.toml changes)."""
    python = BIN / "python"
    if not python.exists():
        must([sys.executable, "-m", "venv", VENV])
        must([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()
    stamp = VENV / f".mpidist-{extras.replace(',', '-')}"
    if not stamp.exists() or stamp.read_text() != key:
        must([python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extras}]"])
        stamp.write_text(key)
    if torch:
        install_local_torch(python)
    return python


def install_local_torch(python: Path) -> None:
    """Install torch 2.13.0 only if a local wheel is reachable (never a multi-GB download)."""
    if subprocess.call([python, "-c", "import torch"], stderr=subprocess.DEVNULL) == 0:
        return
    rc = subprocess.call(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "torch==2.13.0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if rc == 0:
        rc = run([python, "-m", "pip", "install", "-q", "torch==2.13.0"])
    say("torch installed: the gloo comparison tests run" if rc == 0 else "no local torch wheel: gloo comparisons are skipped")


def mpiexec(python: Path) -> list[str]:
    launcher = os.environ.get("MPIEXEC") or (str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else shutil.which("mpiexec"))
    if not launcher:
        sys.exit("[dev] no mpiexec found: install mpidist[mpich] or set MPIEXEC")
    cmd = [launcher]
    if "openmpi" in subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout.lower():
        cmd.append("--oversubscribe")
    return cmd


def run_tests(python: Path, args: list[str]) -> int:
    """Run the suite under mpiexec at each world size; print a summary."""
    sizes = [int(s) for s in os.environ.get("MPIDIST_TEST_SIZES", "1 2 3 4").split()]
    launcher = mpiexec(python)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    results = []
    for n in sizes:
        start = time.monotonic()
        cmd = launcher + ["-n", str(n), str(python), "-m", "pytest", "--with-mpi", "-q", *args]
        say(f"world size {n}: " + " ".join(cmd))
        try:
            rc = subprocess.call(cmd, cwd=ROOT, env=env, timeout=SIZE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = 124
        results.append((n, rc, time.monotonic() - start))
    say("summary:")
    for n, rc, secs in results:
        say(f"  mpiexec -n {n}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {secs:.0f} s")
    return max((rc for _, rc, _ in results), default=0)


def main(argv: list[str]) -> int:
    cmd, args = (argv[0], argv[1:]) if argv else ("help", [])
    if cmd == "example":
        python = setup("mpich")
        n = args[0] if args else "4"
        return run(mpiexec(python) + ["-n", n, python, ROOT / "examples" / "quickstart.py"], cwd=ROOT)
    if cmd == "test":
        python = setup("mpich,test", torch=True)
        return run_tests(python, args)
    if cmd == "run-tests":
        return run_tests(Path(sys.executable), args)
    if cmd == "bench":
        python = setup("mpich,test", torch=True)
        rc = run(mpiexec(python) + ["-n", "2", python, ROOT / "benchmarks" / "bench_collectives.py", *args], cwd=ROOT)
        rc = rc or run(mpiexec(python) + ["-n", "2", python, "-m", "mpidist.bench", *BENCH_SWEEP], cwd=ROOT)
        torch_bench = [python, ROOT / "benchmarks" / "bench_torch_backend.py"]
        return rc or run(mpiexec(python) + ["-n", "2", *torch_bench], cwd=ROOT)
    print(__doc__)
    return 0 if cmd in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
