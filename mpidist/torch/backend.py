"""``ProcessGroupMPIDist``: mpidist as a ``torch.distributed`` backend.

torch 2.x lets a Python package provide a backend: a Python subclass of
``torch.distributed.ProcessGroup`` registered with
``Backend.register_backend(name, creator, extended_api=True, devices=...)``.
torch's own code (``dist.all_reduce``, DDP's reducer in C++, its communication
hooks, FSDP, DeviceMesh, functional collectives) then calls the methods below.

Each method takes torch's arguments (lists of tensors, an options object whose
ranks are group ranks) and makes one call of mpidist's public API on one of the
group's two mpidist process groups:

* the *main lane*, for calls from the program's threads;
* the *side lane*, a second communicator over the same ranks, for calls made
  inside Future callbacks on the engine thread (see ``_engine.py``), so the two
  kinds of calls never need a common order.

A synchronous call (``opts.asyncOp`` False, which ``torch.distributed`` sets for
``async_op=False``) completes inside the method and returns None, as torch's
Python API allows, so the common blocking call costs no Work and no Future. An
asynchronous call returns a :class:`~mpidist.torch._work.TorchWork` that the
engine completes in the background.

Example (``mpiexec -n 2 python script.py``)::

    import torch, torch.distributed as dist
    import mpidist.torch                   # registers the "mpidist" backend
    dist.init_process_group("mpidist")
    t = torch.ones(4)
    dist.all_reduce(t)                     # tensor([2., 2., 2., 2.])
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

import _mpidist_autoload as autoload

from .. import collectives, p2p
from .._world import world
from ..barriers import monitored_barrier as _monitored_barrier
from ..groups import new_group
from ..init import destroy_process_group as _destroy
from ..init import init_process_group as _init
from ..reduce_op import foreign_op, make_premul_sum
from . import _monitored, _profiler, _sparse
from ._engine import engine
from ._work import TorchWork

__all__ = ["ProcessGroupMPIDist", "create_process_group", "BACKEND_NAME"]

BACKEND_NAME = autoload.BACKEND_NAME  # "mpidist"
"""The name torch knows mpidist's backend by: ``"mpidist"`` (``init_process_group("mpidist")``).

Examples:
    >>> import mpidist.torch
    >>> mpidist.torch.BACKEND_NAME
    'mpidist'
"""

_TorchRedOp = dist.ReduceOp.RedOpType
#: torch's reduction kinds by number -> mpidist's (``foreign_op``, looked up once: it costs ~1.5 us on torch's
#: objects; PREMUL_SUM also carries a factor, read per call)
_OPS = tuple(foreign_op(k) for k in sorted(_TorchRedOp.__members__.values(), key=lambda k: k.value))
_PREMUL = int(_TorchRedOp.PREMUL_SUM.value)
_AllreduceOptions = dist.AllreduceOptions
_ReduceOp = dist.ReduceOp
_get_ident = threading.get_ident
_UNSET = timedelta(milliseconds=-1)  # torch's kUnsetTimeout: use the group's timeout


def _hash_is_kind() -> bool:
    """Whether ``hash(ReduceOp)`` is its kind's number (torch's binding), checked on every kind once."""
    try:
        kinds = [k for k in _TorchRedOp.__members__.values() if k.value != _PREMUL]
        return all(hash(dist.ReduceOp(k)) == k.value for k in kinds)
    except Exception:  # noqa: BLE001 - a torch whose ReduceOp is built otherwise: read .op.value
        return False


#: ``opts.reduceOp.op.value`` costs 0.4 us (two pybind11 objects made); ``hash(opts.reduceOp)`` 0.1 us
_HASH_IS_KIND = _hash_is_kind()
#: mpidist's op by ``hash(opts.reduceOp)`` for the kinds that carry nothing else (not PREMUL_SUM), where
#: the hash is the kind; empty otherwise (then every call takes :func:`_op`)
_BY_HASH = {k: op for k, op in enumerate(_OPS) if op is not None and k != _PREMUL} if _HASH_IS_KIND else {}


def _op(reduce_op: Any, fn: str) -> Any:
    """mpidist's op for torch's ``opts.reduceOp`` (a ReduceOp, or a bare RedOpType); hot path."""
    kind = hash(reduce_op) if _HASH_IS_KIND and type(reduce_op) is _ReduceOp else getattr(reduce_op, "op", reduce_op).value
    if kind == _PREMUL:
        return make_premul_sum(reduce_op.factor)
    op = _OPS[kind] if 0 <= kind < len(_OPS) else None
    if op is None:
        raise ValueError(f"{fn}: unsupported reduction {reduce_op!r}")
    return op


def _allreduce_options(op: Any) -> Any:
    """Options for ``pg.allreduce(tensor)``/``pg.allreduce(tensors, op)`` (returns a Work, as torch does)."""
    opts = _AllreduceOptions()
    if op is not None:
        opts.reduceOp = op
    return opts


def _one(tensors: Any, fn: str, arg: str = "tensors") -> Any:
    """The single tensor of torch's one-per-device list (mpidist runs one device per process)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise ValueError(f"{fn}: {arg} must hold exactly one tensor per process (one device), got {len(tensors)}")
    return tensors[0]


