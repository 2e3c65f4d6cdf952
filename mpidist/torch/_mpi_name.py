"""The backend name ``"mpi"`` on a torch built without MPI.

Scripts written for a source-built torch say ``init_process_group("mpi")`` or
``new_group(backend="mpi")``. torch handles ``"mpi"`` itself, before it looks at
registered backends: it asks ``is_mpi_available()`` (the module flag
``_MPI_AVAILABLE``) and then calls ``ProcessGroupMPI.create(ranks)`` in
``_new_process_group_helper``, skipping the store rendezvous (rank and size come
from MPI). On a torch without MPI that class does not exist and the flag is
False, so the call fails with "Distributed package doesn't have MPI built in".

:func:`install` fills that gap with mpidist: it sets the flag and provides a
``ProcessGroupMPI`` whose ``create`` returns a
:class:`~mpidist.torch.backend.ProcessGroupMPIDist` named ``"mpi"``. It does so
only after checking that torch still has exactly this shape (the flag, no class
of its own, and a helper whose source calls ``ProcessGroupMPI.create(`` and
returns Python process groups as they are), and it never touches a torch that
has its own MPI. Where the shape differs, ``"mpi"`` keeps torch's behaviour,
with an error that points to ``"mpidist"`` instead.

These are private torch internals (checked against torch 2.1-2.13); the check
runs at ``import mpidist.torch`` and :func:`status` says what applies.
"""

from __future__ import annotations

import functools
import inspect
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .backend import create_process_group

__all__ = ["install", "status", "MPI_NAME"]

MPI_NAME = "mpi"

_HELPER = "_new_process_group_helper"


def _c10d() -> Any:
    return sys.modules["torch.distributed.distributed_c10d"]


class ProcessGroupMPI:
    """Stands in for torch's missing ``ProcessGroupMPI``: ``create`` builds a mpidist group named "mpi"."""

    @staticmethod
    def create(ranks: list[int]) -> Any:
        """Called by torch's ``_new_process_group_helper`` on the members of a new group."""
        caller = sys._getframe(1)  # the helper: its timeout is not passed to create()
        found = caller.f_locals if caller.f_code.co_name == _HELPER else {}
        timeout = found.get("timeout")
        if not isinstance(timeout, timedelta):
            timeout = dist.default_pg_timeout
        return create_process_group(list(ranks), -1, -1, timeout, None, MPI_NAME)


def _shape_problem(c10d: Any) -> str:
    """Why torch's internals differ from what the patch relies on ('' if they match)."""
    if not hasattr(c10d, "_MPI_AVAILABLE"):
        return "torch.distributed.distributed_c10d has no _MPI_AVAILABLE flag"
    helper = getattr(c10d, _HELPER, None)
    if helper is None:
        return f"torch.distributed.distributed_c10d has no {_HELPER}"
    try:
        source = inspect.getsource(helper)
        params = inspect.signature(helper).parameters
    except (OSError, TypeError, ValueError) as exc:
        return f"cannot read {_HELPER}: {exc}"
    for needle in ("ProcessGroupMPI.create(", "issubclass(type(backend_class), ProcessGroup)"):
        if needle not in source:
            return f"{_HELPER} no longer contains {needle!r}"
    if "timeout" not in params:
        return f"{_HELPER} has no timeout parameter"
    if "_MPI_AVAILABLE" not in inspect.getsource(c10d.is_mpi_available):
        return "is_mpi_available no longer reads _MPI_AVAILABLE"
    return ""


def status() -> str:
    """What the name "mpi" means on this torch: "installed" (mpidist serves it), "torch has MPI", or why not."""
    c10d = _c10d()
    current = getattr(c10d, "ProcessGroupMPI", None)
    if current is ProcessGroupMPI:
        return "installed"
    if current is not None or getattr(c10d, "_MPI_AVAILABLE", False):
        return "torch has MPI"  # its own backend: never touched
    problem = _shape_problem(c10d)
    return f"not installed: {problem} (torch {torch.__version__})" if problem else "not installed"


def install() -> str:
    """Make ``"mpi"`` run on mpidist where torch has no MPI of its own (idempotent); return :func:`status`."""
    now = status()
    if now == "not installed":  # the shape matches: install
        c10d = _c10d()
        c10d.ProcessGroupMPI = ProcessGroupMPI
        c10d._MPI_AVAILABLE = True
        return status()
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
