"""Collectives inside torch's autograd graph: Lightning's ``AllGatherGrad``.

This module imports torch (``import mpidist`` does not; torch is optional).
:func:`mpidist.all_gather_ddp_if_available` with ``sync_grads=True`` uses it, and
``mpidist.utils.AllGatherGrad`` is the same class, where Lightning keeps it.
"""

from __future__ import annotations

from typing import Any

try:
    import torch
    from torch.autograd.function import once_differentiable
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mpidist.autograd needs torch (pip install 'mpidist[torch]'); the rest of mpidist works without it"
    ) from exc

from .arrays.host import array_or_tensor_arg
from .collectives import all_gather_into_tensor, all_reduce
from .process_group import ProcessGroup, resolve_group
from .reduce_op import ReduceOp

__all__ = ["AllGatherGrad"]


class AllGatherGrad(torch.autograd.Function):
    """All-gather a tensor in the forward pass; sum its gradient across the group in the backward pass.

    Lightning's ``AllGatherGrad``, called as ``AllGatherGrad.apply(tensor, group=None)``:
    it returns a new tensor of shape ``(world_size, *tensor.shape)`` whose row ``i`` is
    group rank ``i``'s ``tensor``, as :func:`~mpidist.all_gather_into_tensor`. The
    backward pass all-reduces the incoming gradient (``ReduceOp.SUM``) across the
    group and returns this rank's slice: the gradient of ``tensor`` on rank ``r`` is
    the sum over every rank of that rank's upstream gradient at row ``r``, i.e. the
    derivative of the sum of all ranks' losses.

    Both passes are collectives: every rank of ``group`` must call ``apply`` with
    the same shape and dtype, and every rank must then backpropagate through its
    result (in the same order as the other gathers on the group), so either every
    rank's ``tensor`` requires grad or none does. The backward pass is once
    differentiable (``create_graph=True`` raises if differentiated again). Unlike
    Lightning's code, the world size and the slice come from ``group`` (Lightning
    takes them from the default group), so subgroups work.

    Args:
        tensor: a CPU torch tensor of a dtype mpidist sends (bfloat16 included).
        group: the process group (default: the world).

    Returns:
        The stacked tensor; None on ranks outside ``group`` (no communication).

    Raises:
        TypeError: ``tensor`` is not a CPU torch tensor of a supported dtype, or
            ``group`` is not a process group.
        RuntimeError: no default process group, or ``group`` was destroyed
            (also when that happens between the forward and the backward pass).

    Example (``mpiexec -n 2``)::

        >>> from mpidist.autograd import AllGatherGrad
        >>> x = torch.full((2,), 1.0 + dist.get_rank(), requires_grad=True)
        >>> gathered = AllGatherGrad.apply(x)          # [[1., 1.], [2., 2.]] on both ranks
        >>> (gathered * (dist.get_rank() + 1)).sum().backward()
        >>> x.grad                                     # tensor([3., 3.]) on both ranks: 1 + 2
    """

    @staticmethod
    def forward(ctx: Any, tensor: Any, group: ProcessGroup | None = None) -> Any:
        """Gather ``tensor`` from every rank of ``group`` into a new stacked tensor."""
        fn = "AllGatherGrad"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{fn}: tensor must be a torch.Tensor, got {type(tensor).__module__}.{type(tensor).__qualname__}; "
                "use mpidist.all_gather_ddp_if_available for numpy arrays"
            )
        view, _ = array_or_tensor_arg(tensor, fn, "tensor")
        pg = resolve_group(group, fn)
        if pg is None:  # not a member of group: like the collectives, do nothing
            return None
        ctx.group = pg
        ctx.group_rank = pg.rank()
        out = torch.empty((pg.size(), *tensor.shape), dtype=tensor.dtype)
        all_gather_into_tensor(out, view, group=pg)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_output: Any) -> tuple[Any, None]:
        """Sum the gradient of the stacked tensor across the group; return this rank's row."""
        pg = resolve_group(ctx.group, "AllGatherGrad.backward")  # raises if the group was destroyed meanwhile
        # reduced in place, so a contiguous copy: the incoming gradient may be the caller's tensor or an expanded view
        grad = grad_output[0].clone(memory_format=torch.contiguous_format)
        all_reduce(grad, op=ReduceOp.SUM, group=pg)
        # a copy of this rank's row, so the (world_size times larger) sum is not kept alive by .grad
        return grad[ctx.group_rank].clone(), None
