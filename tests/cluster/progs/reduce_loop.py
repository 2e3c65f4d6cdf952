"""All-reduces in a loop until something goes wrong: for killing a rank or cutting a link mid-job.

    python reduce_loop.py [--timeout S] [--init-method URL] [--tag TAG]

Each process prints ``READY rank=R size=N host=H pid=P`` once the world is formed and
one all_reduce has completed, then all_reduces a small array every 20 ms, checking each
result, with the group's timeout ``S`` (default 20). It never ends by itself: the test
kills one process (or cuts a host's link), and the others are expected to fail with
``DistBackendError`` naming the missing rank within the timeout, and exit non-zero.
``--tag`` is ignored: it marks the processes of one test in ``ps``.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np

import mpidist as dist


def main(argv: list[str]) -> int:
    timeout = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 20.0
    init_method = argv[argv.index("--init-method") + 1] if "--init-method" in argv else None
    dist.init_process_group(timeout=timeout, **({"init_method": init_method} if init_method else {}))
    rank, size = dist.get_rank(), dist.get_world_size()
    x = np.ones(4)
    dist.all_reduce(x)
    print(f"READY rank={rank} size={size} host={socket.gethostname()} pid={os.getpid()}", flush=True)
    i = 0
    while True:
        x = np.ones(4)
        dist.all_reduce(x)
        if not (x == size).all():
            print(f"rank {rank}: iteration {i}: wrong sum {x.tolist()}", file=sys.stderr, flush=True)
            return 3
        i += 1
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
