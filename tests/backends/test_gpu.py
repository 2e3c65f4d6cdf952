"""The nccl backend on real GPUs: cupy arrays and torch CUDA tensors through the public API.

Skipped without cupy (with its NCCL bindings), without a CUDA device, and when a
node runs more ranks than it has GPUs (NCCL needs a GPU per rank): on a machine
with one GPU run it at ``-n 1``, with N GPUs at up to ``-n N``::

    mpiexec -n 2 python -m pytest -q -p no:cacheprovider tests/backends/test_gpu.py

Results are read back with ``cupy.ndarray.get()`` / ``tensor.cpu()``, which run on
the current stream: that they see the collectives' results checks that blocking
calls and ``Work.wait()`` make the current stream wait for NCCL's stream.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist.testing import backend_of

from helpers import (
    BF16,
    fail_together,
    filled,
    inputs_of,
    nccl_reference,
    rank_input,
    sentinel,
    to_kind,
    to_numpy,
)
from helpers import Checks as BaseChecks

cp = pytest.importorskip("cupy")

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
R = dist.ReduceOp


def _usable() -> tuple[bool, str, int]:
    """(usable, why not, device): decided together so that every rank skips or runs."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    local, per_node = node.Get_rank(), node.Get_size()
    node.Free()
    why, device = "", 0
    try:
        from cupy.cuda import nccl

        gpus = cp.cuda.runtime.getDeviceCount()
        if not getattr(nccl, "available", True):
            why = "cupy cannot load libnccl"
        elif gpus < per_node:
            why = f"{per_node} ranks on this node but {gpus} GPU(s); NCCL needs one GPU per rank"
        else:
            device = local % gpus
    except Exception as exc:  # noqa: BLE001 - no driver, no device
        why = f"no usable CUDA device: {exc}"
    whys = MPI.COMM_WORLD.allgather(why)
    first = next((w for w in whys if w), "")
    return not first, first, device


USABLE, WHY, DEVICE = _usable()
pytestmark = pytest.mark.skipif(not USABLE, reason=WHY)
if USABLE:
    cp.cuda.Device(DEVICE).use()  # the backend uses the current device

CUPY_DTYPES = [
    np.dtype(t)
    for t in (np.bool_, np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64,
              np.float16, np.float32, np.float64, np.complex64, np.complex128)
]  # fmt: skip


class Checks(BaseChecks):
    """helpers.Checks whose equal() allows a few ulps for NCCL's float AVG (see below)."""

    def equal(self, what: str, got: Any, expected: np.ndarray, op: Any = None) -> None:
        """Exact equality; for float AVG over a group size that is not a power of two, to a few ulps.

        (NCCL's ncclAvg on floats multiplies by 1/n before summing, which rounds differently.)
        """
        if hasattr(got, "get"):
            got = got.get()
        elif not isinstance(got, np.ndarray):
            got = to_numpy(got.cpu())
        if got.dtype != expected.dtype or got.shape != expected.shape:
            self.failures.append(f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}")
            return
        inexact = op == R.AVG and SIZE & (SIZE - 1) and (expected.dtype.kind in "fc" or expected.dtype == BF16)
        if inexact:
            rtol = 1e-2 if expected.dtype.itemsize <= 2 or expected.dtype == BF16 else 1e-5
            ok = np.allclose(got.astype(np.complex128), expected.astype(np.complex128), rtol=rtol, atol=0)
        else:
            ok = np.array_equal(got, expected)
        if not ok:
            self.failures.append(f"{what}: got {got!r}, expected {expected!r}")


@pytest.fixture(scope="module")
def group():
    g = dist.new_group(list(range(SIZE)), backend="cpu:mpi,cuda:nccl")
    yield g
    dist.destroy_process_group(g)


def nccl_reduces(dtype: np.dtype, op: Any) -> bool:
    base = op.op if isinstance(op, R) else op
    if dtype in (np.dtype(np.int16), np.dtype(np.uint16)) or base in (R.BAND, R.BOR, R.BXOR):
        return False
    if dtype.kind == "c":
        return base in (R.SUM, R.AVG, R.PREMUL_SUM)
    if dtype.kind == "b":
        return base in (R.SUM, R.PRODUCT, R.MIN, R.MAX)
    return base != R.PREMUL_SUM or dtype.kind == "f"


@pytest.mark.parametrize("dtype", CUPY_DTYPES, ids=str)
def test_all_reduce_cupy(group, dtype):
    c = Checks()
    for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, dist.make_premul_sum(0.5)):
        if not nccl_reduces(dtype, op):
            continue
        x = cp.asarray(rank_input(RANK, (3, 5), dtype))
        dist.all_reduce(x, op=op, group=group)
        c.equal(f"all_reduce {op}", x, nccl_reference(inputs_of(SIZE, (3, 5), dtype), op), op)
    c.done()


