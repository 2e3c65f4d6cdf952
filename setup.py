"""Build the one C extension (the MPI backend's direct calls); everything else is in pyproject.toml.

The extension is optional: where it cannot be built (no C compiler), mpidist installs
without it and the MPI backend calls MPI through mpi4py (``mpidist.backends.lane``).
"""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mpidist.backends._direct",
            ["mpidist/backends/_direct.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
