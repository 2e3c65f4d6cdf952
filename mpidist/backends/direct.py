"""The MPI backend's hot collectives, one call each: straight to MPI where the C module binds, else mpi4py.

Each method posts one nonblocking collective on C-contiguous numpy arrays and
returns what :meth:`MPIBackend._done <mpidist.backends.mpi.MPIBackend._done>`
finishes: None when the operation is already complete (the C calls tested it:
blocking calls only), else the pending request (an int handle from C, an
``MPI.Request`` from mpi4py).

* ``_direct.Direct`` (``backends/_direct.c``, built with the package) calls the
  MPI library that mpi4py loaded, and tests the request up to ``spins`` times
  with the GIL released: about 0.1 us per call on one rank, where mpi4py's
  ``Iallreduce`` + ``Test`` takes 0.5 us. Whatever it does not take (a device
  array, a count past ``INT_MAX``) it hands to the mpi4py calls.
* :class:`MPI4pyCalls` makes the same calls through mpi4py (``spins`` unused):
  where the C module was not built, where the check below fails, or with
  ``MPIDIST_DIRECT_MPI=0``.

:func:`bind` finds the MPI functions once per process and compares the C calls
with mpi4py on ``COMM_SELF`` (handles, results) before any group uses them;
:func:`direct_status` says which calls are in use and why.

Example (``mpiexec -n 1``, after ``init_process_group``)::

    >>> calls = make_calls(MPI.COMM_SELF)
    >>> a = np.ones(3)
    >>> calls.allreduce(a, MPI.DOUBLE, MPI.SUM, 16) is None   # complete: one rank
    True
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from mpi4py import MPI

from .._validate import c_extension_refused
from .._world import world

__all__ = ["MPI4pyCalls", "DirectState", "make_calls", "bind", "direct_status", "calls_kind"]

IN_PLACE = MPI.IN_PLACE


class MPI4pyCalls:
    """The hot collectives through mpi4py: each returns the ``MPI.Request`` of the posted operation."""

    __slots__ = ("_rank", "_iallreduce", "_ireduce", "_ibcast", "_iallgather", "_ialltoall", "_irsb", "_irs", "_isend", "_ibarrier")

    def __init__(self, comm: MPI.Comm) -> None:
        self._rank = comm.Get_rank()
        self._iallreduce = comm.Iallreduce
        self._ireduce = comm.Ireduce
        self._ibcast = comm.Ibcast
        self._iallgather = comm.Iallgather
        self._ialltoall = comm.Ialltoall
        self._irsb = comm.Ireduce_scatter_block
        self._irs = comm.Ireduce_scatter
        self._isend = comm.Isend
        self._ibarrier = comm.Ibarrier

    def allreduce(self, buf: Any, dt: MPI.Datatype, op: MPI.Op, spins: int) -> MPI.Request:
        """In place."""
        return self._iallreduce(IN_PLACE, [buf, dt], op)

    def reduce(self, buf: Any, dt: MPI.Datatype, op: MPI.Op, root: int, spins: int) -> MPI.Request:
        """In place at the root; elsewhere ``buf`` is only sent."""
        msg = [buf, dt]
        return self._ireduce(IN_PLACE, msg, op, root) if root == self._rank else self._ireduce(msg, None, op, root)

    def bcast(self, buf: Any, dt: MPI.Datatype, root: int, spins: int) -> MPI.Request:
        return self._ibcast([buf, dt], root)

    def allgather(self, out: Any, inp: Any, dt: MPI.Datatype, spins: int) -> MPI.Request:
        """``inp`` None: in place (this rank's block of ``out`` already holds its data)."""
        return self._iallgather(IN_PLACE if inp is None else [inp, dt], [out, dt])

    def alltoall(self, out: Any, inp: Any, dt: MPI.Datatype, spins: int) -> MPI.Request:
        return self._ialltoall([inp, dt], [out, dt])

    def reduce_scatter_block(self, out: Any, inp: Any, dt: MPI.Datatype, op: MPI.Op, spins: int) -> MPI.Request:
        return self._irsb([inp, dt], [out, dt], op)

    def reduce_scatter(self, out: Any, inp: Any, dt: MPI.Datatype, op: MPI.Op, spins: int) -> MPI.Request:
        """The vector call with equal counts (faster than the block call for large inputs on MPICH)."""
        return self._irs([inp, dt], [out, dt], None, op)

    def barrier(self, spins: int) -> MPI.Request:
        return self._ibarrier()

    # -- point-to-point (the contracts of _direct_p2p.c) --
    def send(self, buf: Any, dt: MPI.Datatype, peer: int, tag: int, spins: int) -> MPI.Request:
        return self._isend([buf, dt], peer, tag)

    def irecv(self, buf: Any, peer: int, tag: int) -> None:
        """None: the backend posts the receive itself (``mpi_receive.posted_receive``)."""
        return None

    def recv(self, buf: Any, peer: int, tag: int, spins: int) -> None:
        """None: nothing posted or matched; the backend's matched receive takes the message."""
        return None

    def post_send(self, buf: Any, dt: MPI.Datatype, peer: int, tag: int, spins: int, owner: Any, seq: int) -> None:
        """None: the backend makes its Python Work (``_direct_posted.c`` makes a lighter one)."""
        return None

    def post_recv(self, buf: Any, peer: int, tag: int, spins: int, owner: Any, seq: int) -> None:
        """None: as :meth:`post_send`."""
        return None

    def wait(self, request: MPI.Request, status: MPI.Status | None, spins: int, nbytes: int = -1) -> bool | None:
        """One test of ``request`` (the first test of a Work's wait; the Python poll continues).

        With ``nbytes`` (a receive's size), a completed test gives None: the receive checks the size itself.
        """
        done = request.Test(status)
        return None if done and nbytes >= 0 else done


class DirectState:
    """Whether this process calls MPI directly, and why not (``world.direct``, decided once)."""

    __slots__ = ("module", "reason")

    def __init__(self, module: Any, reason: str) -> None:
        self.module = module  # the bound mpidist.backends._direct, or None
        self.reason = reason


def bind() -> DirectState:
    """Bind the C calls to the MPI library mpi4py uses, once per process (MPI must be initialized)."""
    state = world.direct
    if state is None:
        state = world.direct = _bind()
    return state


def direct_status() -> str:
    """How the MPI backend calls MPI in this process: ``"direct"`` or ``"mpi4py (<why>)"``."""
    if world.direct is None and not MPI.Is_initialized():
        return "undecided (MPI is not initialized)"
    state = bind()
    return "direct" if state.module is not None else f"mpi4py ({state.reason})"


def make_calls(comm: MPI.Comm) -> Any:
    """The hot collectives of ``comm``: the C calls if they are bound (over mpi4py's), else mpi4py's."""
    fallback = MPI4pyCalls(comm)
    module = bind().module
    if module is None:
        return fallback
    return module.Direct(comm.handle, comm.Get_rank(), comm.Get_size(), fallback)


def calls_kind(calls: Any) -> str:
    """``"mpi4py"`` for :class:`MPI4pyCalls`, else ``"direct"``."""
    return "mpi4py" if type(calls) is MPI4pyCalls else "direct"


def _bind() -> DirectState:
    refused = c_extension_refused("MPIDIST_DIRECT_MPI")
    if refused:
        return DirectState(None, refused)
    try:
        from . import _direct
    except ImportError as exc:
        return DirectState(None, f"the C module was not built: {exc}")
    size = getattr(MPI, "_sizeof", None)
    if size is None or size(MPI.Comm) not in (4, 8) or size(MPI.Request) != size(MPI.Comm):
        return DirectState(None, "this mpi4py does not say the size of MPI handles")
    capi = getattr(MPI, "__pyx_capi__", None)  # mpi4py's C API: the handle getters (see _direct.c)
    if not isinstance(capi, dict):
        return DirectState(None, "this mpi4py does not export its C API (mpi4py.MPI.__pyx_capi__)")
    try:
        _direct.bind(
            MPI.__file__,
            size(MPI.Comm) == 4,
            int(IN_PLACE) % (1 << 64),
            MPI.Datatype,
            MPI.Op,
            MPI.Exception,
            capi,
        )
        _direct.bind_p2p(
            MPI.__file__,
            MPI.BYTE,
            MPI.ERR_TRUNCATE,
            _status_offset(MPI.Status.Set_source),
            _status_offset(MPI.Status.Set_error),
            scratch_max(),
            MPI.Request,
            MPI.Status,
            capi,
        )
    except (OSError, ValueError) as exc:
        return DirectState(None, str(exc))
    problem = _self_check(_direct)
    if problem:
        return DirectState(None, problem)
    world.stats.counted_in_c = _direct.scratch_copies  # the small recv's copies out of its scratch buffer
    return DirectState(_direct, "")


#: the largest blocking recv (bytes) that _direct_p2p.c receives through its scratch buffer, with no probe
SCRATCH_MAX = 16 << 10


def scratch_max() -> int:
    """The largest blocking recv (bytes) received through the scratch buffer: :data:`SCRATCH_MAX`, or 0 on Open MPI.

    The scratch route lets MPI truncate a message longer than its buffer. Open MPI 5.0.11 corrupts its heap
    when a large (rendezvous) message is truncated ("double free or corruption", SIGABRT, at 2 ranks with a
    160 KB message into a 64 KiB receive), so there every blocking recv probes first and never truncates.
    """
    return 0 if MPI.Get_library_version().startswith("Open MPI") else SCRATCH_MAX


def _status_offset(setter: Any) -> int:
    """The byte offset in this library's ``MPI_Status`` of the field that ``setter`` (an ``MPI.Status`` method:
    ``Set_source``, ``Set_error``) writes."""
    status = MPI.Status()
    marker = 0x5A5A5A5
    setter(status, marker)
    words = np.frombuffer(ctypes.string_at(MPI._addressof(status), MPI._sizeof(MPI.Status)), np.intc)
    found = np.flatnonzero(words == marker)
    if len(found) != 1:
        raise ValueError(f"mpi4py's Status.{setter.__name__} wrote no single field of the MPI_Status")
    return int(found[0]) * words.itemsize


def _self_check(module: Any) -> str:
    """Compare the C calls with mpi4py on COMM_SELF; return what differs ('' if nothing)."""
    for obj in (MPI.FLOAT, MPI.INT64_T, MPI.SUM, MPI.MAX):
        if module.handle(obj) != obj.handle:
            return f"mpi4py's C API gives another handle than {obj}.handle"
    comm = MPI.COMM_SELF
    calls = module.Direct(comm.handle, 0, 1, MPI4pyCalls(comm))
    a = np.array([3, -2, 7], np.int64)
    out = np.zeros(3, np.int64)
    many = 1 << 20  # tests: one rank completes at once
    try:
        pending = calls.allreduce(a, MPI.INT64_T, MPI.MAX, many)
        pending = pending or calls.bcast(a, MPI.INT64_T, 0, many)
        pending = pending or calls.allgather(out, a, MPI.INT64_T, many)
    except MPI.Exception as exc:
        return f"a check on COMM_SELF failed: {exc}"
    if pending is not None or a.tolist() != [3, -2, 7] or out.tolist() != [3, -2, 7]:
        return "a check on COMM_SELF gave another result than mpi4py"
    status, got = MPI.Status(), np.zeros(3, np.int64)
    try:  # wait: tests mpi4py's request in place and fills its status
        req = comm.Irecv([got, MPI.INT64_T], 0, 5)
        comm.Isend([a, MPI.INT64_T], 0, 5).Wait()
        done = calls.wait(req, status, many)
    except MPI.Exception as exc:
        return f"a check of wait on COMM_SELF failed: {exc}"
    if not done or req != MPI.REQUEST_NULL or status.Get_count(MPI.INT64_T) != 3 or got.tolist() != [3, -2, 7]:
        return "wait on COMM_SELF gave another result than mpi4py's Test"
    try:  # wait's size check: right (True), and not (None: complete, for the Python check)
        sized = []
        for nbytes in (24, 16):
            status, req = MPI.Status(), comm.Irecv([got, MPI.BYTE], 0, 6)
            comm.Isend([a, MPI.INT64_T], 0, 6).Wait()
            sized.append(calls.wait(req, status, many, nbytes))
    except MPI.Exception as exc:
        return f"a check of wait's size check on COMM_SELF failed: {exc}"
    if sized != [True, None]:
        return f"wait's size check on COMM_SELF gave {sized}, not [True, None]"
    return ""
