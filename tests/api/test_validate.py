"""The shared checks (mpidist/_validate.py): one vocabulary for environment flags, one timeout rule,
one integer rule, each with mpidist's message format, seen through the public functions that use them."""

from __future__ import annotations

import numpy as np
import pytest

import mpidist as dist
from mpidist._validate import FALSE_WORDS, TRUE_WORDS, env_flag, int_arg, timeout_seconds

from helpers import fail_together

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("word", [*TRUE_WORDS, "TRUE", " On "])
def test_env_flag_true_words(monkeypatch, word):
    monkeypatch.setenv("MPIDIST_TEST_FLAG", word)
    assert env_flag("MPIDIST_TEST_FLAG") is True


@pytest.mark.parametrize("word", [*FALSE_WORDS, "Off"])
def test_env_flag_false_words(monkeypatch, word):
    monkeypatch.setenv("MPIDIST_TEST_FLAG", word)
    assert env_flag("MPIDIST_TEST_FLAG", default=True) is False


def test_env_flag_unset_empty_and_order(monkeypatch):
    monkeypatch.delenv("MPIDIST_TEST_A", raising=False)
    monkeypatch.setenv("MPIDIST_TEST_B", "  ")
    assert env_flag("MPIDIST_TEST_A", "MPIDIST_TEST_B") is False
    assert env_flag("MPIDIST_TEST_A", default=None) is None
    monkeypatch.setenv("MPIDIST_TEST_B", "yes")
    monkeypatch.setenv("MPIDIST_TEST_C", "no")
    assert env_flag("MPIDIST_TEST_A", "MPIDIST_TEST_B", "MPIDIST_TEST_C") is True  # the first one set wins


def test_env_flag_other_words_are_an_error(monkeypatch):
    monkeypatch.setenv("MPIDIST_TEST_FLAG", "enabled")
    with pytest.raises(
        ValueError,
        match=r"^environment variable MPIDIST_TEST_FLAG='enabled' is not a flag: use one of 1/true/yes/on or 0/false/no/off$",
    ):
        env_flag("MPIDIST_TEST_FLAG")


def test_int_and_timeout_rules():
    problems = []
    for value, exc, message in (
        (True, TypeError, r"^f: x must be an int, got bool$"),
        (np.bool_(True), TypeError, r"^f: x must be an int, got bool_?$"),
        (1.0, TypeError, r"^f: x must be an int, got float$"),
        (-1, ValueError, r"^f: x must be a non-negative int, got -1$"),
    ):
        with pytest.raises(exc, match=message):
            int_arg(value, "f", "x")
    assert int_arg(np.int32(3), "f", "x") == 3 and int_arg(-1, "f", "x", -1, "-1 or more") == -1
    assert timeout_seconds(None, "f", 5.0) == 5.0 and timeout_seconds(0, "f", 5.0) == 5.0
    for bad, exc, message in (
        (float("nan"), ValueError, "must be a number of seconds, got nan"),
        (-1, ValueError, "must not be negative"),
        ("1s", TypeError, "must be a datetime.timedelta or seconds, got str"),
    ):
        with pytest.raises(exc, match=message):
            timeout_seconds(bad, "f", 1.0)
    fail_together(problems)


def test_a_nan_timeout_is_refused_by_work_wait_and_barrier():
    """Before: Work.wait(timeout=nan) silently waited the group's timeout; barrier(timeout=bad) posted first."""
    work = dist.all_reduce(np.ones(2), async_op=True)
    with pytest.raises(ValueError, match=r"^Work\.wait: timeout must be a number of seconds, got nan$"):
        work.wait(timeout=float("nan"))
    work.wait()
    # barrier checks its timeout before posting (before: the barrier was posted, then Work.wait refused it)
    for bad, exc in ((float("nan"), ValueError), ("1s", TypeError), (-1, ValueError)):
        with pytest.raises(exc, match=r"^barrier: timeout must"):
            dist.barrier(timeout=bad)
    dist.barrier(timeout=30)  # nothing was left posted: the next barrier matches its peers
    x = np.ones(1)
    dist.all_reduce(x)
    assert x[0] == dist.get_world_size()
