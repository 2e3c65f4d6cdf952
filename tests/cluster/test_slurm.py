"""mpidist programs started by a real Slurm (one node): srun under each --mpi plugin, salloc, sbatch, mpidistrun.

    cd /work/main && .venv/bin/python -m pytest tests/cluster/test_slurm.py -v           # MPICH
    cd /work/main && .venv-openmpi/bin/python -m pytest tests/cluster/test_slurm.py -v   # Open MPI

Not under mpiexec. The module starts Slurm with ``tools/cluster/slurm.sh up`` (root; it installs
Debian's packages the first time) and skips with that script's reason where it cannot. Each test
launches ``tests/cluster/progs/probe.py`` (one JSON per process: its world, torchrun's variables at
import, an all_reduce or one DDP step) and checks what the library must do:

* MPICH: every ``srun --mpi`` (none, pmi2, pmix) forms ONE world of all the step's tasks, with RANK =
  SLURM_PROCID, LOCAL_RANK = SLURM_LOCALID and LOCAL_WORLD_SIZE = the step's tasks on the node.
* Open MPI: ``--mpi=pmix`` forms the world; ``--mpi=none``/``pmi2`` (where Open MPI would make every
  task a world of one) fail on every task with a message naming ``--mpi=pmix``.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from slurm_support import (
    BIN,
    JOB_NAME,
    PROBE,
    PYTHON,
    cancel_our_jobs,
    mpi_library,
    probes,
    procid_by_pid,
    recording_rc,
    run,
    slurm_up,
    task_exit_codes,
    task_files,
    task_stderr,
    world_problems,
)

LIB = mpi_library()
#: the --mpi each library is started with where the test is not about the plugin
PLUGIN = "pmix" if LIB == "openmpi" else "pmi2"
#: plugins under which a world forms; under the others the library must refuse (Open MPI speaks only PMIx)
FORMS_WORLD = {"mpich": {"none", "pmi2", "pmix"}, "openmpi": {"pmix"}}.get(LIB, {"none", "pmi2", "pmix"})
#: the DDP program: MPICH under pmi2 and none (mpidist connects it), Open MPI under pmix
TORCH_PLUGINS = ["pmix"] if LIB == "openmpi" else ["pmi2", "none"]
SRUN = ["srun", "-J", JOB_NAME, "--kill-on-bad-exit=0"]


@pytest.fixture(scope="module", autouse=True)
def slurm():
    """A running single-node Slurm; the module skips with slurm.sh's reason where there cannot be one."""
    rc, output = slurm_up()
    if rc == 77:
        pytest.skip(output.splitlines()[-1] if output else "tools/cluster/slurm.sh up: exit 77")
    if rc != 0:
        pytest.fail(f"tools/cluster/slurm.sh up failed with exit code {rc}:\n{output}", pytrace=False)
    yield
    cancel_our_jobs()


@pytest.fixture(autouse=True)
def _cancel_leftovers():
    """A test that timed out may leave its job behind: cancel it before the next test waits for CPUs."""
    yield
    cancel_our_jobs()


def probe(folder: Path, *args: str) -> list[str]:
    return [PYTHON, str(PROBE), "--out", str(folder), "--timeout", "60", *args]


def expect_world(
    r,
    n: int,
    *,
    local_world: int | None = None,
    by_task: bool = True,
    torch: bool = False,
    torchrun_extras: bool = False,
) -> None:
    """Assert ``r`` ran one world of ``n`` (see slurm_support.world_problems); on failure show everything."""
    found = probes(r.folder)
    procids = procid_by_pid(r.folder) if by_task else None
    problems = world_problems(
        found,
        n,
        local_world=n if local_world is None else local_world,
        procids=procids,
        torch=torch,
        torchrun_extras=torchrun_extras,
    )
    if r.rc != 0:
        problems.insert(0, f"the launcher exited with {r.rc}")
    assert not problems, f"[{LIB}] " + "\n".join(problems) + "\n\n" + r.describe()


def expect_refused(r, n: int) -> None:
    """Assert every one of the ``n`` tasks failed with a message naming --mpi=pmix, none reported a world."""
    codes, errs, found = task_exit_codes(r.folder), task_stderr(r.folder), probes(r.folder)
    problems = []
    if found:
        problems.append(
            f"{len(found)} process(es) reported a world (sizes {[p.get('size') for p in found]}) instead of refusing"
        )
    for t in range(n):
        if codes.get(t, 0) == 0:
            problems.append(f"task {t} exited with {codes.get(t, 'no exit code recorded')}, expected non-zero")
        if "--mpi=pmix" not in errs.get(t, ""):
            problems.append(f"task {t}: its stderr does not name --mpi=pmix")
    assert not problems, f"[{LIB}] " + "\n".join(problems) + "\n\n" + r.describe()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("plugin", ["none", "pmi2", "pmix"])
