"""Debug levels: per-call traces (INFO) and cross-rank consistency checks (DETAIL).

``MPIDIST_DEBUG=OFF|INFO|DETAIL`` (or, when it is unset, torch's
``TORCH_DISTRIBUTED_DEBUG``) sets the level at ``init_process_group``;
``set_debug_level`` changes it at run time for every group.

* **OFF** (default): nothing is added.
* **INFO**: every call logs one line per rank on the ``mpidist`` logger (a stderr
  handler is attached if the logger has none): rank, operation, group, sequence
  number, dtype and shape, bytes and duration.
* **DETAIL**: INFO, plus before each collective the ranks of the group exchange a
  description of their call (operation, sequence number, root, reduction,
  dtypes and sizes) on the group's private communicator, bounded by its
  timeout. If they disagree, every rank raises the same :class:`DistError`
  listing what each rank called, e.g.
  ``rank 0: broadcast float64[4] src=0 / rank 1: all_reduce float64[4] op=SUM``,
  before any data moves, so the group is still usable afterwards.

Both work through :class:`DebugBackend`, a wrapper each group makes for each of
its backends (as torch's ProcessGroupWrapper) and calls through while the level
is above OFF; at OFF the group calls its plain backends (one attribute test per call).
"""

from __future__ import annotations

import logging
import os
import time
from enum import IntEnum
from typing import Any, Callable, Sequence

import numpy as np

from .._object_wire import gather_all
from .._world import world
from ..backends.base import BaseBackend, PersistentPlan, WrapperBackend
from ..errors import DistError
from ..work import Work

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env", "DebugBackend"]

logger = logging.getLogger("mpidist")


class DebugLevel(IntEnum):
    """How much mpidist checks and reports (torch's ``DebugLevel``).

    ``OFF`` (the default) checks each rank's own arguments only. ``INFO`` logs
    one line per call (the ``mpidist`` logger, to stderr when nothing else
    handles it). ``DETAIL`` also compares every call's description across the
    ranks of the group before any data moves (the collective, sizes, dtypes,
    roots, ops) and raises the same error on every rank when they do not fit
    together: it costs an extra exchange per call. Set it with
    ``MPIDIST_DEBUG`` or ``TORCH_DISTRIBUTED_DEBUG``, or ``set_debug_level``.

    Examples:
        >>> dist.DebugLevel.DETAIL
        <DebugLevel.DETAIL: 2>
        >>> dist.DebugLevel["INFO"] > dist.DebugLevel.OFF
        True
    """

    OFF = 0
    INFO = 1
    DETAIL = 2


def _parse(level: Any, fn: str) -> DebugLevel:
    if isinstance(level, DebugLevel):
        return level
    if isinstance(level, str):
        name = level.strip().upper()
        if name in DebugLevel.__members__:
            return DebugLevel[name]
        raise ValueError(f"{fn}: debug level {level!r} is not one of OFF, INFO, DETAIL")
    if hasattr(level, "__index__") and not isinstance(level, bool):
        level = level.__index__()
        try:
            return DebugLevel(level)
        except ValueError:
            raise ValueError(f"{fn}: debug level {level} is not one of 0 (OFF), 1 (INFO), 2 (DETAIL)") from None
    raise TypeError(f"{fn}: level must be a DebugLevel, its name or its number, got {type(level).__name__}")


def get_debug_level() -> DebugLevel:
    """Return the current debug level.

    Returns:
        The ``DebugLevel`` every group uses now.

    Examples:
        >>> dist.get_debug_level()  # MPIDIST_DEBUG unset
        <DebugLevel.OFF: 0>
    """
    return world.debug_level


def set_debug_level(level: DebugLevel | str | int) -> None:
    """Set the debug level for every existing and future group (every rank should set the same).

    Above ``OFF`` it also makes the ``mpidist`` logger print INFO lines to
    stderr when no logging handler is configured.

    Args:
        level: A ``DebugLevel``, its name (any case) or its number.

    Raises:
        TypeError: ``level`` is none of those.
        ValueError: a name or number that is not a level.

    Examples:
        >>> dist.set_debug_level(dist.DebugLevel.DETAIL)  # or "DETAIL", or 2
        >>> dist.get_debug_level()
        <DebugLevel.DETAIL: 2>
        >>> dist.set_debug_level("off")
    """
    world.debug_level = _parse(level, "set_debug_level")
    if world.debug_level > DebugLevel.OFF:
        logger.setLevel(logging.INFO)
        if not logger.hasHandlers():  # nobody logs anywhere: print to stderr ourselves
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)


