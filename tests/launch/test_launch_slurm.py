"""Slurm's variables as a task of an srun step sees them (mpidist.launch.slurm): no Slurm needed.

The launches under a real ``srun`` are in tests/cluster/test_slurm.py.
"""

from __future__ import annotations

import pytest

from mpidist.launch.slurm import PORT_BASE, PORT_SPAN, expand_counts, expand_hostlist, slurm_step

# Slurm's variables parsed, no MPI: in the world of one rank, under one MPI library
pytestmark = [pytest.mark.one_rank, pytest.mark.one_library]


@pytest.mark.parametrize(
    "text,names",
    [
        ("vm", ["vm"]),
        ("n[01-03],gpu7", ["n01", "n02", "n03", "gpu7"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a[1,3-4],b[2]", ["a1", "a3", "a4", "b2"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("", []),
    ],
)
def test_expand_hostlist(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(
    "text,counts",
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,2(x2)", [1, 2, 2]), ("", []), ("two", [])],
)
def test_expand_counts(text, counts):
    assert expand_counts(text) == counts


def _step(**extra):
    base = {
        "SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_ID": "3", "SLURM_JOB_ID": "1234",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "3", "SLURM_STEP_NODELIST": "c[1-4]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
    }  # fmt: skip
    base.update(extra)
    return base


def test_step_reads_the_step_not_the_allocation():
    step = slurm_step(_step(SLURM_NTASKS="64", SLURM_NTASKS_PER_NODE="16"))
    assert step is not None
    assert (step.rank, step.size, step.local_rank, step.local_size, step.node_id) == (4, 7, 0, 1, 3)
    assert step.nodes == ("c1", "c2", "c3", "c4") and step.master_host == "c1"
    assert step.port == PORT_BASE + (1234 * 16 + 3) % PORT_SPAN


def test_steps_of_one_job_get_different_ports_and_stay_below_the_ephemeral_range():
    ports = {slurm_step(_step(SLURM_STEP_ID=str(i))).port for i in range(16)}
    assert len(ports) == 16 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN < 32768 for p in ports)
    assert slurm_step(_step(SLURM_STEP_ID="batch")).port == PORT_BASE + (1234 * 16) % PORT_SPAN


@pytest.mark.parametrize(
    "missing", ["SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID"],
)
def test_no_step_without_its_variables(missing):
    environ = _step()
    del environ[missing]
    assert slurm_step(environ) is None


def test_inconsistent_local_fields_are_left_out():
    step = slurm_step(_step(SLURM_LOCALID="5"))  # node 3 runs 1 task: local id 5 cannot be
    assert step is not None and step.local_rank is None and step.local_size is None
    fields = step.torchrun_fields()
    assert "LOCAL_RANK" not in fields and "LOCAL_WORLD_SIZE" not in fields and fields["RANK"] == "4"


def test_stepid_spelling_of_older_slurm():
    environ = _step()
    environ["SLURM_STEPID"] = environ.pop("SLURM_STEP_ID")
    assert slurm_step(environ).step_id == "3"
