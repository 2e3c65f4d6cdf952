"""Run a script as torchrun would, under an MPI launcher; one rank's unhandled exception ends the job.

    mpiexec -n 4 python -m mpidist script.py [args...]
    mpiexec -n 4 python -m mpidist -m package.module [args...]
    srun -n 4 python -m mpidist script.py

Before the script starts, torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ...) are derived from MPI and set where the
user has not set them (every rank takes part: one collective), so programs
written for torchrun that read them run unchanged. An unhandled exception is
printed with every line prefixed by ``[rank N]``, then ``MPI_Abort`` ends every
rank, instead of leaving the others waiting in their next collective until the
timeout. ``mpidistrun`` (docs/drop-in.md) starts the job and runs this.
"""

from __future__ import annotations

import os
import runpy
import sys

from .launch.abort import install_excepthook
from .launch.boot import launch_mode
from .launch.environment import fill_environment
from .launch.from_mpi import torchrun_environment

USAGE = "usage: python -m mpidist script.py [args...] | python -m mpidist -m module [args...]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(USAGE)
        return 0 if argv else 2
    if launch_mode() == "launcher":
        fill_environment(torchrun_environment())  # collective: every rank runs this module
    # in an srun step that MPI alone cannot connect, import mpidist has set everything from Slurm's variables,
    # and init_process_group forms the world
    install_excepthook()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        # as `python script.py` (and torchrun) do: the script's folder first on the path, so that it imports
        # the modules beside it (`python -m` put the working directory there)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
