"""Lightning's distributed utilities (``pytorch_lightning.utilities.distributed``) for numpy arrays and torch tensors.

Same names, parameters and results as Lightning's, built on mpidist's public
collectives. Each function takes a numpy array or a CPU torch tensor and returns
the kind it was given (same dtype, bfloat16 included):

* :func:`distributed_available`: is the default process group initialized?
* :func:`all_gather_ddp_if_available`: stack every rank's array, shape ``(world_size, *shape)``;
  with ``sync_grads=True`` (torch tensors) gradients flow back through the gather
  (:class:`~mpidist.autograd.AllGatherGrad`).
* :func:`gather_all_tensors`: every rank's array, in a list, where shapes may differ
  per rank in any dimension (two collectives: the shapes, then the padded data).
* :func:`sync_ddp`, :func:`sync_ddp_if_available`: all-reduce with ``reduce_op`` given
  as a ``ReduceOp`` or a string (``"sum"``, ``"mean"``/``"avg"``, ``"max"``, ...).
* :func:`init_dist_connection`: set ``MASTER_ADDR``/``MASTER_PORT`` from a cluster
  environment and call :func:`~mpidist.init_process_group`.
* :class:`MPIEnvironment`: a ready cluster environment for processes started by an MPI
  launcher (Lightning's ``ClusterEnvironment`` interface).

``AllGatherGrad`` (a ``torch.autograd.Function``) lives in :mod:`mpidist.autograd`
and is importable from here too, as in Lightning; it needs torch, which this module
never imports (torch is optional). :func:`register_ddp_comm_hook` registers one of
torch's DDP communication hooks (optionally wrapped) on a ``DistributedDataParallel``
model; it runs over MPI when the model's process group is mpidist's torch backend
(``import mpidist.torch``; see docs/torch-backend.md).
"""

from __future__ import annotations

import inspect
import logging
import operator
import os
import socket
from typing import Any

import numpy as np

from ._validate import int_arg
from .arrays.host import DTYPES, array_or_tensor_arg, new_like
from .collectives import all_gather_into_tensor, all_reduce
from .init import get_rank, init_process_group, is_initialized
from .launch.environment import free_port
from .process_group import ProcessGroup, resolve_group
from .reduce_op import RedOpType, ReduceOp, check_op, foreign_op

__all__ = [
    "distributed_available",
    "all_gather_ddp_if_available",
    "gather_all_tensors",
    "sync_ddp",
    "sync_ddp_if_available",
    "init_dist_connection",
    "MPIEnvironment",
]

log = logging.getLogger("mpidist")

#: The most dimensions a numpy array can have (NPY_MAXDIMS in numpy 2; 32 in numpy 1).
_MAXDIMS = 64
#: One int64 header per rank in gather_all_tensors: ndim, dtype code, then the shape, zero-padded.
_HEADER = 2 + _MAXDIMS
#: Dtype codes for the header: the supported dtypes sorted by name (the same on every rank).
_DTYPE_BY_CODE = tuple(sorted(DTYPES, key=lambda d: d.name))
_CODE_OF_DTYPE = {d: i for i, d in enumerate(_DTYPE_BY_CODE)}

#: ``reduce_op`` strings (case-insensitive) and the ReduceOp they mean; "avg"/"mean" sum, then divide.
_REDUCE_OP_NAMES = {
    "sum": ReduceOp.SUM,
    "product": ReduceOp.PRODUCT,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
    "band": ReduceOp.BAND,
    "bor": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR,
}
_AVERAGE_NAMES = ("avg", "mean")


def __getattr__(name: str) -> Any:
    """``mpidist.utils.AllGatherGrad``, as in Lightning's module, imported (with torch) on first use."""
    if name == "AllGatherGrad":
        from .autograd import AllGatherGrad

        return AllGatherGrad
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def distributed_available() -> bool:
    """Return True if the default process group is initialized (so collectives can run).

    Lightning's ``distributed_available()``; there is no TPU branch.

    Returns:
        True between ``init_process_group`` and ``destroy_process_group``.

    Examples:
        >>> import mpidist as dist
        >>> dist.distributed_available()
        False
        >>> dist.init_process_group()
        >>> dist.distributed_available()
        True
    """
    return is_initialized()


