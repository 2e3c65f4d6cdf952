"""DistributedSampler against torch's (same partition) and against its own documented rules.

Most tests are local (explicit ``num_replicas``/``rank``) and run identically on
every rank; the ones that take the defaults from the process group gather every
rank's indices and check the partition across the real ranks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import DistributedSampler

from helpers import check_raises, fail_together

pytestmark = pytest.mark.timeout(120)

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
LENGTHS = [*range(0, 26), 31, 64, 97, 128]
REPLICAS = range(1, 8)


def torch_sampler_class():
    torch = pytest.importorskip("torch")
    return torch, torch.utils.data.distributed.DistributedSampler


def interleave(per_rank: list[list[int]]) -> list[int]:
    """Undo the subsampling: the padded (or cut) index list that the ranks' shares came from."""
    n = len(per_rank)
    total = sum(len(p) for p in per_rank)
    out = [0] * total
    for r, part in enumerate(per_rank):
        out[r:total:n] = part
    return out


def expected_list(order: np.ndarray, total_size: int) -> list[int]:
    """The documented rule: cut to total_size, or pad by repeating ``order`` from its start."""
    if len(order) == 0 or total_size == 0:
        return []
    reps = math.ceil(total_size / len(order))
    return np.concatenate([order] * reps)[:total_size].tolist()


# -- the partition is torch's -------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_unshuffled_indices_equal_torchs(drop_last):
    _, TorchSampler = torch_sampler_class()
    problems: list[str] = []
    for length in LENGTHS:
        data = list(range(length))
        for n in REPLICAS:
            for r in range(n):
                ours = DistributedSampler(data, num_replicas=n, rank=r, shuffle=False, drop_last=drop_last)
                theirs = TorchSampler(data, num_replicas=n, rank=r, shuffle=False, drop_last=drop_last)
                got = (list(ours), len(ours), ours.num_samples, ours.total_size)
                want = (list(theirs), len(theirs), theirs.num_samples, theirs.total_size)
                if got != want:
                    problems.append(f"len={length} n={n} rank={r}: {got} != torch's {want}")
    fail_together(problems)


class TorchOrderSampler(DistributedSampler):
    """Our sampler fed with torch's shuffled order, to compare the partition of shuffled indices."""

    def _order(self, length: int) -> np.ndarray:
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return np.asarray(torch.randperm(length, generator=g).tolist(), dtype=np.int64)


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_partition_equals_torchs_given_torchs_order(drop_last):
    _, TorchSampler = torch_sampler_class()
    problems: list[str] = []
    for length in LENGTHS:
        for n in REPLICAS:
            for r in range(n):
                for seed, epoch in [(0, 0), (7, 3)]:
                    ours = TorchOrderSampler(range(length), num_replicas=n, rank=r, seed=seed, drop_last=drop_last)
                    theirs = TorchSampler(range(length), num_replicas=n, rank=r, seed=seed, drop_last=drop_last)
                    ours.set_epoch(epoch)
                    theirs.set_epoch(epoch)
                    if (list(ours), len(ours)) != (list(theirs), len(theirs)):
                        problems.append(f"len={length} n={n} rank={r} seed={seed} epoch={epoch}")
    fail_together(problems)


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_partition_follows_the_documented_rule(drop_last):
    """Without torch: the ranks' shares interleave back into the numpy permutation, padded or cut."""
    problems: list[str] = []
    for length in LENGTHS:
        for n in REPLICAS:
            for seed, epoch in [(0, 0), (3, 1), (-5, 2)]:
                samplers = [
                    DistributedSampler(range(length), num_replicas=n, rank=r, seed=seed, drop_last=drop_last)
                    for r in range(n)
                ]
                for s in samplers:
                    s.set_epoch(epoch)
                shares = [list(s) for s in samplers]
                key = seed + epoch
                order = np.random.default_rng(key % 2**64 if key < 0 else key).permutation(length)
                total = samplers[0].total_size
                per = length // n if drop_last else math.ceil(length / n)
                where = f"len={length} n={n} seed={seed} epoch={epoch}"
                if sorted(order.tolist()) != list(range(length)):
                    problems.append(f"{where}: not a permutation")
                if [len(p) for p in shares] != [per] * n or total != per * n:
                    problems.append(f"{where}: share sizes {[len(p) for p in shares]}, expected {per} each")
                if interleave(shares) != expected_list(order, total):
                    problems.append(f"{where}: shares do not interleave into the padded permutation")
                if drop_last and len(set(interleave(shares))) != total:
                    problems.append(f"{where}: drop_last shares overlap")
    fail_together(problems)


