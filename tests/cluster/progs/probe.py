"""What a user's program sees at start: the world, torchrun's variables, one all_reduce.

Prints one line ``PROBE {json}`` per process, and with ``--out DIR`` also writes it to
``DIR/probe-<host>-<pid>.json`` (launchers may merge the processes' lines). Arguments: ``--torch`` also runs one
DDP step over ``torch.distributed.init_process_group("mpidist")`` and compares its
gradient with the mean computed by hand; ``--timeout S`` sets the group timeout.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np

import mpidist as dist

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def main(argv: list[str]) -> int:
    timeout = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 60.0
    env_at_import = {v: os.environ.get(v) for v in VARS}
    result: dict = {"host": socket.gethostname(), "pid": os.getpid(), "env": env_at_import}
    if "--torch" in argv:
        import torch
        import torch.distributed as tdist

        import mpidist.torch  # noqa: F401  - registers the "mpidist" backend

        tdist.init_process_group("mpidist", timeout=__import__("datetime").timedelta(seconds=timeout))
        rank, size = tdist.get_rank(), tdist.get_world_size()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        x = torch.full((2, 4), float(rank + 1))
        ddp(x).sum().backward()
        grad = model.weight.grad.flatten().tolist()
        expected = [2.0 * sum(r + 1 for r in range(size)) / size] * 4
        result.update(rank=rank, size=size, grad=grad, grad_ok=grad == expected)
        tdist.destroy_process_group()
    else:
        dist.init_process_group(timeout=timeout)
        rank, size = dist.get_rank(), dist.get_world_size()
        x = np.full(3, rank + 1.0)
        dist.all_reduce(x)
        result.update(rank=rank, size=size, sum=x.tolist(), sum_ok=x.tolist() == [size * (size + 1) / 2] * 3)
        dist.barrier()
        dist.destroy_process_group()
    report(result, argv[argv.index("--out") + 1] if "--out" in argv else None)
    return 0


def report(result: dict, out_dir: str | None) -> None:
    """Print ``PROBE {json}``; with ``out_dir`` also write it to ``out_dir/probe-<host>-<pid>.json``."""
    text = json.dumps(result)
    if out_dir:
        out = os.path.join(out_dir, f"probe-{result['host']}-{os.getpid()}.json")
        with open(out + ".tmp", "w") as f:
            f.write(text)
        os.replace(out + ".tmp", out)
    print("PROBE " + text, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