def set_debug_level_from_env() -> None:
    """Set the level from ``MPIDIST_DEBUG``, else ``TORCH_DISTRIBUTED_DEBUG``, else OFF.

    ``init_process_group`` calls it; call it again after changing the variables.

    Raises:
        ValueError: the variable is set to something other than OFF, INFO or
            DETAIL (any case).

    Examples:
        >>> import os
        >>> os.environ["MPIDIST_DEBUG"] = "INFO"
        >>> dist.set_debug_level_from_env()
        >>> dist.get_debug_level()
        <DebugLevel.INFO: 1>
        >>> del os.environ["MPIDIST_DEBUG"]
        >>> dist.set_debug_level_from_env()
    """
    for var in ("MPIDIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        value = os.environ.get(var)
        if value is not None and value.strip():
            try:
                set_debug_level(value)
            except ValueError:
                raise ValueError(f"{var}={value!r} must be OFF, INFO or DETAIL") from None
            return
    set_debug_level(DebugLevel.OFF)


def _arr(a: np.ndarray | None) -> str:
    if a is None:
        return "-"
    return f"{a.dtype.name}[{', '.join(str(int(s)) for s in a.shape)}]"


def _op_name(op: Any) -> str:
    base = getattr(op, "op", op)
    return getattr(base, "name", str(base))


#: the errors a failed check raises, by name: the other ranks raise the same kind (DETAIL)
_ERROR_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


class Call:
    """What one rank passed to one collective, in plain data (sent to the other ranks)."""

    __slots__ = ("op", "seq", "text", "root", "reduce", "dtype", "size", "sizes", "other", "error")

    def __init__(self, op: str, seq: int, text: str, root: int | None = None, reduce: str | None = None,
                 dtype: str = "", size: int = 0, sizes: Sequence[int] = (), other: Any = None,
                 error: tuple[str, str] | None = None) -> None:  # fmt: skip
        self.op, self.seq, self.text = op, seq, text
        self.root, self.reduce, self.dtype, self.size = root, reduce, dtype, size
        self.sizes = list(sizes)
        self.other = other
        self.error = error  # (exception type name, message): this rank's arguments failed a check only it makes

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)


def _listing(calls: list[Call]) -> str:
    return " / ".join(f"rank {i}: {c.text}" for i, c in enumerate(calls))


def _rule_same(field: str, what: str) -> Callable[[list[Call]], str | None]:
    def rule(calls: list[Call]) -> str | None:
        if len({getattr(c, field) for c in calls}) > 1:
            return f"the ranks passed different {what}"
        return None

    return rule


def _transposed(field_in: str, field_out: str, what: str) -> Callable[[list[Call]], str | None]:
    """Rank i's ``field_in[j]`` must equal rank j's ``field_out[i]`` (sizes exchanged pairwise)."""

    def rule(calls: list[Call]) -> str | None:
        for i, ci in enumerate(calls):
            for j, cj in enumerate(calls):
                sent, room = getattr(ci, field_in)[j], getattr(cj, field_out)[i]
                if sent != room:
                    return f"{what}: rank {i} sends {sent} elements to rank {j}, which expects {room}"
        return None

    return rule


def _rooted(what: str) -> Callable[[list[Call]], str | None]:
    """The root's ``sizes[i]`` (its list) must equal rank i's ``size``."""

    def rule(calls: list[Call]) -> str | None:
        root = calls[0].root
        if root is None or not 0 <= root < len(calls) or not calls[root].sizes:
            return None
        for i, c in enumerate(calls):
            if calls[root].sizes[i] != c.size:
                return f"{what}: the root's array for rank {i} has {calls[root].sizes[i]} elements, rank {i}'s has {c.size}"
        return None

    return rule


def _all_gather_slots(calls: list[Call]) -> str | None:
    """Every rank's slot i must have rank i's input size."""
    for i, c in enumerate(calls):
        for j, other in enumerate(calls):
            if other.sizes[i] != c.size:
                return f"all_gather: rank {j} expects {other.sizes[i]} elements from rank {i}, which sends {c.size}"
    return None


