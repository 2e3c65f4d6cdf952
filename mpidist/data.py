"""``DistributedSampler``: torch's partition of a dataset's indices over the ranks, without torch.

Each rank iterates over its own ``num_samples`` indices. The partition follows
``torch.utils.data.distributed.DistributedSampler`` exactly: the (optionally
shuffled) index list is padded by wrapping around, or with ``drop_last=True``
cut, to a multiple of ``num_replicas``, and rank ``r`` takes every
``num_replicas``-th index starting at ``r``. Only the shuffled order differs from
torch's (numpy's generator instead of ``torch.randperm``).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterator

import numpy as np

from .init import get_rank, get_world_size, is_initialized

__all__ = ["DistributedSampler"]


def _int(value: Any, fn: str, arg: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise TypeError(f"{fn}: {arg} must be an int, got {type(value).__name__}")
    return operator.index(value)


def _bool(value: Any, fn: str, arg: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {arg} must be a bool, got {type(value).__name__}")
    return bool(value)


class DistributedSampler:
    """Sample the indices of ``dataset`` that belong to one rank, as torch's ``DistributedSampler``.

    Works with any dataset that has ``__len__``; iterate over it (or pass it as
    ``sampler=`` to a torch ``DataLoader``) to get this rank's indices as Python
    ints. Call :meth:`set_epoch` at the start of every epoch so that shuffling
    differs between epochs.

    Partition (identical to torch's): ``num_samples`` is ``ceil(len / num_replicas)``,
    or ``floor(len / num_replicas)`` with ``drop_last=True``; ``total_size`` is
    ``num_samples * num_replicas``. The index list ``0..len-1`` (shuffled if
    ``shuffle``) is cut to ``total_size`` with ``drop_last=True``, otherwise padded
    to it by repeating the list from its start (as often as needed when padding
    exceeds the dataset); rank ``r`` gets ``indices[r:total_size:num_replicas]``.

    Shuffling: the order is ``numpy.random.default_rng(seed + epoch).permutation(len)``,
    deterministic and the same on every rank, but not torch's order (which comes
    from ``torch.randperm`` with a ``torch.Generator`` seeded with ``seed + epoch``).

    Args:
        dataset: any object with ``__len__``.
        num_replicas: number of ranks sharing the dataset (default: the default
            process group's world size).
        rank: this rank's index in ``0..num_replicas-1`` (default: its rank in
            the default process group).
        shuffle: shuffle the indices (default True).
        seed: seed of the shuffle; must be the same on every rank.
        drop_last: drop the tail so that every rank gets ``floor(len / num_replicas)``
            indices, instead of padding so that every rank gets ``ceil(...)``.

    Raises:
        RuntimeError: ``num_replicas`` or ``rank`` is not given and the default
            process group is not initialized.
        TypeError: ``dataset`` has no ``__len__``, or an argument has the wrong type.
        ValueError: ``num_replicas < 1`` or ``rank`` outside ``[0, num_replicas - 1]``.

    Examples:
        >>> sampler = dist.DistributedSampler(range(5), shuffle=False)
        >>> list(sampler)
        [0, 2, 4]  # rank 0
        [1, 3, 0]  # rank 1 (0 repeated: padding)
        >>> for epoch in range(3):
        ...     sampler.set_epoch(epoch)
        ...     for i in sampler:
        ...         pass  # train on dataset[i]
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        fn = "DistributedSampler"
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"{fn}: dataset must have a length (__len__), got {type(dataset).__name__}")
        length = len(dataset)
        shuffle = _bool(shuffle, fn, "shuffle")
        drop_last = _bool(drop_last, fn, "drop_last")
        seed = _int(seed, fn, "seed")
        if num_replicas is None or rank is None:
            if not is_initialized():
                missing = " and ".join(a for a, v in (("num_replicas", num_replicas), ("rank", rank)) if v is None)
                raise RuntimeError(
                    f"{fn}: {missing} not given and the default process group is not initialized; "
                    "call mpidist.init_process_group() first or pass num_replicas and rank"
                )
        num_replicas = get_world_size() if num_replicas is None else _int(num_replicas, fn, "num_replicas")
        rank = get_rank() if rank is None else _int(rank, fn, "rank")
        if num_replicas < 1:
            raise ValueError(f"{fn}: num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"{fn}: invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        if drop_last and length % num_replicas != 0:
            self.num_samples = length // num_replicas  # torch: ceil((len - n) / n), the same number
        else:
            self.num_samples = math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle = shuffle
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        length = len(self.dataset)
        if self.drop_last:
            fits = length >= self.total_size
        else:  # padding repeats the indices, so there must be some (torch fails here too)
            fits = length <= self.total_size and (length > 0 or self.total_size == 0)
        if not fits:
            raise RuntimeError(
                f"DistributedSampler: the dataset has {length} items, which does not fit the partition made "
                f"for {self.total_size} (num_samples={self.num_samples} per rank); create a new sampler "
                "after the dataset changes length"
            )
        indices = self._order(length)
        if length:
            # pad by wrapping around, or cut the tail (np.resize repeats the array cyclically)
            indices = np.resize(indices, self.total_size)
        return iter(indices[self.rank : self.total_size : self.num_replicas].tolist())

    def _order(self, length: int) -> np.ndarray:
        """Return the indices ``0..length-1`` in this epoch's order, before padding and subsampling."""
        if not self.shuffle:
            return np.arange(length)
        key = self.seed + self.epoch
        return np.random.default_rng(key % 2**64 if key < 0 else key).permutation(length)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the shuffle (with ``seed``): call it before each epoch.

        Every rank must use the same epoch, or the ranks' indices overlap.

        Args:
            epoch: The epoch number, an int.

        Raises:
            TypeError: ``epoch`` is not an int.

        Examples:
            >>> sampler = dist.DistributedSampler(range(6), num_replicas=2, rank=0)
            >>> sampler.set_epoch(0)
            >>> list(sampler)
            [3, 5, 0]
            >>> sampler.set_epoch(1)
            >>> list(sampler)  # another order each epoch
            [4, 2, 5]
        """
        self.epoch = _int(epoch, "DistributedSampler.set_epoch", "epoch")

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(num_replicas={self.num_replicas}, rank={self.rank}, shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last}, num_samples={self.num_samples})"
        )
