"""The messages of the object functions over a backend: heads, pickle streams, out-of-band frames.

``objects.py``'s functions and DETAIL's call checks (``diagnose/debug.py``) move
objects with these; the wire format is described in ``objects.py``. A rank whose
object cannot be pickled, or whose arguments failed a check only it makes (a
root's list), announces the failure in the head instead of a size (negative:
``-1 - len(error text)``) and sends the error's text instead of the stream, so every
rank of the call raises the same error at once and the group stays usable.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ._pickling import Pickled, pickled, receive_buffers, unpickle

__all__ = [
    "ARGUMENT",
    "announced",
    "empty",
    "exchange_heads",
    "failure_error",
    "frame",
    "gather_all",
    "raise_if_failed",
    "slices",
    "try_pickle",
    "wait_all",
]

_I64 = np.dtype(np.int64)
#: how an announced error text starts when it is a failed argument check, not a pickling error
ARGUMENT = "argument "
#: argument errors every rank raises as the same type
_ARGUMENT_ERRORS = {e.__name__: e for e in (TypeError, ValueError)}


def empty() -> np.ndarray:
    """Nothing to move: a rank's part of a frame collective beyond its own frames (a new array each time)."""
    return np.empty(0, np.uint8)


def wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()


#: pickling errors every rank raises as the same type; any other is raised as pickle.PicklingError
_PICKLING_ERRORS = {
    e.__name__: e
    for e in (pickle.PicklingError, TypeError, AttributeError, ValueError, RecursionError, NotImplementedError)
}


def try_pickle(obj: Any, refused: Exception | None = None) -> tuple[Pickled, Exception | None]:
    """``(pickled(obj), None)``, or (an error's text as the stream, the error) to announce instead of an object.

    ``refused``: this rank's arguments failed a check (its text travels marked as such);
    else the error is that ``obj`` cannot be pickled.
    """
    exc, mark = refused, ARGUMENT
    if exc is None:
        try:
            return pickled(obj), None
        except Exception as error:  # noqa: BLE001 - the text goes to every rank, which all raise (failure_error)
            exc, mark = error, ""
    text = np.frombuffer(f"{mark}{type(exc).__name__}: {exc}".encode("utf-8", "replace"), np.uint8)
    return Pickled(text, [], np.empty((0, 2), _I64)), exc


def announced(p: Pickled, exc: Exception | None) -> int:
    """The size a rank announces: its stream's, or ``-1 - len(error text)`` if pickling failed."""
    return p.stream.size if exc is None else -1 - p.stream.size


def failure_error(fn: str, what: str, impl: Any, ranks: list[int], text: np.ndarray) -> Exception:
    """The error every rank raises when group ranks ``ranks`` announced a failure with ``text``.

    A failed argument check (``try_pickle(..., refused=exc)``) is raised as the same
    kind with the same message; an object that could not be pickled as the pickling error.
    """
    message = bytes(text).decode("utf-8", "replace")
    names = [str(r if impl.global_ranks is None else impl.global_ranks[r]) for r in ranks]  # global ranks
    who = f"rank {names[0]}" if len(names) == 1 else f"ranks {', '.join(names)}"
    if message.startswith(ARGUMENT):
        kind, _, detail = message[len(ARGUMENT) :].partition(": ")
        return _ARGUMENT_ERRORS.get(kind, ValueError)(
            f"{detail} (raised on {who}, and on every rank of the call with it; nothing was sent and the "
            "group is still usable)"
        )
    kind, _, detail = message.partition(": ")
    error = f"{kind}: {detail}" if len(names) == 1 else f"rank {names[0]}: {kind}: {detail}"
    return _PICKLING_ERRORS.get(kind, pickle.PicklingError)(
        f"{fn}: {what} of {who} could not be pickled ({error}); no object was sent and the group is still usable"
    )


def exchange_heads(impl: Any, mine: Pickled, exc: Exception | None) -> np.ndarray:
    """Every rank's ``[stream bytes (negative: a pickling error), frames]``, one row per rank."""
    heads = np.empty((impl.size, 2), _I64)
    impl.all_gather_into_tensor(heads, None, np.array([announced(mine, exc), len(mine.frames)], _I64), False)
    return heads


def slices(sizes: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """One buffer for all payloads and consecutive views of it, one per rank."""
    big = np.empty(int(sizes.sum()), np.uint8)
    views, offset = [], 0
    for s in sizes.tolist():
        views.append(big[offset : offset + s])
        offset += s
    return big, views


def raise_if_failed(impl: Any, sizes: np.ndarray, mine: np.ndarray, exc: Exception | None, fn: str) -> None:
    """If a rank announced a failure (a negative size), gather the error texts and raise on every rank."""
    failed = [r for r, s in enumerate(sizes.tolist()) if s < 0]
    if not failed:
        return
    _, texts = slices(np.where(sizes < 0, -1 - sizes, 0))
    impl.all_gather(texts, None, mine if exc is not None else mine[:0], False)
    if exc is not None and bytes(mine[: len(ARGUMENT)]) == ARGUMENT.encode():
        raise exc  # this rank's own failed check, as it was raised
    raise failure_error(fn, "obj", impl, failed, texts[failed[0]]) from exc


def frame(p: Pickled, j: int) -> np.ndarray:
    return p.frames[j] if j < len(p.frames) else empty()


def gather_all(impl: Any, obj: Any, fn: str = "all_gather_object") -> list[Any]:
    """Every rank's ``obj``, gathered over backend ``impl`` (collective; used by debug checks too)."""
    mine, exc = try_pickle(obj)
    heads = exchange_heads(impl, mine, exc)
    raise_if_failed(impl, heads[:, 0], mine.stream, exc, fn)
    _, streams = slices(heads[:, 0])
    counts = heads[:, 1].tolist()
    if not any(counts):
        impl.all_gather(streams, None, mine.stream, False)
        return [unpickle(s) for s in streams]
    works = [impl.all_gather(streams, None, mine.stream, True)]
    tables = [np.empty((k, 2), _I64) for k in counts]
    impl.all_gather(tables, None, mine.table, False)
    received = [receive_buffers(t) for t in tables]
    for j in range(max(counts)):
        outs = [into[j] if j < len(into) else empty() for into, _ in received]
        works.append(impl.all_gather(outs, None, frame(mine, j), True))
    wait_all(works)
    return [unpickle(s, give) for s, (_, give) in zip(streams, received)]
