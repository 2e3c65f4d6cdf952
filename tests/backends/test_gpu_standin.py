"""Device paths on the stand-in that fails the way a GPU does (``mpidist.testing.gpu``, issue 34).

Each test here failed on the code before issue 34's fixes (the note of the commit
that fixed it says how): device memory the host cannot touch (finding 1), streams
that run only when ordered (finding 2), a cupy whose ``nccl.available`` is False
(finding 3), an allocation that fails on one rank (finding 5). Every test is SPMD
and decides together (``fail_together``); blocking waits on the stand-in raise
``StandinHangError`` after ``hang_s`` instead of hanging.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import DistBackendError
from mpidist._world import world
from mpidist.arrays.device import DeviceArray, DevicePointer, from_cuda_interface
from mpidist.backends import registry
from mpidist.backends._cuda import CudaRuntime, make_communicator
from mpidist.backends.mpi import MPIBackend
from mpidist.backends.mpi_device import MPIDeviceBackend
from mpidist.backends.nccl import NCCLBackend
from mpidist.backends.shm import SharedPath
from mpidist.testing import backend_of
from mpidist.testing.gpu import GpuStandin, StandinHangError
from mpidist.testing.gpu_nccl import StandinNccl, StandinRuntime, fake_cupy

from helpers import copies, fail_together

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
R = dist.ReduceOp
pytestmark = pytest.mark.timeout(120)


def darr(x: Any) -> Any:
    return from_cuda_interface(x, "test", "x")


@pytest.fixture
def gpu():
    return GpuStandin(hang_s=20.0, device=RANK)  # one GPU per rank


@pytest.fixture
def nccl_backend(gpu):
    """``build(timeout=30.0, **runtime kwargs)`` -> (NCCLBackend on the stand-in, runtime); shut down after."""
    made: list[tuple[Any, Any]] = []

    def build(timeout: float = 30.0, **rt: Any):
        runtime = StandinRuntime(gpu, **rt)
        comm = MPI.COMM_WORLD.Dup()
        backend = NCCLBackend(comm, timeout, "standin", runtime=runtime)
        made.append((backend, comm))
        return backend, runtime

    yield build
    for backend, comm in made:
        if backend._broken is None:
            try:
                gpu.synchronize_all()
            except StandinHangError:
                pass
        backend.shutdown()
        comm.Free()


# -- the stand-in itself ---------------------------------------------------------------------


def test_standin_streams_run_only_when_ordered(gpu):
    """An enqueued step waits for an order; an event completes only when its stream ran; freed memory is poisoned."""
    problems: list[str] = []
    s = gpu.new_stream()
    x = gpu.array(np.zeros(4, np.float32), stream=s)
    ran: list[int] = []
    gpu.enqueue(s, lambda: ran.append(1))
    from mpidist.testing.gpu import StandinEvent

    e = StandinEvent()
    gpu.record(e, s)
    if ran or gpu.query(e):
        problems.append("a step ran (or its event completed) without an order")
    gpu.wait_event(gpu.DEFAULT, e)
    gpu.synchronize()  # the default stream runs, and with it s up to e
    if ran != [1] or not gpu.query(e):
        problems.append(f"after a wait and a synchronize: ran={ran}, query={gpu.query(e)}")
    addr = x.ptr
    x.free()
    y = gpu.empty(4, np.float32)
    if y.ptr != addr or not np.isnan(y.get()).all():
        problems.append("freed memory was not reused poisoned")
    gpu.fail_allocations(1)
    try:
        gpu.empty(4, np.float32)
        problems.append("an allocation told to fail succeeded")
    except MemoryError:
        pass
    fail_together(problems)


# -- finding 1: device pointers reach host code -----------------------------------------------


@pytest.mark.parametrize("n", [4, 1 << 18], ids=["small", "1MiB"])
def test_cuda_aware_device_pointers_only_to_mpi(gpu, monkeypatch, n):
    """With a CUDA-aware MPI, device memory goes to MPI calls only: never to the shared-memory path or numpy.

    The stand-in's memory is PROT_NONE: a host read is a SIGSEGV (before the fix: the
    numpy view over the device pointer crashed in MPI or in ``SharedPath``). Small
    calls go to MPI directly (no copy); from the shared-memory threshold they are staged.
    """
    monkeypatch.setattr(world, "cuda_aware", True)
    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    shm_calls: list[str] = []
    for name in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"):
        real = getattr(SharedPath, name, None)
        if real is not None:

            def spy(self, *a, _real=real, _name=name, **k):
                if any(isinstance(x, DevicePointer) for x in a):
                    shm_calls.append(_name)
                return _real(self, *a, **k)

            monkeypatch.setattr(SharedPath, name, spy)
    problems: list[str] = []
    comm = MPI.COMM_WORLD.Dup()
    inner = MPIBackend(comm, 30.0, "standin-mpi")
    backend = MPIDeviceBackend(inner)
    try:
        x = gpu.array(np.full(n, RANK + 1, np.float32), stream=gpu.new_stream())
        before = copies()
        backend.all_reduce(darr(x), None, R.SUM, False)
        if n == 4 and copies() != before:
            problems.append(f"a small all_reduce with a CUDA-aware MPI made {copies() - before} copies")
        got = x.get()
        if not (got == SIZE * (SIZE + 1) / 2).all():
            problems.append(f"all_reduce: got {got[:4]}")
        b = gpu.array(np.full(n, RANK, np.int32))
        backend.broadcast(darr(b), None, 0, False)
        if not (b.get() == 0).all():
            problems.append(f"broadcast: got {b.get()[:4]}")
        ins = [gpu.array(np.full(n, RANK + r, np.float32)) for r in range(SIZE)]
        out = gpu.empty(n, np.float32)
        backend.reduce_scatter(darr(out), None, [darr(a) for a in ins], R.SUM, False)
        want = sum(r + RANK for r in range(SIZE))
        if not (out.get() == want).all():
            problems.append(f"reduce_scatter with separate inputs: got {out.get()[:4]}, expected {want}")
        outs = [gpu.empty(n, np.float32) for _ in range(SIZE)]
        backend.all_gather([darr(o) for o in outs], None, darr(x), False)
        for r, o in enumerate(outs):
            if not (o.get() == SIZE * (SIZE + 1) / 2).all():
                problems.append(f"all_gather[{r}]: got {o.get()[:4]}")
        if shm_calls:
            problems.append(f"device memory reached the shared-memory path: {shm_calls}")
    finally:
        inner.shutdown()
        comm.Free()
    fail_together(problems)


# -- finding 2: Work.wait orders the caller's current stream ------------------------------------


def test_wait_orders_the_current_stream_every_call(gpu, nccl_backend):
    """As torch's WorkNCCL::wait: each wait() makes the stream current then wait for the operation."""
    problems: list[str] = []
    backend, _ = nccl_backend()
    side = gpu.new_stream()
    x = gpu.array(np.full(8, RANK + 1, np.float32), stream=side)
    want = np.full(8, SIZE * (SIZE + 1) / 2, np.float32)
    work = backend.all_reduce(darr(x), None, R.SUM, True)
    gpu.current = gpu.DEFAULT
    work.wait()
    got = x.get()  # read on the current (default) stream
    if not np.array_equal(got, want):
        problems.append(f"after wait() on the default stream, a read there saw {got[:3]} (stale), expected {want[:3]}")
    other = gpu.new_stream()
    gpu.current = other
    y = gpu.array(np.full(8, RANK + 1, np.float32), stream=side)
    work2 = backend.all_reduce(darr(y), None, R.SUM, True)
    gpu.current = gpu.DEFAULT
    work2.wait()
    gpu.current = other
    work2.wait()  # a second wait, from another stream, orders that stream too
    got = y.get(other)
    if not np.array_equal(got, want):
        problems.append(f"the second wait() did not order the new current stream: read {got[:3]}")
    gpu.current = gpu.DEFAULT
    fail_together(problems)


