"""torch's ``env://`` rendezvous under an MPI launcher, with nothing set by the user.

``init_process_group("mpidist")`` (and any other backend) reads ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in torch's ``env://``
handler. Under ``mpiexec``/``srun`` nobody sets them, so the handler is wrapped
(by ``_mpidist_autoload``, at ``import torch`` or ``import mpidist.torch``):
when one of them is missing it calls :func:`fill_if_launched`, which derives
torchrun's variables from MPI if an MPI launcher started the process
(:func:`mpidist.launch.from_mpi.torchrun_environment`, set by
:func:`mpidist.launch.environment.fill_environment`; values the user set are
kept). Otherwise torch's handler runs unchanged and asks for the variables.

The wrapper replaces an entry of torch's private handler table
(``torch.distributed.rendezvous._rendezvous_handlers["env"]``); where that table
is missing, nothing is patched.
"""

from __future__ import annotations

import os

from _mpidist_autoload import ENV_NEEDED as NEEDED  # what torch's env:// handler needs

from ..launch.boot import launch_mode
from ..launch.environment import fill_environment
from ..launch.from_mpi import torchrun_environment

__all__ = ["fill_if_launched", "NEEDED"]


def fill_if_launched() -> None:
    """Under an MPI launcher, set torchrun's variables that are missing (from MPI); elsewhere do nothing."""
    if launch_mode() == "launcher" and any(not os.environ.get(v, "").strip() for v in NEEDED):
        fill_environment(torchrun_environment())
