"""A table-driven fuzz of the public API with wrong arguments (issue 13, "Tests").

For every public function that takes arguments, :data:`CASES` holds one correct call
(keyword arguments, valid at world sizes 1 to 4) and, for each parameter, a few values
that are certainly wrong. Every rank passes the same wrong value; each must raise a
TypeError or ValueError whose message starts with the function's name and names the
argument (``"fn: arg ..."``), before anything is posted on the group (its call counters
do not move and nothing is left pending). After a function's wrong calls, its correct
call still works and an all_reduce on the same group gives the right sums.

Not duplicated here (see test_hostile.py): ``async_op`` of the collectives, roots of
broadcast/reduce/broadcast_object_list and tags of isend/irecv given as arrays.
Not fuzzed: ``abort_process_group`` (a value wrongly accepted would end the job),
``init_process_group`` (the session's world is initialized) and the stores (their own
hostile modules).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist.testing import backend_of, calls_issued, p2p_calls_issued

from helpers import Checks, sum_ok

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
K = 3  # elements per rank in the correct calls

pytestmark = pytest.mark.timeout(90)


# -- the wrong values, by what the parameter expects ----------------------------------------------------

NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE

#: where an array is expected
NOT_ARRAY = ["x", object(), None, 2.5]
#: where a list of arrays is expected
NOT_LIST = ["x", object(), None, 7]
#: where a rank (global or group) is expected: wrong kinds, then out of range (every rank alike)
NOT_RANK = ["0", object(), 1.5, -1, SIZE, SIZE + 7]
#: where a ReduceOp is expected
NOT_OP = ["sum", object(), 99, 1.5, np.zeros(2)]
#: where a group is expected (None is the default group and is valid)
NOT_GROUP = ["x", object(), 0, [0], MPI.COMM_WORLD]
#: where a timeout is expected (None and 0 are the group's timeout)
NOT_TIMEOUT = ["1s", object(), -1, float("nan"), [5]]
#: where a tag is expected
NOT_TAG = ["0", object(), 1.5, -1]
#: where a bool flag is expected (ints count by their truth, as in torch)
NOT_BOOL = ["x", object(), 1.5, None]
#: where a list of split sizes (ints summing to the rows) is expected
NOT_SPLITS = ["x", object(), 5, [-1] * SIZE, [1.5] * SIZE, [K] * (SIZE + 1)]


def _t() -> np.ndarray:
    return np.full(K, RANK + 1.0)


def _zs(n: int = SIZE) -> list[np.ndarray]:
    return [np.zeros(K) for _ in range(n)]


class Case:
    """One function: its correct call (``good()`` -> kwargs, ``run`` to call it) and its wrong values."""

    def __init__(
        self,
        fn: str,
        good: Callable[[Any], dict],
        bad: dict[str, list],
        run: Callable[[Callable, Any, dict], Any] | None = None,
        min_size: int = 1,
        grouped: bool = True,
        says: str | None = None,
    ) -> None:
        self.fn, self.good, self.bad, self.min_size, self.grouped = fn, good, bad, min_size, grouped
        self.says = says or fn  # an alias (the same function object) names its original in messages
        self.run = run or (lambda f, g, kw: f(**kw))


def _ring(send: str, recv: str):
    """Run a correct send-side call and a matching receive-side call as a ring (n >= 2)."""

    def run(f, g, kw):
        if send == f.__name__:
            w = dist.irecv(np.zeros(K), src=PREV, group=g)
            out = f(**kw)
            if out is not None:
                out.wait()
            w.wait()
        else:
            w = dist.isend(_t(), dst=NEXT, group=g)
            out = f(**kw)
            if out is not None and hasattr(out, "wait"):
                out.wait()
            w.wait()

    return run


def _persistent(f, g, kw):
    p = f(**kw)
    p.start().wait()
    p.free()


def _persistent_pair(f, g, kw):
    if f.__name__ == "send_init":
        p, q = f(**kw), dist.recv_init(np.zeros(K), src=PREV, group=g)
    else:
        p, q = f(**kw), dist.send_init(_t(), dst=NEXT, group=g)
    q.start()
    p.start().wait()
    q.wait()
    p.free()
    q.free()


def _batch(f, g, kw):
    for w in f(**kw):
        w.wait()


def _root_list(k: int = K) -> list | None:
    return [np.zeros(k) for _ in range(SIZE)] if RANK == 0 else None


def _new_group(f, g, kw):
    dist.destroy_process_group(f(**kw))


def _new_subgroups(f, g, kw):
    mine, groups = f(**kw)
    for sub in groups:
        dist.destroy_process_group(sub)


COLLECTIVE_BAD = {"group": NOT_GROUP}

CASES: list[Case] = [
    # -- collectives -------------------------------------------------------------------------------
    Case("broadcast", lambda g: dict(tensor=_t(), src=0, group=g),
         {"tensor": NOT_ARRAY, "src": NOT_RANK, "group_src": NOT_RANK, **COLLECTIVE_BAD}),
    Case("all_reduce", lambda g: dict(tensor=_t(), op=dist.ReduceOp.SUM, group=g),
         {"tensor": NOT_ARRAY, "op": NOT_OP, **COLLECTIVE_BAD}),
    Case("reduce", lambda g: dict(tensor=_t(), dst=0, op=dist.ReduceOp.SUM, group=g),
         {"tensor": NOT_ARRAY, "dst": NOT_RANK, "group_dst": NOT_RANK, "op": NOT_OP, **COLLECTIVE_BAD}),
    Case("all_gather", lambda g: dict(tensor_list=_zs(), tensor=_t(), group=g),
         {"tensor_list": NOT_LIST + [[object()] * SIZE, _zs(SIZE + 1)], "tensor": NOT_ARRAY, **COLLECTIVE_BAD}),
    Case("all_gather_into_tensor", lambda g: dict(output_tensor=np.zeros(SIZE * K), input_tensor=_t(), group=g),
         {"output_tensor": NOT_ARRAY + [np.zeros(SIZE * K + 1)], "input_tensor": NOT_ARRAY, **COLLECTIVE_BAD}),
    Case("all_gather_single", lambda g: dict(output_tensor=np.zeros(SIZE * K), input_tensor=_t(), group=g),
         {"output_tensor": NOT_ARRAY, "input_tensor": NOT_ARRAY, **COLLECTIVE_BAD}, says="all_gather_into_tensor"),
    Case("gather", lambda g: dict(tensor=_t(), gather_list=_root_list(), dst=0, group=g),
         {"tensor": NOT_ARRAY, "dst": NOT_RANK, "group_dst": NOT_RANK, **COLLECTIVE_BAD}),
    Case("scatter", lambda g: dict(tensor=np.zeros(K), scatter_list=_root_list(), src=0, group=g),
         {"tensor": NOT_ARRAY, "src": NOT_RANK, "group_src": NOT_RANK, **COLLECTIVE_BAD}),
    Case("reduce_scatter", lambda g: dict(output=np.zeros(K), input_list=[_t() for _ in range(SIZE)], group=g),
         {"output": NOT_ARRAY, "input_list": NOT_LIST + [[object()] * SIZE, _zs(SIZE + 1)], "op": NOT_OP,
          **COLLECTIVE_BAD}),
    Case("reduce_scatter_tensor", lambda g: dict(output=np.zeros(K), input=np.ones(SIZE * K), group=g),
         {"output": NOT_ARRAY, "input": NOT_ARRAY + [np.ones(SIZE * K + 1)], "op": NOT_OP, **COLLECTIVE_BAD}),
    Case("reduce_scatter_single", lambda g: dict(output=np.zeros(K), input=np.ones(SIZE * K), group=g),
         {"output": NOT_ARRAY, "input": NOT_ARRAY, "op": NOT_OP, **COLLECTIVE_BAD}, says="reduce_scatter_tensor"),
    Case("all_to_all_single",
         lambda g: dict(output=np.zeros(SIZE * K), input=np.ones(SIZE * K), output_split_sizes=[K] * SIZE,
                        input_split_sizes=[K] * SIZE, group=g),
         {"output": NOT_ARRAY, "input": NOT_ARRAY, "output_split_sizes": NOT_SPLITS,
          "input_split_sizes": NOT_SPLITS, **COLLECTIVE_BAD}),
    Case("all_to_all", lambda g: dict(output_tensor_list=_zs(), input_tensor_list=[_t() for _ in range(SIZE)], group=g),
         {"output_tensor_list": NOT_LIST + [[object()] * SIZE, _zs(SIZE + 1)],
          "input_tensor_list": NOT_LIST + [[object()] * SIZE, _zs(SIZE + 1)], **COLLECTIVE_BAD}),
    Case("barrier", lambda g: dict(group=g, timeout=30),
         {"timeout": NOT_TIMEOUT, "device_ids": ["x", object(), 1.5], **COLLECTIVE_BAD}),
    Case("monitored_barrier", lambda g: dict(group=g, timeout=30, wait_all_ranks=True),
         {"timeout": NOT_TIMEOUT, "wait_all_ranks": NOT_BOOL, **COLLECTIVE_BAD}),
    Case("all_reduce_coalesced", lambda g: dict(tensors=[_t(), _t()], op=dist.ReduceOp.SUM, group=g),
         {"tensors": NOT_LIST + [[object()], [_t(), "x"]], "op": NOT_OP, **COLLECTIVE_BAD}),
    Case("all_gather_coalesced",
         lambda g: dict(output_tensor_lists=[[np.zeros(K)] for _ in range(SIZE)], input_tensor_list=[_t()], group=g),
         {"output_tensor_lists": NOT_LIST + [[["x"]] * SIZE, [[np.zeros(K)] for _ in range(SIZE + 1)]],
          "input_tensor_list": NOT_LIST + [[object()]], **COLLECTIVE_BAD}),
    # -- point to point (the correct calls need a peer other than this rank) -------------------------
    Case("send", lambda g: dict(tensor=_t(), dst=NEXT, group=g, tag=0),
         {"tensor": NOT_ARRAY, "dst": NOT_RANK, "group_dst": NOT_RANK, "tag": NOT_TAG, **COLLECTIVE_BAD},
         run=_ring("send", "irecv"), min_size=2),
    Case("recv", lambda g: dict(tensor=np.zeros(K), src=PREV, group=g, tag=0),
         {"tensor": NOT_ARRAY, "src": NOT_RANK[:3] + [-1, SIZE + 7], "group_src": NOT_RANK, "tag": NOT_TAG,
          **COLLECTIVE_BAD},
         run=_ring("isend", "recv"), min_size=2),
    Case("isend", lambda g: dict(tensor=_t(), dst=NEXT, group=g, tag=0),
         {"tensor": NOT_ARRAY, "dst": NOT_RANK, "group_dst": NOT_RANK, "tag": NOT_TAG[:3], **COLLECTIVE_BAD},
         run=_ring("isend", "irecv"), min_size=2),
    Case("irecv", lambda g: dict(tensor=np.zeros(K), src=PREV, group=g, tag=0),
         {"tensor": NOT_ARRAY, "src": NOT_RANK, "group_src": NOT_RANK, "tag": NOT_TAG[:3], **COLLECTIVE_BAD},
         run=_ring("isend", "irecv"), min_size=2),
    Case("P2POp", lambda g: dict(op=dist.isend, tensor=_t(), peer=NEXT, group=g, tag=0),
         {"op": ["isend", object(), dist.send, None], "tensor": NOT_ARRAY, "peer": NOT_RANK,
          "group_peer": NOT_RANK, "tag": NOT_TAG, **COLLECTIVE_BAD},
         run=lambda f, g, kw: _batch(dist.batch_isend_irecv, g, dict(
             p2p_op_list=[dist.P2POp(dist.irecv, np.zeros(K), PREV, group=g), f(**kw)])),
         min_size=2),
    Case("batch_isend_irecv",
         lambda g: dict(p2p_op_list=[dist.P2POp(dist.irecv, np.zeros(K), PREV, group=g),
                                     dist.P2POp(dist.isend, _t(), NEXT, group=g)]),
         {"p2p_op_list": ["x", object(), None, [], [object()], [dist.isend]]},
         run=_batch, min_size=2, grouped=False),
    # -- persistent operations ---------------------------------------------------------------------
    Case("broadcast_init", lambda g: dict(tensor=_t(), src=0, group=g),
         {"tensor": NOT_ARRAY, "src": NOT_RANK, "group_src": NOT_RANK, **COLLECTIVE_BAD}, run=_persistent),
    Case("all_reduce_init", lambda g: dict(tensor=_t(), op=dist.ReduceOp.SUM, group=g),
         {"tensor": NOT_ARRAY, "op": NOT_OP, **COLLECTIVE_BAD}, run=_persistent),
    Case("reduce_init", lambda g: dict(tensor=_t(), dst=0, op=dist.ReduceOp.SUM, group=g),
         {"tensor": NOT_ARRAY, "dst": NOT_RANK, "group_dst": NOT_RANK, "op": NOT_OP, **COLLECTIVE_BAD},
         run=_persistent),
    Case("all_gather_into_tensor_init",
         lambda g: dict(output_tensor=np.zeros(SIZE * K), input_tensor=_t(), group=g),
         {"output_tensor": NOT_ARRAY + [np.zeros(SIZE * K + 1)], "input_tensor": NOT_ARRAY, **COLLECTIVE_BAD},
         run=_persistent),
    Case("reduce_scatter_tensor_init", lambda g: dict(output=np.zeros(K), input=np.ones(SIZE * K), group=g),
         {"output": NOT_ARRAY, "input": NOT_ARRAY + [np.ones(SIZE * K + 1)], "op": NOT_OP, **COLLECTIVE_BAD},
         run=_persistent),
    Case("all_to_all_single_init",
         lambda g: dict(output=np.zeros(SIZE * K), input=np.ones(SIZE * K), output_split_sizes=[K] * SIZE,
                        input_split_sizes=[K] * SIZE, group=g),
         {"output": NOT_ARRAY, "input": NOT_ARRAY, "output_split_sizes": NOT_SPLITS,
          "input_split_sizes": NOT_SPLITS, **COLLECTIVE_BAD}, run=_persistent),
    Case("send_init", lambda g: dict(tensor=_t(), dst=NEXT, group=g, tag=0),
         {"tensor": NOT_ARRAY, "dst": NOT_RANK, "group_dst": NOT_RANK, "tag": NOT_TAG, **COLLECTIVE_BAD},
         run=_persistent_pair, min_size=2),
    Case("recv_init", lambda g: dict(tensor=np.zeros(K), src=PREV, group=g, tag=0),
         {"tensor": NOT_ARRAY, "src": NOT_RANK, "group_src": NOT_RANK, "tag": NOT_TAG, **COLLECTIVE_BAD},
         run=_persistent_pair, min_size=2),
    # -- objects -----------------------------------------------------------------------------------
    Case("broadcast_object_list", lambda g: dict(object_list=[RANK, "x"], src=0, group=g),
         # an empty list is a valid broadcast of nothing (torch too); device is accepted for torch
         # compatibility and unused (objects travel in host memory), so it is not fuzzed
         {"object_list": ["xy", object(), None, 7], "src": NOT_RANK[:2] + NOT_RANK[3:], "group_src": NOT_RANK,
          **COLLECTIVE_BAD}),
    Case("all_gather_object", lambda g: dict(object_list=[None] * SIZE, obj={"r": RANK}, group=g),
         {"object_list": ["x" * SIZE, object(), None, 7, [None] * (SIZE + 1)], **COLLECTIVE_BAD}),
    Case("gather_object",
         lambda g: dict(obj=RANK, object_gather_list=[None] * SIZE if RANK == 0 else None, dst=0, group=g),
         {"dst": NOT_RANK, "group_dst": NOT_RANK, **COLLECTIVE_BAD}),
    Case("scatter_object_list",
         lambda g: dict(scatter_object_output_list=[None],
                        scatter_object_input_list=list(range(SIZE)) if RANK == 0 else None, src=0, group=g),
         {"scatter_object_output_list": ["x", object(), None, 7, []], "src": NOT_RANK, "group_src": NOT_RANK,
          **COLLECTIVE_BAD}),
    Case("send_object_list", lambda g: dict(object_list=[RANK], dst=NEXT, group=g),
         # [] is a valid message of no objects (torch too); use_batch is read by its truth as in torch
         {"object_list": ["x", object(), None, 7], "dst": NOT_RANK, "group_dst": NOT_RANK, **COLLECTIVE_BAD},
         run=lambda f, g, kw: _objects_ring(f, g, kw), min_size=2),
    Case("recv_object_list", lambda g: dict(object_list=[None], src=PREV, group=g),
         # [] is a valid receive of no objects, which waits for its message (torch too)
         {"object_list": ["x", object(), None, 7], "src": NOT_RANK, "group_src": NOT_RANK, **COLLECTIVE_BAD},
         run=lambda f, g, kw: _objects_ring(f, g, kw), min_size=2),
    # -- groups and queries ------------------------------------------------------------------------
    Case("new_group", lambda g: dict(ranks=list(range(SIZE)), timeout=5),
         {"ranks": ["x", object(), 3, [1.5], [SIZE], [-1], [[0]]], "timeout": NOT_TIMEOUT,
          "backend": ["nope", object(), 3]},  # use_local_synchronization is read by its truth, as in torch
         run=_new_group, grouped=False),
    Case("new_subgroups", lambda g: dict(group_size=1, timeout=5),
         {"group_size": ["1", object(), 1.5, 0, -1, SIZE + 1], "group": NOT_GROUP, "timeout": NOT_TIMEOUT,
          "backend": ["nope", object()]},
         run=_new_subgroups, grouped=False),
    Case("new_subgroups_by_enumeration", lambda g: dict(ranks_per_subgroup_list=[[r] for r in range(SIZE)], timeout=5),
         {"ranks_per_subgroup_list": ["x", object(), 3, [1], [[1.5]], [[SIZE]], [[-1]], [[0], [0]]],
          "timeout": NOT_TIMEOUT, "backend": ["nope", object()]},
         run=_new_subgroups, grouped=False),
    Case("get_rank", lambda g: dict(group=g), {"group": NOT_GROUP}),
    Case("get_world_size", lambda g: dict(group=g), {"group": NOT_GROUP}),
    Case("get_backend", lambda g: dict(group=g), {"group": NOT_GROUP}),
    Case("get_process_group_ranks", lambda g: dict(group=g), {"group": NOT_GROUP}),
    Case("get_group_rank", lambda g: dict(group=g, global_rank=RANK),
         {"group": NOT_GROUP, "global_rank": NOT_RANK}),
    Case("get_global_rank", lambda g: dict(group=g, group_rank=RANK),
         {"group": NOT_GROUP, "group_rank": NOT_RANK}),
    Case("destroy_process_group", None, {"group": NOT_GROUP}),
    # -- reductions and debugging ------------------------------------------------------------------
    Case("make_premul_sum", lambda g: dict(factor=2.0), {"factor": ["2", object(), None, [2.0], np.ones(3)]},
         grouped=False),
    Case("_make_nccl_premul_sum", lambda g: dict(factor=2.0), {"factor": ["2", object(), None, [2.0]]},
         grouped=False, says="make_premul_sum"),
    Case("ReduceOp", lambda g: dict(op=dist.ReduceOp.MAX), {"op": NOT_OP}, grouped=False),
    Case("supports_complex", lambda g: dict(op=dist.ReduceOp.SUM), {"op": NOT_OP}, grouped=False),
    Case("set_debug_level", lambda g: dict(level="OFF"), {"level": ["nope", object(), 1.5, 99, None]},
         grouped=False),
    # -- Lightning's utilities and the sampler ---------------------------------------------------------
    Case("gather_all_tensors", lambda g: dict(result=_t(), group=g), {"result": ["x", object(), None], **COLLECTIVE_BAD}),
    Case("sync_ddp", lambda g: dict(result=_t(), group=g, reduce_op="sum"),
         {"result": ["x", object(), None], "reduce_op": ["nope", object(), 1.5], **COLLECTIVE_BAD}),
    Case("DistributedSampler", lambda g: dict(dataset=list(range(8)), num_replicas=SIZE, rank=RANK),
         {"dataset": [object(), 7], "num_replicas": ["2", object(), 1.5, 0, -1], "rank": ["0", object(), 1.5, -1, SIZE],
          "seed": ["0", object(), 1.5]},
         grouped=False),
    Case("is_backend_available", lambda g: dict(backend="mpi"), {"backend": [object(), 1.5, None]}, grouped=False),
]  # fmt: skip


def _objects_ring(f, g, kw):
    if f.__name__ == "send_object_list":
        got: list = [None]
        if RANK % 2 == 0:
            f(**kw)
            dist.recv_object_list(got, src=PREV, group=g)
        else:
            dist.recv_object_list(got, src=PREV, group=g)
            f(**kw)
    else:
        if RANK % 2 == 0:
            dist.send_object_list([RANK], dst=NEXT, group=g)
            f(**kw)
        else:
            f(**kw)
            dist.send_object_list([RANK], dst=NEXT, group=g)


CASE_IDS = [c.fn for c in CASES]


def _counters(g) -> tuple:
    """What a refused call must not change: collectives and sends/receives issued on ``g`` and the world."""
    return (calls_issued(g), p2p_calls_issued(g), calls_issued(None), p2p_calls_issued(None))


def _pending(g) -> bool:
    return bool(g.control.pending() or backend_of(g).pending())


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, np.ndarray) else f"ndarray{v.shape}"
    return text if len(text) < 40 else text[:37] + "..."


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_wrong_arguments_are_refused_naming_the_function_and_the_group_stays_usable(fresh, case):
    c = Checks()
    fn = getattr(dist, case.fn)
    name = case.says
    for arg, values in case.bad.items():
        for bad in values:
            kw = case.good(fresh) if case.good is not None else {}
            kw[arg] = bad
            if arg == "group_src" and "src" in kw:
                kw.pop("src")
            if arg == "group_dst" and "dst" in kw:
                kw.pop("dst")
            if arg == "group_peer" and "peer" in kw:
                kw.pop("peer")
            what = f"{name}({arg}={_short(bad)})"
            before = _counters(fresh)
            try:
                out = fn(**kw)
            except (TypeError, ValueError) as exc:
                msg = str(exc)
                if not msg.startswith(f"{name}: "):
                    c.failures.append(f"{what}: {type(exc).__name__} {msg!r} does not start with '{name}: '")
                elif SIZE >= case.min_size and not re.search(rf"\b{re.escape(arg)}\b", msg):  # n = 1: "to itself"
                    c.failures.append(f"{what}: {type(exc).__name__} {msg!r} does not name {arg}")
            except Exception as exc:  # noqa: BLE001 - reported, not swallowed
                c.failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
            else:
                c.failures.append(f"{what}: accepted, returned {_short(out)}")
            c.equal(f"{what}: counters (group calls, group p2p, world calls, world p2p)", _counters(fresh), before)
            c.true(f"{what}: left something pending", not _pending(fresh))
    if case.good is not None and SIZE >= case.min_size:
        try:
            case.run(fn, fresh, case.good(fresh))
        except Exception as exc:  # noqa: BLE001
            c.failures.append(f"the correct {name} afterwards raised {type(exc).__name__}: {exc}")
    sum_ok(c, fresh)
    c.done()
