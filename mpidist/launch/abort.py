"""Ending the whole job when one rank cannot go on.

MPI has no way to make other ranks leave a collective they are waiting in. When
a rank fails for good (an unhandled exception, a timeout you cannot recover from),
the right response is usually to end the job, as torch's asynchronous error
handling does, instead of leaving the other ranks waiting until their timeouts.

* :func:`abort_process_group` calls ``MPI_Abort`` (the launcher then ends every
  rank of the job).
* :func:`install_excepthook` (or ``python -m mpidist script.py``) prints an
  unhandled exception with every line prefixed by ``[rank N]`` and aborts.
* ``MPIDIST_ABORT_ON_TIMEOUT=1`` turns every timeout into: print the diagnosis,
  then abort the job (instead of raising DistBackendError).
* At exit, a process with a call that timed out and is still pending inside MPI
  aborts the job instead of finalizing MPI (:func:`exit_check`): MPI_Finalize
  would wait for ranks that may never get there.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import os
import sys
import time
import traceback
from types import TracebackType
from typing import Any

from .._world import world

__all__ = ["abort_process_group", "abort_after_timeout", "install_excepthook", "excepthook", "rank_label"]

#: exit code of a job that mpidist aborted (EX_SOFTWARE)
ABORT_CODE = 70


def rank_label() -> str:
    """This process's world rank, for messages (also before init, from launcher variables)."""
    if world.default_pg is not None:
        return str(world.default_pg.rank())
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            return str(MPI.COMM_WORLD.Get_rank())
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK"):
        if os.environ.get(var, "").isdigit():
            return os.environ[var]
    return "?"


def _say(text: str) -> None:
    prefix = f"[rank {rank_label()}] "
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").splitlines()))
    sys.stderr.flush()


def abort_after_timeout(error: BaseException) -> None:
    """End the job after a call timed out (``MPIDIST_ABORT_ON_TIMEOUT=1``; the backends call it through
    ``world.init_info.on_timeout``), printing ``error`` first."""
    abort_process_group(None, message=f"{error} Aborting the job (MPIDIST_ABORT_ON_TIMEOUT=1).")


def abort_process_group(group: Any = None, errorcode: int = ABORT_CODE, message: str | None = None) -> None:
    """End the job: ``MPI_Abort`` on ``group``'s communicator (the default group if None).

    Every rank of the job ends, not only the group's: MPI implementations abort
    the whole job. ``message`` is printed first, prefixed with ``[rank N]``.
    Only one rank needs to call it; it does not return.

    Args:
        group: The group whose communicator to abort; None is the default group
            (``MPI.COMM_WORLD`` before ``init_process_group``).
        errorcode: The exit code the launcher reports (70 by default).
        message: A line to print on stderr first.

    Examples:
        >>> try:
        ...     step()
        ... except Exception as exc:
        ...     dist.abort_process_group(message=f"step failed: {exc}")  # every rank ends
    """
    if message:
        _say(message)
    from mpi4py import MPI

    pg = world.default_pg if group is None else group
    _abort(getattr(pg, "mpi_comm", None) or MPI.COMM_WORLD, errorcode)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Skip the frames of ``python -m mpidist`` itself (runpy and mpidist/__main__.py)."""
    start = tb
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if "runpy" not in name and not name.endswith(os.path.join("mpidist", "__main__.py")):
            return tb
        tb = tb.tb_next
    return start


def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Print the exception with ``[rank N]`` on every line, then abort the whole job."""
    _say("".join(traceback.format_exception(kind, value, _user_frames(tb))))
    if kind is KeyboardInterrupt or not _mpi_running():
        return
    _say(f"mpidist: unhandled {kind.__name__}; aborting the job so that the other ranks do not hang")
    from mpi4py import MPI

    _abort(MPI.COMM_WORLD, ABORT_CODE)


def _mpi_running() -> bool:
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI

    return bool(MPI.Is_initialized() and not MPI.Is_finalized())


def install_excepthook() -> None:
    """Make an unhandled exception on any rank print ``[rank N]``-prefixed and abort the job.

    Without it, a rank that dies of an exception leaves the others waiting in
    their next collective until its timeout. It replaces ``sys.excepthook``; a
    ``KeyboardInterrupt`` is printed and not turned into an abort.

    Examples:
        >>> import mpidist
        >>> mpidist.install_excepthook()  # or run: mpiexec -n 4 python -m mpidist script.py
    """
    sys.excepthook = excepthook


