"""Exception types, named and layered as in torch.distributed."""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistBackendError",
    "DistStoreError",
    "DistNetworkError",
    "RankNotInGroupError",
    "DefaultGroupStateError",
]


class DistError(RuntimeError):
    """Base class of every error raised while communicating."""


class DistBackendError(DistError):
    """A failure inside the backend (MPI, NCCL) or a timeout of a call."""


class DistStoreError(DistError):
    """A failure of a key-value store (missing key after the timeout, ...)."""


class DistNetworkError(DistError):
    """A failure of the network underneath a store or a backend."""


class RankNotInGroupError(ValueError, RuntimeError):
    """A rank that is not a member of the group it was used with.

    It is a ValueError (a wrong argument) and, as torch.distributed documents for
    ``get_group_rank``/``get_global_rank``, a RuntimeError, so either ``except``
    clause catches it.
    """


class DefaultGroupStateError(ValueError, RuntimeError):
    """The default process group is not initialized (a call that needs it), or already is (``init_process_group``).

    torch raises a ValueError for both; mpidist raised a RuntimeError before, so
    this is both and either ``except`` clause catches it.
    """
