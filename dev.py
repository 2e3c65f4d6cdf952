#!/usr/bin/env python3
"""Set up and run mpidist from a fresh checkout; needs only Python 3.9+.

    python3 dev.py example         # .venv with mpidist + MPICH, then mpiexec -n 4 examples/quickstart.py
    python3 dev.py test [ARGS]     # the suite under MPICH (.venv) at world sizes 1, 2, 3, 4 and once more at
                                   # size 2 with every C extension off (the pure-Python paths), then under
                                   # Open MPI (.venv-openmpi) at world sizes 1, 2, 3, 4
                                   # each followed by tests/cluster: jobs under a real Slurm (srun, salloc,
                                   # sbatch) and across 3 and 8 simulated hosts, set up by tools/cluster/ (root)
                                   # then tests/with_torch on each newer torch of TORCH_MATRIX at 1 and 2 ranks
                                   # (MPICH; the newest under Open MPI too), each in .venv-torch-<version>
    python3 dev.py test --mpi mpich [ARGS]     # one MPI library only (or --mpi openmpi)
    python3 dev.py test-torch      # the torch matrix alone
    python3 dev.py bench [ARGS]    # the benchmarks on 2 ranks (see benchmarks/): collectives, the mpidist.bench
                                   # sweep (every collective, 8 B to 4 MiB, checked), then the torch backend
    python3 dev.py docs [ARGS]     # the documentation site (mkdocs.yml: docs/ + the API reference from the
                                   # docstrings) into site/, warnings as errors
    python3 dev.py run-tests       # the suite with the current interpreter (used by tox)

Extra ARGS go to pytest (test), the benchmark script (bench) or `mkdocs build` (docs). Environment:
MPIDIST_TEST_SIZES="1 2" picks the world sizes (of both libraries), MPIDIST_OPENMPI_TEST_SIZES
those of Open MPI alone; MPIDIST_C_OFF_SIZES those of the pass with C off ("" leaves it out);
MPIDIST_CLUSTER_TESTS=0 leaves tests/cluster out (ARGS do too), MPIDIST_TORCH_MATRIX=0 the torch matrix (ARGS
do too), MPIDIST_TORCH_MATRIX_SIZES its world sizes; MPIDIST_TEST_MPI=mpich|openmpi|both
is --mpi's default; MPIEXEC names another launcher (run-tests, and test with one --mpi).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
#: the MPI libraries the suite runs under: (extra of pyproject.toml, virtual environment)
LIBRARIES = {"mpich": ("mpich", ROOT / ".venv"), "openmpi": ("openmpi", ROOT / ".venv-openmpi")}
VENV = LIBRARIES["mpich"][1]
SIZE_TIMEOUT_S = 40 * 60
#: the pass with every C extension off (_ready, _direct, _halfops): the pure-Python paths a machine without a
#: compiler runs, under the first library, at the world sizes MPIDIST_C_OFF_SIZES gives ("" leaves it out);
#: the tests that do not depend on the MPI library ran in the first pass already
C_OFF_SIZES = [int(n) for n in os.environ.get("MPIDIST_C_OFF_SIZES", "2").split()]
C_OFF_ENV = {"MPIDIST_C_EXTENSIONS": "0", "MPIDIST_TEST_ONE_LIBRARY": "0"}
CLUSTER_TIMEOUT_S = 15 * 60
#: Open MPI yields the core while it waits inside MPI only when its launcher sees more ranks than
#: cores; on a machine shared with other jobs (CI, developers) it should always (MPICH's ch4 does)
OPENMPI_ENV = {"OMPI_MCA_mpi_yield_when_idle": "1"}
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


def bin_dir(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin")


def setup(extras: str, torch: bool = False, venv: Path = VENV) -> Path:
    """Create ``venv`` and install mpidist[extras] (re-install when pyproject.toml changes)."""
    python = bin_dir(venv) / "python"
    if not python.exists():
        must([sys.executable, "-m", "venv", venv])
        must([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()
    stamp = venv / f".mpidist-{extras.replace(',', '-')}"
    if not stamp.exists() or stamp.read_text() != key:
        must([python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extras}]"])
        stamp.write_text(key)
    if torch:
        install_local_torch(python)
        install_lightning(python)
    return python


def install_local_torch(python: Path) -> None:
    """Install torch TORCH_OLDEST only if a local wheel is reachable (never a multi-GB download)."""
    if subprocess.call([python, "-c", "import torch"], stderr=subprocess.DEVNULL) == 0:
        return
    rc = subprocess.call(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", f"torch=={TORCH_OLDEST}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if rc == 0:
        rc = run([python, "-m", "pip", "install", "-q", f"torch=={TORCH_OLDEST}"])
    say("torch installed: the gloo comparison tests run" if rc == 0 else "no local torch wheel: gloo comparisons are skipped")


#: the torch of the main environments (.venv, .venv-openmpi): the oldest release mpidist supports (pyproject.toml's
#: lower bound), whose tests run at every world size under both libraries
TORCH_OLDEST = "2.13.0"
#: the newer torch releases `dev.py test` also runs tests/with_torch on (with Lightning and torch's own suite), each
#: in an environment of its own, at TORCH_MATRIX_SIZES under MPICH, the newest under Open MPI too. Keep it equal to
#: _mpidist_autoload.TESTED_TORCH less TORCH_OLDEST (tests/tools/test_dev.py checks)
TORCH_MATRIX = ("2.14.1", "2.15.0")
TORCH_MATRIX_SIZES = [int(n) for n in os.environ.get("MPIDIST_TORCH_MATRIX_SIZES", "1 2").split()]
#: pip's environment for a torch newer than a machine's pip constraints allow (a local cap on torch releases)
TORCH_PIP_ENV = {"PIP_CONSTRAINT": "/dev/null"}
#: what the torch tests use beside torch: the Lightning they train with over "mpi" and "mpidist"
#: (tests/with_torch/test_torch_autoload.py), and expecttest, which torch's own distributed test suite imports
#: (tests/with_torch/test_torch_suite.py)
TORCH_TEST_EXTRAS = ("lightning==2.6.6", "expecttest")


def install_lightning(python: Path) -> None:
    """Install Lightning and expecttest where torch is installed (a few MB; their tests are skipped without)."""
    if subprocess.call([python, "-c", "import torch, lightning, expecttest"], stderr=subprocess.DEVNULL) == 0:
        return
    if subprocess.call([python, "-c", "import torch"], stderr=subprocess.DEVNULL) != 0:
        return
    rc = run([python, "-m", "pip", "install", "-q", *TORCH_TEST_EXTRAS])
    say("Lightning and expecttest installed" if rc == 0 else "Lightning/expecttest did not install: their tests skip")


def setup_torch(library: str, version: str) -> Path | None:
    """An environment with mpidist[library,test], torch ``version``, Lightning and expecttest; None if it failed.

    Under MPICH, torch is installed once per pyproject.toml and version (a CUDA build of torch is several GB;
    pip's cache keeps a download for the next run). Another library's environment holds only mpidist and that
    library, and reaches the MPICH environment's torch through a ``.pth`` file (its own packages, mpi4py
    and the MPI library among them, come first on ``sys.path``).
    """
    if library != "mpich":
        shared = setup_torch("mpich", version)
        if shared is None:
            return None
        python = setup(f"{library},test", venv=ROOT / f".venv-{library}-torch-{version}")
        (Path(site_packages(python)) / "zz-mpidist-shared-torch.pth").write_text(site_packages(shared) + "\n")
        return python
    venv = ROOT / f".venv-torch-{version}"
    python = bin_dir(venv) / "python"
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + version.encode()).hexdigest()
    stamp = venv / ".mpidist-torch"
    if stamp.exists() and stamp.read_text() == key:
        return python
    if not python.exists():
        must([sys.executable, "-m", "venv", venv])
    env = {**os.environ, **TORCH_PIP_ENV}
    cmd = [python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[mpich,test]", f"torch=={version}"]
    if run([*cmd, *TORCH_TEST_EXTRAS], env=env):
        say(f"torch {version} did not install: its tests fail")
        return None
    stamp.write_text(key)
    return python


def site_packages(python: Path) -> str:
    """The site-packages folder of the environment of ``python``."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def run_torch_matrix(args: list[str], libraries: list[str]) -> list[tuple]:
    """tests/with_torch on each torch of TORCH_MATRIX (MPICH; the newest under every library in ``libraries``)."""
    if os.environ.get("MPIDIST_TORCH_MATRIX", "1").strip() == "0" or args:
        say("torch matrix: left out" + (" (MPIDIST_TORCH_MATRIX=0)" if not args else " (pytest arguments given)"))
        return []
    results: list[tuple] = []
    for version in TORCH_MATRIX:
        for library in libraries if version == TORCH_MATRIX[-1] else libraries[:1]:
            label = f"{library}, torch {version}: "
            python = setup_torch(library, version)
            if python is None:
                results.append((label, "install", 1, 0.0, [f"pip could not install torch {version}"]))
                continue
            env = {"MPIDIST_TEST_ONE_LIBRARY": "0" if library != libraries[0] else "1"}
            results += run_tests(python, ["tests/with_torch"], TORCH_MATRIX_SIZES, label, len(libraries) == 1, env)
    return results


