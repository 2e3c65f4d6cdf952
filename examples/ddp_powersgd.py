"""DDP with torch's PowerSGD hook over MPI, beside the same training over gloo.

Run:  mpiexec -n 2 python examples/ddp_powersgd.py

``import mpidist.torch`` registers the "mpidist" backend; under mpiexec the default
group needs no environment variables. The script trains the same model twice,
once over mpidist (MPI) and once over a gloo group of the same processes (each
bucket's hook completed before the next starts: unserialized, gloo aborts with
PowerSGD over several buckets), and prints both final losses and whether every
parameter is bit-identical (it is at 2 ranks; at more, MPI and gloo add the
ranks' gradients in different orders, and the last digits differ).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

import mpidist.torch  # noqa: F401 - registers the backend


def serialized(hook):  # noqa: ANN001, ANN201 - DDP checks the hook's annotations
    def run(state, bucket):  # noqa: ANN001, ANN202
        fut = hook(state, bucket)
        fut.wait()
        return fut

    return run


def train(group: dist.ProcessGroup, hook) -> tuple[float, list[torch.Tensor]]:  # noqa: ANN001
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    model = torch.nn.parallel.DistributedDataParallel(net, process_group=group, bucket_cap_mb=0.01)
    state = powerSGD.PowerSGDState(
        process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=3, random_seed=0
    )
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = dist.get_rank()
    for step in range(20):
        gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
        x = torch.randn(16, 32, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item() / dist.get_world_size(), [p.detach() for p in net.parameters()]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("mpidist")  # rank, size and rendezvous from mpiexec
    gloo = dist.new_group(backend="gloo")
    mpi_loss, mpi_params = train(dist.group.WORLD, powerSGD.powerSGD_hook)
    gloo_loss, gloo_params = train(gloo, serialized(powerSGD.powerSGD_hook))
    same = all(torch.equal(a, b) for a, b in zip(mpi_params, gloo_params))
    if dist.get_rank() == 0:
        print(f"world size {dist.get_world_size()}, backend {dist.get_backend()}")
        print(f"final loss over mpidist: {mpi_loss:.6f}")
        print(f"final loss over gloo:    {gloo_loss:.6f}")
        print(f"parameters bit-identical: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
