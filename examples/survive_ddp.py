"""torch DDP over the "mpidist" backend that goes on after a rank is killed, and matches a reference bit for bit.

    mpidistrun --with-ft --nproc-per-node 4 examples/survive_ddp.py --kill-rank 1 --kill-step 5
    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/survive_ddp.py --kill-rank 1 --kill-step 5
    python examples/survive_ddp.py --reference --world 4 --kill-step 5   # the reference alone, one process

A linear model (``nn.Linear``) in ``DistributedDataParallel`` on ``init_process_group("mpidist")``,
a fixed synthetic dataset sharded by torch's ``DistributedSampler``. At ``--kill-step`` the rank
``--kill-rank`` SIGKILLs itself after its forward pass, before its backward's all-reduce. The recovery:

1. keep a copy of the parameters after the last step every rank completed (``synced``);
2. the survivors' ``loss.backward()`` raises: DDP's reducer (C++) re-raises the backend's error as a
   RuntimeError quoting it; torch's default group sits on mpidist's default group, revoked by the
   failure, and any mpidist call on it raises the ``ProcessFailedError`` again with the dead ranks;
3. ``mpidist.shrink_group(failure.failed_group_ranks)`` makes the survivors mpidist's world, then
   ``destroy_process_group()`` and ``init_process_group("mpidist", store=, rank=, world_size=)``
   put torch's default group on it (a new TCPStore on the new rank 0);
4. restore ``synced`` into a new DDP, shard the epoch in progress anew (same epoch, same batch
   index), redo the failed step and finish.

Each survivor prints ``RESULT old= new= size= steps= params= loss= ref_equal= detect= recover=``;
``ref_equal`` compares the parameters bit for bit with plain torch in one process that computes every
rank's gradient and averages them (``world`` ranks before the kill step, one fewer from it on).
float32 allows that because every sum is exact: small integer data, a power-of-two batch and learning
rate, parameters kept on a grid of 2**-10, so the ranks' gradients are multiples of 2**-11 whose
magnitudes add up to under 2**7 (18 significant bits, of float32's 24; the reference checks every
step) and the all-reduce adds them without rounding in any order. The DDP hook averages with
``ReduceOp.AVG``, which divides once after the sum (DDP's default divides each rank's gradient
first: three roundings whose sum depends on MPI's order), as the reference does. ``detect``: seconds
from entering the failed backward to the error; ``recover``: from the error to the redone step's end.
With Open MPI's heartbeat detector on (``--mca mpi_ft_detector true``), raise its timeout
(``--mca mpi_ft_detector_timeout 60``) on a loaded machine: a rank that spends more than 10 s in
Python without calling MPI (DDP's first use imports torch._dynamo) can be declared dead.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpidist
import mpidist.torch  # noqa: F401 - registers the "mpidist" backend (an installed mpidist does at import torch)

N, D, B = 64, 4, 4  # samples, features, batch per rank (a power of two: dividing by it is exact)
SEED = 11
LR = 2.0**-5
GRID = 2.0**-10  # the parameters' fixed-point grid
TIMEOUT = timedelta(seconds=60)


def make_data() -> TensorDataset:
    """A regression problem of small integers (exactly representable, every product exact)."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randint(-2, 3, (N, D), generator=g).float()
    w_true = torch.randint(-3, 4, (D, 1), generator=g).float()
    y = x @ w_true + torch.randint(-1, 2, (N, 1), generator=g).float()
    return TensorDataset(x, y)


def make_model() -> nn.Linear:
    torch.manual_seed(SEED)
    model = nn.Linear(D, 1)
    snap(model)
    return model


