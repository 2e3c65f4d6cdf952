"""Initialization and teardown: init_process_group, destroy_process_group, queries, backends.

Tests that need the default group gone use the ``no_group`` fixture: it destroys the
group on every rank before the test and again afterwards (if the test left one), so
the harness re-creates the session's group, with its short timeout, for the next test.
Every init/destroy here runs on all ranks in the same order (they are collective).
"""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import warnings
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist import Backend, BackendOptions, BaseBackend
from mpidist.backends.mpi import MPIBackend
from mpidist.testing import backend_of

from helpers import check_raises, fail_together, raises_together

#: the timeout the harness gives the session's group (see conftest.py)
PG_TIMEOUT_S = float(os.environ.get("MPIDIST_TEST_PG_TIMEOUT", "90"))
RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
LAST = SIZE - 1


def init(**kwargs) -> None:
    kwargs.setdefault("timeout", PG_TIMEOUT_S)
    dist.init_process_group(**kwargs)


def check_world_works(group=None) -> None:
    """All-reduce on ``group`` (default: the world) and check the exact result."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    x = np.array([me + 1, 7], np.int64)
    dist.all_reduce(x, group=group)
    np.testing.assert_array_equal(x, [n * (n + 1) // 2, 7 * n])


def expect_init_value_error(match: str, exc: type[BaseException] = ValueError, **kwargs) -> None:
    """init_process_group must raise on every rank and leave nothing initialized."""
    problems = check_raises(exc, match, init, **kwargs)
    if dist.is_initialized():  # a wrong success: undo it so every rank is in the same state
        problems.append("init_process_group left the default group initialized")
        dist.destroy_process_group()
    if dist.group.WORLD is not None:
        problems.append("group.WORLD is set after a failed init")
    fail_together(problems)


# -- is_initialized / destroy / re-init ------------------------------------------------


def test_is_initialized_before_and_after(no_group):
    assert dist.is_initialized() is False
    assert dist.group.WORLD is None
    assert dist.GroupMember.WORLD is None
    init()
    assert dist.is_initialized() is True
    assert isinstance(dist.group.WORLD, dist.ProcessGroup)
    assert dist.GroupMember.WORLD is dist.group.WORLD
    assert dist.get_rank() == RANK
    assert dist.get_world_size() == SIZE
    dist.destroy_process_group()
    assert dist.is_initialized() is False
    assert dist.group.WORLD is None


def test_destroy_then_init_several_cycles(no_group):
    old_groups = []
    for cycle in range(3):
        init()
        assert dist.is_initialized()
        world = dist.group.WORLD
        assert all(world is not g for g in old_groups)
        check_world_works()
        # broadcast, barrier, a subgroup and an object collective in every cycle
        x = np.arange(4.0) * (cycle + 1) if RANK == 0 else np.zeros(4)
        dist.broadcast(x, src=0)
        np.testing.assert_array_equal(x, np.arange(4.0) * (cycle + 1))
        dist.barrier()
        sub = dist.new_group()
        check_world_works(sub)
        objs = [None] * SIZE
        dist.all_gather_object(objs, ("cycle", cycle, RANK))
        assert objs == [("cycle", cycle, r) for r in range(SIZE)]
        old_groups += [world, sub]
        dist.destroy_process_group()
        assert not dist.is_initialized()
    # every group of every cycle is dead now, even after a new init
    init()
    check_world_works()
    for g in old_groups:
        with pytest.raises(RuntimeError, match=r"^all_reduce: process group .* has been destroyed"):
            dist.all_reduce(np.zeros(1), group=g)
        with pytest.raises(RuntimeError, match=r"^get_rank: process group .* has been destroyed"):
            dist.get_rank(g)
        with pytest.raises(RuntimeError, match=r"^barrier: process group .* has been destroyed"):
            dist.barrier(group=g)


def test_destroy_subgroup_only(rank, world_size):
    before = dist.get_pg_count()
    sub = dist.new_group()
    assert dist.get_pg_count() == before + 1
    check_world_works(sub)
    dist.destroy_process_group(sub)
    assert dist.is_initialized()
    assert dist.get_pg_count() == before
    raises_together(
        RuntimeError, r"^all_reduce: process group .* has been destroyed", dist.all_reduce, np.zeros(1), group=sub
    )
    raises_together(
        RuntimeError, r"^destroy_process_group: process group .* has been destroyed", dist.destroy_process_group, sub
    )
    check_world_works()


def test_destroy_default_destroys_subgroups(no_group):
    init()
    sub = dist.new_group()
    mine, _ = dist.new_subgroups(1)
    dist.destroy_process_group()
    assert dist.get_pg_count() == 0
    init()
    for g in (sub, mine):
        raises_together(RuntimeError, "has been destroyed", dist.all_reduce, np.zeros(1), group=g)
    check_world_works()


@pytest.mark.mpi(min_size=2)
def test_destroy_non_member_group_is_a_no_op(rank):
    g = dist.new_group([0])
    if rank == 0:
        assert isinstance(g, dist.ProcessGroup)
    else:
        assert g is dist.GroupMember.NON_GROUP_MEMBER
    assert dist.destroy_process_group(g) is None
    if rank == 0:
        problems = check_raises(RuntimeError, r"^get_rank: process group .* has been destroyed", dist.get_rank, g)
    else:
        problems = []
    fail_together(problems)
    check_world_works()


def test_init_twice_raises():
    assert dist.is_initialized()
    world = dist.group.WORLD
    for kind in (ValueError, RuntimeError):  # torch raises a ValueError; mpidist raised a RuntimeError before
        raises_together(
            kind,
            r"^init_process_group: .*already initialized.*destroy_process_group\(\)",
            dist.init_process_group,
        )
    assert dist.group.WORLD is world
    check_world_works()


# -- every public function before init ---------------------------------------------------


def _x():
    return np.zeros(2, np.float64)


_BEFORE_INIT = {
    "all_reduce": lambda: dist.all_reduce(_x()),
    "reduce": lambda: dist.reduce(_x(), dst=0),
    "broadcast": lambda: dist.broadcast(_x(), src=0),
    "all_gather": lambda: dist.all_gather([_x()], _x()),
    "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(_x(), _x()),
    "gather": lambda: dist.gather(_x(), [_x()], dst=0),
    "scatter": lambda: dist.scatter(_x(), [_x()], src=0),
    "reduce_scatter": lambda: dist.reduce_scatter(_x(), [_x()]),
    "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(_x(), _x()),
    "all_to_all_single": lambda: dist.all_to_all_single(_x(), _x()),
    "all_to_all": lambda: dist.all_to_all([_x()], [_x()]),
    "barrier": lambda: dist.barrier(),
    "monitored_barrier": lambda: dist.monitored_barrier(),
    "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([_x()]),
    "all_gather_coalesced": lambda: dist.all_gather_coalesced([[_x()]], [_x()]),
    "send": lambda: dist.send(_x(), dst=0),
    "recv": lambda: dist.recv(_x(), src=0),
    "isend": lambda: dist.isend(_x(), dst=0),
    "irecv": lambda: dist.irecv(_x(), src=0),
    "P2POp": lambda: dist.P2POp(dist.isend, _x(), 0),
    "broadcast_object_list": lambda: dist.broadcast_object_list([1], src=0),
    "all_gather_object": lambda: dist.all_gather_object([None], 1),
    "gather_object": lambda: dist.gather_object(1, [None], dst=0),
    "scatter_object_list": lambda: dist.scatter_object_list([None], [1], src=0),
    "send_object_list": lambda: dist.send_object_list([1], dst=0),
    "recv_object_list": lambda: dist.recv_object_list([None], src=0),
    "get_rank": lambda: dist.get_rank(),
    "get_world_size": lambda: dist.get_world_size(),
    "get_backend": lambda: dist.get_backend(),
    "new_group": lambda: dist.new_group(),
    "new_subgroups": lambda: dist.new_subgroups(1),
    "new_subgroups_by_enumeration": lambda: dist.new_subgroups_by_enumeration([[0]]),
    "get_group_rank": lambda: dist.get_group_rank(None, 0),
    "get_global_rank": lambda: dist.get_global_rank(None, 0),
    "get_process_group_ranks": lambda: dist.get_process_group_ranks(None),
    "destroy_process_group": lambda: dist.destroy_process_group(),
}


@pytest.mark.parametrize("name", sorted(_BEFORE_INIT))
def test_public_function_before_init_raises(no_group, name):
    for kind in (ValueError, RuntimeError):  # torch raises a ValueError; mpidist raised a RuntimeError before
        with pytest.raises(kind, match=rf"^{name}: .*not initialized.*call mpidist\.init_process_group\(\)"):
            _BEFORE_INIT[name]()
    assert not dist.is_initialized()


def test_queries_that_need_no_group_work_before_init(no_group):
    assert dist.is_available() is True
    assert dist.is_mpi_available() is True
    assert dist.is_gloo_available() is True  # the name is served by MPI
    assert dist.get_pg_count() == 0
    assert dist.is_backend_available("mpi") is True


# -- rank / world_size arguments and environment variables --------------------------------


def test_rank_and_world_size_that_agree_with_mpi(no_group):
    init(rank=RANK, world_size=SIZE)
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
    check_world_works()
    dist.destroy_process_group()
    init(rank=np.int64(RANK))  # numpy integers are ints too
    check_world_works()
    dist.destroy_process_group()
    init(world_size=SIZE, rank=-1)  # -1: take it from MPI
    check_world_works()


def test_rank_that_disagrees_on_every_rank(no_group):
    def wrong(r):
        return (r + 1) % SIZE if SIZE > 1 else 1

    every = " | ".join(f"rank {r}: the rank argument says rank={wrong(r)} but MPI says {r}" for r in range(SIZE))
    msg = "^" + re.escape(f"init_process_group: {every}") + "$"
    expect_init_value_error(msg, rank=wrong(RANK), world_size=SIZE)
    init()
    check_world_works()


def test_rank_that_disagrees_on_one_rank_fails_everywhere(no_group):
    # only the last rank passes a wrong rank; every rank must raise the same error
    claimed = SIZE if RANK == LAST else RANK
    msg = f"^init_process_group: rank {LAST}: the rank argument says rank={SIZE} but MPI says {LAST}$"
    expect_init_value_error(msg, rank=claimed)
    init()
    check_world_works()


def test_world_size_that_disagrees_on_one_rank_fails_everywhere(no_group):
    claimed = SIZE + 3 if RANK == 0 else SIZE
    msg = rf"^init_process_group: rank 0: the world_size argument says world_size={SIZE + 3} but MPI says {SIZE}"
    expect_init_value_error(msg, world_size=claimed)
    init()
    check_world_works()


def test_every_disagreement_is_reported(no_group):
    msg = (
        rf"rank {RANK}: the rank argument says rank={RANK + SIZE} but MPI says {RANK}; "
        rf"the world_size argument says world_size={SIZE + 1} but MPI says {SIZE}"
    )
    expect_init_value_error(msg, rank=RANK + SIZE, world_size=SIZE + 1)


@pytest.mark.skipif(SIZE != 1, reason="only a world of one process can lack a launcher")
def test_world_size_without_a_launcher_explains_mpiexec(no_group):
    expect_init_value_error(r"MPI's world has 1 process: start all processes with `mpiexec -n N", world_size=4)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"rank": "0"}, TypeError, r"^init_process_group: rank must be an int, got str"),
        ({"rank": True}, TypeError, r"^init_process_group: rank must be an int, got bool"),
        ({"world_size": 2.0}, TypeError, r"^init_process_group: world_size must be an int, got float"),
        ({"rank": -2}, ValueError, r"^init_process_group: rank must be -1 .* got -2"),
        ({"world_size": -5}, ValueError, r"^init_process_group: world_size must be -1 .* got -5"),
    ],
)
def test_bad_rank_arguments(no_group, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        init(**kwargs)
    assert not dist.is_initialized()


def test_env_rank_and_world_size_that_agree(no_group, monkeypatch):
    monkeypatch.setenv("RANK", str(RANK))
    monkeypatch.setenv("WORLD_SIZE", str(SIZE))
    init()
    check_world_works()
    dist.destroy_process_group()
    init(init_method="env://")
    check_world_works()


def test_env_rank_that_disagrees_on_one_rank(no_group, monkeypatch):
    monkeypatch.setenv("RANK", str(SIZE + 7) if RANK == LAST else str(RANK))
    msg = rf"^init_process_group: rank {LAST}: the environment variable RANK says rank={SIZE + 7} but MPI says {LAST}$"
    expect_init_value_error(msg)
    expect_init_value_error(msg, init_method="env://")
    monkeypatch.delenv("RANK")
    init()
    check_world_works()


def test_env_world_size_that_disagrees(no_group, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(SIZE + 1))
    expect_init_value_error(
        rf"rank {RANK}: the environment variable WORLD_SIZE says world_size={SIZE + 1} but MPI says {SIZE}"
    )


def test_env_rank_that_is_not_an_int(no_group, monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    expect_init_value_error(r"^init_process_group: environment variable RANK='zero' is not an int")


def test_env_variables_are_ignored_by_tcp_and_file_init(no_group, monkeypatch, tmp_path):
    # as in torch, only env:// reads RANK and WORLD_SIZE
    monkeypatch.setenv("RANK", str(RANK + 100))
    monkeypatch.setenv("WORLD_SIZE", str(SIZE + 100))
    init(init_method="tcp://127.0.0.1:23456")
    check_world_works()
    dist.destroy_process_group()
    init(init_method=f"file://{tmp_path}/nonexistent-rendezvous-file")
    check_world_works()


# -- init_method -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "env://",
        "tcp://127.0.0.1:23456",
        "tcp://10.1.1.20:23456?rank={rank}&world_size={size}",
        "tcp://[::1]:29500?world_size={size}",
        "file:///tmp/mpidist-test-sharedfile",
        "file:///tmp/mpidist-test-sharedfile?rank={rank}&world_size={size}",
        "env://?rank={rank}",
    ],
)
def test_init_method_accepted(no_group, url):
    init(init_method=url.format(rank=RANK, size=SIZE))
    check_world_works()


def test_init_method_rank_query_that_disagrees_on_one_rank(no_group):
    claimed = SIZE if RANK == LAST else RANK
    msg = rf"^init_process_group: rank {LAST}: init_method's rank= says rank={SIZE} but MPI says {LAST}$"
    expect_init_value_error(msg, init_method=f"tcp://127.0.0.1:23456?rank={claimed}&world_size={SIZE}")


def test_init_method_world_size_query_that_disagrees(no_group):
    msg = rf"rank {RANK}: init_method's world_size= says world_size={SIZE + 2} but MPI says {SIZE}"
    expect_init_value_error(msg, init_method=f"file:///tmp/mpidist-test-x?world_size={SIZE + 2}")


def test_init_method_query_that_is_not_an_int(no_group):
    expect_init_value_error(
        r"^init_process_group: init_method's world_size= must be an int, got 'many'",
        init_method="tcp://127.0.0.1:1?world_size=many",
    )


@pytest.mark.parametrize("url", ["http://example.com:80", "mpi://", "nonsense", "", "tcp//127.0.0.1:1"])
def test_init_method_bad_scheme(no_group, url):
    expect_init_value_error(
        r"^init_process_group: init_method .* must start with env://, tcp:// or file://", init_method=url
    )


def test_init_method_not_a_string(no_group):
    with pytest.raises(TypeError, match=r"^init_process_group: init_method must be a URL string, got int"):
        init(init_method=23456)
    assert not dist.is_initialized()


def test_init_method_and_store_are_mutually_exclusive(no_group):
    expect_init_value_error(
        r"^init_process_group: init_method and store are mutually exclusive", init_method="env://", store=object()
    )


def test_store_alone_is_accepted(no_group):
    store = dist.HashStore()
    init(store=store, rank=RANK, world_size=SIZE)
    check_world_works()
    assert dist.get_default_store() is store


def test_store_that_is_not_a_store(no_group):
    with pytest.raises(
        TypeError,
        match=r"^init_process_group: store must be a key-value store .* got object without "
        r"set, get, add, wait$",
    ):
        init(store=object(), rank=RANK, world_size=SIZE)
    assert not dist.is_initialized()


# -- timeout ---------------------------------------------------------------------------


def test_timeout_as_timedelta(no_group):
    init(timeout=timedelta(seconds=42))
    assert dist.group.WORLD.timeout == timedelta(seconds=42)
    assert backend_of().timeout_s == 42
    check_world_works()


def test_timeout_as_seconds(no_group):
    init(timeout=41.5)
    assert dist.group.WORLD.timeout == timedelta(seconds=41.5)
    dist.destroy_process_group()
    init(timeout=40)
    assert dist.group.WORLD.timeout == timedelta(seconds=40)
    check_world_works()


def test_default_timeout_is_default_pg_timeout(no_group):
    assert dist.default_pg_timeout == timedelta(minutes=30)
    dist.init_process_group()
    assert dist.group.WORLD.timeout == dist.default_pg_timeout
    check_world_works()


@pytest.mark.parametrize("bad", ["60", [60], True])
def test_timeout_bad_type(no_group, bad):
    with pytest.raises(TypeError, match=r"^init_process_group: timeout must be a datetime.timedelta or seconds"):
        init(timeout=bad)
    assert not dist.is_initialized()


def test_timeout_negative(no_group):
    expect_init_value_error(r"^init_process_group: timeout must not be negative", timeout=timedelta(seconds=-1))


def test_new_group_and_subgroups_inherit_the_timeout(no_group):
    init(timeout=timedelta(seconds=77))
    sub = dist.new_group()
    assert sub.timeout == timedelta(seconds=77)
    assert backend_of(sub).timeout_s == 77
    mine, _ = dist.new_subgroups(1)
    assert mine.timeout == timedelta(seconds=77)
    enum_mine, _ = dist.new_subgroups_by_enumeration([list(range(SIZE))])
    assert enum_mine.timeout == timedelta(seconds=77)
    own = dist.new_group(timeout=12)
    assert own.timeout == timedelta(seconds=12)
    own2 = dist.new_group(timeout=timedelta(minutes=1))
    assert own2.timeout == timedelta(minutes=1)
    mine2, _ = dist.new_subgroups(1, timeout=timedelta(seconds=9))
    assert mine2.timeout == timedelta(seconds=9)
    raises_together(
        TypeError, r"^new_group: timeout must be a datetime.timedelta or seconds", dist.new_group, timeout="soon"
    )
    for g in (sub, mine, enum_mine, own, own2, mine2):
        check_world_works(g)


# -- backend names --------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend",
    [None, "mpi", "MPI", "Mpi", Backend.MPI, Backend("MPI"), "cpu:mpi", "cpu:mpi,cuda:nccl", "CPU:MPI, CUDA:NCCL"],
)
def test_backend_names_accepted(no_group, backend):
    init(backend=backend)
    # get_backend() answers the name as asked (lowercase, as torch's Backend() spells it)
    asked = "mpi" if backend is None else str(backend).lower().replace(" ", "")
    assert dist.get_backend() == asked
    assert dist.group.WORLD.name() == asked
    assert dist.group.WORLD.devices["cpu"] == "mpi"
    check_world_works()


def test_per_device_backend_string_keeps_the_mapping(no_group):
    init(backend="cpu:mpi,cuda:nccl")
    assert dist.group.WORLD.devices == {"cpu": "mpi", "cuda": "nccl"}
    sub = dist.new_group()  # inherits the mapping
    assert sub.devices == {"cpu": "mpi", "cuda": "nccl"}
    assert dist.get_backend(sub) == "cpu:mpi,cuda:nccl"  # the name as asked, as torch answers
    check_world_works(sub)


@pytest.mark.parametrize(
    "name,served",
    [
        ("gloo", {"cpu": "mpi", "cuda": "mpi"}),
        ("GLOO", {"cpu": "mpi", "cuda": "mpi"}),
        (Backend.GLOO, {"cpu": "mpi", "cuda": "mpi"}),
        ("cpu:gloo", {"cpu": "mpi"}),
        ("cpu:gloo,cuda:nccl", {"cpu": "mpi", "cuda": "nccl"}),
        ("CPU:Gloo, CUDA:Gloo", {"cpu": "mpi", "cuda": "mpi"}),
    ],
)
def test_torch_backend_names_are_served(no_group, name, served):
    """Programs written for torch say "gloo": MPI serves it and get_backend() still answers "gloo"."""
    init(backend=name)
    asked = str(name).lower().replace(" ", "")
    problems = []
    if dist.get_backend() != asked or dist.group.WORLD.devices != served:
        problems.append(f"{name!r}: get_backend {dist.get_backend()!r}, devices {dist.group.WORLD.devices}")
    sub = dist.new_group()  # inherits the default group's backend under the same name
    if dist.get_backend(sub) != asked:
        problems.append(f"new_group(): {dist.get_backend(sub)!r}")
    other = dist.new_group(backend=Backend.MPI)
    if dist.get_backend(other) != "mpi":
        problems.append(f"new_group(backend='mpi'): {dist.get_backend(other)!r}")
    fail_together(problems)
    check_world_works()
    check_world_works(sub)


def test_gloo_subgroup_of_an_mpi_world(no_group):
    init()
    g = dist.new_group(backend="gloo")
    assert dist.get_backend(g) == "gloo" and dist.get_backend() == "mpi"
    subs = dist.new_subgroups(1, backend="gloo")[1]
    assert all(dist.get_backend(s) == "gloo" for s in subs if s is not dist.GroupMember.NON_GROUP_MEMBER)
    check_world_works(g)


@pytest.mark.parametrize("name", ["ucc", "UCC", "cpu:ucc"])
def test_ucc_rejected_with_the_fix(no_group, name):
    expect_init_value_error(r"^init_process_group: mpidist has no ucc backend: use backend='mpi'", backend=name)


@pytest.mark.parametrize("name", ["nosuchbackend", "cpu:nosuchbackend", "cpu", "tcp"])
def test_unknown_backend(no_group, name):
    expect_init_value_error(
        r"^init_process_group: unknown backend '(nosuchbackend|cpu|tcp)'; available: .*mpi", backend=name
    )


def expect_host_arrays_rejected(name: str) -> None:
    """A device-only group: host arrays get a TypeError (fast lane included), on every rank."""
    pattern = (
        rf"^{{fn}}: process group \S+ has backend {name}, which takes CUDA arrays only; "
        r"got a host array \(numpy or CPU tensor\).*backend='cpu:mpi,cuda:nccl'"
    )
    problems = []
    for fn, call in (
        ("all_reduce", lambda: dist.all_reduce(np.ones(2))),
        ("broadcast", lambda: dist.broadcast(np.ones(2), src=0)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(np.ones(2 * SIZE), np.ones(2))),
    ):
        problems += check_raises(TypeError, pattern.format(fn=fn), call)
    fail_together(problems)


@pytest.mark.parametrize("name", ["cuda:mpi", "CUDA:MPI"])
def test_cuda_only_mpi_backend_takes_device_arrays_only(no_group, name):
    from mpidist.testing import HostCudaArray

    init(backend=name)
    assert dist.group.WORLD.devices == {"cuda": "mpi"}
    assert dist.get_backend() == "cuda:mpi"
    expect_host_arrays_rejected("cuda:mpi")
    x = HostCudaArray(np.full(3, float(RANK)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time staging warning
        dist.all_reduce(x)
    fail_together([] if np.array_equal(x.host, np.full(3, float(sum(range(SIZE))))) else [f"got {x.host}"])


@pytest.mark.parametrize("name", ["cpu:", ":mpi", "cpu:mpi,cuda", "cpu:mpi,,cuda:nccl"])
def test_malformed_per_device_backend(no_group, name):
    expect_init_value_error(r"is not of the form 'cpu:mpi,cuda:nccl'", backend=name)


def test_nccl_without_cupy_is_rejected(no_group):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed (tests/backends/test_gpu.py covers the nccl backend there)")
    expect_init_value_error(r"the nccl backend needs cupy with NCCL bindings", RuntimeError, backend="nccl")
    init()  # nothing was left half-initialized
    check_world_works()


def test_backend_not_a_string(no_group):
    with pytest.raises(TypeError, match=r"^init_process_group: backend must be a string"):
        init(backend=5)
    assert not dist.is_initialized()


def test_get_backend_of_groups(rank):
    assert dist.get_backend() == "mpi"
    assert isinstance(dist.get_backend(), Backend)
    assert dist.get_backend(dist.group.WORLD) == "mpi"
    sub = dist.new_group([0])
    if rank == 0:
        assert dist.get_backend(sub) == "mpi"
    else:
        with pytest.raises(ValueError, match=r"^get_backend: this rank is not a member"):
            dist.get_backend(sub)
    with pytest.raises(TypeError, match=r"^get_backend: group must be a ProcessGroup"):
        dist.get_backend("mpi")
    dist.destroy_process_group(sub)


def test_backend_class():
    assert Backend("GLOO") == "gloo" == Backend.GLOO
    assert Backend("gloo") == "gloo"
    assert Backend("Nccl") == Backend.NCCL == "nccl"
    assert Backend("MPI") == Backend.MPI == "mpi"
    assert Backend("ucc") == Backend.UCC == "ucc"
    assert Backend.UNDEFINED == "undefined"
    assert isinstance(Backend("MPI"), str)
    assert isinstance(Backend("MPI"), Backend)
    assert Backend("SomethingElse") == "somethingelse"
    for name in ("gloo", "nccl", "ucc", "mpi"):
        assert name in Backend.backend_list
    assert Backend.default_device_backend_map["cpu"] == "mpi"
    with pytest.raises(ValueError, match="must be a string"):
        Backend(3)
    with pytest.raises(ValueError, match="must be a string"):
        Backend(None)


def test_availability_queries(monkeypatch):
    assert dist.is_available() is True
    assert dist.is_mpi_available() is True
    assert dist.is_gloo_available() is True  # the name is served by MPI
    assert dist.is_ucc_available() is False
    nccl = dist.is_nccl_available()
    assert isinstance(nccl, bool)
    if importlib.util.find_spec("cupy") is None:
        assert nccl is False
    assert dist.is_backend_available("mpi") is True
    assert dist.is_backend_available("MPI") is True
    assert dist.is_backend_available(Backend.MPI) is True
    assert dist.is_backend_available("gloo") is True
    assert dist.is_backend_available("ucc") is False
    assert dist.is_backend_available("nccl") is False
    assert dist.is_backend_available("no_such_backend") is False


def test_is_torchelastic_launched(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert dist.is_torchelastic_launched() is False
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1234")
    assert dist.is_torchelastic_launched() is True
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "")
    assert dist.is_torchelastic_launched() is True  # set, even if empty, as in torch
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert dist.is_torchelastic_launched() is False


# -- third-party backends: Backend.register_backend --------------------------------------


class CountingBackend(MPIBackend):
    """The MPI backend, counting the calls it gets."""

    name = "counting"

    def __init__(self, comm, timeout_s, group_name=""):
        super().__init__(comm, timeout_s, group_name)
        self.calls = collections.Counter()
        self.shut_down = False

    def all_reduce(self, buf, backs, op, async_op):
        self.calls["all_reduce"] += 1
        return super().all_reduce(buf, backs, op, async_op)

    def broadcast(self, buf, backs, root, async_op):
        self.calls["broadcast"] += 1
        return super().broadcast(buf, backs, root, async_op)

    def barrier(self, async_op):
        self.calls["barrier"] += 1
        return super().barrier(async_op)

    def shutdown(self):
        self.shut_down = True
        super().shutdown()


EXT = "mpidist_test_counting_ext"
PLAIN = "mpidist_test_counting_plain"
BAD = "mpidist_test_bad_factory"
CUDA_ONLY = "mpidist_test_cuda_only"

_ext_calls: list[tuple[BackendOptions, object, CountingBackend]] = []
_plain_calls: list[tuple[object, int, int, timedelta, CountingBackend]] = []


def _ext_factory(options, pg_options):
    impl = CountingBackend(options.comm, options.timeout.total_seconds(), options.group_id)
    _ext_calls.append((options, pg_options, impl))
    return impl


def _plain_factory(store, rank, world_size, timeout):
    # the plain form gets no communicator: this backend only serves the whole world,
    # so it builds its own from MPI's world (every rank creates the default group)
    impl = CountingBackend(MPI.COMM_WORLD.Dup(), timeout.total_seconds(), "plain")
    _plain_calls.append((store, rank, world_size, timeout, impl))
    return impl


def _bad_factory(store, rank, world_size, timeout):
    return object()


@pytest.fixture(scope="module")
def registered():
    """Register the test backends once per process (registration cannot be undone)."""
    for name, func, ext, devices in (
        (EXT, _ext_factory, True, None),
        (PLAIN, _plain_factory, False, "cpu"),
        (BAD, _bad_factory, False, ["cpu"]),
        (CUDA_ONLY, _ext_factory, True, "cuda"),
    ):
        if name not in Backend.backend_list:
            Backend.register_backend(name, func, extended_api=ext, devices=devices)
    return True


def test_register_backend_names(registered):
    assert Backend.MPIDIST_TEST_COUNTING_EXT == EXT
    assert Backend(EXT.upper()) == EXT
    for name in (EXT, PLAIN, BAD, CUDA_ONLY):
        assert name in Backend.backend_list
    assert Backend.backend_capability[EXT] == ["cpu", "cuda"]
    assert Backend.backend_capability[PLAIN] == ["cpu"]
    assert Backend.backend_capability[CUDA_ONLY] == ["cuda"]
    assert dist.is_backend_available(EXT) is True
    assert dist.is_backend_available(PLAIN.upper()) is True
    # the registry on world is the one record: the class gains no attribute, the lists are views of it
    assert not any(name.upper() in vars(Backend) for name in (EXT, PLAIN, BAD, CUDA_ONLY))
    assert Backend.backend_list[:5] == ["undefined", "gloo", "nccl", "ucc", "mpi"]
    assert Backend.default_device_backend_map == {"cpu": "mpi", "cuda": "nccl"}  # both already served
    with pytest.raises(AttributeError, match="MPIDIST_TEST_NEVER_REGISTERED"):
        Backend.MPIDIST_TEST_NEVER_REGISTERED  # noqa: B018


def test_register_backend_extended_api(no_group, registered):
    _ext_calls.clear()
    pg_options = object()
    init(backend=EXT, pg_options=pg_options)
    assert dist.get_backend() == EXT
    assert dist.group.WORLD.name() == EXT
    assert len(_ext_calls) == 1
    options, got_pg_options, impl = _ext_calls[0]
    assert isinstance(options, BackendOptions)
    assert got_pg_options is pg_options
    assert isinstance(options.comm, MPI.Intracomm)
    assert options.comm.Get_size() == SIZE
    assert options.comm.Get_rank() == RANK
    assert options.comm is not MPI.COMM_WORLD
    assert MPI.Comm.Compare(options.comm, MPI.COMM_WORLD) == MPI.CONGRUENT  # a private duplicate
    assert (options.group_rank, options.group_size) == (RANK, SIZE)
    assert options.timeout == timedelta(seconds=PG_TIMEOUT_S)
    assert options.global_ranks_in_group == list(range(SIZE))
    assert options.group_id == dist.group.WORLD.group_name
    assert backend_of() is impl

    check_world_works()
    x = np.arange(3.0) if RANK == 0 else np.zeros(3)
    dist.broadcast(x, src=0)
    np.testing.assert_array_equal(x, np.arange(3.0))
    dist.barrier()
    assert impl.calls == {"all_reduce": 1, "broadcast": 1, "barrier": 1}

    # a new group without backend= inherits the custom backend
    sub = dist.new_group()
    assert len(_ext_calls) == 2
    sub_options, _, sub_impl = _ext_calls[1]
    assert backend_of(sub) is sub_impl and sub_impl is not impl
    assert dist.get_backend(sub) == EXT
    assert sub_options.group_id == sub.group_name != options.group_id
    check_world_works(sub)
    assert sub_impl.calls["all_reduce"] == 1
    assert impl.calls["all_reduce"] == 1

    dist.destroy_process_group()
    assert impl.shut_down and sub_impl.shut_down


def test_new_group_with_a_registered_backend(registered, rank, world_size):
    _ext_calls.clear()
    ranks = list(range(0, world_size, 2))
    g = dist.new_group(ranks, backend=EXT)
    if rank in ranks:
        assert dist.get_backend(g) == EXT
        options, _, impl = _ext_calls[-1]
        assert options.global_ranks_in_group == ranks
        assert options.group_size == len(ranks)
        assert options.group_rank == ranks.index(rank)
        check_world_works(g)
        assert impl.calls["all_reduce"] == 1
        dist.destroy_process_group(g)
        assert impl.shut_down
    else:
        assert g is dist.GroupMember.NON_GROUP_MEMBER
        assert _ext_calls == []
    assert dist.get_backend() == "mpi"


def test_register_backend_plain_api(no_group, registered):
    _plain_calls.clear()
    store = dist.HashStore()
    init(backend=PLAIN, store=store)
    assert len(_plain_calls) == 1
    got_store, got_rank, got_size, got_timeout, impl = _plain_calls[0]
    assert isinstance(got_store, dist.PrefixStore) and got_store.underlying_store is store  # the group's own view
    assert (got_rank, got_size) == (RANK, SIZE)
    assert got_timeout == timedelta(seconds=PG_TIMEOUT_S)
    assert dist.get_backend() == PLAIN
    check_world_works()
    dist.barrier()
    assert impl.calls == {"all_reduce": 1, "barrier": 1}


def test_register_backend_factory_returning_a_non_backend(no_group, registered):
    expect_init_value_error(
        rf"^backend '{BAD}': its factory returned object, expected an instance of a mpidist.backends.BaseBackend subclass",
        exc=TypeError,
        backend=BAD,
    )
    assert dist.get_pg_count() == 0
    init()  # the failed attempt left nothing behind
    check_world_works()


def test_registered_backend_without_cpu_device(no_group, registered):
    init(backend=CUDA_ONLY)
    assert dist.group.WORLD.devices == {"cuda": CUDA_ONLY}
    expect_host_arrays_rejected(CUDA_ONLY)


def test_register_backend_errors(registered):
    with pytest.raises(ValueError, match=rf"'{EXT}' is already registered"):
        Backend.register_backend(EXT, _ext_factory, extended_api=True)
    with pytest.raises(ValueError, match="already registered"):
        Backend.register_backend(EXT.upper(), _ext_factory)
    for builtin in ("mpi", "MPI", "gloo", "nccl", "ucc"):
        with pytest.raises(ValueError, match="already registered"):
            Backend.register_backend(builtin, _ext_factory)
    for bad_name in ("", "has-dash", "has space", "1starts_with_digit", None, 5):
        with pytest.raises(ValueError, match=r"^Backend.register_backend: name must be an identifier-like string"):
            Backend.register_backend(bad_name, _ext_factory)
    with pytest.raises(TypeError, match=r"^Backend.register_backend: func must be callable, got str"):
        Backend.register_backend("mpidist_test_never_registered", "not a function")
    assert "mpidist_test_never_registered" not in Backend.backend_list


def test_base_backend_is_abstract():
    with pytest.raises(TypeError):
        BaseBackend(0, 1, 1.0)  # abstract methods are not implemented
    assert issubclass(MPIBackend, BaseBackend)


# -- node-local rank, group count ---------------------------------------------------------


def test_get_node_local_rank_from_env(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.get_node_local_rank() == 3
    assert dist.get_node_local_rank(fallback_rank=9) == 3


def test_get_node_local_rank_from_mpi(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    try:
        expected = node.Get_rank()
    finally:
        node.Free()
    assert dist.get_node_local_rank() == expected
    assert dist.get_node_local_rank(fallback_rank=99) == expected


def test_get_node_local_rank_fallback(no_group, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert dist.get_node_local_rank(fallback_rank=5) == 5
    with pytest.raises(RuntimeError, match=r"^get_node_local_rank: LOCAL_RANK is not set.*fallback_rank"):
        dist.get_node_local_rank()
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert dist.get_node_local_rank() == 2


def test_get_pg_count(no_group):
    assert dist.get_pg_count() == 0
    init()
    assert dist.get_pg_count() == 1
    sub = dist.new_group()
    assert dist.get_pg_count() == 2
    mine, _ = dist.new_subgroups(1)  # this rank is a member of one of them
    assert dist.get_pg_count() == 3
    dist.destroy_process_group(sub)
    assert dist.get_pg_count() == 2
    dist.destroy_process_group(mine)
    assert dist.get_pg_count() == 1
    dist.destroy_process_group()
    assert dist.get_pg_count() == 0


# -- the default store -------------------------------------------------------------------


def test_default_store_is_shared_by_every_rank(world_size):
    store = dist.get_default_store()
    key = "test-default-store-shared"
    store.add(key, dist.get_rank() + 1)
    dist.barrier()
    assert int(store.get(key)) == world_size * (world_size + 1) // 2
    dist.barrier()  # every rank has read before anyone adds again
    store.delete_key(key) if dist.get_rank() == 0 else None
    dist.barrier()


def test_default_store_after_reinit_is_a_new_one(no_group):
    init()
    first = dist.get_default_store()
    first.set("test-reinit", "old")
    dist.barrier()
    dist.destroy_process_group()
    init()
    second = dist.get_default_store()
    assert second is not first
    assert not second.check(["test-reinit"])  # a fresh store: the old key is gone
    dist.barrier()


def test_get_default_store_before_init(no_group):
    with pytest.raises(RuntimeError, match=r"^get_default_store: the default process group is not initialized"):
        dist.get_default_store()


def test_each_group_sees_the_store_through_its_own_prefix(no_group, registered):
    _plain_calls.clear()
    init(backend=PLAIN)
    g = dist.new_group(backend=PLAIN)
    world_store, group_store = _plain_calls[0][0], _plain_calls[-1][0]
    assert isinstance(world_store, dist.PrefixStore) and isinstance(group_store, dist.PrefixStore)
    assert world_store.underlying_store is dist.get_default_store() is group_store.underlying_store
    if dist.get_rank() == 0:
        group_store.set("k", "group")
        world_store.set("k", "world")
    dist.barrier()
    assert group_store.get("k") == b"group" and world_store.get("k") == b"world"
    dist.barrier()
    dist.destroy_process_group(g)