def test_event_completes_only_after_the_gpu_ran(gpu, nccl_backend):
    """is_completed() is False until the stream runs; the Future's value is there only then."""
    problems: list[str] = []
    backend, _ = nccl_backend()
    x = gpu.array(np.full(4, RANK + 1, np.float64))
    work = backend.all_reduce(darr(x), None, R.SUM, True)
    if work.is_completed():
        problems.append("is_completed() before the stream ran")
    work.wait()
    gpu.synchronize()
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    if not work.is_completed():
        problems.append("is_completed() still False after the stream ran")
    fail_together(problems)


# -- finding 3: cupy without libnccl ---------------------------------------------------------------


def test_nccl_unavailable_falls_back_to_mpi(gpu, monkeypatch):
    """cupy imports without libnccl and says ``nccl.available = False``: NCCL is not available, MPI serves
    GPU arrays (docs/devices.md: backend None -> "NCCL when cupy's NCCL bindings and a GPU are present, else MPI")."""
    monkeypatch.setenv("MPIDIST_DEVICE_STAGING", "quiet")
    problems: list[str] = []
    with fake_cupy(available=False):
        if registry.nccl_available():
            problems.append("nccl_available() is True though cupy.cuda.nccl.available is False")
        if dist.is_backend_available("nccl"):
            problems.append("dist.is_backend_available('nccl') is True without libnccl")
        try:
            g = dist.new_group(backend="cpu:mpi,cuda:nccl")
        except Exception as exc:  # noqa: BLE001 - the failure is the finding
            problems.append(f"new_group(cpu:mpi,cuda:nccl) without libnccl raised {type(exc).__name__}: {exc}")
        else:
            x = np.full(3, RANK + 1.0)
            dist.all_reduce(x, group=g)
            if not (x == SIZE * (SIZE + 1) / 2).all():
                problems.append(f"host all_reduce on that group: {x}")
            dist.destroy_process_group(g)
        g = dist.new_group()  # backend None: NCCL if available, else MPI
        y = gpu.array(np.full(5, RANK + 1.0))
        try:
            dist.all_reduce(y, group=g)
            if not (y.get() == SIZE * (SIZE + 1) / 2).all():
                problems.append(f"GPU all_reduce on a backend=None group without libnccl: {y.get()}")
        except Exception as exc:  # noqa: BLE001 - the failure is the finding
            problems.append(f"GPU all_reduce on a backend=None group without libnccl raised {exc!r}")
        dist.destroy_process_group(g)
    with fake_cupy(available=True):
        if not registry.nccl_available():
            problems.append("nccl_available() is False with a loadable libnccl and a GPU")
    fail_together(problems)


