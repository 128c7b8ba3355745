"""Local filesystem backend: positional I/O, fsync, atomic rename, directory fsync."""

from __future__ import annotations

import os
import uuid

from ..errors import StorageError
from .base import Storage, Writer

__all__ = ["LocalStorage"]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalWriter(Writer):
    def __init__(self, storage: "LocalStorage", name: str):
        self._storage = storage
        self._path = storage._path(name)
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._closed = False

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            n = os.write(self._fd, mv)
            mv = mv[n:]
        self._storage.stats.add_write(len(memoryview(data).cast("B")))

    def close(self) -> None:
        if self._closed:
            return
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._closed = True
        _fsync_dir(os.path.dirname(self._path))

    def abort(self) -> None:
        if not self._closed:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._closed = True
        try:
            os.unlink(self._path)
        except OSError:
            pass


class LocalStorage(Storage):
    """A folder on a local or shared POSIX filesystem.

    Example::

        st = LocalStorage("ckpt/step_100")
        st.put_atomic("manifest.json", b"{}")
    """

    def __init__(self, root: str):
        super().__init__()
        if root.startswith("file://"):
            root = root[len("file://"):]
        self.root = os.path.abspath(root)
        self.url = root

    def _path(self, name: str) -> str:
        if name.startswith("/") or ".." in name.split("/"):
            raise StorageError(f"{self.url}: refusing unsafe name {name!r}")
        return os.path.join(self.root, name)

    def open_writer(self, name: str) -> Writer:
        return _LocalWriter(self, name)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        want = len(mv)
        try:
            fd = os.open(self._path(name), os.O_RDONLY)
        except FileNotFoundError:
            raise
        try:
            got = 0
            while got < want:
                n = os.preadv(fd, [mv[got:]], offset + got)
                if n == 0:
                    raise self._short(name, offset, want, got)
                got += n
        finally:
            os.close(fd)
        self.stats.add_read(want)

    def put_atomic(self, name: str, data: bytes) -> None:
        path = self._path(name)
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            mv = memoryview(data)
            while len(mv):
                mv = mv[os.write(fd, mv):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(d)
        self.stats.add_write(len(data))

    def get(self, name: str) -> bytes:
        with open(self._path(name), "rb") as f:
            data = f.read()
        self.stats.add_read(len(data))
        return data

    def size(self, name: str) -> int:
        return os.stat(self._path(name)).st_size

    def list(self, prefix: str = "") -> list[str]:
        out = []
        base = self.root
        if not os.path.isdir(base):
            return []
        for dirpath, _dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, base)
            for f in files:
                name = f if rel == "." else f"{rel}/{f}".replace(os.sep, "/")
                if name.startswith(prefix):
                    out.append(name)
        return sorted(out)

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def location_exists(self) -> bool:
        return os.path.exists(self.root)

    def child(self, sub: str) -> "LocalStorage":
        child = LocalStorage(os.path.join(self.root, sub))
        child.stats = self.stats
        return child
