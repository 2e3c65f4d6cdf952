"""From which message size the MPI backend's shared-memory path (``shm.py``) takes a collective.

A threshold is a range of sizes in bytes, ``(from, up to)``, per collective and per
number of ranks on the node; a call whose array is in it goes through shared memory,
any other stays with MPI's own call (``up to`` is :data:`NEVER` where shared memory
wins at every larger size; it is finite where, beyond cache sizes, both paths copy
the same bytes and MPI's is as fast). The array measured is the one every rank
passes alike: all_reduce's, broadcast's and reduce's array, all_gather_into_tensor's
output, reduce_scatter_tensor's input.

Where a threshold comes from (a later source wins):

1. :data:`DEFAULTS`, measured on a 2-core machine with the MPICH 5 wheel
   (``docs/performance.md``);
2. the table ``python -m mpidist.bench --tune`` writes for this MPI library
   (:func:`tune_file`: ``MPIDIST_SHM_TUNE_FILE``, else
   ``~/.cache/mpidist/shm-thresholds.json``); a table written for another MPI
   library is ignored;
3. ``MPIDIST_SHM_THRESHOLDS``, e.g. ``all_reduce=256K,broadcast=off,all_gather_into_tensor=128K-4M``
   (a size alone means no upper end).

``MPIDIST_SHM=0`` turns the path off. The ranks of a group agree when the path is
set up (``shm.SharedPath.setup``): it is used only where every rank allows it,
from the largest of their lower ends up to the smallest of their upper ends, so
ranks with different settings never take different paths.

Example::

    >>> thresholds(2)["all_reduce"]
    (131072, 4611686018427387904)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._validate import env_flag

__all__ = [
    "COLLECTIVES", "DEFAULTS", "NEVER", "SETUP_FLOOR", "Range", "thresholds", "enabled", "tune_file", "read_table",
    "write_table", "parse_size", "parse_range",
]  # fmt: skip

#: the collectives the shared-memory path runs, in the order of the set-up agreement
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
#: a threshold that no message reaches: the path is off for that collective
NEVER = 1 << 62
#: No threshold is below this. A group sets the path up on its first call of at least this size
#: (a size every rank passes alike, so every rank sets up in the same call).
SETUP_FLOOR = 16 << 10

#: a range of message sizes in bytes: (from, up to), both included
Range = tuple[int, int]

#: Where shared memory wins, by collective and ranks on the node (a count not listed takes the nearest
#: one below). Measured with ``python -m mpidist.bench --tune`` and, launch after launch, with
#: ``python -m mpidist.bench`` on the 2-core development machine (MPICH 5 wheel): the 2-rank ranges with a
#: core per rank, the 3-rank ones from 4 ranks on the 2 cores. Only reduce won in every launch (0.06-0.40x
#: raw MPI); all_reduce won in most (0.28-0.97x) and lost by up to 16% in some. broadcast,
#: all_gather_into_tensor and reduce_scatter_tensor won by 1.5-5x in some launches and lost by 3-8x in
#: others (docs/performance.md), so they are off unless ``--tune`` (or ``MPIDIST_SHM_THRESHOLDS``) turns
#: them on for a machine where they win.
DEFAULTS: dict[str, dict[int, Range]] = {
    "all_reduce": {2: (128 << 10, NEVER), 3: (64 << 10, 2 << 20)},
    "broadcast": {2: (NEVER, NEVER)},
    "reduce": {2: (64 << 10, NEVER)},
    "all_gather_into_tensor": {2: (NEVER, NEVER)},
    "reduce_scatter_tensor": {2: (NEVER, NEVER)},
}

ENV_SWITCH = "MPIDIST_SHM"
ENV_THRESHOLDS = "MPIDIST_SHM_THRESHOLDS"
ENV_TUNE_FILE = "MPIDIST_SHM_TUNE_FILE"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}  # fmt: skip


def enabled() -> bool:
    """Whether this process allows the shared-memory path (``MPIDIST_SHM``, default on)."""
    return bool(env_flag(ENV_SWITCH, default=True))


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


def thresholds(ranks: int, library: str = "") -> dict[str, Range]:
    """The sizes at which each collective takes shared memory among ``ranks`` ranks of a node, for this process."""
    tuned = read_table(library) if library else {}
    out = {}
    for name in COLLECTIVES:
        value = _for_ranks(DEFAULTS[name], ranks)
        if name in tuned and tuned[name]:
            value = _for_ranks(tuned[name], ranks)
        out[name] = value
    text = os.environ.get(ENV_THRESHOLDS, "").strip()
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, size = item.partition("=")
        if not sep or name.strip() not in COLLECTIVES:
            raise ValueError(
                f"environment variable {ENV_THRESHOLDS}={text!r}: {item!r} is not collective=size "
                f"(collectives: {', '.join(COLLECTIVES)})"
            )
        out[name.strip()] = parse_range(size, f"environment variable {ENV_THRESHOLDS}")
    return {name: (max(low, SETUP_FLOOR), high) for name, (low, high) in out.items()}