def test_runtime_refuses_nccl_unavailable(gpu):
    problems: list[str] = []
    rt = StandinRuntime(gpu, StandinNccl(gpu, available=False))
    if getattr(rt.nccl, "available", True):
        problems.append("the stand-in's nccl says available")
    fail_together(problems)


# -- finding 5: a failure on one rank never leaves the others hanging --------------------------------


def test_allocation_failure_on_one_rank_raises_everywhere(gpu, nccl_backend):
    """rank 0 cannot allocate a temporary: it raises DistBackendError; the others do not hang, and the
    group is broken on every rank (the next call raises)."""
    problems: list[str] = []
    backend, _ = nccl_backend(timeout=3.0)
    n = 16
    out = gpu.empty(n * SIZE, np.float32)
    # an input overlapping the output, not in this rank's block: NCCL needs a temporary copy of it
    inp = DeviceArray(out.ptr + 4, (n,), np.dtype(np.float32), None, RANK, None, out, gpu.ops)
    if RANK == 0:
        gpu.fail_allocations(1)
    first: BaseException | None = None
    try:
        backend.all_gather_into_tensor(darr(out), None, inp, False)
        out.get()  # a host read: on a GPU it waits for the NCCL call
    except StandinHangError as exc:
        problems.append(f"a host read hung (a GPU would hang forever): {exc}")
    except Exception as exc:  # noqa: BLE001 - the kind is checked below
        first = exc
    gpu.fail_allocations(0)
    if RANK == 0 and not isinstance(first, DistBackendError):
        problems.append(f"rank 0's failed allocation raised {type(first).__name__}: {first}, not DistBackendError")
    deadline = time.monotonic() + 15
    while backend._broken is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if backend._broken is None:
        problems.append("the group is not marked broken")
    x = gpu.array(np.ones(2, np.float32))
    try:
        backend.all_reduce(darr(x), None, R.SUM, False)
        problems.append("a call after the failure did not raise")
    except DistBackendError:
        pass
    except Exception as exc:  # noqa: BLE001
        problems.append(f"a call after the failure raised {type(exc).__name__}: {exc}")
    fail_together(problems)


