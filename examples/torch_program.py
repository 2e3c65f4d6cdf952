"""A program written for torch.distributed; its only change is the import line.

Run it any of these ways (2 processes; any number works):

    mpidistrun --nproc-per-node 2 examples/torch_program.py
    mpiexec -n 2 python examples/torch_program.py
    torchrun --standalone --nproc-per-node 2 examples/torch_program.py

It says backend="gloo" (MPI serves it), reads LOCAL_RANK before init (set by
torchrun, by mpidistrun, and under mpiexec by ``import mpidist`` from the
launcher's variables), and uses collectives, a ring of point-to-point messages,
object collectives and a subgroup, as torch's tutorials do. Replace the import
with ``import torch.distributed as dist`` and run it under torchrun: the output
is the same.
"""

import json
import os

import torch

import mpidist as dist  # was: import torch.distributed as dist


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun's variable
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    total = torch.full((3,), float(rank + 1))
    dist.all_reduce(total, op=dist.ReduceOp.SUM)

    # a ring: send to the next rank, receive from the previous one
    token = torch.tensor([rank * 10])
    got = torch.zeros(1, dtype=torch.int64)
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        req = dist.isend(token, right)
        dist.recv(got, left)
        req.wait()

    pairs = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pairs, torch.tensor([rank, local_rank]))
    names = [None] * world
    dist.all_gather_object(names, f"worker-{rank}")
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    even_sum = torch.tensor([float(rank)])
    if rank % 2 == 0:
        dist.all_reduce(even_sum, group=evens)
    dist.barrier()

    result = {
        "rank": rank,
        "world": world,
        "backend": str(dist.get_backend()),
        "gloo_branch": dist.get_backend() == dist.Backend.GLOO,
        "sum": total.tolist(),
        "ring": got.item(),
        "pairs": [p.tolist() for p in pairs],
        "names": names,
        "even_sum": even_sum.item(),
    }
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