def all_gather_ddp_if_available(tensor: Any, group: ProcessGroup | None = None, sync_grads: bool = False) -> Any:
    """Gather ``tensor`` from every rank of ``group`` and stack the results.

    Every rank must pass an array of the same shape and dtype (use
    :func:`gather_all_tensors` when shapes differ; ``MPIDIST_DEBUG=DETAIL`` checks it).

    With ``sync_grads=True`` the gather is :class:`~mpidist.autograd.AllGatherGrad`:
    the result is part of the autograd graph, and backpropagating through it
    all-reduces (sums) the gradient of the result across ``group`` and hands each
    rank its own slice, so ``tensor.grad`` receives what every rank's loss says
    about this rank's ``tensor``. That backward pass is a collective: every rank of
    ``group`` must backpropagate through its result. With ``sync_grads=False`` the
    result is detached (no ``grad_fn``), as Lightning's ``torch.no_grad()`` gather.

    Args:
        tensor: a numpy array or CPU torch tensor of shape ``(batch, ...)``.
        group: the process group (default: the world).
        sync_grads: let gradients flow back through the gather (torch tensors only;
            numpy arrays carry no gradients).

    Returns:
        A new array of ``tensor``'s kind and dtype, of shape ``(world_size, batch, ...)``;
        row ``i`` is group rank ``i``'s ``tensor``. Without an initialized process
        group, ``tensor`` as in a world of one: a copy of shape ``(1, batch, ...)``
        (differentiable with ``sync_grads=True``). None on ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not a numpy array or CPU torch tensor of a supported
            dtype, ``sync_grads`` is not a bool, or ``sync_grads=True`` with a numpy array.

    Examples:
        >>> dist.all_gather_ddp_if_available(np.full(2, dist.get_rank()))
        array([[0, 0],
               [1, 1]])  # rank 0 and rank 1
        >>> x = torch.full((2,), 1.0 + dist.get_rank(), requires_grad=True)
        >>> gathered = dist.all_gather_ddp_if_available(x, sync_grads=True)
        >>> gathered
        tensor([[1., 1.],
                [2., 2.]], grad_fn=<AllGatherGradBackward>)  # rank 0 and rank 1
        >>> (gathered * torch.tensor([[1.0], [10.0]])).sum().backward()
        >>> x.grad
        tensor([2., 2.])  # rank 0
        tensor([20., 20.])  # rank 1
    """
    fn = "all_gather_ddp_if_available"
    view, torch = array_or_tensor_arg(tensor, fn, "tensor")
    if not isinstance(sync_grads, (bool, np.bool_)):
        raise TypeError(f"{fn}: sync_grads must be a bool, got {type(sync_grads).__name__}")
    if sync_grads and torch is None:
        raise TypeError(
            f"{fn}: sync_grads=True backpropagates through the gather, which needs a torch.Tensor; got a "
            "numpy.ndarray, which carries no gradients: pass sync_grads=False (or a torch tensor)"
        )
    if not distributed_available():  # a world of one
        if torch is None:
            return view[None].copy()
        source = tensor if sync_grads else tensor.detach()
        return source.unsqueeze(0).clone(memory_format=torch.contiguous_format)
    pg = resolve_group(group, fn)
    if pg is None:  # not a member of group: like the collectives, do nothing
        return None
    if sync_grads:
        from .autograd import AllGatherGrad

        return AllGatherGrad.apply(tensor, pg)
    out, out_view = new_like(tensor, view, torch, (pg.size(), *view.shape), fn)
    all_gather_into_tensor(out_view, view, group=pg)
    return out


