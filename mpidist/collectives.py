"""Public collectives, with torch.distributed's names, parameters and semantics.

Each function: resolve the group (a non-member gets None back and nothing
happens), translate ``src``/``dst`` (global ranks) or ``group_src``/``group_dst``
(group ranks) to group ranks, validate and prepare the arrays locally, then make
one backend call. ``async_op=True`` returns a :class:`~mpidist.work.Work` whose
``result()`` (and future value) lists the output arrays.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ._args import (
    all_to_all_counts,
    check_block_shapes,
    check_dtype,
    check_own_size,
    gathered_size_error,
    same_dtype,
    scattered_size_error,
)
from ._validate import bool_arg, timeout_seconds
from ._world import world
from .arrays.host import (
    DTYPES,
    Buffer,
    as_host_array,
    prepare_inout,
    prepare_input,
    prepare_input_list,
    prepare_output,
    prepare_output_list,
    prepare_pair,
)
from .process_group import ProcessGroup, absent, resolve_group
from .reduce_op import ReduceOp, check_op
from .work import Work

__all__ = [
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "all_to_all",
    "barrier",
    "all_reduce_coalesced",
    "all_gather_coalesced",
]

SUM = ReduceOp.SUM


def broadcast(
    tensor: Any,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Send ``tensor`` from rank ``src`` to every rank of the group (in place).

    Args:
        tensor: On ``src``, the data to send; on the other ranks, the array that
            receives it (the same size and dtype). A numpy array, a torch tensor or
            a GPU array; C-contiguous arrays go to MPI without a copy.
        src: The sending rank, as a global rank. Give ``src`` or ``group_src``.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.
        group_src: The sending rank as a rank of ``group``, instead of ``src``.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, or ``src``,
            ``group_src``, ``group`` or ``async_op`` has the wrong type.
        ValueError: neither or both of ``src`` and ``group_src`` are given, or the
            receiving ``tensor`` is read-only.
        RankNotInGroupError: ``src`` is not a member of ``group``, or ``group_src``
            is out of range.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> x = np.arange(3.0) if dist.get_rank() == 0 else np.zeros(3)
        >>> dist.broadcast(x, src=0)
        >>> x
        array([0., 1., 2.])  # rank 0 and rank 1
    """
    fn = "broadcast"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    root = pg.root_rank(src, group_src, fn, ("src", "group_src"))
    if pg.rank() == root:
        buf, target = prepare_input(tensor, fn, "tensor"), None
    else:
        try:
            buf, target = prepare_output(tensor, fn, "tensor")
        except (TypeError, ValueError) as exc:
            raise pg.failed_in_role(fn, exc, tensor)  # noqa: B904 - exc itself
    w = pg.broadcast(buf, None if target is None else [(buf, target)], root, async_op)
    if w is not None:
        w.with_outputs([tensor])
    return w


