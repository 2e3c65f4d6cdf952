"""Checks of arguments and environment variables, each rule in one place, in mpidist's message format.

Every check names the function and the argument (or the variable), says what was
expected and what was given, and raises before any MPI call::

    >>> int_arg(True, "init_process_group", "rank")
    TypeError: init_process_group: rank must be an int, got bool
    >>> timeout_seconds(float("nan"), "Work.wait", 30.0)
    ValueError: Work.wait: timeout must be a number of seconds, got nan
"""

from __future__ import annotations

import math
import operator
import os
from datetime import timedelta
from typing import Any

import numpy as np

__all__ = [
    "int_arg", "bool_arg", "timeout_seconds", "timeout_arg", "env_flag", "TRUE_WORDS", "FALSE_WORDS",
    "C_EXTENSIONS_FLAG", "c_extension_refused",
]  # fmt: skip

#: the words an environment flag may take (any case, surrounding blanks ignored); unset or empty: the default
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def int_arg(value: Any, fn: str, arg: str, minimum: int = 0, expected: str = "a non-negative int") -> int:
    """``value`` as an int (bools refused) of at least ``minimum``; ``expected`` words the range in messages."""
    if type(value) is int and value >= minimum:  # the common case, at the cost of one test
        return value
    if isinstance(value, bool) or type(value).__name__ == "bool_" or not hasattr(value, "__index__"):
        raise TypeError(f"{fn}: {arg} must be an int, got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:  # an array of more than one element has __index__, which refuses
        raise TypeError(f"{fn}: {arg} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{fn}: {arg} must be {expected}, got {value}")
    return value


def bool_arg(value: Any, fn: str, arg: str) -> bool:
    """``value`` as a bool: a bool (numpy's too) or an int, whose truth torch would take; anything else is a TypeError.

    Checked before a call posts anything: ``async_op=np.array(...)`` once raised numpy's
    "truth value is ambiguous" after the operation was posted, losing its Work while MPI
    still wrote into its buffers.
    """
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_) or (isinstance(value, int) and type(value) is not bool):
        return bool(value)
    raise TypeError(f"{fn}: {arg} must be a bool, got {type(value).__name__}")


def timeout_seconds(timeout: Any, fn: str, default: float) -> float:
    """A timeout argument (timedelta or seconds; None or 0 for ``default``) in seconds."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{fn}: timeout must be a datetime.timedelta or seconds, got {type(timeout).__name__}")
    if math.isnan(seconds):
        raise ValueError(f"{fn}: timeout must be a number of seconds, got nan")
    if seconds < 0:
        raise ValueError(f"{fn}: timeout must not be negative, got {seconds} s")
    return seconds if seconds > 0 else default


def timeout_arg(timeout: Any, fn: str, default: timedelta) -> timedelta:
    """A timeout argument (timedelta or seconds; None for ``default``) as a timedelta."""
    return timedelta(seconds=timeout_seconds(timeout, fn, default.total_seconds()))


def env_flag(*names: str, default: bool | None = False) -> bool | None:
    """The first of the variables ``names`` that is set, read as a flag (:data:`TRUE_WORDS`/:data:`FALSE_WORDS`).

    Unset or empty everywhere: ``default``. Any other word raises a ValueError
    naming the variable and the accepted words.
    """
    for name in names:
        text = os.environ.get(name, "").strip().lower()
        if not text:
            continue
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
        raise ValueError(
            f"environment variable {name}={os.environ[name]!r} is not a flag: use one of "
            f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}"
        )
    return default


#: the variable that turns every C extension of mpidist off (``=0``): the pure-Python paths run instead
C_EXTENSIONS_FLAG = "MPIDIST_C_EXTENSIONS"


def c_extension_refused(flag: str | None = None) -> str:
    """Why a C extension must not be used ('' if it may): ``MPIDIST_C_EXTENSIONS=0``, or its own ``flag`` off.

    ``MPIDIST_C_EXTENSIONS=0`` turns off all of them (``arrays/_ready.c``, ``backends/_direct.c``,
    ``backends/_halfops.c``), whatever their own flags say, so one variable tests the Python fallback.
    """
    if not env_flag(C_EXTENSIONS_FLAG, default=True):
        return f"{C_EXTENSIONS_FLAG} is off"
    if flag is not None and not env_flag(flag, default=True):
        return f"{flag} is off"
    return ""
