"""A victim under ``mpiexec -n 2``: keeps a key in its default store while another user tries to reach it.

Rank 0 sets ``secret_key`` = ``mine`` in ``mpidist.get_default_store()`` and writes the
store's address (``{"host", "port"}``) to ``EXCHANGE/address.json``, where the attacker
reads it (as it could read it from ``/proc/net/tcp``). Every rank then waits (bounded)
for ``EXCHANGE/attacker-done``, reads the key back and prints ``RESULT {json}``.

    mpiexec -n 2 python victim_store.py EXCHANGE
"""

from __future__ import annotations

import json
import os
import sys
import time

import mpidist as dist


def main(exchange: str) -> int:
    dist.init_process_group(timeout=60)
    store = dist.get_default_store()
    rank = dist.get_rank()
    if rank == 0:
        store.set("secret_key", "mine")
        host, port = store.server_address or (store.host, store.port)
        tmp = os.path.join(exchange, "address.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"host": host, "port": port}, f)
        os.chmod(tmp, 0o644)
        os.rename(tmp, os.path.join(exchange, "address.json"))
    done = os.path.join(exchange, "attacker-done")
    deadline = time.monotonic() + 40
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    value = store.get("secret_key").decode(errors="replace")
    print("RESULT " + json.dumps({"rank": rank, "value": value, "attacker_done": os.path.exists(done)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
