"""Exception types, named and layered as in torch.distributed."""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistBackendError",
    "ProcessFailedError",
    "DistStoreError",
    "DistNetworkError",
    "RankNotInGroupError",
    "DefaultGroupStateError",
]


class DistError(RuntimeError):
    """Base class of every error raised while communicating.

    A ``RuntimeError``. Bad arguments raise ``TypeError`` or ``ValueError`` instead,
    before anything is sent. A group whose call failed on one rank alone (while
    the others may have sent their part) raises it for every later call on that
    rank.

    Examples:
        >>> try:
        ...     dist.all_reduce(np.ones(2))
        ... except dist.DistError as exc:  # a timeout, an MPI failure, a refused group
        ...     print(exc)
    """


class DistBackendError(DistError):
    """A failure inside the backend (MPI, NCCL) or a timeout of a call.

    A timeout's message names the call, its number on the group, the ranks that
    have not arrived (where they are waiting, when they say), and whether the
    group is still usable.

    Examples:
        >>> if dist.get_rank() == 0:
        ...     dist.barrier(timeout=1)  # rank 1 never calls it
        Traceback (most recent call last):
        DistBackendError: barrier (call #1) on group 0 (mpi, rank 0 of 2) did not complete within the timeout of 1 s. Rank 1: no answer (not waiting in an mpidist call: busy elsewhere, hung or dead). The group is unusable now (the call is still pending inside MPI): destroy it, or end the job (mpidist.abort_process_group).
    """


class ProcessFailedError(DistBackendError):
    """A member of the group has died (MPI's User-Level Failure Mitigation, ULFM, reported it).

    Raised, where the MPI library has ULFM (Open MPI 5 under ``mpirun --with-ft ulfm``),
    by the call that met the failure and by every later call on the group, on every
    surviving member, within the failure detector's time rather than the group's
    timeout. The group is revoked: members blocked in other calls on it wake up with
    this error too. ``shrink_group(exc.failed_group_ranks, group)`` then makes a group
    of the survivors.

    Attributes:
        failed_ranks: the dead members' global ranks, sorted (those known on this
            rank when it raised; ``shrink_group`` agrees on the full set).
        failed_group_ranks: the same members' ranks in the group.
        group_name: the name of the group the call was made on.

    Examples:
        >>> try:
        ...     dist.all_reduce(x)  # rank 3 was killed (mpirun --with-ft ulfm -n 4)
        ... except dist.ProcessFailedError as exc:
        ...     world = dist.shrink_group(exc.failed_group_ranks)  # the new default group
        >>> exc.failed_ranks, dist.get_world_size()
        ([3], 3)
    """

    def __init__(self, message: str, failed_ranks: list[int], failed_group_ranks: list[int], group_name: str) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.failed_group_ranks = failed_group_ranks
        self.group_name = group_name


class DistStoreError(DistError):
    """A failure of a key-value store (missing key after the timeout, ...).

    Examples:
        >>> dist.HashStore(timeout=0.1).get("missing")
        Traceback (most recent call last):
        DistStoreError: HashStore.get: key 'missing' was not set within the timeout of 0:00:00.100000
    """


class DistNetworkError(DistError):
    """A failure of the network underneath a store or a backend.

    Examples:
        >>> dist.TCPStore("127.0.0.1", 1, 2, False, timeout=1)  # nothing listens on port 1
        Traceback (most recent call last):
        DistNetworkError: TCPStore: could not connect to a TCPStore server at 127.0.0.1:1 within 0:00:01 (last error: [Errno 111] Connection refused); ...
    """


class RankNotInGroupError(ValueError, RuntimeError):
    """A rank that is not a member of the group it was used with.

    It is a ValueError (a wrong argument) and, as torch.distributed documents for
    ``get_group_rank``/``get_global_rank``, a RuntimeError, so either ``except``
    clause catches it.

    Examples:
        >>> dist.get_group_rank(dist.group.WORLD, 5)  # under mpiexec -n 2
        Traceback (most recent call last):
        RankNotInGroupError: get_group_rank: global_rank=5 is not a member of process group 0 (its global ranks: [0, 1])
    """


class DefaultGroupStateError(ValueError, RuntimeError):
    """The default process group is not initialized (a call that needs it), or already is (``init_process_group``).

    torch raises a ValueError for both; mpidist raised a RuntimeError before, so
    this is both and either ``except`` clause catches it.

    Examples:
        >>> dist.init_process_group()
        >>> dist.init_process_group()
        Traceback (most recent call last):
        DefaultGroupStateError: init_process_group: the default process group is already initialized; call destroy_process_group() first
    """
