"""The backend name ``"mpi"`` on a torch built without MPI.

Scripts written for a source-built torch say ``init_process_group("mpi")`` or
``new_group(backend="mpi")``. torch handles ``"mpi"`` itself, before it looks at
registered backends: it asks ``is_mpi_available()`` (the module flag
``_MPI_AVAILABLE``) and then calls ``ProcessGroupMPI.create(ranks)`` in
``_new_process_group_helper``, skipping the store rendezvous (rank and size come
from MPI). On a torch without MPI that class does not exist and the flag is
False, so the call fails with "Distributed package doesn't have MPI built in".

``_mpidist_autoload.install`` (run at ``import torch`` through torch's entry
points, and by ``import mpidist.torch``) fills that gap with mpidist: it sets
the flag, provides a ``ProcessGroupMPI`` whose ``create`` returns a
:class:`~mpidist.torch.backend.ProcessGroupMPIDist` named ``"mpi"``, and gives
that default group mpidist's store (:mod:`mpidist.torch._store`). It does so
only after checking that torch still has exactly this shape, and never touches
a torch that has its own MPI. Where the shape differs, ``"mpi"`` keeps torch's
behaviour, with an error that points to ``"mpidist"`` instead (this module).

These are private torch internals (checked against torch 2.1-2.13);
:func:`status` says what applies.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.distributed as dist

import _mpidist_autoload as autoload

__all__ = ["install", "status", "MPI_NAME"]

MPI_NAME = autoload.MPI_NAME


def _c10d() -> Any:
    return sys.modules["torch.distributed.distributed_c10d"]


def status() -> str:
    """What the name "mpi" means on this torch: "installed" (mpidist serves it), "torch has MPI", or why not.

    ``mpidist.torch.mpi_name_status`` is this function.

    Returns:
        ``"installed"`` when ``init_process_group("mpi")`` runs on mpidist,
        ``"torch has MPI"`` when torch was built with its own MPI backend (which
        mpidist leaves alone), or ``"not installed: <why>"``.

    Examples:
        >>> import mpidist.torch
        >>> mpidist.torch.mpi_name_status()  # torch's pip wheels have no MPI
        'installed'
    """
    c10d = _c10d()
    current = getattr(c10d, "ProcessGroupMPI", None)
    if current is autoload.ProcessGroupMPI:
        return "installed"
    if current is not None or getattr(c10d, "_MPI_AVAILABLE", False):
        return "torch has MPI"  # its own backend: never touched
    problem = autoload.mpi_name_problem(c10d)
    return f"not installed: {problem} (torch {torch.__version__})" if problem else "not installed"


def install() -> str:
    """Make ``"mpi"`` run on mpidist where torch has no MPI of its own (idempotent); return :func:`status`."""
    autoload.install()
    now = status()
    if now.startswith("not installed"):
        _explain_failures()
    return now


def _explain_failures() -> None:
    """Where the patch does not apply: make torch's "no MPI" error point to "mpidist"."""
    for name in ("init_process_group", "new_group"):
        original = getattr(dist, name)
        if getattr(original, "__mpidist_explained__", False):
            continue

        @functools.wraps(original)
        def explained(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            try:
                return __original(*args, **kwargs)
            except RuntimeError as exc:
                if "MPI built in" not in str(exc):
                    raise
                raise RuntimeError(
                    f"{exc}. mpidist could not provide the name 'mpi' on this torch ({status()}); "
                    "use backend='mpidist' instead (import mpidist.torch registers it)"
                ) from exc

        explained.__mpidist_explained__ = True  # type: ignore[attr-defined]
        setattr(dist, name, explained)
