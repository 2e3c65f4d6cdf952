"""``ProcessGroup``: a set of ranks with a backend, and rank translation."""

from __future__ import annotations

import operator
from datetime import timedelta
from typing import Any

from ._device import DeviceArray
from ._world import world
from .backends.base import BaseBackend
from .errors import RankNotInGroupError

__all__ = [
    "backend_for",
    "ProcessGroup",
    "GroupMember",
    "group",
    "resolve_group",
    "absent",
    "rank_int",
    "NON_GROUP_MEMBER",
]


class ProcessGroup:
    """A group of processes that communicate through one backend.

    Created by ``init_process_group`` (the default group) and ``new_group``;
    pass it as ``group=`` to any collective. ``rank()`` and ``size()`` are this
    process's rank in the group and the group's size; ``ranks`` lists the members'
    global ranks in group-rank order.
    """

    def __init__(
        self,
        impl: BaseBackend,
        control: Any,
        ranks: list[int],
        group_name: str,
        timeout: timedelta,
        backend_name: str,
        devices: dict[str, str],
        comm: Any = None,
        group_desc: str = "",
        device_factory: Any = None,
    ) -> None:
        self.impl = impl  # the backend for host arrays (for a cuda-only group: its device backend)
        self.control = control  # MPIBackend over a private duplicate: library traffic
        self.ranks = ranks
        self.group_name = group_name
        self.group_desc = group_desc or group_name
        self.timeout = timeout
        self.backend_name = backend_name
        self.devices = devices
        self._comm = comm
        self._identity = ranks == list(range(len(ranks)))
        self._group_of = {g: i for i, g in enumerate(ranks)}
        self.destroyed = False
        self.host_ok = "cpu" in devices
        self._device_factory = device_factory  # builds the backend for device arrays, on first use
        self.device_impl: BaseBackend | None = None
        self._other_device_impl: BaseBackend | None = None

    def device_backend(self, fn: str, arr: Any) -> BaseBackend:
        """Return the backend for a call on device arrays (``arr`` is one of them), made on first use."""
        d = self.device_impl
        if d is None or not d.takes(arr):
            other = self._other_device_impl  # e.g. stand-in arrays on a group whose GPU backend is NCCL
            if d is not None and other is not None and other.takes(arr):
                return other
            if self._device_factory is None:
                raise TypeError(
                    f"{fn}: process group {self.group_name} (backend {self.backend_name}) takes no device arrays"
                )
            made = self._device_factory(self, fn, arr)
            if d is None:
                self.device_impl = made
            else:
                self._other_device_impl = made
            d = made
        return d

    def host_backend(self, fn: str) -> BaseBackend:
        """Return the backend for a call on host arrays, or raise if the group has none."""
        if not self.host_ok:
            raise TypeError(
                f"{fn}: process group {self.group_name} has backend {self.backend_name}, which takes CUDA "
                "arrays only; got a host array (numpy or CPU tensor); create the group with "
                "backend='cpu:mpi,cuda:nccl' to use both"
            )
        return self.impl

    def packing_backend(self) -> BaseBackend:
        """The backend for host buffers mpidist packs itself (``*_coalesced``): the host backend, or on a
        device-only group (``backend="nccl"``) the MPI backend of the group's private communicator."""
        return self.impl if self.host_ok else self.control

    def rank(self) -> int:
        """Return this process's rank in the group."""
        return self.impl.rank

    def size(self) -> int:
        """Return the number of processes in the group."""
        return self.impl.size

    def name(self) -> str:
        """Return the backend's name (torch's ``ProcessGroup.name()``)."""
        return self.backend_name

    def shutdown(self) -> None:
        """Mark the group destroyed and free its backend and communicators."""
        if self.destroyed:
            return
        self.destroyed = True
        for d in (self._other_device_impl, self.device_impl):
            if d is not None and d is not self.impl:
                d.shutdown()
        self.impl.shutdown()
        self.control.shutdown()
        if self._comm is not None and not (self.impl.pending() or self.control.pending()):
            self._comm.Free()  # else left allocated, see MPIBackend.shutdown

    @property
    def mpi_comm(self) -> Any:
        """The group's private MPI communicator (an ``mpi4py.MPI.Comm``), for use with mpi4py."""
        return self._comm

    def group_rank(self, global_rank: int, fn: str = "get_group_rank", arg: str = "global_rank") -> int:
        """Translate a global rank into this group's rank, or raise RankNotInGroupError."""
        global_rank = rank_int(global_rank, fn, arg)
        r = self._group_of.get(global_rank)
        if r is None:
            raise RankNotInGroupError(
                f"{fn}: {arg}={global_rank} is not a member of process group {self.group_name} "
                f"(its global ranks: {_short(self.ranks)})"
            )
        return r

    def global_rank(self, group_rank: int, fn: str = "get_global_rank", arg: str = "group_rank") -> int:
        """Translate a rank of this group into a global rank, or raise RankNotInGroupError."""
        group_rank = rank_int(group_rank, fn, arg)
        if not 0 <= group_rank < len(self.ranks):
            raise RankNotInGroupError(
                f"{fn}: {arg}={group_rank} is out of range for process group {self.group_name} "
                f"of size {len(self.ranks)}"
            )
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        state = " destroyed" if self.destroyed else ""
        return (
            f"<ProcessGroup {self.group_name!r} backend={self.backend_name} "
            f"ranks={_short(self.ranks)} rank={self.rank()}{state}>"
        )