def test_srun_4_tasks(plugin, tmp_path):
    """srun -n 4 --mpi=<plugin> python probe.py: one world of 4 (or, for Open MPI without PMIx, a clear refusal)."""
    cmd = [*SRUN, f"--mpi={plugin}", "-n", "4", *task_files(tmp_path)]
    if plugin in FORMS_WORLD:
        expect_world(run([*cmd, *probe(tmp_path)], 90, tmp_path), 4)
    else:
        expect_refused(run([*cmd, *recording_rc(tmp_path, probe(tmp_path))], 90, tmp_path), 4)


@pytest.mark.timeout(150)
def test_srun_3_tasks(tmp_path):
    """An odd step: srun -n 3 on a node of 8 CPUs; LOCAL_WORLD_SIZE is 3."""
    r = run([*SRUN, f"--mpi={PLUGIN}", "-n", "3", *task_files(tmp_path), *probe(tmp_path)], 90, tmp_path)
    expect_world(r, 3)


@pytest.mark.timeout(150)
def test_one_task_step_in_two_task_allocation(tmp_path):
    """salloc -n 2 srun -n 1: a world of 1 whose LOCAL_WORLD_SIZE is the step's 1, not the allocation's 2."""
    step = ["srun", f"--mpi={PLUGIN}", "-n", "1", *task_files(tmp_path), *probe(tmp_path)]
    r = run(["salloc", "-J", JOB_NAME, "-n", "2", *step], 90, tmp_path)
    expect_world(r, 1, local_world=1)


@pytest.mark.timeout(150)
def test_mpidistrun_in_salloc(tmp_path):
    """salloc -n 2 mpidistrun --nproc-per-node 2 probe.py: one world of 2, torchrun's variables set."""
    r = run(
        ["salloc", "-J", JOB_NAME, "-n", "2", BIN / "mpidistrun", "--nproc-per-node", "2", *probe(tmp_path)[1:]],
        90,
        tmp_path,
    )
    expect_world(r, 2, by_task=False, torchrun_extras=True)


@pytest.mark.timeout(150)
def test_mpiexec_in_salloc(tmp_path):
    """salloc -n 2 mpiexec -n 2 probe.py, the wheel's own launcher inside an allocation: hydra starts its
    proxy with srun, so every rank sees SLURM_PROCID=0 and SLURM_NTASKS=1; the world and RANK come from
    PMI (MPICH) / Open MPI's launcher, not from Slurm's variables."""
    root = ["--allow-run-as-root", "--oversubscribe"] if LIB == "openmpi" else []
    r = run(["salloc", "-J", JOB_NAME, "-n", "2", BIN / "mpiexec", "-n", "2", *root, *probe(tmp_path)], 90, tmp_path)
    expect_world(r, 2, by_task=False)


@pytest.mark.timeout(90)
def test_mpidistrun_dry_run_in_salloc(tmp_path):
    """mpidistrun --dry-run inside an allocation names srun with this library's --mpi."""
    r = run(
        ["salloc", "-J", JOB_NAME, "-n", "2", BIN / "mpidistrun", "--dry-run", "--nproc-per-node", "2", PROBE, "--x"],
        60,
    )
    assert r.rc == 0, r.describe()
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert lines, r.describe()
    words = shlex.split(lines[-1])
    launcher = next((w for w in words if "=" not in w), "")
    name = Path(launcher).name
    problems = []
    if name != "srun":  # this Slurm has both pmi2 and pmix: srun can start either library
        problems.append(f"the launcher is {launcher!r}, expected srun (inside an allocation)")
    elif f"--mpi={PLUGIN}" not in words:
        problems.append(f"srun without --mpi={PLUGIN} (what {LIB} speaks)")
    if not any(words[i] in ("-n", "--ntasks", "-np") and words[i + 1] == "2" for i in range(len(words) - 1)):
        problems.append("no -n 2 in the command")
    tail = [PYTHON, "-m", "mpidist", str(PROBE), "--x"]
    if words[-len(tail) :] != tail:
        problems.append(f"the command does not end with {shlex.join(tail)}")
    assert not problems, "\n".join(problems) + "\n\n" + r.describe()


