"""Where the benchmark's buffers live: numpy arrays, torch CPU tensors, cupy arrays on a GPU, or the device stand-in.

Each kind is a small namespace with the same methods, so the cases never ask what
kind of array they hold: ``empty`` allocates, ``clear``/``upload``/``download`` set
and read values for ``--check``, ``synchronize`` ends a timed batch (a GPU's work is asynchronous),
and ``raw`` gives the bytes raw mpi4py is handed (``None`` in ``raw_missing`` means
raw mpi4py can take these arrays; otherwise it says why not).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["DEVICES", "HostArrays", "TorchArrays", "CupyArrays", "StandInArrays", "open_device"]

#: the ``--device`` choices
DEVICES = ("cpu", "torch", "cuda", "standin")


class HostArrays:
    """numpy arrays in host memory (``--device cpu``)."""

    name = "cpu"
    describe = "numpy arrays in host memory"
    raw_missing: str | None = None
    xp = np

    def empty(self, k: int, dtype: np.dtype) -> Any:
        return np.empty(k, dtype)

    def upload(self, dst: Any, values: np.ndarray) -> None:
        dst[...] = values

    def clear(self, a: Any) -> None:
        a[...] = 0

    def download(self, a: Any) -> np.ndarray:
        return np.array(a, copy=True)

    def synchronize(self) -> None:
        pass

    def typed(self, a: Any) -> Any:
        """The array raw mpi4py's AVG divides in place (the array itself)."""
        return a

    def raw(self, a: Any) -> Any:
        """The buffer raw mpi4py gets: the array's bytes (mpi4py knows no bfloat16 buffer format)."""
        return a.view(np.uint8)


class TorchArrays(HostArrays):
    """torch CPU tensors (``--device torch``, ``--torch``): mpidist's calls get the tensors, raw mpi4py their memory.

    Values are set and read through the tensors' numpy views (``arrays.host.host_view``,
    which also covers bfloat16), so raw mpi4py runs on the same memory.
    """

    name = "torch"
    describe = "torch CPU tensors (raw mpi4py on their memory)"

    def __init__(self) -> None:
        import torch

        from ..arrays.host import host_view, torch_dtypes

        self._torch = torch
        self._view = host_view
        self._dtypes = {np.dtype(v): k for k, v in torch_dtypes(torch).items()}

    def empty(self, k: int, dtype: np.dtype) -> Any:
        return self._torch.empty(k, dtype=self._dtypes[np.dtype(dtype)])

    def upload(self, dst: Any, values: np.ndarray) -> None:
        self._view(dst)[...] = values

    def clear(self, a: Any) -> None:
        a.zero_()

    def download(self, a: Any) -> np.ndarray:
        return np.array(self._view(a), copy=True)

    def typed(self, a: Any) -> Any:
        return self._view(a)

    def raw(self, a: Any) -> Any:
        return self._view(a).view(np.uint8)


class StandInArrays(HostArrays):
    """``mpidist.testing.HostCudaArray`` (``--device standin``): host memory that mpidist treats as GPU memory.

    mpidist takes its device path (over MPI: staged through host memory), so the
    command's device handling runs without a GPU. Raw mpi4py runs on the host
    memory underneath.
    """

    name = "standin"
    describe = "mpidist.testing.HostCudaArray (host memory through mpidist's device path)"

    def __init__(self) -> None:
        os.environ.setdefault("MPIDIST_DEVICE_STAGING", "quiet")  # staging is the point here: no warning
        from ..testing import HostCudaArray

        self._cls = HostCudaArray

    def empty(self, k: int, dtype: np.dtype) -> Any:
        return self._cls(np.empty(k, dtype))

    def upload(self, dst: Any, values: np.ndarray) -> None:
        dst.host[...] = values

    def clear(self, a: Any) -> None:
        a.host[...] = 0

    def download(self, a: Any) -> np.ndarray:
        return np.array(a.host, copy=True)

    def typed(self, a: Any) -> Any:
        return a.host

    def raw(self, a: Any) -> Any:
        return a.host.view(np.uint8)


class CupyArrays:
    """cupy arrays on this rank's GPU (``--device cuda``): node-local rank modulo the GPUs it sees."""

    name = "cuda"

    def __init__(self, cupy: Any, local_rank: int) -> None:
        self.xp = cupy
        count = cupy.cuda.runtime.getDeviceCount()
        self.index = local_rank % count
        self.device = cupy.cuda.Device(self.index)
        self.device.use()
        props = cupy.cuda.runtime.getDeviceProperties(self.index)
        gpu = props.get("name", b"GPU")
        gpu = gpu.decode() if isinstance(gpu, bytes) else str(gpu)
        self.describe = f"cupy arrays on GPU {self.index} of rank 0's node ({gpu})"
        self.raw_missing: str | None = None  # decided once MPI runs: see check_cuda_aware

    def check_cuda_aware(self) -> None:
        """Decide whether raw mpi4py can take device buffers (the MPI library must be CUDA-aware)."""
        try:
            from ..arrays.device import mpi_cuda_aware  # mpidist's probe (MPIX_Query_cuda_support, MPIDIST_CUDA_AWARE)

            aware = mpi_cuda_aware()
        except Exception:  # noqa: BLE001 - a probe that cannot run means: not known to be CUDA-aware
            aware = os.environ.get("MPIDIST_CUDA_AWARE") == "1"
        if not aware:
            self.raw_missing = "the MPI library is not CUDA-aware, so raw mpi4py cannot take device buffers"

    def empty(self, k: int, dtype: np.dtype) -> Any:
        return self.xp.empty(k, dtype)

    def upload(self, dst: Any, values: np.ndarray) -> None:
        dst.set(values)
        self.synchronize()

    def clear(self, a: Any) -> None:
        a.fill(0)

    def download(self, a: Any) -> np.ndarray:
        self.synchronize()
        return self.xp.asnumpy(a)

    def synchronize(self) -> None:
        self.device.synchronize()

    def typed(self, a: Any) -> Any:
        return a

    def raw(self, a: Any) -> Any:
        return a.view(self.xp.uint8)


def find_cupy() -> tuple[Any, str]:
    """Return ``(cupy, "")`` if a CUDA device is usable here, else ``(None, why not)``."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a cupy built for a CUDA that is missing
        return None, f"cupy cannot be imported ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, no device
        return None, f"cupy finds no CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return None, "cupy finds no CUDA device"
    return cupy, ""


def open_device(name: str, comm: Any) -> tuple[Any, str]:
    """The array namespace for ``--device name``, or ``(None, why not)`` (decided on every rank together).

    ``comm`` is the world communicator (mpi4py); choosing the GPU happens before
    ``init_process_group``, since a device backend may bind to the current device.
    """
    if name == "cpu":
        return HostArrays(), ""
    if name == "torch":
        try:
            return TorchArrays(), ""
        except ImportError as exc:
            return None, f"--device torch needs torch ({exc}): pip install torch"
    if name == "standin":
        try:
            return StandInArrays(), ""
        except ImportError as exc:  # mpidist.testing is a pytest plugin: it needs pytest
            return None, f"--device standin needs mpidist.testing, which needs pytest ({exc})"
    cupy, why = find_cupy()
    whys = comm.allgather(why)
    if any(whys):
        bad = [r for r, w in enumerate(whys) if w]
        where = "" if len(bad) == comm.Get_size() else f" on rank(s) {bad}"
        first = next(w for w in whys if w)
        return None, f"--device cuda needs cupy and a CUDA device{where}: {first} (install mpidist[gpu])"
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank = local.Get_rank()
    local.Free()
    return CupyArrays(cupy, local_rank), ""
