"""The environment torchrun gives a program, for programs started by an MPI launcher.

Programs written for torchrun read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ... from the environment. Under ``mpiexec``, ``mpirun`` or
``srun`` nobody sets them. :func:`torchrun_environment` derives them from MPI
(one collective: the shared-memory split gives the local ranks, rank 0 picks a
free port) and :func:`fill_environment` sets the ones the user has not set;
a value already in the environment is never overridden.

Example (``mpiexec -n 2``)::

    >>> from mpidist.launch.environment import fill_environment
    >>> fill_environment()
    >>> os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]
    ('0', '2')
"""

from __future__ import annotations

import errno
import os
import random
import socket
from typing import Any, Mapping

__all__ = [
    "TORCHRUN_VARIABLES",
    "LAUNCHER_FIELDS",
    "launcher_environment",
    "torchrun_environment",
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


#: torchrun's per-process variables as MPI launchers spell them: (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)
LAUNCHER_FIELDS = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH's hydra, Intel MPI
    (  # Open MPI
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),  # fmt: skip
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),  # srun
)


def launcher_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` from the launcher's own variables.

    No MPI call and no communication (``import mpidist`` runs this under a
    launcher). The first launcher of :data:`LAUNCHER_FIELDS` whose rank and size
    are both set wins; local values are included when it gives them. The rest of
    torchrun's variables (node rank, ``MASTER_ADDR``/``MASTER_PORT``) need the
    processes to talk: :func:`torchrun_environment`.
    """
    environ = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    for fields in LAUNCHER_FIELDS:
        values = [environ.get(f, "").strip() for f in fields]
        if values[0].isdigit() and values[1].isdigit():
            return {n: v for n, v in zip(names, values) if v.isdigit()}
    return {}


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


def torchrun_environment(comm: Any = None) -> dict[str, str]:
    """Return torchrun's variables for this process, derived from MPI (collective over ``comm``).

    ``comm`` defaults to a private duplicate of ``MPI.COMM_WORLD`` (MPI is
    initialized if it is not yet). Every process of the communicator must call it.
    ``MASTER_ADDR`` is ``127.0.0.1`` on one node, else rank 0's address;
    ``MASTER_PORT`` is rank 0's ``MASTER_PORT`` if it has one, else a free port
    there. Nodes are numbered by their lowest rank.
    """
    from .boot import start_mpi

    mpi = start_mpi()
    own = comm is None
    if own:
        comm = mpi.COMM_WORLD.Dup()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(mpi.COMM_TYPE_SHARED, key=rank)
        try:
            local_rank, local_size = node.Get_rank(), node.Get_size()
            leader = node.bcast(rank, root=0)  # the lowest rank of this node
        finally:
            node.Free()
        proposal = None
        if rank == 0:
            port = os.environ.get("MASTER_PORT", "").strip()
            proposal = (socket.gethostname(), port if port.isdigit() else str(free_port()))
        leaders = sorted(r for r in comm.allgather(rank if local_rank == 0 else None) if r is not None)
        host0, port = comm.bcast(proposal, root=0)
    finally:
        if own:
            comm.Free()
    nodes = len(leaders)
    node_rank = leaders.index(leader)  # nodes numbered by their lowest rank
    address = "127.0.0.1" if nodes == 1 else _address_of(host0)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": address,
        "MASTER_PORT": port,
    }


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def fill_environment(values: Mapping[str, str] | None = None, environ: Any = None) -> dict[str, str]:
    """Set every torchrun variable missing from ``environ`` (default ``os.environ``); return what was set.

    ``values`` defaults to :func:`torchrun_environment` (collective: every
    process must call this). Values the user set are never changed.
    """
    environ = os.environ if environ is None else environ
    if values is None:
        values = torchrun_environment()
    added = {k: v for k, v in values.items() if not environ.get(k, "").strip()}
    environ.update(added)
    return added
