"""The storage interface: a few primitives every backend implements.

A :class:`Storage` is bound to one location (a checkpoint folder, or a run
folder that holds many). Names inside it are relative, ``/``-separated paths.
Backends implement the primitives; everything else (``read``, ``exists``,
``child``) is derived here so each backend stays small.

The commit rule is the same everywhere: data files are written and made
durable first; ``put_atomic`` of the manifest is the commit. On a filesystem it
is write-temp, fsync, rename, fsync-directory; on an object store it is the
single PUT of the manifest object.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from .. import errors
from ..errors import StorageError, UnsafeCheckpointError

__all__ = ["Storage", "Writer", "IOStats", "ShortReadError", "MissingDependencyError"]


class ShortReadError(StorageError):
    """An object ended before the requested byte range (truncated data)."""


class MissingDependencyError(errors.MissingDependencyError, StorageError):
    """A backend needs an optional package that is not installed; the message says what to install.

    Both a :class:`shardpoint.errors.MissingDependencyError` and a
    :class:`~shardpoint.errors.StorageError`, so storage code that handles
    backend failures sees it too.

    Example::

        try:
            storage_for("s3://bucket/ckpt")
        except MissingDependencyError as e:
            print(e)  # ... install it with: pip install 'shardpoint[s3]'
    """


@dataclass
class IOStats:
    """Bytes and calls through one storage instance (thread-safe counters)."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.reads += 1

    def add_write(self, n: int) -> None:
        with self._lock:
            self.bytes_written += n
            self.writes += 1

    def __getstate__(self) -> dict:  # picklable: the lock is per process
        d = dict(self.__dict__)
        d.pop("_lock", None)
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()


class Writer(abc.ABC):
    """A sequential writer of one data file. ``close()`` makes it durable."""

    @abc.abstractmethod
    def write(self, data: memoryview | bytes) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and make durable (fsync or upload complete)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard what was written; never raises."""

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is None:
            self.close()
        else:
            self.abort()


class Storage(abc.ABC):
    """A checkpoint location. Subclasses implement the abstract primitives."""

    url: str
    # Whether a second read of the same bytes on one host is a memory copy (local
    # files through the page cache, memory): loads then re-read instead of sharing.
    page_cached: bool = False

    def __init__(self) -> None:
        self.stats = IOStats()

    # --- primitives -------------------------------------------------------
    @abc.abstractmethod
    def open_writer(self, name: str) -> Writer:
        """A writer that creates or replaces ``name``."""

    @abc.abstractmethod
    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with ``len(buf)`` bytes of ``name`` from ``offset``; short reads raise."""

    @abc.abstractmethod
    def put_atomic(self, name: str, data: bytes) -> None:
        """Write a small object so that readers see all of it or none of it."""

    @abc.abstractmethod
    def get(self, name: str) -> bytes:
        """The whole content of a (small) object; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def size(self, name: str) -> int:
        """Byte size of ``name``; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All names under ``prefix`` (recursive), sorted."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; absent names are ignored."""

    @abc.abstractmethod
    def location_exists(self) -> bool:
        """Whether the location itself exists (a folder, or any object under the prefix)."""

    @abc.abstractmethod
    def child(self, sub: str) -> "Storage":
        """A storage bound to the sub-location ``sub``."""

    # --- derived ----------------------------------------------------------
    def read(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from ``offset``."""
        buf = bytearray(length)
        self.readinto(name, offset, memoryview(buf))
        return bytes(buf)

    def get_limited(self, name: str, limit: int) -> bytes:
        """The whole content of a metadata object, refused unread when larger than ``limit`` bytes.

        The size is checked before reading (a manifest linked to
        ``/dev/zero``, or a huge object, is never read into memory), and the
        read itself takes at most ``limit`` bytes. Raises
        :class:`~shardpoint.errors.UnsafeCheckpointError` naming the object,
        or ``FileNotFoundError``. Backends override it to check and read
        through one handle (local files) or a bounded ranged GET (S3).

        Example::

            data = storage.get_limited("manifest.json", Limits.from_env().manifest_bytes)
        """
        n = self.size(name)
        if n > limit:
            raise self._too_large(name, n, limit)
        data = self.get(name)
        if len(data) > limit:
            raise self._too_large(name, len(data), limit)
        return data

    def _too_large(self, name: str, size: int, limit: int) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self.url}: {name} is {size} bytes, over the format's limit of {limit} for metadata; "
            "refusing to read it (raise the SHARDPOINT_MAX_* limit only for a trusted checkpoint)"
        )

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
            return True
        except FileNotFoundError:
            return False

    def delete_many(self, names: list[str]) -> None:
        for n in names:
            self.delete(n)

    def _short(self, name: str, offset: int, want: int, got: int) -> StorageError:
        return ShortReadError(f"{self.url}: short read of {name} at {offset}: wanted {want} bytes, got {got}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def merged_options(options: Any, overrides: dict, default: Any, what: str) -> Any:
    """``options`` (or ``default``) with keyword ``overrides`` applied; unknown names raise TypeError."""
    opts = options or default
    if overrides:
        try:
            opts = replace(opts, **overrides)
        except TypeError as e:
            raise TypeError(f"unknown {what} option: {e}; see shardpoint.storage.{type(opts).__name__}") from None
    return opts
