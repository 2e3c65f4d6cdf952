"""Backend names (``Backend``), registration of third-party backends, construction."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from .._world import BackendEntry, world
from .base import BaseBackend

__all__ = [
    "Backend",
    "BackendOptions",
    "SERVED_BY",
    "parse_backend",
    "requested_name",
    "create_backend",
    "nccl_importable",
    "nccl_available",
    "nccl_usable",
]


#: torch's names that are always in ``Backend.backend_list``, in torch's order
_TORCH_NAMES = ("undefined", "gloo", "nccl", "ucc", "mpi")
#: the device type -> backend map before any registration (torch's, with MPI for cpu)
_DEVICE_DEFAULTS = {"cpu": "mpi", "cuda": "nccl"}
#: what torch's builtin backends can run (mpidist's own come from their registry entries)
_CAPABILITY_DEFAULTS = {"gloo": ["cpu"]}


class _BackendNames(type):
    """``Backend``'s class attributes that depend on registrations, computed from ``world.backends``.

    torch keeps them as class-level lists that ``register_backend`` appends to;
    here the registry on ``world`` is the one record, and these are views of it.
    """

    @property
    def backend_list(cls) -> list[str]:
        """torch's names, then every backend registered since, in registration order."""
        return [*_TORCH_NAMES, *(n for n in world.backends if n not in _TORCH_NAMES)]

    @property
    def backend_capability(cls) -> dict[str, list[str]]:
        """Backend name -> the device types it runs."""
        return {**_CAPABILITY_DEFAULTS, **{n: list(e.devices) for n, e in world.backends.items()}}

    @property
    def default_device_backend_map(cls) -> dict[str, str]:
        """Device type -> the backend a group uses for it when none is named (the first registered wins)."""
        out = dict(_DEVICE_DEFAULTS)
        for name, entry in world.backends.items():
            for device in entry.devices:
                out.setdefault(device, name)
        return out

    def __getattr__(cls, attr: str) -> str:
        """``Backend.NAME`` of a registered backend: its lowercase name."""
        entry = world.backends.get(attr.lower()) if attr.isupper() else None
        if entry is None:
            raise AttributeError(f"type object 'Backend' has no attribute {attr!r}")
        return entry.name


