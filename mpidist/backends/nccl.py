"""The NCCL backend: collectives on GPU memory through ``cupy.cuda.nccl``.

One :class:`NCCLBackend` per process group and device array kind: an NCCL
communicator over the group's ranks, bound to one GPU, and a communication
stream of its own. It is built collectively: group rank 0 asks NCCL for a
unique id, the id travels over the group's MPI communicator (bounded by the
group's timeout), and every rank creates its communicator from it.

**Device.** The GPU is the current one if this thread already uses a GPU (a CUDA
context is current: ``torch.cuda.set_device``, ``cupy.cuda.Device(i).use()``, an
allocation); otherwise node-local rank modulo the number of visible devices,
which then becomes the current device. Arrays on another GPU raise ValueError.

**Streams.** As in torch's ProcessGroupNCCL, the communication stream first waits
for the streams the arrays were produced on (their ``stream``, else the current
stream), then runs the NCCL calls and the device-side steps around them (copies
into and out of temporaries, AVG's division, PREMUL_SUM's scaling, write-backs
of staged outputs), then records an event. A blocking call makes the producer
streams wait for that event and returns without blocking the host; ``async_op``
returns a :class:`CudaWork` whose ``wait()`` does it. Buffers stay referenced
until the event has completed. The host waits, bounded by the group's timeout,
only in ``barrier``, in ``Work.wait(timeout)`` and with ``TORCH_NCCL_BLOCKING_WAIT=1``;
a timeout aborts the communicator.

**Types and ops.** See ``docs/nccl.md``: reductions SUM, PRODUCT, MIN, MAX, AVG
(ncclAvg from NCCL 2.10, else sum then divide), PREMUL_SUM (scale a copy, then
sum); complex arrays reduce as float pairs (SUM, AVG, PREMUL_SUM), bool as uint8
(SUM/MAX = or, PRODUCT/MIN = and); no bitwise ops and no int16/uint16
reductions. Data movement takes every dtype (as bytes where NCCL has no type).
"""

from __future__ import annotations

from typing import Any, Sequence

from .._world import world
from ..arrays.device import DeviceArray
from ..arrays.host import displacements
from ._cuda import CudaRuntime
from ._cuda_work import CudaWork
from ._nccl_base import _F32, NCCLBase, _consecutive, _overlap, _same_memory, on_device

__all__ = ["NCCLBackend", "CudaWork"]

#: builds the runtime of a backend made without one (tests replace it with a fake)