def _reduce_scatter_blocks(calls: list[Call]) -> str | None:
    """Every rank's inputs must have the same sizes, and input j rank j's output size."""
    for i, c in enumerate(calls):
        if c.sizes != calls[0].sizes:
            return f"reduce_scatter: rank {i}'s inputs have sizes {c.sizes}, rank 0's {calls[0].sizes}"
    for j, c in enumerate(calls):
        if calls[0].sizes[j] != c.size:
            return f"reduce_scatter: the inputs for rank {j} have {calls[0].sizes[j]} elements, its output {c.size}"
    return None


_SAME_ROOT = _rule_same("root", "roots (src/dst)")
_SAME_OP = _rule_same("reduce", "reduction ops")
_SAME_DTYPE = _rule_same("dtype", "dtypes")
_SAME_SIZE = _rule_same("size", "array sizes")

#: What must agree between the ranks' calls, per collective (after op and sequence number).
RULES: dict[str, list[Callable[[list[Call]], str | None]]] = {
    "broadcast": [_SAME_ROOT, _SAME_DTYPE, _SAME_SIZE],
    "all_reduce": [_SAME_OP, _SAME_DTYPE, _SAME_SIZE],
    "reduce": [_SAME_ROOT, _SAME_OP, _SAME_DTYPE, _SAME_SIZE],
    "all_gather_into_tensor": [_SAME_DTYPE, _SAME_SIZE],
    "reduce_scatter_tensor": [_SAME_OP, _SAME_DTYPE, _SAME_SIZE],
    "all_to_all_single": [_SAME_DTYPE, _transposed("sizes", "other", "all_to_all_single splits")],
    "all_gather": [_SAME_DTYPE, _all_gather_slots],
    "gather": [_SAME_ROOT, _SAME_DTYPE, _rooted("gather")],
    "scatter": [_SAME_ROOT, _SAME_DTYPE, _rooted("scatter")],
    "reduce_scatter": [_SAME_OP, _SAME_DTYPE, _reduce_scatter_blocks],
    "all_to_all": [_SAME_DTYPE, _transposed("sizes", "other", "all_to_all")],
    "barrier": [],
}
# a persistent collective's creation must agree as the one-off call does (its starts: by op and creation number)
for _name in ("broadcast", "all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
              "all_to_all_single"):  # fmt: skip
    RULES[f"{_name}_init"] = RULES[_name]


def verdict(calls: list[Call]) -> str | None:
    """Return why the ranks' calls do not fit together, or None if they do."""
    first = calls[0]
    if any(c.op != first.op for c in calls):
        return "the ranks called different collectives"
    if any(c.seq != first.seq for c in calls):
        return "the ranks are at different calls of this group (sequence numbers differ)"
    for rule in RULES.get(first.op, []):
        reason = rule(calls)
        if reason:
            return reason
    return None


#: what the timeout error of a call adds when the time ran out in DETAIL's check of it
_CHECK_TIMED_OUT = (
    "The time ran out while the ranks compared their calls (debug level DETAIL checks each call), "
    "before this call started."
)


class _AsCall:
    """The group's control backend as DETAIL's check of one call uses it: waited for as that call.

    ``gather_all`` moves the ranks' descriptions through this object. A rank
    waits in the exchange because a peer has not reached the call yet, so the
    wait is the user's call: the control's Works are relabelled and owned by this
    object, so that this rank reports that call (operation, the user's group,
    the group's sequence number) to a rank that asks what it waits in, and a
    timeout raises the error the call raises at debug level OFF, with
    ``_CHECK_TIMED_OUT`` added. The control backend keeps what MPI still uses
    (``DebugBackend.pending`` counts it).
    """

    __slots__ = ("debug", "control", "op", "seq", "limit", "size", "global_ranks", "group_name", "spins")

    def __init__(self, debug: DebugBackend, op: str, seq: int, limit: float | None) -> None:
        control = debug.pg.control
        self.debug, self.control, self.op, self.seq = debug, control, op, seq
        self.limit = limit  # the call's own timeout (barrier(timeout=...)), if not the group's
        self.size, self.global_ranks = control.size, control.global_ranks  # what gather_all reads
        self.group_name, self.spins = debug.group_name, control.spins  # what a Work reads of its owner

    # -- gather_all's calls: the control's, waited for as the user's call
    def all_gather_into_tensor(self, out: np.ndarray, backs: Any, inp: np.ndarray, async_op: bool) -> Any:
        return self._as_call(self.control.all_gather_into_tensor(out, backs, inp, True), async_op)

    def all_gather(self, outs: Sequence[np.ndarray], backs: Any, inp: np.ndarray, async_op: bool) -> Any:
        return self._as_call(self.control.all_gather(outs, backs, inp, True), async_op)

    def _as_call(self, work: Work, async_op: bool) -> Work | None:
        work.act_as(self, self.op, self.seq)
        if self.limit is not None:
            work.default_timeout(self.limit)
        if async_op:
            return work
        work.wait()
        return None

    # -- what a Work asks of its owner
    def timeout_failure(self, op: str, seq: int, timeout_s: float, note: str = "", settled: bool = False) -> Any:
        return self.debug.timeout_failure(op, seq, timeout_s, f"{_CHECK_TIMED_OUT} {note}".strip(), settled)

    def backend_error(self, op: str, seq: int, exc: BaseException) -> Any:
        return self.debug.backend_error(op, seq, exc)

    def keep_stuck(self, reqs: Any, keep: Any) -> None:
        self.control.keep_stuck(reqs, keep)

    def adopt(self, reqs: Any, keep: Any) -> None:
        self.control.adopt(reqs, keep)


