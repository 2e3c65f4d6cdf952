"""Creating process groups: ``new_group``, ``new_subgroups``, rank translation.

Every group is a private MPI communicator derived from the library's control
communicator (a duplicate of ``MPI.COMM_WORLD``, so group ranks and global ranks
agree with MPI's world ranks). ``new_group`` uses ``MPI_Comm_create`` (every rank
calls) or, with ``use_local_synchronization=True``, ``MPI_Comm_create_group``
(only members call). Subgroups come from one ``MPI_Comm_split``.
"""

from __future__ import annotations

import contextlib
import zlib
from datetime import timedelta
from typing import Any, Sequence

from ._validate import bool_arg, timeout_arg
from ._world import world
from .backends.base import BaseBackend
from .backends.registry import (
    Backend,
    BackendOptions,
    create_backend,
    nccl_available,
    nccl_usable,
    parse_backend,
    requested_name,
)
from .process_group import NON_GROUP_MEMBER, ProcessGroup, rank_int, resolve_group
from .store import PrefixStore

__all__ = [
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    "make_group",
]


def make_group(
    comm: Any,
    ranks: list[int],
    devices: dict[str, str],
    timeout: timedelta,
    pg_options: Any,
    name: str,
    group_desc: str | None = None,
    requested: str | None = None,
) -> ProcessGroup:
    """Build and register the ProcessGroup of ``comm`` (this rank is a member).

    ``devices`` maps device types to the backends that serve them; ``requested``
    is the backend name the program asked for (what ``get_backend`` reports,
    e.g. "gloo" served by MPI; default: the serving backend's name).

    The group owns ``comm`` and a private duplicate of it for library traffic
    (object collectives, subgroup creation), driven by its own MPI backend. Its
    backend sees the default store through a ``PrefixStore`` of its own.
    """
    from .backends.mpi import MPIBackend  # imports mpi4py.MPI: deferred, import mpidist must not start MPI

    backend_name = devices.get("cpu") or devices["cuda"]
    store = None
    if world.store is not None:
        store = PrefixStore(f"mpidist/group/{name}", world.store)
    options = BackendOptions(store, comm.Get_rank(), comm.Get_size(), timeout, name, list(ranks), comm)
    control_comm = comm.Dup()
    first = device = None
    try:
        first = create_backend(backend_name, options, pg_options)
        cuda = devices.get("cuda", backend_name)
        if cuda != backend_name and (cuda != Backend.NCCL or nccl_available()):
            # e.g. cpu:mpi,cuda:nccl: made now, collectively. Without a usable NCCL (no GPU, no
            # cupy) the group still runs host arrays; a GPU array then gets a clear error.
            device = create_backend(cuda, options, pg_options)
    except BaseException:
        if first is not None:
            with contextlib.suppress(Exception):
                first.shutdown()
        control_comm.Free()
        comm.Free()
        raise
    host: BaseBackend | None = first
    if "cpu" not in devices:  # a device-only group (nccl, cuda:mpi): its backend serves device arrays only
        host = None
        if isinstance(first, MPIBackend):
            from .backends.mpi_device import MPIDeviceBackend  # only device-only groups need it at creation

            device = MPIDeviceBackend(first, owns_inner=True)
        else:
            device = first
    control = MPIBackend(
        control_comm, timeout.total_seconds(), f"{name}/control", owns_comm=True, global_ranks=list(ranks)
    )
    pg = ProcessGroup(
        host,
        device,
        control,
        list(ranks),
        name,
        timeout,
        requested or backend_name,
        devices,
        comm,
        group_desc or "",
        _DeviceMaker(options, pg_options, first),
    )
    world.register_group(pg)
    return pg