# -- shuffling -----------------------------------------------------------------------------


def test_shuffle_is_deterministic_per_epoch_and_changes_between_epochs():
    def share(seed=0, epoch=0, rank=0):
        s = DistributedSampler(range(100), num_replicas=3, rank=rank, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert share(epoch=1) == share(epoch=1)
    assert share(epoch=0) != share(epoch=1) != share(epoch=2)
    assert share(seed=1) != share(seed=2)
    assert share(seed=2, epoch=3) == share(seed=4, epoch=1)  # seeded with seed + epoch, as torch
    assert share(epoch=1) != list(range(0, 100, 3))[:34]
    for epoch in range(3):  # every epoch, the three shares cover the dataset (2 indices repeated)
        shares = [share(epoch=epoch, rank=r) for r in range(3)]
        assert sorted(set().union(*shares)) == list(range(100))
        assert sum(len(p) for p in shares) == 102


def test_unshuffled_order_is_sequential():
    s = DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False)
    assert list(s) == [1, 4, 7, 0]
    s.set_epoch(5)
    assert list(s) == [1, 4, 7, 0]


def test_padding_longer_than_the_dataset_wraps_repeatedly():
    shares = [list(DistributedSampler(range(2), num_replicas=7, rank=r, shuffle=False)) for r in range(7)]
    assert shares == [[0], [1], [0], [1], [0], [1], [0]]
    assert [list(DistributedSampler(range(2), num_replicas=7, rank=r, drop_last=True)) for r in range(7)] == [[]] * 7


# -- defaults from the process group, across the real ranks -------------------------------------


@pytest.mark.parametrize("length", [0, 1, SIZE, 4 * SIZE, 4 * SIZE + 1, 37])
@pytest.mark.parametrize("drop_last", [False, True])
def test_default_replicas_partition_the_dataset_over_the_ranks(length, drop_last):
    problems: list[str] = []
    for epoch in range(3):
        s = DistributedSampler(list(range(length)), drop_last=drop_last, seed=11)
        s.set_epoch(epoch)
        mine = list(s)
        shares = MPI.COMM_WORLD.allgather(mine)
        if (s.num_replicas, s.rank) != (SIZE, RANK):
            problems.append(f"num_replicas, rank = {s.num_replicas}, {s.rank}; expected {SIZE}, {RANK}")
        flat = interleave(shares)
        if drop_last:
            if len(flat) != len(set(flat)) or len(flat) != length - length % SIZE:
                problems.append(f"epoch {epoch}: drop_last shares {shares} overlap or have the wrong size")
        elif sorted(set(flat)) != list(range(length)) or len(flat) != math.ceil(length / SIZE) * SIZE:
            problems.append(f"epoch {epoch}: shares {shares} do not cover 0..{length - 1} exactly once plus padding")
        if len({len(p) for p in shares}) > 1 or len(mine) != len(s):
            problems.append(f"epoch {epoch}: share sizes differ: {[len(p) for p in shares]}, len {len(s)}")
        if length == SIZE * 4 and sorted(flat) != list(range(length)):
            problems.append(f"epoch {epoch}: an evenly divisible dataset is not split without padding")
    fail_together(problems)


def test_defaults_need_a_group_unless_given(no_group):
    problems = check_raises(
        RuntimeError,
        r"^DistributedSampler: num_replicas and rank not given and the default process group is not initialized",
        DistributedSampler,
        range(4),
    )
    problems += check_raises(
        RuntimeError, r"^DistributedSampler: rank not given", DistributedSampler, range(4), num_replicas=2
    )
    s = DistributedSampler(range(5), num_replicas=2, rank=1, shuffle=False)
    if list(s) != [1, 3, 0]:
        problems.append(f"explicit num_replicas and rank without a group: {list(s)}")
    fail_together(problems)


# -- arguments and datasets ---------------------------------------------------------------


