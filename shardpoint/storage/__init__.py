"""Storage backends, chosen by URL scheme.

``storage_for("ckpt/x")`` and ``storage_for("file:///data/ckpt")`` give a
:class:`LocalStorage`; an existing :class:`Storage` passes through. Backends
with optional dependencies are imported only when their scheme is used, so a
missing package gives an install hint instead of an import error at start-up.
"""

from __future__ import annotations

from ..errors import StorageError
from .base import IOStats, Storage, Writer
from .local import LocalStorage
from .memory import MemoryStorage

__all__ = ["Storage", "Writer", "IOStats", "LocalStorage", "MemoryStorage", "storage_for"]


def storage_for(location, **options) -> Storage:
    """Resolve a path, URL or :class:`Storage` into a storage instance."""
    if isinstance(location, Storage):
        return location
    if hasattr(location, "__fspath__"):
        location = location.__fspath__()
    if not isinstance(location, str):
        raise StorageError(f"expected a path, URL or Storage, got {type(location).__name__}")
    scheme = location.split("://", 1)[0] if "://" in location else "file"
    if scheme == "file":
        return LocalStorage(location)
    if scheme == "memory":
        raise StorageError(
            "memory:// has no shared state between calls by design; create "
            "shardpoint.storage.MemoryStorage() once and pass the instance instead"
        )
    raise StorageError(f"no storage backend for scheme {scheme!r} in {location!r} (supported: file, memory)")
