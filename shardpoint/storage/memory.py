"""In-memory backend: one dict per instance, for tests and dry runs (no global state)."""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import StorageError
from .base import Storage, Writer

__all__ = ["MemoryStorage"]


class _MemWriter(Writer):
    def __init__(self, storage: "MemoryStorage", name: str):
        self._s, self._name, self._buf = storage, name, bytearray()

    def write(self, data) -> None:
        b = memoryview(data).cast("B")
        self._buf += b
        self._s.stats.add_write(len(b))

    def close(self) -> None:
        with self._s._lock:
            key = self._s._key(self._name)
            self._s._objects[key] = bytes(self._buf)
            self._s._times[key] = time.time()

    def abort(self) -> None:
        self._buf = bytearray()


class MemoryStorage(Storage):
    """Objects kept in a dict owned by this instance.

    Children share the parent's dict, so a run folder and its step folders
    see each other, as on a real filesystem.

    Example::

        mem = MemoryStorage()
        sp.save(mem, {"w": torch.ones(3)})
    """

    page_cached = True

    atomic_create = True  # within this process, the only place a MemoryStorage is shared

    def __init__(self, _objects: dict | None = None, _prefix: str = "", _times: dict | None = None, _lock: threading.Lock | None = None):
        super().__init__()
        self._objects: dict[str, bytes] = {} if _objects is None else _objects
        self._times: dict[str, float] = {} if _times is None else _times  # last write of each key
        self._prefix = _prefix
        self._lock = threading.Lock() if _lock is None else _lock  # shared with children
        self.url = f"memory://{_prefix}"

    def _key(self, name: str) -> str:
        return f"{self._prefix}{name}"

    def open_writer(self, name: str) -> Writer:
        return _MemWriter(self, name)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        try:
            data = self._objects[self._key(name)]
        except KeyError:
            raise FileNotFoundError(name) from None
        end = offset + len(mv)
        if end > len(data):
            raise self._short(name, offset, len(mv), max(0, len(data) - offset))
        mv[:] = data[offset:end]
        self.stats.add_read(len(mv))

    def put_atomic(self, name: str, data: bytes) -> None:
        with self._lock:
            self._objects[self._key(name)] = bytes(data)
            self._times[self._key(name)] = time.time()
        self.stats.add_write(len(data))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Insert ``name`` only if absent, under the lock shared with every child."""
        key = self._key(name)
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = bytes(data)
            self._times[key] = time.time()
        self.stats.add_write(len(data))
        return True

    def replace_if(self, name: str, expected: bytes, data: bytes) -> bool:
        """Compare and swap under the shared lock."""
        key = self._key(name)
        with self._lock:
            if self._objects.get(key) != expected:
                return False
            self._objects[key] = bytes(data)
            self._times[key] = time.time()
        self.stats.add_write(len(data))
        return True

    def modified_times(self, prefix: str = "") -> dict[str, float | None]:
        n = len(self._prefix)
        return {k[n:]: self._times.get(k) for k in self._list_keys(prefix)}

    def _list_keys(self, prefix: str = "") -> list[str]:
        """Full keys (with this location's prefix) of the names under ``prefix``."""
        full = self._key(prefix)
        return sorted(k for k in list(self._objects) if k.startswith(full))

    def get(self, name: str) -> bytes:
        try:
            data = self._objects[self._key(name)]
        except KeyError:
            raise FileNotFoundError(name) from None
        self.stats.add_read(len(data))
        return data

    def size(self, name: str) -> int:
        try:
            return len(self._objects[self._key(name)])
        except KeyError:
            raise FileNotFoundError(name) from None

    def list(self, prefix: str = "") -> list[str]:
        full = self._key(prefix)
        n = len(self._prefix)
        return sorted(k[n:] for k in list(self._objects) if k.startswith(full))

    def delete(self, name: str) -> None:
        with self._lock:
            self._objects.pop(self._key(name), None)
            self._times.pop(self._key(name), None)

    def location_exists(self) -> bool:
        return any(k.startswith(self._prefix) for k in list(self._objects))

    def place(self) -> tuple[Any, str]:
        return (("memory", id(self._objects)), "/" + self._prefix.rstrip("/"))

    def at(self, path: str) -> "MemoryStorage":
        inner = path.strip("/")
        other = MemoryStorage(self._objects, f"{inner}/" if inner else "", self._times, self._lock)
        other.stats = self.stats
        return other

    def child(self, sub: str) -> "MemoryStorage":
        if ".." in sub.split("/"):
            raise StorageError(f"refusing unsafe sub-location {sub!r}")
        c = MemoryStorage(self._objects, f"{self._prefix}{sub.strip('/')}/", self._times, self._lock)
        c.stats = self.stats
        return c
