"""Where the processes meet: the default store, and a world without an MPI launcher.

``init_process_group`` reads its ``init_method`` (``env://``, ``tcp://host:port``,
``file:///path``) or ``store`` into a :class:`Plan`, and:

* under an MPI launcher, MPI already connects the processes: the plan only
  names the default store (rank and size come from MPI and are checked);
* without one, the store is where the processes meet: each writes its host
  name, rank 0 starts a PMI server (``pmi.py``) and publishes its address, and
  every process initializes MPI against it, so that ``MPI.COMM_WORLD`` holds
  them all. This needs an MPI library that speaks PMI-1 (MPICH); with any
  other, a clear error says to start the job with ``mpiexec``.

Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``), torchrun's agent already
serves a store at ``MASTER_ADDR:MASTER_PORT``: every process joins it as a client
(torch's own ``TCPStore`` client: torch is there under torchrun), under the key
prefix of this restart attempt, as torch's workers do, instead of binding the port.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from .._world import world

__all__ = ["Plan", "plan_from", "store_for", "launch_free_world", "agent_store_in_use", "join_agent_store"]

_KEY = "mpidist/boot"


@dataclass
class Plan:
    """What the arguments and environment say about how to meet."""

    scheme: str  # "env", "tcp", "file" or "store"
    rank: int  # -1: not stated
    world_size: int  # -1: not stated
    host: str | None = None
    port: int | None = None
    path: str | None = None


def plan_from(init_method: str | None, store: Any, claims: list[tuple[str, str, int]], fn: str) -> Plan:
    """Read where to meet from the URL (or ``MASTER_ADDR``/``MASTER_PORT``) into a Plan.

    ``claims`` are init's validated statements of rank and world size (arguments
    first, then the URL's query, then ``RANK``/``WORLD_SIZE``); the first of each wins.
    """
    stated = {}
    for _, what, value in claims:
        stated.setdefault(what, value)
    rank, world_size = stated.get("rank", -1), stated.get("world_size", -1)
    if store is not None:
        return Plan("store", rank, world_size)
    url = urlparse(init_method or "env://")
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ValueError(f"{fn}: init_method {init_method!r} must be tcp://host:port")
        return Plan("tcp", rank, world_size, host=url.hostname, port=url.port)
    if url.scheme == "file":
        path = url.path if not url.netloc else f"/{url.netloc}{url.path}"
        if not path:
            raise ValueError(f"{fn}: init_method {init_method!r} must be file:///path/to/file")
        return Plan("file", rank, world_size, path=path)
    port = os.environ.get("MASTER_PORT", "").strip()
    if port and not port.isdigit():
        raise ValueError(f"{fn}: environment variable MASTER_PORT={port!r} is not a port number")
    return Plan(
        "env",
        rank,
        world_size,
        host=os.environ.get("MASTER_ADDR", "").strip() or None,
        port=int(port) if port else None,
    )


def store_for(plan: Plan, rank: int, world_size: int, timeout: timedelta, fn: str) -> Any:
    """Open the store a tcp://, env:// or file:// plan names (rank 0 hosts a TCPStore; torchrun's agent's)."""
    from ..store import FileStore, TCPStore

    if plan.scheme == "file":
        return FileStore(plan.path, world_size)
    if plan.host is None or plan.port is None:
        raise ValueError(
            f"{fn}: env:// needs MASTER_ADDR and MASTER_PORT in the environment (the address and a free "
            "port of rank 0), or start the processes with mpiexec"
        )
    if plan.scheme == "env" and agent_store_in_use():
        return join_agent_store(plan.host, plan.port, world_size, timeout, fn)
    return TCPStore(plan.host, plan.port, world_size, rank == 0, timeout, wait_for_workers=False)


def agent_store_in_use() -> bool:
    """True when torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT (torch's own test)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"


def join_agent_store(host: str, port: int, world_size: int, timeout: timedelta, fn: str) -> Any:
    """Join torchrun's agent store as a client, under this restart attempt's prefix (as torch's workers)."""
    try:
        import torch.distributed as tdist
    except ImportError as exc:  # torchrun always has torch beside it
        raise RuntimeError(
            f"{fn}: TORCHELASTIC_USE_AGENT_STORE is set (torchrun), but torch is not importable to join the "
            "agent's store; install torch in this environment or start the processes with mpiexec"
        ) from exc
    from ..store import PrefixStore
    from ..store.foreign import ForeignStore

    agent = tdist.TCPStore(host, port, world_size, False, timeout)  # a client: the agent is the server
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
    return PrefixStore(f"/worker/attempt_{attempt}", ForeignStore(agent))


def launch_free_world(plan: Plan, store: Any, timeout: timedelta, fn: str) -> tuple[Any, dict[str, str]]:
    """Meet through the store and start a PMI server on rank 0; return (store, PMI environment).

    Raises:
        ValueError: the rank or world size is not stated, or out of range.
        RuntimeError: the MPI library cannot be started this way (not MPICH).
    """
    rank, size = plan.rank, plan.world_size
    if rank < 0 or size < 1 or rank >= size:
        raise ValueError(
            f"{fn}: this process was not started by an MPI launcher, so mpidist needs its rank and the "
            f"world size (rank={rank}, world_size={size}): pass them, put them in the init_method URL, or set "
            "RANK and WORLD_SIZE (env://); or start every process with `mpiexec -n N python script.py`"
        )
    _require_pmi1(fn)
    if store is None:
        store = store_for(plan, rank, size, timeout, fn)
    store.set(f"{_KEY}/host/{rank}", socket.gethostname())
    if rank == 0:
        hosts = [store.get(f"{_KEY}/host/{r}").decode() for r in range(size)]
        host = "127.0.0.1" if len(set(hosts)) == 1 else (plan.host or socket.gethostbyname(socket.gethostname()))
        from .pmi import start_server_process

        world.pmi_server, address = start_server_process(host, size, hosts, timeout.total_seconds())
        store.set(f"{_KEY}/pmi", address)
    address = store.get(f"{_KEY}/pmi").decode()
    store.set(f"{_KEY}/got/{rank}", "1")
    if rank == 0:
        # MPI_Init holds the interpreter lock, so rank 0's store cannot answer once it is inside
        store.wait([f"{_KEY}/got/{r}" for r in range(size)])
    return store, {"PMI_PORT": address, "PMI_ID": str(rank)}


def speaks_pmi1() -> bool:
    """Whether this process's MPI library can be started without a launcher (PMI-1: MPICH, Intel MPI)."""
    from mpi4py import MPI  # not initialized yet (see boot.py)

    library = MPI.Get_library_version()
    return "MPICH" in library or "Intel(R) MPI" in library


def _require_pmi1(fn: str) -> None:
    from mpi4py import MPI  # not initialized yet (see boot.py)

    if not speaks_pmi1():
        library = MPI.Get_library_version()
        first = library.splitlines()[0].strip() if library else "this MPI library"
        raise RuntimeError(
            f"{fn}: this process was not started by an MPI launcher, and {first} cannot be connected "
            "without one (mpidist starts such worlds through PMI-1, which MPICH speaks). Start the job "
            "with `mpiexec -n N python script.py` (or mpirun, srun --mpi=pmix), or install the MPICH "
            "wheel (pip install mpidist[mpich])"
        )
