"""The torch internals mpidist relies on, each with the check that tells whether this torch still has it.

torch's public extension points (``Backend.register_backend``, the entry point groups
``torch.backends`` and ``torch.distributed.backends``, ``dist.ProcessGroup`` subclasses,
``torch.futures.Future``) carry most of mpidist's torch integration. A few things go
beyond them; each is checked where it is used, before it is used, and has a way to
fail that names the difference instead of misbehaving. :func:`problems` runs every
check at once: the tests run it on every torch of ``_mpidist_autoload.TESTED_TORCH``,
and ``docs/design.md`` ("The torch internals mpidist relies on") says what to do when
one fails on a new torch.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable

import torch

import _mpidist_autoload as autoload

__all__ = ["CHECKS", "problems"]


def _c10d() -> Any:
    return sys.modules["torch.distributed.distributed_c10d"]


def _mpi_name() -> str:
    return autoload.mpi_name_problem(_c10d())


def _env_handlers() -> str:
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    table = getattr(rendezvous, "_rendezvous_handlers", None)
    if not isinstance(table, dict) or "env" not in table:
        return "torch.distributed.rendezvous._rendezvous_handlers has no 'env' handler"
    return ""


def _group_registry() -> str:
    registry = getattr(_c10d(), "_world", None)
    for name in ("pg_map", "pg_names"):
        if not isinstance(getattr(registry, name, None), dict):
            return f"torch.distributed.distributed_c10d._world has no {name} table"
    return ""


def _monitored_barrier() -> str:
    barrier = getattr(_c10d(), "monitored_barrier", None)
    if barrier is None:
        return "torch.distributed.distributed_c10d has no monitored_barrier"
    params = list(inspect.signature(barrier).parameters)
    if params[:3] != ["group", "timeout", "wait_all_ranks"]:
        return f"monitored_barrier takes {params}, not (group, timeout, wait_all_ranks)"
    return ""


def _future_unwrap() -> str:
    if not callable(getattr(torch.futures.Future, "_set_unwrap_func", None)):
        return "torch.futures.Future has no _set_unwrap_func"
    return ""


def _reduce_op_hash() -> str:
    from .backend import _HASH_IS_KIND

    return "" if _HASH_IS_KIND else "hash(ReduceOp) is not its kind's number (each call reads .op.value: slower)"


#: what mpidist relies on -> its check ('' where this torch has it). Where each check runs in normal use,
#: and what a failure does, is in docs/design.md.
CHECKS: dict[str, Callable[[], str]] = {
    "the name 'mpi' (flag, helper or creator table)": _mpi_name,
    "env:// handler table": _env_handlers,
    "group registry (_world.pg_map, pg_names)": _group_registry,
    "monitored_barrier's module function": _monitored_barrier,
    "Future._set_unwrap_func": _future_unwrap,
    "hash(ReduceOp) is the kind": _reduce_op_hash,
}


def problems() -> dict[str, str]:
    """Run every check: ``{internal: what differs}`` for those this torch lacks (empty when all match).

    Returns:
        The internals whose check failed, each with its reason.

    Examples:
        >>> from mpidist.torch import _internals
        >>> _internals.problems()  # on every torch of _mpidist_autoload.TESTED_TORCH
        {}
    """
    found = {name: check() for name, check in CHECKS.items()}
    return {name: why for name, why in found.items() if why}
