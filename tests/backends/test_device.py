"""Device arrays over the MPI backend, without a GPU: ``HostCudaArray`` stands in for GPU memory.

Every call goes the device way (``backends/mpi_device.py``): either direct, as with a
CUDA-aware MPI (``world.cuda_aware`` forced on), or staged through host memory (forced
off). Results are checked against numpy references; the stand-in's ops record stream
synchronizations and ``world.stats`` counts staging copies.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist._world import world
from mpidist.arrays.device import DeviceArray, mpi_cuda_aware
from mpidist.backends.mpi_device import DeviceStagingWarning
from mpidist.testing import HostCudaArray
from mpidist.testing.standin import HostOps

from helpers import BF16, check_raises, copies, fail_together, rank_input, reference

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
R = dist.ReduceOp
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["direct", "staged"])
def mode(request, monkeypatch):
    """Force the CUDA-aware answer; silence the one-time staging warning for the test."""
    monkeypatch.setattr(world, "cuda_aware", request.param == "direct")
    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    return request.param


def dev(a: np.ndarray, stream: int | None = 7) -> HostCudaArray:
    return HostCudaArray(np.ascontiguousarray(a), stream)


def expect(problems: list[str], what: str, got: np.ndarray, want: np.ndarray, close: bool = False) -> None:
    """Exact comparison (``close``: to the last bits, for divisions rounded in another order)."""
    same = np.allclose(got, want, rtol=1e-12, atol=0) if close else np.array_equal(got, want)
    if got.dtype != want.dtype or got.shape != want.shape or not same:
        problems.append(f"{what}: got {got!r}, expected {want!r}")


DTYPES = [np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.float16), BF16, np.dtype(np.complex128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("op", [R.SUM, R.MAX, R.AVG], ids=lambda o: o.name)
def test_all_reduce(mode, dtype, op):
    if op == R.MAX and dtype.kind == "c":
        pytest.skip("MAX is undefined for complex")
    problems: list[str] = []
    x = dev(rank_input(RANK, (2, 3), dtype))
    before = copies()
    dist.all_reduce(x, op=op)
    want = reference([rank_input(r, (2, 3), dtype) for r in range(SIZE)], op)
    expect(problems, "all_reduce", x.host, want, close=op == R.AVG and dtype.kind == "c")
    # float MIN/MAX reduce order keys computed on the host (NaN and +/-0 agree on every rank): staged
    native = op != R.AVG and dtype.name not in ("float16", "bfloat16") and not (op == R.MAX and dtype.kind == "f")
    if mode == "direct" and native and copies() != before:
        problems.append(f"direct all_reduce {op.name} {dtype.name} copied {copies() - before} arrays")
    if mode == "staged" and copies() == before:
        problems.append("staged all_reduce made no counted copy")
    fail_together(problems)


def test_broadcast_every_root_and_stream_sync(mode):
    problems: list[str] = []
    for root in range(SIZE):
        x = dev(rank_input(RANK, (5,), np.dtype(np.float64)), stream=40 + RANK)
        HostCudaArray.ops.syncs.clear()
        dist.broadcast(x, src=root)
        expect(problems, f"broadcast src={root}", x.host, rank_input(root, (5,), np.dtype(np.float64)))
        new = list(HostCudaArray.ops.syncs)
        if 40 + RANK not in new:
            problems.append(f"broadcast src={root}: the producer's stream was not synchronized ({new})")
    fail_together(problems)


def test_all_gather_into_tensor_and_list(mode):
    problems: list[str] = []
    mine = rank_input(RANK, (3,), np.dtype(np.int32))
    want = np.concatenate([rank_input(r, (3,), np.dtype(np.int32)) for r in range(SIZE)])
    out = dev(np.zeros(3 * SIZE, np.int32))
    dist.all_gather_into_tensor(out, dev(mine))
    expect(problems, "all_gather_into_tensor", out.host, want)
    outs = [dev(np.zeros(3, np.int32)) for _ in range(SIZE)]
    dist.all_gather(outs, dev(mine))
    expect(problems, "all_gather", np.concatenate([o.host for o in outs]), want)
    fail_together(problems)


def test_reduce_scatter_tensor_and_list(mode):
    problems: list[str] = []
    dt = np.dtype(np.float64)
    full = [rank_input(r, (SIZE * 2,), dt) for r in range(SIZE)]
    want = reference(full, R.SUM)[RANK * 2 : RANK * 2 + 2]
    out = dev(np.zeros(2, dt))
    dist.reduce_scatter_tensor(out, dev(full[RANK]))
    expect(problems, "reduce_scatter_tensor", out.host, want)
    out = dev(np.zeros(2, dt))
    dist.reduce_scatter(out, [dev(full[RANK][2 * r : 2 * r + 2]) for r in range(SIZE)])
    expect(problems, "reduce_scatter", out.host, want)
    fail_together(problems)


def test_reduce_gather_scatter_roots(mode):
    problems: list[str] = []
    dt = np.dtype(np.int64)
    for root in range(SIZE):
        x = dev(rank_input(RANK, (4,), dt))
        dist.reduce(x, dst=root, op=R.SUM)
        if RANK == root:
            expect(
                problems, f"reduce dst={root}", x.host, reference([rank_input(r, (4,), dt) for r in range(SIZE)], R.SUM)
            )
        outs = [dev(np.zeros(4, dt)) for _ in range(SIZE)] if RANK == root else None
        dist.gather(dev(rank_input(RANK, (4,), dt)), outs, dst=root)
        if RANK == root:
            for r, o in enumerate(outs):
                expect(problems, f"gather dst={root} [{r}]", o.host, rank_input(r, (4,), dt))
        out = dev(np.zeros(4, dt))
        ins = [dev(rank_input(r, (4,), dt, salt=root)) for r in range(SIZE)] if RANK == root else None
        dist.scatter(out, ins, src=root)
        expect(problems, f"scatter src={root}", out.host, rank_input(RANK, (4,), dt, salt=root))
    fail_together(problems)


def test_all_to_all_single_uneven_and_list(mode):
    problems: list[str] = []
    dt = np.dtype(np.float32)
    # rank r sends (r + k + 1) rows to rank k
    splits_in = [RANK + k + 1 for k in range(SIZE)]
    splits_out = [r + RANK + 1 for r in range(SIZE)]
    inp = np.concatenate([np.full((n, 2), 100 * RANK + k, dt) for k, n in enumerate(splits_in)])
    out = dev(np.zeros((sum(splits_out), 2), dt))
    dist.all_to_all_single(out, dev(inp), splits_out, splits_in)
    want = np.concatenate([np.full((n, 2), 100 * r + RANK, dt) for r, n in enumerate(splits_out)])
    expect(problems, "all_to_all_single", out.host, want)
    outs = [dev(np.zeros(2, dt)) for _ in range(SIZE)]
    dist.all_to_all(outs, [dev(np.full(2, 10 * RANK + k, dt)) for k in range(SIZE)])
    expect(
        problems,
        "all_to_all",
        np.stack([o.host for o in outs]),
        np.stack([np.full(2, 10 * r + RANK, dt) for r in range(SIZE)]),
    )
    fail_together(problems)


def test_non_contiguous_device_output_is_written_in_place(mode):
    problems: list[str] = []
    backing = np.full((3, 4), -1.0)
    view = HostCudaArray(backing)[:, 1]  # strided: staged through a contiguous device copy
    before = copies()
    dist.all_reduce(view)
    want = backing.copy()
    want[:, 1] = -1.0 * SIZE
    expect(problems, "strided all_reduce", backing, want)
    if copies() == before:
        problems.append("a strided device array was reduced without a counted copy")
    fail_together(problems)


def test_async_work_writes_back_on_wait(mode):
    problems: list[str] = []
    x = dev(np.full(4, float(RANK + 1)))
    w = dist.all_reduce(x, op=R.AVG, async_op=True)
    w.wait()
    expect(problems, "async AVG", x.host, np.full(4, (SIZE + 1) / 2))
    if w.result() != [x] or w.result()[0] is not x:
        problems.append(f"result() is {w.result()!r}, not the caller's array")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_send_recv_and_batch(mode):
    problems: list[str] = []
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    out = dev(np.zeros(3, np.int16))
    ops = [dist.P2POp(dist.isend, dev(np.full(3, RANK, np.int16)), nxt), dist.P2POp(dist.irecv, out, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    expect(problems, "batch ring", out.host, np.full(3, prv, np.int16))
    if RANK == 0:
        dist.send(dev(np.arange(5.0)), dst=1)
    elif RANK == 1:
        y = dev(np.zeros(5))
        dist.recv(y, src=0)
        expect(problems, "recv", y.host, np.arange(5.0))
    fail_together(problems)


def test_host_and_device_arrays_mix_in_one_call(mode):
    problems: list[str] = []
    out = dev(np.zeros(2 * SIZE))
    dist.all_gather_into_tensor(out, np.full(2, float(RANK)))
    expect(problems, "host in, device out", out.host, np.repeat(np.arange(SIZE, dtype=np.float64), 2))
    host_out = np.zeros(2 * SIZE)
    dist.all_gather_into_tensor(host_out, dev(np.full(2, float(RANK))))
    expect(problems, "device in, host out", host_out, np.repeat(np.arange(SIZE, dtype=np.float64), 2))
    fail_together(problems)


def test_direct_mode_passes_pointers_without_copies(monkeypatch):
    monkeypatch.setattr(world, "cuda_aware", True)
    problems: list[str] = []
    x, out = dev(np.ones(8)), dev(np.zeros(8 * SIZE))
    before = copies()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceStagingWarning)  # nothing may be staged
        dist.all_reduce(x)
        dist.all_gather_into_tensor(out, x)
        dist.broadcast(x, src=0)
    if copies() != before:
        problems.append(f"direct mode made {copies() - before} copies")
    expect(problems, "all_gather", out.host, np.full(8 * SIZE, float(SIZE)))
    fail_together(problems)


def test_staging_warns_once_and_can_be_forbidden(monkeypatch):
    monkeypatch.setattr(world, "cuda_aware", False)
    monkeypatch.setattr(world, "staging_warned", False)
    monkeypatch.delenv("MPIDIST_DEVICE_STAGING", raising=False)
    problems: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_reduce(dev(np.ones(2)))
        dist.all_reduce(dev(np.ones(2)))
    staged = [w for w in caught if issubclass(w.category, DeviceStagingWarning)]
    if len(staged) != 1 or "MPI library is not CUDA-aware" not in str(staged[0].message):
        problems.append(f"expected one staging warning, got {[str(w.message) for w in staged]}")
    elif staged[0].filename != __file__:
        problems.append(f"the warning points at {staged[0].filename}, not at the caller")
    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "error")
    x = dev(np.ones(2))
    problems += check_raises(
        TypeError,
        r"^all_reduce: device arrays would be copied through host memory.*MPIDIST_DEVICE_STAGING=error",
        dist.all_reduce,
        x,
    )
    expect(problems, "untouched after the refusal", x.host, np.ones(2))
    dist.all_reduce(np.ones(1))  # the group still works
    fail_together(problems)


def test_avg_under_cuda_aware_mpi_is_staged_and_correct(monkeypatch):
    monkeypatch.setattr(world, "cuda_aware", True)
    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    problems: list[str] = []
    x = dev(np.arange(4.0) * (RANK + 1))
    before = copies()
    dist.all_reduce(x, op=R.AVG)
    expect(problems, "AVG", x.host, np.arange(4.0) * (SIZE + 1) / 2)
    if copies() == before:
        problems.append("AVG on a CUDA-aware MPI should be staged (host-side division)")
    fail_together(problems)


def test_overlapping_device_arguments_are_staged(monkeypatch):
    monkeypatch.setattr(world, "cuda_aware", True)
    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    problems: list[str] = []
    backing = np.zeros(2 * SIZE)
    backing[2 * RANK : 2 * RANK + 2] = RANK + 1
    out = HostCudaArray(backing)
    dist.all_gather_into_tensor(out, HostCudaArray(backing[2 * RANK : 2 * RANK + 2]))  # in place
    expect(problems, "in-place all_gather_into_tensor", backing, np.repeat(np.arange(1, SIZE + 1, dtype=np.float64), 2))
    fail_together(problems)


def test_bad_device_arrays_get_clear_errors(mode):
    problems: list[str] = []
    ro = np.zeros(2)
    ro.flags.writeable = False
    problems += check_raises(ValueError, r"^all_reduce: tensor is read-only", dist.all_reduce, HostCudaArray(ro))
    problems += check_raises(
        TypeError, r"^all_reduce: tensor has dtype object", dist.all_reduce, HostCudaArray(np.array([None, 1]))
    )
    fail_together(problems)


def test_coalesced_calls_stage_device_arrays(mode):
    problems: list[str] = []
    xs = [dev(np.full(2, float(RANK))), dev(np.full((2, 2), RANK, np.float64))]
    dist.all_reduce_coalesced(xs)
    total = float(sum(range(SIZE)))
    expect(problems, "all_reduce_coalesced[0]", xs[0].host, np.full(2, total))
    expect(problems, "all_reduce_coalesced[1]", xs[1].host, np.full((2, 2), total))
    outs = [[dev(np.zeros(3))] for _ in range(SIZE)]
    dist.all_gather_coalesced(outs, [dev(np.full(3, float(RANK)))])
    for r in range(SIZE):
        expect(problems, f"all_gather_coalesced[{r}]", outs[r][0].host, np.full(3, float(r)))
    fail_together(problems)


class _BareCai:
    """A CUDA array interface with no ops of its own: mpidist must reach it through cupy."""

    def __init__(self) -> None:
        self._a = np.zeros(2)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"version": 3, "shape": (2,), "typestr": "<f8", "data": (self._a.ctypes.data, False), "stream": None}


class _CudaDlpack:
    def __dlpack__(self, stream=None):  # pragma: no cover - never exported
        raise AssertionError("not reached")

    def __dlpack_device__(self):
        return (2, 0)


class _CpuDlpack:
    """A host DLPack exporter that is not a numpy array (like a jax or tensorflow CPU array)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, stream=None, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_gpu_arrays_without_cupy_explain_the_fix(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed here")
    monkeypatch.setattr(world, "device_ops", None)
    problems: list[str] = []
    for obj, what in ((_BareCai(), "a CUDA array"), (_CudaDlpack(), "a CUDA DLPack array")):
        problems += check_raises(
            TypeError, rf"^all_reduce: tensor is {what} .*pip install 'mpidist\[gpu\]'", dist.all_reduce, obj
        )
    fail_together(problems)


def test_host_dlpack_objects_are_host_arrays():
    problems: list[str] = []
    backing = np.full(3, float(RANK))
    x = _CpuDlpack(backing)
    dist.all_reduce(x)
    expect(problems, "DLPack host all_reduce (in place, zero-copy)", backing, np.full(3, float(sum(range(SIZE)))))
    fail_together(problems)


def test_device_array_metadata():
    a = np.arange(12.0).reshape(3, 4)
    d = DeviceArray(a.ctypes.data, (3, 4), a.dtype, (32, 8), 0, None, a, HostOps())
    assert d.c_contiguous and d.strides is None and d.nbytes == 96 and d.size == 12
    col = DeviceArray(a.ctypes.data + 8, (3,), a.dtype, (32,), 0, None, a, HostOps())
    assert not col.c_contiguous
    assert np.array_equal(HostOps().view(col), a[:, 1])
    flat = d.flat(4, 4)
    assert np.array_equal(HostOps().view(flat), a[1])
    assert d.reshape(-1).shape == (12,) and d.reshape(2, 6).shape == (2, 6)
    cai = HostCudaArray(a.astype(BF16)).__cuda_array_interface__
    assert cai["typestr"] == "<V2" and cai["version"] == 3
    assert "float64[3, 4]" in repr(d)


def test_cuda_awareness_env_override(monkeypatch):
    for value, want in (("1", True), ("0", False), ("yes", True), ("off", False)):
        monkeypatch.setattr(world, "cuda_aware", None)
        monkeypatch.setenv("MPIDIST_CUDA_AWARE", value)
        assert mpi_cuda_aware() is want
    monkeypatch.setattr(world, "cuda_aware", None)
    monkeypatch.delenv("MPIDIST_CUDA_AWARE")
    assert mpi_cuda_aware() is False  # the PyPI MPICH and Open MPI wheels are not CUDA-aware


def test_cuda_only_mpi_group_rejects_host_arrays(monkeypatch):
    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    problems: list[str] = []
    g = dist.new_group(backend="cuda:mpi")
    problems += check_raises(
        TypeError, r"^all_reduce: process group \S+ has backend cuda:mpi, which takes CUDA arrays only; got a host array",
        dist.all_reduce, np.ones(2), group=g,
    )  # fmt: skip
    x = dev(np.ones(2))
    dist.all_reduce(x, group=g)
    expect(problems, "cuda:mpi device all_reduce", x.host, np.full(2, float(SIZE)))
    dist.destroy_process_group(g)
    fail_together(problems)


def test_detail_debug_checks_device_calls(monkeypatch):
    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    problems: list[str] = []
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        g = dist.new_group()
        x = dev(np.ones(3))
        dist.all_reduce(x, group=g)
        expect(problems, "DETAIL all_reduce", x.host, np.full(3, float(SIZE)))
        if SIZE > 1:
            shape = 3 if RANK == 0 else 4
            problems += check_raises(
                dist.DistError, r"all_reduce \(call #\d+\).*float64\[3\]", dist.all_reduce, dev(np.ones(shape)), group=g
            )
        dist.destroy_process_group(g)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    fail_together(problems)
