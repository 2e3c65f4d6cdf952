"""float16 and bfloat16 reductions at memory speed: MPI user-defined ops from C (``_halfops.c``).

MPICH reduces ``MPI_FLOAT16_T`` in a slow software loop (measured: 17 ms for 1M
numbers, 30-50x its float32 sum), its ``MPI_BFLOAT16_T`` is null, and Open MPI 5 has
neither type. The C module makes MPI ops (``MPI_Op_create``, commutative) that
reduce the 2-byte numbers where they are: SUM and PROD combine each pair in
float32 and round back to nearest even (the correctly rounded result, as numpy
and ml_dtypes compute one element), MIN and MAX follow mpidist's float rule (NaN
wins and becomes the default quiet NaN, -0 < +0; see ``reduce_op.to_order_keys``),
and :meth:`HalfOps.divide` is AVG's division. The MPI backend's type table
(``mpi.py``) uses them for every host array of these dtypes: no widening copy, no
order keys, one MPI call.

They are made once per process, when the MPI backend first builds its type table
(never at ``import mpidist``), from the MPI library mpi4py loaded (``MPI_Op_create``
found with dlsym, as ``backends/_direct.c`` finds its functions), checked against
numpy with ``MPI_Reduce_local``, and left to ``MPI_Finalize`` to free. Where the C
module was not built, the check fails, or ``MPIDIST_HALF_OPS=0``, mpidist reduces
as before (MPI's float16 type, or a float32 copy); :func:`halfops_status` says which.

Example (``mpiexec -n 1``, after ``init_process_group``)::

    >>> ops = half_ops(np.dtype(np.float16))
    >>> a, b = np.array([1.5, -2.0], np.float16), np.array([0.25, 4.0], np.float16)
    >>> ops.by_prim[Prim.SUM].Reduce_local([a, MPI.UINT16_T], [b, MPI.UINT16_T]); b
    array([1.75, 2.  ], dtype=float16)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .._validate import c_extension_refused
from ..arrays.dtypes import BFLOAT16
from ..reduce_op import Prim

__all__ = ["HalfOps", "half_ops", "halfops_status", "HALF_DTYPES"]

#: the dtypes the C ops reduce, by name
HALF_DTYPES = ("float16", "bfloat16")
_PRIMS = (Prim.SUM, Prim.PROD, Prim.MIN, Prim.MAX)  # the order of _halfops.create's handles, per dtype


class HalfOps:
    """The C reductions of one 2-byte float dtype: MPI ops by primitive, and AVG's division."""

    __slots__ = ("by_prim", "_divide", "_bf16")

    def __init__(self, by_prim: dict[Prim, MPI.Op], divide: Any, bf16: bool) -> None:
        self.by_prim = by_prim  # Prim.SUM, PROD, MIN, MAX -> MPI.Op
        self._divide = divide
        self._bf16 = bf16

    def divide(self, a: np.ndarray, n: int) -> None:
        """AVG's division of a summed C-contiguous array in place, rounded as numpy's float16 division rounds."""
        self._divide(a.reshape(-1).view(np.uint16), n, self._bf16)


class _State:
    """What this process decided (once): the ops by dtype name, or why there are none."""

    __slots__ = ("ops", "reason", "loops")

    def __init__(self, ops: dict[str, HalfOps], reason: str, loops: str = "") -> None:
        self.ops = ops
        self.reason = reason
        self.loops = loops


#: decided once per process, when the MPI backend first asks. Not in ``_world.world``: the MPI ops outlive
#: ``destroy_process_group`` (MPI stays initialized), so a reset must not forget and make them again.
_state: _State | None = None


def half_ops(dtype: np.dtype) -> HalfOps | None:
    """The C reductions for ``dtype`` (float16, bfloat16), or None where they are not used (MPI must be initialized)."""
    return _decide().ops.get(dtype.name)


def halfops_status() -> str:
    """How this process reduces float16 and bfloat16: ``"C ops (<loops>)"`` or ``"off (<why>)"``.

    Example::

        >>> halfops_status()
        'C ops (float16: F16C, bfloat16: AVX2)'
    """
    if _state is None and not MPI.Is_initialized():
        return "undecided (MPI is not initialized)"
    state = _decide()
    return f"C ops ({state.loops})" if state.ops else f"off ({state.reason})"


def _decide() -> _State:
    global _state
    if _state is None:
        _state = _make()
    return _state


def _make() -> _State:
    refused = c_extension_refused("MPIDIST_HALF_OPS")
    if refused:
        return _State({}, refused)
    try:
        from . import _halfops
    except ImportError as exc:
        return _State({}, f"the C module was not built: {exc}")
    size = getattr(MPI, "_sizeof", None)
    if size is None or size(MPI.Op) not in (4, 8) or size(MPI.Datatype) != size(MPI.Op):
        return _State({}, "this mpi4py does not say the size of MPI handles")
    try:
        handles = _halfops.create(MPI.__file__, size(MPI.Op) == 4)
    except (OSError, RuntimeError) as exc:
        return _State({}, str(exc))
    ops = {}
    for k, name in enumerate(HALF_DTYPES):
        by_prim = {p: MPI.Op.fromhandle(h) for p, h in zip(_PRIMS, handles[4 * k : 4 * k + 4])}
        ops[name] = HalfOps(by_prim, _halfops.divide, name == "bfloat16")
    problem = _self_check(ops)
    if problem:
        return _State({}, problem)
    return _State(ops, "", f"float16: {_halfops.float16_loops}, bfloat16: {_halfops.bfloat16_loops}")


def _self_check(ops: dict[str, HalfOps]) -> str:
    """Reduce a few numbers with each op (``MPI_Reduce_local``) and compare with numpy; '' if all agree."""
    a = [1.5, -2.0, 3.0, 0.0, -0.0, 7.0, float("inf"), 0.1]
    b = [0.25, 4.0, 3.0, -0.0, 0.0, -9.0, 1.0, 0.2]
    for name, half in ops.items():
        dtype = np.dtype(np.float16) if name == "float16" else BFLOAT16
        if dtype is None:
            continue
        x, y = np.array(a, dtype), np.array(b, dtype)
        wide_x, wide_y = x.astype(np.float32), y.astype(np.float32)
        expect = {
            Prim.SUM: (wide_x + wide_y).astype(dtype),
            Prim.PROD: (wide_x * wide_y).astype(dtype),
            Prim.MIN: np.array([0.25, -2.0, 3.0, -0.0, -0.0, -9.0, 1.0, 0.1], dtype),
            Prim.MAX: np.array([1.5, 4.0, 3.0, 0.0, 0.0, 7.0, float("inf"), 0.2], dtype),
        }
        for prim, op in half.by_prim.items():
            got = y.copy()
            try:
                op.Reduce_local([x.view(np.uint16), MPI.UINT16_T], [got.view(np.uint16), MPI.UINT16_T])
            except MPI.Exception as exc:
                return f"a check with MPI_Reduce_local failed: {exc}"
            if got.tobytes() != expect[prim].tobytes():
                return f"a check of {prim.name} on {name} with MPI_Reduce_local gave another result than numpy"
        halved = (wide_x + wide_y).astype(dtype)
        half.divide(halved, 2)
        if halved.tobytes() != ((wide_x + wide_y).astype(dtype).astype(np.float32) / 2).astype(dtype).tobytes():
            return f"a check of the division on {name} gave another result than numpy"
    return ""
