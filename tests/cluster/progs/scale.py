"""Many ranks on many hosts: every kind of collective checked, a timeout that names the missing rank, ULFM's shrink.

    python scale.py check --missing R [--short S]   # every kind of call checked against numpy, then rank R
                                                    # skips an all_reduce on a group with timeout S
    python scale.py ulfm                            # all_reduces until a member dies; shrink_group; check again

Started by tests/cluster/test_scale.py across the simulated hosts (16 ranks on 8 hosts).

``check`` prints one line per rank, ``SCALE {json}``: ``rank``, ``size``, ``host``, ``problems`` (what this
rank found wrong), ``everyone_ok`` (the vote of every rank: an all_reduce of the ok-flags, MIN) and ``diagnosis``
(the text of the timeout's DistBackendError on the ranks that waited). Every rank checks every result it
receives against numpy, computed from the inputs each rank is known to give. The missing rank stays outside
mpidist (a raw, polled MPI barrier on COMM_WORLD) until the others' calls have timed out, then joins the call
they left pending, so that nothing is left pending inside MPI and the job ends normally. Exit status: 0 if
every rank's checks passed, 1 otherwise (on every rank alike).

``ulfm`` (Open MPI under ``mpirun --with-ft ulfm``) prints ``READY rank=R size=N host=H pid=P`` (as
reduce_loop.py), then all_reduces every 20 ms until a ``ProcessFailedError``; the test kills a host meanwhile.
Each survivor shrinks the default group (again if another death is reported after a shrink), then checks an
all_reduce of the old ranks on the shrunk world and prints ``SURVIVOR {json}``: ``old``, ``new``, ``size``,
``failed`` (old ranks left out), ``shrinks``, ``sum``, ``sum_ok``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

import mpidist as dist

#: the group timeout of the job's world (generous: 16 ranks share 2 cores in CI)
WORLD_TIMEOUT_S = 60.0


def _arg(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


class Checks:
    """This rank's failed checks, by name."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def equal(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            self.problems.append(
                f"{what}: got {got.dtype}{list(got.shape)} {got.ravel()[:6]}, expected {want.ravel()[:6]}"
            )

    def run(self, what: str, fn) -> None:
        """Call ``fn`` (which checks its results itself); an exception is a problem, not an end."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported, with the others' results
            self.problems.append(f"{what}: raised {type(exc).__name__}: {str(exc)[:300]}")


def every_kind(c: Checks) -> None:
    """One call of every kind on the world, each checked against numpy on every rank."""
    r, n = dist.get_rank(), dist.get_world_size()
    m = 1000  # elements per rank: small calls, many hosts
    base = np.arange(m, dtype=np.int64)

    def data(k: int, dtype=np.int64) -> np.ndarray:  # rank k's input, known to every rank
        return ((base * (k + 1) + 7 * k) % 1009).astype(dtype)

    def all_reduce() -> None:
        x = data(r)
        dist.all_reduce(x)
        c.equal("all_reduce SUM int64", x, sum(data(k) for k in range(n)))
        y = data(r, np.float64) - 500.0
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        c.equal("all_reduce MAX float64", y, np.max([data(k, np.float64) - 500.0 for k in range(n)], axis=0))
        big = np.full(1 << 15, float(r + 1))  # 256 KiB: MPI's large-message path across the links
        dist.all_reduce(big)
        c.equal("all_reduce 256 KiB", big, np.full(1 << 15, n * (n + 1) / 2))

    def reduce() -> None:
        dst = n - 3
        x = data(r, np.float32)
        dist.reduce(x, dst=dst)
        if r == dst:
            c.equal(f"reduce to {dst}", x, np.sum([data(k, np.float32) for k in range(n)], axis=0, dtype=np.float32))

    def broadcast() -> None:
        src = 5 % n
        x = data(r, np.int32)
        dist.broadcast(x, src=src)
        c.equal(f"broadcast from {src}", x, data(src, np.int32))

    def all_gather() -> None:
        out = [np.empty(m, np.int64) for _ in range(n)]
        dist.all_gather(out, data(r))
        for k in range(n):
            c.equal(f"all_gather[{k}]", out[k], data(k))

    def all_gather_into_tensor() -> None:
        out = np.empty(n * m, np.uint16)
        dist.all_gather_into_tensor(out, data(r, np.uint16))
        c.equal("all_gather_into_tensor", out, np.concatenate([data(k, np.uint16) for k in range(n)]))

    def gather() -> None:
        dst = n - 1
        out = [np.empty(m, np.int64) for _ in range(n)] if r == dst else None
        dist.gather(data(r), out, dst=dst)
        if r == dst:
            for k in range(n):
                c.equal(f"gather[{k}] to {dst}", out[k], data(k))

    def scatter() -> None:
        src = 3 % n
        out = np.empty(m, np.int64)
        dist.scatter(out, [data(k) + 1000 * k for k in range(n)] if r == src else None, src=src)
        c.equal(f"scatter from {src}", out, data(r) + 1000 * r)

    def reduce_scatter_tensor() -> None:
        out = np.empty(m, np.int64)
        dist.reduce_scatter_tensor(out, np.concatenate([data(r) * (j + 1) for j in range(n)]))
        c.equal("reduce_scatter_tensor", out, sum(data(k) for k in range(n)) * (r + 1))

    def all_to_all() -> None:
        out = [np.empty(m, np.int64) for _ in range(n)]
        dist.all_to_all(out, [data(r) + 100 * j for j in range(n)])  # block j of rank r goes to rank j
        for k in range(n):
            c.equal(f"all_to_all from {k}", out[k], data(k) + 100 * r)

    def barrier() -> None:
        dist.barrier()

    def send_recv() -> None:  # a ring two ranks apart: every message crosses to another host
        nxt, prv = (r + 2) % n, (r - 2) % n
        work = dist.isend(data(r), dst=nxt)
        got = np.empty(m, np.int64)
        dist.recv(got, src=prv)
        work.wait()
        c.equal(f"recv from {prv}", got, data(prv))
        if r % 4 < 2:  # blocking send as well: pairs r -> r + 2, answered back
            dist.send(data(r) * 3, dst=nxt)
            back = np.empty(m, np.int64)
            dist.recv(back, src=nxt)
            c.equal(f"send/recv answer of {nxt}", back, data(nxt) * 5)
        elif n > 3:
            got = np.empty(m, np.int64)
            dist.recv(got, src=prv)
            c.equal(f"send from {prv}", got, data(prv) * 3)
            dist.send(data(r) * 5, dst=prv)

    def objects() -> None:
        out: list = [None] * n
        dist.all_gather_object(out, {"rank": r, "host": socket.gethostname(), "tag": "x" * r})
        if [o["rank"] for o in out] != list(range(n)) or [o["tag"] for o in out] != ["x" * k for k in range(n)]:
            c.problems.append(f"all_gather_object: got {out}")
        hosts = [o["host"] for o in out]
        if any(hosts.count(h) != 2 for h in hosts) or len(set(hosts)) != n // 2:
            c.problems.append(f"all_gather_object: ranks by host {hosts}, expected 2 ranks on each of {n // 2}")

    for fn in (all_reduce, reduce, broadcast, all_gather, all_gather_into_tensor, gather, scatter,
               reduce_scatter_tensor, all_to_all, barrier, send_recv, objects):  # fmt: skip
        c.run(fn.__name__, fn)


def meet_outside_mpidist() -> None:
    """Meet every rank on COMM_WORLD without entering mpidist (a raw MPI barrier, polled)."""
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def timeout_names_the_missing_rank(c: Checks, missing: int, short: float) -> str:
    """Rank ``missing`` skips an all_reduce on a group of every rank; the others' error must name it alone."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(timeout=short)
    meet_outside_mpidist()
    diagnosis = ""
    if r != missing:
        start = time.monotonic()
        try:
            dist.all_reduce(np.ones(4), group=g)
            c.problems.append(f"all_reduce without rank {missing}: completed (after {time.monotonic() - start:.1f} s)")
        except dist.DistBackendError as exc:
            took = time.monotonic() - start
            diagnosis = str(exc)
            head = (
                rf"^all_reduce \(call #1\) on group {re.escape(g.group_name)} \(mpi, rank {r} of {n}\) "
                rf"did not complete within the timeout of {short:g} s\."
            )
            if not re.search(head, diagnosis):
                c.problems.append(f"timeout: the message does not start as {head!r}")
            absent = sorted(int(k) for k in re.findall(r"Rank (\d+)(?: \(global rank \d+\))?: no answer", diagnosis))
            if absent != [missing]:
                c.problems.append(f"timeout: the ranks named as not answering are {absent}, expected [{missing}]")
            waiting = re.findall(r"Rank (\d+): waiting in all_reduce \(call #1\)", diagnosis)
            if sorted(int(k) for k in waiting) != [k for k in range(n) if k not in (r, missing)]:
                c.problems.append(f"timeout: ranks named as waiting in the call: {sorted(map(int, waiting))}")
            if took > short + 20:
                c.problems.append(f"timeout: the error came {took:.1f} s after the call, timeout {short:g} s")
        except Exception as exc:  # noqa: BLE001 - reported
            c.problems.append(f"timeout: raised {type(exc).__name__} instead of DistBackendError: {exc}")
    meet_outside_mpidist()  # the missing rank stayed away until every other rank's call had timed out
    if r == missing:  # join the call the others left pending: nothing stays pending inside MPI
        x = np.ones(4)
        c.run("the late all_reduce", lambda: dist.all_reduce(x, group=g))
        c.equal("the late all_reduce", x, np.full(4, float(n)))
    dist.barrier()
    dist.destroy_process_group(g)
    x = np.full(3, r + 1, np.int64)
    dist.all_reduce(x)
    c.equal("the world's all_reduce after the timeout", x, np.full(3, n * (n + 1) // 2, np.int64))
    return diagnosis


def check(argv: list[str]) -> int:
    dist.init_process_group(timeout=WORLD_TIMEOUT_S)
    r, n = dist.get_rank(), dist.get_world_size()
    c = Checks()
    every_kind(c)
    diagnosis = timeout_names_the_missing_rank(
        c, int(_arg(argv, "--missing", "1")) % n, float(_arg(argv, "--short", "3"))
    )
    vote = np.array([0 if c.problems else 1], np.int64)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)  # pass or fail together
    line = {"rank": r, "size": n, "host": socket.gethostname(), "problems": c.problems,
            "everyone_ok": bool(vote[0]), "diagnosis": diagnosis}  # fmt: skip
    print("SCALE " + json.dumps(line), flush=True)
    dist.destroy_process_group()
    return 0 if vote[0] else 1


def ulfm(argv: list[str]) -> int:
    faulthandler.dump_traceback_later(float(_arg(argv, "--stacks-after", "90")), repeat=True)  # where a hang is
    dist.init_process_group(timeout=WORLD_TIMEOUT_S)
    old, n = dist.get_rank(), dist.get_world_size()
    x = np.ones(4)
    dist.all_reduce(x)
    print(f"READY rank={old} size={n} host={socket.gethostname()} pid={os.getpid()}", flush=True)
    shrinks = 0
    while True:  # all_reduces until a member dies
        try:
            x = np.ones(4)
            dist.all_reduce(x)
        except dist.ProcessFailedError as exc:
            print(f"FAILED rank={old} failed={exc.failed_ranks}", file=sys.stderr, flush=True)
            dist.shrink_group(exc.failed_group_ranks)
            shrinks += 1
            print(f"SHRUNK rank={old} new={dist.get_rank()} size={dist.get_world_size()}", file=sys.stderr, flush=True)
            break
        time.sleep(0.02)
    while True:  # the world shrunk: a checked all_reduce of the old ranks (again if another death shows up)
        try:
            olds: list = [None] * dist.get_world_size()
            dist.all_gather_object(olds, old)
            y = np.full(5, float(old))
            dist.all_reduce(y)
            break
        except dist.ProcessFailedError as exc:
            if shrinks >= 4:
                raise
            dist.shrink_group(exc.failed_group_ranks)
            shrinks += 1
    want = float(sum(olds))
    line = {"old": old, "new": dist.get_rank(), "size": dist.get_world_size(), "shrinks": shrinks,
            "failed": [k for k in range(n) if k not in olds], "sum": y.tolist(), "sum_ok": y.tolist() == [want] * 5}  # fmt: skip
    print("SURVIVOR " + json.dumps(line), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("check", "ulfm"):
        sys.exit(f"usage: scale.py check|ulfm [options], not {sys.argv[1:]}")
    sys.exit(check(sys.argv[2:]) if mode == "check" else ulfm(sys.argv[2:]))