def mpiexec(python: Path, use_env: bool = True) -> tuple[list[str], dict[str, str]]:
    """The launcher beside ``python`` (or $MPIEXEC, or one on PATH) and what it needs: (command, environment).

    Open MPI's needs ``--oversubscribe`` (more ranks than cores, which MPICH allows anyway),
    ``--allow-run-as-root`` for root (CI machines), and OPENMPI_ENV.
    """
    beside = python.parent / "mpiexec"
    named = os.environ.get("MPIEXEC") if use_env else None
    launcher = named or (str(beside) if beside.exists() else shutil.which("mpiexec"))
    if not launcher:
        sys.exit("[dev] no mpiexec found: install mpidist[mpich] or set MPIEXEC")
    cmd, env = [launcher], {}
    if "open mpi" in subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout.lower():
        cmd.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        env = {k: v for k, v in OPENMPI_ENV.items() if k not in os.environ}
    return cmd, env


#: what a failed run's output shows of its failures, ANSI colours removed: pytest's summary lines
#: (FAILED/ERROR ...), the "E   " lines of its tracebacks, and any crash or timeout the launcher reports
FAILURE_LINE = re.compile(r"^(FAILED |ERROR |E   |\+{3,} Timeout|Fatal Python error|.*(?:BAD TERMINATION|EXIT CODE:|exited on signal))")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: lines of failures kept per run, so that CI's tail shows the whole summary
FAILURE_LINES_KEPT = 40


