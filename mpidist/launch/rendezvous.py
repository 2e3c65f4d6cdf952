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

import importlib
import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from .._auth import JobKey, SecretKey, munge_key, secret_from_env
from .._world import world
from ..errors import DistBackendError, DistNetworkError
from .addresses import meeting_address, own_addresses
from .slurm import slurm_step

__all__ = [
    "Plan",
    "plan_from",
    "store_for",
    "launch_free_world",
    "launch_key",
    "start_world",
    "agent_store_in_use",
    "join_agent_store",
]

_KEY = "mpidist/boot"
_log = logging.getLogger("mpidist.launch")


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


def store_for(plan: Plan, rank: int, world_size: int, timeout: timedelta, fn: str, key: JobKey | None = None) -> Any:
    """Open the store a tcp://, env:// or file:// plan names (rank 0 hosts a TCPStore; torchrun's agent's).

    A TCPStore mpidist opens takes the job's ``key``: only processes that prove it get in.
    """
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
    return TCPStore(plan.host, plan.port, world_size, rank == 0, timeout, wait_for_workers=False, secret=key)


def launch_key(fn: str) -> JobKey | None:
    """The key of a world no MPI launcher forms: ``MPIDIST_SECRET`` (or its file); in an srun step, munge's.

    None where there is neither (the start is not authenticated; rank 0 warns).
    """
    secret = secret_from_env(fn)
    if secret is not None:
        return SecretKey(secret)
    if slurm_step() is not None:
        return munge_key()
    return None


def _warn_unauthenticated(fn: str, plan: Plan) -> None:
    """Rank 0's one warning that this world's listeners admit any process that reaches them."""
    where = f"{plan.host}:{plan.port}" if plan.host else "the store"
    why = (
        "munged does not answer on this node, and MPIDIST_SECRET is not set"
        if slurm_step() is not None
        else "MPIDIST_SECRET is not set"
    )
    message = (
        f"{fn}: this start is not authenticated ({why}): any process that reaches {where} or rank 0's PMI "
        "server can join the job as one of its ranks and send it data. Give every process the same "
        "MPIDIST_SECRET (or MPIDIST_SECRET_FILE), or start the job with mpiexec or mpidistrun; see docs/security.md"
    )
    _log.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _claim(store: Any, rank: int, me: dict[str, Any], fn: str) -> None:
    """Take ``rank`` in the store; a second process claiming it fails the start on every rank.

    The first claimant's record stays; a later one raises DistNetworkError naming
    both, and marks the conflict, so that rank 0 stops the start for everyone.
    """
    if int(store.add(f"{_KEY}/claims/{rank}", 1)) == 1:
        store.set(f"{_KEY}/host/{rank}", json.dumps(me))
        return
    first = json.loads(store.get(f"{_KEY}/host/{rank}").decode())
    message = _conflict_message(fn, rank, first, me)
    store.set(f"{_KEY}/conflict", message)
    store.add(f"{_KEY}/conflicts", 1)
    store.add(f"{_KEY}/told/{rank}", 1)
    raise DistNetworkError(message)


#: how long rank 0 keeps its store for the other ranks to read that the start is stopped (seconds)
_TELL_S = 10.0


