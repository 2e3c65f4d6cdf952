"""Build the four C extensions; everything else is in pyproject.toml.

* ``mpidist.arrays._ready``: the array layer's readiness check (``arrays/host.py``);
* ``mpidist.backends._direct``: the MPI backend's hot collectives and point-to-point calls as
  direct MPI calls (``backends/direct.py``; ``_direct_p2p.c`` and ``_direct_posted.c`` are #included by ``_direct.c``);
* ``mpidist.backends._halfops``: MPI reduction ops for float16 and bfloat16 (``backends/halfops.py``),
  built with -O3 so that the compiler vectorizes their loops;
* ``mpidist.backends._shm``: the shared-memory path's counters with C11 memory order
  (``backends/shm.py``).

All are optional: where they cannot be built (no C compiler), mpidist installs
without them and runs the same Python code they speed up.
"""

import numpy
from setuptools import Extension, setup

#: C files a source #includes (rebuilt when they change; shipped in the sdist)
_INCLUDED = {"mpidist/backends/_direct.c": ["mpidist/backends/_direct_p2p.c", "mpidist/backends/_direct_posted.c"]}

setup(
    ext_modules=[
        Extension(
            name,
            [source],
            include_dirs=[numpy.get_include()],
            extra_compile_args=[level],
            depends=_INCLUDED.get(source, []),
            optional=True,
        )
        for name, source, level in [
            ("mpidist.arrays._ready", "mpidist/arrays/_ready.c", "-O2"),
            ("mpidist.backends._direct", "mpidist/backends/_direct.c", "-O2"),
            ("mpidist.backends._halfops", "mpidist/backends/_halfops.c", "-O3"),
            ("mpidist.backends._shm", "mpidist/backends/_shm.c", "-O2"),
        ]
    ]
)
