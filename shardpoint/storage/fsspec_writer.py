"""The writer of :class:`~shardpoint.storage.fsspec_bridge.FsspecStorage`: one file through an fsspec filesystem.

On a local filesystem a closed file is fsynced, and so is its folder; on
every other filesystem the file is flushed and closed, which uploads and
finalises it, with ``autocommit=False`` where the filesystem offers it so
that ``abort()`` discards a half-made upload.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from ..errors import StorageError
from .base import Writer
from .durable import fsync_path

if TYPE_CHECKING:
    from .fsspec_bridge import FsspecStorage

__all__ = ["FsspecWriter"]


class FsspecWriter(Writer):
    """One file written through an fsspec filesystem; ``close()`` makes it durable, ``abort()`` removes it.

    ``path`` is the file's full path on the filesystem, ``local`` whether
    the filesystem is a local one (fsync on close), and ``wrap`` turns a
    filesystem's exception into the storage's typed error.

    Example::

        w = FsspecWriter(storage, "data/a.bin", storage.root + "/data/a.bin", False, wrap)
    """

    def __init__(self, storage: "FsspecStorage", name: str, path: str, local: bool,
                 wrap: Callable[[str, str, BaseException], StorageError]):
        self._st = storage
        self._name = name
        self._path = path
        self._local = local
        self._wrap = wrap
        self._state = "open"
        self._committable = False
        fs = storage.fs
        try:
            if local:
                fs.makedirs(fs._parent(self._path), exist_ok=True)
                self._f = fs.open(self._path, "wb")
            else:
                self._f = self._open_remote(fs)
        except FileNotFoundError:
            # Filesystems with real folders (hdfs, sftp) need the parent first.
            fs.makedirs(fs._parent(self._path), exist_ok=True)
            self._f = self._open_remote(fs)
        except Exception as e:  # noqa: BLE001
            raise wrap("open", name, e) from e

    def _open_remote(self, fs):
        try:
            f = fs.open(self._path, "wb", autocommit=False)
            self._committable = callable(getattr(f, "commit", None))
            return f
        except (TypeError, NotImplementedError, ValueError):
            return fs.open(self._path, "wb")

    def write(self, data) -> None:
        if self._state != "open":
            raise StorageError(f"{self._st.url}: write to {self._name} after close or abort")
        mv = memoryview(data).cast("B")
        try:
            self._f.write(mv)
        except Exception as e:  # noqa: BLE001
            raise self._wrap("write", self._name, e) from e
        self._st.stats.add_write(len(mv))

    def close(self) -> None:
        if self._state == "closed":
            return
        if self._state == "aborted":
            raise StorageError(f"{self._st.url}: close of {self._name} after abort")
        try:
            if self._local:
                self._f.flush()
                os.fsync(self._f.fileno())
                self._f.close()
                fsync_path(self._st.fs._parent(self._path))
            else:
                self._f.close()  # flushes the last part; no fsync on object stores
                if self._committable:
                    self._f.commit()
        except Exception as e:  # noqa: BLE001
            self.abort()
            raise self._wrap("close", self._name, e) from e
        self._state = "closed"

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        f, fs = self._f, self._st.fs
        try:
            if self._committable:
                f.discard()
            elif not getattr(f, "closed", True) and self._local:
                f.close()
        except Exception:  # noqa: BLE001 - abort never raises
            pass
        try:
            fs.rm_file(self._path)
        except Exception:  # noqa: BLE001
            pass
