"""Key-value stores, as in torch.distributed: ``HashStore``, ``FileStore``, ``TCPStore``, ``PrefixStore``.

None of them needs MPI: they work before ``init_process_group`` and in programs
started without an MPI launcher. Example::

    >>> from mpidist.store import HashStore, PrefixStore
    >>> store = PrefixStore("job", HashStore())
    >>> store.set("first_key", "first_value")
    >>> store.get("first_key")
    b'first_value'
"""

from .base import Store
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .tcp import TCPStore

__all__ = ["Store", "HashStore", "FileStore", "TCPStore", "PrefixStore"]
