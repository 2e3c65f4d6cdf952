"""Unmodified torch programs use mpidist: ``import torch`` registers it (torch's entry points).

* ``import torch`` alone makes ``"mpidist"`` a backend and ``"mpi"`` available, without importing
  mpidist or starting MPI; ``MPIDIST_TORCH_AUTOLOAD=0`` leaves torch untouched, and
  ``import mpidist.torch`` then installs it all the same.
* A real Lightning job (``prepare_data``, validation, a checkpoint) under ``mpiexec -n 2`` with
  ``process_group_backend="mpi"`` and ``"mpidist"``, never importing mpidist, trains bitwise equal
  to the same job on gloo; also with ``fp16_compress_hook`` registered on CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import PROGRAMS, clean_env, mpiexec_command

pytest.importorskip("torch")

SIZE = MPI.COMM_WORLD.Get_size()

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.one_rank,  # starts its own processes, or checks this process's import of torch
]

PROBE = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import torch.distributed as dist
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    found = {
        "mpidist_imported": "mpidist" in sys.modules,
        "mpi4py_MPI_imported": "mpi4py.MPI" in sys.modules,
        "registered": getattr(dist.Backend, "MPIDIST", None),
        "mpi_available": dist.is_mpi_available(),
        "helper_wrapped": getattr(c10d._new_process_group_helper, "__mpidist__", False),
    }
    if "--import" in sys.argv:
        import mpidist.torch
        found["after_import"] = [getattr(dist.Backend, "MPIDIST", None), dist.is_mpi_available(),
                                 mpidist.torch.mpi_name_status()]
    import _mpidist_autoload
    start = time.perf_counter()
    _mpidist_autoload.install()  # once more: idempotent, and what it costs when everything is in place
    found["again_us"] = (time.perf_counter() - start) * 1e6
    print("RESULT " + json.dumps(found))
    """
)


def _probe(tmp_path: Path, *args: str, **env: str) -> dict:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    proc = subprocess.run(
        [sys.executable, str(path), *args], env=clean_env(**env), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


def test_import_torch_registers_mpidist_and_mpi_without_importing_mpidist(tmp_path):
    found = _probe(tmp_path)
    assert found["registered"] == "mpidist", found
    assert found["mpi_available"] is True, found
    assert found["helper_wrapped"] is True, found
    assert not found["mpidist_imported"], "import torch imported the mpidist package (30 ms): it must not"
    assert not found["mpi4py_MPI_imported"], "import torch loaded MPI"


def test_the_switch_leaves_torch_alone_and_import_mpidist_torch_still_installs(tmp_path):
    found = _probe(tmp_path, "--import", MPIDIST_TORCH_AUTOLOAD="0")
    assert found["registered"] is None and found["mpi_available"] is False, found
    assert not found["helper_wrapped"], found
    assert found["after_import"] == ["mpidist", True, "installed"], found


def test_a_failure_at_import_torch_is_a_warning_not_a_failed_import(monkeypatch):
    """torch makes an entry point's exception a failed ``import torch``: mpidist's warns instead."""
    import _mpidist_autoload

    def broken() -> None:
        raise RuntimeError("torch internals changed")

    monkeypatch.setattr(_mpidist_autoload, "install", broken)
    monkeypatch.delenv(_mpidist_autoload.SWITCH, raising=False)
    with pytest.warns(RuntimeWarning, match=r"could not register .*RuntimeError: torch internals changed"):
        _mpidist_autoload.load()


def _lightning_job(backend: str, tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / "-".join((backend, *extra))
    out.mkdir()
    cmd = [*mpiexec_command(2), sys.executable, str(PROGRAMS / "lightning_train.py"), backend, str(out), *extra]
    proc = subprocess.run(cmd, env=clean_env(PYTHONWARNINGS="ignore"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{backend}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    results = [json.loads(path.read_text()) for path in sorted(out.glob("result-*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1], f"{backend}: results {results}\n{proc.stdout[-3000:]}"
    assert (out / "ckpt" / "last.ckpt").is_file(), f"{backend}: no checkpoint in {out / 'ckpt'}"
    return sorted(results, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory) -> list[dict]:
    """The Lightning job on torch's gloo, the reference of both tests below (run once)."""
    pytest.importorskip("lightning")
    return _lightning_job("gloo", tmp_path_factory.mktemp("lightning"))


def test_lightning_trains_on_mpi_and_mpidist_bitwise_equal_to_gloo_without_importing_mpidist(tmp_path, gloo_job):
    gloo = gloo_job
    for backend in ("mpi", "mpidist"):
        runs = _lightning_job(backend, tmp_path)
        for got, ref in zip(runs, gloo):
            assert got["backend"] == backend, got["backend"]
            assert not got["mpidist_imported_before_fit"], "the program imported mpidist before fit"
            assert got["weights"] == ref["weights"], f"{backend}: rank {got['rank']}'s weights differ from gloo's"
            assert got["val_loss"] == ref["val_loss"], (backend, got["val_loss"], ref["val_loss"])
        assert runs[0]["weights"] == runs[1]["weights"], f"{backend}: the ranks' weights differ"


# Lightning's registering of the hook is torch's and Lightning's code: under the second library the fp16 hook's
# MPI path is test_torch_backend.py's DDP comm hook tests, and Lightning on that library the test above
@pytest.mark.one_library
def test_lightning_with_a_ddp_comm_hook_on_cpu_matches_gloo(tmp_path, gloo_job):
    """docs/torch-backend.md's strategy subclass registers fp16_compress_hook on CPU (Lightning does on CUDA only)."""
    gloo = _lightning_job("gloo", tmp_path, "fp16")
    plain = gloo_job
    runs = _lightning_job("mpi", tmp_path, "fp16")
    for got, ref in zip(runs, gloo):
        assert got["hooks"] == ["fp16_compress_hook"], got["hooks"]
        assert got["weights"] == ref["weights"], f"rank {got['rank']}'s weights differ from gloo's with the hook"
    assert runs[0]["weights"] != plain[0]["weights"], "the hook changed nothing: was it registered?"
