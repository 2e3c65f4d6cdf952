"""What this process's MPI library does with each dtype, probed at run time, and the limits of its calls.

The MPI backend's type table (:func:`type_table`): for every supported numpy dtype
the MPI datatype that moves it and, per :class:`~mpidist.reduce_op.RedOpType`,
whether one MPI call reduces it. Each reduction is checked with
``MPI_Reduce_local`` once per process: float16 and bfloat16 move as their native
MPI types where the library has them and as same-size unsigned integers
otherwise. They reduce with mpidist's own MPI ops (``halfops.py``: C, at memory
speed, on the 2-byte numbers); where those are not built or are switched off, a
reduction the library cannot do on them natively runs on a float32 copy that is
rounded back (``mpi_reductions.py``).

The limits of the library's calls that the backend's modules share are defined
here once: whether counts and displacements are 64-bit (MPI-4), and the size at
which reduce_scatter switches MPI calls.

Example (``mpiexec -n 1``, after ``init_process_group``)::

    >>> e = type_table()[np.dtype(np.float32)]
    >>> e.mpi == MPI.FLOAT, e.fast[ReduceOp.SUM] == MPI.SUM
    (True, True)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from .._world import world
from ..arrays import host as _arrays
from ..reduce_op import OP_TABLE, Post, Prim
from .halfops import HALF_DTYPES, HalfOps, half_ops

__all__ = [
    "TypeEntry", "type_table", "bad_dtype", "address", "count_limit_note", "PRIM_OPS", "KEYS_BY_SIZE", "WIDE",
    "GENERAL", "Step", "LARGE_COUNTS", "COUNT_ERRORS", "BLOCK_VARIANT_LIMIT",
]  # fmt: skip

#: the MPI op of each primitive reduction
PRIM_OPS = {
    Prim.SUM: MPI.SUM, Prim.PROD: MPI.PROD, Prim.MIN: MPI.MIN, Prim.MAX: MPI.MAX,
    Prim.BAND: MPI.BAND, Prim.BOR: MPI.BOR, Prim.BXOR: MPI.BXOR,
    Prim.LAND: MPI.LAND, Prim.LOR: MPI.LOR, Prim.LXOR: MPI.LXOR,
}  # fmt: skip

_MPI_TYPE_NAMES = {
    "bool": "C_BOOL",
    "int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
    "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T", "uint64": "UINT64_T",
    "float16": "FLOAT16_T", "bfloat16": "BFLOAT16_T", "float32": "FLOAT", "float64": "DOUBLE",
    "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX",
}  # fmt: skip
_RAW_BY_SIZE = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}
#: the integer types float MIN/MAX reduce their order keys in (reduce_op.to_order_keys), by itemsize
KEYS_BY_SIZE = {2: (MPI.INT16_T, np.dtype(np.int16)), 4: (MPI.INT32_T, np.dtype(np.int32)),
                8: (MPI.INT64_T, np.dtype(np.int64))}  # fmt: skip
#: the dtype a reduction runs in where MPI cannot reduce a 2-byte float (and mpidist's C ops are not used)
WIDE = np.dtype(np.float32)
#: a step of an operation (prepare, finish, undo), or None where there is nothing to do
Step = Optional[Callable[[], None]]
#: marks an op that needs more than one native MPI call (AVG, PREMUL_SUM, widening)
GENERAL = object()

#: whether mpi4py passes 64-bit counts and displacements to MPI (MPI-4 large-count routines)
LARGE_COUNTS = MPI.Get_version() >= (4, 0)
#: the error classes an MPI-3 library gives for a count beyond its 32-bit limit
COUNT_ERRORS = (MPI.ERR_ARG, MPI.ERR_COUNT)

#: Below this input size reduce_scatter uses the block variant (Ireduce_scatter_block, and
#: MPI_Reduce_scatter_block_init for the persistent operation), from it on the vector one
#: (Ireduce_scatter, MPI_Reduce_scatter_init). Measured with MPICH 5 on 2 ranks: the one-off vector
#: call costs +2.3 us at 8 B, while the one-off block call is 8x slower than blocking MPI from 256 KiB
#: up (1151 vs 134 us at 1 MiB); the persistent ones (raw start/test loops against the blocking call)
#: are equally fast up to 384 KiB, while the block one takes 1.4x the blocking call at 512 KiB and
#: 1.9x at 1 MiB, the vector one 0.97x.
BLOCK_VARIANT_LIMIT = 256 << 10


class TypeEntry:
    """How this MPI library handles one dtype."""

    __slots__ = ("info", "mpi", "ops", "wide", "fast", "half")

    def __init__(
        self,
        info: _arrays.DtypeInfo,
        mpi: MPI.Datatype,
        ops: tuple[Any, ...],
        wide: np.dtype | None,
        fast: tuple[MPI.Op | None, ...] | None = None,
        half: HalfOps | None = None,
    ) -> None:
        self.info = info
        self.mpi = mpi  # datatype that moves the elements
        # by RedOpType: an MPI.Op if MPI computes it natively on this dtype in one call, on any memory (host or
        # a CUDA-aware library's device memory: mpi_device.py reads this), GENERAL, or None (undefined)
        self.ops = ops
        self.wide = wide  # dtype reductions run in when MPI cannot reduce this one natively (and no C ops)
        # by RedOpType: the MPI.Op one call on host arrays uses (native, or mpidist's C op), else None
        self.fast = fast if fast is not None else tuple(o if type(o) is MPI.Op else None for o in ops)
        self.half = half  # float16/bfloat16: mpidist's C reductions (halfops.py), or None


def type_table(alone: bool = False) -> dict[np.dtype, TypeEntry]:
    """Return the dtype table of this MPI library (probed once per process); ``alone``: for a one-rank group."""
    tables = world.mpi_type_table
    if tables is None:
        tables = world.mpi_type_table = {}
    table = tables.get(alone)
    if table is None:
        table = tables[alone] = {dt: _entry(info, alone) for dt, info in _arrays.DTYPES.items()}
    return table


def bad_dtype(a: np.ndarray, fn: str) -> TypeEntry:
    """Raise the TypeError of ``fn`` for an array whose dtype the table does not hold."""
    _arrays.dtype_info(a.dtype, fn, "array")  # raises the specific TypeError
    raise TypeError(f"{fn}: the MPI backend cannot send {a.dtype.name} arrays")  # pragma: no cover


def address(a: np.ndarray) -> int:
    """The address of an array's first byte, as MPI gets it."""
    return MPI.buffer(a).address