def _devices(tensors: Sequence[Any]) -> list[Any] | None:
    """CUDA devices among ``tensors`` (a torch Future holding CUDA tensors must know them)."""
    found = {t.device for t in _flat(tensors) if t.is_cuda}
    return sorted(found, key=str) or None


def _flat(items: Any) -> list[Any]:
    if isinstance(items, torch.Tensor):
        return [items]
    out: list[Any] = []
    for x in items:
        out.extend(_flat(x))
    return out


class ProcessGroupMPIDist(dist.ProcessGroup):
    """A torch process group whose collectives run over MPI (and NCCL) through mpidist.

    Created by torch (``init_process_group("mpidist")``, ``new_group``); not by
    users. ``mpidist_group`` is the underlying :class:`mpidist.ProcessGroup`
    (its ``mpi_comm`` is the group's MPI communicator).

    Examples:
        >>> import torch.distributed as tdist
        >>> tdist.init_process_group("mpidist")  # under mpiexec -n 2
        >>> pg = tdist.group.WORLD
        >>> type(pg).__name__, pg.mpidist_group.size()
        ('ProcessGroupMPIDist', 2)
    """

    #: marks torch groups that are mpidist's (for _mpidist_autoload, which does not import this module)
    mpidist_backend = True
    #: what torch reads of the backend ``_get_backend`` returns (torch 2.14 on asks every group for one): torch's
    #: batch_isend_irecv then issues one isend/irecv per operation, as it does on gloo; torch's split_group and
    #: shrink_group refuse this group as they refuse gloo's (mpidist.split_group and shrink_group serve it)
    supports_coalescing = False
    supports_splitting = False
    supports_shrinking = False

    def __init__(self, main: Any, side: Any, backend_name: str, owns_world: bool, default: bool = False) -> None:
        super().__init__(main.rank(), main.size())
        self._main = main
        self._side = side
        self._backend_name = backend_name
        self._owns_world = owns_world
        self._default = default  # torch's default group
        self._group_name = ""
        self._group_desc = ""
        self._coalesced: list[Any] | None = None  # works between _start_coalescing and _end_coalescing
        self._closed = False

    @property
    def mpidist_group(self) -> Any:
        """The mpidist ProcessGroup of this group (its main lane).

        Examples:
            >>> tdist.group.WORLD.mpidist_group.mpi_comm.Get_size()  # after init_process_group("mpidist")
            2
        """
        return self._main

    def _lane(self) -> Any:
        return self._side if _get_ident() == engine.ident else self._main

    def _work(self, inner: Any, outputs: Any, op: str) -> TorchWork | None:
        """Wrap mpidist's Work (None: the call already completed) for torch; queue it on the engine."""
        if inner is None:
            return None
        work = TorchWork(inner if isinstance(inner, list) else [inner], outputs, op, _devices(outputs))
        if self._coalesced is not None:
            self._coalesced.append(work)
        if _get_ident() != engine.ident and engine.running():
            engine.submit(work)
        return work

    def _get_backend(self, device: Any) -> ProcessGroupMPIDist:
        """The backend torch's Python code asks a group for, per device: this group itself.

        torch's own groups hold one backend object per device type; a Python group such as this one
        holds none, so torch's ``ProcessGroup._get_backend`` raises "No backend type associated with
        device type cpu", which torch 2.14's ``batch_isend_irecv`` and ``_coalescing_manager`` reach.
        """
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        if kind not in autoload.DEVICES:
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    # -- names (DeviceMesh, FSDP and the group registry read them) ------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._backend_name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def __repr__(self) -> str:
        return (
            f"<ProcessGroupMPIDist {self._group_name!r} backend={self._backend_name} rank={self.rank()} "
            f"size={self.size()}>"
        )

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> TorchWork | None:
        if type(opts) is not _AllreduceOptions:  # pg.allreduce(tensor[, op]): torch's convenience forms
            opts = _allreduce_options(opts)
        t = tensors[0] if type(tensors) is list and len(tensors) == 1 else _one(tensors, "allreduce")
        reduce_op = opts.reduceOp
        op = _BY_HASH.get(hash(reduce_op)) if type(reduce_op) is _ReduceOp else None  # the common case, inlined
        try:
            w = collectives.all_reduce(
                t,
                _op(reduce_op, "allreduce") if op is None else op,
                self._side if _get_ident() == engine.ident else self._main,
                opts.asyncOp,
            )
        except TypeError:
            if getattr(t, "layout", None) is not torch.sparse_coo:
                raise
            _sparse.all_reduce(t, _op(opts.reduceOp, "allreduce"), self._lane())  # as gloo: gathered, summed, coalesced
            w = [] if opts.asyncOp else None  # a Work that is complete
        if w is None:
            return None
        return self._work(w, tensors if type(tensors) is list else [t], "allreduce")

    def allreduce_coalesced(self, tensors: list[Any], opts: Any) -> TorchWork | None:
        op, lane = _op(opts.reduceOp, "allreduce_coalesced"), self._lane()
        by_dtype: dict[Any, list[Any]] = {}
        for t in tensors:  # torch's coalescing manager mixes dtypes; one flat buffer per dtype
            by_dtype.setdefault(t.dtype, []).append(t)
        works = [collectives.all_reduce_coalesced(same, op, lane, True) for same in by_dtype.values()]
        return self._sync_or_work(works, tensors, opts, "allreduce_coalesced")

    def broadcast(self, tensors: Any, opts: Any) -> TorchWork | None:
        t = _one(tensors, "broadcast")
        w = collectives.broadcast(t, group=self._lane(), async_op=opts.asyncOp, group_src=opts.rootRank)
        return self._work(w, tensors, "broadcast")

    def reduce(self, tensors: Any, opts: Any) -> TorchWork | None:
        t = _one(tensors, "reduce")
        w = collectives.reduce(
            t, op=_op(opts.reduceOp, "reduce"), group=self._lane(), async_op=opts.asyncOp, group_dst=opts.rootRank
        )
        return self._work(w, tensors, "reduce")

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any) -> TorchWork | None:
        outs = _one(output_tensors, "allgather", "output_tensors")
        w = collectives.all_gather(outs, _one(input_tensors, "allgather", "input_tensors"), self._lane(), opts.asyncOp)
        return self._work(w, outs, "allgather")  # the Future holds the list of tensors, as gloo's

    def all_gather_single(self, output: Any, input: Any, opts: Any) -> TorchWork | None:
        w = collectives.all_gather_into_tensor(output, input, self._lane(), opts.asyncOp)
        return self._work(w, [output], "all_gather_single")

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any) -> TorchWork | None:
        w = collectives.all_gather_coalesced(output_lists, input_list, self._lane(), opts.asyncOp)
        return self._work(w, output_lists, "allgather_coalesced")

    def all_gather_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any) -> TorchWork | None:
        lane = self._lane()
        works = [collectives.all_gather_into_tensor(o, i, lane, True) for o, i in zip(outputs, inputs)]
        return self._sync_or_work(works, outputs, opts, "all_gather_single_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any) -> TorchWork | None:
        inp = _one(input_tensors, "gather", "input_tensors")
        root = opts.rootRank
        outs = _one(output_tensors, "gather", "output_tensors") if self.rank() == root else None
        w = collectives.gather(inp, outs, group=self._lane(), async_op=opts.asyncOp, group_dst=root)
        return self._work(w, outs or [], "gather")  # the root's list of tensors, as gloo's; [] elsewhere

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any) -> TorchWork | None:
        out = _one(output_tensors, "scatter", "output_tensors")
        root = opts.rootRank
        ins = _one(input_tensors, "scatter", "input_tensors") if self.rank() == root else None
        w = collectives.scatter(out, ins, group=self._lane(), async_op=opts.asyncOp, group_src=root)
        return self._work(w, output_tensors, "scatter")

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any) -> TorchWork | None:
        out = _one(output_tensors, "reduce_scatter", "output_tensors")
        ins = _one(input_tensors, "reduce_scatter", "input_tensors")
        w = collectives.reduce_scatter(out, ins, _op(opts.reduceOp, "reduce_scatter"), self._lane(), opts.asyncOp)
        return self._work(w, output_tensors, "reduce_scatter")

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any) -> TorchWork | None:
        w = collectives.reduce_scatter_tensor(
            output, input, _op(opts.reduceOp, "reduce_scatter_single"), self._lane(), opts.asyncOp
        )
        return self._work(w, [output], "reduce_scatter_single")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any) -> TorchWork | None:
        op, lane = _op(opts.reduceOp, "reduce_scatter_single_coalesced"), self._lane()
        works = [collectives.reduce_scatter_tensor(o, i, op, lane, True) for o, i in zip(outputs, inputs)]
        return self._sync_or_work(works, outputs, opts, "reduce_scatter_single_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self, output: Any, input: Any, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any
    ) -> TorchWork | None:
        w = collectives.all_to_all_single(
            output, input, list(output_split_sizes) or None, list(input_split_sizes) or None, self._lane(), opts.asyncOp
        )
        return self._work(w, [output], "all_to_all_single")

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[Any], input_tensors: list[Any], opts: Any) -> TorchWork | None:
        w = collectives.all_to_all(output_tensors, input_tensors, self._lane(), opts.asyncOp)
        return self._work(w, output_tensors, "alltoall")

    def barrier(self, opts: Any = None) -> TorchWork | None:
        async_op = True if opts is None else opts.asyncOp
        timeout = None if opts is None or opts.timeout == _UNSET else opts.timeout
        w = collectives.barrier(self._lane(), async_op=async_op, timeout=timeout)
        return None if w is None else self._work(w, [], "barrier")

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's barrier that names the ranks that did not arrive within ``timeout``: :func:`mpidist.monitored_barrier`."""
        _monitored_barrier(self._lane(), timeout, wait_all_ranks)

    def _sync_or_work(self, works: list[Any], outputs: Any, opts: Any, op: str) -> TorchWork | None:
        if opts.asyncOp:
            return self._work([w for w in works if w is not None], outputs, op)
        for w in works:
            if w is not None:
                w.wait()
        return None

    # -- point-to-point ----------------------------------------------------------------------
    def send(self, tensors: Any, dst_rank: int, tag: int) -> TorchWork:
        w = p2p.isend(_one(tensors, "send"), group=self._lane(), tag=tag, group_dst=dst_rank)
        return self._work(w, tensors, "send")

    def recv(self, tensors: Any, src_rank: int, tag: int) -> TorchWork:
        w = p2p.irecv(_one(tensors, "recv"), group=self._lane(), tag=tag, group_src=src_rank)
        return self._work(w, tensors, "recv")

    def recv_anysource(self, tensors: Any, tag: int) -> TorchWork:
        w = p2p.irecv(_one(tensors, "recv_anysource"), group=self._lane(), tag=tag)
        return self._work(w, tensors, "recv_anysource")

    # -- coalescing (torch's _coalescing_manager with a device) -------------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        if self._coalesced is not None:
            raise RuntimeError("ProcessGroupMPIDist._start_coalescing: already coalescing")
        self._coalesced = []

    def _end_coalescing(self, device: Any = None) -> TorchWork:
        works, self._coalesced = self._coalesced or [], None
        inner = [w for tw in works for w in tw._inner]
        return TorchWork(inner, [t for tw in works for t in _flat(tw._outputs)], "coalesced")

    # -- lifetime ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Free the group's communicators (torch's ``destroy_process_group``)."""
        if self._closed:
            return
        self._closed = True
        if self._default:
            engine.drain()  # torch's default group: finish every queued work and callback first
        for g in (self._side, None if self._owns_world else self._main):
            if g is not None and not g.destroyed:
                _destroy(g)
        if self._owns_world and world.default_pg is self._main:  # not a world that replaced it (shrink_group)
            _destroy()

    def abort(self) -> None:
        """End the job (``MPI_Abort``): MPI cannot abort one group alone."""
        from ..launch.abort import abort_process_group

        abort_process_group(self._main)


