"""An unmodified torch DDP program, for tests/with_torch/test_torch_autoload.py: ``mpiexec -n 2 python ddp_train.py BACKEND DIR``.

It never imports mpidist and sets no variable: ``init_process_group(BACKEND)`` with
torch's default ``env://``, which mpidist fills from the MPI launcher ("mpi",
"mpidist"); the gloo reference runs under torchrun, as gloo's users run it. It trains a small model with DDP for a few steps
on data each rank makes from its rank, then uses p2p (``batch_isend_irecv`` around
a ring), ``all_gather_object`` and a ``barrier``, and writes ``DIR/result-<rank>.json``
with the final weights' bytes (hex) and what p2p received, to compare bitwise
between backends.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

BACKEND, OUT = sys.argv[1], sys.argv[2]


def main() -> None:
    dist.init_process_group(BACKEND)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x = torch.randn(32, 8, generator=gen)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    got = torch.full((4,), -1.0)
    ops = [
        dist.P2POp(dist.isend, torch.arange(4.0) + 10 * rank, (rank + 1) % size),
        dist.P2POp(dist.irecv, got, (rank - 1) % size),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    names: list = [None] * size
    dist.all_gather_object(names, {"rank": rank})
    dist.barrier()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes().hex()
    result = {"rank": rank, "backend": dist.get_backend(), "weights": weights, "p2p": got.tolist(), "names": names}
    with open(f"{OUT}/result-{rank}.json", "w") as f:
        json.dump(result, f)
    del model, opt  # DDP's reducer goes before its group
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