def _sbatch(tmp_path: Path, ntasks: int, *probe_args: str, seconds: int):
    """sbatch --wait a script whose one step is ``srun python probe.py``; MPICH's step uses Slurm's
    MpiDefault (none), Open MPI's ``--mpi=pmix``."""
    plugin = ["--mpi=pmix"] if LIB == "openmpi" else []
    step = ["srun", *plugin, *task_files(tmp_path), *probe(tmp_path, *probe_args)]
    script = tmp_path.parent / f"{tmp_path.name}-job.sh"
    script.write_text(
        '#!/bin/bash\nset -e\necho "batch step: SLURM_JOB_ID=$SLURM_JOB_ID SLURM_NTASKS=$SLURM_NTASKS"\n'
        f"{shlex.join(step)}\n"
    )
    r = run(
        [
            "sbatch",
            "--wait",
            "-J",
            JOB_NAME,
            "-n",
            str(ntasks),
            "-o",
            tmp_path / "job.out",
            "-e",
            tmp_path / "job.err",
            script,
        ],
        seconds,
        tmp_path,
    )
    jobs = [w.split()[-1] for w in r.stdout.splitlines() if w.startswith("Submitted batch job")]
    if jobs:
        show = run(["scontrol", "show", "job", jobs[0]], 20)
        r.notes.append("--- scontrol show job ---\n" + show.stdout + show.stderr)
    return r


@pytest.mark.timeout(150)
def test_sbatch(tmp_path):
    """sbatch -n 4 with ``srun python probe.py``: the job exits 0 and its step is one world of 4."""
    r = _sbatch(tmp_path, 4, seconds=110)
    expect_world(r, 4)


@pytest.mark.timeout(240)
def test_sbatch_torch(tmp_path):
    """sbatch -n 2 with ``srun python probe.py --torch``: one DDP step over init_process_group("mpidist")."""
    r = _sbatch(tmp_path, 2, "--torch", seconds=200)
    expect_world(r, 2, torch=True)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("plugin", ["none", "pmi2", "pmix"])
def test_python_m_mpidist(plugin, tmp_path):
    """srun -n 2 --mpi=<plugin> python -m mpidist probe.py: one world of 2 with torchrun's variables
    (GROUP_RANK, MASTER_ADDR) set, or for Open MPI without PMIx a clear refusal."""
    cmd = [*SRUN, f"--mpi={plugin}", "-n", "2", *task_files(tmp_path)]
    prog = [PYTHON, "-m", "mpidist", *probe(tmp_path)[1:]]
    if plugin in FORMS_WORLD:
        expect_world(run([*cmd, *prog], 90, tmp_path), 2, torchrun_extras=True)
    else:
        expect_refused(run([*cmd, *recording_rc(tmp_path, prog)], 90, tmp_path), 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plugin", TORCH_PLUGINS)
def test_srun_torch_ddp(plugin, tmp_path):
    """srun -n 2 --mpi=<plugin> python probe.py --torch: the DDP gradient is the mean on every rank."""
    r = run([*SRUN, f"--mpi={plugin}", "-n", "2", *task_files(tmp_path), *probe(tmp_path, "--torch")], 200, tmp_path)
    expect_world(r, 2, torch=True)


@pytest.mark.timeout(150)
def test_batch_script_itself_is_a_world_of_one(tmp_path):
    """python run by an ``sbatch -n 4`` script itself (no srun) is one process: a world of one, not task 0 of
    4 waiting for three others (the allocation's SLURM_NTASKS=4 describes the job, not a step)."""
    script = tmp_path.parent / f"{tmp_path.name}-alone.sh"
    script.write_text(f"#!/bin/bash\nset -e\n{shlex.join(probe(tmp_path))}\n")
    r = run(
        ["sbatch", "--wait", "-J", JOB_NAME, "-n", "4", "-o", tmp_path / "job.out", "-e", tmp_path / "job.err", script],
        110,
        tmp_path,
    )
    found = probes(tmp_path)
    sizes = [(p.get("rank"), p.get("size"), p.get("sum_ok"), p["env"].get("WORLD_SIZE")) for p in found]
    assert r.rc == 0 and sizes == [(0, 1, True, None)], f"[{LIB}] {sizes}\n\n" + r.describe()