class _DeviceMaker:
    """Makes a group's backend for device arrays that its named backends do not take, on first use.

    A group whose device backend was named (``cuda:nccl``, ``cuda:mpi``, ``nccl``) got
    it at creation; this covers the rest: ``backend=None`` sends device arrays to NCCL
    when cupy's NCCL bindings and a GPU are there, else (and for arrays a GPU runtime
    does not manage, such as ``mpidist.testing.HostCudaArray``) through the MPI
    backend, CUDA-aware or staged (``backends/mpi_device.py``).
    """

    def __init__(self, options: BackendOptions, pg_options: Any, first: BaseBackend) -> None:
        self.options = options
        self.pg_options = pg_options
        self.first = first  # the group's first backend (an MPIBackend unless a third party's)

    def __call__(self, pg: ProcessGroup, fn: str, arr: Any) -> BaseBackend:
        from .backends.mpi import MPIBackend  # deferred: see make_group
        from .backends.mpi_device import MPIDeviceBackend

        wanted = pg.devices.get("cuda")
        if wanted in (None, Backend.NCCL) and nccl_usable(arr):
            if wanted is None:
                return create_backend(Backend.NCCL, self.options, self.pg_options)
            raise TypeError(
                f"{fn}: process group {pg.group_name} has no NCCL communicator (it was created without a usable NCCL)"
            )
        if not isinstance(self.first, MPIBackend):
            raise TypeError(
                f"{fn}: process group {pg.group_name} (backend {pg.backend_name}) cannot take this device "
                f"array ({arr!r}); name a device backend, e.g. backend='cpu:mpi,cuda:mpi'"
            )
        return MPIDeviceBackend(self.first)


