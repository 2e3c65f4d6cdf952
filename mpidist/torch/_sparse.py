"""``all_reduce`` of a sparse COO tensor, as gloo does it.

gloo gathers every rank's indices and values, sums them (``coalesce``) and
copies the result into the caller's tensor: the same tensor object afterwards
holds the coalesced sum (``is_coalesced()`` True), and ``work.result()`` and the
Future's value are ``[tensor]``. Only ``ReduceOp.SUM`` is defined for sparse
tensors. Here the same steps run on mpidist: one all-gather of each rank's
description (nnz, sparse and dense dimensions, shape), then an all-gather of
the indices (as ``nnz x sparse_dim`` rows) and one of the values, whose sizes
differ from rank to rank (mpidist's ``all_gather`` takes that).

The call completes before it returns, also with ``async_op=True`` (the Work it
then returns is complete): a sparse all-reduce is made of three dependent
exchanges.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import collectives
from ..reduce_op import ReduceOp

__all__ = ["all_reduce"]


def all_reduce(tensor: Any, op: Any, group: Any, fn: str = "allreduce") -> None:
    """Sum the sparse COO ``tensor`` over ``group`` (a mpidist group) into ``tensor`` itself (coalesced)."""
    if op is not ReduceOp.SUM and getattr(op, "name", None) != "SUM":
        raise ValueError(
            f"{fn}: a sparse tensor can only be summed (ReduceOp.SUM), got {getattr(op, 'name', op)}; "
            "gloo refuses the same; convert it with to_dense() first for other reductions"
        )
    mine = tensor.coalesce()
    shape = list(mine.shape)
    described = torch.tensor([mine._nnz(), mine.sparse_dim(), mine.dense_dim(), *_padded(shape)], dtype=torch.int64)
    every = [torch.empty_like(described) for _ in range(group.size())]
    collectives.all_gather(every, described, group)
    for rank, other in enumerate(every):
        if not torch.equal(other[1:], described[1:]):
            raise ValueError(
                f"{fn}: sparse tensors differ across ranks: this rank's has shape {shape} with "
                f"{mine.sparse_dim()} sparse dimensions, group rank {rank}'s {_shape(other)} with "
                f"{int(other[1])}; every rank must pass the same shape and layout"
            )
    counts = [int(d[0]) for d in every]
    rows = mine.indices().t().contiguous()  # nnz x sparse_dim: gathered along the first dimension
    values = mine.values().contiguous()
    dense = tuple(values.shape[1:])
    all_rows = [rows.new_empty((n, rows.shape[1])) for n in counts]
    all_values = [values.new_empty((n, *dense)) for n in counts]
    collectives.all_gather(all_rows, rows, group)
    collectives.all_gather(all_values, values, group)
    total = torch.sparse_coo_tensor(torch.cat(all_rows).t(), torch.cat(all_values), mine.shape).coalesce()
    tensor.copy_(total)


#: at most this many dimensions travel in the description (shapes are compared up to it, and by count)
_DIMS = 8


def _padded(shape: list[int]) -> list[int]:
    head = shape[:_DIMS]
    return [len(shape), *head, *([-1] * (_DIMS - len(head)))]


def _shape(described: Any) -> list[int]:
    n = int(described[3])
    return [int(s) for s in described[4 : 4 + min(n, _DIMS)]]
