"""Run a script so that an unhandled exception on one rank ends the whole job.

    mpiexec -n 4 python -m mpidist script.py [args...]
    mpiexec -n 4 python -m mpidist -m package.module [args...]
    srun -n 4 python -m mpidist script.py

The exception is printed with every line prefixed by ``[rank N]``, then
``MPI_Abort`` ends every rank, instead of leaving the others waiting in their
next collective until the timeout.
"""

from __future__ import annotations

import runpy
import sys

from .abort import install_excepthook

USAGE = "usage: python -m mpidist script.py [args...] | python -m mpidist -m module [args...]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(USAGE)
        return 0 if argv else 2
    install_excepthook()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
