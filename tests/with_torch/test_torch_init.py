"""Starting torch.distributed on mpidist: every way a torch program starts its default group.

Under mpiexec with nothing set (rank, size and the rendezvous come from MPI),
through torch's env://, tcp://, file:// and ``store=`` paths, with ``timeout=``
honoured, with the name ``"mpi"``, and destroyed then started again. The last test
starts plain ``python`` processes (no launcher) that form a world through torch's
env:// variables, where ``init_process_group("mpidist")`` starts mpidist itself.
"""

from __future__ import annotations

import os
import re
import textwrap
from datetime import timedelta

import pytest
from mpi4py import MPI

from mpidist.launch.boot import launched_by_mpi
from mpidist.launch.environment import fill_environment

from helpers import clean_env, fail_together, free_port, needs_pmi1, run_plain_world

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")
mpidist_torch = pytest.importorskip("mpidist.torch")

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT")

pytestmark = pytest.mark.timeout(120)
#: these start with nothing set, so they need the launcher's own variables (the suite runs under mpiexec)
under_launcher = pytest.mark.skipif(not launched_by_mpi(), reason="needs an MPI launcher (run under mpiexec)")


@pytest.fixture
def fresh():
    """No torch default group before or after; torchrun's variables removed (restored afterwards)."""
    if tdist.is_initialized():
        pytest.skip("torch.distributed was left initialized by another test")
    saved = dict(os.environ)
    for var in TORCHRUN_VARS + RENDEZVOUS_VARS:
        os.environ.pop(var, None)
    try:
        yield
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)  # init fills torchrun's variables: take them away again


def _sum_check(what: str) -> list[str]:
    t = torch.tensor([RANK + 1.0])
    tdist.all_reduce(t)
    expected = SIZE * (SIZE + 1) / 2
    return [] if t.item() == expected else [f"{what}: all_reduce gave {t.item()}, expected {expected}"]


@under_launcher
def test_nothing_set_under_mpiexec(fresh):
    tdist.init_process_group("mpidist", timeout=timedelta(seconds=42))
    problems = _sum_check("env-free init")
    if (tdist.get_rank(), tdist.get_world_size()) != (RANK, SIZE):
        problems.append(f"rank/size {tdist.get_rank()}/{tdist.get_world_size()}")
    if tdist.group.WORLD.mpidist_group.timeout != timedelta(seconds=42):
        problems.append(f"timeout {tdist.group.WORLD.mpidist_group.timeout}")
    # torchrun's variables now exist, derived from MPI, for code that reads them
    env = {v: os.environ.get(v) for v in TORCHRUN_VARS + RENDEZVOUS_VARS}
    if env["RANK"] != str(RANK) or env["WORLD_SIZE"] != str(SIZE) or env["LOCAL_RANK"] != str(RANK):
        problems.append(f"environment {env}")  # one node: the local rank is the rank
    fail_together(problems)


@under_launcher
def test_the_variables_the_user_set_are_kept(fresh, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "7")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    tdist.init_process_group("mpidist", timeout=timedelta(seconds=60))  # a failure must not wait torch's 30 min
    problems = _sum_check("user's variables")
    if os.environ["LOCAL_RANK"] != "7" or os.environ["MASTER_ADDR"] != "127.0.0.1":
        problems.append(f"overrode the user's values: {os.environ['LOCAL_RANK']} {os.environ['MASTER_ADDR']}")
    if os.environ.get("RANK") != str(RANK):  # what the user left unset was filled
        problems.append(f"RANK {os.environ.get('RANK')}")
    fail_together(problems)


def test_fill_environment_never_overrides():
    environ = {"MASTER_PORT": "1234", "LOCAL_RANK": " 5 ", "RANK": ""}
    values = {"MASTER_PORT": "999", "LOCAL_RANK": "0", "RANK": "3", "WORLD_SIZE": "4"}
    added = fill_environment(values, environ)
    assert added == {"RANK": "3", "WORLD_SIZE": "4"}  # an empty value counts as unset
    assert environ == {"MASTER_PORT": "1234", "LOCAL_RANK": " 5 ", "RANK": "3", "WORLD_SIZE": "4"}


def test_tcp_file_and_store_init_then_init_again(fresh, tmp_path):
    tmpdir = MPI.COMM_WORLD.bcast(str(tmp_path) if RANK == 0 else None, root=0)
    port = MPI.COMM_WORLD.bcast(free_port() if RANK == 0 else None, root=0)
    problems = []
    forms = {
        "tcp://": {"init_method": f"tcp://127.0.0.1:{port}"},
        "file://": {"init_method": f"file://{tmpdir}/rendezvous"},
        "store=": {"store": tdist.FileStore(f"{tmpdir}/store", SIZE)},
    }
    for name, kwargs in forms.items():
        tdist.init_process_group("mpidist", rank=RANK, world_size=SIZE, timeout=timedelta(seconds=50), **kwargs)
        problems += _sum_check(name)
        if tdist.get_backend() != "mpidist" or tdist.group.WORLD.mpidist_group.timeout != timedelta(seconds=50):
            problems.append(f"{name}: backend {tdist.get_backend()}")
        tdist.destroy_process_group()
        if tdist.is_initialized():
            problems.append(f"{name}: still initialized after destroy_process_group")
        MPI.COMM_WORLD.barrier()
    fail_together(problems)


