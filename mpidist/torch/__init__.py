"""torch.distributed on MPI: ``import mpidist.torch`` makes mpidist a torch backend.

After the import, torch's own code runs over MPI (and NCCL) through mpidist::

    import mpidist.torch                      # registers the "mpidist" backend
    import torch.distributed as dist
    dist.init_process_group("mpidist")        # under mpiexec/srun: nothing else needed
    model = torch.nn.parallel.DistributedDataParallel(model)

An installed mpidist does the same at ``import torch`` (torch's entry points,
``_mpidist_autoload``), so unmodified torch programs need no import; this
package installs it again where that was turned off. Everything in this
package imports torch; ``import mpidist`` never does. See docs/torch-backend.md.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mpidist.torch needs torch: pip install 'mpidist[torch]' (the rest of mpidist works without it)"
    ) from exc

from . import _mpi_name
from ._mpi_name import status as mpi_name_status
from .backend import BACKEND_NAME, ProcessGroupMPIDist, register

__all__ = ["BACKEND_NAME", "ProcessGroupMPIDist", "mpi_name_status", "register"]

_mpi_name.install()  # also registers "mpidist" and wraps env:// (_mpidist_autoload.install)
