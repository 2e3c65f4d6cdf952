"""Reduction operations: ``ReduceOp``, premultiplied sums, and the op table.

The table says, for each kind of element (bool, signed, unsigned, float,
complex), which element-wise primitive a ``ReduceOp`` becomes and what has to
happen around it (AVG divides after summing, PREMUL_SUM multiplies before).
Backends translate the primitives into their own ops (MPI.Op, ncclRedOp_t).
"""

from __future__ import annotations

import functools
import numbers
import warnings
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .arrays.dtypes import DtypeInfo

__all__ = [
    "RedOpType",
    "ReduceOp",
    "reduce_op",
    "make_premul_sum",
    "_make_nccl_premul_sum",
    "supports_complex",
]


class RedOpType(IntEnum):
    """The reduction kinds, numbered as in torch.distributed."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8
    UNUSED = 9

    def __str__(self) -> str:  # torch's: "RedOpType.AVG" (an IntEnum prints "1" from Python 3.11 on)
        return f"RedOpType.{self.name}"

    def __format__(self, spec: str) -> str:  # f"{op}" as str(op); with a spec ("{op:d}"), the number's format
        return str(self) if not spec else int.__format__(self, spec)


class ReduceOp:
    """An enum-like class of reductions: ``ReduceOp.SUM``, ``ReduceOp.MAX``, ...

    Attributes such as ``ReduceOp.SUM`` are :class:`RedOpType` members and are
    what collectives take as ``op``. Instances exist for ops that carry data:
    ``_make_nccl_premul_sum(2.0)`` returns ``ReduceOp(PREMUL_SUM)`` with its factor.

    ``AVG`` sums and then divides by the group size; on integer arrays the
    division truncates toward zero, as NCCL's ``ncclAvg`` does.

    Which ops each kind of array takes: ``SUM``, ``AVG``, ``PRODUCT`` every
    number; ``MIN`` and ``MAX`` every real number; ``BAND``, ``BOR``, ``BXOR``
    integers and bool; ``PREMUL_SUM`` floating-point and complex numbers. On bool
    arrays ``SUM`` and ``MAX`` are a logical or, ``PRODUCT`` and ``MIN`` a logical
    and. Any other pairing raises a ValueError that lists the valid ops.

    Args:
        op: The reduction, a ``RedOpType`` member or its number.
        factor: For ``PREMUL_SUM``, the factor (see ``make_premul_sum``).

    Raises:
        TypeError: ``op`` is not a ``RedOpType`` member or an int.
        ValueError: no reduction has that number.

    Examples:
        >>> dist.ReduceOp.SUM
        <RedOpType.SUM: 0>
        >>> dist.ReduceOp(dist.ReduceOp.MAX) == dist.ReduceOp.MAX
        True
        >>> x = np.array([dist.get_rank() + 1.0, 5.0])
        >>> dist.all_reduce(x, op=dist.ReduceOp.MIN)
        >>> x
        array([1., 5.])  # rank 0 and rank 1
    """

    RedOpType = RedOpType
    SUM = RedOpType.SUM
    AVG = RedOpType.AVG
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
    BAND = RedOpType.BAND
    BOR = RedOpType.BOR
    BXOR = RedOpType.BXOR
    PREMUL_SUM = RedOpType.PREMUL_SUM
    UNUSED = RedOpType.UNUSED

    __slots__ = ("op", "factor")

    def __init__(self, op: RedOpType | int = RedOpType.SUM, factor: Any = None) -> None:
        if isinstance(op, ReduceOp):
            op, factor = op.op, op.factor if factor is None else factor
        self.op = _op_type(op, "ReduceOp")
        self.factor = factor

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReduceOp):
            return self.op == other.op and _same_factor(self.factor, other.factor)
        if isinstance(other, RedOpType):
            return self.factor is None and self.op == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.op)

    def __repr__(self) -> str:
        if self.op is RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({_factor_repr(self.factor)})"
        return f"ReduceOp.{self.op.name}"


def _same_factor(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return factor_value(a) == factor_value(b)


def _factor_repr(factor: Any) -> str:
    try:
        return repr(factor_value(factor))
    except (TypeError, ValueError):
        return repr(factor)


def factor_value(factor: Any) -> complex | float | int:
    """Return the Python number a premul-sum factor stands for (read at call time)."""
    if isinstance(factor, numbers.Number) and not isinstance(factor, bool):
        return factor  # type: ignore[return-value]
    size = getattr(factor, "size", None)
    if callable(size):  # torch tensors: size() is a method, numel() the count
        size = factor.numel()
    if size == 1 and hasattr(factor, "item"):
        return factor.item()
    raise TypeError(
        "make_premul_sum: factor must be a real or complex number or a "
        f"1-element array, got {type(factor).__name__}" + (f" with {size} elements" if isinstance(size, int) else "")
    )


def make_premul_sum(factor: Any) -> ReduceOp:
    """Return a PREMUL_SUM op: every rank's input is multiplied by ``factor``, then summed.

    ``factor`` is a number or a 1-element array (read when the collective runs).
    Defined for floating-point and complex arrays.

    Args:
        factor: A real or complex number, or a 1-element array or tensor whose
            value is read each time a collective uses the op.

    Returns:
        ``ReduceOp(PREMUL_SUM)`` carrying ``factor``.

    Raises:
        TypeError: ``factor`` is neither a number nor a 1-element array.

    Examples:
        >>> x = np.ones(3, np.float32)
        >>> dist.all_reduce(x, op=dist.make_premul_sum(0.5))
        >>> x
        array([1., 1., 1.], dtype=float32)  # rank 0 and rank 1: 0.5 * 1 + 0.5 * 1
    """
    factor_value(factor)  # validate now, read again at call time
    return ReduceOp(RedOpType.PREMUL_SUM, factor)


_make_nccl_premul_sum = make_premul_sum
"""torch's private name for :func:`make_premul_sum` (``torch.distributed._make_nccl_premul_sum``).

