"""The write side of :class:`~shardpoint.storage.local.LocalStorage`: durable folders, buffered and O_DIRECT writers."""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from typing import TYPE_CHECKING

import numpy as np

from ..errors import StorageError
from .base import Writer
from .durable import fsync_path

if TYPE_CHECKING:
    from .local import LocalStorage

__all__ = ["DIRECT_REFUSED", "makedirs_durable", "pwrite_all", "aligned_buffer", "DirectState", "LocalWriter", "DirectWriter"]

log = logging.getLogger("shardpoint.storage.local")

# errno values with which a filesystem says "no O_DIRECT here" (not a disk or permission problem).
DIRECT_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def makedirs_durable(path: str) -> None:
    """``os.makedirs``, then fsync the parent of every folder it created.

    A file fsynced inside a new folder is not durable until the folder's own
    entry in its parent is: a crash could otherwise lose the whole folder.

    Example::

        makedirs_durable(os.path.dirname(path))
    """
    if os.path.isdir(path):
        return
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    os.makedirs(path, exist_ok=True)
    for d in reversed(missing):
        fsync_path(os.path.dirname(d))


def pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``mv`` is at ``offset`` (a write may take only part of it).

    Example::

        pwrite_all(fd, memoryview(data), 0)
    """
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        if n <= 0:  # pragma: no cover - pwrite raises rather than return 0 on a full disk
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset}")
        mv, offset = mv[n:], offset + n


def aligned_buffer(size: int, alignment: int) -> memoryview:
    """A writable byte buffer of ``size`` bytes whose address is a multiple of ``alignment``.

    O_DIRECT needs aligned memory; numpy over-allocates and the view starts
    at the first aligned byte, so the memory is freed with the view.

    Example::

        buf = aligned_buffer(8 << 20, 4096)
    """
    raw = np.empty(size + alignment, dtype=np.uint8)
    skip = (-raw.ctypes.data) % alignment
    return memoryview(raw[skip : skip + size])


class DirectState:
    """Shared by a storage and its children: why O_DIRECT was refused, if it was."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.lock = threading.Lock()

    def __getstate__(self) -> dict:  # picklable: the lock is per process
        return {"reason": self.reason}

    def __setstate__(self, state: dict) -> None:
        self.reason, self.lock = state["reason"], threading.Lock()

    def refuse(self, url: str, reason: str) -> None:
        """Record that O_DIRECT was refused for ``reason``; the first refusal is logged."""
        with self.lock:
            first, self.reason = self.reason is None, self.reason or reason
        if first:
            log.warning("%s: O_DIRECT refused (%s); writing data files buffered instead", url, reason)


class LocalWriter(Writer):
    """Buffered positional writes; ``close()`` fsyncs the file and its folder."""

    positional = True

    def __init__(self, storage: "LocalStorage", path: str):
        self._storage = storage
        self._path = path
        makedirs_durable(os.path.dirname(self._path))
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pos = 0
        self._closed = False

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        pwrite_all(self._fd, mv, self._pos)
        self._pos += len(mv)
        self._storage.stats.add_write(len(mv))

    def write_at(self, offset: int, data) -> None:
        mv = memoryview(data).cast("B")
        pwrite_all(self._fd, mv, offset)
        self._storage.stats.add_write(len(mv))

    def close(self) -> None:
        if self._closed:
            return
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._closed = True
        fsync_path(os.path.dirname(self._path))

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


class DirectWriter(Writer):
    """O_DIRECT writes through aligned staging buffers; see the module documentation.

    Bytes are copied into the current buffer; a full buffer goes to the
    writing thread (or is written at once with one buffer). On ``close()``
    the aligned part of the last buffer is written with O_DIRECT, the
    remainder through a buffered descriptor, and the file is fsynced. If the
    first O_DIRECT write fails with EINVAL (the flag was accepted at open but
    the filesystem cannot do it), that buffer and the rest of the file are
    written buffered instead.
    """

    def __init__(self, storage: "LocalStorage", direct: DirectState, fd: int, path: str):
        o = storage.options
        self._storage = storage
        self._direct_state = direct
        self._path = path
        self._fd = fd  # opened with O_DIRECT
        self._fd_buffered: int | None = None
        self._align = o.direct_alignment
        self._size = o.direct_buffer_size
        self._free: queue.Queue = queue.Queue()
        for _ in range(o.direct_buffers):
            self._free.put(aligned_buffer(self._size, self._align))
        self._buf: memoryview = self._free.get()
        self._fill = 0
        self._flushed = 0  # file offset where the current buffer starts
        self._direct_ok = True
        self._direct_bytes = 0
        self._error: BaseException | None = None
        self._closed = False
        self._todo: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if o.direct_buffers > 1:
            self._todo = queue.Queue()
            self._thread = threading.Thread(target=self._drain, name="shardpoint-odirect", daemon=True)
            self._thread.start()

    # --- the device side ------------------------------------------------------
    def _buffered_fd(self) -> int:
        if self._fd_buffered is None:
            self._fd_buffered = os.open(self._path, os.O_WRONLY)
        return self._fd_buffered

    def _put(self, mv: memoryview, offset: int) -> None:
        """Write ``mv`` at ``offset`` (aligned, whole blocks) with O_DIRECT, or buffered after a refusal."""
        if self._direct_ok:
            try:
                pwrite_all(self._fd, mv, offset)
                self._direct_bytes += len(mv)
                return
            except OSError as e:
                if e.errno not in DIRECT_REFUSED or self._direct_bytes:
                    raise
                self._direct_ok = False
                self._direct_state.refuse(self._storage.url, f"the first O_DIRECT write failed: {e}")
        pwrite_all(self._buffered_fd(), mv, offset)

    def _drain(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            buf, offset = job
            try:
                if self._error is None:
                    self._put(buf, offset)
            except BaseException as e:  # noqa: BLE001 - reported by the next write or close
                self._error = e
            finally:
                self._free.put(buf)

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def _ship(self) -> None:
        """Hand the full current buffer to the device side; take a free one."""
        if self._todo is None:
            self._put(self._buf, self._flushed)
        else:
            self._todo.put((self._buf, self._flushed))
            self._buf = self._free.get()
            self._raise_pending()
        self._flushed += self._size
        self._fill = 0

    # --- Writer ---------------------------------------------------------------
    def write(self, data) -> None:
        if self._closed:
            raise StorageError(f"{self._storage.url}: write to {self._path} after close or abort")
        self._raise_pending()
        mv = memoryview(data).cast("B")
        n = len(mv)
        while len(mv):
            take = min(self._size - self._fill, len(mv))
            self._buf[self._fill : self._fill + take] = mv[:take]
            self._fill += take
            mv = mv[take:]
            if self._fill == self._size:
                self._ship()
        self._storage.stats.add_write(n)

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None

    def _close_fds(self) -> None:
        for fd in (self._fd, self._fd_buffered):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._fd_buffered = None

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._stop_thread()
            self._raise_pending()
            head = self._fill - self._fill % self._align
            if head:
                self._put(self._buf[:head], self._flushed)
            if self._fill > head:
                # The unaligned tail: O_DIRECT cannot write a partial block, the page cache can.
                pwrite_all(self._buffered_fd(), self._buf[head : self._fill], self._flushed + head)
            # One fsync covers the file whichever descriptor wrote it: O_DIRECT does not
            # persist metadata (size, extents), and the tail sits in the page cache.
            os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._close_fds()
        fsync_path(os.path.dirname(self._path))

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_thread()
        except BaseException:  # noqa: BLE001 - abort never raises
            pass
        self._close_fds()
        try:
            os.unlink(self._path)
        except OSError:
            pass
