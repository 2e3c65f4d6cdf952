"""torchrun's variables derived from MPI, for ``python -m mpidist`` and env:// under a launcher.

Under ``mpiexec``/``srun`` the launcher's variables give ``RANK`` and ``WORLD_SIZE``
(:mod:`.environment`); the rest (``LOCAL_RANK`` where the launcher has none,
``GROUP_RANK``, ``MASTER_ADDR`` across hosts, a free ``MASTER_PORT``) takes one
collective over MPI: the shared-memory split gives the local ranks, rank 0 picks
a port and the address the others reach.

Example (``mpiexec -n 2``)::

    >>> from mpidist.launch.environment import fill_environment
    >>> from mpidist.launch.from_mpi import torchrun_environment
    >>> fill_environment(torchrun_environment())   # collective: every rank
    >>> os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]
    ('0', '0')
"""

from __future__ import annotations

import os
import socket
from typing import Any

from .._auth import SECRET_ENV, new_secret
from .addresses import meeting_address, own_addresses
from .environment import free_port
from .rendezvous import start_world

__all__ = ["torchrun_environment", "root_address"]


def torchrun_environment(comm: Any = None) -> dict[str, str]:
    """Return torchrun's variables for this process, derived from MPI (collective over ``comm``).

    ``comm`` defaults to a private duplicate of ``MPI.COMM_WORLD`` (MPI is
    initialized if it is not yet). Every process of the communicator must call it.
    ``MASTER_ADDR`` is ``127.0.0.1`` on one node, else rank 0's address (:func:`root_address`);
    ``MASTER_PORT`` is rank 0's ``MASTER_PORT`` if it has one, else a free port
    there. Nodes are numbered by their lowest rank. ``MPIDIST_SECRET`` is rank 0's
    (its own, or a fresh one), sent over MPI: the processes a rank starts with this
    environment can meet without a launcher, and only they (docs/security.md).
    """
    mpi = start_world("torchrun_environment")
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
            secret = os.environ.get(SECRET_ENV, "").strip() or new_secret().hex()
            proposal = (port if port.isdigit() else str(free_port()), secret)
        leaders = sorted(r for r in comm.allgather(rank if local_rank == 0 else None) if r is not None)
        port, secret = comm.bcast(proposal, root=0)  # the secret travels over MPI only
        address = root_address(comm, single_node=len(leaders) == 1)
    finally:
        if own:
            comm.Free()
    if address is None:
        raise RuntimeError(
            "torchrun_environment: the ranks span several hosts, but rank 0's host has no address other than "
            "loopback that they reach; set MASTER_ADDR to an address of rank 0's host that the others reach"
        )
    nodes = len(leaders)
    node_rank = leaders.index(leader)  # nodes numbered by their lowest rank
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
        SECRET_ENV: secret,
    }


def root_address(comm: Any, single_node: bool) -> str | None:
    """The address rank 0 advertises to every rank (collective over ``comm``; the same on every rank).

    ``127.0.0.1`` on one node; across hosts ``MASTER_ADDR`` if rank 0 resolves it to
    an address that is not loopback, else the address of rank 0's interface
    towards the ranks on other hosts (never ``gethostbyname(gethostname())``: that
    is ``127.0.1.1`` on Debian). None on every rank when rank 0 has none.
    """
    if single_node:
        return "127.0.0.1"
    hostname = socket.gethostname()
    gathered = comm.gather((hostname, own_addresses()), root=0)
    address = None
    if comm.Get_rank() == 0:
        peers = [a for host, addresses in gathered for a in addresses if host != hostname]
        address = meeting_address(os.environ.get("MASTER_ADDR", "").strip() or None, peers)
    return comm.bcast(address, root=0)
