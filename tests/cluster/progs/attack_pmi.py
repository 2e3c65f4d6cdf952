"""The attacker of a job's PMI server: find root's listening ports in /proc/net/tcp and talk PMI-1 to each.

Any user can read ``/proc/net/tcp`` and ``/proc/net/tcp6``, which list every socket with
its owner's uid. This program notes the uid-0 listeners that exist when it starts, then
polls (every 0.2 s, until ``STOP`` exists or ``SECONDS`` pass) for new ones: the job's
store, its PMI server. To each new port it sends, one line at a time, what an MPI
process's PMI client sends first::

    cmd=init pmi_version=1 pmi_subversion=1
    cmd=get_my_kvsname
    cmd=get kvsname=x key=PMI_process_mapping
    cmd=barrier_in

and records everything the peer answered (at most 4 KiB, 1 s per line). ``OUT`` holds
``{"ports": {port: {"reply": text, "pmi": bool, "closed": bool}}}`` (``pmi``: a ``cmd=``
answer came back), rewritten after each port.

    attack_pmi.py OUT STOP SECONDS
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

LINES = [b"cmd=init pmi_version=1 pmi_subversion=1\n", b"cmd=get_my_kvsname\n",
         b"cmd=get kvsname=x key=PMI_process_mapping\n", b"cmd=barrier_in\n"]  # fmt: skip


def root_listeners() -> set[tuple[str, int]]:
    """(address to connect to, port) of every uid-0 socket in LISTEN state (state 0A)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 8 or cols[3] != "0A" or cols[7] != "0":
                continue
            addr_hex, port_hex = cols[1].split(":")
            raw = bytes.fromhex(addr_hex)
            if family == socket.AF_INET:
                addr = socket.inet_ntop(family, raw[::-1])
                addr = "127.0.0.1" if addr == "0.0.0.0" else addr
            else:  # four little-endian 32-bit words
                addr = socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                addr = "::1" if addr == "::" else addr
            found.add((addr, int(port_hex, 16)))
    return found


def talk(addr: str, port: int) -> dict:
    """Send the PMI lines to ``addr:port``; what came back."""
    reply, closed = b"", False
    try:
        with socket.create_connection((addr, port), timeout=2) as sock:
            sock.settimeout(1.0)
            for line in LINES:
                try:
                    sock.sendall(line)
                except OSError:
                    closed = True
                    break
                try:
                    chunk = sock.recv(4096)
                except socket.timeout:
                    continue
                except OSError:
                    closed = True
                    break
                if not chunk:
                    closed = True
                    break
                reply += chunk
                if len(reply) > 4096:
                    break
    except OSError as exc:
        return {"reply": "", "pmi": False, "closed": True, "error": str(exc)}
    text = reply.decode("latin-1")
    return {"reply": text[:4096], "pmi": "cmd=" in text, "closed": closed}


def save(path: str, record: dict) -> None:
    """Write ``record`` to ``path`` at once (a reader never sees half of it)."""
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)


def main(out: str, stop: str, seconds: str) -> int:
    before = root_listeners()
    found: dict[str, dict] = {}
    record = {"started": True, "ports": found}
    save(out, record)  # the test starts the job once this exists: its listeners are new ones
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline and not os.path.exists(stop):
        for addr, port in sorted(root_listeners() - before):
            key = str(port)
            if key not in found:
                found[key] = {"address": addr, **talk(addr, port)}
                save(out, record)
        time.sleep(0.2)
    save(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