def _rank_list(ranks: Any, size: int, fn: str, arg: str = "ranks", sort: bool = True) -> list[int]:
    """``ranks`` checked (ints in the world, no repeats), sorted unless ``sort`` is False (then in the order given)."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (list, tuple, range, set, frozenset)):
        raise TypeError(f"{fn}: {arg} must be a list of int ranks, got {type(ranks).__name__}")
    out = [rank_int(r, fn, arg) for r in ranks]
    bad = [r for r in out if not 0 <= r < size]
    if bad:
        raise ValueError(f"{fn}: {arg} contains rank(s) {bad} outside the world of size {size}")
    if len(set(out)) != len(out):
        dups = sorted({r for r in out if out.count(r) > 1})
        raise ValueError(f"{fn}: {arg} lists rank(s) {dups} more than once")
    return sorted(out) if sort else out


def _group_settings(fn: str, timeout: Any, backend: Any) -> tuple[ProcessGroup, timedelta, dict[str, str], str]:
    """(default group, timeout, device -> serving backend, the backend name asked for) of a new group."""
    default = resolve_group(None, fn)
    assert default is not None
    td = default.timeout if timeout is None else timeout_arg(timeout, fn, default.timeout)
    if backend is None:  # the default group's backend, under the name it was asked by
        return default, td, default.devices, default.backend_name
    return default, td, parse_backend(backend, fn), requested_name(backend)


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup | Any:
    """Create a process group of the global ``ranks`` (all ranks if None).

    Every rank of the default group must call it, in the same order, unless
    ``use_local_synchronization=True``: then only the members call it (MPI's
    group-local communicator creation). Group ranks follow the sorted global ranks,
    or with ``sort_ranks=False`` the order of ``ranks`` (group rank ``i`` is
    ``ranks[i]``; every caller must then pass the same list in the same order).

    Returns the new ProcessGroup on members and ``GroupMember.NON_GROUP_MEMBER``
    elsewhere; collectives on that are no-ops and ``get_rank`` of it is -1.

    Args:
        ranks: The members' global ranks; None means every rank.
        timeout: The group's timeout for each call (timedelta or seconds); None
            means the default group's.
        backend: The group's backend name (see ``init_process_group``); None
            means the default group's.
        pg_options: Passed to a registered backend's factory.
        use_local_synchronization: True: only the members call ``new_group``.
        group_desc: A description of the group, shown in debug output.
        device_id: Accepted for torch compatibility; unused.
        sort_ranks: False: group rank ``i`` is ``ranks[i]`` instead of following
            the sorted global ranks.

    Returns:
        The ``ProcessGroup`` on its members, ``GroupMember.NON_GROUP_MEMBER`` on
        the other ranks.

    Raises:
        TypeError: ``ranks`` is not a list of int ranks, or ``timeout``,
            ``backend`` or ``sort_ranks`` has the wrong type.
        ValueError: ``ranks`` has a rank outside the world or a rank twice, or
            ``backend`` is not a known backend.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: not every rank called ``new_group`` within the default
            group's timeout.

    Examples:
        >>> odd = dist.new_group([1, 3])  # under mpiexec -n 4
        >>> dist.get_rank(odd)
        -1  # rank 0 and rank 2
        0  # rank 1
        1  # rank 3
        >>> rev = dist.new_group([1, 0], sort_ranks=False)
        >>> dist.get_rank(rev)
        1  # rank 0
        0  # rank 1
        -1  # rank 2 and rank 3
    """
    fn = "new_group"
    sort_ranks = bool_arg(sort_ranks, fn, "sort_ranks")
    default, td, devices, requested = _group_settings(fn, timeout, backend)
    size = default.size()
    members = list(range(size)) if ranks is None else _rank_list(ranks, size, fn, sort=sort_ranks)
    me = world.default_pg.rank() if world.default_pg is not None else -1
    control = world.control_comm
    with world.lock:
        mpi_group = control.Get_group().Incl(members)
        try:
            if use_local_synchronization:
                if me not in members:
                    return NON_GROUP_MEMBER
                digest = zlib.crc32(",".join(map(str, members)).encode())
                comm = control.Create_group(mpi_group, digest % 32768)
                # members create their groups in the same order: count per member set
                count = world.local_group_counts.get(digest, 0)
                world.local_group_counts[digest] = count + 1
                name = f"local-{digest:08x}-{count}"
            else:
                world.control.gate(fn)
                comm = control.Create(mpi_group)
                name = world.next_group_name()
        finally:
            mpi_group.Free()
        if me not in members:
            return NON_GROUP_MEMBER
        return make_group(comm, members, devices, td, pg_options, name, group_desc, requested)


def _split(
    fn: str,
    parent: Any,
    rank_lists: list[list[int]],
    td: timedelta,
    devices: dict[str, str],
    pg_options: Any,
    group_desc: str | None,
    requested: str,
) -> tuple[ProcessGroup | None, list[Any]]:
    """Create one group per list of global ranks with one MPI_Comm_split of ``parent`` (an MPIBackend); return (mine, all)."""
    from mpi4py import MPI

    me = world.default_pg.rank() if world.default_pg is not None else -1
    color = next((i for i, lst in enumerate(rank_lists) if me in lst), MPI.UNDEFINED)
    key = rank_lists[color].index(me) if color != MPI.UNDEFINED else 0
    with world.lock:
        parent.gate(fn)
        comm = parent.comm.Split(color, key)
        names = [world.next_group_name() for _ in rank_lists]
        mine = None
        if color != MPI.UNDEFINED:
            mine = make_group(comm, rank_lists[color], devices, td, pg_options, names[color], group_desc, requested)
    return mine, [mine if i == color else NON_GROUP_MEMBER for i in range(len(rank_lists))]


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[Any]]:
    """Split ``group`` (default: the world) into equal subgroups of ``group_size`` consecutive ranks.

    ``group_size`` defaults to the number of ranks per node (MPI's shared-memory
    split). Every member of ``group`` calls it (ranks outside it get a ValueError
    and are not needed). Returns
    ``(this rank's subgroup, list of all subgroups)``, non-member entries being
    ``GroupMember.NON_GROUP_MEMBER``.

    Args:
        group_size: Ranks per subgroup; it must divide the size of ``group``. None
            means the number of ranks on this node.
        group: The group to split; None is the default group.
        timeout: The subgroups' timeout (timedelta or seconds); None means the
            default group's.
        backend: The subgroups' backend name; None means the default group's.
        pg_options: Passed to a registered backend's factory.
        group_desc: A description of the subgroups, shown in debug output.

    Returns:
        ``(mine, subgroups)``: this rank's subgroup, and every subgroup in order
        (``GroupMember.NON_GROUP_MEMBER`` for those this rank is not in).

    Raises:
        TypeError: ``group_size`` is not an int, or ``timeout`` or ``backend``
            has the wrong type.
        ValueError: ``group_size`` is not positive or does not divide the size of
            ``group``, or this rank is not a member of ``group``.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: not every member of ``group`` called it within the
            group's timeout.

    Examples:
        >>> mine, subgroups = dist.new_subgroups(2)  # under mpiexec -n 4: {0, 1} and {2, 3}
        >>> dist.get_process_group_ranks(mine)
        [0, 1]  # rank 0 and rank 1
        [2, 3]  # rank 2 and rank 3
    """
    fn = "new_subgroups"
    _, td, devices, requested = _group_settings(fn, timeout, backend)
    parent = resolve_group(group, fn)
    if parent is None:
        raise ValueError(f"{fn}: this rank is not a member of the group to split")
    n = parent.size()
    if group_size is None:
        group_size = world.init_info.node_size
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"{fn}: group_size must be an int, got {type(group_size).__name__}")
    if group_size <= 0:
        raise ValueError(f"{fn}: group_size must be positive, got {group_size}")
    if group_size > n or n % group_size:
        raise ValueError(f"{fn}: the group size {n} must be divisible by group_size={group_size}")
    lists = [parent.ranks[i : i + group_size] for i in range(0, n, group_size)]
    return _split(
        fn,
        parent.control if group is not None else world.control,
        lists,
        td,
        devices,
        pg_options,
        group_desc,
        requested,
    )


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[Any]]:
    """Create one subgroup per list of global ranks; a rank may be in at most one.

    Every rank of the default group calls it. Returns ``(this rank's subgroup or
    None, list of all subgroups)``.

    Args:
        ranks_per_subgroup_list: One list of global ranks per subgroup; the lists
            must not overlap.
        timeout: The subgroups' timeout (timedelta or seconds); None means the
            default group's.
        backend: The subgroups' backend name; None means the default group's.
        pg_options: Passed to a registered backend's factory.
        group_desc: A description of the subgroups, shown in debug output.

    Returns:
        ``(mine, subgroups)``: this rank's subgroup (None if it is in none), and
        every subgroup in order (``GroupMember.NON_GROUP_MEMBER`` for those this
        rank is not in).

    Raises:
        TypeError: ``ranks_per_subgroup_list`` is not a list of lists of int ranks.
        ValueError: it is empty, a rank is outside the world or in two subgroups.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: not every rank called it within the default group's
            timeout.

    Examples:
        >>> mine, subgroups = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])  # mpiexec -n 4
        >>> dist.get_process_group_ranks(mine)
        [0, 2]  # rank 0 and rank 2
        [1, 3]  # rank 1 and rank 3
    """
    fn = "new_subgroups_by_enumeration"
    default, td, devices, requested = _group_settings(fn, timeout, backend)
    if not isinstance(ranks_per_subgroup_list, (list, tuple)):
        raise TypeError(
            f"{fn}: ranks_per_subgroup_list must be a list of lists of ranks, got {type(ranks_per_subgroup_list).__name__}"
        )
    if not ranks_per_subgroup_list:
        raise ValueError(f"{fn}: ranks_per_subgroup_list must be a non-empty list of lists of ranks")
    lists = [
        _rank_list(r, default.size(), fn, f"ranks_per_subgroup_list[{i}]")
        for i, r in enumerate(ranks_per_subgroup_list)
    ]
    seen: dict[int, int] = {}
    for i, lst in enumerate(lists):
        for r in lst:
            if r in seen:
                raise ValueError(
                    f"{fn}: rank {r} appears in subgroups {seen[r]} and {i} of ranks_per_subgroup_list; "
                    "subgroups must not overlap"
                )
            seen[r] = i
    return _split(fn, world.control, lists, td, devices, pg_options, group_desc, requested)


def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: list[list[int]] | None = None,
    timeout: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: Any = None,
) -> ProcessGroup | None:
    """Split ``parent_pg`` into disjoint groups of its ranks, with one ``MPI_Comm_split``.

    Every member of ``parent_pg`` calls it with the same ``split_ranks``. Unlike
    ``new_subgroups_by_enumeration``, the ranks are ``parent_pg``'s group ranks,
    each list is sorted, and a rank in no list gets None. Works on any MPI library
    (torch runs it on NCCL only).

    Args:
        parent_pg: The group to split; None is the default group.
        split_ranks: Lists of group ranks of ``parent_pg``, not overlapping; a rank
            in none of them gets None.
        timeout: The new groups' timeout (timedelta or seconds); None means the
            default group's.
        pg_options: Passed to a registered backend's factory.
        group_desc: A description of the new group, shown in debug output.
        backend: The new groups' backend; None means ``parent_pg``'s.

    Returns:
        This rank's new ``ProcessGroup``, or None if it is in no list.

    Raises:
        TypeError: ``split_ranks`` is not a list of lists of int ranks.
        ValueError: ``split_ranks`` is None or empty, a list is empty or has a rank
            twice or outside ``parent_pg``, two lists overlap, or this rank is not
            a member of ``parent_pg``.
        DistBackendError: not every member of ``parent_pg`` called it within the
            timeout.

    Examples:
        >>> pair = dist.split_group(split_ranks=[[0, 1], [2, 3]])  # mpiexec -n 4
        >>> dist.get_process_group_ranks(pair)
        [0, 1]  # rank 0 and rank 1
        [2, 3]  # rank 2 and rank 3
    """
    fn = "split_group"
    parent = resolve_group(parent_pg, fn)
    if parent is None:
        raise ValueError(f"{fn}: this rank is not a member of parent_pg")
    if split_ranks is None or (isinstance(split_ranks, (list, tuple)) and not split_ranks):
        raise ValueError(f"{fn}: split_ranks must be a non-empty list of lists of ranks, got {split_ranks!r}")
    if not isinstance(split_ranks, (list, tuple)):
        raise TypeError(f"{fn}: split_ranks must be a list of lists of ranks, got {type(split_ranks).__name__}")
    lists = [_rank_list(r, parent.size(), fn, f"split_ranks[{i}]") for i, r in enumerate(split_ranks)]
    seen: dict[int, int] = {}
    for i, lst in enumerate(lists):
        if not lst:
            raise ValueError(f"{fn}: split_ranks[{i}] is empty")
        for r in lst:
            if r in seen:
                raise ValueError(f"{fn}: rank {r} is in split_ranks[{seen[r]}] and split_ranks[{i}]; splits must not overlap")
            seen[r] = i
    if backend is None:
        devices, requested = parent.devices, parent.backend_name
    else:
        devices, requested = parse_backend(backend, fn), requested_name(backend)
    td = parent.timeout if timeout is None else timeout_arg(timeout, fn, parent.timeout)
    global_lists = [[parent.ranks[r] for r in lst] for lst in lists]
    mine, _ = _split(fn, parent.control, global_lists, td, devices, pg_options, group_desc, requested)
    return mine


def _member_group(group: Any, fn: str) -> ProcessGroup:
    pg = resolve_group(group, fn)
    if pg is None:
        raise ValueError(f"{fn}: this rank is not a member of the group")
    return pg


def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """Translate a global rank into a rank of ``group`` (RankNotInGroupError if absent).

    Args:
        group: The group; None is the default group.
        global_rank: A rank of the default group.

    Returns:
        ``global_rank``'s rank in ``group``.

    Raises:
        RankNotInGroupError: ``global_rank`` is not a member of ``group``.
        ValueError: this rank is not a member of ``group``.
        TypeError: ``global_rank`` is not an int, or ``group`` not a process group.

    Examples:
        >>> rev = dist.new_group([1, 0], sort_ranks=False)
        >>> dist.get_group_rank(rev, 0)
        1  # rank 0 and rank 1
    """
    return _member_group(group, "get_group_rank").group_rank(global_rank)


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """Translate a rank of ``group`` into a global rank.

    Args:
        group: The group; None is the default group.
        group_rank: A rank of ``group``.

    Returns:
        The global rank of ``group``'s member ``group_rank``.

    Raises:
        RankNotInGroupError: ``group_rank`` is out of range for ``group``.
        ValueError: this rank is not a member of ``group``.
        TypeError: ``group_rank`` is not an int, or ``group`` not a process group.

    Examples:
        >>> rev = dist.new_group([1, 0], sort_ranks=False)
        >>> dist.get_global_rank(rev, 0)
        1  # rank 0 and rank 1
    """
    return _member_group(group, "get_global_rank").global_rank(group_rank)


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """Return the global ranks of ``group``'s members, in group-rank order.

    Args:
        group: The group; None is the default group.

    Returns:
        A list of global ranks: entry ``i`` is group rank ``i``.

    Raises:
        ValueError: this rank is not a member of ``group``.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        TypeError: ``group`` is not a process group.

    Examples:
        >>> dist.get_process_group_ranks(dist.new_group([1, 0], sort_ranks=False))
        [1, 0]  # rank 0 and rank 1
    """
    return list(_member_group(group, "get_process_group_ranks").ranks)
