"""In-memory backend: one dict per instance, for tests and dry runs (no global state)."""

from __future__ import annotations

import threading

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
            self._s._objects[self._s._key(self._name)] = bytes(self._buf)

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

    def __init__(self, _objects: dict | None = None, _prefix: str = ""):
        super().__init__()
        self._objects: dict[str, bytes] = {} if _objects is None else _objects
        self._prefix = _prefix
        self._lock = threading.Lock()
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
        self.stats.add_write(len(data))

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

    def location_exists(self) -> bool:
        return any(k.startswith(self._prefix) for k in list(self._objects))

    def child(self, sub: str) -> "MemoryStorage":
        if ".." in sub.split("/"):
            raise StorageError(f"refusing unsafe sub-location {sub!r}")
        c = MemoryStorage(self._objects, f"{self._prefix}{sub.strip('/')}/")
        c.stats = self.stats
        return c
