"""Where the extra time of a small collective on a torch CPU tensor goes, against a numpy array.

Run:  mpiexec -n 2 python benchmarks/profile_torch_overhead.py [--trials 15] [--cprofile]

Three parts, all on 8-byte float32 messages:

1. End to end (both ranks, interleaved trials, slowest rank, medians): ``dist.all_reduce``
   and ``dist.broadcast`` on a numpy array and on a torch tensor, and a *prototype* of a
   torch fast lane: the tensor's numpy view handed to the backend's ``fast_*`` method
   after the checks that lane would need. The prototype lives only in this script; it
   bounds what a torch fast lane in mpidist could save.
2. The pieces (rank 0, no MPI traffic, timeit minimum of 5 repeats): what each step of
   the torch path costs on its own (``Tensor.numpy()``, ``t.device.type``, the
   adapter, ``prepare_inout``, ...).
3. With ``--cprofile``: rank 0's profile of 20,000 torch all_reduce calls, top functions
   by own time (cProfile's per-call overhead inflates small functions; use it for the
   shape of the call tree, parts 1 and 2 for the numbers).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import timeit
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

import mpidist as dist
from mpidist import _arrays
from mpidist._world import world
from mpidist.reduce_op import ReduceOp

SUM = ReduceOp.SUM


def time_block(fn: Callable[[], Any], iters: int, comm: MPI.Comm) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def torch_fast_view(t: Any) -> Any:
    """The proposed ``_arrays`` helper: ``t.numpy()`` if the fast lane may hand it to MPI as it is, else None.

    Exact ``torch.Tensor``, strided, no autograd (``requires_grad`` tensors need
    ``detach()`` first), on the CPU, contiguous, no lazy conj/neg bit, a dtype numpy
    has (bfloat16 is left to the general lane). Cheapest and most selective checks first.
    """
    if (
        type(t) is not TENSOR
        or t.layout is not STRIDED
        or t.requires_grad
        or not t.is_cpu
        or not t.is_contiguous()
        or t.is_conj()
        or t.is_neg()
        or t.dtype not in PLAIN_DTYPES
    ):
        return None
    return t.numpy()


def torch_fast_pair(out: Any, inp: Any) -> Any:
    """Views of two tensors for the two-array fast lane, if their memory certainly does not overlap.

    Contiguous tensors occupy ``[data_ptr, data_ptr + nbytes)``, so two intervals
    decide aliasing exactly (numpy's ``base`` test cannot: a tensor's view has the
    tensor as its base).
    """
    o = torch_fast_view(out)
    i = None if o is None else torch_fast_view(inp)
    if i is None:
        return None
    po, pi = out.data_ptr(), inp.data_ptr()
    if po < pi + inp.nbytes and pi < po + out.nbytes:
        return None
    return o, i


TENSOR = torch.Tensor
STRIDED = torch.strided
PLAIN_DTYPES = frozenset(
    d for d in (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128)
)  # fmt: skip


def proto_all_reduce(tensor: Any, op: Any = SUM, group: Any = None, async_op: bool = False) -> Any:
    """dist.all_reduce with the proposed change: a plain tensor takes the fast lane as its numpy view."""
    impl = world.default_pg.impl  # the prototypes take the default group only
    v = tensor if type(tensor) is np.ndarray else torch_fast_view(tensor)
    w = NotImplemented if v is None else impl.fast_all_reduce(v, op, async_op)
    if w is NotImplemented:
        return dist.all_reduce(tensor, op, group, async_op)
    if w is not None:
        w._outputs = [tensor]
    return w


def proto_broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Any:
    impl = world.default_pg.impl  # the prototypes take the default group only
    v = tensor if type(tensor) is np.ndarray else torch_fast_view(tensor)
    w = NotImplemented if v is None else impl.fast_broadcast(v, src, async_op)
    if w is NotImplemented:
        return dist.broadcast(tensor, src, group, async_op)
    if w is not None:
        w._outputs = [tensor]
    return w


def proto_all_gather_into_tensor(out: Any, inp: Any, group: Any = None, async_op: bool = False) -> Any:
    """The two-array variant: what fast_all_gather_into_tensor would do after torch_fast_pair."""
    impl = world.default_pg.impl
    pair = torch_fast_pair(out, inp)
    if pair is None:
        return dist.all_gather_into_tensor(out, inp, group, async_op)
    o, i = pair
    e = impl._types.get(o.dtype)
    if e is None or not e.direct or o.size != impl.size * i.size:
        return dist.all_gather_into_tensor(out, inp, group, async_op)
    impl.seq += 1
    req = impl._iallgather(i, o)
    if not req.Test():
        impl._wait("all_gather_into_tensor", req, (i, o))
    return None


def end_to_end(comm: MPI.Comm, trials: int, iters: int) -> dict[str, float]:
    n = comm.Get_size()
    a = np.ones(2, np.float32)
    t = torch.ones(2, dtype=torch.float32)
    ga, gao = np.ones(2, np.float32), np.empty(2 * n, np.float32)
    gt, gto = torch.ones(2), torch.empty(2 * n)
    calls = {
        "all_reduce numpy": lambda: dist.all_reduce(a),
        "all_reduce torch": lambda: dist.all_reduce(t),
        "all_reduce torch, proposed fast lane": lambda: proto_all_reduce(t),
        "broadcast numpy": lambda: dist.broadcast(a, 0),
        "broadcast torch": lambda: dist.broadcast(t, 0),
        "broadcast torch, proposed fast lane": lambda: proto_broadcast(t, 0),
        "all_gather_into_tensor numpy": lambda: dist.all_gather_into_tensor(gao, ga),
        "all_gather_into_tensor torch": lambda: dist.all_gather_into_tensor(gto, gt),
        "all_gather_into_tensor torch, proposed fast lane": lambda: proto_all_gather_into_tensor(gto, gt),
    }
    # the prototypes compute what the real calls compute
    for x in (a, t):
        x[...] = 1 + comm.Get_rank()
    proto_all_reduce(t)
    dist.all_reduce(a)
    ok = np.array_equal(t.numpy(), a)
    gt[...] = torch.tensor([1.0, 2.0]) + comm.Get_rank()
    ga[...] = gt.numpy()
    proto_all_gather_into_tensor(gto, gt)
    dist.all_gather_into_tensor(gao, ga)
    ok = ok and np.array_equal(gto.numpy(), gao)
    if not comm.allreduce(ok, op=MPI.LAND):
        raise SystemExit("profile_torch_overhead: the prototype computed a different result")
    for fn in calls.values():
        time_block(fn, iters // 10, comm)
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(trials):
        for name in names[trial % len(names) :] + names[: trial % len(names)]:
            samples[name].append(time_block(calls[name], iters, comm))
    return {name: statistics.median(v) for name, v in samples.items()}


def quiet_barrier(comm: MPI.Comm) -> None:
    """A barrier that sleeps instead of spinning, so waiting ranks leave rank 0's timings alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def pieces() -> list[tuple[str, float]]:
    t = torch.ones(2, dtype=torch.float32)
    a = np.ones(2, np.float32)
    v = t.numpy()
    adapt = _arrays._adapt
    stmts = [
        "t.numpy()",
        "t.device.type",
        "t.is_cpu",
        "t.layout",
        "t.is_conj(); t.is_neg()",
        "t.requires_grad",
        "t.is_contiguous()",
        "_arrays._torch_dtypes(torch).get(t.dtype)",
        "adapt(t, 'all_reduce', 'tensor')",
        "_arrays.prepare_inout(t, 'all_reduce', 'tensor')",
        "_arrays.prepare_inout(a, 'all_reduce', 'tensor')",
        "_arrays.prepare_input(t, 'broadcast', 'tensor')",
        "_arrays.prepare_input(a, 'broadcast', 'tensor')",
        "v.flags.c_contiguous",
        "_arrays.may_overlap(v, t.numpy())",
        "torch_fast_view(t)",
        "torch_fast_pair(o, t)",
        "MPI.buffer.fromaddress(t.data_ptr(), t.nbytes)",
    ]
    env = {
        "t": t, "o": torch.empty(4), "a": a, "v": v, "torch": torch, "_arrays": _arrays, "adapt": adapt, "MPI": MPI,
        "torch_fast_view": torch_fast_view, "torch_fast_pair": torch_fast_pair,
    }  # fmt: skip
    out = []
    for stmt in stmts:
        n = 100_000
        best = min(timeit.repeat(stmt, globals=env, number=n, repeat=5)) / n
        out.append((stmt, best))
    return out


