"""torch's profiler events for torch's groups on mpidist: ``mpi:all_reduce`` as gloo's ``gloo:all_reduce``.

While a torch profiler runs, each collective and point-to-point call of a
:class:`~mpidist.torch.backend.ProcessGroupMPIDist` records one event named
after the group's backend (``mpi:`` when torch's name "mpi" made it,
``mpidist:`` otherwise) and the operation, with the shapes of the input
tensors torch passed (``record_shapes=True``; complex tensors arrive as their
real views, as in gloo), begun at the call and ended when the operation
completes. The event names and inputs are gloo's (and torch's MPI backend's),
which torch's distributed test suite checks. The machinery, and why it costs
nothing while no profiler runs, is in :mod:`mpidist.diagnose.profiler`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ..diagnose import profiler
from ..process_group import ProcessGroup

__all__ = ["METHODS", "watch"]


def _flat(items: Any) -> list[Any]:
    if items is None:
        return []
    if hasattr(items, "shape"):
        return [items]
    out: list[Any] = []
    for x in items:
        out.extend(_flat(x))
    return out


def _arg(i: int) -> Callable[[tuple], Iterable[Any]]:
    def inputs(args: tuple) -> Iterable[Any]:
        return _flat(args[i]) if len(args) > i else []

    return inputs


def _none(args: tuple) -> Iterable[Any]:
    return ()


_A0, _A1 = _arg(0), _arg(1)

#: ProcessGroupMPIDist's methods (every name torch may call, aliases included) -> (event op, inputs)
METHODS: dict[str, tuple[str, Callable[[tuple], Iterable[Any]]]] = {
    "allreduce": ("all_reduce", _A0),
    "allreduce_coalesced": ("all_reduce", _A0),
    "broadcast": ("broadcast", _A0),
    "reduce": ("reduce", _A0),
    "allgather": ("all_gather", _A1),
    "all_gather_single": ("all_gather_into_tensor", _A1),
    "_allgather_base": ("all_gather_into_tensor", _A1),
    "allgather_coalesced": ("all_gather", _A1),
    "all_gather_single_coalesced": ("all_gather_into_tensor", _A1),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor", _A1),
    "gather": ("gather", _A1),
    "scatter": ("scatter", _A1),
    "reduce_scatter": ("reduce_scatter", _A1),
    "reduce_scatter_single": ("reduce_scatter_tensor", _A1),
    "_reduce_scatter_base": ("reduce_scatter_tensor", _A1),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor", _A1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", _A1),
    "all_to_all_single": ("all_to_all", _A1),
    "alltoall_base": ("all_to_all", _A1),
    "alltoall": ("all_to_all", _A1),
    "barrier": ("barrier", _none),
    "send": ("send", _A0),
    "recv": ("recv", _A0),
    "recv_anysource": ("recvAnySource", _A0),
}


def _label(pg: Any) -> str:
    return pg._backend_name


def watch(cls: type) -> str:
    """Record events for ``cls`` (ProcessGroupMPIDist) while a torch profiler runs; return the status."""
    profiler.register(ProcessGroup, profiler.CORE_METHODS, profiler.core_label)
    profiler.register(cls, METHODS, _label)
    return profiler.watch()