def gather_all_tensors(result: Any, group: ProcessGroup | None = None) -> list[Any] | None:
    """Gather every rank's ``result`` into a list on every rank; shapes may differ in any dimension.

    Two collectives, whatever the world size: an all-gather of every rank's
    ndim, dtype and shape, then (unless every array is empty) an all-gather of the
    arrays zero-padded to the largest extent of each dimension, which each slice
    is trimmed back from. Every rank must pass the same number of dimensions and
    the same dtype; otherwise every rank raises the same error after the first
    collective (and before any data moves). The results carry no gradients
    (as Lightning's; use :func:`all_gather_ddp_if_available` with
    ``sync_grads=True`` for that).

    Args:
        result: a numpy array or CPU torch tensor (0-d works).
        group: the process group (default: the world).

    Returns:
        A list with one C-contiguous array of ``result``'s kind and dtype per rank
        of ``group``: element ``i`` is group rank ``i``'s ``result`` (a copy). None
        on ranks outside ``group``.

    Raises:
        TypeError: ``result`` is not a numpy array or CPU torch tensor of a supported
            dtype, or the ranks passed different dtypes.
        ValueError: the ranks passed different numbers of dimensions.

    Examples:
        >>> r = dist.get_rank()
        >>> parts = dist.gather_all_tensors(np.ones((r + 1, 2 - r)))
        >>> [p.shape for p in parts]
        [(1, 2), (2, 1)]  # rank 0 and rank 1
        >>> dist.gather_all_tensors(torch.arange(r + 1))
        [tensor([0]), tensor([0, 1])]  # rank 0 and rank 1
    """
    fn = "gather_all_tensors"
    arr, torch = array_or_tensor_arg(result, fn, "result")
    pg = resolve_group(group, fn)
    if pg is None:  # not a member of group: like the collectives, do nothing
        return None
    n = pg.size()
    header = np.zeros(_HEADER, np.int64)
    header[0] = arr.ndim
    header[1] = _CODE_OF_DTYPE[arr.dtype]
    header[2 : 2 + arr.ndim] = arr.shape
    headers = np.empty((n, _HEADER), np.int64)
    all_gather_into_tensor(headers, header, group=pg)

    ndims = headers[:, 0].tolist()
    if len(set(ndims)) > 1:
        listing = ", ".join(f"rank {r}: {d}" for r, d in enumerate(ndims))
        raise ValueError(f"{fn}: every rank's result must have the same number of dimensions; got {listing}")
    codes = headers[:, 1].tolist()
    if len(set(codes)) > 1:
        listing = ", ".join(f"rank {r}: {_DTYPE_BY_CODE[c].name}" for r, c in enumerate(codes))
        raise TypeError(f"{fn}: every rank's result must have the same dtype; got {listing}")
    shapes = [tuple(row) for row in headers[:, 2 : 2 + arr.ndim].tolist()]
    max_shape = tuple(headers[:, 2 : 2 + arr.ndim].max(axis=0).tolist())

    out, out_view = new_like(result, arr, torch, (n, *max_shape), fn)
    if out_view.size:  # else every array is empty: nothing to send
        if arr.shape == max_shape:
            padded = arr
        else:
            padded = np.zeros(max_shape, arr.dtype)
            padded[tuple(slice(0, s) for s in arr.shape)] = arr
        all_gather_into_tensor(out_view, padded, group=pg)
    contiguous = np.ascontiguousarray if torch is None else (lambda t: t.contiguous())
    return [
        out[r] if shape == max_shape else contiguous(out[r][tuple(slice(0, s) for s in shape)])
        for r, shape in enumerate(shapes)
    ]