def create_process_group(
    ranks: Sequence[int], rank: int, size: int, timeout: timedelta, store: Any, backend_name: str
) -> ProcessGroupMPIDist:
    """Build the torch group over global ``ranks`` ([] for the default group); members only.

    The default group is mpidist's default group when torch starts mpidist
    (with ``store`` for worlds started without an MPI launcher, and torch's
    ``timeout``); when the program had already started mpidist, it is a new
    group over all ranks with torch's timeout (mpidist's own calls and torch's
    then never share a communicator). Other groups are made by their members
    alone (``MPI_Comm_create_group``), as torch calls the creator on members only.
    """
    if not ranks:
        owns = world.default_pg is None
        if owns:
            _init(timeout=timeout, store=store, rank=rank, world_size=size)
        everyone = world.default_pg
        if size > 0 and everyone.size() != size:
            raise ValueError(
                f"init_process_group: torch asked for a world of {size} processes but mpidist's default group "
                f"has {everyone.size()}; destroy mpidist's group first or start the job with {size} processes"
            )
        members = list(range(everyone.size()))
        main = everyone if owns else new_group(members, timeout=timeout)
    else:
        owns = False
        members = list(ranks)
        if world.default_pg is None:
            _start_for_first_group(members, timeout, store)
        main = new_group(members, timeout=timeout, use_local_synchronization=True)
    side = new_group(members, timeout=timeout, use_local_synchronization=True)
    return ProcessGroupMPIDist(main, side, backend_name, owns, default=not ranks)


