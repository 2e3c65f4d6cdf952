"""Build the two C extensions; everything else is in pyproject.toml.

* ``mpidist.arrays._ready``: the array layer's readiness check (``arrays/host.py``);
* ``mpidist.backends._direct``: the MPI backend's hot collectives as direct MPI calls
  (``backends/direct.py``).

Both are optional: where they cannot be built (no C compiler), mpidist installs
without them and runs the same Python code they speed up.
"""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(name, [source], include_dirs=[numpy.get_include()], extra_compile_args=["-O2"], optional=True)
        for name, source in [
            ("mpidist.arrays._ready", "mpidist/arrays/_ready.c"),
            ("mpidist.backends._direct", "mpidist/backends/_direct.c"),
        ]
    ]
)
