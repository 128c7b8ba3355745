"""Storage backends, chosen by URL scheme.

``storage_for("ckpt/x")`` and ``storage_for("file:///data/ckpt")`` give a
:class:`LocalStorage`; ``s3://bucket/prefix`` an :class:`S3Storage` (boto3);
any other scheme that fsspec knows (``gcs://``, ``hdfs://``, ``az://``, ...)
an :class:`FsspecStorage`. An existing :class:`Storage` passes through.
Optional packages (boto3, gcsfs, ...) are imported only when their scheme is
used, so a missing one raises :class:`MissingDependencyError` with an install
hint instead of an import error at start-up.

Example::

    st = storage_for("s3://bucket/run1", endpoint_url="http://127.0.0.1:9000")
    st = storage_for("s3://bucket/run1", options=S3Options(max_concurrency=16))
    st = storage_for("ckpt/step_100", direct=True)  # LocalStorage with O_DIRECT data files
"""

from __future__ import annotations

from ..errors import StorageError
from .base import IOStats, MissingDependencyError, ShortReadError, Storage, Writer
from .fsspec_bridge import FsspecStorage
from .local import LocalOptions, LocalStorage
from .memory import MemoryStorage
from .s3 import S3Options, S3Storage, S3StorageError

__all__ = [
    "Storage",
    "Writer",
    "IOStats",
    "LocalStorage",
    "LocalOptions",
    "MemoryStorage",
    "S3Storage",
    "S3Options",
    "S3StorageError",
    "FsspecStorage",
    "MissingDependencyError",
    "ShortReadError",
    "storage_for",
]


def storage_for(location, **options) -> Storage:
    """Resolve a path, URL or :class:`Storage` into a storage instance.

    ``options`` go to the backend: for ``s3://``, :class:`S3Options` fields
    (``endpoint_url=...``) or ``options=S3Options(...)``; for local paths,
    :class:`LocalOptions` fields (``direct=True``) or
    ``options=LocalOptions(...)``; for fsspec schemes, the filesystem's own
    storage options.

    Example::

        storage_for("ckpt/step_1")                        # LocalStorage
        storage_for("s3://bucket/ckpt", region="eu-west-1")  # S3Storage
        storage_for("gcs://bucket/ckpt", token="cloud")   # FsspecStorage over gcsfs
    """
    if isinstance(location, Storage):
        return location
    if hasattr(location, "__fspath__"):
        location = location.__fspath__()
    if not isinstance(location, str):
        raise StorageError(f"expected a path, URL or Storage, got {type(location).__name__}")
    scheme = location.split("://", 1)[0] if "://" in location else "file"
    if scheme == "file":
        opts = options.pop("options", None)
        return LocalStorage(location, opts, **options)
    if scheme == "s3":
        opts = options.pop("options", None)
        return S3Storage(location, opts, **options)
    if scheme == "memory":
        raise StorageError(
            "memory:// has no shared state between calls by design; create "
            "shardpoint.storage.MemoryStorage() once and pass the instance instead"
        )
    return FsspecStorage.from_url(location, **options)