def test_the_group_uses_nccl_for_device_arrays(group):
    from mpidist.backends.nccl import NCCLBackend

    x = cp.ones(2)
    dist.all_reduce(x, group=group)
    impl = backend_of(group, "cuda")
    fail_together([] if isinstance(impl, NCCLBackend) and impl.device == DEVICE else [f"device backend {impl!r}"])


def test_errors_before_anything_is_sent(group):
    problems = []
    for op, exc in ((R.BAND, ValueError), (R.SUM, TypeError)):
        x = cp.ones(2, np.int16 if exc is TypeError else np.int32)
        try:
            dist.all_reduce(x, op=op, group=group)
            problems.append(f"{op}: no error")
        except exc:
            pass
    fail_together(problems)


@pytest.mark.parametrize(
    "dtype", [np.dtype(np.float32), np.dtype(np.int16), np.dtype(np.complex64), np.dtype(np.bool_)], ids=str
)
def test_data_movement_cupy(group, dtype):
    c = Checks()
    for root in range(SIZE):
        x = cp.asarray(rank_input(RANK, (4,), dtype) if RANK == root else filled((4,), dtype, sentinel(dtype)))
        dist.broadcast(x, src=root, group=group)
        c.equal(f"broadcast {root}", x, rank_input(root, (4,), dtype))
        inp = cp.asarray(rank_input(RANK, (3,), dtype, salt=root))
        outs = [cp.asarray(filled((3,), dtype, sentinel(dtype))) for _ in range(SIZE)] if RANK == root else None
        dist.gather(inp, outs, dst=root, group=group)
        if outs is not None:
            for j in range(SIZE):
                c.equal(f"gather {root} from {j}", outs[j], rank_input(j, (3,), dtype, salt=root))
        ins = [cp.asarray(rank_input(root, (3,), dtype, salt=j)) for j in range(SIZE)] if RANK == root else None
        out = cp.asarray(filled((3,), dtype, sentinel(dtype)))
        dist.scatter(out, ins, src=root, group=group)
        c.equal(f"scatter {root}", out, rank_input(root, (3,), dtype, salt=RANK))
    outs = [cp.asarray(filled((3,), dtype, sentinel(dtype))) for _ in range(SIZE)]
    dist.all_gather(outs, cp.asarray(rank_input(RANK, (3,), dtype)), group=group)
    for j in range(SIZE):
        c.equal(f"all_gather {j}", outs[j], rank_input(j, (3,), dtype))
    uneven = [cp.asarray(filled((j + 1,), dtype, sentinel(dtype))) for j in range(SIZE)]
    dist.all_gather(uneven, cp.asarray(rank_input(RANK, (RANK + 1,), dtype)), group=group)
    for j in range(SIZE):
        c.equal(f"uneven all_gather {j}", uneven[j], rank_input(j, (j + 1,), dtype))
    out = cp.asarray(filled((SIZE * 3,), dtype, sentinel(dtype)))
    dist.all_gather_into_tensor(out, cp.asarray(rank_input(RANK, (3,), dtype)), group=group)
    c.equal("all_gather_into_tensor", out, np.concatenate(inputs_of(SIZE, (3,), dtype)))
    ins = [cp.asarray(rank_input(RANK, (j + 1,), dtype, salt=j)) for j in range(SIZE)]
    outs = [cp.asarray(filled((RANK + 1,), dtype, sentinel(dtype))) for _ in range(SIZE)]
    dist.all_to_all(outs, ins, group=group)
    for j in range(SIZE):
        c.equal(f"all_to_all {j}", outs[j], rank_input(j, (RANK + 1,), dtype, salt=RANK))
    c.done()


def test_all_to_all_single_uneven_rows(group):
    c = Checks()
    dtype = np.dtype(np.float64)

    def rows(src: int, dst: int) -> int:
        return (src + 2 * dst) % 3

    send = [rows(RANK, j) for j in range(SIZE)]
    recv = [rows(j, RANK) for j in range(SIZE)]
    inp = np.concatenate([rank_input(RANK, (send[j], 2), dtype, salt=j) for j in range(SIZE)])
    want = np.concatenate([rank_input(j, (recv[j], 2), dtype, salt=RANK) for j in range(SIZE)])
    out = cp.zeros((sum(recv), 2))
    dist.all_to_all_single(out, cp.asarray(inp), recv, send, group=group)
    c.equal("uneven", out, want)
    c.done()


