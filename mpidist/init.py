"""Starting and ending mpidist: ``init_process_group``, ``destroy_process_group`` and queries.

Under an MPI launcher (``mpiexec``, ``mpirun``, ``srun`` with PMI) rank and world
size come from MPI; a plain ``python script.py`` is a world of one process.
Arguments and environment variables that name a rank or world size are checked
against MPI on every rank together, so all ranks raise the same ValueError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import time
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

from ._auth import new_secret
from ._validate import env_flag, int_arg, timeout_arg
from ._world import InitInfo, world
from .backends.registry import Backend, nccl_available, nccl_importable, parse_backend, requested_name
from .diagnose.debug import DebugLevel, logger, set_debug_level_from_env
from .errors import DefaultGroupStateError, DistBackendError
from .groups import make_group
from .launch.abort import abort_after_timeout
from .launch.boot import (
    launch_mode,
    launcher_label,
    launcher_numbers,
    mpi_initialized,
    require_startable,
    start_mpi,
    world_of_one_hint,
)
from .launch.from_mpi import root_address
from .launch.rendezvous import launch_free_world, plan_from
from .process_group import ProcessGroup, not_initialized, resolve_group
from .work import oversubscribed, poll

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_gloo_available",
    "is_ucc_available",
    "is_backend_available",
    "is_torchelastic_launched",
    "get_backend",
    "get_rank",
    "get_world_size",
    "get_node_local_rank",
    "get_pg_count",
    "get_default_store",
    "default_pg_timeout",
]

default_pg_timeout = timedelta(minutes=30)
"""torch.distributed's default timeout for process groups: 30 minutes (a ``datetime.timedelta``).

Examples:
    >>> dist.default_pg_timeout
    datetime.timedelta(seconds=1800)
"""

_SCHEMES = ("env", "tcp", "file")


#: the range rank/world_size arguments take (-1: not stated, MPI or the environment says)
_FROM_MPI = "-1 (take it from MPI) or a non-negative int"


def _claims(init_method: str | None, rank: int, world_size: int, fn: str) -> list[tuple[str, str, int]]:
    """Collect every place that states a rank or world size: (where, what, value)."""
    claims: list[tuple[str, str, int]] = []
    if rank != -1:
        claims.append(("the rank argument", "rank", rank))
    if world_size != -1:
        claims.append(("the world_size argument", "world_size", world_size))
    scheme = "env"
    if init_method is not None:
        if not isinstance(init_method, str):
            raise TypeError(f"{fn}: init_method must be a URL string, got {type(init_method).__name__}")
        url = urlparse(init_method)
        scheme = url.scheme
        if scheme not in _SCHEMES:
            raise ValueError(f"{fn}: init_method {init_method!r} must start with env://, tcp:// or file://")
        query = parse_qs(url.query)
        for what in ("rank", "world_size"):
            if what in query:
                try:
                    claims.append((f"init_method's {what}=", what, int(query[what][0])))
                except ValueError:
                    raise ValueError(f"{fn}: init_method's {what}= must be an int, got {query[what][0]!r}") from None
    if scheme == "env" or launch_mode() == "slurm":
        for var, what in (("RANK", "rank"), ("WORLD_SIZE", "world_size")):
            text = os.environ.get(var)
            if text is not None and text.strip():
                try:
                    claims.append((f"the environment variable {var}", what, int(text)))
                except ValueError:
                    raise ValueError(f"{fn}: environment variable {var}={text!r} is not an int") from None
    return claims


def _disagreements(claims: list[tuple[str, str, int]], mpi_rank: int, mpi_size: int) -> str:
    actual = {"rank": mpi_rank, "world_size": mpi_size}
    bad = [
        f"{where} says {what}={value} but MPI says {actual[what]}"
        for where, what, value in claims
        if value != actual[what]
    ]
    if not bad:
        return ""
    msg = "; ".join(bad)
    if mpi_size == 1 and any(what == "world_size" and value > 1 for _, what, value in claims):
        msg += ". MPI's world has 1 process: " + world_of_one_hint()
    return msg


class _Phases:
    """Where ``init_process_group``'s time goes: (phase, seconds) in order, printed at ``MPIDIST_DEBUG=INFO``."""

    __slots__ = ("start", "last", "parts")

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.parts: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """The time since the previous mark was spent in ``phase``."""
        now = time.perf_counter()
        self.parts.append((phase, now - self.last))
        self.last = now

    def report(self, rank: int, size: int) -> str:
        """``"init_process_group: rank 0 of 4 in 0.31 s: MPI start 0.120 s, ..."``."""
        spent = ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in self.parts)
        return f"init_process_group: rank {rank} of {size} in {self.last - self.start:.3f} s: {spent}"