def has_c_compiler() -> bool:
    """True if the compiler Python's extensions are built with is on PATH (setup.py's C extensions are optional)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    return bool(cc) and shutil.which(cc[0]) is not None


def call_teed(cmd: list[str], timeout_s: float, **kw) -> tuple[int, list[str]]:
    """Run ``cmd`` with its output passed through to ours; return (exit code, its failure lines).

    The failure lines are repeated in the summary: a CI log keeps only its tail, and the run that
    failed may be far above it. A run past ``timeout_s`` is killed (exit code 124).
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
    deadline = time.monotonic() + timeout_s
    failures: list[str] = []
    killer = threading.Timer(timeout_s, proc.kill)
    killer.start()
    try:
        for raw in proc.stdout:
            sys.stdout.buffer.write(raw)
            sys.stdout.flush()
            line = ANSI.sub("", raw.decode(errors="replace")).rstrip()
            if FAILURE_LINE.match(line) and line not in failures:
                failures.append(line)
        rc = proc.wait()
    finally:
        killer.cancel()
    return (124 if time.monotonic() >= deadline else rc), failures


def run_tests(
    python: Path, args: list[str], sizes: list[int], label: str = "", use_env: bool = True, env_extra: dict | None = None
) -> list[tuple]:
    """Run the suite under mpiexec at each world size; return (label, size, exit code, seconds, failures).

    ``env_extra`` is added to the environment (the C-off pass); where a C compiler is found, the
    C extensions must have been built (MPIDIST_REQUIRE_C=1: a failed build fails tests/backends/test_direct.py
    instead of passing silently on the Python fallback).
    """
    launcher, extra_env = mpiexec(python, use_env)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", **extra_env, **(env_extra or {}))
    if has_c_compiler() and env.get("MPIDIST_C_EXTENSIONS", "1").strip() != "0":
        env.setdefault("MPIDIST_REQUIRE_C", "1")
    if label and label != f"{next(iter(LIBRARIES))}: ":  # tests marked one_library ran under the first library
        env.setdefault("MPIDIST_TEST_ONE_LIBRARY", "0")
    results = []
    for n in sizes:
        start = time.monotonic()
        cmd = launcher + ["-n", str(n), str(python), "-m", "pytest", "--with-mpi", "-q", *args]
        say(f"{label}world size {n}: " + " ".join(cmd))
        rc, failures = call_teed(cmd, SIZE_TIMEOUT_S, cwd=ROOT, env=env)
        results.append((label, n, rc, time.monotonic() - start, failures))
    return results


