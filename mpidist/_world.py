"""The one object that holds mpidist's process-wide state.

Everything mutable that outlives a call lives on :data:`world`: the default
process group, the registry of groups, counters, registered backends and
caches that depend on the MPI library. ``destroy_process_group()`` calls
:meth:`World.reset`, after which ``init_process_group()`` may run again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .process_group import ProcessGroup


class BackendEntry:
    """How to build one named backend (see ``Backend.register_backend``)."""

    __slots__ = ("name", "factory", "extended_api", "devices", "builtin")

    def __init__(
        self,
        name: str,
        factory: Callable[..., Any],
        extended_api: bool,
        devices: tuple[str, ...],
        builtin: bool,
    ) -> None:
        self.name = name
        self.factory = factory
        self.extended_api = extended_api
        self.devices = devices
        self.builtin = builtin


class Stats:
    """Counters of work done outside MPI (staging copies), for tests and benchmarks.

    ``copies`` and ``copied_bytes`` include the copies C code counts itself (``counted_in_c``: the
    small blocking recv's copy out of its scratch buffer, ``backends/_direct_p2p.c``).
    """

    __slots__ = ("_copies", "_copied_bytes", "counted_in_c")

    def __init__(self) -> None:
        self._copies = 0
        self._copied_bytes = 0
        self.counted_in_c: Callable[[], tuple[int, int]] | None = None  # set where the C calls are bound

    def count_copy(self, nbytes: int) -> None:
        self._copies += 1
        self._copied_bytes += int(nbytes)

    @property
    def copies(self) -> int:
        """Staging copies made so far in this process."""
        return self._copies + (self.counted_in_c()[0] if self.counted_in_c else 0)

    @property
    def copied_bytes(self) -> int:
        """Their bytes."""
        return self._copied_bytes + (self.counted_in_c()[1] if self.counted_in_c else 0)


@dataclass
class InitInfo:
    """What one ``init_process_group`` found out about the world (reset by ``destroy_process_group``).

    The defaults are what mpidist assumes before any init.
    """

    node_rank: int = 0  # this process's rank on its node (shared-memory split)
    node_size: int = 1  # processes on this node
    init_method: str = "env://"
    mpi_library: str = ""  # the first line of MPI_Get_library_version
    tag_ub: int = 32767  # the largest tag MPI allows (the standard's minimum until known)
    oversubscribed: bool = True  # more ranks on the node than usable cores (polls yield sooner)
    # what a backend calls with a timeout's error before raising it: under MPIDIST_ABORT_ON_TIMEOUT=1,
    # init_process_group installs one that ends the job (launch/abort.py, a layer the backends do not import)
    on_timeout: Callable[[BaseException], None] | None = None
    own_store: bool = False  # the default store was opened by mpidist (closed at destroy)
    store_error: str = ""  # why rank 0 could not open a default store


class World:
    """Process-wide state: default group, group registry, backends, caches."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.backends: dict[str, BackendEntry] = {}
        self.stats = Stats()
        # Per-MPI-library tables (datatypes, op support); they survive reset().
        self.mpi_type_table: Any = None
        self.torch_dtypes: Any = None  # torch dtype -> numpy dtype (built on first use)
        self.device_ops: Any = None  # _device.CupyOps, made on the first GPU array
        self.cuda_aware: bool | None = None  # whether MPI takes device pointers (_device.mpi_cuda_aware)
        self.survived_failure = False  # shrink_group went on without a dead member (launch/abort.py: exit)
        self.ulfm: bool | None = None  # the MPI library reports dead members (backends/ulfm.py; asked once)
        self.persistent_routines: dict[str, bool] = {}  # MPI-4 *_init routines this MPI library runs (probed)
        self.self_truncation_reported: bool | None = None  # MPI reports a longer message to self (probed)
        # bytes of shared-memory segments this rank's groups hold, its part of each (backends/shm.py: the node's
        # budget); kept across reset, as a group left pending keeps its segment
        self.shm_share = 0
        self.rx: Any = None  # backends/mpi_receive.py, imported by the first receive (backends/mpi.py's _receiving)
        self.staging_warned = False  # the one-time warning about staging device arrays through host memory
        self.direct: Any = None  # backends.direct.DirectState: whether the MPI backend calls MPI directly (once)
        self.nccl_ok: bool | None = None  # cupy NCCL + a GPU here (backends.registry.nccl_available)
        self.activity: Any = None  # (group, op, seq) this rank is waiting in, once the wait is slow
        self.activity_since = 0.0  # when that wait began (time.monotonic)
        self.debug_level: Any = 0  # debug.DebugLevel; set by init_process_group from the environment
        self.pmi_server: Any = None  # rank 0 of a world started without an MPI launcher (launch/pmi.py)
        self.boot_store: Any = None  # the store an srun step met through before init_process_group (start_world)
        # buffers and communicators MPI or NCCL may still touch after a call that failed or timed out:
        # kept alive for the life of the process (freeing them could corrupt memory); grows only on failures
        self.unreleased: list[Any] = []
        # (backend, op, seq) of every call that timed out and was left pending: a process that still has
        # one at exit aborts the job instead of finalizing MPI (launch/abort.py); survives reset like unreleased
        self.timed_out: list[tuple[Any, str, int]] = []
        self.cuda_runtime_factory: Callable[[], Any] | None = None  # None: CudaRuntime.from_cupy (tests: a fake)
        self.profiler: Any = None  # diagnose.profiler.ProfilerState: torch's profiler followed (made on first use)
        self._clear()

    def _clear(self) -> None:
        self.default_pg: ProcessGroup | None = None
        self.groups: dict[str, ProcessGroup] = {}
        self.group_count = 0
        self.local_group_counts: dict[int, int] = {}  # groups made with use_local_synchronization
        self.control_comm: Any = None  # private MPI communicator for library traffic
        self.control: Any = None  # an MPIBackend over control_comm (bounded waits, diagnoses)
        self.node_comm: Any = None  # shared-memory (node-local) split of the world
        self.init_info = InitInfo()
        self.store: Any = None  # the default store (get_default_store)
        self.stall: Any = None  # diagnose.stall.Beacon: this rank's beats in the default store (made on first use)

    def next_group_name(self) -> str:
        """Return a name for a group that every rank creates in the same order."""
        name = str(self.group_count)
        self.group_count += 1
        return name

    def register_group(self, pg: ProcessGroup) -> None:
        self.groups[pg.group_name] = pg

    def reset(self) -> None:
        """Forget every group; called by ``destroy_process_group()``."""
        if self.stall is not None:
            self.stall.close()
        self._clear()


world = World()
