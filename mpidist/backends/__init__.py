"""Backends: the interface (:class:`BaseBackend`), the MPI backend, and the registry."""

from .base import BaseBackend
from .registry import Backend, BackendOptions

__all__ = ["BaseBackend", "Backend", "BackendOptions"]