def test_bad_arguments():
    problems = check_raises(
        ValueError,
        r"^DistributedSampler: invalid rank 3, rank should be in the interval \[0, 2\]",
        DistributedSampler,
        range(4),
        num_replicas=3,
        rank=3,
    )
    problems += check_raises(
        ValueError, r"^DistributedSampler: invalid rank -1", DistributedSampler, range(4), num_replicas=3, rank=-1
    )
    problems += check_raises(
        ValueError,
        r"^DistributedSampler: num_replicas must be at least 1, got 0",
        DistributedSampler,
        range(4),
        num_replicas=0,
        rank=0,
    )
    problems += check_raises(
        TypeError,
        r"^DistributedSampler: dataset must have a length \(__len__\), got generator",
        DistributedSampler,
        (i for i in range(3)),
        num_replicas=1,
        rank=0,
    )
    problems += check_raises(
        TypeError,
        r"^DistributedSampler: rank must be an int, got float",
        DistributedSampler,
        range(4),
        num_replicas=2,
        rank=1.0,
    )
    problems += check_raises(
        TypeError,
        r"^DistributedSampler: num_replicas must be an int, got str",
        DistributedSampler,
        range(4),
        num_replicas="2",
        rank=0,
    )
    problems += check_raises(
        TypeError,
        r"^DistributedSampler: shuffle must be a bool, got str",
        DistributedSampler,
        range(4),
        1,
        0,
        shuffle="yes",
    )
    problems += check_raises(
        TypeError,
        r"^DistributedSampler: drop_last must be a bool, got int",
        DistributedSampler,
        range(4),
        1,
        0,
        drop_last=1,
    )
    problems += check_raises(
        TypeError, r"^DistributedSampler: seed must be an int, got float", DistributedSampler, range(4), 1, 0, seed=0.5
    )
    problems += check_raises(
        TypeError,
        r"^DistributedSampler.set_epoch: epoch must be an int, got str",
        DistributedSampler(range(4), 1, 0).set_epoch,
        "1",
    )
    fail_together(problems)


def test_rank_out_of_range_is_a_value_error_in_torch_too():
    _, TorchSampler = torch_sampler_class()
    for rank in (-1, 3, 4):
        with pytest.raises(ValueError):
            TorchSampler(range(4), num_replicas=3, rank=rank)
        with pytest.raises(ValueError):
            DistributedSampler(range(4), num_replicas=3, rank=rank)


class Sized:
    """A dataset that only has a length."""

    def __len__(self) -> int:
        return 11


def test_any_sized_dataset():
    for data in (Sized(), list("abcdefghijk"), np.zeros((11, 2)), range(11), "abcdefghijk"):
        s = DistributedSampler(data, num_replicas=4, rank=3, shuffle=False)
        assert list(s) == [3, 7, 0]
        assert all(type(i) is int for i in s)
        assert len(s) == s.num_samples == 3 and s.total_size == 12


def test_dataset_that_changed_length():
    data = list(range(10))
    s = DistributedSampler(data, num_replicas=3, rank=0, shuffle=False)
    data.extend([10, 11, 12])
    with pytest.raises(RuntimeError, match=r"^DistributedSampler: the dataset has 13 items"):
        list(s)
    data[:] = [0, 1, 2, 3, 4, 5, 6, 7, 8]  # shorter: padding still fills the partition, as in torch
    assert list(s) == [0, 3, 6, 0]


def test_attributes_and_repr_match_torch():
    torch, TorchSampler = torch_sampler_class()
    ours = DistributedSampler(range(10), num_replicas=4, rank=2, shuffle=True, seed=5, drop_last=True)
    theirs = TorchSampler(range(10), num_replicas=4, rank=2, shuffle=True, seed=5, drop_last=True)
    for attr in ("num_replicas", "rank", "epoch", "drop_last", "num_samples", "total_size", "shuffle", "seed"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    ours.set_epoch(4)
    theirs.set_epoch(4)
    assert ours.epoch == theirs.epoch == 4
    assert repr(ours).startswith("DistributedSampler(num_replicas=4, rank=2, shuffle=True, seed=5")


def test_works_as_a_torch_dataloader_sampler():
    torch, _ = torch_sampler_class()
    data = list(range(100, 110))
    s = DistributedSampler(data, num_replicas=3, rank=2, shuffle=False)
    loader = torch.utils.data.DataLoader(data, sampler=s, batch_size=2)
    batches = [b.tolist() for b in loader]
    assert batches == [[102, 105], [108, 101]]
