"""A rank dies (SIGKILL) in one kind of call; the survivors raise ProcessFailedError, shrink, and compute again.

    mpirun --with-ft ulfm -n 4 python survive.py SCENARIO

Each survivor prints ``OK old=<rank> new=<rank> size=<n> failed=<global ranks, commas> detect=<s> recover=<s>``
after checking a collective on the shrunk world against its expected value (tests/cluster/test_ulfm.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import mpidist as dist

SCENARIO = sys.argv[1]
VICTIM = {"rank0": 0, "p2p": 1}.get(SCENARIO, 2)


def die_if(victim: int) -> None:
    if dist.get_rank() == victim:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def step(i: int, sub: object, victim: int) -> None:
    """One iteration of the scenario's kind of call (the victim dies at i == 3)."""
    me, n = dist.get_rank(), dist.get_world_size()
    if i == 3:
        die_if(victim)
    if SCENARIO in ("all_reduce", "rank0", "two", "large"):
        x = np.full(1 << 17 if SCENARIO == "large" else 1000, 1.0)  # large: 1 MiB (shared memory's sizes)
        dist.all_reduce(x)
        assert x[0] == n
    elif SCENARIO == "p2p":  # a ring: each sends to the next, receives from the previous
        got = np.zeros(4)
        r = dist.irecv(got, src=(me - 1) % n)
        dist.send(np.full(4, float(me)), dst=(me + 1) % n)
        r.wait()
        assert got[0] == (me - 1) % n
    elif SCENARIO == "object":
        out = [None] * n
        dist.all_gather_object(out, {"rank": me})
        assert [o["rank"] for o in out] == list(range(n))
    elif SCENARIO == "persistent":
        op = PERSISTENT[0]
        op.start()
        op.wait()
    elif SCENARIO == "other_group":  # ranks 0 and 1 keep using their pair group while rank 2 dies
        if me in (0, 1):
            y = np.full(8, float(me + 1))
            dist.all_reduce(y, group=sub)
            assert y[0] == 3.0
        x = np.ones(8)
        dist.all_reduce(x)


def survive(sub: object, victim: int) -> tuple[list[int], float, float]:
    """Run steps until ``victim`` dies; shrink the world; return (failed global ranks, detect s, time of the kill)."""
    t_kill = 0.0
    for i in range(1000):
        if i == 3:
            t_kill = time.monotonic()
        try:
            step(i, sub, victim)
        except dist.ProcessFailedError as exc:
            detect = time.monotonic() - t_kill
            dist.shrink_group(exc.failed_group_ranks)
            return exc.failed_ranks, detect, t_kill
        time.sleep(0.001)
    raise AssertionError("no member died")


PERSISTENT: list = []

dist.init_process_group(timeout=60)
old = dist.get_rank()
pair = dist.new_group([0, 1])
if SCENARIO == "persistent":
    buf = np.ones(16)
    PERSISTENT.append(dist.all_reduce_init(buf))
failed, detect, t_kill = survive(pair, VICTIM)
if SCENARIO == "two":  # a second death on the shrunk world: the old rank 3 (now rank 2) dies
    again, _, _ = survive(None, 2)
    assert again == [2], again
    failed = failed + [3]
x = np.full(5, float(old))
dist.all_reduce(x)  # on the shrunk world, without a group argument
recover = time.monotonic() - t_kill  # for "two": from the first kill, through both shrinks
expected = sum(r for r in range(4) if r not in failed)
assert x.tolist() == [float(expected)] * 5, (x, expected)
store = dist.get_default_store()  # a new store on the new rank 0
store.add("survivors", 1)
dist.barrier()
assert store.add("survivors", 0) == dist.get_world_size()
print(f"OK old={old} new={dist.get_rank()} size={dist.get_world_size()} failed={','.join(map(str, failed))} detect={detect:.3f} recover={recover:.3f}", flush=True)
dist.destroy_process_group()
