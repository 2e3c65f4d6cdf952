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

__all__ = ["launched_by_mpi", "defer_mpi_init", "start_mpi", "fill_launcher_environment"]

# set by the process managers of MPICH (hydra), Open MPI (prte), Slurm with PMI/PMIx, Intel MPI
_LAUNCHER_VARS = (
    "PMI_RANK",
    "PMI_FD",
    "PMI_PORT",
    "PMI_ID",
    "PMI_SIZE",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "HYDI_CONTROL_FD",
    "MPI_LOCALNRANKS",
)


def launched_by_mpi() -> bool:
    """True if an MPI launcher (mpiexec, mpirun, srun with PMI) started this process."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def defer_mpi_init() -> None:
    """Without a launcher, keep mpi4py from initializing MPI until ``start_mpi``."""
    if "mpi4py.MPI" in sys.modules or launched_by_mpi():
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
            os.environ.update(pmi_env)
        level = {"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED, "serialized": MPI.THREAD_SERIALIZED}
        MPI.Init_thread(level.get(str(mpi4py.rc.thread_level), MPI.THREAD_MULTIPLE))
    return MPI


def mpi_initialized() -> bool:
    """True if MPI is initialized (without initializing it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized()


def fill_launcher_environment() -> None:
    """Under an MPI launcher, set torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE where unset.

    From the launcher's own variables only (no MPI call, no communication), so
    that programs written for torchrun can read them right after ``import
    mpidist``. ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` are left to
    ``python -m mpidist``/``mpidistrun`` (they need the processes to talk, and
    with ``GROUP_RANK`` set Lightning would take the job for a torchrun job).
    """
    if not launched_by_mpi():
        return
    from .environment import fill_environment, launcher_environment

    fill_environment(launcher_environment())


defer_mpi_init()  # on import, before any module of mpidist imports mpi4py.MPI
fill_launcher_environment()
