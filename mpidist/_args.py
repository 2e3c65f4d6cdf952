"""Argument checks shared by the public functions: dtypes, sizes and shapes of arrays, split sizes.

Every check raises the TypeError/ValueError the caller's user sees, naming the function
(``fn``) and the argument, before any MPI call. ``collectives.py``, ``persistent.py`` and the
other public modules use them; nothing here knows about groups or backends.

    >>> import numpy as np
    >>> from mpidist._args import check_dtype
    >>> check_dtype("all_to_all_single", np.zeros(2), "output", np.zeros(2, np.int32), "input")
    Traceback (most recent call last):
    ...
    TypeError: all_to_all_single: output is float64 but input is int32; dtypes must match
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ._validate import int_arg
from ._world import world

__all__ = [
    "same_dtype",
    "check_dtype",
    "gathered_size_error",
    "scattered_size_error",
    "check_block_shapes",
    "check_own_size",
    "all_to_all_counts",
    "tag_value",
]


def same_dtype(fn: str, ref: np.ndarray, ref_name: str, arrays: Sequence[np.ndarray], name: str) -> None:
    """Raise unless every array of ``arrays`` (argument ``name``) has ``ref``'s dtype."""
    dtype = ref.dtype
    for i, a in enumerate(arrays):
        if a.dtype is not dtype and a.dtype != dtype:  # builtin dtypes are singletons: identity first
            raise TypeError(
                f"{fn}: {name}[{i}] is {a.dtype.name} but {ref_name} is {ref.dtype.name}; dtypes must match"
            )


def check_dtype(fn: str, a: np.ndarray, a_name: str, b: np.ndarray, b_name: str) -> None:
    """Raise unless the dtypes are equal (callers test identity first: builtin dtypes are singletons)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{fn}: {a_name} is {a.dtype.name} but {b_name} is {b.dtype.name}; dtypes must match")


def gathered_size_error(fn: str, out: Any, inp: Any, n: int) -> ValueError:
    """The error of an all-gather whose ``output_tensor`` is not ``n`` times ``input_tensor``."""
    return ValueError(
        f"{fn}: output_tensor has {out.size} elements but must have world_size * "
        f"input_tensor.size = {n} * {inp.size} = {n * inp.size}"
    )


def scattered_size_error(fn: str, out: Any, inp: Any, n: int) -> ValueError:
    """The error of a reduce-scatter whose ``input`` is not ``n`` times ``output``."""
    return ValueError(
        f"{fn}: input has {inp.size} elements but must have world_size * output.size = "
        f"{n} * {out.size} = {n * out.size}"
    )


def check_block_shapes(fn: str, whole: Any, part: Any, n: int, whole_name: str, part_name: str) -> None:
    """Refuse a ``whole`` (of ``n`` times ``part``'s elements) that is not ``n`` arrays shaped like ``part``
    concatenated along the first dimension or stacked: torch's two forms of all_gather_into_tensor's
    output and reduce_scatter_tensor's input. Flat arrays of the right sizes pass without a check here."""
    ws, ps = tuple(whole.shape), tuple(part.shape)
    if ws == (n, *ps) or (ps and len(ws) == len(ps) and ws[0] == n * ps[0] and ws[1:] == ps[1:]):
        return
    concatenated = f" {(n * ps[0], *ps[1:])} (concatenated) or" if ps else ""
    raise ValueError(
        f"{fn}: {whole_name} has shape {ws}; for {part_name} of shape {ps} on {n} ranks it must be"
        f"{concatenated} {(n, *ps)} (stacked)"
    )


def check_own_size(fn: str, mine: np.ndarray, name: str, rank: int, local: np.ndarray, local_name: str) -> None:
    """Raise unless this rank's slot ``mine`` of list ``name`` has as many elements as ``local``."""
    if mine.size != local.size:
        raise ValueError(
            f"{fn}: {name}[{rank}] (this rank's slot) has {mine.size} elements but {local_name} has "
            f"{local.size}; they must match"
        )


_ANY_SIZE = -(1 << 63)  # split sizes are checked for negatives after conversion, with their own message


def _split_counts(
    splits: Any, rows: int, row_elems: int, n: int, fn: str, name: str, arr_name: str
) -> list[int] | None:
    """Return per-rank element counts for a split-size argument (None for an even split).

    One pass over the sizes: converted, checked and summed together (uneven
    all_to_all_single is a hot call in expert-parallel models).
    """
    if type(splits) is list or type(splits) is tuple:
        even = not splits
    elif splits is None:
        even = True
    elif isinstance(splits, (list, tuple, np.ndarray)):
        even = False  # a numpy array of sizes, or a list or tuple subclass
    else:
        raise TypeError(f"{fn}: {name} must be a list of ints, got {type(splits).__name__}")
    if even:
        if rows % n:
            raise ValueError(f"{fn}: {arr_name} has {rows} rows, which do not split evenly over {n} ranks; pass {name}")
        return None
    if len(splits) != n:
        raise ValueError(f"{fn}: {name} has {len(splits)} entries but the group has {n} ranks")
    counts, total, negative = [], 0, False
    for s in splits:
        if type(s) is not int:
            s = int_arg(s, fn, name, minimum=_ANY_SIZE)
        if s < 0:
            negative = True
        total += s
        counts.append(s * row_elems)
    if negative:
        sizes = [s if type(s) is int else int_arg(s, fn, name, minimum=_ANY_SIZE) for s in splits]
        raise ValueError(f"{fn}: {name} must not contain negative sizes, got {sizes}")
    if total != rows:
        raise ValueError(f"{fn}: {name} sums to {total} but {arr_name} has {rows} rows")
    return counts


def all_to_all_counts(
    fn: str, out: Any, inp: Any, output_split_sizes: Any, input_split_sizes: Any, n: int
) -> tuple[list[int] | None, list[int] | None]:
    """Check all_to_all_single's arrays and split sizes; return the element counts (None: even splits)."""
    check_dtype(fn, out, "output", inp, "input")
    if out.ndim == 0 or inp.ndim == 0:
        raise ValueError(f"{fn}: output and input need at least one dimension (rows)")
    if out.shape[1:] != inp.shape[1:]:
        raise ValueError(f"{fn}: rows of output {out.shape[1:]} and input {inp.shape[1:]} must have the same shape")
    row = math.prod(inp.shape[1:])
    in_counts = _split_counts(input_split_sizes, inp.shape[0], row, n, fn, "input_split_sizes", "input")
    out_counts = _split_counts(output_split_sizes, out.shape[0], row, n, fn, "output_split_sizes", "output")
    if in_counts is None and out_counts is None:
        if out.shape[0] != inp.shape[0]:
            raise ValueError(
                f"{fn}: output has {out.shape[0]} rows but input has {inp.shape[0]}; with even splits they must match"
            )
        return None, None
    return (
        [inp.size // n] * n if in_counts is None else in_counts,
        [out.size // n] * n if out_counts is None else out_counts,
    )


def tag_value(tag: Any, fn: str) -> int:
    """Return ``tag`` as an int within MPI's range, or raise TypeError/ValueError naming ``fn``."""
    if type(tag) is int and 0 <= tag <= world.init_info.tag_ub:  # the common case, decided at once
        return tag
    t = int_arg(tag, fn, "tag", minimum=-(1 << 64))  # the type rule; the range is MPI's, checked here
    upper = world.init_info.tag_ub
    if not 0 <= t <= upper:
        raise ValueError(f"{fn}: tag must be between 0 and {upper} (MPI_TAG_UB of this MPI library), got {t}")
    return t
