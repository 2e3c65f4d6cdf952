"""The attacker of a job's store: connect as a client without the secret, then read and change keys.

Waits (bounded) for ``EXCHANGE/address.json`` (``{"host", "port"}``), connects with
``mpidist.store.TCPStore(host, port, is_master=False, timeout=5)`` and tries ``get``,
``set``, ``add`` and ``num_keys`` on the key ``secret_key``. Writes what each step did
to ``EXCHANGE/attack.json`` (``{"connect": "ok" | "Type: message", "get": ..., ...}``)
and then creates ``EXCHANGE/attacker-done``.

    attack_store.py EXCHANGE
"""

from __future__ import annotations

import json
import os
import sys
import time


def outcome(call) -> str:
    """``ok <value>`` or ``Type: message`` of ``call()``."""
    try:
        return f"ok {call()!r}"
    except Exception as exc:  # noqa: BLE001 - every failure is recorded
        return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"


def main(exchange: str) -> int:
    address = os.path.join(exchange, "address.json")
    deadline = time.monotonic() + 40
    while not os.path.exists(address) and time.monotonic() < deadline:
        time.sleep(0.05)
    found: dict[str, str] = {}
    try:
        with open(address) as f:
            where = json.load(f)
        from mpidist.store import TCPStore

        try:
            store = TCPStore(where["host"], int(where["port"]), is_master=False, timeout=5)
            found["connect"] = "ok"
        except Exception as exc:  # noqa: BLE001
            found["connect"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        else:
            found["get"] = outcome(lambda: store.get("secret_key"))
            found["set"] = outcome(lambda: store.set("secret_key", "theirs"))
            found["add"] = outcome(lambda: store.add("attacker_counter", 1))
            found["num_keys"] = outcome(store.num_keys)
    except Exception as exc:  # noqa: BLE001
        found["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(exchange, "attack.json"), "w") as f:
        json.dump(found, f)
    open(os.path.join(exchange, "attacker-done"), "w").close()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
