"""torch's ``env://`` rendezvous under an MPI launcher, with nothing set by the user.

``init_process_group("mpidist")`` (and any other backend) reads ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in torch's ``env://``
handler. Under ``mpiexec``/``srun`` nobody sets them, so the handler is wrapped:
when the process was started by an MPI launcher and one of them is missing,
torchrun's variables are derived from MPI first
(:func:`mpidist.launch.environment.fill_environment`; values the user set are
kept). Otherwise torch's handler runs unchanged.

This replaces an entry of torch's private handler table
(``torch.distributed.rendezvous._rendezvous_handlers["env"]``); where that table
is missing, nothing is patched and torch asks for the variables as usual.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Iterator

from ..launch.boot import launch_mode
from ..launch.environment import fill_environment

__all__ = ["install", "NEEDED"]

#: what torch's env:// handler needs
NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _wrap(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def env_from_mpi(url: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if launch_mode() == "launcher" and any(not os.environ.get(v, "").strip() for v in NEEDED):
            fill_environment()
        return original(url, *args, **kwargs)

    env_from_mpi.__wrapped__ = original  # type: ignore[attr-defined]
    return env_from_mpi


def install() -> bool:
    """Wrap torch's env:// handler (idempotent); return False where torch's table is not there."""
    try:  # the module (torch.distributed.rendezvous is also the name of a function)
        rdzv = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    table = getattr(rdzv, "_rendezvous_handlers", None)
    if not isinstance(table, dict) or "env" not in table:
        return False
    if getattr(table["env"], "__wrapped__", None) is None:
        table["env"] = _wrap(table["env"])
    return True
