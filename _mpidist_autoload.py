"""Make ``import torch`` know mpidist's backend names, without importing mpidist.

torch calls every entry point of the group ``torch.backends`` at the end of
``import torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); mpidist's calls
:func:`load`. After it, an unmodified torch program can say
``init_process_group("mpidist")`` or ``init_process_group("mpi")`` (on a torch
built without MPI) with no ``import mpidist.torch``.

This module is outside the ``mpidist`` package on purpose: importing that
package costs about 30 ms (its modules and mpi4py's package), too much to add
to every ``import torch``. Here nothing is imported that torch has not
imported already, and nothing starts: mpidist (and MPI) load when the first
group on one of its names is created, or when ``env://`` finds torchrun's
variables missing. Importing this module and running :func:`load` costs about
0.1 ms (docs/torch-backend.md, "No import needed").

What is installed (each step idempotent, each the one place that patches torch):

* the backend ``"mpidist"`` (``Backend.register_backend``), whose creator
  builds a :class:`mpidist.torch.ProcessGroupMPIDist`;
* ``env://`` under an MPI launcher: torchrun's variables derived from MPI when
  some are missing (:func:`mpidist.torch._rendezvous.fill_if_launched`);
* the name ``"mpi"`` where torch has no MPI of its own: torch's flag, a
  ``ProcessGroupMPI`` whose ``create`` builds a mpidist group and, on a torch
  that creates groups through its creator table (2.14 on), mpidist's creator
  for ``"mpi"`` in that table; and a real store for that default group (torch
  gives it a placeholder), so that side groups such as
  ``new_group(backend="gloo")`` work on it. These rely on torch internals,
  checked by :func:`mpi_name_problem` at every ``import torch`` (tested on
  every torch of :data:`TESTED_TORCH`); where they differ, ``"mpi"`` fails
  with mpidist's own message naming the difference and ``"mpidist"``, and a
  ``RuntimeWarning`` at ``import torch`` says so first.

Turn it off with ``MPIDIST_TORCH_AUTOLOAD=0`` (``import mpidist.torch`` still
installs everything).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator

__all__ = [
    "load",
    "install",
    "register_mpidist",
    "mpi_name_problem",
    "mpi_name_shape",
    "ProcessGroupMPI",
    "SWITCH",
    "BACKEND_NAME",
    "MPI_NAME",
    "DEVICES",
    "TESTED_TORCH",
]

#: the environment switch: "0" (or false/no/off) leaves torch as it is at ``import torch``
SWITCH = "MPIDIST_TORCH_AUTOLOAD"
BACKEND_NAME = "mpidist"
MPI_NAME = "mpi"
#: the device types whose tensors mpidist's groups take (registered with torch for "mpidist")
DEVICES = ("cpu", "cuda")
#: what torch's env:// handler needs
ENV_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_HELPER = "_new_process_group_helper"
#: the torch releases CI runs the torch integration on (dev.py's TORCH_MATRIX installs them): the oldest
#: supported (pyproject.toml's lower bound) to the newest; named in mpidist's errors about "mpi"
TESTED_TORCH = ("2.13.0", "2.14.1", "2.15.0")
#: how torch makes an "mpi" group, by release (mpi_name_shape): its group helper calls ProcessGroupMPI.create
#: itself (2.13), or takes the creator registered for "mpi" in Backend's table of creators (2.14 on)
SHAPE_HELPER, SHAPE_CREATOR = "helper", "creator table"


def load() -> None:
    """torch's entry point: :func:`install`, unless ``MPIDIST_TORCH_AUTOLOAD`` says no.

    Never raises: torch turns an entry point's exception into a failed ``import torch``,
    and no torch program may fail to start because of mpidist; a warning says what went wrong.
    """
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        install()
    except Exception as exc:  # noqa: BLE001 - see above
        import warnings

        warnings.warn(
            f"mpidist could not register its torch backends at import torch ({type(exc).__name__}: {exc}); "
            f"`import mpidist.torch` installs them with the error shown, {SWITCH}=0 skips this step",
            RuntimeWarning,
            stacklevel=2,
        )


def install() -> None:
    """Register ``"mpidist"``, wrap ``env://`` and serve ``"mpi"`` (idempotent; no-op without torch.distributed)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    register_mpidist()
    _wrap_env_rendezvous()
    if getattr(c10d, "ProcessGroupMPI", None) is not None and c10d.ProcessGroupMPI is not ProcessGroupMPI:
        return  # a torch built with its own MPI: never touched
    shape, problem = mpi_name_shape(c10d)
    if problem:
        _refuse_mpi_name(c10d, problem)
        return
    c10d.ProcessGroupMPI = ProcessGroupMPI
    c10d._MPI_AVAILABLE = True
    if shape == SHAPE_CREATOR:
        _register_mpi_creator(c10d)
    helper = getattr(c10d, _HELPER)
    if not getattr(helper, "__mpidist__", False):
        setattr(c10d, _HELPER, _with_real_store(helper))