def _sync_args(result: Any, reduce_op: Any, fn: str) -> tuple[Any, np.ndarray, Any, Any, bool]:
    """Validate ``sync_ddp``'s arguments.

    Returns ``(result, view, torch, op, divide)``: the array to reduce and return
    (a new 0-d numpy array for a number), its numpy view, the torch module for a
    tensor (else None), the ReduceOp, and whether to divide by the group size afterwards.
    """
    if isinstance(result, (bool, int, float, complex, np.generic)):
        result = np.array(result)  # a number: reduced in a new 0-d array
    arr, torch = array_or_tensor_arg(result, fn, "result")
    kind = DTYPES[arr.dtype].kind
    divide = False
    if reduce_op is None:
        op = ReduceOp.SUM
    elif isinstance(reduce_op, str):
        key = reduce_op.lower()
        if key in _AVERAGE_NAMES:
            if kind == "b":
                cast = "result.astype(numpy.int64)" if torch is None else "result.long()"
                raise ValueError(
                    f"{fn}: reduce_op={reduce_op!r} averages, which is not defined for bool arrays; "
                    f"cast result to a number type first, e.g. {cast}"
                )
            op, divide = ReduceOp.SUM, True
        elif key in _REDUCE_OP_NAMES:
            op = _REDUCE_OP_NAMES[key]
        else:
            names = ", ".join(repr(k) for k in (*_REDUCE_OP_NAMES, *_AVERAGE_NAMES))
            raise ValueError(
                f"{fn}: reduce_op={reduce_op!r} is not a reduction; expected None (sum), a ReduceOp, "
                f"or one of {names} (any case)"
            )
    elif type(reduce_op) is RedOpType or isinstance(reduce_op, ReduceOp):
        op = reduce_op
    elif (op := foreign_op(reduce_op)) is None:  # not torch's own ReduceOp either
        raise TypeError(
            f"{fn}: reduce_op must be None, a ReduceOp such as ReduceOp.SUM, or a string such as 'sum' "
            f"or 'mean', got {type(reduce_op).__module__}.{type(reduce_op).__qualname__}"
        )
    check_op(op, DTYPES[arr.dtype], fn)
    return result, arr, torch, op, divide


def sync_ddp(result: Any, group: ProcessGroup | None = None, reduce_op: Any = None) -> Any:
    """All-reduce ``result`` across ``group`` and return the reduced value.

    ``result`` is reduced in place (an array or tensor) and returned. With
    ``"mean"``/``"avg"`` it is summed and then divided by the group size: in place
    for floating-point and complex arrays; integer arrays keep the sum and a new
    array holding the mean is returned (Lightning's true division ``result /
    world_size``: float64 for numpy, torch's default float dtype for a tensor). A
    number is reduced in a new 0-d numpy array, which is returned. Like
    torch.distributed, a tensor that requires grad is reduced without autograd.

    Args:
        result: a numpy array, a CPU torch tensor, or a number.
        group: the process group (default: the world).
        reduce_op: None or ``"sum"`` (the default), ``"mean"`` or ``"avg"``, another
            reduction's name (``"max"``, ``"min"``, ``"product"``, ``"band"``,
            ``"bor"``, ``"bxor"``; any case), or a ``ReduceOp``, passed to
            :func:`~mpidist.all_reduce` as it is.

    Returns:
        The reduced array (``result`` itself except as said above); ``result``
        unchanged on ranks outside ``group``.

    Raises:
        TypeError: ``result`` is not a numpy array, CPU torch tensor or number of a
            supported dtype, or ``reduce_op`` is not None, a string or a ReduceOp.
        ValueError: ``reduce_op`` names no reduction, or one not defined on the dtype.

    Examples:
        >>> x = np.array([1.0, 2.0]) * (dist.get_rank() + 1)
        >>> dist.sync_ddp(x, reduce_op="mean")
        array([1.5, 3. ])  # rank 0 and rank 1: the mean of [1, 2] and [2, 4]
        >>> t = torch.tensor([1, 2]) * (dist.get_rank() + 1)
        >>> dist.sync_ddp(t, reduce_op="avg")
        tensor([1.5000, 3.0000])  # rank 0 and rank 1
    """
    fn = "sync_ddp"
    result, arr, torch, op, divide = _sync_args(result, reduce_op, fn)
    pg = resolve_group(group, fn)
    if pg is None:  # not a member of group: like the collectives, do nothing
        return result
    all_reduce(arr, op=op, group=pg)
    if not divide:
        return result
    n = pg.size()
    kind = DTYPES[arr.dtype].kind
    if kind == "f":  # in place, through the view (a tensor that requires grad included)
        np.divide(arr, n, out=arr)
        return result
    if kind == "c":  # each component, correctly rounded (as ReduceOp.AVG does)
        np.divide(arr.real, n, out=arr.real)
        np.divide(arr.imag, n, out=arr.imag)
        return result
    if torch is None:
        return np.divide(arr, n, out=np.empty(arr.shape, np.float64))
    return torch.true_divide(result, n)