@pytest.mark.parametrize("form", ["NcclError", "KeyError"])
def test_watchdog_aborts_on_an_async_nccl_error(gpu, nccl_backend, form):
    """NCCL reports an asynchronous error (a peer died): the watchdog aborts the communicator by itself,
    and the next call raises DistBackendError on every rank. cupy < 14 raises KeyError(6) for
    ncclRemoteError (its error table lacks the code): caught the same way."""
    problems: list[str] = []
    backend, _ = nccl_backend()
    if form == "KeyError":

        def remote_error() -> None:
            raise KeyError("6 (ncclRemoteError)")

        backend._comm.check_async_error = remote_error
    else:
        backend._comm.async_error = "ncclRemoteError: remote process exited or there was a network error"
    deadline = time.monotonic() + 10
    while backend._broken is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if backend._broken is None or "ncclRemoteError" not in backend._broken:
        problems.append(f"the watchdog did not mark the group broken: {backend._broken!r}")
    if not backend._comm.aborted:
        problems.append("the communicator was not aborted")
    x = gpu.array(np.ones(2, np.float32))
    try:
        backend.all_reduce(darr(x), None, R.SUM, False)
        problems.append("a call after the async error did not raise")
    except DistBackendError:
        pass
    fail_together(problems)


def test_shutdown_waits_for_async_works_nobody_waited_for(gpu, nccl_backend):
    """destroy waits (within the timeout) for async calls still on the GPU instead of freeing under them."""
    problems: list[str] = []
    backend, _ = nccl_backend()
    x = gpu.array(np.full(4, RANK + 1, np.float32))
    work = backend.all_reduce(darr(x), None, R.SUM, True)
    event = work._event  # the program holds the Work but never waits for it
    runner = threading.Timer(0.5, gpu.synchronize_all)  # the GPU runs it a little later
    runner.start()
    comm = backend._comm
    backend.shutdown()
    runner.join(20)
    if not gpu.query(event):
        problems.append("shutdown returned before the GPU ran an async call")
    if comm.aborted:
        problems.append("shutdown aborted a call that completed within the timeout")
    if not work.is_completed():
        problems.append("the Work is not completed after shutdown")
    fail_together(problems)


@pytest.mark.mpi(min_size=2)
def test_shrink_group_aborts_the_old_nccl_communicator(gpu):
    """shrink_group gives the old group up: its NCCL communicator is aborted (not left running)."""
    problems: list[str] = []
    name = "standin_nccl"

    def make(options, pg_options):
        return NCCLBackend(options.comm, options.timeout.total_seconds(), options.group_id, runtime=StandinRuntime(gpu))

    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, make, extended_api=True, devices=["cuda"])
    g = dist.new_group(backend=f"cpu:mpi,cuda:{name}")
    x = gpu.array(np.ones(3, np.float32))
    dist.all_reduce(x, group=g)
    gpu.synchronize_all()
    old = backend_of(g, "cuda")
    new = None
    if RANK != SIZE - 1:  # only the remaining members call it
        new = dist.shrink_group([SIZE - 1], group=g)
        deadline = time.monotonic() + 5
        while not old._comm.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        if not old._comm.aborted or old._broken is None:
            problems.append(f"the old group's NCCL communicator was left running (broken={old._broken!r})")
    fail_together(problems)
    if new is not None:
        dist.destroy_process_group(new)


# -- finding 4: communicators and devices -----------------------------------------------------------