def _agree(comm: Any, local_error: str, fn: str, offer: Any = None) -> Any:
    """Raise the same ValueError on every rank if any rank found a problem; else return rank 0's ``offer``.

    One reduction (O(log n)) of (problem?, rank 0?, offer) by MAX: ``offer`` (rank 0's only; the
    default store's address, see ``_offer_store``) travels with the agreement instead of in a
    broadcast of its own. The texts of the problems travel only when one failed.
    """
    from mpi4py import MPI

    # only rank 0's tuple has True second, so ties never compare two offers
    failed, _, offered = comm.allreduce((bool(local_error), comm.Get_rank() == 0, offer), op=MPI.MAX)
    if not failed:
        return offered
    errors = comm.allgather(local_error)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    raise ValueError(f"{fn}: " + " | ".join(bad))


def init_process_group(
    backend: Any = None,
    init_method: str | None = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Initialize the default process group (the world) over MPI.

    Args:
        backend: ``"mpi"`` (default when None), a registered backend, or a
            per-device string such as ``"cpu:mpi,cuda:nccl"``.
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file:///path``.
            Under an MPI launcher the processes are already connected; a rank or
            world size it states (``?rank=0&world_size=4``) is checked against MPI.
        timeout: bound on every blocking call of the group (timedelta or
            seconds; default 30 minutes).
        world_size: Optional (-1: from MPI); must agree with MPI when given, as
            must ``WORLD_SIZE`` with ``env://``. Without a launcher, the number of
            processes that meet through ``init_method`` or ``store``.
        rank: Optional (-1: from MPI); must agree with MPI when given, as must
            ``RANK`` with ``env://``. Without a launcher, this process's rank.
        store: a key-value store; mutually exclusive with ``init_method``.
        group_name: ignored (deprecated in torch).
        pg_options: passed to the backend factory.
        device_id: accepted for torch compatibility; unused for host arrays.

    Raises:
        DefaultGroupStateError: already initialized (a ValueError, as in torch, and a RuntimeError).
        TypeError: ``backend`` or ``init_method`` is not a string, ``store`` lacks
            ``set``/``get``/``add``/``wait``, or ``rank``, ``world_size`` or
            ``timeout`` has the wrong type.
        ValueError: a rank or world size disagrees with MPI (the same error on
            every rank); an unknown backend or ``"ucc"``; an ``init_method`` other
            than ``env://``, ``tcp://`` or ``file://``; both ``init_method`` and
            ``store``; ``tcp://`` or ``file://`` without a launcher and without
            the world size and rank.
        RuntimeError: MPI cannot start the world asked for here (the message says
            why and what to do), or the processes cannot reach each other.
        DistBackendError: not every rank called ``init_process_group`` within
            ``timeout``.

    Examples:
        >>> import mpidist as dist
        >>> dist.init_process_group()  # under mpiexec -n 2
        >>> dist.get_rank(), dist.get_world_size()
        (0, 2)  # rank 0
        (1, 2)  # rank 1
    """
    fn = "init_process_group"
    phases = _Phases()
    with world.lock:
        if world.default_pg is not None:
            raise DefaultGroupStateError(
                f"{fn}: the default process group is already initialized; call destroy_process_group() first"
            )
        td = timeout_arg(timeout, fn, default_pg_timeout)
        devices = parse_backend(backend, fn)
        if init_method is not None and store is not None:
            raise ValueError(f"{fn}: init_method and store are mutually exclusive; pass one of them")
        rank = int_arg(rank, fn, "rank", -1, _FROM_MPI)
        world_size = int_arg(world_size, fn, "world_size", -1, _FROM_MPI)
        claims = _claims(init_method, rank, world_size, fn)
        if store is not None:
            _check_store(store, fn)
        plan = plan_from(init_method, store, claims, fn)
        if plan.scheme in ("tcp", "file") and plan.world_size < 0 and launch_mode() == "none":
            # each process would start a world of its own; torch raises here too
            raise ValueError(
                f"{fn}: init_method {init_method!r} without an MPI launcher needs the world size and this "
                "process's rank: pass world_size= and rank=, or add ?rank=R&world_size=N to the URL "
                "(RANK and WORLD_SIZE are read with env:// only, as in torch)"
            )
        set_debug_level_from_env()

        require_startable(fn)
        phases.mark("checks")
        met = None  # the store through which processes without a launcher met
        if plan.world_size > 1 and not mpi_initialized() and launch_mode() != "launcher":
            met, pmi_env = launch_free_world(plan, store, td, fn)
            phases.mark("meeting without a launcher")
            start_mpi(pmi_env)
        else:
            start_mpi()
        from mpi4py import MPI  # initialized now

        phases.mark("MPI start")
        from .backends.mpi import MPIBackend

        phases.mark("imports")

        # nonblocking, so that a rank that never calls init_process_group cannot hang the others
        control, joined = MPI.COMM_WORLD.Idup()
        if not poll(joined.Test, td.total_seconds()):
            raise DistBackendError(
                f"{fn}: not every rank called init_process_group within the timeout of {td}; "
                "start every rank with the same program and check for ranks that failed earlier"
            )
        phases.mark("Idup")
        node = made = None  # the node split; the default store rank 0 opened
        try:
            mpi_rank, mpi_size = control.Get_rank(), control.Get_size()
            problem = _disagreements(claims, mpi_rank, mpi_size)
            numbers = launcher_numbers()
            if problem and mpi_size == 1 and numbers is not None and numbers[1] > 1:
                # the launcher started several processes but each is a world of one: each raises alone,
                # named by the launcher's numbers (MPI calls every one of them rank 0)
                raise ValueError(f"{fn}: {launcher_label()}{problem}")
            node = control.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_rank)
            phases.mark("node split")
            # the default store: on one node rank 0 opens it now, and its address and secret travel with the
            # agreement (across nodes the address takes a collective of its own, below)
            own_store = met is None and store is None
            offer = None
            if own_store and node.Get_size() == mpi_size and mpi_rank == 0:
                offer, made = _offer_store("127.0.0.1", mpi_size, td)
            offered = _agree(control, problem, fn, offer)
            phases.mark("agreement on rank and size")  # and the default store's address
            data = MPI.COMM_WORLD.Dup()
            phases.mark("Dup")
        except BaseException:
            if made is not None:
                made.close()
            if node is not None:
                node.Free()
            control.Free()
            raise
        world.control_comm = control
        world.node_comm = node
        world.init_info = InitInfo(
            node_rank=node.Get_rank(),
            node_size=node.Get_size(),
            init_method=init_method or "env://",
            mpi_library=MPI.Get_library_version().splitlines()[0].strip(),
            tag_ub=int(control.Get_attr(MPI.TAG_UB)),
            oversubscribed=oversubscribed(node.Get_size()),
            on_timeout=abort_after_timeout if env_flag("MPIDIST_ABORT_ON_TIMEOUT") else None,
        )
        world.control = MPIBackend(control, td.total_seconds(), "world", global_ranks=list(range(mpi_size)))
        phases.mark("control backend")
        try:
            if not own_store:
                world.store = met or store
            elif offered is not None:
                world.store = _take_store(offered, made, mpi_size, td)
            else:
                world.store = _open_default_store(control, node.Get_size() == mpi_size, td)
            world.init_info.own_store = store is None
            phases.mark("default store")
            pg = make_group(
                data, list(range(mpi_size)), devices, td, pg_options, world.next_group_name(), "default_pg",
                requested_name(backend),
            )  # fmt: skip
            phases.mark("default group")
        except BaseException:
            _close_store()
            _free_world_comms()
            world.reset()
            raise
        world.default_pg = pg
        if world.debug_level >= DebugLevel.INFO:
            logger.info(phases.report(mpi_rank, mpi_size))


def replace_world(data: Any, pg_options: Any, group_desc: str) -> ProcessGroup:
    """Make ``data``, a communicator of some members of the default group, the world (``shrink_group``).

    Global ranks become ``data``'s ranks. Every other group is dropped without a word to its
    members (some may be dead), as is the old default group. mpidist's control communicator and
    node split follow; a default store mpidist opened is opened anew by the new rank 0 (the old
    one lived in the old rank 0's process, which may be dead); a store the program passed stays.
    """
    from mpi4py import MPI

    from .backends.mpi import MPIBackend

    old = world.default_pg
    assert old is not None
    td = old.timeout
    control = data.Dup()
    size = control.Get_size()
    node = control.Split_type(MPI.COMM_TYPE_SHARED, key=control.Get_rank())
    for member in list(world.groups.values()):
        member.abandon()
    world.unreleased.extend(c for c in (world.control_comm, world.node_comm) if c is not None)
    if world.stall is not None:
        world.stall.close()
        world.stall = None
    if world.init_info.own_store:
        with contextlib.suppress(Exception):
            world.store.close()
    world.groups = {}
    world.default_pg = None
    world.control_comm, world.node_comm = control, node
    world.init_info = dataclasses.replace(
        world.init_info,
        node_rank=node.Get_rank(),
        node_size=node.Get_size(),
        oversubscribed=oversubscribed(node.Get_size()),
        store_error="",
    )
    world.control = MPIBackend(control, td.total_seconds(), "world", global_ranks=list(range(size)))
    if world.init_info.own_store:
        world.store = _open_default_store(control, node.Get_size() == size, td)
    pg = make_group(
        data, list(range(size)), old.devices, td, pg_options, world.next_group_name(), group_desc, old.backend_name
    )
    world.default_pg = pg
    return pg


def _check_store(store: Any, fn: str) -> None:
    missing = [m for m in ("set", "get", "add", "wait") if not callable(getattr(store, m, None))]
    if missing:
        raise TypeError(
            f"{fn}: store must be a key-value store (mpidist.TCPStore, FileStore, HashStore, PrefixStore or "
            f"one with set/get/add/wait), got {type(store).__name__} without {', '.join(missing)}"
        )


def _open_default_store(comm: Any, single_node: bool, timeout: timedelta) -> Any:
    """Rank 0 opens a TCPStore on a free port and tells the others (collective over ``comm``).

    The store takes a fresh secret that rank 0 sends with its address over MPI:
    only the job's processes get in (see docs/security.md).

    It listens on loopback when every rank shares its node, else on the address
    :func:`~mpidist.launch.from_mpi.root_address` picks (``MASTER_ADDR``, or the
    interface towards the other hosts; never a loopback one). If rank 0 cannot open
    one, no rank has a default store and ``get_default_store()`` says why; the
    process group works regardless.
    """
    host = root_address(comm, single_node)
    found, made = _offer_store(host, comm.Get_size(), timeout) if comm.Get_rank() == 0 else (None, None)
    return _take_store(comm.bcast(found, root=0), made, comm.Get_size(), timeout)  # the secret travels over MPI only


def _offer_store(host: str | None, size: int, timeout: timedelta) -> tuple[tuple[str, Any, bytes], Any]:
    """Rank 0 opens the default TCPStore on ``host``: ((error, (host, port), secret), the store or None)."""
    from .store import TCPStore

    try:
        if host is None:
            raise RuntimeError(
                "the ranks span several hosts, but rank 0's host has no address other than loopback that they "
                "reach; set MASTER_ADDR to an address of rank 0's host"
            )
        secret = new_secret()
        made = TCPStore(host, 0, size, True, timeout, wait_for_workers=False, secret=secret, _connect_later=True)
        return ("", (host, made.port), secret), made
    except Exception as exc:  # noqa: BLE001 - any failure: report it on every rank
        return (f"{type(exc).__name__}: {exc}", None, b""), None


def _take_store(found: tuple[str, Any, bytes], made: Any, size: int, timeout: timedelta) -> Any:
    """Every rank: the default store from rank 0's offer (``made`` on rank 0), or None with the error kept."""
    from .store import TCPStore

    error, address, secret = found
    if error:
        world.init_info.store_error = error
        return None
    if made is not None:
        return made
    # the clients (rank 0's too) connect with their first request: init_process_group does not wait for
    # rank 0's server to shake hands with every rank in turn (many programs never use the store; the
    # stall diagnosis of a timeout does)
    return TCPStore(
        address[0], address[1], size, False, timeout, wait_for_workers=False, secret=secret,
        _connect_later=True,
    )  # fmt: skip


def get_default_store() -> Any:
    """Return the default process group's key-value store (shared by every rank).

    It is the ``store`` passed to ``init_process_group``, the store an
    ``init_method`` named when the processes met through it, or else a
    ``TCPStore`` that rank 0 opened on a free port. Each group sees it through its
    own ``PrefixStore``. A store mpidist opened closes in ``destroy_process_group``
    (rank 0 hosts it: finish using it on every rank first, e.g. with a barrier).

    Returns:
        The store (a ``Store``: ``TCPStore``, ``FileStore``, ... or the user's own).

    Raises:
        DefaultGroupStateError: ``init_process_group`` has not been called.
        RuntimeError: rank 0 could not open a store (the message says why); the
            process groups work without one.

    Examples:
        >>> store = dist.get_default_store()
        >>> if dist.get_rank() == 0:
        ...     store.set("answer", "42")
        >>> store.get("answer")  # waits until rank 0 has set it
        b'42'  # rank 0 and rank 1
    """
    fn = "get_default_store"
    if world.default_pg is None:
        raise not_initialized(fn)
    if world.store is None:
        raise RuntimeError(f"{fn}: rank 0 could not open a store: {world.init_info.store_error or 'unknown'}")
    return world.store


def _close_store() -> None:
    """Close the default store if mpidist opened it (a user's store stays open)."""
    close = getattr(world.store, "close", None)
    if world.init_info.own_store and callable(close):
        close()


def _free_world_comms() -> None:
    for comm in (world.node_comm, world.control_comm):
        if comm is not None and not (world.control is not None and world.control.pending()):
            comm.Free()


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy one process group, or all of them (and de-initialize) when ``group`` is None.

    Destroying the default group destroys every group. Afterwards
    ``init_process_group()`` may be called again; MPI itself stays initialized
    until the process exits. Every member of the group calls it.

    Args:
        group: The group to destroy; None (or the default group) destroys every
            group. On a rank outside ``group`` it does nothing.

    Raises:
        DefaultGroupStateError: ``init_process_group`` has not been called.
        RuntimeError: ``group`` has already been destroyed.
        TypeError: ``group`` is not a process group.

    Examples:
        >>> dist.destroy_process_group()
        >>> dist.is_initialized()
        False
        >>> dist.init_process_group()  # again, as often as needed
    """
    fn = "destroy_process_group"
    with world.lock:
        pg = resolve_group(group, fn)
        if pg is None:  # this rank is not a member: nothing to free here
            return
        if pg is world.default_pg:
            for member in list(world.groups.values()):
                member.shutdown()
            _close_store()
            _free_world_comms()
            world.reset()
        else:
            pg.shutdown()
            world.groups.pop(pg.group_name, None)


def is_initialized() -> bool:
    """Return True if the default process group is initialized.

    Returns:
        True between ``init_process_group`` and ``destroy_process_group``.

    Examples:
        >>> dist.is_initialized()
        True
    """
    return world.default_pg is not None


def is_available() -> bool:
    """Return True: mpidist is usable wherever it imports.

    Returns:
        True (torch answers whether it was built with distributed support).

    Examples:
        >>> dist.is_available()
        True
    """
    return True


def is_mpi_available() -> bool:
    """Return True if mpi4py (and with it an MPI library) can be used.

    Returns:
        True when mpi4py is importable.

    Examples:
        >>> dist.is_mpi_available()
        True
    """
    return importlib.util.find_spec("mpi4py") is not None


def is_nccl_available() -> bool:
    """Return True if cupy's NCCL bindings are installed.

    It does not import cupy, nor check that a GPU is present: ``is_backend_available("nccl")`` does.

    Returns:
        True when ``cupy.cuda.nccl`` can be imported.

    Examples:
        >>> dist.is_nccl_available()
        False  # without cupy
    """
    return nccl_importable()


def is_gloo_available() -> bool:
    """Return True: the name "gloo" is served (by MPI), so programs that check it take the gloo branch.

    Returns:
        True when MPI is available (``is_mpi_available()``).

    Examples:
        >>> dist.is_gloo_available()
        True
    """
    return is_mpi_available()


def is_ucc_available() -> bool:
    """Return False: mpidist has no ucc backend.

    Returns:
        False, always.

    Examples:
        >>> dist.is_ucc_available()
        False
    """
    return False


def is_backend_available(backend: str) -> bool:
    """Return True if ``backend`` names a backend mpidist can create.

    Args:
        backend: A backend name, any case: ``"mpi"``, ``"gloo"`` (served by MPI),
            ``"nccl"`` or a registered one.

    Returns:
        True for ``"mpi"`` and ``"gloo"`` when MPI is available, for ``"nccl"``
        when cupy's NCCL and a GPU are, and for backends registered with
        ``Backend.register_backend``; False otherwise.

    Raises:
        TypeError: ``backend`` is not a string.

    Examples:
        >>> dist.is_backend_available("mpi")
        True
        >>> dist.is_backend_available("ucc")
        False
    """
    if not isinstance(backend, str):
        raise TypeError(f"is_backend_available: backend must be a str, got {type(backend).__name__}")
    name = Backend(backend)
    if name in (Backend.MPI, Backend.GLOO):  # "gloo" is served by MPI
        return is_mpi_available()
    if name == Backend.NCCL:
        return nccl_available()  # cupy's NCCL bindings and a GPU
    entry = world.backends.get(name)
    return entry is not None and not entry.builtin


def is_torchelastic_launched() -> bool:
    """Return True if started by torchelastic (``TORCHELASTIC_RUN_ID`` is set).

    Returns:
        True under ``torchrun``, False under ``mpiexec``, ``srun`` or ``mpidistrun``.

    Examples:
        >>> dist.is_torchelastic_launched()
        False  # under mpiexec
    """
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def get_backend(group: ProcessGroup | None = None) -> Backend:
    """Return the backend name of ``group`` (default: the world) as the program asked for it: ``"mpi"``,
    ``"gloo"`` (served by MPI), ``"cpu:gloo,cuda:nccl"``, ...

    Args:
        group: The group; None is the default group.

    Returns:
        The name, lowercase (a ``Backend``, which is a ``str``). A group made
        without a ``backend`` has the default group's.

    Raises:
        ValueError: this rank is not a member of ``group``.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        TypeError: ``group`` is not a process group.

    Examples:
        >>> dist.get_backend()
        'mpi'
    """
    pg = resolve_group(group, "get_backend")
    if pg is None:
        raise ValueError("get_backend: this rank is not a member of the group")
    return Backend(pg.backend_name)


def get_rank(group: ProcessGroup | None = None) -> int:
    """Return this process's rank in ``group`` (default: the world); -1 if not a member.

    Args:
        group: The group; None is the default group.

    Returns:
        The rank, from 0 to the group's size - 1; -1 on ranks outside ``group``.

    Raises:
        DefaultGroupStateError: ``init_process_group`` has not been called.
        TypeError: ``group`` is not a process group.

    Examples:
        >>> dist.get_rank()
        0  # rank 0
        1  # rank 1
    """
    pg = resolve_group(group, "get_rank")
    return -1 if pg is None else pg.rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Return the size of ``group`` (default: the world); -1 if not a member.

    Args:
        group: The group; None is the default group.

    Returns:
        The number of processes in ``group``; -1 on ranks outside it.

    Raises:
        DefaultGroupStateError: ``init_process_group`` has not been called.
        TypeError: ``group`` is not a process group.

    Examples:
        >>> dist.get_world_size()
        2
    """
    pg = resolve_group(group, "get_world_size")
    return -1 if pg is None else pg.size()


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """Return this process's rank among the processes of its node.

    Taken from ``LOCAL_RANK`` if set, else from MPI's shared-memory split once
    initialized, else ``fallback_rank``. ``import mpidist`` sets ``LOCAL_RANK`` from
    the MPI launcher's variables where it finds them.

    Args:
        fallback_rank: What to return when neither of the above is known.

    Returns:
        The node-local rank.

    Raises:
        ValueError: ``LOCAL_RANK`` is not an integer.
        RuntimeError: none of the three is known.

    Examples:
        >>> dist.get_node_local_rank()  # both ranks on one node
        0  # rank 0
        1  # rank 1
    """
    text = os.environ.get("LOCAL_RANK")
    if text is not None:
        return int(text)
    if world.default_pg is not None:
        return world.init_info.node_rank
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "get_node_local_rank: LOCAL_RANK is not set, the process group is not initialized and no fallback_rank was given"
    )


def get_pg_count() -> int:
    """Return the number of live process groups (the default group included).

    Counts the groups this rank belongs to that have not been destroyed (torch
    counts every group ever created).

    Returns:
        The number of groups; 0 before ``init_process_group``.

    Examples:
        >>> dist.get_pg_count()
        1
        >>> pair = dist.new_group([0, 1])
        >>> dist.get_pg_count()
        2
    """
    return len(world.groups)