def profile(comm: MPI.Comm, calls: int) -> str:
    t = torch.ones(2, dtype=torch.float32)
    prof = cProfile.Profile()
    comm.Barrier()
    prof.enable()
    for _ in range(calls):
        dist.all_reduce(t)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return buf.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--iters", type=int, default=2000, help="calls per timed block")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()

    e2e = end_to_end(comm, args.trials, args.iters)
    if rank == 0:
        print(f"end to end, 8 B, {comm.Get_size()} ranks, median of {args.trials} interleaved trials:")
        for op in ("all_reduce", "broadcast", "all_gather_into_tensor"):
            base = e2e[f"{op} numpy"]
            for name, sec in e2e.items():
                if name.startswith(op + " "):
                    print(f"  {name:40s} {sec * 1e6:7.2f} us   {(sec - base) * 1e6:+6.2f} us vs numpy")
    if rank == 0:
        print("\npieces (rank 0 alone, timeit, best of 5):")
        for stmt, sec in pieces():
            print(f"  {sec * 1e9:7.0f} ns  {stmt}")
    quiet_barrier(comm)
    if args.cprofile:
        text = profile(comm, 20_000)
        if rank == 0:
            print("\ncProfile, rank 0, 20,000 x dist.all_reduce(torch tensor, 8 B):")
            print(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