def test_more_ranks_than_gpus_is_a_clear_error_on_every_rank(gpu, nccl_backend):
    """One visible GPU, no device chosen: two ranks of a node would share it; every rank raises, naming them."""
    problems: list[str] = []
    try:
        backend, _ = nccl_backend(context=False, devices=1, current=0)
        if SIZE > 1:
            problems.append(f"{SIZE} ranks on one GPU were accepted (this rank uses cuda:{backend.device})")
    except DistBackendError as exc:
        text = str(exc)
        if SIZE == 1 or "cuda:0" not in text or f"group ranks {list(range(SIZE))}" not in text:
            problems.append(f"the error does not name the ranks and the GPU: {text}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"raised {type(exc).__name__}: {exc}")
    fail_together(problems)


def test_a_set_device_without_context_is_kept(gpu, nccl_backend):
    """torch.cuda.set_device(i) may create no context: the current device (not 0) is the program's choice."""
    problems: list[str] = []
    want = SIZE - RANK  # 1..SIZE, not the node-local rank (except where they meet)
    backend, _ = nccl_backend(context=False, devices=SIZE + 1, current=want)
    if backend.device != want:
        problems.append(f"the backend uses cuda:{backend.device}, the program chose cuda:{want}")
    fail_together(problems)


def test_a_rank_without_gpu_fails_every_rank_at_once(gpu, nccl_backend):
    """One rank sees no GPU: every rank raises DistBackendError at once (not one RuntimeError and a timeout)."""
    problems: list[str] = []
    bad = SIZE - 1
    start = time.monotonic()
    try:
        nccl_backend(timeout=20.0, devices=0 if RANK == bad else SIZE, context=False)
        problems.append("no error")
    except DistBackendError as exc:
        if RANK != bad and f"group rank(s) [{bad}] could not choose a GPU" not in str(exc):
            problems.append(f"the error does not name rank {bad}: {exc}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"raised {type(exc).__name__}: {exc}")
    if time.monotonic() - start > 10:
        problems.append(f"it took {time.monotonic() - start:.1f} s (the timeout, not an agreement)")
    fail_together(problems)


def test_unique_id_unsigned_char_form():
    """cupy 13 on aarch64 takes the id as a tuple of unsigned chars and raises OverflowError for a negative one."""
    problems: list[str] = []
    seen: list[Any] = []

    def ctor(size: int, uid: Any, rank: int) -> str:
        if not isinstance(uid, tuple):
            raise TypeError("Argument 'commId' has incorrect type (expected tuple, got bytes)")
        if any(c < 0 or c > 255 for c in uid):
            raise OverflowError("can't convert negative value to unsigned char")
        seen.append(uid)
        return "comm"

    data = bytes(range(128, 256))  # every byte > 127: negative as signed chars
    if make_communicator(ctor, 2, data, 0) != "comm" or seen != [tuple(data)]:
        problems.append(f"the unsigned form was not passed: {seen}")
    fail_together(problems)


# -- finding 6: torch's current stream; graph capture --------------------------------------------------


def test_current_stream_is_torchs_when_cupys_is_the_default(monkeypatch):
    """barrier() and Work.wait() order "the current stream": in a torch program that is torch's
    (``torch.cuda.stream(s)`` does not tell cupy)."""
    problems: list[str] = []
    fake_cp = types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda d: types.SimpleNamespace(ptr=0))
    )
    fake_torch = types.ModuleType("torch")
    fake_torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_initialized=lambda: True, current_stream=lambda d: types.SimpleNamespace(cuda_stream=0xBEEF)
    )
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    rt = CudaRuntime(fake_cp, None, ops=object())  # type: ignore[arg-type]
    if rt.current_stream(0) != 0xBEEF:
        problems.append(f"current_stream gave {rt.current_stream(0):#x}, torch's current stream is 0xbeef")
    fake_cp.cuda.get_current_stream = lambda d: types.SimpleNamespace(ptr=0x77)
    if rt.current_stream(0) != 0x77:
        problems.append("a cupy stream the program made current was not kept")
    fail_together(problems)


def test_graph_capture_makes_no_event_query_or_allocation(gpu, nccl_backend):
    """Inside a CUDA graph capture (global mode) the backend queries no event (nor does its watchdog) and
    allocates nothing: a call that needs a temporary raises a clear DistBackendError on every rank."""
    problems: list[str] = []
    backend, _ = nccl_backend()
    n = 8
    x = gpu.array(np.ones(n, np.float32))
    y = gpu.array(np.ones(n, np.float32))
    out = gpu.empty(n * SIZE, np.float32)
    inp = DeviceArray(out.ptr + 4, (n,), np.dtype(np.float32), None, RANK, None, out, gpu.ops)
    backend.all_reduce(darr(x), None, R.SUM, False)  # not run yet: its event is pending (tracked, watched)
    cap = gpu.new_stream()
    gpu.current = cap
    gpu.begin_capture(cap)
    try:
        try:
            backend.all_reduce(darr(y), None, R.SUM, False)
            backend.barrier(False)
        except Exception as exc:  # noqa: BLE001 - the finding
            problems.append(f"a captured call raised {type(exc).__name__}: {exc}")
        try:
            backend.all_gather_into_tensor(darr(out), None, inp, False)
            problems.append("a captured call that needs a temporary did not raise")
        except DistBackendError as exc:
            if "graph" not in str(exc):
                problems.append(f"unclear error: {exc}")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"a captured call needing a temporary raised {type(exc).__name__}: {exc}")
        time.sleep(0.3)  # the watchdog looks at the pending call meanwhile
    finally:
        broken = gpu.end_capture()
        gpu.current = gpu.DEFAULT
    if broken:
        problems.append(f"the capture was invalidated by {broken}")
    if backend._broken is not None:
        problems.append(f"the group broke: {backend._broken}")
    fail_together(problems)