def _start_for_first_group(members: list[int], timeout: timedelta, store: Any) -> None:
    """Start mpidist under the first mpidist group of a job whose torch default group runs on another backend.

    ``init_process_group("gloo")`` then ``new_group(backend="mpidist")``: starting mpidist is collective
    over the world, and torch asks only a group's members to create it, so the first mpidist group must
    span every rank (or the program starts mpidist itself first).
    """
    size = dist.get_world_size()
    if len(members) != size:
        raise RuntimeError(
            f"new_group: the first group on backend {BACKEND_NAME!r} must have every rank ({size}), got {members}: "
            f"mpidist starts on every rank at once, and torch's default group runs on {dist.get_backend()!r}. "
            f"Create new_group(backend={BACKEND_NAME!r}) over all ranks first, call mpidist.init_process_group() "
            f"on every rank first, or use init_process_group({BACKEND_NAME!r}) for the default group"
        )
    _init(timeout=timeout, store=_job_store(store), rank=dist.get_rank(), world_size=size)


def _job_store(store: Any) -> Any:
    """The job's store beneath torch's per-group prefixes, under a prefix of mpidist's own.

    Ranks may name one group differently: from torch 2.14 on, a group made by some ranks alone
    (``use_local_synchronization=True``) advances their count of groups only, so the next group over
    every rank has another name (and store prefix) on them. Starting mpidist must not depend on it.
    """
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return None if store is None else dist.PrefixStore("mpidist-start/", store)


