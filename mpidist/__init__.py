"""mpidist: the torch.distributed API over MPI, for numpy arrays.

Run a program under an MPI launcher and use it as you would torch.distributed::

    import numpy as np
    import mpidist as dist

    dist.init_process_group()                  # backend "mpi"; rank and size from MPI
    x = np.full(4, dist.get_rank(), np.float64)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)   # in place, same result on every rank
    dist.destroy_process_group()

``mpiexec -n 4 python script.py``
"""

from ._version import __version__
from .backends import Backend, BackendOptions, BaseBackend
from .barriers import monitored_barrier
from .collectives import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from .data import DistributedSampler
from .diagnose.debug import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from .errors import (
    DefaultGroupStateError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    ProcessFailedError,
    RankNotInGroupError,
)
from .groups import (
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from .init import (
    default_pg_timeout,
    destroy_process_group,
    get_backend,
    get_default_store,
    get_node_local_rank,
    get_pg_count,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
)
from .launch import boot  # noqa: F401  (first: decides when MPI is initialized, see launch/boot.py)
from .launch.abort import abort_process_group, install_excepthook
from .objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .persistent import (
    Persistent,
    all_gather_into_tensor_init,
    all_reduce_init,
    all_to_all_single_init,
    broadcast_init,
    recv_init,
    reduce_init,
    reduce_scatter_tensor_init,
    send_init,
)
from .process_group import GroupMember, ProcessGroup, group
from .reduce_op import ReduceOp, _make_nccl_premul_sum, make_premul_sum, reduce_op, supports_complex
from .resilience import SHRINK_ABORT, SHRINK_DEFAULT, shrink_group
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .utils import (
    MPIEnvironment,
    all_gather_ddp_if_available,
    distributed_available,
    gather_all_tensors,
    init_dist_connection,
    register_ddp_comm_hook,
    sync_ddp,
    sync_ddp_if_available,
)
from .work import Future, Work

__all__ = [
    "__version__",
    # initialization and queries
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_gloo_available",
    "is_ucc_available",
    "is_backend_available",
    "is_torchelastic_launched",
    "get_backend",
    "get_rank",
    "get_world_size",
    "get_node_local_rank",
    "get_pg_count",
    "get_default_store",
    "default_pg_timeout",
    "Backend",
    "BackendOptions",
    "BaseBackend",
    # groups
    "ProcessGroup",
    "group",
    "GroupMember",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "shrink_group",
    "SHRINK_DEFAULT",
    "SHRINK_ABORT",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    # point-to-point
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "batch_isend_irecv",
    # collectives
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
    "monitored_barrier",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    # persistent operations (MPI-4's *_init; beyond torch.distributed)
    "Persistent",
    "broadcast_init",
    "all_reduce_init",
    "reduce_init",
    "all_gather_into_tensor_init",
    "reduce_scatter_tensor_init",
    "all_to_all_single_init",
    "send_init",
    "recv_init",
    # objects
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    # reductions
    "ReduceOp",
    "reduce_op",
    "make_premul_sum",
    "_make_nccl_premul_sum",
    "supports_complex",
    # async
    "Work",
    "Future",
    # debugging
    "DebugLevel",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
    # ending the job
    "abort_process_group",
    "install_excepthook",
    # key-value stores
    "Store",
    "HashStore",
    "FileStore",
    "TCPStore",
    "PrefixStore",
    # errors
    "DistError",
    "DistBackendError",
    "DistStoreError",
    "ProcessFailedError",
    "DistNetworkError",
    "RankNotInGroupError",
    "DefaultGroupStateError",
    # Lightning's distributed utilities
    "distributed_available",
    "all_gather_ddp_if_available",
    "gather_all_tensors",
    "sync_ddp",
    "sync_ddp_if_available",
    "init_dist_connection",
    "register_ddp_comm_hook",
    "MPIEnvironment",
    # data loading
    "DistributedSampler",
]