def run_cluster_tests(python: Path, label: str = "") -> list[tuple]:
    """Run tests/cluster once with plain pytest: jobs under a real Slurm and across simulated hosts.

    They set up Slurm and the hosts themselves (tools/cluster/), which needs root; where that cannot
    be done they skip and say why. MPIDIST_CLUSTER_TESTS=0 leaves them out.
    """
    if os.environ.get("MPIDIST_CLUSTER_TESTS", "1").strip() == "0":
        say(f"{label}cluster tests: left out (MPIDIST_CLUSTER_TESTS=0)")
        return []
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    if label and label != f"{next(iter(LIBRARIES))}: ":  # tests marked one_library ran under the first library
        env.setdefault("MPIDIST_TEST_ONE_LIBRARY", "0")
    start = time.monotonic()
    cmd = [str(python), "-m", "pytest", "-q", "-rs", "tests/cluster"]
    say(f"{label}cluster tests: " + " ".join(cmd))
    rc, failures = call_teed(cmd, CLUSTER_TIMEOUT_S, cwd=ROOT, env=env)
    return [(label, "cluster", rc, time.monotonic() - start, failures)]


def summary(results: list[tuple]) -> int:
    """Print the failures of each failed run, one line per run and the total time; return the worst exit code."""
    for label, n, rc, _secs, failures in results:
        if rc:
            say(f"failures of {label}{n if isinstance(n, str) else f'mpiexec -n {n}'} (exit {rc}):")
            for line in failures[:FAILURE_LINES_KEPT]:
                print(f"    {line}", flush=True)
            if len(failures) > FAILURE_LINES_KEPT:
                print(f"    ... and {len(failures) - FAILURE_LINES_KEPT} more lines", flush=True)
    say("summary:")
    for label, n, rc, secs, _failures in results:
        what = {"cluster": "tests/cluster (srun, several hosts)", "install": "install", "leftovers": "the machine left as found"}.get(n, f"mpiexec -n {n}")
        say(f"  {label}{what}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {secs:.0f} s")
    say(f"  total: {sum(r[3] for r in results):.0f} s")
    return max((r[2] for r in results), default=0)


#: what a test run may start or leave and `dev.py test` takes away again: the daemons tools/cluster/slurm.sh starts,
#: the hosts tools/cluster/hosts.sh makes, and the shared-memory segments of jobs the tests killed
DAEMONS = ("slurmctld", "slurmd", "munged")
SHM = Path("/dev/shm")
SHM_OURS = re.compile(r"^(mpich_shm_|sm_segment\.|vader_segment\.|mpidist|psm2|ompi\.|pmix)")