def snap(model: nn.Module) -> None:
    """Round the parameters to the grid (after every step)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.round(p / GRID) * GRID)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def full_loss(model: nn.Module, data: TensorDataset) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]))


def avg_hook(group, bucket):  # noqa: ANN001, ANN201 - DDP rejects annotations that are strings (__future__)
    """DDP communication hook: all-reduce with ReduceOp.AVG (one rounding, after an exact sum)."""
    work = tdist.all_reduce(bucket.buffer(), op=tdist.ReduceOp.AVG, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def check_exact(grads: list[torch.Tensor]) -> None:
    """Raise unless the gradients are multiples of 2*GRID/B whose magnitudes add up below 2**24."""
    unit = 2 * GRID / B
    scaled = torch.stack([g.double() / unit for g in grads])
    if not (torch.equal(scaled, scaled.round()) and scaled.abs().sum(0).max() < 2.0**24):
        raise AssertionError(f"gradients not exact on the grid: {grads}")


def reference(world: int, kill_step: int, steps: int) -> nn.Linear:
    """The same training in plain torch: every rank's gradient here, ``world - 1`` ranks from ``kill_step``."""
    data = make_data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    n, step, epoch, j = world, 0, 0, 0
    while step < steps:
        orders = []
        for r in range(n):
            sampler = DistributedSampler(data, num_replicas=n, rank=r, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        per_epoch = len(orders[0]) // B
        while j < per_epoch and step < steps:
            if step == kill_step and n == world:
                n -= 1  # the world shrinks: the same epoch and batch index, sharded anew
                break
            per_rank = []
            for order in orders:
                x, y = data[order[j * B : (j + 1) * B]]
                model.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                per_rank.append([p.grad.clone() for p in model.parameters()])
            for p, grads in zip(model.parameters(), zip(*per_rank)):
                check_exact(list(grads))
                p.grad = torch.stack(grads).sum(0) / n  # an exact sum, then AVG's one rounding
            opt.step()
            snap(model)
            step, j = step + 1, j + 1
        else:
            epoch, j = epoch + 1, 0
    return model


def failure_behind(exc: RuntimeError) -> mpidist.ProcessFailedError | None:
    """The ProcessFailedError behind torch's RuntimeError ``exc``, or None if no member died.

    A failure revokes the mpidist group under torch's default group (``mpi_comm.Is_revoked()``,
    a local check), and every call on it then raises the ProcessFailedError at once.
    """
    group = tdist.group.WORLD.mpidist_group
    if not group.mpi_comm.Is_revoked():
        return None
    try:
        mpidist.barrier(group=group)
    except mpidist.ProcessFailedError as failure:
        return failure
    return None


def survivors_store() -> tdist.Store:
    """A torch TCPStore hosted by the (new) rank 0, for torch's default group on the survivors."""
    rank, n = mpidist.get_rank(), mpidist.get_world_size()
    store = None
    where: list[object] = [None, None]
    if rank == 0:
        host = socket.gethostname()
        store = tdist.TCPStore(host, 0, n, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        where = [host, store.port]
    mpidist.broadcast_object_list(where, src=0)
    if store is None:
        store = tdist.TCPStore(where[0], where[1], n, is_master=False, timeout=TIMEOUT)
    return store


def train(kill_rank: int, kill_step: int, steps: int) -> None:
    tdist.init_process_group("mpidist", timeout=TIMEOUT)  # under mpirun: rank and size from MPI
    old, world = tdist.get_rank(), tdist.get_world_size()
    data = make_data()
    model = make_model()
    synced = {k: v.clone() for k, v in model.state_dict().items()}  # after the last completed step
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, avg_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    failed = False
    detect = recover = t_error = 0.0
    step, epoch, j = 0, 0, 0
    while step < steps:
        sampler = DistributedSampler(data, shuffle=True, seed=SEED)  # the current world's ranks
        sampler.set_epoch(epoch)
        loader = DataLoader(data, batch_size=B, sampler=sampler, drop_last=True)
        per_epoch = len(loader)
        batches = itertools.islice(loader, j, None)
        while j < per_epoch and step < steps:
            x, y = next(batches)
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            if step == kill_step and old == kill_rank and not failed:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of the step
            t0 = time.monotonic()
            try:
                loss.backward()
            except RuntimeError as exc:
                failure = failure_behind(exc)
                if failure is None:
                    raise
                t_error = time.monotonic()
                detect, failed = t_error - t0, True
                mpidist.shrink_group(failure.failed_group_ranks)  # mpidist's world: the survivors
                tdist.destroy_process_group()  # torch's groups on the old world
                tdist.init_process_group("mpidist", store=survivors_store(), rank=mpidist.get_rank(),
                                         world_size=mpidist.get_world_size(), timeout=TIMEOUT)  # fmt: skip
                model = make_model()  # a new module: the old DDP's hooks stay on the old one
                model.load_state_dict(synced)
                ddp = DistributedDataParallel(model)
                ddp.register_comm_hook(None, avg_hook)
                opt = torch.optim.SGD(ddp.parameters(), lr=LR)
                break  # shard the same epoch anew over the new world, redo step j
            opt.step()
            snap(model)
            synced = {k: v.clone() for k, v in model.state_dict().items()}
            if step == kill_step and failed:
                recover = time.monotonic() - t_error
            step, j = step + 1, j + 1
        else:
            epoch, j = epoch + 1, 0
    ref = reference(world, kill_step if failed else -1, steps)
    equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    print(
        f"RESULT old={old} new={tdist.get_rank()} size={tdist.get_world_size()} steps={step} "
        f"params={digest(model)} loss={full_loss(model, data):.6g} ref_equal={equal} detect={detect:.3f} "
        f"recover={recover:.3f}",
        flush=True,
    )
    tdist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kill-rank", type=int, default=1, help="the rank that kills itself (default 1)")
    p.add_argument("--kill-step", type=int, default=5, help="the step it dies in; -1: none (default 5)")
    p.add_argument("--steps", type=int, default=20, help="steps in all (default 20)")
    p.add_argument("--reference", action="store_true", help="print the single-process reference only")
    p.add_argument("--world", type=int, default=4, help="with --reference: the world size before the kill")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.reference:
        model = reference(a.world, a.kill_step, a.steps)
        print(f"REFERENCE size={a.world - (0 <= a.kill_step < a.steps)} steps={a.steps} params={digest(model)} "
              f"loss={full_loss(model, make_data()):.6g}")  # fmt: skip
    else:
        train(a.kill_rank, a.kill_step, a.steps)


if __name__ == "__main__":
    main()