def sync_ddp_if_available(result: Any, group: ProcessGroup | None = None, reduce_op: Any = None) -> Any:
    """Like :func:`sync_ddp` when the process group is initialized; else return ``result`` unchanged.

    The arguments are checked either way (the same errors as :func:`sync_ddp`).

    Args:
        result: a numpy array, a CPU torch tensor, or a number.
        group: the process group (default: the world).
        reduce_op: as for :func:`sync_ddp`.

    Returns:
        The reduced value as :func:`sync_ddp` returns it, or ``result`` itself
        when no process group is initialized.

    Raises:
        TypeError: as :func:`sync_ddp`.
        ValueError: as :func:`sync_ddp`.

    Examples:
        >>> dist.sync_ddp_if_available(np.ones(2), reduce_op="sum")
        array([2., 2.])  # rank 0 and rank 1
        >>> dist.sync_ddp_if_available(torch.ones(2), reduce_op="max")
        tensor([1., 1.])  # rank 0 and rank 1
    """
    fn = "sync_ddp_if_available"
    _sync_args(result, reduce_op, fn)
    if not distributed_available():
        return result
    return sync_ddp(result, group=group, reduce_op=reduce_op)


def register_ddp_comm_hook(
    model: Any,
    ddp_comm_state: Any = None,
    ddp_comm_hook: Any = None,
    ddp_comm_wrapper: Any = None,
    *,
    state: Any = None,
) -> None:
    """Register ``ddp_comm_hook`` (wrapped by ``ddp_comm_wrapper`` if given) on a DDP model.

    Lightning's function: nothing happens when ``ddp_comm_hook`` is None; else
    ``model.register_comm_hook(ddp_comm_state, hook)`` with ``hook =
    ddp_comm_wrapper(ddp_comm_hook)`` when a wrapper is given. ``state=`` is
    accepted for ``ddp_comm_state`` (Lightning's documentation uses both).

    Args:
        model: A ``torch.nn.parallel.DistributedDataParallel`` (anything with
            ``register_comm_hook``).
        ddp_comm_state: The hook's state (``process_group``, a PowerSGD state, ...).
        ddp_comm_hook: The hook, ``hook(state, bucket) -> Future``; None does nothing.
        ddp_comm_wrapper: A wrapper applied to the hook, such as
            ``fp16_compress_wrapper``.
        state: Another name for ``ddp_comm_state``.

    Raises:
        TypeError: ``model`` has no ``register_comm_hook``, a hook or wrapper is
            not callable, or both ``ddp_comm_state`` and ``state`` are given.

    Examples:
        With ``import mpidist.torch`` and ``torch.distributed.init_process_group("mpidist")``:

        >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
        >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        >>> dist.register_ddp_comm_hook(model, ddp_comm_hook=default.fp16_compress_hook)
    """
    fn = "register_ddp_comm_hook"
    if state is not None:
        if ddp_comm_state is not None:
            raise TypeError(f"{fn}: got both ddp_comm_state and state (its alias); pass one")
        ddp_comm_state = state
    if not callable(getattr(model, "register_comm_hook", None)):
        raise TypeError(
            f"{fn}: model must be a torch.nn.parallel.DistributedDataParallel (it has register_comm_hook), "
            f"got {type(model).__name__}"
        )
    for arg, value in (("ddp_comm_hook", ddp_comm_hook), ("ddp_comm_wrapper", ddp_comm_wrapper)):
        if value is not None and not callable(value):
            raise TypeError(f"{fn}: {arg} must be callable or None, got {type(value).__name__}")
    if ddp_comm_hook is None:
        return
    hook = ddp_comm_hook if ddp_comm_wrapper is None else ddp_comm_wrapper(ddp_comm_hook)
    log.info(
        "%s: registering DDP comm hook %s%s",
        fn,
        getattr(ddp_comm_hook, "__qualname__", ddp_comm_hook),
        ""
        if ddp_comm_wrapper is None
        else f" wrapped by {getattr(ddp_comm_wrapper, '__qualname__', ddp_comm_wrapper)}",
    )
    model.register_comm_hook(state=ddp_comm_state, hook=hook)


