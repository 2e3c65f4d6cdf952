"""Events in torch's profiler for mpidist's calls, at no cost while no profiler runs.

torch's own backends record an event per operation in ``torch.profiler`` /
``torch.autograd.profiler``: ``gloo:all_reduce`` with the input shapes
(``record_shapes=True``), begun when the call is made and ended when the
operation completes, by the backend's worker thread, so torch lists it as
asynchronous (``is_async``). mpidist records the same way:

* torch's groups on mpidist (``mpidist/torch/_profiler.py``): ``mpi:all_reduce``
  or ``mpidist:all_reduce`` (the torch group's backend name), with the tensors
  torch passed, as gloo;
* mpidist's own API on mpidist's groups: ``mpidist:all_reduce`` with the
  shapes of the arrays (numpy arrays as well as tensors).

**No cost without a profiler.** Nothing in mpidist checks for a profiler per
call. torch calls ``torch.autograd.profiler._run_on_profiler_start()`` and
``_run_on_profiler_stop()`` whenever one of its profilers starts and stops
(``torch.profiler.profile``, ``torch.autograd.profiler.profile``,
``emit_nvtx``, ``emit_itt``: it is where torch sets ``_is_profiler_enabled``, the
flag torch's own fast paths read). :func:`watch` wraps those two functions; on
start the methods of the watched classes (mpidist's ``ProcessGroup``, torch's
``ProcessGroupMPIDist``) are replaced by recording versions, and on stop put
back. ``watch`` runs when ``mpidist.torch`` is imported and when a mpidist group
is made in a process that has loaded torch; ``import mpidist`` never imports
torch. Where torch lacks those functions, nothing is recorded (:func:`status`).

**Asynchronous events.** torch marks an event asynchronous when it ends on
another thread than it began. An operation that completes on the thread that
started it (a blocking call, or a wait that drives it) hands the end to a
small helper thread and waits for it (tens of microseconds, only while
profiling), so every event looks like torch's backends' events.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
from typing import Any, Callable, Iterable

from .._world import world

__all__ = ["watch", "status", "register", "Record", "begin", "CORE_METHODS", "core_label"]

_get_ident = threading.get_ident



class ProfilerState:
    """What this module keeps for the process's life (``world.profiler``; it survives ``destroy_process_group``)."""

    def __init__(self) -> None:
        #: (class, {method name: (event op name, inputs(args) -> arrays)}, label) of every watched class
        self.watched: list[tuple[type, dict[str, tuple[str, Callable[[tuple], Iterable[Any]]]], Callable[[Any], Any]]]
        self.watched = []
        self.lock = threading.Lock()
        #: per thread: inside a recording method (a torch group's call runs mpidist's: one event, the outer one)
        self.inside = threading.local()
        self.installed = False  # torch's start/stop functions are wrapped (or found missing)
        self.active = False  # the recording methods are in place
        self.problem = ""  # why nothing can be recorded
        self.closer = _Closer()


def _st() -> ProfilerState:
    """The module's state on :data:`~mpidist._world.world` (made on first use)."""
    state = world.profiler
    if state is None:
        with world.lock:
            if world.profiler is None:
                world.profiler = ProfilerState()
            state = world.profiler
    return state


def _first(args: tuple) -> Iterable[Any]:
    return (args[0],)


def _third(args: tuple) -> Iterable[Any]:
    return (args[2],)


def _third_list(args: tuple) -> Iterable[Any]:
    return args[2]


def _none(args: tuple) -> Iterable[Any]:
    return ()


#: mpidist.ProcessGroup's methods (prepared arrays in, see process_group.py): event name and inputs
CORE_METHODS: dict[str, tuple[str, Callable[[tuple], Iterable[Any]]]] = {
    "broadcast": ("broadcast", _first),
    "all_reduce": ("all_reduce", _first),
    "reduce": ("reduce", _first),
    "all_gather": ("all_gather", _third),
    "all_gather_into_tensor": ("all_gather_into_tensor", _third),
    "gather": ("gather", _first),
    "scatter": ("scatter", _first),
    "reduce_scatter": ("reduce_scatter", _third_list),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", _third),
    "all_to_all_single": ("all_to_all_single", _third),
    "all_to_all": ("all_to_all", _third_list),
    "barrier": ("barrier", _none),
    "all_reduce_packed": ("all_reduce_coalesced", _first),
    "all_gather_packed": ("all_gather_coalesced", _third),
    "send": ("send", _first),
    "recv": ("recv", _first),
    "isend_fast": ("send", _first),
    "irecv_fast": ("recv", _first),
    "recv_blocking": ("recv", _first),
    "batch_p2p": ("batch_isend_irecv", _none),
    "batch_fast": ("batch_isend_irecv", _none),
}


# -- ending events on another thread --------------------------------------------------------


