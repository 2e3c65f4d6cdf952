"""mpidist's default store seen as a torch ``Store``, for torch's "mpi" default group.

torch creates the MPI default group with a placeholder ``Store()`` whose every
method raises, so anything torch builds on the default store fails on it:
``new_group(backend="gloo")`` (Lightning's ``prepare_data`` and
``rank_zero_first`` barriers), ``_store_based_barrier``, DeviceMesh. mpidist's
own default group has a real store (see :func:`mpidist.get_default_store`);
:func:`give_real_store` puts it in the placeholder's place, as a
:class:`TorchStore` (a Python subclass of torch's ``Store``, which torch's C++
backends call through pybind11).

Example (``mpiexec -n 2 python script.py``; no ``import mpidist`` needed)::

    import torch.distributed as dist
    dist.init_process_group("mpi")
    side = dist.new_group(backend="gloo")     # a gloo group over the same ranks
    dist.barrier(group=side)
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._world import world

__all__ = ["TorchStore", "give_real_store"]


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class TorchStore(dist.Store):
    """A torch ``Store`` whose methods run on a mpidist store (``store``)."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self._store = store

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self._store.compare_set(key, _bytes(expected_value), _bytes(desired_value))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._store.wait(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(list(keys))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def append(self, key: str, value: Any) -> None:
        self._store.append(key, _bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._store.multi_get(list(keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._store.multi_set(list(keys), [_bytes(v) for v in values])

    def has_extended_api(self) -> bool:
        return True


def give_real_store(pg: Any) -> None:
    """Replace torch's placeholder store of the "mpi" default group ``pg`` by mpidist's default store.

    Keeps torch's layout: the group's entry holds ``PrefixStore("<group name>/", store)``. Where
    mpidist has no default store (it could not open one; ``get_default_store()`` says why), torch's
    placeholder stays.
    """
    store = world.store
    if store is None:
        return
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    table = c10d._world.pg_map
    name, _placeholder = table[pg]
    group_name = c10d._world.pg_names[pg]
    adapter = TorchStore(store)
    # torch's C++ side holds the store, not its Python object, and reaches the methods above only
    # while that object lives (pybind11): the group keeps it
    pg._torch_store = adapter
    table[pg] = (name, dist.PrefixStore(f"{group_name}/", adapter))
