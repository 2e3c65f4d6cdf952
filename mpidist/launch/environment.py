"""The environment torchrun gives a program, for programs started by an MPI launcher.

Programs written for torchrun read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ... from the environment. Under ``mpiexec``, ``mpirun`` or
``srun`` nobody sets them. :func:`launcher_environment` reads what the
launcher gives (its own variables, Slurm's step) without any communication;
:func:`fill_environment` sets the ones the user has not set (a value already
in the environment is never overridden). What needs MPI (``MASTER_ADDR`` across
hosts, ``GROUP_RANK``) comes from :mod:`.from_mpi`.

Example (``mpiexec -n 2``)::

    >>> from mpidist.launch.environment import fill_environment, launcher_environment
    >>> fill_environment(launcher_environment())
    >>> os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]
    ('0', '2')
"""

from __future__ import annotations

import errno
import os
import random
import socket
from typing import Any, Mapping

from .slurm import slurm_step

__all__ = [
    "TORCHRUN_VARIABLES",
    "LAUNCHER_FIELDS",
    "launcher_environment",
    "fill_environment",
    "free_port",
]

#: what torchrun sets for every worker, and what this module provides
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


#: torchrun's per-process variables as MPI launchers spell them: (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE);
#: srun's are read by :mod:`.slurm` (its allocation-wide variables would mislead)
LAUNCHER_FIELDS = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH's hydra, Intel MPI, srun --mpi=pmi2
    (  # Open MPI
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),  # fmt: skip
)


def launcher_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun's variables that the launcher's own variables give (no MPI call, no communication).

    ``import mpidist`` runs this under a launcher. The first launcher of
    :data:`LAUNCHER_FIELDS` whose rank and size are both set gives ``RANK``,
    ``WORLD_SIZE`` and, where it has them, ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``. In
    an ``srun`` step whose rank and size agree (or that is the only launcher: PMIx,
    ``--mpi=none``), Slurm's variables give the rest: the local ones from
    ``SLURM_LOCALID`` and the step's tasks per node, ``GROUP_RANK``/``NODE_RANK``
    from ``SLURM_NODEID``, ``MASTER_ADDR`` (the step's first node) and
    ``MASTER_PORT`` (derived from the job and step ids). Under another launcher
    started inside a step (hydra's proxies under Slurm), Slurm's describe the
    proxies, so they are ignored. Elsewhere, node ranks and the master's address
    need the processes to talk: :func:`.from_mpi.torchrun_environment`.
    """
    environ = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    found: dict[str, str] = {}
    for fields in LAUNCHER_FIELDS:
        values = [environ.get(f, "").strip() for f in fields]
        if values[0].isdigit() and values[1].isdigit():
            found = {n: v for n, v in zip(names, values) if v.isdigit()}
            break
    step = slurm_step(environ)
    if step is None:
        return found
    slurm = step.torchrun_fields()
    slurm.update(MASTER_ADDR=step.master_host, MASTER_PORT=str(step.port))
    if found and (found["RANK"], found["WORLD_SIZE"]) != (slurm["RANK"], slurm["WORLD_SIZE"]):
        return found
    return {**slurm, **found}


def free_port() -> int:
    """Return a TCP port free on every interface a moment ago, from below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` lies in the ephemeral range, where
    any outgoing connection (MPI's own sockets among them) may take it before the
    store that was promised it binds; a port below that range is never taken that
    way. Falls back to ``bind(0)`` if no such port is free.
    """
    low, _ = _ephemeral_range()
    rng = random.Random()  # never the program's seeded generator
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12000), low)
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        if 2048 < low <= high:
            return low, high
    except (OSError, ValueError):
        pass
    return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    """True if ``port`` can be bound for listening on IPv4 (and IPv6 where the host has it)."""
    families = [(socket.AF_INET, "")] + ([(socket.AF_INET6, "::")] if socket.has_ipv6 else [])
    for family, host in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, port))
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue  # no IPv6 here
            return False
    return True


def fill_environment(values: Mapping[str, str], environ: Any = None) -> dict[str, str]:
    """Set every variable of ``values`` missing from ``environ`` (default ``os.environ``); return what was set.

    Values the user set are never changed. ``values`` come from
    :func:`launcher_environment` or :func:`~mpidist.launch.from_mpi.torchrun_environment`.
    """
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in values.items() if not environ.get(k, "").strip()}
    environ.update(added)
    return added