class DebugBackend(WrapperBackend):
    """Wraps one backend of a group: traces each call (INFO) and checks it across ranks (DETAIL).

    Every group makes one for each of its backends when it makes the backend, and
    routes calls through it while the debug level is above OFF (as torch's
    ProcessGroupWrapper does); at OFF the group calls the plain backend.
    """

    def __init__(self, inner: BaseBackend, pg: Any) -> None:
        super().__init__(inner)
        self.pg = pg

    def _run(self, call: Call, nbytes: int, start: Callable[[], Any], mode: str | None = None,
             label: str | None = None, limit: float | None = None) -> Any:  # fmt: skip
        if world.debug_level >= DebugLevel.DETAIL:
            self._check(call, label, limit)
        t0 = time.perf_counter()
        result = start()
        if world.debug_level >= DebugLevel.INFO:
            took = time.perf_counter() - t0
            if mode is None:
                mode = " (async, posted)" if result is not None else ""
            logger.info(
                f"[rank {self.pg.ranks[self.inner.rank]}] group={self.pg.group_name} #{call.seq} "
                f"{call.text} {nbytes} B {took * 1e6:.1f} us{mode}"
            )
        return result

    def _check(self, call: Call, label: str | None = None, limit: float | None = None) -> None:
        """Compare ``call`` with the other ranks' calls; ``label``: the call's name in a timeout error, if not its op.

        The exchange runs on the group's control backend, waited for as the user's call (:class:`_AsCall`):
        within ``limit`` seconds, the call's own timeout, if given, else the group's.
        """
        calls = gather_all(_AsCall(self, label or call.op, call.seq, limit), call)
        failed = [(i, c.error) for i, c in enumerate(calls) if c.error is not None]
        if failed:
            if call.error is not None:
                return  # the rank that failed raises its own exception (ProcessGroup.failed_alone)
            i, (kind, text) = failed[0]
            raise _ERROR_KINDS.get(kind, DistError)(
                f"{text} (raised on rank {self.pg.ranks[i]}, and on every rank of group {self.pg.group_name} "
                "with it; nothing was sent, the group is still usable)"
            )
        reason = verdict(calls)
        if reason:
            raise DistError(
                f"{call.op} (call #{call.seq}) on group {self.pg.group_name}: {reason}: {_listing(calls)}. "
                "Nothing was sent; the group is still usable."
            )

    def pending(self) -> bool:
        """The inner backend's pending calls, and an exchange of a DETAIL check that timed out (on the control)."""
        return self.inner.pending() or self.pg.control.pending()

    def share_failure(self, op: str, exc: Exception) -> None:
        """Put this rank's failed check of call ``op`` into the DETAIL exchange the other ranks are in."""
        error = (type(exc).__name__, str(exc))
        self._check(self._call(op, f"(failed: {error[0]}: {error[1]})", error=error))

    def _call(self, op: str, text: str, **kw: Any) -> Call:
        return Call(op, self.inner.calls_issued() + 1, f"{op} {text}".strip(), **kw)

    # -- what each collective's call looks like (shared by the one-off call and its *_init) --
    def _broadcast_call(self, fn: str, buf: np.ndarray, root: int) -> Call:
        return self._call(fn, f"{_arr(buf)} src={self.pg.ranks[root]}", root=root, dtype=buf.dtype.name, size=buf.size)

    def _all_reduce_call(self, fn: str, buf: np.ndarray, op: Any) -> Call:
        r = _op_name(op)
        return self._call(fn, f"{_arr(buf)} op={r}", reduce=r, dtype=buf.dtype.name, size=buf.size)

    def _reduce_call(self, fn: str, buf: np.ndarray, op: Any, root: int) -> Call:
        r = _op_name(op)
        return self._call(fn, f"{_arr(buf)} op={r} dst={self.pg.ranks[root]}", root=root, reduce=r,
                          dtype=buf.dtype.name, size=buf.size)  # fmt: skip

    def _all_gather_into_tensor_call(self, fn: str, out: np.ndarray, inp: np.ndarray) -> Call:
        return self._call(fn, f"{_arr(inp)} -> {_arr(out)}", dtype=inp.dtype.name, size=inp.size)

    def _reduce_scatter_tensor_call(self, fn: str, out: np.ndarray, inp: np.ndarray, op: Any) -> Call:
        r = _op_name(op)
        return self._call(fn, f"{_arr(inp)} -> {_arr(out)} op={r}", reduce=r, dtype=inp.dtype.name, size=inp.size)

    def _all_to_all_single_call(self, fn: str, out: np.ndarray, inp: np.ndarray, out_counts: Any,
                                in_counts: Any) -> Call:  # fmt: skip
        n = self.inner.size
        sent = list(in_counts) if in_counts is not None else [inp.size // n] * n
        room = list(out_counts) if out_counts is not None else [out.size // n] * n
        return self._call(fn, f"{_arr(inp)} -> {_arr(out)}", dtype=inp.dtype.name, size=inp.size,
                          sizes=sent, other=room)  # fmt: skip

    # -- collectives -------------------------------------------------------------------
    def broadcast(self, buf: np.ndarray, backs: Any, root: int, async_op: bool) -> Any:
        call = self._broadcast_call("broadcast", buf, root)
        return self._run(call, buf.nbytes, lambda: self.inner.broadcast(buf, backs, root, async_op))

    def all_reduce(self, buf: np.ndarray, backs: Any, op: Any, async_op: bool) -> Any:
        call = self._all_reduce_call("all_reduce", buf, op)
        return self._run(call, buf.nbytes, lambda: self.inner.all_reduce(buf, backs, op, async_op))

    def reduce(self, buf: np.ndarray, backs: Any, op: Any, root: int, async_op: bool) -> Any:
        call = self._reduce_call("reduce", buf, op, root)
        return self._run(call, buf.nbytes, lambda: self.inner.reduce(buf, backs, op, root, async_op))

    def all_gather(self, outs: Sequence[np.ndarray], backs: Any, inp: np.ndarray, async_op: bool) -> Any:
        call = self._call("all_gather", f"{_arr(inp)} into {len(outs)} arrays", dtype=inp.dtype.name, size=inp.size,
                          sizes=[o.size for o in outs])  # fmt: skip
        return self._run(call, inp.nbytes, lambda: self.inner.all_gather(outs, backs, inp, async_op))

    def all_gather_into_tensor(self, out: np.ndarray, backs: Any, inp: np.ndarray, async_op: bool) -> Any:
        call = self._all_gather_into_tensor_call("all_gather_into_tensor", out, inp)
        return self._run(call, inp.nbytes, lambda: self.inner.all_gather_into_tensor(out, backs, inp, async_op))

    def gather(self, inp: np.ndarray, outs: Any, backs: Any, root: int, async_op: bool) -> Any:
        sizes = [o.size for o in outs] if outs is not None else []
        call = self._call(
            "gather",
            f"{_arr(inp)} dst={self.pg.ranks[root]}",
            root=root,
            dtype=inp.dtype.name,
            size=inp.size,
            sizes=sizes,
        )
        return self._run(call, inp.nbytes, lambda: self.inner.gather(inp, outs, backs, root, async_op))

    def scatter(self, out: np.ndarray, backs: Any, ins: Any, root: int, async_op: bool) -> Any:
        sizes = [a.size for a in ins] if ins is not None else []
        call = self._call(
            "scatter",
            f"{_arr(out)} src={self.pg.ranks[root]}",
            root=root,
            dtype=out.dtype.name,
            size=out.size,
            sizes=sizes,
        )
        return self._run(call, out.nbytes, lambda: self.inner.scatter(out, backs, ins, root, async_op))

    def reduce_scatter(self, out: np.ndarray, backs: Any, ins: Sequence[np.ndarray], op: Any, async_op: bool) -> Any:
        r = _op_name(op)
        call = self._call("reduce_scatter", f"{len(ins)} arrays -> {_arr(out)} op={r}", reduce=r, dtype=out.dtype.name,
                          size=out.size, sizes=[a.size for a in ins])  # fmt: skip
        return self._run(call, out.nbytes, lambda: self.inner.reduce_scatter(out, backs, ins, op, async_op))

    def reduce_scatter_tensor(self, out: np.ndarray, backs: Any, inp: np.ndarray, op: Any, async_op: bool) -> Any:
        call = self._reduce_scatter_tensor_call("reduce_scatter_tensor", out, inp, op)
        return self._run(call, inp.nbytes, lambda: self.inner.reduce_scatter_tensor(out, backs, inp, op, async_op))

    def all_to_all_single(self, out: np.ndarray, backs: Any, inp: np.ndarray, out_counts: Any, in_counts: Any,
                          async_op: bool) -> Any:  # fmt: skip
        call = self._all_to_all_single_call("all_to_all_single", out, inp, out_counts, in_counts)
        return self._run(
            call, inp.nbytes, lambda: self.inner.all_to_all_single(out, backs, inp, out_counts, in_counts, async_op)
        )

    def all_to_all(self, outs: Sequence[np.ndarray], backs: Any, ins: Sequence[np.ndarray], async_op: bool) -> Any:
        dtype = ins[0].dtype.name if ins else ""
        sent, room = [a.size for a in ins], [o.size for o in outs]
        call = self._call("all_to_all", f"{dtype} sizes {sent} -> {room}", dtype=dtype, sizes=sent, other=room)
        return self._run(call, sum(a.nbytes for a in ins), lambda: self.inner.all_to_all(outs, backs, ins, async_op))

    def barrier(self, async_op: bool) -> Any:
        return self._run(self._call("barrier", ""), 0, lambda: self.inner.barrier(async_op))

    def timed_barrier(self, timeout_s: float) -> Any:
        return self._run(self._call("barrier", ""), 0, lambda: self.inner.timed_barrier(timeout_s), limit=timeout_s)

    # -- persistent operations: creation checked like a call; starts traced and checked ----------
    def _create(self, call: Call, nbytes: int, make: Callable[[], PersistentPlan]) -> PersistentPlan:
        """Check (DETAIL) and log (INFO) the creation of a persistent collective; label the plan for its starts."""
        plan = self._run(call, nbytes, make, " (persistent, created)")
        plan.debug, plan.text, plan.nbytes = self, call.text, nbytes
        return plan

    def start_persistent(self, plan: PersistentPlan, go: Callable[[], Any]) -> None:
        """Run ``go()``, one start of ``plan``, while the debug level is above OFF: logged at INFO; at DETAIL the
        ranks first compare what they start (collectives only: a send and its receive legitimately differ)."""
        if plan.p2p:
            self._trace(f"start of {plan.text} (p2p#{plan.seq})", plan.nbytes, go, " (started)")
            return
        call = Call(f"start of {plan.op}", plan.seq, f"start of {plan.text}")
        self._run(call, plan.nbytes, go, " (started)", label=plan.op)  # a timeout names it as at OFF

    def broadcast_init(self, buf: np.ndarray, backs: Any, root: int) -> PersistentPlan:
        call = self._broadcast_call("broadcast_init", buf, root)
        return self._create(call, buf.nbytes, lambda: self.inner.broadcast_init(buf, backs, root))

    def all_reduce_init(self, buf: np.ndarray, backs: Any, op: Any) -> PersistentPlan:
        call = self._all_reduce_call("all_reduce_init", buf, op)
        return self._create(call, buf.nbytes, lambda: self.inner.all_reduce_init(buf, backs, op))

    def reduce_init(self, buf: np.ndarray, backs: Any, op: Any, root: int) -> PersistentPlan:
        call = self._reduce_call("reduce_init", buf, op, root)
        return self._create(call, buf.nbytes, lambda: self.inner.reduce_init(buf, backs, op, root))

    def all_gather_into_tensor_init(self, out: np.ndarray, backs: Any, inp: np.ndarray) -> PersistentPlan:
        call = self._all_gather_into_tensor_call("all_gather_into_tensor_init", out, inp)
        return self._create(call, inp.nbytes, lambda: self.inner.all_gather_into_tensor_init(out, backs, inp))

    def reduce_scatter_tensor_init(self, out: np.ndarray, backs: Any, inp: np.ndarray, op: Any) -> PersistentPlan:
        call = self._reduce_scatter_tensor_call("reduce_scatter_tensor_init", out, inp, op)
        return self._create(call, inp.nbytes, lambda: self.inner.reduce_scatter_tensor_init(out, backs, inp, op))

    def all_to_all_single_init(self, out: np.ndarray, backs: Any, inp: np.ndarray, out_counts: Any,
                               in_counts: Any) -> PersistentPlan:  # fmt: skip
        call = self._all_to_all_single_call("all_to_all_single_init", out, inp, out_counts, in_counts)
        return self._create(
            call, inp.nbytes, lambda: self.inner.all_to_all_single_init(out, backs, inp, out_counts, in_counts)
        )

    def send_init(self, buf: np.ndarray, peer: int, tag: int) -> PersistentPlan:
        plan = self._trace_p2p("send_init", buf, peer, tag, lambda: self.inner.send_init(buf, peer, tag),
                               " (persistent, created)")  # fmt: skip
        plan.debug, plan.text, plan.nbytes = self, self._p2p_text("send_init", buf, peer, tag), buf.nbytes
        return plan

    def recv_init(self, buf: np.ndarray, backs: Any, peer: int | None, tag: int) -> PersistentPlan:
        plan = self._trace_p2p("recv_init", buf, peer, tag, lambda: self.inner.recv_init(buf, backs, peer, tag),
                               " (persistent, created)")  # fmt: skip
        plan.debug, plan.text, plan.nbytes = self, self._p2p_text("recv_init", buf, peer, tag), buf.nbytes
        return plan

    # -- point-to-point (traced, not checked: ranks legitimately differ) -----------------
    def send(self, buf: np.ndarray, peer: int, tag: int) -> Any:
        return self._trace_p2p("send", buf, peer, tag, lambda: self.inner.send(buf, peer, tag))

    def recv(self, buf: np.ndarray, backs: Any, peer: int | None, tag: int) -> Any:
        return self._trace_p2p("recv", buf, peer, tag, lambda: self.inner.recv(buf, backs, peer, tag))

    def recv_blocking(self, buf: np.ndarray, backs: Any, peer: int | None, tag: int) -> Any:
        return self._trace_p2p("recv", buf, peer, tag, lambda: self.inner.recv_blocking(buf, backs, peer, tag))

    def send_and_wait(self, buf: np.ndarray, peer: int, tag: int) -> None:
        self._trace_p2p("send", buf, peer, tag, lambda: self.inner.send_and_wait(buf, peer, tag))

    def recv_and_wait(self, buf: np.ndarray, backs: Any, peer: int | None, tag: int) -> int:
        return self._trace_p2p("recv", buf, peer, tag, lambda: self.inner.recv_and_wait(buf, backs, peer, tag))

    def _p2p_text(self, op: str, buf: np.ndarray, peer: int | None, tag: int) -> str:
        return f"{op} {_arr(buf)} peer={'any' if peer is None else self.pg.ranks[peer]} tag={tag}"

    def _trace_p2p(self, op: str, buf: np.ndarray, peer: int | None, tag: int, start: Callable[[], Any],
                   mode: str = " (posted)") -> Any:  # fmt: skip
        t0 = time.perf_counter()
        work = start()
        if world.debug_level >= DebugLevel.INFO:
            logger.info(
                f"[rank {self.pg.ranks[self.inner.rank]}] {op} group={self.pg.group_name} p2p#{self.inner.p2p_calls_issued()} "
                f"{_arr(buf)} peer={'any' if peer is None else self.pg.ranks[peer]} tag={tag} {buf.nbytes} B "
                f"{(time.perf_counter() - t0) * 1e6:.1f} us{mode}"
            )
        return work

    def _trace(self, text: str, nbytes: int, start: Callable[[], Any], mode: str) -> None:
        t0 = time.perf_counter()
        start()
        if world.debug_level >= DebugLevel.INFO:
            logger.info(
                f"[rank {self.pg.ranks[self.inner.rank]}] group={self.pg.group_name} {text} {nbytes} B "
                f"{(time.perf_counter() - t0) * 1e6:.1f} us{mode}"
            )