def register_mpidist() -> None:
    """Register the backend ``"mpidist"`` with torch (idempotent; no-op without torch.distributed).

    Also torch's lazy registrar for the name (entry point group ``torch.distributed.backends``, torch
    2.14 on): ``init_process_group("mpidist")`` then works even where ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
    kept :func:`load` from running at ``import torch``.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    if getattr(dist.Backend, BACKEND_NAME.upper(), None) is None:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=list(DEVICES))


def _create(options: Any, backend_options: Any = None) -> Any:
    """The ``"mpidist"`` creator torch calls (``extended_api=True``)."""
    from mpidist.torch.backend import _create_from_options

    return _create_from_options(options, backend_options)


# -- env:// under an MPI launcher ----------------------------------------------------------------
def _wrap_env_rendezvous() -> None:
    try:  # the module (torch.distributed.rendezvous is also the name of a function)
        rdzv = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:  # pragma: no cover - torch without distributed
        return
    table = getattr(rdzv, "_rendezvous_handlers", None)
    if isinstance(table, dict) and "env" in table and not getattr(table["env"], "__mpidist__", False):
        table["env"] = _env_from_mpi(table["env"])


def _env_from_mpi(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    @functools.wraps(original)
    def env_from_mpi(url: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if any(not os.environ.get(v, "").strip() for v in ENV_NEEDED):
            from mpidist.torch._rendezvous import fill_if_launched

            fill_if_launched()
        return original(url, *args, **kwargs)

    env_from_mpi.__mpidist__ = True  # type: ignore[attr-defined]
    return env_from_mpi


# -- the name "mpi" ------------------------------------------------------------------------------
def mpi_name_problem(c10d: Any) -> str:
    """Why torch's internals differ from what serving ``"mpi"`` relies on ('' if they match).

    Reads code objects only (names used, parameters), not source files: it runs at ``import torch``.
    """
    return mpi_name_shape(c10d)[1]


def mpi_name_shape(c10d: Any) -> tuple[str, str]:
    """How this torch makes an ``"mpi"`` group: ``(SHAPE_HELPER or SHAPE_CREATOR, "")``, or ``("", why not)``.

    Args:
        c10d: the module ``torch.distributed.distributed_c10d``.

    Returns:
        The shape mpidist knows how to serve, or an empty shape and what differs from both known ones.
    """
    if not hasattr(c10d, "_MPI_AVAILABLE"):
        return "", "torch.distributed.distributed_c10d has no _MPI_AVAILABLE flag"
    available = getattr(getattr(c10d, "is_mpi_available", None), "__code__", None)
    if available is None or "_MPI_AVAILABLE" not in available.co_names:
        return "", "is_mpi_available no longer reads _MPI_AVAILABLE"
    code = _code(getattr(c10d, _HELPER, None))
    if code is None:
        return "", f"torch.distributed.distributed_c10d has no {_HELPER} function"
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    if "timeout" not in params or "store" not in params:
        return "", f"{_HELPER} has no timeout or store parameter"
    if "ProcessGroupMPI" in code.co_names:  # torch 2.13: the helper makes MPI groups itself
        for name in ("create", "issubclass", "ProcessGroup"):
            if name not in code.co_names:
                return "", f"{_HELPER} uses ProcessGroupMPI but no longer {name!r}"
        return SHAPE_HELPER, ""
    return _creator_table_problem(c10d, code)


def _creator_table_problem(c10d: Any, helper: Any) -> tuple[str, str]:
    """The creator-table shape (torch 2.14 on): ``(SHAPE_CREATOR, "")`` or ``("", why not)``."""
    backend = getattr(c10d, "Backend", None)
    plugins = getattr(backend, "_plugins", None)
    if not isinstance(plugins, dict):  # torch registers its own creator for "mpi" there on first use
        return "", f"{_HELPER} does not use ProcessGroupMPI, and torch.distributed.Backend has no _plugins table"
    for name in ("_plugins", "creator_fn", "extended_api", "isinstance", "ProcessGroup"):
        if name not in helper.co_names:
            return "", f"{_HELPER} neither calls ProcessGroupMPI nor takes creators from Backend._plugins (no {name!r})"
    register = _code(getattr(backend, "register_backend", None))
    if register is None or not {"extended_api", "devices"} <= set(register.co_varnames[: register.co_argcount]):
        return "", "Backend.register_backend takes no extended_api and devices"
    if MPI_NAME not in getattr(backend, "backend_capability", {}):
        return "", "Backend.backend_capability has no devices for 'mpi'"
    return SHAPE_CREATOR, ""


def _code(func: Any) -> Any:
    """The code object of ``func`` (of what it wraps, for mpidist's own wrappers and classmethods)."""
    func = getattr(func, "__func__", func)
    return getattr(getattr(func, "__wrapped__", func), "__code__", None)


def _register_mpi_creator(c10d: Any) -> None:
    """Put mpidist's creator for ``"mpi"`` in torch's table, with the devices and group type torch gives MPI."""
    backend = c10d.Backend
    plugin = backend._plugins.get(MPI_NAME.upper())  # torch's own (an entry point) is registered on first use
    if getattr(getattr(plugin, "creator_fn", None), "__mpidist__", False):
        return
    register = _code(backend.register_backend)
    kinds = {}
    if "_backend_type" in register.co_varnames[: register.co_argcount + register.co_kwonlyargcount]:
        kinds["_backend_type"] = c10d.ProcessGroup.BackendType.MPI  # what torch registers "mpi" with
    devices = list(backend.backend_capability[MPI_NAME])
    backend.register_backend(MPI_NAME, _create_mpi, extended_api=True, devices=devices, **kinds)


def _create_mpi(options: Any, backend_options: Any = None) -> Any:
    """mpidist's creator for ``"mpi"`` in torch's creator table (torch 2.14 on; ``extended_api=True``)."""
    timeout = options.timeout if isinstance(options.timeout, timedelta) else None
    return ProcessGroupMPI.create(list(options.global_ranks_in_group), timeout)


_create_mpi.__mpidist__ = True  # type: ignore[attr-defined]


def _refuse_mpi_name(c10d: Any, problem: str) -> None:
    """Where ``"mpi"`` cannot be served: warn now, and fail ``"mpi"`` groups with mpidist's message, early."""
    import warnings

    message = refusal(problem)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    dist = sys.modules["torch.distributed"]
    for name in ("init_process_group", "new_group"):
        original = getattr(dist, name)
        if not getattr(original, "__mpidist_refuses__", False):
            refusing = _refusing(original, name, message)
            setattr(dist, name, refusing)
            if getattr(c10d, name, None) is original:
                setattr(c10d, name, refusing)


def refusal(problem: str) -> str:
    """mpidist's message where it cannot serve ``"mpi"`` on this torch: which torch, what differs, what works."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", "?")
    return (
        f"mpidist cannot serve the backend name 'mpi' on torch {version}: {problem}. torch's pip wheels have no "
        f"MPI of their own, and mpidist serves 'mpi' through torch internals that it checks at import torch "
        f"(tested on torch {', '.join(TESTED_TORCH)}). backend='{BACKEND_NAME}' runs the same MPI backend on "
        f"this torch: init_process_group('{BACKEND_NAME}'), or Lightning's process_group_backend='{BACKEND_NAME}'"
    )


def _names_mpi(backend: Any) -> bool:
    """Whether a torch backend argument names "mpi" ("mpi", "MPI", "cpu:mpi,cuda:mpi", Backend.MPI)."""
    if not isinstance(backend, str):
        return False
    parts = [part.split(":")[-1].strip().lower() for part in backend.split(",")]
    return MPI_NAME in parts


def _refusing(original: Callable[..., Any], name: str, message: str) -> Callable[..., Any]:
    """``original`` (torch's init_process_group or new_group) that refuses "mpi" before torch sees it."""
    import inspect  # torch imported it already

    params = list(inspect.signature(original).parameters)  # through torch's logging decorators (__wrapped__)
    at = params.index("backend") if "backend" in params else None

    @functools.wraps(original)
    def refusing(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[at] if at is not None and len(args) > at else None)
        if _names_mpi(backend):
            raise RuntimeError(f"{name}: {message}")
        return original(*args, **kwargs)

    refusing.__mpidist_refuses__ = True  # type: ignore[attr-defined]
    return refusing


class ProcessGroupMPI:
    """Stands in for torch's missing ``ProcessGroupMPI``: ``create`` builds a mpidist group named "mpi"."""

    @staticmethod
    def create(ranks: list[int], timeout: timedelta | None = None) -> Any:
        """Build the mpidist group torch asks for, on its members (``ranks`` empty: the default group).

        torch 2.13's ``_new_process_group_helper`` calls it without the timeout, which is then read
        from the helper's frame (``timeout``), as from torch 2.14's own creator's (``opts.timeout``).
        """
        if timeout is None:
            found = sys._getframe(1).f_locals
            timeout = found.get("timeout", getattr(found.get("opts"), "timeout", None))
        if not isinstance(timeout, timedelta):
            timeout = sys.modules["torch.distributed"].default_pg_timeout
        from mpidist.torch.backend import create_process_group

        return create_process_group(list(ranks), -1, -1, timeout, None, MPI_NAME)


def _with_real_store(helper: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap torch's group helper: an "mpi" default group gets mpidist's store in place of torch's placeholder.

    torch makes the MPI default group with ``Store()`` ("MPI backend doesn't use store"), whose every
    method raises, so ``new_group(backend="gloo")`` on top of it fails inside torch.
    """
    store_at = helper.__code__.co_varnames.index("store")

    @functools.wraps(helper)
    def helper_with_store(*args: Any, **kwargs: Any) -> Any:
        result = helper(*args, **kwargs)
        store = kwargs["store"] if "store" in kwargs else args[store_at] if len(args) > store_at else None
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        if type(store) is c10d.Store and isinstance(result, tuple) and getattr(result[0], "mpidist_backend", False):
            from mpidist.torch._store import give_real_store

            give_real_store(result[0])
        return result

    helper_with_store.__mpidist__ = True  # type: ignore[attr-defined]
    return helper_with_store
