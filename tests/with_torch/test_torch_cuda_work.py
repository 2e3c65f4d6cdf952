"""The torch backend's Work around a GPU operation, on the stand-in that fails like a GPU (issue 34, finding 2).

The Future's value (the output tensors) is there only once the GPU has run the
operation: on the stand-in a stream runs only when ordered, so a Future completed
at issue would show here as completed while the operation still sits in its stream.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

pytest.importorskip("torch")

import mpidist as dist  # noqa: E402
from mpidist.arrays.device import from_cuda_interface  # noqa: E402
from mpidist.backends.nccl import NCCLBackend  # noqa: E402
from mpidist.testing.gpu import GpuStandin  # noqa: E402
from mpidist.testing.gpu_nccl import StandinRuntime  # noqa: E402
from mpidist.torch._work import TorchWork  # noqa: E402

from helpers import fail_together  # noqa: E402

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.timeout(120)


def test_future_completes_only_after_the_gpu_ran():
    problems: list[str] = []
    gpu = GpuStandin(hang_s=20.0, device=RANK)  # one GPU per rank
    comm = MPI.COMM_WORLD.Dup()
    backend = NCCLBackend(comm, 30.0, "standin-torch", runtime=StandinRuntime(gpu))
    try:
        x = gpu.array(np.full(4, RANK + 1, np.float32))
        inner = backend.all_reduce(from_cuda_interface(x, "test", "x"), None, dist.ReduceOp.SUM, True)
        work = TorchWork([inner], ["out"], "all_reduce")
        work._taken = True  # the test holds it: nothing for the engine to keep
        driver = threading.Thread(target=work.run, daemon=True)  # what the engine thread does
        driver.start()
        time.sleep(0.3)
        if work.is_completed():
            problems.append("the Work completed (its Future too) before the GPU ran the operation")
        gpu.synchronize_all()  # the GPU runs it
        driver.join(20)
        if driver.is_alive() or not work.is_completed() or work.exception() is not None:
            problems.append(f"after the GPU ran: alive={driver.is_alive()}, exception={work.exception()!r}")
        got = x.get()
        if not (got == SIZE * (SIZE + 1) / 2).all():
            problems.append(f"the output after completion: {got}")
    finally:
        gpu.synchronize_all()
        backend.shutdown()
        comm.Free()
    fail_together(problems)
