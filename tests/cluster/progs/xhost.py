"""A job across hosts: the world, torchrun's variables, a small and a large all_reduce, the default store.

Prints one line ``PROBE {json}`` per process, in ``probe.py``'s form (``host``, ``pid``,
``env``, ``rank``, ``size``, ``sum``, ``sum_ok``) plus:

* ``big_ok``: an all_reduce of ``--bytes N`` bytes (default 4 MiB) came out right; with
  ranks on several hosts it must cross the hosts' links, which the test sees in their
  byte counters (a few KiB of start-up traffic could not account for it);
* with ``--store``: ``store_ok``, every rank read every other rank's key from
  ``get_default_store()`` (``store_type`` names the store).

``--init-method URL`` is passed to ``init_process_group`` (default: its own default);
``--timeout S`` sets the group timeout (default 60); ``--out DIR`` also writes the line's
JSON to ``DIR/probe-<host>-<pid>.json``. Started by tests/cluster/test_hosts.py.
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
from probe import VARS, report  # this folder is the script's: sys.path[0]

import mpidist as dist


def _arg(argv: list[str], name: str, default: str | None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def main(argv: list[str]) -> int:
    timeout = float(_arg(argv, "--timeout", "60"))
    nbytes = int(_arg(argv, "--bytes", str(4 << 20)))
    init_method = _arg(argv, "--init-method", None)
    env_at_start = {v: os.environ.get(v) for v in VARS}
    result: dict = {"host": socket.gethostname(), "pid": os.getpid(), "env": env_at_start}
    kwargs = {"init_method": init_method} if init_method else {}
    dist.init_process_group(timeout=timeout, **kwargs)
    rank, size = dist.get_rank(), dist.get_world_size()
    x = np.full(3, rank + 1.0)
    dist.all_reduce(x)
    result.update(rank=rank, size=size, sum=x.tolist(), sum_ok=x.tolist() == [size * (size + 1) / 2] * 3)
    big = np.full(max(nbytes // 8, 1), float(rank + 1))
    dist.all_reduce(big)
    result.update(big_bytes=big.nbytes, big_ok=bool((big == size * (size + 1) / 2).all()))
    if "--store" in argv:
        store = dist.get_default_store()
        result["store_type"] = type(store).__name__
        store.set(f"xhost/{rank}", f"{result['host']}:{rank}")
        seen = {r: store.get(f"xhost/{r}").decode() for r in range(size)}
        result["store_ok"] = all(seen[r].endswith(f":{r}") for r in range(size))
        result["store_seen"] = seen
    dist.barrier()
    dist.destroy_process_group()
    report(result, _arg(argv, "--out", None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
