"""Where the MPI backend's shared-memory path (``shm.py``) may take a collective, and where it must.

The path is chosen by measurement where the job runs (``shm_choice.py``): a group's
first calls of each collective and size class try both MPI's call and shared memory,
and the ranks agree on the faster. This module holds what overrides or informs that:

1. ``MPIDIST_SHM=0`` turns the path off (every call takes MPI's);
2. ``MPIDIST_SHM_THRESHOLDS``, e.g. ``all_reduce=256K,broadcast=off,all_gather_into_tensor=128K-4M``
   (a size alone means no upper end), fixes the collectives it names: shared memory exactly
   in that range, MPI's call elsewhere, nothing measured (:func:`overrides`);
3. the table ``python -m mpidist.bench --tune`` writes for this MPI library
   (:func:`tune_file`: ``MPIDIST_SHM_TUNE_FILE``, else ``~/.cache/mpidist/shm-thresholds.json``;
   a table written for another library is ignored) is a prior (:func:`prior`): in its
   ranges shared memory needs to win by less to be chosen (``shm_choice.PRIOR_MARGIN``);
4. ``MPIDIST_SHM_NODE_BYTES`` (e.g. ``64M``) bounds the shared memory of every group of a node
   together (:func:`node_budget`; by default half of ``/dev/shm``, at most 256 MiB);
5. ``MPIDIST_SHM_ONE_COPY=0`` keeps the one-copy variant of broadcast and
   all_gather_into_tensor (each rank reads the others' arrays with ``process_vm_readv``)
   out of the measuring (:func:`one_copy_enabled`); a fixed range takes the variant that
   copies through the segment;
6. ``MPIDIST_SHM_LEADERS=0`` keeps the node-leader path of a group that spans nodes
   (``node_leaders.py``: all_reduce within each node, then between the nodes' leaders) out of
   the measuring (:func:`leaders_enabled`); ``MPIDIST_SHM=0`` does too, and an all_reduce range
   in ``MPIDIST_SHM_THRESHOLDS`` fixes that path to it in such a group.

A range is ``(from, up to)`` in bytes, both included (``up to`` is :data:`NEVER` for no
upper end). The size is the array every rank passes alike: all_reduce's, broadcast's
and reduce's array, all_gather_into_tensor's output, reduce_scatter_tensor's input.
The ranks of a group agree on both when the path is set up (``shm.SharedPath.setup``):
a collective is fixed if any rank fixes it, in the largest of the lower ends up to the
smallest of the upper ends; a prior holds only where every rank's holds; a rank with
``MPIDIST_SHM=0`` turns the path off for the group.

Example::

    >>> os.environ["MPIDIST_SHM_THRESHOLDS"] = "all_reduce=256K"
    >>> overrides()
    {'all_reduce': (262144, 4611686018427387904)}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._validate import env_flag

__all__ = [
    "COLLECTIVES", "NEVER", "SETUP_FLOOR", "MPI_CALL", "SHARED", "TRIAL", "ONE_COPY", "LEADERS", "CLASSES", "Range",
    "overrides", "prior", "enabled", "leaders_enabled", "one_copy_enabled", "tune_file", "read_table", "write_table", "parse_size", "parse_range", "node_budget", "NODE_BUDGET_MAX",
]  # fmt: skip

#: the collectives the shared-memory path runs, in the order of the set-up agreement
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
#: a threshold that no message reaches: the path is off for that collective
NEVER = 1 << 62
#: No threshold is below this. A group sets the path up on its first call of at least this size
#: (a size every rank passes alike, so every rank sets up in the same call).
SETUP_FLOOR = 16 << 10

#: what a call takes: MPI's own call, the shared-memory path, or a measured call of either (shm_choice.Chooser.next);
#: here, not in shm_choice.py, so that the MPI backend reads them without importing the measuring at start-up
MPI_CALL, SHARED, TRIAL = 0, 1, 2
#: ... or the shared-memory path's one-copy variant (broadcast, all_gather_into_tensor: each rank reads the others'
#: arrays straight from their memory, ``shm.py``), where the kernel lets the group's ranks do that
ONE_COPY = 3
#: ... or the node-leader path of a group that spans nodes (all_reduce within each node, then between the nodes'
#: leaders, ``node_leaders.py``)
LEADERS = 4
#: the size classes of the measured choice: a call of n bytes is in class n.bit_length() (2**(k-1) <= n < 2**k)
CLASSES = 64

#: a range of message sizes in bytes: (from, up to), both included
Range = tuple[int, int]

ENV_SWITCH = "MPIDIST_SHM"
ENV_THRESHOLDS = "MPIDIST_SHM_THRESHOLDS"
ENV_ONE_COPY = "MPIDIST_SHM_ONE_COPY"
ENV_LEADERS = "MPIDIST_SHM_LEADERS"
ENV_TUNE_FILE = "MPIDIST_SHM_TUNE_FILE"
ENV_NODE_BYTES = "MPIDIST_SHM_NODE_BYTES"
#: the default bound of a node's shared memory, where ``/dev/shm`` is larger than twice this
NODE_BUDGET_MAX = 256 << 20
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}  # fmt: skip


def one_copy_enabled() -> bool:
    """Whether this process lets its groups measure the one-copy variant (``MPIDIST_SHM_ONE_COPY``, default on)."""
    return bool(env_flag(ENV_ONE_COPY, default=True))


def leaders_enabled() -> bool:
    """Whether this process lets its groups that span nodes measure the node-leader path (``MPIDIST_SHM_LEADERS``,
    default on; ``MPIDIST_SHM=0`` turns it off too)."""
    return bool(env_flag(ENV_LEADERS, default=True)) and enabled()


def enabled() -> bool:
    """Whether this process allows the shared-memory path (``MPIDIST_SHM``, default on)."""
    return bool(env_flag(ENV_SWITCH, default=True))


def node_budget() -> int:
    """Bytes of shared memory every group of this node may take together.

    ``MPIDIST_SHM_NODE_BYTES`` where set (``0``: none at all), else half of ``/dev/shm``'s size
    (a container's 64 MB gives 32 MiB), at most :data:`NODE_BUDGET_MAX`. Each rank may hold
    this divided by the node's ranks (``shm.SharedPath.setup``).

    Raises:
        ValueError: ``MPIDIST_SHM_NODE_BYTES`` is not a size.
    """
    named = os.environ.get(ENV_NODE_BYTES, "").strip()
    if named:
        return parse_size(named, ENV_NODE_BYTES)
    try:
        fs = os.statvfs("/dev/shm")
    except OSError:  # no /dev/shm to ask (not Linux): the segment's own creation says whether it fits
        return NODE_BUDGET_MAX
    return min(NODE_BUDGET_MAX, fs.f_blocks * fs.f_frsize // 2)


def parse_range(text: str, where: str) -> Range:
    """``"256K"`` (no upper end), ``"128K-4M"`` or ``"off"`` as a :data:`Range`; ``where`` names the source."""
    word = text.strip().lower()
    if word in ("off", "never", "none"):
        return (NEVER, NEVER)
    low, dash, high = word.partition("-")
    return (parse_size(low, where), parse_size(high, where) if dash else NEVER)


def parse_size(text: str, where: str) -> int:
    """``"256K"``, ``"4M"`` or ``"65536"`` as bytes; ``where`` names the source in the ValueError."""
    word = text.strip().lower()
    digits = word.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = word[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"{where}: {text!r} is not a size: use bytes such as 65536, 256K or 4M, a range 128K-4M, or off")
    return int(digits) * _UNITS[unit]


def _for_ranks(by_ranks: dict[int, Range], ranks: int) -> Range:
    """The entry for ``ranks`` ranks on the node: the nearest listed count at or below it (else the smallest)."""
    below = [n for n in by_ranks if n <= ranks]
    return by_ranks[max(below) if below else min(by_ranks)]


def tune_file() -> Path:
    """Where ``python -m mpidist.bench --tune`` writes its table and the backend reads it."""
    named = os.environ.get(ENV_TUNE_FILE, "").strip()
    if named:
        return Path(named)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpidist" / "shm-thresholds.json"


def read_table(library: str, path: Path | None = None) -> dict[str, dict[int, Range]]:
    """The tuned thresholds for the MPI library ``library`` ({} if there are none, or they are for another)."""
    path = tune_file() if path is None else path
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("library") != library or not isinstance(data.get("thresholds"), dict):
        return {}
    table: dict[str, dict[int, Range]] = {}
    for name, by_ranks in data["thresholds"].items():
        if name in COLLECTIVES and isinstance(by_ranks, dict):
            table[name] = {
                int(n): (int(v[0]), int(v[1]))
                for n, v in by_ranks.items()
                if str(n).isdigit() and isinstance(v, list) and len(v) == 2 and all(isinstance(b, int) for b in v)
            }
    return table


def write_table(library: str, table: dict[str, dict[int, Range]], path: Path | None = None) -> Path:
    """Merge ``table`` into the tuned thresholds of ``library`` (other rank counts kept); return the file."""
    path = tune_file() if path is None else path
    merged = read_table(library, path)
    for name, by_ranks in table.items():
        merged.setdefault(name, {}).update(by_ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "library": library,
        "thresholds": {k: {str(n): list(v) for n, v in sorted(d.items())} for k, d in merged.items()},
    }
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path


def prior(ranks: int, library: str = "") -> dict[str, Range]:
    """The ``--tune`` table's ranges for ``ranks`` ranks on a node and MPI library ``library``; (NEVER, NEVER) where
    it has none (the table is a prior of the measuring, see ``shm_choice.py``)."""
    tuned = read_table(library) if library else {}
    out = {}
    for name in COLLECTIVES:
        low, high = _for_ranks(tuned[name], ranks) if tuned.get(name) else (NEVER, NEVER)
        out[name] = (max(low, SETUP_FLOOR), high)
    return out


def overrides() -> dict[str, Range]:
    """The collectives ``MPIDIST_SHM_THRESHOLDS`` fixes, and their ranges (no measuring for them)."""
    text = os.environ.get(ENV_THRESHOLDS, "").strip()
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, size = item.partition("=")
        if not sep or name.strip() not in COLLECTIVES:
            raise ValueError(
                f"environment variable {ENV_THRESHOLDS}={text!r}: {item!r} is not collective=size "
                f"(collectives: {', '.join(COLLECTIVES)})"
            )
        low, high = parse_range(size, f"environment variable {ENV_THRESHOLDS}")
        out[name.strip()] = (max(low, SETUP_FLOOR), high)
    return out