def all_reduce(tensor: Any, op: Any = SUM, group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group in place; every rank gets the identical result.

    Args:
        tensor: Each rank's input, overwritten with the result. A numpy array, a
            torch tensor or a GPU array of the same size and dtype on every rank;
            C-contiguous arrays go to MPI without a copy.
        op: How to combine: a ``ReduceOp`` (``SUM``, ``AVG``, ``PRODUCT``, ``MIN``,
            ``MAX``, ``BAND``, ``BOR``, ``BXOR``), torch's ``ReduceOp``, or an op
            from ``make_premul_sum``. ``AVG`` truncates integers, as NCCL does;
            bool arrays reduce logically.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, ``op`` is not a
            reduction, or ``group`` or ``async_op`` has the wrong type.
        ValueError: ``op`` is not defined for the dtype (a bitwise op on floats,
            ``MIN`` on complex numbers), or ``tensor`` is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> x = np.arange(2) + 1 + 2 * dist.get_rank()
        >>> x
        array([1, 2])  # rank 0
        array([3, 4])  # rank 1
        >>> dist.all_reduce(x, op=dist.ReduceOp.SUM)
        >>> x
        array([4, 6])  # rank 0 and rank 1
        >>> work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
        >>> work.wait()
        True
        >>> x
        array([4, 6])  # rank 0 and rank 1
    """
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, "all_reduce", "async_op")
    pg = world.default_pg if group is None else resolve_group(group, "all_reduce")
    if pg is None:
        return absent(group, "all_reduce")
    buf, target = prepare_inout(tensor, "all_reduce", "tensor")
    w = pg.all_reduce(buf, None if target is None else [(buf, target)], op, async_op)
    if w is not None:
        w.with_outputs([tensor])
    return w


def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Any = SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` across the group into ``tensor`` on rank ``dst`` only.

    Other ranks' ``tensor`` is left unchanged.

    Args:
        tensor: Each rank's input; on ``dst`` it is overwritten with the result.
            The same size and dtype on every rank.
        dst: The rank that gets the result, as a global rank. Give ``dst`` or
            ``group_dst``.
        op: How to combine: a ``ReduceOp`` or an op from ``make_premul_sum`` (see
            ``all_reduce``).
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.
        group_dst: The rank that gets the result as a rank of ``group``, instead
            of ``dst``.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: ``tensor`` is not an array of a supported dtype, ``op`` is not a
            reduction, or a rank, ``group`` or ``async_op`` has the wrong type.
        ValueError: neither or both of ``dst`` and ``group_dst`` are given, ``op``
            is not defined for the dtype, or ``tensor`` is read-only on ``dst``.
        RankNotInGroupError: ``dst`` is not a member of ``group``, or ``group_dst``
            is out of range.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> x = np.arange(2) + 1 + 2 * dist.get_rank()
        >>> dist.reduce(x, dst=0)
        >>> x
        array([4, 6])  # rank 0
        array([3, 4])  # rank 1 (unchanged)
    """
    fn = "reduce"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    root = pg.root_rank(dst, group_dst, fn, ("dst", "group_dst"))
    if pg.rank() == root:
        try:
            buf, target = prepare_inout(tensor, fn, "tensor")
        except (TypeError, ValueError) as exc:
            raise pg.failed_in_role(fn, exc, tensor)  # noqa: B904 - exc itself
    else:
        buf, target = prepare_input(tensor, fn, "tensor"), None
    w = pg.reduce(buf, None if target is None else [(buf, target)], op, root, async_op)
    if w is not None:
        w.with_outputs([tensor])
    return w


def all_gather(
    tensor_list: list[Any], tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list`` (one array per rank) on all ranks.

    The arrays may differ in size from rank to rank: ``tensor_list[i]`` must have
    rank ``i``'s size. They are written in place, without an intermediate buffer.

    Args:
        tensor_list: One output array per rank of the group, of ``tensor``'s dtype;
            ``tensor_list[i]`` receives rank ``i``'s ``tensor``.
        tensor: This rank's input.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: ``tensor_list`` is not a list of arrays, an array has an
            unsupported dtype or a dtype other than ``tensor``'s, or ``group`` or
            ``async_op`` has the wrong type.
        ValueError: ``tensor_list`` does not have one array per rank, this rank's
            own slot differs in size from ``tensor``, or an output is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> x = np.arange(2) + 1 + 2 * dist.get_rank()
        >>> out = [np.zeros(2, np.int64) for _ in range(dist.get_world_size())]
        >>> dist.all_gather(out, x)
        >>> out
        [array([1, 2]), array([3, 4])]  # rank 0 and rank 1
    """
    fn = "all_gather"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    inp = prepare_input(tensor, fn, "tensor")
    outs, backs = prepare_output_list(tensor_list, fn, "tensor_list", pg.size())
    same_dtype(fn, inp, "tensor", outs, "tensor_list")
    check_own_size(fn, outs[pg.rank()], "tensor_list", pg.rank(), inp, "tensor")
    w = pg.all_gather(outs, backs or None, inp, async_op)
    if w is not None:
        w.with_outputs(list(tensor_list))
    return w


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor``.

    ``output_tensor`` has ``world_size`` times the input's elements: the inputs
    concatenated (shape ``(world_size * n, ...)``) or stacked (``(world_size, n, ...)``).
    ``all_gather_single`` is another name for it.

    Args:
        output_tensor: The output, on every rank: the inputs in rank order, either
            concatenated along the first dimension or stacked, flat arrays of the
            right size too.
        input_tensor: This rank's input; the same size and dtype on every rank.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: an argument is not an array of a supported dtype, the two
            dtypes differ, or ``group`` or ``async_op`` has the wrong type.
        ValueError: ``output_tensor`` does not have ``world_size`` times the input's
            elements or has another shape than the two above, or is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> x = np.arange(2) + 1 + 2 * dist.get_rank()
        >>> out = np.zeros(2 * dist.get_world_size(), np.int64)
        >>> dist.all_gather_into_tensor(out, x)
        >>> out
        array([1, 2, 3, 4])  # rank 0 and rank 1
        >>> stacked = np.zeros((dist.get_world_size(), 2), np.int64)
        >>> dist.all_gather_into_tensor(stacked, x)
        >>> stacked
        array([[1, 2],
               [3, 4]])  # rank 0 and rank 1
    """
    fn = "all_gather_into_tensor"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    out, target, inp = prepare_pair(output_tensor, input_tensor, fn, "output_tensor", "input_tensor")
    n = pg.size()
    if out.dtype is not inp.dtype:
        check_dtype(fn, out, "output_tensor", inp, "input_tensor")
    if out.size != n * inp.size:
        raise gathered_size_error(fn, out, inp, n)
    if out.ndim != 1 or inp.ndim != 1:
        check_block_shapes(fn, out, inp, n, "output_tensor", "input_tensor")
    w = pg.all_gather_into_tensor(out, None if target is None else [(out, target)], inp, async_op)
    if w is not None:
        w.with_outputs([output_tensor])
    return w


all_gather_single = all_gather_into_tensor
"""Another name for :func:`all_gather_into_tensor` (torch's ``_all_gather_base``, Lightning's name).

Examples:
    >>> dist.all_gather_single is dist.all_gather_into_tensor
    True
"""


def _root_list(
    pg: ProcessGroup, root: int, xs: Any, fn: str, arg: str, role: str, mine: Buffer, outputs: bool
) -> tuple[list[Buffer] | None, list[tuple[Buffer, Buffer]] | None]:
    """Check and prepare gather's or scatter's ``xs`` (``arg``): one array per rank on the root, None elsewhere.

    ``outputs``: gather_list holds outputs, scatter_list inputs; either must match this rank's
    ``mine`` in dtype and, at the root's own slot, size. Returns ``(buffers, backs)``
    on the root (``backs``: write-backs of staged outputs), ``(None, None)`` elsewhere.
    A failure is this rank's alone (see :meth:`ProcessGroup.failed_in_role`).
    """
    try:
        if pg.rank() != root:
            if xs:
                raise ValueError(f"{fn}: {arg} must be None (or empty) on non-{role} ranks")
            return None, None
        if xs is None or (not xs and not outputs):
            raise ValueError(f"{fn}: {arg} must be given on the {role} rank")
        if outputs:
            bufs, backs = prepare_output_list(xs, fn, arg, pg.size())
        else:
            bufs, backs = prepare_input_list(xs, fn, arg, pg.size()), None
        same_dtype(fn, mine, "tensor", bufs, arg)
        check_own_size(fn, bufs[root], arg, root, mine, "tensor")
        return bufs, backs
    except (TypeError, ValueError) as exc:
        raise pg.failed_in_role(fn, exc)  # noqa: B904 - exc itself


def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on rank ``dst`` (default: global rank 0).

    ``gather_list`` is required on ``dst`` and must be None (or empty) elsewhere.

    Args:
        tensor: This rank's input. Ranks may send different sizes.
        gather_list: On ``dst``, one output array per rank of the group, of
            ``tensor``'s dtype: ``gather_list[i]`` receives rank ``i``'s ``tensor``.
            None (or empty) on the other ranks.
        dst: The rank that gathers, as a global rank; None means global rank 0.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.
        group_dst: The rank that gathers as a rank of ``group``, instead of ``dst``.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: an array has an unsupported dtype or a dtype other than
            ``tensor``'s, ``gather_list`` is not a list, or a rank, ``group`` or
            ``async_op`` has the wrong type.
        ValueError: ``gather_list`` is missing on ``dst``, given elsewhere, does
            not have one array per rank, or ``dst``'s own slot differs in size from
            its ``tensor``; both ``dst`` and ``group_dst`` are given.
        RankNotInGroupError: ``dst`` is not a member of ``group``, or ``group_dst``
            is out of range.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> x = np.arange(2) + 1 + 2 * dist.get_rank()
        >>> out = [np.zeros(2, np.int64) for _ in range(2)] if dist.get_rank() == 0 else None
        >>> dist.gather(x, out, dst=0)
        >>> out
        [array([1, 2]), array([3, 4])]  # rank 0 (rank 1: None)
    """
    fn = "gather"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    root = pg.root_rank(dst, group_dst, fn, ("dst", "group_dst"), default=0)
    inp = prepare_input(tensor, fn, "tensor")
    outs, backs = _root_list(pg, root, gather_list, fn, "gather_list", "destination", inp, True)
    w = pg.gather(inp, outs, backs or None, root, async_op)
    if w is not None:
        w.with_outputs(list(gather_list) if pg.rank() == root else [])
    return w


def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Send ``scatter_list[i]`` from rank ``src`` (default: global rank 0) into rank ``i``'s ``tensor``.

    ``scatter_list`` is required on ``src`` and must be None (or empty) elsewhere.

    Args:
        tensor: The output: this rank's part.
        scatter_list: On ``src``, one array per rank of the group, of ``tensor``'s
            dtype; ``scatter_list[i]`` goes to rank ``i``. None (or empty) on the
            other ranks.
        src: The sending rank, as a global rank; None means global rank 0.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.
        group_src: The sending rank as a rank of ``group``, instead of ``src``.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: an array has an unsupported dtype or a dtype other than
            ``tensor``'s, ``scatter_list`` is not a list, or a rank, ``group`` or
            ``async_op`` has the wrong type.
        ValueError: ``scatter_list`` is missing on ``src``, given elsewhere, does
            not have one array per rank, or ``src``'s own part differs in size from
            its ``tensor``; ``tensor`` is read-only; both ``src`` and ``group_src``
            are given.
        RankNotInGroupError: ``src`` is not a member of ``group``, or ``group_src``
            is out of range.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> x = np.zeros(2, np.int64)
        >>> parts = [np.array([1, 2]), np.array([3, 4])] if dist.get_rank() == 0 else None
        >>> dist.scatter(x, parts, src=0)
        >>> x
        array([1, 2])  # rank 0
        array([3, 4])  # rank 1
    """
    fn = "scatter"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    root = pg.root_rank(src, group_src, fn, ("src", "group_src"), default=0)
    out, target = prepare_output(tensor, fn, "tensor")
    backs = None if target is None else [(out, target)]
    ins, _ = _root_list(pg, root, scatter_list, fn, "scatter_list", "source", out, False)
    w = pg.scatter(out, backs, ins, root, async_op)
    if w is not None:
        w.with_outputs([tensor])
    return w


def reduce_scatter(
    output: Any, input_list: list[Any], op: Any = SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Reduce ``input_list[i]`` across ranks and deliver the result to rank ``i``'s ``output``.

    Args:
        output: The output: the reduction of every rank's ``input_list[rank]``.
        input_list: One input array per rank of the group, of ``output``'s dtype;
            ``input_list[i]`` has rank ``i``'s output size.
        op: How to combine: a ``ReduceOp`` or an op from ``make_premul_sum`` (see
            ``all_reduce``).
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: an array has an unsupported dtype or a dtype other than
            ``output``'s, ``input_list`` is not a list, ``op`` is not a reduction,
            or ``group`` or ``async_op`` has the wrong type.
        ValueError: ``input_list`` does not have one array per rank, this rank's
            own entry differs in size from ``output``, ``op`` is not defined for the
            dtype, or ``output`` is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> r = dist.get_rank()
        >>> inputs = [np.array([1, 2]) + 10 * r, np.array([3, 4]) + 10 * r]
        >>> out = np.zeros(2, np.int64)
        >>> dist.reduce_scatter(out, inputs)
        >>> out
        array([12, 14])  # rank 0: [1, 2] + [11, 12]
        array([16, 18])  # rank 1: [3, 4] + [13, 14]
    """
    fn = "reduce_scatter"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    out, target = prepare_output(output, fn, "output")
    ins = prepare_input_list(input_list, fn, "input_list", pg.size())
    same_dtype(fn, out, "output", ins, "input_list")
    check_own_size(fn, ins[pg.rank()], "input_list", pg.rank(), out, "output")
    w = pg.reduce_scatter(out, None if target is None else [(out, target)], ins, op, async_op)
    if w is not None:
        w.with_outputs([output])
    return w


def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Reduce ``input`` across ranks; rank ``i`` gets block ``i`` of the result in ``output``.

    ``input`` has ``world_size`` times the output's elements (concatenated or stacked blocks).
    ``reduce_scatter_single`` is another name for it.

    Args:
        output: The output: this rank's block of the reduction.
        input: This rank's input, ``world_size`` blocks shaped like ``output``,
            concatenated along the first dimension or stacked (flat arrays of the
            right size too); the same dtype as ``output``.
        op: How to combine: a ``ReduceOp`` or an op from ``make_premul_sum`` (see
            ``all_reduce``).
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: an argument is not an array of a supported dtype, the two
            dtypes differ, ``op`` is not a reduction, or ``group`` or ``async_op``
            has the wrong type.
        ValueError: ``input`` does not have ``world_size`` times the output's
            elements or has another shape than the two above, ``op`` is not
            defined for the dtype, or ``output`` is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> out = np.zeros(2, np.int64)
        >>> dist.reduce_scatter_tensor(out, np.arange(4))
        >>> out
        array([0, 2])  # rank 0
        array([4, 6])  # rank 1
    """
    fn = "reduce_scatter_tensor"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    out, target, inp = prepare_pair(output, input, fn, "output", "input")
    n = pg.size()
    if out.dtype is not inp.dtype:
        check_dtype(fn, out, "output", inp, "input")
    if inp.size != n * out.size:
        raise scattered_size_error(fn, out, inp, n)
    if out.ndim != 1 or inp.ndim != 1:
        check_block_shapes(fn, inp, out, n, "input", "output")
    w = pg.reduce_scatter_tensor(out, None if target is None else [(out, target)], inp, op, async_op)
    if w is not None:
        w.with_outputs([output])
    return w


reduce_scatter_single = reduce_scatter_tensor
"""Another name for :func:`reduce_scatter_tensor` (torch's ``_reduce_scatter_base``).

Examples:
    >>> dist.reduce_scatter_single is dist.reduce_scatter_tensor
    True
"""


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` by rows, send block ``i`` to rank ``i``, and concatenate what arrives into ``output``.

    Without split sizes the rows split evenly; with them, ``input_split_sizes[i]``
    rows go to rank ``i`` and ``output_split_sizes[i]`` rows come from it. Rows
    may have any trailing shape (the same for input and output).

    Args:
        output: The output: the blocks received, in rank order.
        input: This rank's input, of ``output``'s dtype and row shape.
        output_split_sizes: Rows received from each rank (one int per rank), or
            None (or empty) for an even split of ``output``.
        input_split_sizes: Rows sent to each rank (one int per rank), or None (or
            empty) for an even split of ``input``.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: an argument is not an array of a supported dtype, the two
            dtypes differ, a split size is not an int, or ``group`` or
            ``async_op`` has the wrong type.
        ValueError: the arrays have no rows or rows of different shapes, a list of
            split sizes does not have one entry per rank, has a negative entry or
            does not sum to the array's rows, rows do not split evenly when no
            sizes are given, or ``output`` is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Sizes that disagree between ranks (rank 0 sends 2 rows to rank 1, which
    expects 3) are not caught at the default debug level; ``MPIDIST_DEBUG=DETAIL``
    catches them.

    Examples:
        >>> r = dist.get_rank()
        >>> out = np.empty(4, np.int64)
        >>> dist.all_to_all_single(out, np.arange(4) + 4 * r)
        >>> out
        array([0, 1, 4, 5])  # rank 0
        array([2, 3, 6, 7])  # rank 1
        >>> splits = [1, 2] if r == 0 else [2, 1]
        >>> out = np.empty(3, np.int64)
        >>> dist.all_to_all_single(out, np.arange(3) + 10 * r, splits, splits)
        >>> out
        array([ 0, 10, 11])  # rank 0
        array([ 1,  2, 12])  # rank 1
    """
    fn = "all_to_all_single"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    n = pg.size()
    out, target, inp = prepare_pair(output, input, fn, "output", "input")
    shape = inp.shape
    even = output_split_sizes is None and input_split_sizes is None
    if even and out.dtype is inp.dtype and out.shape == shape and shape and not shape[0] % n:
        in_counts = out_counts = None  # even splits of arrays of one shape and dtype: nothing more to check
    else:
        in_counts, out_counts = all_to_all_counts(fn, out, inp, output_split_sizes, input_split_sizes, n)
    w = pg.all_to_all_single(out, None if target is None else [(out, target)], inp, out_counts, in_counts, async_op)
    if w is not None:
        w.with_outputs([output])
    return w


def all_to_all(
    output_tensor_list: list[Any],
    input_tensor_list: list[Any],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Send ``input_tensor_list[i]`` to rank ``i``; receive rank ``i``'s array into ``output_tensor_list[i]``.

    Arrays may have any (uneven) sizes as long as each pair of ranks agrees.

    Args:
        output_tensor_list: One output array per rank of the group;
            ``output_tensor_list[i]`` receives what rank ``i`` sends to this rank.
        input_tensor_list: One input array per rank of the group;
            ``input_tensor_list[i]`` goes to rank ``i``. All arrays of both lists
            have one dtype.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: a list is not a list of arrays, an array has an unsupported
            dtype or another dtype than the rest, or ``group`` or ``async_op`` has
            the wrong type.
        ValueError: a list does not have one array per rank, the array this rank
            sends to itself differs in size from the one it receives it into, or
            an output is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> r = dist.get_rank()
        >>> inputs = [np.array([10 * r]), np.array([10 * r + 1])]
        >>> outputs = [np.zeros(1, np.int64), np.zeros(1, np.int64)]
        >>> dist.all_to_all(outputs, inputs)
        >>> outputs
        [array([0]), array([10])]  # rank 0
        [array([1]), array([11])]  # rank 1
    """
    fn = "all_to_all"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    outs, backs = prepare_output_list(output_tensor_list, fn, "output_tensor_list", pg.size())
    ins = prepare_input_list(input_tensor_list, fn, "input_tensor_list", pg.size())
    same_dtype(fn, outs[0], "output_tensor_list[0]", outs, "output_tensor_list")
    same_dtype(fn, outs[0], "output_tensor_list[0]", ins, "input_tensor_list")
    me = pg.rank()
    if outs[me].size != ins[me].size:
        raise ValueError(
            f"{fn}: output_tensor_list[{me}] has {outs[me].size} elements but input_tensor_list[{me}] "
            f"(sent to this rank itself) has {ins[me].size}; they must match"
        )
    w = pg.all_to_all(outs, backs or None, ins, async_op)
    if w is not None:
        w.with_outputs(list(output_tensor_list))
    return w


def barrier(
    group: ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None, timeout: Any = None
) -> Work | None:
    """Block until every rank of the group has entered the barrier.

    ``timeout`` (timedelta or seconds) overrides the group's timeout for this call;
    with ``async_op=True`` it bounds a ``Work.wait()`` given no timeout of its own.
    ``device_ids`` is accepted for torch compatibility.

    Args:
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.
        device_ids: Accepted for torch compatibility (a list of ints) and unused.
        timeout: This call's timeout, a ``datetime.timedelta`` or seconds; None
            means the group's.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: ``device_ids`` is not a list, ``timeout`` is neither a
            timedelta nor a number, or ``group`` or ``async_op`` has the wrong type.
        ValueError: ``timeout`` is negative or NaN.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: some rank did not enter the barrier within the timeout
            (the message names them), or MPI failed. With ``async_op=True``,
            ``Work.wait()`` raises it instead.

    Examples:
        >>> dist.barrier()
        >>> dist.barrier(timeout=10)  # DistBackendError if a rank is not there within 10 s
    """
    fn = "barrier"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        raise TypeError(f"{fn}: device_ids must be a list of ints or None, got {type(device_ids).__name__}")
    if timeout is None:
        return pg.barrier(async_op)
    limit = timeout_seconds(timeout, fn, pg.timeout.total_seconds())  # checked before anything is posted
    w = pg.barrier(True, limit)
    if w is not None:
        w.default_timeout(limit)
        if not async_op:
            w.wait()
    return w if async_op else None


def _flat_list(tensors: Any, fn: str, arg: str, writeable: bool, devices: list[Any]) -> list[np.ndarray]:
    """Host arrays for ``tensors``; device arrays are copied to the host and ``(host, device)``
    appended to ``devices``, for the write-back of outputs."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{fn}: {arg} must be a list of arrays, got {type(tensors).__name__}")
    arrays = []
    for i, t in enumerate(tensors):
        a, d = as_host_array(t, fn, f"{arg}[{i}]", writeable)
        arrays.append(a)
        if d is not None:
            devices.append((a, d))
    if arrays:
        same_dtype(fn, arrays[0], f"{arg}[0]", arrays, arg)
    return arrays


def _pack(arrays: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    packed = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0, dtype)
    world.stats.count_copy(packed.nbytes)
    return packed


def all_reduce_coalesced(
    tensors: list[Any], op: Any = SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """All-reduce several arrays of one dtype with a single MPI call (packed into one buffer).

    Args:
        tensors: The arrays, each overwritten with its reduction; one dtype, the
            same sizes on every rank. Device arrays are copied through the host.
        op: How to combine: a ``ReduceOp`` or an op from ``make_premul_sum`` (see
            ``all_reduce``).
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: ``tensors`` is not a list of arrays, the arrays' dtypes differ
            or are unsupported, ``op`` is not a reduction, or ``group`` or
            ``async_op`` has the wrong type.
        ValueError: ``tensors`` is empty, ``op`` is not defined for the dtype, or
            an array is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> a, b = np.ones(2), np.full(3, float(dist.get_rank()))
        >>> dist.all_reduce_coalesced([a, b])
        >>> a, b
        (array([2., 2.]), array([1., 1., 1.]))  # rank 0 and rank 1
    """
    fn = "all_reduce_coalesced"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    devices: list[Any] = []
    arrays = _flat_list(tensors, fn, "tensors", writeable=True, devices=devices)
    if not arrays:
        raise ValueError(f"{fn}: tensors must not be empty")
    check_op(op, DTYPES[arrays[0].dtype], fn)
    packed = _pack(arrays, arrays[0].dtype)
    backs, offset = [], 0
    for a in arrays:
        backs.append((packed[offset : offset + a.size], a))
        offset += a.size
    w = pg.all_reduce_packed(packed, backs + devices, op, async_op)
    if w is not None:
        w.with_outputs(list(tensors))
    return w


def all_gather_coalesced(
    output_tensor_lists: list[list[Any]],
    input_tensor_list: list[Any],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Gather several arrays of one dtype with a single MPI call.

    ``output_tensor_lists[r][i]`` receives rank ``r``'s ``input_tensor_list[i]``.

    Args:
        output_tensor_lists: One list per rank of the group, each with one output
            array per input array, of the input's size and dtype.
        input_tensor_list: This rank's arrays, of one dtype; the same sizes on
            every rank.
        group: The group to work on; None is the default group. On ranks outside it
            the call does nothing and returns None.
        async_op: True returns a ``Work`` at once; False (the default) returns when
            the call has completed.

    Returns:
        A ``Work`` if ``async_op`` is True, else None; None on ranks outside ``group``.

    Raises:
        TypeError: a list is not a list of arrays, or an array's dtype differs
            from the others or is unsupported; ``group`` or ``async_op`` has the
            wrong type.
        ValueError: ``output_tensor_lists`` does not have one list per rank, a
            list has another length than ``input_tensor_list``, an output has
            another size or dtype than its input, or an output is read-only.
        DefaultGroupStateError: ``init_process_group`` has not been called.
        DistBackendError: the call did not complete within the group's timeout (the
            message names the ranks that have not arrived), or MPI failed. With
            ``async_op=True``, ``Work.wait()`` raises it instead.

    Examples:
        >>> r = dist.get_rank()
        >>> inputs = [np.array([r]), np.array([10 * r, 10 * r])]
        >>> outputs = [[np.zeros(1, np.int64), np.zeros(2, np.int64)] for _ in range(2)]
        >>> dist.all_gather_coalesced(outputs, inputs)
        >>> outputs
        [[array([0]), array([0, 0])], [array([1]), array([10, 10])]]  # rank 0 and rank 1
    """
    fn = "all_gather_coalesced"
    if async_op is not False and async_op is not True:  # checked before anything is posted
        async_op = bool_arg(async_op, fn, "async_op")
    pg = world.default_pg if group is None else resolve_group(group, fn)
    if pg is None:
        return absent(group, fn)
    n = pg.size()
    devices: list[Any] = []
    ins = _flat_list(input_tensor_list, fn, "input_tensor_list", writeable=False, devices=[])
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != n:
        raise ValueError(f"{fn}: output_tensor_lists must be a list with one list per rank ({n})")
    outs = [
        _flat_list(lst, fn, f"output_tensor_lists[{r}]", writeable=True, devices=devices)
        for r, lst in enumerate(output_tensor_lists)
    ]
    dtype = ins[0].dtype if ins else np.dtype(np.uint8)
    for r, lst in enumerate(outs):
        if len(lst) != len(ins):
            raise ValueError(
                f"{fn}: output_tensor_lists[{r}] has {len(lst)} arrays but input_tensor_list has {len(ins)}"
            )
        for i, (o, a) in enumerate(zip(lst, ins)):
            if o.dtype != dtype or o.size != a.size:
                raise ValueError(
                    f"{fn}: output_tensor_lists[{r}][{i}] is {o.dtype.name} with {o.size} elements; "
                    f"expected {dtype.name} with {a.size} like input_tensor_list[{i}]"
                )
    packed = _pack(ins, dtype)
    total = packed.size
    flat = np.empty(n * total, dtype)
    world.stats.count_copy(flat.nbytes)
    backs = []
    for r, lst in enumerate(outs):
        offset = r * total
        for o in lst:
            backs.append((flat[offset : offset + o.size], o))
            offset += o.size
    w = pg.all_gather_packed(flat, backs + devices, packed, async_op)
    if w is not None:
        w.with_outputs([output_tensor_lists])
    return w
