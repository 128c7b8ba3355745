"""A read-only storage that serves each file of one step from the hosts holding a copy.

A memory step restored after a host loss is spread over the surviving
hosts' memory folders. :class:`RoutedStorage` presents it as one checkpoint
to :func:`shardpoint.load`: the manifest comes from one host, and each file
is read from the first folder of its source list; a missing or short copy
moves that file to the next source. A chunk whose bytes fail their checksum
is read again, alone, from the file's next copies: the load engine asks
:meth:`RoutedStorage.alternatives`, one view per fallback rank, so only that
chunk's span comes from another host. Bytes are counted per source host.

Example::

    st = RoutedStorage("peer-memory:step_00000012", manifest_bytes, {"data/x.bin": [st_h0, st_h1]})
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

from ..errors import StorageError
from ..format.manifest import MANIFEST_NAME
from ..storage.base import Storage, Writer

__all__ = ["RoutedStorage", "Fallback"]


class ReadOnlySource(Storage):
    """What every restore source shares: it exists, and it refuses writes and sub-locations."""

    def location_exists(self) -> bool:
        return True

    def open_writer(self, name: str) -> Writer:
        raise StorageError(f"{self.url}: a restore source is read-only")

    def put_atomic(self, name: str, data: bytes) -> None:
        raise StorageError(f"{self.url}: a restore source is read-only")

    def delete(self, name: str) -> None:
        raise StorageError(f"{self.url}: a restore source is read-only")

    def child(self, sub: str) -> "Storage":
        raise StorageError(f"{self.url}: a restore source has no sub-locations")


class RoutedStorage(ReadOnlySource):
    """Reads each file from its first working source; never writes.

    ``sources`` maps a file name to ``(host, storage)`` pairs in order of
    preference. ``bytes_from`` counts the bytes read from each host.
    """

    page_cached = True

    def __init__(self, url: str, manifest: bytes, sources: Mapping[str, Sequence[tuple[str, Storage]]]):
        super().__init__()
        self.url = url
        self._manifest = manifest
        self._sources = {k: list(v) for k, v in sources.items()}
        self._lock = threading.Lock()
        self.bytes_from: dict[str, int] = {}

    def demote(self, name: str) -> bool:
        """Stop reading ``name`` from its current source (its copy failed a check); ``False`` if none is left."""
        with self._lock:
            srcs = self._sources.get(name, [])
            if len(srcs) <= 1:
                return False
            srcs.pop(0)
            return True

    def demote_named(self, message: str) -> bool:
        """Demote every file named in an error ``message`` (a checksum error names its file); ``False`` if none moved."""
        moved = False
        for name in list(self._sources):
            if name in message:
                moved = self.demote(name) or moved
        return moved

    def rotate_all(self) -> bool:
        """Move every file with a second copy on to that copy; ``False`` when no file had one."""
        with self._lock:
            moved = False
            for srcs in self._sources.values():
                if len(srcs) > 1:
                    srcs.pop(0)
                    moved = True
            return moved

    def _first(self, name: str) -> tuple[str, Storage]:
        return self.source(name, 0)

    def source(self, name: str, rank: int) -> tuple[str, Storage]:
        """The ``rank``-th working source of ``name`` (0: the preferred one); ``FileNotFoundError`` if none."""
        with self._lock:
            srcs = self._sources.get(name) or []
            if rank >= len(srcs):
                raise FileNotFoundError(f"{self.url}: no live host holds {'a further copy of ' if rank else ''}{name}")
            return srcs[rank]

    def count(self, host: str, n: int) -> None:
        """Add ``n`` bytes read from ``host``."""
        self.stats.add_read(n)
        with self._lock:
            self.bytes_from[host] = self.bytes_from.get(host, 0) + n

    def alternatives(self) -> list[Storage]:
        """Per-chunk fallback: a view reading every file from its second copy, one from its third, and so on.

        The load engine re-reads a span that failed its checksum from these
        in order, so one bad chunk costs one more read of that chunk only.
        """
        with self._lock:
            most = max((len(v) for v in self._sources.values()), default=0)
        return [Fallback(self, k) for k in range(1, most)]

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        while True:
            host, st = self._first(name)
            try:
                st.readinto(name, offset, buf)
            except (FileNotFoundError, StorageError, OSError):
                if not self.demote(name):
                    raise
                continue
            self.count(host, len(memoryview(buf).cast("B")))
            return

    def get(self, name: str) -> bytes:
        if name == MANIFEST_NAME:
            return self._manifest
        return _read_all(self, name)

    def size(self, name: str) -> int:
        if name == MANIFEST_NAME:
            return len(self._manifest)
        while True:
            _, st = self._first(name)
            try:
                return st.size(name)
            except FileNotFoundError:
                if not self.demote(name):
                    raise

    def list(self, prefix: str = "") -> list[str]:
        return sorted(n for n in [MANIFEST_NAME, *self._sources] if n.startswith(prefix))


class Fallback(ReadOnlySource):
    """``routed``'s files as read from their ``rank``-th copy (a per-chunk fallback source; read-only)."""

    page_cached = True

    def __init__(self, routed: RoutedStorage, rank: int):
        super().__init__()
        self.routed, self.rank = routed, int(rank)
        self.url = f"{routed.url} (copy {rank + 1})"

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        host, st = self.routed.source(name, self.rank)
        try:
            st.readinto(name, offset, buf)
        except (OSError, StorageError) as e:  # the engine tries the next copy, naming the chunk
            raise FileNotFoundError(f"{self.url}: {name}: {e}") from e
        self.routed.count(host, len(memoryview(buf).cast("B")))

    def get(self, name: str) -> bytes:
        return self.routed.get(name) if name == MANIFEST_NAME else _read_all(self, name)

    def size(self, name: str) -> int:
        return self.routed.size(name)

    def list(self, prefix: str = "") -> list[str]:
        return self.routed.list(prefix)


def _read_all(st: Storage, name: str) -> bytes:
    buf = bytearray(st.size(name))
    st.readinto(name, 0, memoryview(buf))
    return bytes(buf)
