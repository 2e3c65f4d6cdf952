"""The MPI backend's receive path: posting a receive, matching a message, checking its size.

A receive is *posted* (``MPIBackend.recv``: ``irecv`` and ``batch_isend_irecv``; and
``recv_init``'s persistent receive) or *matched* (``MPIBackend.recv_and_wait``:
blocking ``recv``); :class:`Receive` is the Work of both (see its docstring). A
message of another size than the receive's array raises ValueError
(:func:`receive_size_error`), never a crash inside MPI: a posted receive takes
bytes (:func:`posted_receive`) and :func:`arrived` counts what came.

Example (``mpiexec -n 1``, after ``init_process_group``)::

    >>> buf = np.zeros(2, np.float64)
    >>> message, as_bytes = posted_receive(buf, MPI.DOUBLE)
    >>> as_bytes, message[1] == MPI.BYTE
    (True, True)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .._world import world
from ..arrays.host import then_write_back
from ..work import Work, poll
from .base import BaseBackend
from .mpi_types import LARGE_COUNTS, TypeEntry

__all__ = [
    "Receive", "posted_receive", "arrived", "receive_size_error", "reports_self_truncation", "finish_blocking_receive",
]  # fmt: skip

BYTE = MPI.BYTE
ANY_SOURCE = MPI.ANY_SOURCE
ERR_TRUNCATE = MPI.ERR_TRUNCATE
_REQUEST = MPI.Request
_MESSAGE = MPI.Message
ndarray = np.ndarray

#: the note of a blocking recv that timed out before any message came
_NOTHING_POSTED = "No message had arrived, and nothing is left posted: the next message goes to the next receive."


#: a posted receive of this many bytes or fewer posts bytes, not elements (see posted_receive)
_BYTES_RECEIVE_LIMIT = 2**63 - 1 if LARGE_COUNTS else 2**31 - 1


def posted_receive(buf: Any, mpi_type: MPI.Datatype) -> tuple[list[Any], bool]:
    """The message a receive posted into ``buf`` gives MPI: ``(message, as bytes)``.

    A message that is not a whole number of the receive's elements (12 bytes of
    float32 into float64) makes MPICH 5 fail an assertion while it unpacks it and
    abort the whole job. Posted as bytes, the message arrives as it is and
    :func:`arrived` finds it was not whole elements, for the ValueError every other
    size mismatch raises. On an MPI-3 library (32-bit counts: Open MPI 5) a receive
    of 2 GiB or more keeps its element type, so that its limit stays 2**31 elements.
    """
    if buf.nbytes <= _BYTES_RECEIVE_LIMIT:
        return [buf, BYTE], True
    return [buf, mpi_type], False


def arrived(status: MPI.Status, mpi_type: MPI.Datatype, itemsize: int, as_bytes: bool) -> int:
    """The elements a completed receive got, or ``-2 - bytes`` when the message was not whole elements."""
    if as_bytes:
        nbytes = status.Get_count(BYTE)
        return nbytes // itemsize if nbytes % itemsize == 0 else -2 - nbytes
    got = status.Get_count(mpi_type)
    return -2 - status.Get_count(BYTE) if got == MPI.UNDEFINED else got


def receive_size_error(size: int, name: str, source: int, got: int) -> ValueError:
    """The error of a receive into ``size`` elements of ``name`` that got ``got`` (-3: more; -2 - n: n bytes)."""
    where = f"from rank {source} (group rank)"
    if got == -3:
        return ValueError(
            f"recv: a message {where} is larger than the {size} elements of {name} expected; sizes must match"
        )
    arrived = f"{-2 - got} bytes" if got < -1 else str(got)
    return ValueError(f"recv: expected {size} elements of {name} {where} but {arrived} arrived; sizes must match")


def _elements(nbytes: int, itemsize: int) -> int:
    """``nbytes`` as :func:`arrived` reports it: elements, ``-2 - bytes`` if not whole elements, -3 if unknown (-1)."""
    if nbytes < 0:
        return -3
    return nbytes // itemsize if nbytes % itemsize == 0 else -2 - nbytes


def finish_blocking_receive(
    owner: BaseBackend, got: Any, buf: ndarray, e: TypeEntry, backs: Any, peer: int | None, tag: int
) -> int:
    """Finish a blocking ``recv`` that the direct call did not complete; return the source's group rank.

    ``got`` is what ``Direct.recv`` returned (``backends/_direct_p2p.c``) when it was not the source:
    None (nothing posted or matched: the matched receive of :class:`Receive` takes the message, as
    where C is off or the array is staged), a pending receive (into the scratch buffer, or into ``buf``),
    a message of another size that arrived (raised here) or matched and is still to be received.
    """
    if got is None:
        w = Receive(None, buf, e, backs, owner, peer, (owner.comm, tag))  # type: ignore[attr-defined]
    elif len(got) == 1:  # (request,): the receive into buf, its size matched
        w = Receive(_REQUEST.fromhandle(got[0]), buf, e, None, owner, peer, None, None, True)
    elif len(got) == 3:  # (source, bytes, message): matched, of another size
        w = Receive(None, buf, e, None, owner, peer, None)
        w.receive_elsewhere(_MESSAGE.fromhandle(got[2]), got[1])
    elif type(got[1]) is ndarray:  # (request, scratch): the small route's receive, pending
        w = Receive(_REQUEST.fromhandle(got[0]), buf, e, None, owner, peer, None, None, True, got[1])
    else:  # (source, bytes): arrived, of another size; buf untouched
        raise receive_size_error(buf.size, e.info.name, got[0], _elements(got[1], buf.itemsize))
    w.wait()
    return w.source_rank()


def reports_self_truncation() -> bool:
    """Whether this MPI library reports a message a rank sends itself that is longer than the receive.

    MPICH raises MPI_ERR_TRUNCATE as for any peer; Open MPI 5 silently truncates a message
    to self (found out once per process, on MPI_COMM_SELF; kept in ``world``).
    """
    if world.self_truncation_reported is None:
        comm = MPI.COMM_SELF
        got = np.zeros(1, np.uint8)
        recv = comm.Irecv([got, BYTE], 0, 0)
        comm.Isend([np.ones(2, np.uint8), BYTE], 0, 0).Wait()
        status = MPI.Status()
        try:
            recv.Wait(status)
            reported = status.Get_error() == ERR_TRUNCATE
        except MPI.Exception as exc:
            reported = exc.Get_error_class() == ERR_TRUNCATE
        world.self_truncation_reported = reported
    return world.self_truncation_reported


class Receive(Work):
    """The Work of a receive on an MPI communicator.

    A receive is *posted* (``MPIBackend.recv``: ``irecv`` and ``batch_isend_irecv``)
    or *matched* (``MPIBackend.recv_blocking``: blocking ``recv``):

    * posted: ``MPI_Irecv`` into the caller's array at once, so that MPI matches
      the message as soon as it arrives and a large send to this rank can
      complete while this rank waits elsewhere (what send-then-receive exchanges
      rely on). MPI writes the message into the array when it matches, before its
      size can be checked: a message of another size raises ValueError here but
      has written its first elements (up to the array's size) into the array.
    * matched: nothing is posted; each test probes (``MPI_Improbe``) for the
      message and only once it is there, and its size is the array's, receives
      it (``MPI_Imrecv``) into the array. A message of another size goes into a
      scratch buffer (so the array is untouched) and raises ValueError.

    Where the C calls are bound, a blocking ``recv`` first runs in C
    (``MPIBackend.recv_and_wait``, ``_direct_p2p.c``): a small array's message is
    received into a scratch buffer and copied into the array only if it has the
    array's size (no probe: MPI matches it on arrival), a large one is matched
    first as above. Only what that call leaves pending becomes a Receive
    (:func:`finish_blocking_receive`); a scratch receive that times out is
    cancelled, leaving nothing posted.

    When ``wait`` times out, a posted receive that no message has matched is
    cancelled (``MPI_Cancel``) and a matched one that found no message has
    nothing to cancel: either way nothing is left pending, the next message goes
    to the next receive and the group stays usable. A receive whose message had
    already matched cannot be cancelled: it stays pending, as a timed-out
    collective does.
    """

    __slots__ = (
        "_buf", "_entry", "_peer", "_posted", "_probe", "_arrived", "_longer", "_as_bytes", "_scratch", "_calls", "_spins",
        "_nbytes",
    )  # fmt: skip

    def __init__(
        self, req: MPI.Request | None, buf: ndarray, e: TypeEntry, backs: Any, owner: BaseBackend,
        peer: int | None, probe: tuple[MPI.Comm, int] | None, longer: ndarray | None = None,
        as_bytes: bool = False, scratch: ndarray | None = None,
    ) -> None:  # fmt: skip
        post = None if not backs else then_write_back(None, backs)  # a staged array: write it back
        keep = buf if longer is None and scratch is None else (buf, longer, scratch)
        Work.__init__(
            self, [] if req is None else [req], post, keep, "recv", owner, owner.p2p_seq, owner.timeout_s, MPI.Status()
        )
        # a posted receive from this rank to itself on a library that truncates those silently:
        # the message lands in this array of one element more, and is copied into buf
        self._longer = longer
        # the blocking recv's small route (_direct_p2p.c): the message went into these bytes, and is copied
        # into buf only if it has buf's size (buf stays untouched otherwise)
        self._scratch = scratch
        self._as_bytes = as_bytes  # posted as bytes (posted_receive)
        self._buf = buf
        self._entry = e
        self._peer = peer  # group rank, or None: any
        self._posted = req is not None
        self._probe = probe  # (communicator, tag) of a matched receive until its message is there
        # elements that arrived, once known (else read from the status); -2 - bytes: not whole elements; -3: longer
        self._arrived: int | None = None
        self._calls, self._spins = owner._calls, owner.c_spins  # type: ignore[attr-defined]  # wait's first test
        # a plain posted receive (nothing to copy or write back afterwards): wait's first test checks its size in C
        self._nbytes = buf.nbytes if req is not None and post is None and longer is None and scratch is None else -1

    def _first_test(self) -> bool:
        """A posted receive's first test in ``wait``: up to the owner's ``c_spins`` tests in C (``Direct.wait``,
        without Python between them; one ``Test`` where C is off), then ``wait`` polls as for any Work."""
        if self._probe is not None:
            return self._test()
        try:
            done = self._calls.wait(self._reqs[0], self._status, self._spins, self._nbytes)
        except MPI.Exception as exc:  # MPICH reports a longer message as an error of the test
            if exc.Get_error_class() != ERR_TRUNCATE:
                raise
            self._arrived = -3
            return True
        if done is None:  # complete, and C did not find the size right: _complete looks at the status
            return True
        if done and self._nbytes >= 0:  # C found exactly the array's bytes and no error
            self._arrived = self._buf.size
        return done

    def _test(self) -> bool:
        if self._probe is not None and not self._match():
            return False
        try:
            return self._reqs[0].Test(self._status)
        except MPI.Exception as exc:  # MPICH reports a longer message as an error of the test
            if exc.Get_error_class() != ERR_TRUNCATE:
                raise
            self._arrived = -3
            return True

    def _match(self) -> bool:
        """Probe for the message of a matched receive; once it is there, receive it. True once matched."""
        comm, tag = self._probe  # type: ignore[misc]
        status, peer = self._status, self._peer
        msg = comm.Improbe(ANY_SOURCE if peer is None else peer, tag, status)
        if msg is None:
            return False
        self._probe = None
        mpi, buf = self._entry.mpi, self._buf
        self._arrived = count = status.Get_count(mpi)
        if count == buf.size:
            self._reqs = [msg.Irecv([buf, mpi])]
            return True
        self.receive_elsewhere(msg, status.Get_count(BYTE))
        return True

    def receive_elsewhere(self, msg: MPI.Message, nbytes: int) -> None:
        """Receive the matched message ``msg`` of ``nbytes``, not of the array's size, into a scratch buffer:
        the caller's array is never written, and the Work fails with the size error once it has arrived."""
        buf = self._buf
        if nbytes % buf.itemsize:  # not a whole number of elements
            scratch, self._arrived = np.empty(nbytes, np.uint8), -2 - nbytes
            self._reqs = [msg.Irecv([scratch, BYTE])]
        else:
            scratch = np.empty(nbytes // buf.itemsize, buf.dtype)
            self._arrived = scratch.size
            self._reqs = [msg.Irecv([scratch, self._entry.mpi])]
        self._keep = (self._keep, scratch)

    def _complete(self) -> None:
        """Fail with a ValueError if a message of another size arrived; else finish as any Work."""
        if self._done:
            return
        got, longer_message = self._arrived, False
        if got is None:  # a posted receive: the status tells (Open MPI reports a longer message there)
            status = self._status
            longer_message = status.Get_error() == ERR_TRUNCATE
            got = -3 if longer_message else arrived(status, self._entry.mpi, self._buf.itemsize, self._as_bytes)
        scratch = self._scratch
        if scratch is not None and got != -3:
            nbytes = self._status.Get_count(BYTE)
            if nbytes >= scratch.size:  # it filled the scratch buffer: it may have been longer (truncated silently)
                got = -3
            elif got == self._buf.size:
                self._buf.reshape(-1).view(np.uint8)[:] = scratch[:nbytes]
                world.stats.count_copy(nbytes)  # the small blocking recv's copy out of its scratch buffer
        longer = self._longer
        if longer is not None and (got >= 0 or longer_message):  # not when the message was not whole elements
            size = self._buf.size
            if got > size:
                got = -3
            n = min(got, size) if got >= 0 else size  # what MPI would have written into the array itself
            self._buf.reshape(-1)[:n] = longer[:n]
        if got != self._buf.size:
            self._fail(self._size_error(got))
            return
        Work._complete(self)

    def _size_error(self, got: int) -> ValueError:
        return receive_size_error(self._buf.size, self._entry.info.name, self._status.Get_source(), got)

    def _expired(self, limit: float) -> None:
        owner, op, seq = self._owner, self._op, self._seq
        if self._probe is not None:  # matched receive: no message has come, and nothing was posted
            note = _NOTHING_POSTED
            self._fail(owner.timeout_failure(op, seq, limit, note, settled=True))
            return
        if self._posted:
            try:
                self._reqs[0].Cancel()
                # a receive that no message matched ends at once, cancelled; else its message completes it
                ended = poll(self._test, min(1.0, limit), owner.spins)
            except MPI.Exception:
                ended = False
            if ended and self._status.Is_cancelled():
                note = "The receive was cancelled: the next message goes to the next receive."
                if self._scratch is not None:  # a blocking recv's: for its caller, nothing was ever posted
                    note = _NOTHING_POSTED
                self._fail(owner.timeout_failure(op, seq, limit, note, settled=True))
                return
            if ended:  # its message arrived as the time ran out: it is received after all
                self._complete()
                return
        owner.keep_stuck(self._reqs, self._keep)
        source = self._status.Get_source() if self._peer is None and not self._posted else self._peer
        sender = "A message" if source is None else f"A message from rank {source} (group rank)"
        note = (
            f"{sender} had matched the receive but did not finish arriving, and MPI cannot cancel a "
            "matched receive: the receive stays pending and its array in use."
        )
        self._fail(owner.timeout_failure(op, seq, limit, note))
