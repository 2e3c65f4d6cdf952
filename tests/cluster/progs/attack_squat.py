"""The attacker that takes a job's port first: a mpidist TCPStore master without the job's secret.

Serves ``TCPStore(HOST, PORT, is_master=True)`` (no secret) and records in ``OUT`` (JSON,
rewritten on every change) ``{"ready": true, "baseline": N, "max": M, "seen": [...]}``:
``baseline`` is ``num_keys`` right after it started, ``max`` the most it saw since
(a victim that talked to it would add keys). Ends after ``SECONDS`` or when ``STOP`` exists.

    attack_squat.py HOST PORT OUT STOP SECONDS
"""

from __future__ import annotations

import json
import os
import sys
import time


def write(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)


def main(host: str, port: str, out: str, stop: str, seconds: str) -> int:
    from mpidist.store import TCPStore

    try:
        store = TCPStore(host, int(port), None, is_master=True, timeout=5, wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001
        write(out, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        os._exit(1)
    baseline = store.num_keys()
    record = {"ready": True, "baseline": baseline, "max": baseline, "pid": os.getpid()}
    write(out, record)
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline and not os.path.exists(stop):
        n = store.num_keys()
        if n > record["max"]:
            record["max"] = n
            write(out, record)
        time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:6])
