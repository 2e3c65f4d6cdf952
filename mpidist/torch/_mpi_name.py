"""The backend name ``"mpi"`` on a torch built without MPI.

Scripts written for a source-built torch say ``init_process_group("mpi")`` or
``new_group(backend="mpi")``. torch handles ``"mpi"`` itself: it asks
``is_mpi_available()`` (the module flag ``_MPI_AVAILABLE``), then calls
``ProcessGroupMPI.create(ranks)``, skipping the store rendezvous (rank and size
come from MPI). Up to torch 2.13 its group helper ``_new_process_group_helper``
makes that call; from 2.14 on, a creator registered for ``"mpi"`` in torch's
table of backend creators does (``Backend.register_backend``). On a torch
without MPI the class does not exist and the flag is False, so the call fails
with "Distributed package doesn't have MPI built in".

``_mpidist_autoload.install`` (run at ``import torch`` through torch's entry
points, and by ``import mpidist.torch``) fills that gap with mpidist: it sets
the flag, provides a ``ProcessGroupMPI`` whose ``create`` returns a
:class:`~mpidist.torch.backend.ProcessGroupMPIDist` named ``"mpi"`` (and, from
2.14 on, registers its own creator for ``"mpi"`` in torch's table), and gives
that default group mpidist's store (:mod:`mpidist.torch._store`). It does so
only after checking that torch still has one of these two shapes, and never
touches a torch that has its own MPI. Where the shape differs, a
``RuntimeWarning`` at ``import torch`` and mpidist's own error from
``init_process_group("mpi")`` name the torch, what differs, and ``"mpidist"``,
which works on it.

These are private torch internals (tested on every torch of
``_mpidist_autoload.TESTED_TORCH``); :func:`status` says what applies.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

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
    shape, problem = autoload.mpi_name_shape(c10d)
    if current is autoload.ProcessGroupMPI and not problem:
        if shape == autoload.SHAPE_HELPER or _creator_is_mpidists(c10d):
            return "installed"
    if current is not None and current is not autoload.ProcessGroupMPI:
        return "torch has MPI"  # its own backend: never touched
    return f"not installed: {problem} (torch {torch.__version__})" if problem else "not installed"


def _creator_is_mpidists(c10d: Any) -> bool:
    plugin = c10d.Backend._plugins.get(MPI_NAME.upper())
    return bool(getattr(getattr(plugin, "creator_fn", None), "__mpidist__", False))


def install() -> str:
    """Make ``"mpi"`` run on mpidist where torch has no MPI of its own (idempotent); return :func:`status`.

    Where it cannot, ``"mpi"`` fails with mpidist's message (``_mpidist_autoload.refusal``) instead of torch's.
    """
    autoload.install()
    return status()