def _wait_told(store: Any, size: int, timeout_s: float) -> None:
    """Wait until ranks 1..size-1 have read why the start stopped (or ``timeout_s`` passes)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(range(1, size))
    while waiting and time.monotonic() < deadline:
        waiting = [r for r in waiting if not int(store.add(f"{_KEY}/told/{r}", 0))]
        if waiting:
            time.sleep(0.02)


def _conflict_message(fn: str, rank: int, first: dict[str, Any], second: dict[str, Any]) -> str:
    def who(p: dict[str, Any]) -> str:
        return f"host {p.get('host', '?')} pid {p.get('pid', '?')}"

    return (
        f"{fn}: rank {rank} is claimed by two processes: {who(first)} and {who(second)}; the start is stopped on "
        "every rank (was a process started twice, or with the wrong RANK?)"
    )


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

    Every process writes its host name and addresses; rank 0 starts the PMI server
    (on loopback when every process shares its host, else on an address the other
    hosts reach) and publishes its address. Rank 0 then waits until every other
    process has connected to the server before it starts MPI itself: ``MPI_Init``
    holds the interpreter lock, so rank 0's store could not answer a process still
    talking to it (its last reply would never go out, and that process would fail).

    Raises:
        ValueError: the rank or world size is not stated, or out of range.
        RuntimeError: the MPI library cannot be started this way (not MPICH), or
            the processes span hosts and rank 0's has no address the others reach.
        DistBackendError: not every process reached the PMI server within the timeout.
    """
    rank, size = plan.rank, plan.world_size
    if rank < 0 or size < 1 or rank >= size:
        raise ValueError(
            f"{fn}: this process was not started by an MPI launcher, so mpidist needs its rank and the "
            f"world size (rank={rank}, world_size={size}): pass them, put them in the init_method URL, or set "
            "RANK and WORLD_SIZE (env://); or start every process with `mpiexec -n N python script.py`"
        )
    loading = _load_mpi_meanwhile()
    if loading is None:
        _require_pmi1(fn)  # decided before anyone meets (loads MPI's library)
    key = launch_key(fn)
    if store is None:
        store = store_for(plan, rank, size, timeout, fn, key)
    me = {"host": socket.gethostname(), "addresses": own_addresses(), "pid": os.getpid()}
    _claim(store, rank, me, fn)
    if rank == 0:
        if key is None:
            _warn_unauthenticated(fn, plan)
        peers = [json.loads(store.get(f"{_KEY}/host/{r}").decode()) for r in range(size)]
        hosts = [p["host"] for p in peers]
        if len(set(hosts)) == 1:
            host: str | None = "127.0.0.1"
        else:
            others = [a for p in peers if p["host"] != me["host"] for a in p["addresses"]]
            host = meeting_address(plan.host, others)
        if host is None:
            store.set(f"{_KEY}/pmi", "")
            raise RuntimeError(_no_address(fn, hosts))
        if int(store.add(f"{_KEY}/conflicts", 0)):  # add: every store has it (check is not required)
            store.set(f"{_KEY}/pmi", json.dumps({"conflict": True}))
            _wait_told(store, size, min(timeout.total_seconds(), _TELL_S))  # this store dies with rank 0
            raise DistNetworkError(store.get(f"{_KEY}/conflict").decode())
        from .pmi import start_server_process

        world.pmi_server, address = start_server_process(host, size, hosts, timeout.total_seconds(), key)
        store.set(f"{_KEY}/pmi", json.dumps({"address": address, "env": _mpi_settings(len(set(hosts)))}))
        step = slurm_step()
        how = (
            f"srun started {step.size} tasks without a process manager this MPI library uses"
            if step is not None and step.size == size
            else "no MPI launcher"
        )
        _log.info("%s: %s: forming the world of %d processes through the store; PMI server at %s", fn, how, size, address)
    published = store.get(f"{_KEY}/pmi").decode()
    if loading is not None:
        loading.join()
        _require_pmi1(fn)
    if not published:
        raise RuntimeError(_no_address(fn, None))
    meeting = json.loads(published)
    if meeting.get("conflict"):
        message = store.get(f"{_KEY}/conflict").decode()
        store.add(f"{_KEY}/told/{rank}", 1)
        raise DistNetworkError(message)
    address = meeting["address"]
    from .pmi import connect

    pmi_env = connect(address, key, rank, size, timeout.total_seconds())
    if rank == 0:
        from .pmi import wait_others_connected

        missing = wait_others_connected(world.pmi_server, timeout.total_seconds())
        if missing:
            raise DistBackendError(
                f"{fn}: ranks {missing} of {size} did not reach MPI's start within the timeout of {timeout} "
                "(they met at the store but never connected to rank 0's PMI server: check that they can reach "
                "it, and for ranks that failed)"
            )
    settings = {k: v for k, v in meeting["env"].items() if k not in os.environ}  # the user's own choice wins
    return store, {**pmi_env, **settings}


def _load_mpi_meanwhile() -> threading.Thread | None:
    """Import ``mpi4py.MPI`` on a thread of its own while the processes meet; None where that must come first.

    Loading MPI's library and mpi4py's module takes 0.15-0.2 s (measured under
    torchrun on 2 ranks), most of a launcher-free start, and the meeting is mostly
    waiting on the store (the other processes, rank 0's PMI server): done together,
    the start is that much shorter. Only with the MPICH wheel installed
    (:func:`~mpidist.launch.boot.installed_library`, read without loading MPI), where
    ``_require_pmi1`` is expected to pass: elsewhere it decides first, as before.
    Importing starts nothing (MPI starts later, on the main thread).
    """
    from .boot import installed_library

    if "mpi4py.MPI" in sys.modules or installed_library() != "mpich":
        return None
    thread = threading.Thread(target=_import_mpi, name="mpidist-load-mpi", daemon=True)
    thread.start()
    return thread


