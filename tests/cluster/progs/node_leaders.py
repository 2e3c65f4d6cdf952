"""all_reduce in a job that spans hosts: the node-leader path (test_hosts.py::test_node_leaders_across_hosts).

Rank 0 prints one ``LEADERS {json}`` line per rank with its findings: whether its group has the
node-leader path, whether every all_reduce was right (a measured group, during its measuring and after,
two size classes; a group fixed to the path; several async calls in flight), the measured choices, and
the bytes each host sent over its link per 1 MiB all_reduce on the path and through MPI's call.
"""

import json

import numpy as np
from mpi4py import MPI

import mpidist as dist
from mpidist.backends import node_leaders, shm_choice
from mpidist.bench.tune import group_under
from mpidist.testing import backend_of


def sent() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def host_bytes_per_call(g, x: np.ndarray, calls: int) -> int:
    """Bytes this host sent per all_reduce of ``x`` on ``g`` (the job is quiet otherwise)."""
    MPI.COMM_WORLD.Barrier()
    before = sent()
    for _ in range(calls):
        dist.all_reduce(x, group=g)
    MPI.COMM_WORLD.Barrier()
    return (sent() - before) // calls


dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
want = size * (size + 1) / 2
problems = []
fixed = group_under(dist, {"MPIDIST_SHM_THRESHOLDS": "all_reduce=16K"})
plain = group_under(dist, {"MPIDIST_SHM": "0"})
measured = group_under(dist, {})
path = backend_of(fixed).shared_memory()
for nbytes in (64 << 10, 1 << 20):
    for k in range(shm_choice.CHOSEN_AT + 4):
        x = np.full(nbytes // 4, rank + 1, np.float32)
        w = dist.all_reduce(x, group=measured, async_op=k % 3 == 1)
        w and w.wait()
        problems += [] if np.all(x == want) else [f"measured {nbytes} call {k}: {x[:3]}"]
xs = [np.full((1 << 18) + k, rank + k, np.float32) for k in range(6)]
works = [dist.all_reduce(x, group=fixed, async_op=True) for x in xs]
for w in reversed(works):
    w.wait()
problems += [f"async {k}: {x[:2]}" for k, x in enumerate(xs) if not np.all(x == sum(r + k for r in range(size)))]
ones = np.ones(1 << 18, np.float32)
issued = path.issued if isinstance(path, node_leaders.NodeLeaders) else -1
on_path = host_bytes_per_call(fixed, ones, 8)
issued = (path.issued - issued) if issued >= 0 else -1
through_mpi = host_bytes_per_call(plain, ones, 8)
problems += [] if np.all(ones == size**16) else [f"the counted calls gave {ones[:2]}"]
mine = {
    "rank": rank, "host": MPI.Get_processor_name(), "leaders": isinstance(path, node_leaders.NodeLeaders),
    "node_size": path.node.Get_size() if isinstance(path, node_leaders.NodeLeaders) else 0,
    "choices": backend_of(measured).shared_memory_choices(), "problems": problems, "issued": issued,
    "sent_on_path": on_path, "sent_through_mpi": through_mpi,
}  # fmt: skip
everyone = MPI.COMM_WORLD.gather(mine)
if rank == 0:
    for r in everyone:
        print("LEADERS", json.dumps(r), flush=True)
for g in (fixed, plain, measured):
    dist.destroy_process_group(g)
dist.destroy_process_group()
