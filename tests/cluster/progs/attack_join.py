"""The attacker's impostor rank: join a job as one of its ranks and send it a pickle that runs code.

Run as another user, with the job's public coordinates in the environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` of an env:// job, or an srun step's
``SLURM_*`` variables) but not its secret. It calls ``init_process_group("mpi")`` and
``all_gather_object`` of an object whose unpickling runs ``touch MARKER``: if any rank
of the job unpickles it, the file appears (only root can create it there: the test's
folder is root's, mode 0755). Prints ``JOINED ...`` and exits 0 when it got in; a
refusal raises, prints ``REFUSED type: message`` on stderr and exits 2.

    attack_join.py --marker /tmp/mpidist-marker-XXXX/ran [--timeout S]
"""

from __future__ import annotations

import os
import sys


class Payload:
    """Unpickling this runs a shell command (pickle calls ``os.system(command)``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def main(argv: list[str]) -> int:
    marker = argv[argv.index("--marker") + 1]
    timeout = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 20.0
    try:
        import mpidist as dist

        dist.init_process_group("mpi", timeout=timeout)
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, Payload(f"touch {marker} 2>/dev/null"))
        print(f"JOINED rank={dist.get_rank()} size={dist.get_world_size()}", flush=True)
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - any refusal is the expected outcome
        print(f"REFUSED {type(exc).__module__}.{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # no clean-up that could wait on a job that threw it out
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
