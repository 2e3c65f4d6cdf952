"""Every collective the shared-memory path serves, at 1 MiB, checked: run on a small /dev/shm (test_small_shm.py)."""

import numpy as np

import mpidist as dist
from mpidist.testing import backend_of

dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
n = (1 << 20) // 4
problems = []
for rep in range(3):
    x = np.arange(n, dtype=np.float32) % 7 + rank
    dist.all_reduce(x)
    want = (np.arange(n, dtype=np.float32) % 7) * size + size * (size - 1) / 2
    problems += [] if np.array_equal(x, want) else [f"all_reduce {rep}"]
    y = np.full(n, float(rank), np.float32)
    dist.broadcast(y, src=size - 1)
    problems += [] if np.all(y == size - 1) else ["broadcast"]
    out = np.empty(n * size, np.float32)
    dist.all_gather_into_tensor(out, np.full(n, float(rank), np.float32))
    problems += [] if np.array_equal(out, np.repeat(np.arange(size, dtype=np.float32), n)) else ["all_gather"]
    rs = np.empty(n, np.float32)
    dist.reduce_scatter_tensor(rs, np.ones(n * size, np.float32))
    problems += [] if np.all(rs == size) else ["reduce_scatter"]
    z = np.ones(n, np.float32)
    dist.reduce(z, dst=0)
    problems += [] if rank or np.all(z == size) else ["reduce"]
everyone = [None] * size
dist.all_gather_object(everyone, problems)
if rank == 0:
    print("RESULT", "ok" if not any(everyone) else everyone, flush=True)
    backend = backend_of()
    path = getattr(backend, "inner", backend).shared_memory()  # (MPIDIST_DEBUG=INFO wraps the backend)
    print("CHUNK", 0 if path is None else path.chunk, flush=True)
dist.destroy_process_group()
