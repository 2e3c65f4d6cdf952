"""Make ``import torch`` know mpidist's backend names, without importing mpidist.

torch calls every entry point of the group ``torch.backends`` at the end of
``import torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); mpidist's calls
:func:`load`. After it, an unmodified torch program can say
``init_process_group("mpidist")`` or ``init_process_group("mpi")`` (on a torch
built without MPI) with no ``import mpidist.torch``.

This module is outside the ``mpidist`` package on purpose: importing that
package costs about 30 ms (its modules and mpi4py's package), too much to add
to every ``import torch``. Here nothing is imported that torch has not
imported already, and nothing starts: mpidist (and MPI) load when the first
group on one of its names is created, or when ``env://`` finds torchrun's
variables missing. Importing this module and running :func:`load` costs about
0.1 ms (docs/torch-backend.md, "No import needed").

What is installed (each step idempotent, each the one place that patches torch):

* the backend ``"mpidist"`` (``Backend.register_backend``), whose creator
  builds a :class:`mpidist.torch.ProcessGroupMPIDist`;
* ``env://`` under an MPI launcher: torchrun's variables derived from MPI when
  some are missing (:func:`mpidist.torch._rendezvous.fill_if_launched`);
* the name ``"mpi"`` where torch has no MPI of its own: torch's flag and a
  ``ProcessGroupMPI`` whose ``create`` builds a mpidist group, and a real
  store for that default group (torch gives it a placeholder), so that side
  groups such as ``new_group(backend="gloo")`` work on it. These rely on torch
  internals (checked against torch 2.1-2.13 by :func:`mpi_name_problem`);
  where they differ, ``"mpi"`` is left to torch.

Turn it off with ``MPIDIST_TORCH_AUTOLOAD=0`` (``import mpidist.torch`` still
installs everything).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator

__all__ = ["load", "install", "mpi_name_problem", "ProcessGroupMPI", "SWITCH", "BACKEND_NAME", "MPI_NAME"]

#: the environment switch: "0" (or false/no/off) leaves torch as it is at ``import torch``
SWITCH = "MPIDIST_TORCH_AUTOLOAD"
BACKEND_NAME = "mpidist"
MPI_NAME = "mpi"
#: what torch's env:// handler needs
ENV_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_HELPER = "_new_process_group_helper"


def load() -> None:
    """torch's entry point: :func:`install`, unless ``MPIDIST_TORCH_AUTOLOAD`` says no.

    Never raises: torch turns an entry point's exception into a failed ``import torch``,
    and no torch program may fail to start because of mpidist; a warning says what went wrong.
    """
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        install()
    except Exception as exc:  # noqa: BLE001 - see above
        import warnings

        warnings.warn(
            f"mpidist could not register its torch backends at import torch ({type(exc).__name__}: {exc}); "
            f"`import mpidist.torch` installs them with the error shown, {SWITCH}=0 skips this step",
            RuntimeWarning,
            stacklevel=2,
        )


def install() -> None:
    """Register ``"mpidist"``, wrap ``env://`` and serve ``"mpi"`` (idempotent; no-op without torch.distributed)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    if getattr(dist.Backend, BACKEND_NAME.upper(), None) is None:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    _wrap_env_rendezvous()
    if getattr(c10d, "ProcessGroupMPI", None) is None and not mpi_name_problem(c10d):
        c10d.ProcessGroupMPI = ProcessGroupMPI
        c10d._MPI_AVAILABLE = True
        helper = getattr(c10d, _HELPER)
        if not getattr(helper, "__mpidist__", False):
            setattr(c10d, _HELPER, _with_real_store(helper))


def _create(options: Any, backend_options: Any = None) -> Any:
    """The ``"mpidist"`` creator torch calls (``extended_api=True``)."""
    from mpidist.torch.backend import _create_from_options

    return _create_from_options(options, backend_options)


# -- env:// under an MPI launcher ----------------------------------------------------------------
def _wrap_env_rendezvous() -> None:
    try:  # the module (torch.distributed.rendezvous is also the name of a function)
        rdzv = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:  # pragma: no cover - torch without distributed
        return
    table = getattr(rdzv, "_rendezvous_handlers", None)
    if isinstance(table, dict) and "env" in table and not getattr(table["env"], "__mpidist__", False):
        table["env"] = _env_from_mpi(table["env"])


def _env_from_mpi(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    @functools.wraps(original)
    def env_from_mpi(url: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if any(not os.environ.get(v, "").strip() for v in ENV_NEEDED):
            from mpidist.torch._rendezvous import fill_if_launched

            fill_if_launched()
        return original(url, *args, **kwargs)

    env_from_mpi.__mpidist__ = True  # type: ignore[attr-defined]
    return env_from_mpi


# -- the name "mpi" ------------------------------------------------------------------------------
def mpi_name_problem(c10d: Any) -> str:
    """Why torch's internals differ from what serving ``"mpi"`` relies on ('' if they match).

    Reads code objects only (names used, parameters), not source files: it runs at ``import torch``.
    """
    if not hasattr(c10d, "_MPI_AVAILABLE"):
        return "torch.distributed.distributed_c10d has no _MPI_AVAILABLE flag"
    helper = getattr(c10d, _HELPER, None)
    code = getattr(getattr(helper, "__wrapped__", helper), "__code__", None)
    if code is None:
        return f"torch.distributed.distributed_c10d has no {_HELPER} function"
    for name in ("ProcessGroupMPI", "create", "issubclass", "ProcessGroup"):
        if name not in code.co_names:
            return f"{_HELPER} no longer uses {name!r}"
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    if "timeout" not in params or "store" not in params:
        return f"{_HELPER} has no timeout or store parameter"
    available = getattr(getattr(c10d, "is_mpi_available", None), "__code__", None)
    if available is None or "_MPI_AVAILABLE" not in available.co_names:
        return "is_mpi_available no longer reads _MPI_AVAILABLE"
    return ""


class ProcessGroupMPI:
    """Stands in for torch's missing ``ProcessGroupMPI``: ``create`` builds a mpidist group named "mpi"."""

    @staticmethod
    def create(ranks: list[int]) -> Any:
        """Called by torch's ``_new_process_group_helper`` on the members of a new group."""
        caller = sys._getframe(1)  # the helper: its timeout is not passed to create()
        found = caller.f_locals if caller.f_code.co_name == _HELPER else {}
        timeout = found.get("timeout")
        if not isinstance(timeout, timedelta):
            timeout = sys.modules["torch.distributed"].default_pg_timeout
        from mpidist.torch.backend import create_process_group

        return create_process_group(list(ranks), -1, -1, timeout, None, MPI_NAME)


def _with_real_store(helper: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap torch's group helper: an "mpi" default group gets mpidist's store in place of torch's placeholder.

    torch makes the MPI default group with ``Store()`` ("MPI backend doesn't use store"), whose every
    method raises, so ``new_group(backend="gloo")`` on top of it fails inside torch.
    """
    store_at = helper.__code__.co_varnames.index("store")

    @functools.wraps(helper)
    def helper_with_store(*args: Any, **kwargs: Any) -> Any:
        result = helper(*args, **kwargs)
        store = kwargs["store"] if "store" in kwargs else args[store_at] if len(args) > store_at else None
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        if type(store) is c10d.Store and isinstance(result, tuple) and getattr(result[0], "mpidist_backend", False):
            from mpidist.torch._store import give_real_store

            give_real_store(result[0])
        return result

    helper_with_store.__mpidist__ = True  # type: ignore[attr-defined]
    return helper_with_store