def _import_mpi() -> None:
    try:
        importlib.import_module("mpi4py.MPI")
    except Exception:  # noqa: BLE001 - the main thread imports it again and raises the error itself
        pass


def _mpi_settings(hosts: int) -> dict[str, str]:
    """MPI settings rank 0 chooses for every process of a world it forms (the same on all of them).

    Across hosts, MPICH's UCX network module crashes the survivors (SIGSEGV inside
    MPI's progress) when a peer dies or its host vanishes; its OFI module reports
    the failure and mpidist's timeout then names the missing rank (measured with a
    rank killed on one of 3 simulated hosts: UCX, 1 of 2 survivors crashed; OFI,
    both raised DistBackendError). Set ``MPIR_CVAR_CH4_NETMOD`` to choose yourself.
    """
    from .boot import mpi_library

    if hosts > 1 and mpi_library().startswith("mpich") and "MPIR_CVAR_CH4_NETMOD" not in os.environ:
        return {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    return {}


def _no_address(fn: str, hosts: list[str] | None) -> str:
    spread = f" ({', '.join(sorted(set(hosts)))})" if hosts else ""
    return (
        f"{fn}: the processes run on several hosts{spread}, but rank 0's host has no address other than "
        "loopback that the others can reach; set MASTER_ADDR to such an address of rank 0's host "
        "(a host name that resolves to 127.0.1.1 in /etc/hosts does not count)"
    )


def start_world(fn: str, timeout: timedelta = timedelta(minutes=30)) -> Any:
    """Start MPI (if it is not yet) with every process the launcher started; return ``mpi4py.MPI``.

    Where MPI alone would make each task of an srun step a world of one
    (:func:`~mpidist.launch.boot.launch_mode` ``"slurm"``), the tasks meet first at
    ``MASTER_ADDR:MASTER_PORT`` (set at import from the step: its first node and a
    port derived from the job and step ids). For callers that need MPI before
    ``init_process_group`` (``mpidist.testing``, ``torchrun_environment``).
    """
    from .boot import launch_mode, mpi_initialized, require_startable, start_mpi

    require_startable(fn)
    if mpi_initialized() or launch_mode() != "slurm":
        return start_mpi()
    step = slurm_step()
    assert step is not None  # launch_mode says so
    port = os.environ.get("MASTER_PORT", "").strip()
    plan = Plan(
        "env",
        step.rank,
        step.size,
        host=os.environ.get("MASTER_ADDR", "").strip() or step.master_host,
        port=int(port) if port.isdigit() else step.port,
    )
    store, pmi_env = launch_free_world(plan, None, timeout, fn)
    world.boot_store = store  # rank 0 serves it: kept open for the process's life (a few idle sockets)
    return start_mpi(pmi_env)


def speaks_pmi1() -> bool:
    """Whether this process's MPI library can be started without a launcher (PMI-1: MPICH, Intel MPI)."""
    from .boot import mpi_library  # reads mpi4py.MPI, not yet initialized (see boot.py)

    return mpi_library() in ("mpich", "mpich+pmix", "intel")


def _require_pmi1(fn: str) -> None:
    from mpi4py import MPI  # not initialized yet (see boot.py)

    if speaks_pmi1():
        return
    library = MPI.Get_library_version()
    first = library.splitlines()[0].strip() if library else "this MPI library"
    step = slurm_step()
    if step is not None:
        raise RuntimeError(
            f"{fn}: srun started {step.size} tasks (this is task {step.rank}) without a process manager that "
            f"{first} can use, so MPI would make each task a world of its own. Start the step with "
            "`srun --mpi=pmix` (Open MPI speaks only PMIx; `srun --mpi=list` shows what this Slurm offers), "
            "or use the MPICH wheel (pip install mpidist[mpich]), which mpidist connects under any --mpi"
        )
    raise RuntimeError(
        f"{fn}: this process was not started by an MPI launcher, and {first} cannot be connected "
        "without one (mpidist starts such worlds through PMI-1, which MPICH speaks). Start the job "
        "with `mpiexec -n N python script.py` (or mpirun, srun --mpi=pmix), or install the MPICH "
        "wheel (pip install mpidist[mpich])"
    )