@pytest.mark.parametrize("op", [R.SUM, R.AVG, R.MAX], ids=str)
def test_reduce_and_reduce_scatter_cupy(group, op):
    c = Checks()
    dtype = np.dtype(np.float32)
    for root in range(SIZE):
        x = cp.asarray(rank_input(RANK, (4,), dtype, salt=root))
        dist.reduce(x, dst=root, op=op, group=group)
        if RANK == root:
            c.equal(f"reduce {root}", x, nccl_reference(inputs_of(SIZE, (4,), dtype, salt=root), op), op)
    full = nccl_reference(inputs_of(SIZE, (SIZE * 2,), dtype), op)
    out = cp.zeros(2, dtype)
    dist.reduce_scatter_tensor(out, cp.asarray(rank_input(RANK, (SIZE * 2,), dtype)), op=op, group=group)
    c.equal("reduce_scatter_tensor", out, full[RANK * 2 : RANK * 2 + 2], op)
    flat = rank_input(RANK, (SIZE * 2,), dtype)
    out = cp.zeros(2, dtype)
    dist.reduce_scatter(out, [cp.asarray(flat[j * 2 : j * 2 + 2]) for j in range(SIZE)], op=op, group=group)
    c.equal("reduce_scatter", out, full[RANK * 2 : RANK * 2 + 2], op)
    c.done()


def test_async_work_stream_semantics(group):
    c = Checks()
    x = cp.full(1 << 20, RANK + 1.0)
    w = dist.all_reduce(x, group=group, async_op=True)
    w.wait()  # the current stream now waits for NCCL's stream; the host did not
    y = x * 2  # queued on the current stream, after the all_reduce
    c.equal("after wait", y[:4], np.full(4, SIZE * (SIZE + 1.0)))
    deadline = time.monotonic() + 60
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    c.failures += [] if w.is_completed() and w.is_success() else ["is_completed never became True"]
    fut = dist.all_reduce(x, group=group, async_op=True).get_future()
    c.equal("future", fut.wait()[0][:2], np.full(2, SIZE * SIZE * (SIZE + 1.0) / 2))
    # a producer on a non-default stream: the collective waits for it
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        z = cp.full(1 << 20, float(RANK))
        z += 1
        dist.all_reduce(z, group=group)
        got = z[:3].get()
    c.equal("stream producer", got, np.full(3, SIZE * (SIZE + 1.0) / 2))
    c.done()


def test_barrier_and_p2p(group):
    c = Checks()
    assert dist.barrier(group=group) is None
    dist.barrier(group=group, timeout=60)
    if SIZE > 1:
        nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
        x, y = cp.full(8, float(RANK)), cp.zeros(8)
        if RANK % 2 == 0:
            dist.send(x, nxt, group=group)
            got = dist.recv(y, prv, group=group)
        else:
            got = dist.recv(y, prv, group=group)
            dist.send(x, nxt, group=group)
        c.equal("recv", y, np.full(8, float(prv)))
        c.failures += [] if got == prv else [f"recv returned {got}"]
        try:
            dist.recv(cp.zeros(1), group=group)
            c.failures.append("recv from any source did not raise")
        except ValueError:
            pass
    c.done()


def test_torch_cuda_tensors_bfloat16_and_premul(group):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    torch.cuda.set_device(DEVICE)
    c = Checks()
    for dtype in (BF16, np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int64)):
        for op in (R.SUM, R.AVG, R.MAX, dist.make_premul_sum(0.5)):
            if not nccl_reduces(dtype, op):
                continue
            t = to_kind(rank_input(RANK, (6,), dtype), "torch").cuda()
            dist.all_reduce(t, op=op, group=group)
            c.equal(f"torch {dtype} {op}", t, nccl_reference(inputs_of(SIZE, (6,), dtype), op), op)
    t = to_kind(rank_input(RANK, (4, 3), BF16), "torch").cuda()
    out = torch.empty((SIZE * 4, 3), dtype=torch.bfloat16, device="cuda")
    dist.all_gather_into_tensor(out, t, group=group)
    c.equal("all_gather_into_tensor bf16", out, np.concatenate(inputs_of(SIZE, (4, 3), BF16)))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # a tensor produced on a side stream
        u = torch.full((1 << 16,), float(RANK + 1), device="cuda")
        w = dist.all_reduce(u, group=group, async_op=True)
        w.wait()
        v = u[:2].clone()
    s.synchronize()
    c.equal("side stream", v, np.full(2, SIZE * (SIZE + 1) / 2, np.float32))
    strided = torch.zeros((4, 2), device="cuda")[:, 0]  # staged and written back on NCCL's stream
    strided += RANK + 1
    dist.all_reduce(strided, group=group)
    c.equal("strided", strided, np.full(4, SIZE * (SIZE + 1) / 2, np.float32))
    c.done()


def test_cuda_only_default_group(no_group):
    """init_process_group(backend="nccl"): device arrays only, host arrays refused."""
    dist.init_process_group(backend="nccl")
    try:
        c = Checks()
        x = cp.full(3, RANK + 1.0)
        dist.all_reduce(x)
        c.equal("all_reduce", x, np.full(3, SIZE * (SIZE + 1) / 2))
        dist.barrier()
        try:
            dist.all_reduce(np.ones(2))
            c.failures.append("a host array was accepted")
        except TypeError:
            pass
        c.done()
    finally:
        dist.destroy_process_group()
