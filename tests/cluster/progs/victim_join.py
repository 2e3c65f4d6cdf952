"""A victim: one rank of a 3-process job that checks it met only its own ranks.

Started by hand (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, env://) or by
``srun`` (the rank is ``SLURM_PROCID``). It calls ``init_process_group("mpi")``, prints
``READY rank=R``, optionally waits for a file (``--hold FILE``: the test lets an attacker
probe the live job meanwhile), gathers every rank's number with ``all_gather_object``
and prints ``OK rank=R gathered=[0, 1, 2]`` (exit 0), or ``WRONG ...`` (exit 3) when the
world holds anything but its own ranks. Arguments:

* ``--late R:S``: rank R sleeps S seconds before it starts (so that an impostor comes first);
* ``--timeout S``: the group's timeout (default 30);
* ``--publish FILE``: task 0 of an srun step writes the step's public variables there first
  (what ``scontrol show step`` tells every user).
"""

from __future__ import annotations

import json
import os
import sys
import time

PUBLIC = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS",
          "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID")  # fmt: skip


def arg(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def wait_file(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main(argv: list[str]) -> int:
    me = int(os.environ.get("SLURM_PROCID") or os.environ.get("RANK") or -1)
    publish = arg(argv, "--publish")
    if publish and me == 0:
        with open(publish + ".tmp", "w") as f:
            json.dump({k: os.environ.get(k, "") for k in PUBLIC}, f)
        os.rename(publish + ".tmp", publish)
    late = arg(argv, "--late")
    if late:
        rank, seconds = late.split(":")
        if me == int(rank):
            time.sleep(float(seconds))
    import mpidist as dist

    dist.init_process_group("mpi", timeout=float(arg(argv, "--timeout", "30")))
    rank, size = dist.get_rank(), dist.get_world_size()
    print(f"READY rank={rank} size={size} pid={os.getpid()}", flush=True)
    hold = arg(argv, "--hold")
    if hold and not wait_file(hold, float(arg(argv, "--hold-s", "40"))):
        print(f"rank {rank}: {hold} did not appear", file=sys.stderr, flush=True)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, rank)
    dist.barrier()
    dist.destroy_process_group()
    if gathered != list(range(size)) or size != 3:
        print(f"WRONG rank={rank} size={size} gathered={gathered!r}", flush=True)
        return 3
    print(f"OK rank={rank} gathered={gathered}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
