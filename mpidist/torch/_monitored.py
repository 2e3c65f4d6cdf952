"""``torch.distributed.monitored_barrier`` on torch's groups on mpidist.

torch implements ``monitored_barrier`` in gloo only: ``dist.monitored_barrier``
refuses any other backend ("only implemented for GLOO backend") before it calls
the group's ``monitored_barrier(timeout, wait_all_ranks=...)``, which the base
class of a Python process group answers with "No backend type associated with
device type cpu". ``ProcessGroupMPIDist.monitored_barrier`` runs
:func:`mpidist.monitored_barrier` (gloo's semantics: rank 0 collects the other
ranks' arrivals within the timeout and every rank raises a RuntimeError naming
the ranks that did not arrive, all of them with ``wait_all_ranks=True``), and
:func:`install` lets ``dist.monitored_barrier`` reach it for those groups; every
other group keeps torch's function as it is.
"""

from __future__ import annotations

import functools
import sys
import warnings
from datetime import timedelta
from typing import Any

__all__ = ["install"]


def install(group_class: type) -> None:
    """Make ``dist.monitored_barrier`` call ``group_class``'s ``monitored_barrier`` (idempotent)."""
    import torch.distributed as dist

    c10d = sys.modules["torch.distributed.distributed_c10d"]
    original = getattr(c10d, "monitored_barrier", None)
    if original is None or getattr(original, "__mpidist__", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        pg = group
        if pg is None and dist.is_initialized():
            pg = c10d._get_default_group()
        if not isinstance(pg, group_class):
            return original(group, timeout, wait_all_ranks)
        if isinstance(timeout, float):  # as torch: seconds, with its warning
            warnings.warn(
                "Please specify timeout arg as a timedelta. "
                f"Converting current value of {timeout} assuming it represents seconds",
                stacklevel=2,
            )
            timeout = timedelta(seconds=timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier.__mpidist__ = True  # type: ignore[attr-defined]
    c10d.monitored_barrier = monitored_barrier
    if getattr(dist, "monitored_barrier", None) is original:
        dist.monitored_barrier = monitored_barrier
