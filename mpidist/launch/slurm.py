"""What Slurm tells a task of an ``srun`` step, read from its environment alone.

``srun`` starts every task with ``SLURM_*`` variables: its rank in the step
(``SLURM_PROCID``), the step's size (``SLURM_STEP_NUM_TASKS``), its rank on its
node (``SLURM_LOCALID``), its node's index (``SLURM_NODEID``), the step's nodes
(``SLURM_STEP_NODELIST``, in Slurm's compressed ``node[01-04,07]`` form) and how
many tasks each node runs (``SLURM_STEP_TASKS_PER_NODE``, as ``2(x3),1``). That
is enough for torchrun's variables, and for a world formed without PMI: the
first node of the step hosts the meeting point on a port derived from the job
and step ids, which every task computes the same way.

Variables of the allocation (``SLURM_NTASKS``, ``SLURM_TASKS_PER_NODE``,
``SLURM_NTASKS_PER_NODE``) describe the job, not the step: a 1-task step in a
4-task allocation inherits ``SLURM_NTASKS=4``. Only the step's are read here, so
a batch script or an ``salloc`` shell (no step of its own) is not a task.

Example::

    >>> expand_hostlist("n[01-03],gpu7")
    ['n01', 'n02', 'n03', 'gpu7']
    >>> expand_counts("2(x3),1")
    [2, 2, 2, 1]
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

__all__ = ["SlurmStep", "slurm_step", "expand_hostlist", "expand_counts", "PORT_BASE", "PORT_SPAN"]

#: the meeting port of a step without PMI is PORT_BASE + (job id * 16 + step id) % PORT_SPAN: below the
#: kernel's ephemeral range (no outgoing connection takes it), distinct for concurrent steps of a job
PORT_BASE = 20000
PORT_SPAN = 10000


@dataclass(frozen=True)
class SlurmStep:
    """One task's view of its ``srun`` step."""

    rank: int  # SLURM_PROCID
    size: int  # SLURM_STEP_NUM_TASKS
    local_rank: int | None  # SLURM_LOCALID
    local_size: int | None  # this node's count in SLURM_STEP_TASKS_PER_NODE
    node_id: int  # SLURM_NODEID (index of this node in the step's node list)
    nodes: tuple[str, ...]  # SLURM_STEP_NODELIST, expanded
    job_id: str
    step_id: str

    @property
    def master_host(self) -> str:
        """The first node of the step: where task 0 runs (Slurm places tasks in node-list order)."""
        return self.nodes[0] if self.nodes else "localhost"

    @property
    def port(self) -> int:
        """The step's meeting port (the same on every task, different for each step of a job)."""
        job = int(self.job_id) if self.job_id.isdigit() else 0
        step = int(self.step_id) if self.step_id.isdigit() and int(self.step_id) < 1 << 20 else 0
        return PORT_BASE + (job * 16 + step) % PORT_SPAN

    def torchrun_fields(self) -> dict[str, str]:
        """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``NODE_RANK``,
        ``GROUP_WORLD_SIZE`` of this task (the local ones only where Slurm gave them)."""
        fields = {"RANK": str(self.rank), "WORLD_SIZE": str(self.size)}
        if self.local_rank is not None and self.local_size is not None:
            fields.update(LOCAL_RANK=str(self.local_rank), LOCAL_WORLD_SIZE=str(self.local_size))
        fields.update(
            GROUP_RANK=str(self.node_id),
            NODE_RANK=str(self.node_id),
            GROUP_WORLD_SIZE=str(max(len(self.nodes), self.node_id + 1)),
        )
        return fields


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    return int(text) if text.isdigit() else None


def slurm_step(environ: Mapping[str, str] | None = None) -> SlurmStep | None:
    """This process's ``srun`` step, or None when no step started it (or its variables are incomplete).

    A process started by a task (a wrapper script, a child program) inherits the
    task's variables and is read as that task, as Slurm's own tools do.
    """
    environ = os.environ if environ is None else environ
    rank, size = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_STEP_NUM_TASKS")
    step_id = (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "").strip()
    if rank is None or size is None or not step_id or rank >= size:
        return None
    nodes = tuple(expand_hostlist(environ.get("SLURM_STEP_NODELIST", "")))
    node_id = _int(environ, "SLURM_NODEID") or 0
    counts = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    local_size: int | None = counts[node_id] if node_id < len(counts) else None
    local_rank = _int(environ, "SLURM_LOCALID")
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        local_rank = local_size = None  # inconsistent: say nothing rather than something wrong
    job_id = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    return SlurmStep(rank, size, local_rank, local_size, node_id, nodes, job_id, step_id)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Expand Slurm's compressed host list (``a[1-3,5],b``, ``rack[1-2]-n[01-02]``) into names."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        if item:
            names.extend(_expand_one(item))
    return names


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def _expand_one(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        return [item]  # not Slurm's syntax: take it as one name
    prefix, ranges, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_one(rest) if rest else [""]
    out = []
    for part in ranges.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            return [item]
        low, high = m.group(1), m.group(2) or m.group(1)
        width = len(low)
        for n in range(int(low), int(high) + 1):
            out.extend(f"{prefix}{n:0{width}d}{tail}" for tail in tails)
    return out


_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_counts(text: str) -> list[int]:
    """Expand Slurm's per-node counts (``2(x3),1`` → ``[2, 2, 2, 1]``); [] if the text is not that form."""
    counts: list[int] = []
    for part in text.strip().split(","):
        m = _COUNT.match(part.strip())
        if not m:
            return []
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