class NCCLBackend(NCCLBase):
    """NCCL collectives for one process group (see the module docstring).

    Args:
        comm: the group's MPI communicator (used once, to share the unique id).
        timeout_s: the group's timeout in seconds.
        group_name: the group's name, for messages.
        global_ranks: the members' world ranks (timeout diagnoses).
        runtime: the CUDA/NCCL adapter; None builds one with ``world.cuda_runtime_factory`` (default: over cupy).
        device: the GPU to use; None chooses one (:func:`~mpidist.backends._cuda.choose_device`).
        high_priority: create the communication stream with the greatest priority
            (torch's ``ProcessGroupNCCL.Options.is_high_priority_stream``).

    Example (``mpiexec -n 2``; usually made by ``init_process_group(backend="cpu:mpi,cuda:nccl")``)::

        >>> backend = NCCLBackend(MPI.COMM_WORLD.Dup(), timeout_s=60.0)
        >>> x = cupy.ones(4)
        >>> backend.all_reduce(mpidist.arrays.host.prepare_input(x, "f", "x"), None, ReduceOp.SUM, False)
    """

    def __init__(
        self,
        comm: Any,
        timeout_s: float,
        group_name: str = "",
        global_ranks: list[int] | None = None,
        runtime: CudaRuntime | None = None,
        device: int | None = None,
        high_priority: bool = False,
    ) -> None:
        rt = runtime if runtime is not None else (world.cuda_runtime_factory or CudaRuntime.from_cupy)()
        super().__init__(comm, timeout_s, rt, group_name, global_ranks, device, high_priority)

    # -- reductions ----------------------------------------------------------------------
    @on_device
    def all_reduce(self, buf: DeviceArray, backs: Any, op: Any, async_op: bool) -> CudaWork | None:
        fn = "all_reduce"
        self._check(fn, [buf], backs)
        p = self._plan(fn, buf.dtype, op)
        self.seq += 1
        seq = self.seq
        streams = self._begin([buf], backs)
        keep: list[Any] = [buf, backs]
        n = buf.size * p.mult
        with self._enqueue(fn, seq):
            if p.factor is not None:
                self.rt.scale(buf, p.factor, self.stream)  # in place: all_reduce overwrites it anyway
            if n:
                self._comm.allReduce(buf.ptr, buf.ptr, n, p.dtype, p.op, self.stream)
            if p.divide:
                self._divide(buf)
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def reduce(self, buf: DeviceArray, backs: Any, op: Any, root: int, async_op: bool) -> CudaWork | None:
        fn = "reduce"
        self._check(fn, [buf], backs)
        p = self._plan(fn, buf.dtype, op)
        self.seq += 1
        seq = self.seq
        streams = self._begin([buf], backs)
        keep: list[Any] = [buf, backs]
        at_root = self.rank == root
        n = buf.size * p.mult
        with self._enqueue(fn, seq):
            src = buf
            if p.factor is not None:
                if not at_root:
                    src = self._copy_of(buf, keep)  # never scale a non-root's input
                self.rt.scale(src, p.factor, self.stream)
            if n:
                self._comm.reduce(src.ptr, buf.ptr, n, p.dtype, p.op, root, self.stream)
            if p.divide and at_root:
                self._divide(buf)
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def reduce_scatter_tensor(
        self, out: DeviceArray, backs: Any, inp: DeviceArray, op: Any, async_op: bool
    ) -> CudaWork | None:
        fn = "reduce_scatter_tensor"
        self._check(fn, [out, inp], backs)
        p = self._plan(fn, out.dtype, op)
        self.seq += 1
        seq = self.seq
        streams = self._begin([out, inp], backs)
        keep: list[Any] = [out, inp, backs]
        in_place = inp.ptr + self.rank * out.nbytes == out.ptr and inp.device == out.device
        with self._enqueue(fn, seq):
            src = inp
            if p.factor is not None or (_overlap(out, inp) and not in_place):
                src = self._copy_of(inp, keep)
                if p.factor is not None:
                    self.rt.scale(src, p.factor, self.stream)
            if out.size:
                self._comm.reduceScatter(src.ptr, out.ptr, out.size * p.mult, p.dtype, p.op, self.stream)
            if p.divide:
                self._divide(out)
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def reduce_scatter(
        self, out: DeviceArray, backs: Any, ins: Sequence[DeviceArray], op: Any, async_op: bool
    ) -> CudaWork | None:
        fn = "reduce_scatter"
        self._check(fn, [out, *ins], backs)
        p = self._plan(fn, out.dtype, op)
        self.seq += 1
        seq = self.seq
        streams = self._begin([out, *ins], backs)
        keep: list[Any] = [out, ins, backs]
        sizes = [a.size for a in ins]
        even = len(set(sizes)) == 1
        with self._enqueue(fn, seq):
            srcs: Sequence[DeviceArray] = ins
            if p.factor is not None or any(_overlap(out, a) for a in ins) or (even and not _consecutive(ins)):
                packed = self._temp(out, sum(sizes), keep)
                srcs = [packed.flat(d, n) for d, n in zip(displacements(sizes), sizes)]
                for dst, a in zip(srcs, ins):
                    if a.size:
                        self.rt.copy(dst, a.reshape(a.size), self.stream)
                world.stats.count_copy(packed.nbytes)
                if p.factor is not None:
                    self.rt.scale(packed, p.factor, self.stream)
            if even:
                if out.size:
                    self._comm.reduceScatter(srcs[0].ptr, out.ptr, out.size * p.mult, p.dtype, p.op, self.stream)
            else:  # uneven blocks: one reduce per rank, rooted at that rank, in one group
                with self._grouped():
                    for r, a in enumerate(srcs):
                        if a.size:
                            self._comm.reduce(a.ptr, out.ptr, a.size * p.mult, p.dtype, p.op, r, self.stream)
            if p.divide:
                self._divide(out)
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    # -- data movement ----------------------------------------------------------------------
    @on_device
    def broadcast(self, buf: DeviceArray, backs: Any, root: int, async_op: bool) -> CudaWork | None:
        fn = "broadcast"
        dt, mult = self._check(fn, [buf], backs)
        self.seq += 1
        seq = self.seq
        streams = self._begin([buf], backs)
        with self._enqueue(fn, seq):
            if buf.size:
                self._comm.broadcast(buf.ptr, buf.ptr, buf.size * mult, dt, root, self.stream)
            self._write_backs(backs)
        return self._end(fn, seq, streams, [buf, backs], async_op)

    @on_device
    def all_gather_into_tensor(self, out: DeviceArray, backs: Any, inp: DeviceArray, async_op: bool) -> CudaWork | None:
        fn = "all_gather_into_tensor"
        dt, mult = self._check(fn, [out, inp], backs)
        self.seq += 1
        seq = self.seq
        streams = self._begin([out, inp], backs)
        keep: list[Any] = [out, inp, backs]
        with self._enqueue(fn, seq):
            send = inp
            if _overlap(out, inp) and inp.ptr != out.ptr + self.rank * inp.nbytes:
                send = self._copy_of(inp, keep)  # NCCL allows only the in-place layout
            if inp.size:
                self._comm.allGather(send.ptr, out.ptr, inp.size * mult, dt, self.stream)
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def all_gather(self, outs: Sequence[DeviceArray], backs: Any, inp: DeviceArray, async_op: bool) -> CudaWork | None:
        fn = "all_gather"
        dt, mult = self._check(fn, [inp, *outs], backs)
        self._disjoint(fn, "tensor_list", outs)
        self.seq += 1
        seq = self.seq
        streams = self._begin([inp, *outs], backs)
        keep: list[Any] = [inp, outs, backs]
        me = self.rank
        in_place = _same_memory(inp, outs[me])
        with self._enqueue(fn, seq):
            send = inp
            if not in_place and any(_overlap(inp, o) for o in outs):
                send = self._copy_of(inp, keep)
            if len({o.size for o in outs}) == 1:
                n = inp.size
                if n and _consecutive(outs):
                    self._comm.allGather(send.ptr, outs[0].ptr, n * mult, dt, self.stream)
                elif n:  # separate outputs: gather into one temporary, then copy out
                    tmp = self._temp(inp, n * self.size, keep)
                    self._comm.allGather(send.ptr, tmp.ptr, n * mult, dt, self.stream)
                    for r, o in enumerate(outs):
                        if not (r == me and in_place):
                            self.rt.copy(o, tmp.flat(r * n, n).reshape(o.shape), self.stream)
                    world.stats.count_copy(tmp.nbytes)
            else:  # uneven sizes: one broadcast per rank, in one group (as torch does)
                with self._grouped():
                    for r, o in enumerate(outs):
                        if o.size:
                            src = send.ptr if r == me else o.ptr
                            self._comm.broadcast(src, o.ptr, o.size * mult, dt, r, self.stream)
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def gather(
        self, inp: DeviceArray, outs: Sequence[DeviceArray] | None, backs: Any, root: int, async_op: bool
    ) -> CudaWork | None:
        fn = "gather"
        arrays = [inp, *(outs or ())]
        dt, mult = self._check(fn, arrays, backs)
        if outs is not None:
            self._disjoint(fn, "gather_list", outs)
        self.seq += 1
        seq = self.seq
        streams = self._begin(arrays, backs)
        keep: list[Any] = [inp, outs, backs]
        with self._enqueue(fn, seq):
            if outs is not None:
                self._copy_into(outs[root], inp, keep)  # first: a receive below may overwrite inp
            with self._grouped():
                if outs is None:
                    if inp.size:
                        self._comm.send(inp.ptr, inp.size * mult, dt, root, self.stream)
                else:
                    for r, o in enumerate(outs):
                        if r != root and o.size:
                            self._comm.recv(o.ptr, o.size * mult, dt, r, self.stream)
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def scatter(
        self, out: DeviceArray, backs: Any, ins: Sequence[DeviceArray] | None, root: int, async_op: bool
    ) -> CudaWork | None:
        fn = "scatter"
        arrays = [out, *(ins or ())]
        dt, mult = self._check(fn, arrays, backs)
        self.seq += 1
        seq = self.seq
        streams = self._begin(arrays, backs)
        keep: list[Any] = [out, ins, backs]
        with self._enqueue(fn, seq):
            with self._grouped():
                if ins is None:
                    if out.size:
                        self._comm.recv(out.ptr, out.size * mult, dt, root, self.stream)
                else:
                    for r, a in enumerate(ins):
                        if r != root and a.size:
                            self._comm.send(a.ptr, a.size * mult, dt, r, self.stream)
            if ins is not None:
                self._copy_into(out, ins[root], keep)  # after: the sends above may read memory out overlaps
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def all_to_all_single(
        self,
        out: DeviceArray,
        backs: Any,
        inp: DeviceArray,
        out_counts: Sequence[int] | None,
        in_counts: Sequence[int] | None,
        async_op: bool,
    ) -> CudaWork | None:
        fn = "all_to_all_single"
        dt, mult = self._check(fn, [out, inp], backs)
        n, me = self.size, self.rank
        if out_counts is None or in_counts is None:
            out_counts = [out.size // n] * n
            in_counts = [inp.size // n] * n
        if out_counts[me] != in_counts[me]:
            raise ValueError(
                f"{fn}: this rank sends {in_counts[me]} elements to itself but expects {out_counts[me]} from "
                "itself; input_split_sizes[rank] and output_split_sizes[rank] must match"
            )
        self.seq += 1
        seq = self.seq
        streams = self._begin([out, inp], backs)
        keep: list[Any] = [out, inp, backs]
        item = out.dtype.itemsize
        in_at, out_at = displacements(in_counts), displacements(out_counts)
        with self._enqueue(fn, seq):
            src = self._copy_of(inp, keep) if _overlap(out, inp) else inp
            with self._grouped():
                for r in range(n):
                    if r == me:
                        continue
                    if in_counts[r]:
                        self._comm.send(src.ptr + in_at[r] * item, in_counts[r] * mult, dt, r, self.stream)
                    if out_counts[r]:
                        self._comm.recv(out.ptr + out_at[r] * item, out_counts[r] * mult, dt, r, self.stream)
            if in_counts[me]:
                flat = out.reshape(out.size)
                self.rt.copy(
                    flat.flat(out_at[me], out_counts[me]),
                    src.reshape(src.size).flat(in_at[me], in_counts[me]),
                    self.stream,
                )
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def all_to_all(
        self, outs: Sequence[DeviceArray], backs: Any, ins: Sequence[DeviceArray], async_op: bool
    ) -> CudaWork | None:
        fn = "all_to_all"
        dt, mult = self._check(fn, [*outs, *ins], backs)
        self._disjoint(fn, "output_tensor_list", outs)
        self.seq += 1
        seq = self.seq
        streams = self._begin([*outs, *ins], backs)
        keep: list[Any] = [outs, ins, backs]
        me = self.rank
        with self._enqueue(fn, seq):
            if any(_overlap(o, a) for o in outs for a in ins):
                ins = [self._copy_of(a, keep) if a.size else a for a in ins]
            with self._grouped():
                for r in range(self.size):
                    if r == me:
                        continue
                    if ins[r].size:
                        self._comm.send(ins[r].ptr, ins[r].size * mult, dt, r, self.stream)
                    if outs[r].size:
                        self._comm.recv(outs[r].ptr, outs[r].size * mult, dt, r, self.stream)
            self._copy_into(outs[me], ins[me], keep)
            self._write_backs(backs)
        return self._end(fn, seq, streams, keep, async_op)

    @on_device
    def barrier(self, async_op: bool) -> CudaWork | None:
        """A one-element all_reduce; the host waits for it (within the group's timeout), as torch's does."""
        fn = "barrier"
        self._check(fn, [])
        self.seq += 1
        seq = self.seq
        if self._scratch is None:
            self._scratch = self.rt.ops.empty((1,), _F32, self.device)
        scratch = self._scratch
        streams = self._begin([])
        f32 = self._types[_F32].move[0]
        with self._enqueue(fn, seq):
            self._comm.allReduce(scratch.ptr, scratch.ptr, 1, f32, self._ops["sum"], self.stream)
        return self._end(fn, seq, streams, scratch, async_op, host_wait=True)

    # -- point-to-point -----------------------------------------------------------------------
    @on_device
    def send(self, buf: DeviceArray, peer: int, tag: int) -> CudaWork:
        """Send ``buf`` to group rank ``peer``; ``tag`` is ignored (NCCL has no tags, as in torch)."""
        dt, mult = self._check("send", [buf])
        self.p2p_seq += 1
        seq = self.p2p_seq
        streams = self._begin([buf])
        with self._enqueue("send", seq):
            if buf.size:
                self._comm.send(buf.ptr, buf.size * mult, dt, peer, self.stream)
        return self._end("send", seq, streams, buf, True)  # type: ignore[return-value]

    @on_device
    def recv(self, buf: DeviceArray, backs: Any, peer: int | None, tag: int) -> CudaWork:
        """Receive into ``buf`` from group rank ``peer``; ``tag`` is ignored."""
        if peer is None:
            raise ValueError(
                "recv: the nccl backend cannot receive from any source (src=None): NCCL matches messages by "
                "sender; pass src (or group_src)"
            )
        dt, mult = self._check("recv", [buf], backs)
        self.p2p_seq += 1
        seq = self.p2p_seq
        streams = self._begin([buf], backs)
        with self._enqueue("recv", seq):
            if buf.size:
                self._comm.recv(buf.ptr, buf.size * mult, dt, peer, self.stream)
            if backs:
                self._later(lambda: self._write_backs(backs))
        return self._end("recv", seq, streams, [buf, backs], True, source=peer)  # type: ignore[return-value]