def test_the_mpi_name_as_the_default_group(fresh):
    if not mpidist_torch.mpi_name_status().startswith("installed"):
        pytest.skip(f"the 'mpi' name is not served here: {mpidist_torch.mpi_name_status()}")
    tdist.init_process_group("mpi", timeout=timedelta(seconds=33))
    problems = _sum_check("'mpi'")
    if tdist.get_backend() != "mpi" or not tdist.is_mpi_available():
        problems.append(f"get_backend() {tdist.get_backend()}, is_mpi_available() {tdist.is_mpi_available()}")
    if tdist.group.WORLD.mpidist_group.timeout != timedelta(seconds=33):
        problems.append(f"timeout {tdist.group.WORLD.mpidist_group.timeout}")
    fail_together(problems)


def test_the_mpi_default_group_has_a_real_store_for_side_groups(fresh):
    """torch gives its MPI default group a placeholder store; on mpidist it is the default store, so
    gloo side groups (Lightning's prepare_data barrier) and store-based barriers work on "mpi"."""
    if not mpidist_torch.mpi_name_status().startswith("installed"):
        pytest.skip(f"the 'mpi' name is not served here: {mpidist_torch.mpi_name_status()}")
    tdist.init_process_group("mpi")
    problems = []
    store = tdist.distributed_c10d._get_default_store()
    store.set(f"from/{RANK}", str(RANK * 7))
    store.wait([f"from/{r}" for r in range(SIZE)], timedelta(seconds=30))
    got = [int(store.get(f"from/{r}")) for r in range(SIZE)]
    if got != [r * 7 for r in range(SIZE)]:
        problems.append(f"the default store gave {got}")
    if store.add("count", 1) < 1:
        problems.append("add on the default store")
    side = tdist.new_group(backend="gloo")
    t = torch.tensor([RANK + 1.0, 2.0])
    tdist.all_reduce(t, group=side)
    if t.tolist() != [SIZE * (SIZE + 1) / 2, 2.0 * SIZE]:
        problems.append(f"all_reduce on the gloo side group gave {t.tolist()}")
    if tdist.get_backend(side) != "gloo":
        problems.append(f"side group backend {tdist.get_backend(side)}")
    odd = tdist.new_group([r for r in range(SIZE) if r % 2], backend="gloo") if SIZE > 1 else None
    if RANK % 2:
        y = torch.ones(1)
        tdist.all_reduce(y, group=odd)
        if y.item() != SIZE // 2:
            problems.append(f"all_reduce on the odd ranks' gloo group gave {y.item()}")
    tdist.barrier(group=side)
    problems += _sum_check("'mpi' after the side groups")
    fail_together(problems)


CHILD = textwrap.dedent(
    """
    import json
    import mpidist.torch
    import torch, torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("mpidist", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    odd = dist.new_group([r for r in range(size) if r % 2])
    y = torch.ones(2)
    if rank % 2:
        dist.all_reduce(y, group=odd)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    model(torch.full((1, 2), float(rank))).sum().backward()
    grad = model.module.weight.grad.tolist()
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": rank, "size": size, "sum": t.item(), "odd": y.tolist(), "grad": grad}))
    """
)


@pytest.mark.one_rank  # starts its own processes
@needs_pmi1
def test_plain_processes_form_a_world_through_env(tmp_path):
    n, port = 2, free_port()
    envs = [clean_env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(n)]
    results = run_plain_world(CHILD, envs, [[]] * n, tmp_path, timeout=100)
    for r, got in enumerate(results):
        assert (got["rank"], got["size"], got["sum"]) == (r, n, 3.0)
        assert got["odd"] == [1.0, 1.0]  # rank 1 alone in the odd group
        assert got["grad"] == [[0.5, 0.5]]  # DDP averages the gradients [0, 0] and [1, 1]


MIXED = textwrap.dedent(
    """
    import json
    import mpidist.torch
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")  # torch's default group on gloo; mpidist is not started
    rank, size = dist.get_rank(), dist.get_world_size()
    error = ""
    if rank == 0:  # a first mpidist group of some ranks only: mpidist cannot start on them alone
        try:
            dist.new_group([0], backend="mpidist", use_local_synchronization=True)
        except RuntimeError as exc:
            error = str(exc)
    everyone = dist.new_group(backend="mpidist")  # starts mpidist on every rank
    t = torch.tensor([rank + 1.0, 2.0 * rank])
    dist.all_reduce(t, group=everyone)
    ref = torch.tensor([rank + 1.0, 2.0 * rank])
    dist.all_reduce(ref)  # on gloo
    last_two = dist.new_group([size - 2, size - 1], backend="mpidist")
    y = torch.full((2,), float(rank))
    if rank >= size - 2:
        dist.all_reduce(y, group=last_two)
    backends = [str(dist.get_backend()), str(dist.get_backend(everyone))]
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": rank, "sum": t.tolist(), "gloo": ref.tolist(), "last_two": y.tolist(),
                                  "backends": backends, "error": error}))
    """
)


@pytest.mark.one_rank  # starts its own processes
@needs_pmi1
def test_mpidist_groups_beside_a_gloo_default_group(tmp_path):
    """torch's default group on gloo, then groups on mpidist: the first one over every rank starts mpidist
    (a first one over some ranks says so, instead of claiming torch is not initialized)."""
    n, port = 3, free_port()
    envs = [clean_env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(n)]
    results = run_plain_world(MIXED, envs, [[]] * n, tmp_path, timeout=100)
    for r, got in enumerate(results):
        assert got["sum"] == got["gloo"] == [6.0, 6.0], got
        assert got["last_two"] == ([3.0, 3.0] if r else [0.0, 0.0]), got  # ranks 1 and 2: 1 + 2
        assert got["backends"] == ["gloo", "mpidist"], got
        if r == 0:
            assert re.search(
                r"^new_group: the first group on backend 'mpidist' must have every rank \(3\), got \[0\]", got["error"]
            ), got
        else:
            assert got["error"] == "", got