def running(name: str) -> list[int]:
    """The pids of processes whose command name is ``name`` (from /proc; empty where there is none)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "comm").read_text().strip() == name:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def shm_in_use() -> set[str]:
    """Names under /dev/shm that a live process maps or holds open."""
    used: set[str] = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            for line in (entry / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.split("/dev/shm/", 1)[1].split()[0])
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/") :].split()[0])
        except OSError:
            continue
    return used


def machine_state() -> dict:
    """What `leave_as_found` compares: daemons running, simulated hosts up, shared-memory segments."""
    hosts = ROOT / "tools" / "cluster" / "hosts.sh"
    listed = subprocess.run(["bash", str(hosts), "list"], capture_output=True, text=True, timeout=60)
    return {
        "daemons": {name for name in DAEMONS if running(name)},
        "hosts": listed.stdout.split() if listed.returncode == 0 else [],
        "shm": set(os.listdir(SHM)) if SHM.is_dir() else set(),
    }


def leave_as_found(before: dict) -> list[str]:
    """Stop what the run started and remove what its killed jobs left; return what is still there."""
    after = machine_state()
    if after["daemons"] - before["daemons"]:
        run(["bash", str(ROOT / "tools" / "cluster" / "slurm.sh"), "down"])
    if after["hosts"] and not before["hosts"]:
        run(["bash", str(ROOT / "tools" / "cluster" / "hosts.sh"), "down"])
    used = shm_in_use()
    removed, freed = 0, 0
    for name in sorted(after["shm"] - before["shm"]):
        if SHM_OURS.match(name) and name not in used:
            try:
                freed += (SHM / name).stat().st_size
                (SHM / name).unlink()
                removed += 1
            except OSError:
                continue
    if removed:
        say(f"/dev/shm: removed {removed} shared-memory segments ({freed / 2**20:.0f} MiB) of jobs the tests killed")
    now = machine_state()
    left = [f"{name} still running (started by the tests)" for name in sorted(now["daemons"] - before["daemons"])]
    left += [f"simulated host {host} still up" for host in now["hosts"] if not before["hosts"]]
    left += [f"/dev/shm/{name} left (in use)" for name in sorted(now["shm"] - before["shm"]) if SHM_OURS.match(name)]
    for line in left:
        say(f"left behind: {line}")
    if not left:
        say("the machine is as the run found it: no daemon, host or shared-memory segment of the tests is left")
    return left


def sizes_for(library: str) -> list[int]:
    default = os.environ.get("MPIDIST_TEST_SIZES", "1 2 3 4")
    if library == "openmpi":
        default = os.environ.get("MPIDIST_OPENMPI_TEST_SIZES", default)
    return [int(s) for s in default.split()]


def test(args: list[str]) -> int:
    """``dev.py test [--mpi mpich|openmpi|both] [ARGS]``: the suite under each library in its own venv."""
    choice = os.environ.get("MPIDIST_TEST_MPI", "both")
    if args and args[0].startswith("--mpi"):
        if args[0] == "--mpi":
            if len(args) < 2:
                sys.exit("[dev] --mpi needs mpich, openmpi or both")
            choice, args = args[1], args[2:]
        else:
            choice, args = args[0].split("=", 1)[1], args[1:]
    if choice not in ("mpich", "openmpi", "both"):
        sys.exit(f"[dev] --mpi {choice}: expected mpich, openmpi or both")
    libraries = ["mpich", "openmpi"] if choice == "both" else [choice]
    before = machine_state()
    results: list[tuple] = []
    for library in libraries:
        extra, venv = LIBRARIES[library]
        python = setup(f"{extra},test", torch=True, venv=venv)
        label = f"{library}: " if len(libraries) > 1 else ""
        results += run_tests(python, args, sizes_for(library), label, use_env=len(libraries) == 1)
        if library == libraries[0] and C_OFF_SIZES:  # the pure-Python paths, as where no compiler exists
            results += run_tests(python, args, C_OFF_SIZES, f"{label}C off: ", len(libraries) == 1, C_OFF_ENV)
        if not args:  # the whole suite: also the launches on real clusters
            results += run_cluster_tests(python, label)
    results += run_torch_matrix(args, libraries)
    left = leave_as_found(before)
    if left and os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # elsewhere others may share the machine
        results.append(("", "leftovers", 1, 0.0, [f"left behind: {line}" for line in left]))
    return summary(results)


#: what `dev.py example` prints after the example ran (the README's "Next" says the same)
NEXT_STEPS = """
[dev] mpidist and MPICH are installed in .venv. Use it: `source .venv/bin/activate` (or call
[dev] .venv/bin/python, .venv/bin/mpiexec, ... by their paths). Three commands to try next, from here:

    source .venv/bin/activate
    pip install -e ".[mpich,torch,test]"                     # torch, pytest and pytest-mpi (torch from PyPI)
    mpiexec -n 2 python examples/ddp_powersgd.py              # torch DDP with PowerSGD, over MPI
    mpidistrun --nproc-per-node 2 examples/torch_program.py   # a torch.distributed program, unchanged
    mpiexec -n 2 python -m pytest --with-mpi -q tests/api     # the API's tests, on 2 ranks
"""


def main(argv: list[str]) -> int:
    cmd, args = (argv[0], argv[1:]) if argv else ("help", [])
    if cmd == "example":
        python = setup("mpich")
        n = args[0] if args else "4"
        launcher, env = mpiexec(python)
        rc = run(launcher + ["-n", n, python, ROOT / "examples" / "quickstart.py"], cwd=ROOT, env={**os.environ, **env})
        if rc == 0:
            print(NEXT_STEPS)
        return rc
    if cmd == "test":
        return test(args)
    if cmd == "test-torch":  # only the torch matrix (TORCH_MATRIX): tests/with_torch on the newer torch releases
        choice = os.environ.get("MPIDIST_TEST_MPI", "both")
        return summary(run_torch_matrix([], ["mpich", "openmpi"] if choice == "both" else [choice]))
    if cmd == "run-tests":
        return summary(run_tests(Path(sys.executable), args, sizes_for("mpich")))
    if cmd == "bench":
        python = setup("mpich,test", torch=True)
        launcher, env = mpiexec(python)
        env = {**os.environ, **env}
        rc = run(launcher + ["-n", "2", python, ROOT / "benchmarks" / "bench_collectives.py", *args], cwd=ROOT, env=env)
        rc = rc or run(launcher + ["-n", "2", python, "-m", "mpidist.bench", *BENCH_SWEEP], cwd=ROOT, env=env)
        torch_bench = [python, ROOT / "benchmarks" / "bench_torch_backend.py"]
        return rc or run(launcher + ["-n", "2", *torch_bench], cwd=ROOT, env=env)
    if cmd == "docs":
        python = setup("mpich,docs")
        # mkdocs.yml sets strict: a warning (a broken link, a docstring argument the signature lacks) fails
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
        return run([python, "-m", "mkdocs", "build", "--strict", "--site-dir", ROOT / "site", *args], cwd=ROOT, env=env)
    print(__doc__)
    return 0 if cmd in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