def exit_check() -> None:
    """At interpreter exit: abort the job, instead of finalizing MPI, while calls that timed out are pending.

    A call that timed out stays pending inside MPI (``world.timed_out``). Finalizing
    MPI then waits for every other rank to finalize too, and the ranks that never
    joined the call may never get there (hung, or waiting for this rank): the job
    would hang at exit. So the process says which calls are pending, on stderr, and
    calls ``MPI_Abort``, which ends every rank of the job (exit code 70). Calls
    that completed after all (a late rank joined them) do not count. Registered
    with ``atexit`` on import; ``mpidist.testing`` clears the record at the end of
    a test session whose tests made calls time out on purpose.
    """
    if not world.timed_out or not _mpi_running():
        return
    pending = [
        f"{op} (call #{seq}) on {backend.describe()}" for backend, op, seq in world.timed_out if _pending(backend)
    ]
    if not pending:
        return
    _say(
        f"mpidist: exiting with {len(pending)} call(s) that timed out still pending inside MPI: "
        f"{'; '.join(pending)}. Finalizing MPI would wait for the ranks that never joined them; aborting "
        f"the job instead (MPI_Abort, exit code {ABORT_CODE})."
    )
    from mpi4py import MPI

    _abort(MPI.COMM_WORLD, ABORT_CODE)


#: how long a survivor of a dead member lets MPI_Finalize run before it ends without it (seconds)
FINALIZE_LIMIT_S = 10.0


def finalize_after_failure() -> None:
    """At interpreter exit, in a process that went on after a member died (``shrink_group`` over ULFM):
    finalize MPI without the runtime's fence over every process of the job, which the dead one never joins.

    Open MPI 5's ``MPI_Finalize`` starts with a PMIx fence over every process the job started
    (``ompi_mpi_finalize``, waiting in ``opal_progress``), dead ones included. The runtime (PRRTE)
    completes it without the dead process only if it has recorded the death by then: here it had not
    in 2 of 6 runs of ``examples/survive_ddp.py`` and 4 of 8 of ``survive_sgd.py``, and every survivor
    waited (open-mpi/ompi#11404); with the fence left out, 20 of 20 runs of each exited 0. Open MPI's
    switch ``mpi_async_mpi_finalize`` leaves that fence out; it is read once at ``MPI_Init``, so a
    survivor sets the variable behind it (``ompi_async_mpi_finalize`` in libmpi) just before
    finalizing. The rest of ``MPI_Finalize`` runs as usual and the process ends with its own exit
    status. What the fence guards against (Open MPI's comment: a process tearing down its connections
    while a peer still sends to it over an unreliable transport) needs a message still in flight at
    exit; the examples' survivors complete every call before they exit.

    Should finalizing still not return within ``FINALIZE_LIMIT_S`` (another MPI library, an Open MPI
    without that variable, a hang elsewhere), faulthandler's timer (a C thread: mpi4py holds the
    interpreter lock inside ``MPI_Finalize``) prints where and ends the process with exit status 1.
    """
    if not world.survived_failure or not _mpi_running():
        return
    from mpi4py import MPI

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    skip_finalize_fence(MPI)
    faulthandler.dump_traceback_later(FINALIZE_LIMIT_S, exit=True)
    MPI.Finalize()
    faulthandler.cancel_dump_traceback_later()


def skip_finalize_fence(mpi: Any) -> bool:
    """Make Open MPI's next ``MPI_Finalize`` skip its fence over the whole job (``mpi_async_mpi_finalize``).

    Returns True if the switch is set: the MPI library is Open MPI and its libmpi, as loaded in this
    process, exports ``ompi_async_mpi_finalize``. Anything else (MPICH, an Open MPI build without the
    variable) is left as it is, and False returned.
    """
    try:
        if not mpi.Get_library_version().startswith("Open MPI"):
            return False
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi.so" in line}
        for path in sorted(paths):
            flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), "ompi_async_mpi_finalize")
            flag.value = True
            return True
    except (OSError, ValueError, AttributeError):  # no /proc, no such symbol, not a shared library
        pass
    return False


#: how long a process that is about to abort the job gives its launcher to forward its last lines
_OUTPUT_GRACE_S = 0.3


def _abort(comm: Any, errorcode: int) -> None:
    """``MPI_Abort`` on ``comm``, after flushing stdout and stderr and waiting a moment: the abort ends
    the job at once, and the launcher (hydra, prterun) drops what it has not yet read from the
    processes' pipes (the script's last lines and mpidist's message went missing now and then
    under load). Every way mpidist ends the job comes here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced streams
            pass
    time.sleep(_OUTPUT_GRACE_S)
    try:
        comm.Abort(errorcode)
    finally:
        # MPI_Abort must not return, but in a world mpidist formed without a launcher MPICH's can (its PMI
        # client reports the abort and carries on); the process then went on into MPI_Finalize, which
        # waited on the PMI socket for ranks that had failed. End it here with the abort's code.
        os._exit(errorcode)


def _pending(backend: Any) -> bool:
    try:
        return bool(backend.pending())
    except Exception:  # noqa: BLE001 - cannot tell: count it as pending
        return True


atexit.register(finalize_after_failure)  # atexit runs handlers last-in first-out: after exit_check
atexit.register(exit_check)