def init_dist_connection(
    cluster_environment: Any,
    torch_distributed_backend: str | None,
    global_rank: int | None = None,
    world_size: int | None = None,
    **kwargs: Any,
) -> None:
    """Set ``MASTER_ADDR``/``MASTER_PORT`` from ``cluster_environment`` and initialize the default group.

    As Lightning's: ``global_rank`` and ``world_size`` default to the environment's
    ``global_rank()`` and ``world_size()``; ``MASTER_ADDR`` and ``MASTER_PORT`` are
    set from its ``main_address`` and ``main_port``; if the default group is
    already initialized nothing else happens. Then
    ``init_process_group(torch_distributed_backend, rank=global_rank,
    world_size=world_size, **kwargs)``, which checks the rank and world size
    against MPI and raises the same ValueError on every rank if they disagree.

    Args:
        cluster_environment: an object with ``main_address`` (str), ``main_port``
            (int), ``global_rank()`` and ``world_size()``, such as
            :class:`MPIEnvironment` or one of Lightning's ``ClusterEnvironment``.
        torch_distributed_backend: the backend, e.g. ``"mpi"`` (None means ``"mpi"``).
        global_rank: this process's rank (default: from the environment).
        world_size: the number of processes (default: from the environment).
        **kwargs: passed on to :func:`~mpidist.init_process_group` (``timeout``, ...).

    Raises:
        TypeError: the environment lacks one of the four members, or a rank,
            world size, address or port is of the wrong type.
        ValueError: a negative rank or world size, a port outside 0-65535, or
            (from ``init_process_group``, on every rank) a disagreement with MPI.

    Examples:
        >>> dist.init_dist_connection(dist.MPIEnvironment(), "mpi")  # under mpiexec -n 2
        >>> dist.get_world_size()
        2
    """
    fn = "init_dist_connection"
    for name in ("main_address", "main_port", "global_rank", "world_size"):
        if inspect.getattr_static(cluster_environment, name, None) is None:
            raise TypeError(
                f"{fn}: cluster_environment must provide main_address, main_port, global_rank() and "
                f"world_size() (like mpidist.MPIEnvironment); {type(cluster_environment).__name__} has no {name}"
            )
    if torch_distributed_backend is not None and not isinstance(torch_distributed_backend, str):
        raise TypeError(
            f"{fn}: torch_distributed_backend must be a backend name such as 'mpi', "
            f"got {type(torch_distributed_backend).__name__}"
        )
    if global_rank is None:
        global_rank = cluster_environment.global_rank()
    global_rank = int_arg(global_rank, fn, "global_rank")
    if world_size is None:
        world_size = cluster_environment.world_size()
    world_size = int_arg(world_size, fn, "world_size")
    address = cluster_environment.main_address
    if not isinstance(address, str) or not address:
        raise TypeError(f"{fn}: cluster_environment.main_address must be a non-empty str, got {address!r}")
    port = cluster_environment.main_port
    if isinstance(port, (bool, np.bool_)) or not hasattr(port, "__index__"):
        raise TypeError(f"{fn}: cluster_environment.main_port must be an int, got {type(port).__name__}")
    port = operator.index(port)
    if not 0 <= port <= 65535:
        raise ValueError(f"{fn}: cluster_environment.main_port must be in 0..65535, got {port}")
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)
    if is_initialized():
        log.debug("%s: the default process group is already initialized; nothing to do", fn)
        return
    log.info("Initializing distributed: GLOBAL_RANK: %d, MEMBER: %d/%d", global_rank, global_rank + 1, world_size)
    init_process_group(torch_distributed_backend, rank=global_rank, world_size=world_size, **kwargs)
    if get_rank() == 0:
        log.info(
            "%s\ndistributed_backend=%s\nAll distributed processes registered. Starting with %d processes\n%s",
            "-" * 100, torch_distributed_backend or "mpi", world_size, "-" * 100,
        )  # fmt: skip


