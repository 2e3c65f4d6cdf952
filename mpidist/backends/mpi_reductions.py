"""Reductions one native MPI call cannot do alone: the messages and the steps around the call.

AVG (a division afterwards), PREMUL_SUM (a scaled copy of the input first),
dtypes MPI cannot reduce (a float32 copy, unless mpidist's C ops reduce them),
MIN/MAX on floats (integer order keys, so that every rank gets the same bits: see
``reduce_op.to_order_keys``), and ops of one call whose output is staged.
:func:`reduction_plan` binds the messages to buffers allocated once, so the MPI
backend's one-off calls (``mpi.py``) and its persistent requests
(``mpi_persistent.py``) run the same plan.

Example (``mpiexec -n 2``, after ``init_process_group``; ``table = type_table()``)::

    >>> x = np.ones(4, np.float32)
    >>> smsg, rmsg, op, prepare, finish, undo, bufs = reduction_plan(
    ...     "all_reduce", table[x.dtype], ReduceOp.AVG, x, x, True, 2, table)
    >>> MPI.COMM_WORLD.Allreduce(smsg, rmsg, op); finish(); x
    array([1., 1., 1., 1.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .._world import world
from ..reduce_op import (
    OP_TABLE,
    Post,
    Prim,
    divide_average,
    factor_value,
    from_order_keys,
    invalid_op_error,
    resolve,
    to_order_keys,
)  # fmt: skip
from .mpi_types import KEYS_BY_SIZE, PRIM_OPS, Step, TypeEntry

__all__ = ["reduction_plan"]

IN_PLACE = MPI.IN_PLACE
ndarray = np.ndarray


def reduction_plan(
    fn: str,
    e: TypeEntry,
    op: Any,
    send: ndarray,
    recv: ndarray | None,
    in_place: bool,
    size: int,
    types: dict[np.dtype, TypeEntry],
) -> tuple[Any, Any, MPI.Op, Step, Step, Step, tuple]:
    """The messages and steps of a reduction of ``op`` on ``e``'s dtype over ``size`` ranks.

    ``types`` is the group's type table (the float32 entry, for widening). Returns
    ``(send message, recv message, MPI op, prepare, finish, undo, buffers)``: the
    messages are bound to buffers allocated here once, ``prepare()`` (None if
    there is nothing to do) fills them before each run, ``finish()`` (or None)
    completes each run and ``undo()`` (or None) gives the caller's input back if
    the MPI call fails after ``prepare()``; so a persistent request can be made on
    the messages as well as a one-off call. Raises the TypeError/ValueError of an
    op the dtype does not take, before anything is allocated.
    """
    base, factor = resolve(op, fn)
    info = e.info
    entry = OP_TABLE[info.kind][base]
    if entry is None:
        raise invalid_op_error(fn, base, info.kind, info.name)
    prim, post = entry
    one = e.fast[base]
    if one is not None:  # one MPI call does it (here for a staged output, or an input apart from the output)
        return (
            IN_PLACE if in_place else [send, e.mpi], None if recv is None else [recv, e.mpi], one,
            None, None, None, (send, recv),
        )  # fmt: skip
    if post is Post.KEYS:
        return _keys_plan(e, prim, send, recv, in_place)
    premul = post is Post.PREMUL
    if premul:
        f = factor_value(factor)
        if isinstance(f, complex) and info.kind != "c":
            raise ValueError(f"{fn}: PREMUL_SUM factor {f!r} is complex but the array is {info.name}")
    half = e.half
    # mpidist's C ops sum the 2-byte numbers themselves; PREMUL_SUM keeps the float32 copy where MPI
    # cannot reduce the dtype (its products are not rounded to the 2-byte type, as before)
    wide = None if half is not None and not (premul and e.wide is not None) else e.wide
    if half is None or wide is not None:
        half = None
    if wide is not None:
        s = np.empty(send.shape, wide)
        r = s if in_place else (None if recv is None else np.empty(recv.shape, wide))
        mpi_type = types[wide].mpi
    else:
        s = np.empty_like(send) if premul and not in_place else send  # never scale the caller's input
        r, mpi_type = recv, e.mpi
    mop = PRIM_OPS[prim] if half is None else half.by_prim[prim]
    copied = s is not send
    count = world.stats.count_copy

    def prepare() -> None:
        if copied:
            np.copyto(s, send, casting="unsafe")
            count(s.nbytes)
        if premul:
            np.multiply(s, factor_value(factor), out=s, casting="unsafe")

    average = post is Post.AVG

    def finish() -> None:
        if average:
            if half is not None:
                half.divide(r, size)  # in C: numpy's float16 division is a slow loop
            else:
                divide_average(r, size, np)
        if wide is not None:
            np.copyto(recv, r, casting="unsafe")
            if r is not s:
                count(r.nbytes)

    smsg = IN_PLACE if in_place else [s, mpi_type]
    rmsg = None if r is None else [r, mpi_type]
    done = finish if r is not None and (average or wide is not None) else None
    return smsg, rmsg, mop, prepare if copied or premul else None, done, None, (send, recv, s, r)


def _keys_plan(
    e: TypeEntry, prim: Prim, send: ndarray, recv: ndarray | None, in_place: bool
) -> tuple[Any, Any, MPI.Op, Step, Step, Step, tuple]:
    """MIN/MAX on floats: reduce integer order keys, so every rank gets the same bits (see reduce_op).

    An in-place buffer is converted where it is (and back on failure); a separate
    input (reduce on a non-root rank, reduce_scatter) is converted into a copy made
    here once. The result comes back as keys in the output's memory, converted back
    when each run completes.
    """
    dtype = e.info.dtype
    mpi_type, key_dtype = KEYS_BY_SIZE[dtype.itemsize]
    if in_place:
        s = r = send.reshape(-1).view(key_dtype)
    else:
        s = np.empty(send.size, key_dtype)
        r = None if recv is None else recv.reshape(-1).view(key_dtype)
    count = world.stats.count_copy

    def prepare() -> None:
        if in_place:
            to_order_keys(send, None, prim, np)
        else:
            to_order_keys(send, s, prim, np)
            count(s.nbytes)

    def finish() -> None:
        from_order_keys(r, dtype, prim, np)  # NaN payloads become the default NaN

    def undo() -> None:
        from_order_keys(s, dtype, prim, np)  # the caller's numbers back

    smsg = IN_PLACE if in_place else [s, mpi_type]
    rmsg = None if r is None else [r, mpi_type]
    done = None if r is None else finish
    return smsg, rmsg, PRIM_OPS[prim], prepare, done, undo if in_place else None, (send, recv, s, r)