def count_limit_note() -> str:
    """What an invalid-argument error from an MPI-3 library most likely means (docs/sharp-bits.md)."""
    version = MPI.Get_library_version().splitlines()
    library = version[0].split(",")[0].strip() if version else "this MPI library"
    major, minor = MPI.Get_version()
    return (
        f"({library} implements MPI {major}.{minor}, whose calls take counts below 2**31: a message of 2**31 "
        "elements or more (bytes, for lists of arrays and for objects) needs an MPI-4 library such as MPICH >= 4, "
        "pip install mpidist[mpich]; see docs/sharp-bits.md)"
    )


def _reduces_natively(mpi_type: MPI.Datatype, dtype: np.dtype, prim: Prim) -> bool:
    """Return True if MPI_Reduce_local computes ``prim`` correctly on ``mpi_type``."""
    a = np.array([1, 0, 1, 2], dtype)
    b = np.array([1, 1, 0, 3], dtype)
    expect = {
        Prim.SUM: np.add, Prim.PROD: np.multiply, Prim.MIN: np.minimum, Prim.MAX: np.maximum,
        Prim.BAND: np.bitwise_and, Prim.BOR: np.bitwise_or, Prim.BXOR: np.bitwise_xor,
        Prim.LAND: np.logical_and, Prim.LOR: np.logical_or, Prim.LXOR: np.logical_xor,
    }[prim](a, b).astype(dtype)  # fmt: skip
    try:
        PRIM_OPS[prim].Reduce_local([a, mpi_type], [b, mpi_type])
    except MPI.Exception:
        return False
    return bool(np.array_equal(b, expect))


def _entry(info: _arrays.DtypeInfo, alone: bool) -> TypeEntry:
    """The entry of one dtype; ``alone``: for a communicator of one rank (see ``_half_fast``)."""
    native = getattr(MPI, _MPI_TYPE_NAMES[info.name], MPI.DATATYPE_NULL)
    have = native != MPI.DATATYPE_NULL
    move = native if have else _RAW_BY_SIZE[info.dtype.itemsize]
    table = OP_TABLE[info.kind]
    prims = {e[0] for e in table if e is not None}
    wide = None
    if not (have and all(_reduces_natively(native, info.dtype, p) for p in prims)):
        if info.kind != "f" or info.dtype.itemsize >= WIDE.itemsize:  # pragma: no cover - MPI-2 era libraries
            raise RuntimeError(f"this MPI library cannot reduce {info.name} arrays")
        wide = WIDE
    half = half_ops(info.dtype) if info.name in HALF_DTYPES else None
    if half is not None:
        # mpidist's C ops read host memory: no op of this dtype counts as native (a CUDA-aware MPI must not
        # get device memory for them: mpi_device.py stages); one call on host arrays uses them
        ops = tuple(None if e is None else GENERAL for e in table)
        return TypeEntry(info, move, ops, wide, _half_fast(table, half, alone), half)
    ops = tuple(
        None if e is None else (PRIM_OPS[e[0]] if e[1] is Post.NONE and wide is None else GENERAL) for e in table
    )
    return TypeEntry(info, move, ops, wide)


def _half_fast(table: tuple[Any, ...], half: HalfOps, alone: bool) -> tuple[MPI.Op | None, ...]:
    """The C ops one call uses, by RedOpType: SUM and PRODUCT, and MIN/MAX (their rule is inside the C op).

    On a communicator of one rank MPI never calls an op, so MIN/MAX would hand a NaN back with its
    payload: there they keep the order keys, which make every NaN the default one.
    """
    return tuple(
        half.by_prim[e[0]] if e is not None and (e[1] is Post.NONE or (e[1] is Post.KEYS and not alone)) else None
        for e in table
    )