class MPIEnvironment:
    """A cluster environment for processes started by an MPI launcher (``mpiexec``, ``srun``).

    Lightning's ``ClusterEnvironment`` interface (and its ``MPIEnvironment``): rank
    and world size come from ``MPI.COMM_WORLD``. The first access to
    ``main_address``, ``main_port``, ``local_rank()`` or ``node_rank()`` is
    collective (one all-gather of host names on a private communicator): every
    rank must make it. ``main_address`` is ``"127.0.0.1"`` when all ranks share one
    host, else rank 0's host name; ``main_port`` is a free TCP port found on rank 0.
    mpidist itself connects the processes through MPI and uses neither; they are
    for code that reads ``MASTER_ADDR``/``MASTER_PORT``.

    Raises:
        RuntimeError: MPI is not initialized (no launcher started the process and
            ``init_process_group`` has not been called).

    Examples:
        >>> env = dist.MPIEnvironment()
        >>> env.global_rank(), env.world_size()
        (0, 2)  # rank 0
        (1, 2)  # rank 1
        >>> dist.init_dist_connection(env, "mpi")
    """

    def __init__(self) -> None:
        from mpi4py import MPI

        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise RuntimeError(
                "MPIEnvironment: MPI is not initialized, so there is no MPI world to describe: start the "
                "processes with an MPI launcher (mpiexec -n N python script.py), or call "
                "mpidist.init_process_group() first"
            )
        self._comm_world = MPI.COMM_WORLD
        self._main_address: str | None = None
        self._main_port: int | None = None
        self._node_rank: int | None = None
        self._local_rank: int | None = None

    @property
    def creates_processes_externally(self) -> bool:
        """True: the MPI launcher starts the processes.

        Examples:
            >>> dist.MPIEnvironment().creates_processes_externally
            True
        """
        return True

    @property
    def main_address(self) -> str:
        """The address for ``MASTER_ADDR`` (collective on first access).

        Examples:
            >>> dist.MPIEnvironment().main_address  # every rank on one host
            '127.0.0.1'
        """
        self._discover()
        return self._main_address  # type: ignore[return-value]

    @property
    def main_port(self) -> int:
        """A free port on rank 0's host for ``MASTER_PORT`` (collective on first access).

        Raises:
            RuntimeError: rank 0 found no free port (on every rank).

        Examples:
            >>> port = dist.MPIEnvironment().main_port  # the same on every rank
        """
        self._discover()
        return self._main_port  # type: ignore[return-value]

    @staticmethod
    def detect() -> bool:
        """Return True if MPI is initialized and its world has more than one process.

        Returns:
            True under an MPI launcher with more than one process.

        Examples:
            >>> dist.MPIEnvironment.detect()  # under mpiexec -n 2
            True
        """
        try:
            from mpi4py import MPI
        except ImportError:
            return False
        return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1

    def world_size(self) -> int:
        """Return the number of processes in MPI's world.

        Returns:
            ``MPI.COMM_WORLD``'s size.

        Examples:
            >>> dist.MPIEnvironment().world_size()
            2
        """
        return self._comm_world.Get_size()

    def set_world_size(self, size: int) -> None:
        """Ignore: the MPI launcher fixes the world size.

        Args:
            size: Ignored (logged at DEBUG level).

        Examples:
            >>> env = dist.MPIEnvironment()
            >>> env.set_world_size(8)
            >>> env.world_size()  # under mpiexec -n 2
            2
        """
        log.debug("MPIEnvironment.set_world_size was called, but the world size comes from MPI; ignored")

    def global_rank(self) -> int:
        """Return this process's rank in MPI's world.

        Returns:
            ``MPI.COMM_WORLD``'s rank.

        Examples:
            >>> dist.MPIEnvironment().global_rank()
            0  # rank 0
            1  # rank 1
        """
        return self._comm_world.Get_rank()

    def set_global_rank(self, rank: int) -> None:
        """Ignore: the MPI launcher fixes the rank.

        Args:
            rank: Ignored (logged at DEBUG level).

        Examples:
            >>> env = dist.MPIEnvironment()
            >>> env.set_global_rank(5)
            >>> env.global_rank()
            0  # rank 0
            1  # rank 1
        """
        log.debug("MPIEnvironment.set_global_rank was called, but the rank comes from MPI; ignored")

    def local_rank(self) -> int:
        """Return this process's rank among the processes on its host (collective on first call).

        Returns:
            The host-local rank, counted in global-rank order.

        Examples:
            >>> dist.MPIEnvironment().local_rank()  # every rank on one host
            0  # rank 0
            1  # rank 1
        """
        self._discover()
        return self._local_rank  # type: ignore[return-value]

    def node_rank(self) -> int:
        """Return the index of this process's host among the sorted host names (collective on first call).

        Returns:
            The node rank, from 0 to the number of hosts - 1.

        Examples:
            >>> dist.MPIEnvironment().node_rank()  # every rank on one host
            0
        """
        self._discover()
        return self._node_rank  # type: ignore[return-value]

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Accept any settings (Lightning's hook for environments with constraints).

        Args:
            num_devices: Devices per node Lightning was given; not checked.
            num_nodes: Nodes Lightning was given; not checked.

        Examples:
            >>> dist.MPIEnvironment().validate_settings(num_devices=1, num_nodes=2)
        """

    def teardown(self) -> None:
        """Nothing to clean up.

        Examples:
            >>> dist.MPIEnvironment().teardown()
        """

    def _discover(self) -> None:
        """Learn every rank's host name, and rank 0's port, in one all-gather."""
        if self._main_address is not None:
            return
        comm = self._comm_world.Dup()  # library traffic never meets the user's messages
        try:
            me = comm.Get_rank()
            proposal: tuple[int | None, str | None] = (None, None)
            if me == 0:
                try:
                    proposal = (free_port(), None)
                except OSError as exc:
                    proposal = (None, f"rank 0 could not find a free TCP port: {exc}")
            everyone = comm.allgather((socket.gethostname(), proposal))
        finally:
            comm.Free()
        port, error = everyone[0][1]
        if error is not None:  # raised on every rank alike
            raise RuntimeError(f"MPIEnvironment: {error}")
        hosts = [host for host, _ in everyone]
        unique = sorted(set(hosts))
        self._node_rank = unique.index(hosts[me])
        self._local_rank = hosts[:me].count(hosts[me])
        self._main_port = port
        self._main_address = "127.0.0.1" if len(unique) == 1 else hosts[0]

    def __repr__(self) -> str:
        return f"MPIEnvironment(global_rank={self.global_rank()}, world_size={self.world_size()})"