def backend_for(pg: ProcessGroup, fn: str, *arrays: Any) -> BaseBackend:
    """Return the backend for a call on prepared ``arrays`` (arrays, lists of arrays, or None).

    Host arrays go to the group's host backend; if any array is a device array, the
    call goes to the group's device backend (NCCL, or MPI CUDA-aware/staged).
    """
    for a in arrays:
        if type(a) is DeviceArray:
            return pg.device_backend(fn, a)
        if type(a) is list:
            for x in a:
                if type(x) is DeviceArray:
                    return pg.device_backend(fn, x)
    return pg.impl if pg.host_ok else pg.host_backend(fn)


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def rank_int(rank: Any, fn: str, arg: str) -> int:
    """Return ``rank`` as an int (numpy integers accepted), or raise TypeError."""
    if isinstance(rank, bool) or not hasattr(rank, "__index__"):
        raise TypeError(f"{fn}: {arg} must be an int rank, got {type(rank).__name__}")
    return operator.index(rank)


class _NonGroupMember:
    """What ``new_group`` returns on ranks outside the group."""

    _instance: _NonGroupMember | None = None

    def __new__(cls) -> _NonGroupMember:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"

    def __reduce__(self) -> str:
        return "NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember()


class _WorldMeta(type):
    """Gives ``group.WORLD``/``GroupMember.WORLD``: the default group, or None before init."""

    @property
    def WORLD(cls) -> ProcessGroup | None:  # noqa: N802 - torch's name
        return world.default_pg


class group(metaclass=_WorldMeta):  # noqa: N801 - torch's name
    """``group.WORLD`` is the default process group."""


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` (the default group) and ``GroupMember.NON_GROUP_MEMBER``."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


def _not_initialized(fn: str) -> RuntimeError:
    return RuntimeError(f"{fn}: the default process group is not initialized; call mpidist.init_process_group() first")


def absent(grp: Any, fn: str) -> None:
    """What a call does when ``world.default_pg if grp is None else resolve_group(grp)`` gave None.

    Raise before ``init_process_group``; else (a non-member) return None.
    """
    if grp is None:
        raise _not_initialized(fn)
    return None


def resolve_group(grp: Any, fn: str) -> ProcessGroup | None:
    """Return the group a call runs on, None for a non-member, or raise.

    ``None`` means the default group; raises RuntimeError before
    ``init_process_group`` or on a destroyed group, TypeError for a non-group.
    """
    if grp is None:
        pg = world.default_pg
        if pg is None:
            raise _not_initialized(fn)
        return pg
    if isinstance(grp, ProcessGroup):
        if grp.destroyed:
            raise RuntimeError(f"{fn}: process group {grp.group_name!r} has been destroyed")
        return grp
    if grp is NON_GROUP_MEMBER:
        if world.default_pg is None:
            raise _not_initialized(fn)
        return None
    raise TypeError(f"{fn}: group must be a ProcessGroup (or None for the default group), got {type(grp).__name__}")