class _Closer:
    """A helper thread that ends events for the thread that began them (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def end(self, ending: Any) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._start:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._loop, name="mpidist-profiler", daemon=True)
                    self._thread.start()
        done = threading.Lock()
        done.acquire()
        self._queue.put((ending, done))
        done.acquire()  # until the helper has ended it: the event's end is the operation's

    def _loop(self) -> None:
        while True:
            ending, done = self._queue.get()
            try:
                ending.set_result(None)
            except Exception:  # noqa: BLE001 - a profiler that went away: nothing to record
                pass
            finally:
                done.release()



class Record:
    """One event in torch's profiler: begun at the call, ended (once) when the operation completes.

    The event is ended by completing a torch Future that torch's profiler ends it on
    (``_call_end_callbacks_on_jit_fut``): its callback runs with the profiler state of
    the thread that began the event, which an event ended on another thread needs.
    """

    __slots__ = ("_ending", "_thread")

    def __init__(self, handle: Any) -> None:
        torch = _torch()
        self._ending = torch.futures.Future()
        torch.ops.profiler._call_end_callbacks_on_jit_fut(handle, self._ending)
        self._thread = _get_ident()

    def end(self, *_: Any) -> None:
        """End the event (on another thread than it began: torch lists it as asynchronous)."""
        ending, self._ending = self._ending, None
        if ending is None:
            return
        if _get_ident() != self._thread:
            ending.set_result(None)
        else:
            _st().closer.end(ending)


def _torch() -> Any:
    return sys.modules["torch"]


def _shapes(arrays: Iterable[Any]) -> list[Any]:
    """What torch's profiler records for ``arrays``: tensors as they are, others as meta tensors of their shape."""
    torch = _torch()
    out = []
    for a in arrays:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif a is not None and hasattr(a, "shape"):
            out.append(_stand_in(tuple(int(s) for s in a.shape)))
    return out


@functools.lru_cache(maxsize=256)
def _stand_in(shape: tuple[int, ...]) -> Any:
    """A meta tensor of ``shape``, made once per shape (making one records an ``aten::empty`` event)."""
    return _torch().empty(shape, device="meta")


def begin(name: str, arrays: Iterable[Any]) -> Record:
    """Begin event ``name`` with the shapes of ``arrays``."""
    return Record(_torch()._C._autograd._record_function_with_args_enter(name, *_shapes(arrays)))


def finish(record: Record, result: Any) -> Any:
    """End ``record`` when ``result`` (a Work, or None for a completed call) completes; return ``result``."""
    profile_until_done = getattr(result, "_profile_until_done", None)
    if profile_until_done is not None:  # mpidist.torch's TorchWork
        profile_until_done(record)
    elif result is not None and hasattr(result, "get_future") and hasattr(result, "_reqs"):  # mpidist's Work
        result.get_future().add_done_callback(record.end)
    else:
        record.end()
    return result


# -- switching the recording methods in and out ------------------------------------------------


def _recording(original: Any, op: str, inputs: Callable[[tuple], Iterable[Any]], label: Callable[[Any], Any]) -> Any:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        prefix, inside = label(self), _st().inside
        if prefix is None or getattr(inside, "busy", False):
            return original(self, *args, **kwargs)
        record = begin(f"{prefix}:{op}", inputs(args))
        inside.busy = True
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            record.end()
            raise
        finally:
            inside.busy = False
        return finish(record, result)

    method.__mpidist_recording__ = original  # type: ignore[attr-defined]
    return method


def core_label(pg: Any) -> str:
    """The name mpidist's own ProcessGroup events carry: ``mpidist:all_reduce``."""
    return "mpidist"


def register(cls: type, methods: dict[str, tuple[str, Callable[[tuple], Iterable[Any]]]],
             label: Callable[[Any], Any]) -> None:  # fmt: skip
    """Watch ``cls``: while a profiler runs, ``methods`` (name -> (event op name, inputs)) record events
    named ``f"{label(self)}:{op}"`` (``label`` returning None: no event)."""
    with _st().lock:
        if any(c is cls for c, _, _ in _st().watched):
            return
        _st().watched.append((cls, methods, label))
        if _st().active:
            _switch_class(cls, methods, label, True)


def _switch_class(cls: type, methods: dict, label: Callable[[Any], Any], on: bool) -> None:
    for name, (op, inputs) in methods.items():
        current = cls.__dict__.get(name)
        if current is None:
            continue
        if on and not hasattr(current, "__mpidist_recording__"):
            setattr(cls, name, _recording(current, op, inputs, label))
        elif not on and hasattr(current, "__mpidist_recording__"):
            setattr(cls, name, current.__mpidist_recording__)


def _switch(on: bool) -> None:
    with _st().lock:
        if _st().active == on:
            return
        _st().active = on
        for cls, methods, label in _st().watched:
            _switch_class(cls, methods, label, on)


def watch() -> str:
    """Follow torch's profiler (once torch is loaded; idempotent); return :func:`status`."""
    if _st().installed or "torch" not in sys.modules:
        return status()
    with _st().lock:
        if _st().installed:
            return status()
        import torch.autograd.profiler as prof

        start, stop = getattr(prof, "_run_on_profiler_start", None), getattr(prof, "_run_on_profiler_stop", None)
        if not callable(start) or not callable(stop) or not hasattr(prof, "_is_profiler_enabled"):
            _st().problem = "torch.autograd.profiler has no _run_on_profiler_start/_stop"
            _st().installed = True
            return status()

        @functools.wraps(start)
        def on_start(*args: Any, **kwargs: Any) -> Any:
            result = start(*args, **kwargs)
            _switch(True)
            return result

        @functools.wraps(stop)
        def on_stop(*args: Any, **kwargs: Any) -> Any:
            result = stop(*args, **kwargs)
            _switch(bool(prof._is_profiler_enabled))
            return result

        prof._run_on_profiler_start, prof._run_on_profiler_stop = on_start, on_stop
        _st().installed = True
        already = bool(prof._is_profiler_enabled)
    if already:  # a profiler was running before mpidist looked
        _switch(True)
    return status()


def status() -> str:
    """Whether mpidist records in torch's profiler: "recording", "watching", "torch not loaded", or why not."""
    if not _st().installed:
        return "torch not loaded"
    if _st().problem:
        return f"not recording: {_st().problem}"
    return "recording" if _st().active else "watching"