class Backend(str, metaclass=_BackendNames):
    """An enum-like class of backend names: ``Backend.MPI == "mpi"``, ``Backend.NCCL``, ...

    ``Backend(name)`` parses a name case-insensitively and returns the lowercase
    string (``Backend("MPI") == "mpi"``). Third-party backends register with
    :meth:`register_backend`; ``backend_list``, ``backend_capability`` and
    ``default_device_backend_map`` (computed from the registry) include them.

    Raises:
        ValueError: ``Backend(name)`` with a ``name`` that is not a string.

    Examples:
        >>> dist.Backend("MPI")
        'mpi'
        >>> dist.Backend.NCCL == "nccl"
        True
        >>> dist.Backend.backend_list[:5]
        ['undefined', 'gloo', 'nccl', 'ucc', 'mpi']
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise ValueError(f"Backend: the name must be a string, got {type(name).__name__}")
        value = getattr(Backend, name.upper(), None)
        if not isinstance(value, str):
            value = name.lower()
        return super().__new__(cls, value)

    @classmethod
    def register_backend(
        cls,
        name: str,
        func: Callable[..., BaseBackend],
        extended_api: bool = False,
        devices: str | list[str] | None = None,
    ) -> None:
        """Register a backend under ``name`` for ``init_process_group``/``new_group``.

        ``func(store, rank, world_size, timeout)`` (or, with ``extended_api=True``,
        ``func(options, pg_options)`` where ``options`` is a :class:`BackendOptions`
        that also carries the group's private MPI communicator) must return an
        instance of a :class:`~mpidist.backends.base.BaseBackend` subclass.
        Registration lasts for the process (``destroy_process_group`` keeps it).

        Args:
            name: The backend's name, identifier-like; ``Backend.NAME`` (upper
                case) then answers it, lowercase.
            func: The factory, called once per process group that uses the backend.
            extended_api: Call ``func(options, pg_options)`` instead of
                ``func(store, rank, world_size, timeout)``.
            devices: The device types it runs: ``"cpu"``, ``"cuda"`` or a list;
                None means both.

        Raises:
            ValueError: ``name`` is not identifier-like, or already registered (or
                one of torch's names).
            TypeError: ``func`` is not callable.

        Examples:
            >>> from mpidist.backends.mpi import MPIBackend
            >>> def make(options, pg_options):
            ...     return MPIBackend(options.comm, options.timeout.total_seconds(), options.group_id)
            >>> dist.Backend.register_backend("mympi", make, extended_api=True, devices="cpu")
            >>> g = dist.new_group(backend="mympi")
            >>> dist.get_backend(g)
            'mympi'
        """
        if not isinstance(name, str) or not name or not name.isidentifier():
            raise ValueError(f"Backend.register_backend: name must be an identifier-like string, got {name!r}")
        if not callable(func):
            raise TypeError(f"Backend.register_backend: func must be callable, got {type(func).__name__}")
        key = name.lower()
        if key in world.backends or key in _TORCH_NAMES:
            raise ValueError(f"Backend.register_backend: {name!r} is already registered")
        if devices is None:
            devs: tuple[str, ...] = ("cpu", "cuda")
        elif isinstance(devices, str):
            devs = (devices,)
        else:
            devs = tuple(devices)
        world.backends[key] = BackendEntry(key, func, bool(extended_api), devs, builtin=False)


@dataclass
class BackendOptions:
    """What a backend factory gets (torch's ``_DistributedBackendOptions`` plus ``comm``).

    Passed as the first argument to a factory registered with
    ``Backend.register_backend(..., extended_api=True)``.

    Attributes:
        store: The group's key-value store (a ``PrefixStore`` over the default
            store), or None when rank 0 could not open one.
        group_rank: This process's rank in the group.
        group_size: The group's size.
        timeout: The group's timeout, a ``datetime.timedelta``.
        group_id: The group's name (unique in the process).
        global_ranks_in_group: The members' global ranks, in group-rank order.
        comm: The group's private MPI communicator (an ``mpi4py.MPI.Comm``).

    Examples:
        >>> from mpidist.backends.mpi import MPIBackend
        >>> def make(options, pg_options):
        ...     print(options.group_rank, options.group_size, options.global_ranks_in_group)
        ...     return MPIBackend(options.comm, options.timeout.total_seconds(), options.group_id)
    """

    store: Any
    group_rank: int
    group_size: int
    timeout: timedelta
    group_id: str
    global_ranks_in_group: list[int]
    comm: Any = field(repr=False, default=None)  # the group's private MPI communicator


def nccl_importable() -> bool:
    """Return True if cupy's NCCL bindings can be imported (without importing them)."""
    try:
        return importlib.util.find_spec("cupy") is not None and importlib.util.find_spec("cupy.cuda.nccl") is not None
    except (ImportError, ValueError):
        return False


def nccl_available() -> bool:
    """True if cupy's NCCL bindings load libnccl and a GPU is visible (checked once per process).

    cupy's ``nccl`` module imports without libnccl and then says ``available = False``:
    NCCL is not available then, and groups run GPU arrays as documented without it.
    """
    if world.nccl_ok is None:
        ok = False
        if nccl_importable():
            try:
                import cupy
                from cupy.cuda import nccl

                ok = bool(getattr(nccl, "available", True)) and cupy.cuda.runtime.getDeviceCount() > 0
            except Exception:  # noqa: BLE001 - no driver, no libnccl: not usable
                ok = False
        world.nccl_ok = ok
    return bool(world.nccl_ok)


def nccl_usable(arr: Any) -> bool:
    """True if ``arr`` (a DeviceArray) is GPU memory that NCCL can reach from here."""
    from ..arrays.device import CupyOps

    return isinstance(arr.ops, CupyOps) and nccl_available()


log = logging.getLogger("mpidist")

#: torch's backend names that one of mpidist's own backends serves. Programs written for torch say
#: "gloo" for host collectives: MPI runs them (host arrays, and device arrays staged or CUDA-aware,
#: as gloo takes CUDA tensors too). "nccl" and "mpi" are mpidist's own. get_backend() still
#: answers the name the program asked for.
SERVED_BY: dict[str, str] = {Backend.GLOO: Backend.MPI}

_NO_UCC = "mpidist has no ucc backend: use backend='mpi' (the default), or 'gloo', which MPI serves"


def requested_name(backend: Any) -> str:
    """The name ``get_backend()`` reports for a backend argument: torch's spelling, lowercase.

    Call after :func:`parse_backend` accepted ``backend`` (None: "mpi").
    """
    if backend is None:
        return Backend.MPI
    text = backend.strip().lower()
    if ":" not in text:
        return str(Backend(text))
    return ",".join(f"{d.strip()}:{n.strip()}" for d, _, n in (part.partition(":") for part in text.split(",")))


def parse_backend(backend: Any, fn: str) -> dict[str, str]:
    """Return ``{device: backend that serves it}`` for a backend argument (None means MPI for CPU).

    torch's names are served (:data:`SERVED_BY`): ``"gloo"`` -> MPI for cpu and
    cuda, ``"cpu:gloo,cuda:nccl"`` -> MPI for cpu, NCCL for cuda.
    """
    if backend is None:
        return {"cpu": Backend.MPI}
    if not isinstance(backend, str):
        raise TypeError(f"{fn}: backend must be a string such as 'mpi', got {type(backend).__name__}")
    text = backend.strip().lower()
    if ":" in text:
        mapping: dict[str, str] = {}
        for part in text.split(","):
            device, sep, name = part.partition(":")
            if not sep or not device.strip() or not name.strip():
                raise ValueError(f"{fn}: backend {backend!r} is not of the form 'cpu:mpi,cuda:nccl'")
            mapping[device.strip()] = _known(name.strip(), fn)
    else:
        name = _known(text, fn)
        entry = world.backends.get(name)
        devices = entry.devices if entry is not None else ("cpu",)
        mapping = {d: name for d in devices}
    for device, name in mapping.items():
        if device not in ("cpu", "cuda"):
            raise ValueError(f"{fn}: backend {backend!r} names device type {device!r}; mpidist knows 'cpu' and 'cuda'")
        if device not in Backend.backend_capability.get(name, [device]):
            raise ValueError(f"{fn}: backend {backend!r}: {name} cannot run {device} arrays")
    return mapping


def _known(name: str, fn: str) -> str:
    if name == Backend.UCC:
        raise ValueError(f"{fn}: {_NO_UCC}")
    served = SERVED_BY.get(name)
    if served is not None:
        log.debug("%s: backend %r is served by mpidist's %r backend", fn, name, served)
        return served
    if name in world.backends:
        return name
    available = ", ".join(sorted(set(world.backends) | set(SERVED_BY)))
    raise ValueError(
        f"{fn}: unknown backend {name!r}; available: {available} (or one registered with Backend.register_backend)"
    )


def create_backend(name: str, options: BackendOptions, pg_options: Any) -> BaseBackend:
    """Build the backend object ``name`` for one process group."""
    entry = world.backends[name]
    if entry.extended_api:
        impl = entry.factory(options, pg_options)
    else:
        impl = entry.factory(options.store, options.group_rank, options.group_size, options.timeout)
    if not isinstance(impl, BaseBackend):
        raise TypeError(
            f"backend {name!r}: its factory returned {type(impl).__name__}, expected an instance "
            "of a mpidist.backends.BaseBackend subclass"
        )
    return impl


def _make_mpi(options: BackendOptions, pg_options: Any) -> BaseBackend:
    from .mpi import MPIBackend

    return MPIBackend(
        options.comm, options.timeout.total_seconds(), options.group_id, global_ranks=options.global_ranks_in_group
    )


def _make_nccl(options: BackendOptions, pg_options: Any) -> BaseBackend:
    """Build the group's NCCL backend (collective over the group's ranks).

    ``pg_options`` may be torch-style options with ``is_high_priority_stream``.
    """
    from . import nccl

    return nccl.NCCLBackend(
        options.comm,
        options.timeout.total_seconds(),
        options.group_id,
        global_ranks=options.global_ranks_in_group,
        high_priority=bool(getattr(pg_options, "is_high_priority_stream", False)),
    )


def register_builtins() -> None:
    """Register the backends that ship with mpidist (idempotent)."""
    for name, factory, devices in ((Backend.MPI, _make_mpi, ("cpu", "cuda")), (Backend.NCCL, _make_nccl, ("cuda",))):
        if name not in world.backends:
            world.backends[name] = BackendEntry(name, factory, True, devices, builtin=True)


register_builtins()