def _create_from_options(options: Any, backend_options: Any = None) -> ProcessGroupMPIDist:
    """The creator torch calls (``extended_api=True``) with its ``_DistributedBackendOptions``."""
    return create_process_group(
        list(options.global_ranks_in_group),
        options.group_rank,
        options.group_size,
        options.timeout,
        options.store,
        BACKEND_NAME,
    )


def register() -> None:
    """Register the ``"mpidist"`` backend with torch, and the rest of ``_mpidist_autoload.install`` (idempotent).

    ``import mpidist.torch`` calls it, and so does ``import torch`` through torch's
    entry points when mpidist is installed (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
    or ``MPIDIST_TORCH_AUTOLOAD=0``). It also lets ``"mpi"`` run on mpidist where
    torch was built without MPI (see ``mpi_name_status``).

    Examples:
        >>> import mpidist.torch
        >>> mpidist.torch.register()  # again: nothing changes
        >>> import torch.distributed as tdist
        >>> tdist.Backend.MPIDIST
        'mpidist'
    """
    autoload.install()


_profiler.watch(ProcessGroupMPIDist)  # torch's profiler events (no cost while none runs: see _profiler.py)
_monitored.install(ProcessGroupMPIDist)  # dist.monitored_barrier reaches ProcessGroupMPIDist.monitored_barrier