Examples:
    >>> dist._make_nccl_premul_sum(0.5)
    ReduceOp.PREMUL_SUM(0.5)
"""


def _op_type(op: Any, fn: str) -> RedOpType:
    """``op`` (a RedOpType or its number) as a RedOpType, or the TypeError/ValueError of ``fn``."""
    if isinstance(op, bool) or not isinstance(op, int):
        raise TypeError(f"{fn}: op must be a ReduceOp.RedOpType, got {op!r}")
    try:
        return RedOpType(op)
    except ValueError:
        raise ValueError(f"{fn}: no reduction numbered {int(op)} (op must be a ReduceOp.RedOpType)") from None


def supports_complex(op: RedOpType | ReduceOp) -> bool:
    """Return True if ``op`` is defined for complex arrays.

    Args:
        op: A ``ReduceOp`` member or a ``ReduceOp`` instance.

    Returns:
        True for ``SUM``, ``AVG`` and ``PREMUL_SUM``; False for the ops that need an
        order or bits (``MIN``, ``MAX``, ``PRODUCT``'s sign aside, bitwise ops).

    Raises:
        TypeError: ``op`` is not a reduction.

    Examples:
        >>> dist.supports_complex(dist.ReduceOp.SUM)
        True
        >>> dist.supports_complex(dist.ReduceOp.MAX)
        False
    """
    base = op.op if isinstance(op, ReduceOp) else _op_type(op, "supports_complex")
    return base in (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM)


class _DeprecatedReduceOp:
    """Deprecated ``reduce_op``: attribute access warns and forwards to ``ReduceOp``."""

    def __getattr__(self, name: str) -> RedOpType:
        if name.startswith("_") or name not in RedOpType.__members__:
            raise AttributeError(name)
        warnings.warn(
            "mpidist.reduce_op is deprecated, use mpidist.ReduceOp instead",
            FutureWarning,
            stacklevel=2,
        )
        return RedOpType[name]

    def __repr__(self) -> str:
        return "<deprecated mpidist.reduce_op; use mpidist.ReduceOp>"


reduce_op = _DeprecatedReduceOp()
"""Deprecated spelling of :class:`ReduceOp` (as in torch): ``reduce_op.SUM`` warns (FutureWarning)
and returns ``ReduceOp.SUM``.

Examples:
    >>> dist.reduce_op.SUM  # FutureWarning: mpidist.reduce_op is deprecated, use mpidist.ReduceOp instead
    <RedOpType.SUM: 0>
"""


class Prim(IntEnum):
    """Element-wise primitives that backends implement natively."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    LAND = 7
    LOR = 8
    LXOR = 9


class Post(IntEnum):
    """What surrounds the primitive."""

    NONE = 0
    AVG = 1  # divide by the group size afterwards
    PREMUL = 2  # multiply the input by a factor beforehand
    KEYS = 3  # floats: reduce order keys (integers) instead, see to_order_keys


_R = RedOpType
_ARITH = {_R.SUM: Prim.SUM, _R.PRODUCT: Prim.PROD, _R.MIN: Prim.MIN, _R.MAX: Prim.MAX}
_BITS = {_R.BAND: Prim.BAND, _R.BOR: Prim.BOR, _R.BXOR: Prim.BXOR}
# Booleans reduce logically (torch maps SUM to "or" and PRODUCT to "and" for bool).
_BOOL = {
    _R.SUM: Prim.LOR,
    _R.PRODUCT: Prim.LAND,
    _R.MIN: Prim.LAND,
    _R.MAX: Prim.LOR,
    _R.BAND: Prim.LAND,
    _R.BOR: Prim.LOR,
    _R.BXOR: Prim.LXOR,
}


def _build(kind: str) -> tuple[tuple[Prim, Post] | None, ...]:
    allowed: dict[RedOpType, tuple[Prim, Post]] = {}
    if kind == "b":
        allowed = {op: (p, Post.NONE) for op, p in _BOOL.items()}
    else:
        if kind in "iuf":
            allowed.update({op: (p, Post.NONE) for op, p in _ARITH.items()})
        if kind == "f":  # NaN wins and -0 < +0, the same on every rank (see to_order_keys)
            allowed[_R.MIN] = (Prim.MIN, Post.KEYS)
            allowed[_R.MAX] = (Prim.MAX, Post.KEYS)
        if kind in "iu":
            allowed.update({op: (p, Post.NONE) for op, p in _BITS.items()})
        if kind == "c":
            allowed[_R.SUM] = (Prim.SUM, Post.NONE)
        allowed[_R.AVG] = (Prim.SUM, Post.AVG)
        if kind in "fc":
            allowed[_R.PREMUL_SUM] = (Prim.SUM, Post.PREMUL)
    return tuple(allowed.get(op) for op in RedOpType)


#: Per element kind, indexed by RedOpType: (primitive, post step) or None if undefined.
OP_TABLE: dict[str, tuple[tuple[Prim, Post] | None, ...]] = {k: _build(k) for k in "biufc"}

_KIND_WORDS = {"b": "bool", "i": "signed integer", "u": "unsigned integer", "f": "floating-point", "c": "complex"}


def foreign_op(op: Any) -> RedOpType | ReduceOp | None:
    """mpidist's op for torch's own (``torch.distributed.ReduceOp.MAX``, ``ReduceOp(...)``,
    ``_make_nccl_premul_sum(f)``): a program that kept ``from torch.distributed import ReduceOp``
    passes those. None for anything else.

    Matched by name and number (the same as torch's), so this module never imports torch.

    Example::

        >>> from torch.distributed import ReduceOp as TorchReduceOp
        >>> foreign_op(TorchReduceOp.MAX)
        <RedOpType.MAX: 4>
    """
    inner = getattr(op, "op", None)  # torch's ReduceOp objects hold the kind in .op (and .factor)
    kind = op if inner is None else inner
    name = getattr(kind, "name", None)
    mine = RedOpType.__members__.get(name) if type(name) is str else None
    if mine is None or getattr(kind, "value", None) != mine.value:
        return None
    if inner is not None and mine is RedOpType.PREMUL_SUM:
        return ReduceOp(mine, op.factor)
    return mine


def resolve(op: Any, fn: str) -> tuple[RedOpType, Any]:
    """Return ``(op type, premul factor or None)`` for an ``op`` argument (mpidist's or torch's), or raise."""
    if type(op) is RedOpType:
        base, factor = op, None
    elif isinstance(op, ReduceOp):
        base, factor = op.op, op.factor
    else:
        mine = foreign_op(op)
        if mine is None:
            raise TypeError(f"{fn}: op must be a ReduceOp such as ReduceOp.SUM, got {op!r}")
        return resolve(mine, fn)
    if base is RedOpType.UNUSED:
        raise ValueError(f"{fn}: ReduceOp.UNUSED is not a reduction")
    if base is RedOpType.PREMUL_SUM:
        if factor is None:
            raise ValueError(
                f"{fn}: ReduceOp.PREMUL_SUM needs a factor; build it with "
                "mpidist.make_premul_sum(factor) (alias _make_nccl_premul_sum)"
            )
        factor_value(factor)
    return base, factor


def check_op(op: Any, info: DtypeInfo, fn: str) -> None:
    """Raise the error ``fn`` gives for ``op`` if it is not defined on arrays of ``info``'s dtype."""
    base, _ = resolve(op, fn)
    if OP_TABLE[info.kind][base] is None:
        raise invalid_op_error(fn, base, info.kind, info.name)


def invalid_op_error(fn: str, op: RedOpType, kind: str, dtype_name: str) -> ValueError:
    """Build the error for an op that is undefined on this kind of element."""
    valid = ", ".join(f"ReduceOp.{o.name}" for o in RedOpType if OP_TABLE[kind][o])
    why = {
        "c": "complex numbers have no order and no bitwise form",
        "f": "bitwise operations need integers or bool",
        "b": "bool arrays reduce logically; AVG and PREMUL_SUM need numbers",
    }.get(kind, "")
    reason = f" ({why})" if why else ""
    return ValueError(
        f"{fn}: ReduceOp.{op.name} is not defined for {dtype_name} arrays{reason}; "
        f"valid for {_KIND_WORDS[kind]} arrays: {valid}"
    )


def divide_average(a: Any, n: int, xp: Any) -> None:
    """AVG's division of a summed array, in place; ``xp`` is its array module (numpy or cupy).

    The one place this is decided, for every backend and device: floats divide
    truly, complex numbers per component (dividing by ``n + 0j`` rounds
    differently), integers truncate toward zero (as NCCL's ``ncclAvg``) with
    integer arithmetic, so int64/uint64 sums beyond 2**53 stay exact.
    """
    kind = a.dtype.kind
    if kind == "c":
        xp.divide(a.real, n, out=a.real)
        xp.divide(a.imag, n, out=a.imag)
    elif kind == "u":
        xp.floor_divide(a, n, out=a)
    elif kind == "i":
        negative_rest = (xp.remainder(a, n) != 0) & (a < 0)
        xp.floor_divide(a, n, out=a)
        a += negative_rest  # floor -> toward zero for negative quotients with a remainder
    else:  # float16/32/64 and bfloat16
        xp.divide(a, n, out=a, casting="unsafe")


# -- MIN and MAX on floating-point numbers ------------------------------------------------
#
# An MPI library computes MAX on floats as ``a > b ? a : b`` (or similar) in whatever order its
# algorithm combines the ranks' contributions, and that order differs between ranks: with a
# NaN, or with +0 and -0, ranks then end up with different results. mpidist instead reduces
# integer *order keys*: IEEE 754 floats ordered as sign and magnitude become two's-complement
# integers with the same order (negative floats get their magnitude bits flipped). Integer
# MIN/MAX pick one of the inputs by a total order, so every rank gets the same bits whatever
# the reduction order. Before that, every NaN becomes one NaN placed beyond every number in the
# op's direction, so a NaN anywhere wins (as torch.maximum and torch.minimum propagate NaN),
# and -0 < +0. This is IEEE 754-2019's maximum and minimum: MAX(+0, -0) = +0, MIN(+0, -0) = -0,
# and the result NaN is always the default quiet NaN (numpy.nan's bits).


@functools.lru_cache(maxsize=16)  # (dtype, array module): a few float dtypes, numpy and cupy
def _key_layout(dtype: Any, xp: Any) -> tuple[Any, int, Any, tuple[int, int]]:
    """``(integer dtype, bits - 1, magnitude mask, NaN keys for MAX and MIN)`` of a float dtype."""
    idt = xp.dtype(f"i{dtype.itemsize}")
    shift = 8 * dtype.itemsize - 1
    quiet = int(xp.array(float("nan"), dtype).view(idt))  # the default quiet NaN, positive: its own key
    # MAX: the quiet NaN's key lies above +inf's; MIN: ~quiet is the key of -NaN, below -inf's
    return idt, shift, xp.array((1 << shift) - 1, idt), (quiet, ~quiet)


def to_order_keys(src: Any, dst: Any, prim: Prim, xp: Any) -> Any:
    """Write the order keys of the float array ``src`` into ``dst``; return them (an integer view).

    ``dst`` is None to convert ``src`` in place, else a separate C-contiguous array with
    ``src``'s size and itemsize. ``prim`` (Prim.MIN or Prim.MAX) says which way NaN goes:
    every NaN becomes the one key that wins.
    """
    idt, shift, mask, nan_keys = _key_layout(src.dtype, xp)
    flat = src.reshape(-1)
    nans = xp.isnan(flat)
    if not nans.any():
        nans = None
    v = flat.view(idt)
    if dst is None:
        k = v
        t = xp.right_shift(v, shift)
        t &= mask
        k ^= t
    else:
        k = dst.reshape(-1).view(idt)
        xp.right_shift(v, shift, out=k)
        k &= mask
        k ^= v
    if nans is not None:
        k[nans] = nan_keys[0] if prim is Prim.MAX else nan_keys[1]
    return k


def from_order_keys(keys: Any, dtype: Any, prim: Prim, xp: Any) -> None:
    """Turn reduced order keys (an integer view of the result's memory) back into ``dtype`` floats, in place."""
    _, shift, mask, _ = _key_layout(dtype, xp)
    k = keys.reshape(-1)
    t = xp.right_shift(k, shift)
    t &= mask
    k ^= t
    if prim is Prim.MIN:  # MIN's NaN key stands for -NaN: give back the default (positive) quiet NaN
        floats = k.view(dtype)
        nans = xp.isnan(floats)
        if nans.any():
            floats[nans] = float("nan")
