"""The read side of :class:`~shardpoint.storage.local.LocalStorage`: kept descriptors, mappings, page-cache calls.

Descriptors and copy-on-write mappings of data files are kept open across
reads (:class:`ReadFiles`); ``madvise`` and ``mincore`` are called through
ctypes so that the interpreter lock is released while the kernel reads
(:func:`madvise`, :func:`populate_supported`, :func:`resident_fraction`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import weakref
from typing import Any

import numpy as np

from ..errors import StorageError

__all__ = ["MADV_WILLNEED", "MADV_POPULATE_READ", "madvise", "populate_supported", "resident_fraction", "ReadFiles"]

log = logging.getLogger("shardpoint.storage.local")


def _open_libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC: Any = _open_libc()  # opened once at import, never replaced: a constant, not a cache


def _libc(name: str) -> Any:
    """The C library's function ``name`` (called without the interpreter lock), or None."""
    return getattr(_LIBC, name, None) if _LIBC is not None else None


MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)  # 3 on Linux and the BSDs
MADV_POPULATE_READ = 22  # Linux 5.14+: fault a range in, reading it from disk, without copying it anywhere


def madvise(mm: mmap.mmap, offset: int, length: int, advice: int) -> int:
    """``madvise(2)`` on ``[offset, offset + length)`` of a writable mapping: 0, or the errno.

    Example::

        madvise(mm, 0, 1 << 20, MADV_WILLNEED)  # a hint; 0 when accepted

    Through ctypes, so the interpreter lock is released for the call:
    ``mmap.madvise`` keeps it, which for ``MADV_POPULATE_READ`` on cold
    pages means for the whole disk read, stalling every other thread.
    """
    page = mmap.PAGESIZE
    start = offset - offset % page
    end = min(len(mm), offset + length)
    if end <= start:
        return 0
    fn = _libc("madvise")
    if fn is None:
        return errno.ENOSYS
    ref = ctypes.c_char.from_buffer(mm, start)  # the mapping's address; released below so it can close
    try:
        if fn(ctypes.c_void_p(ctypes.addressof(ref)), ctypes.c_size_t(end - start), ctypes.c_int(advice)) == 0:
            return 0
        return ctypes.get_errno() or errno.EIO
    finally:
        del ref


def populate_supported(mm: mmap.mmap) -> bool:
    """Whether ``MADV_POPULATE_READ`` works on this kernel, asked with an empty range of ``mm``.

    Example::

        populate_supported(mm)  # True on Linux 5.14 and later

    The kernel checks the advice before it looks at the length, so an empty
    range answers without reading a page: cheap enough to ask every time,
    and no answer is kept for the process.
    """
    fn = _libc("madvise") if sys.platform.startswith("linux") and len(mm) > 0 else None
    if fn is None:
        return False
    ref = ctypes.c_char.from_buffer(mm, 0)  # the mapping's address; released below so it can close
    try:
        return fn(ctypes.c_void_p(ctypes.addressof(ref)), ctypes.c_size_t(0), ctypes.c_int(MADV_POPULATE_READ)) == 0
    finally:
        del ref


def resident_fraction(mm: mmap.mmap, offset: int, length: int) -> float:
    """The fraction of the pages of ``[offset, offset + length)`` of a writable mapping in the page cache.

    One ``mincore`` call. 1.0 where the call is not available (then the
    caller maps, as with ``mmap_reads=True``).
    """
    page = mmap.PAGESIZE
    start = offset - offset % page
    n = (offset + length - start + page - 1) // page
    if n <= 0:
        return 1.0
    mincore = _libc("mincore")
    if mincore is None:
        return 1.0
    ref = ctypes.c_char.from_buffer(mm, start)  # the mapping's address; released below so it can close
    try:
        vec = (ctypes.c_ubyte * n)()
        if mincore(ctypes.c_void_p(ctypes.addressof(ref)), ctypes.c_size_t(n * page), vec) != 0:
            return 1.0
        return float((np.frombuffer(vec, dtype=np.uint8) & 1).mean())
    finally:
        del ref


class ReadFiles:
    """Read-only descriptors kept open across reads of one storage object.

    Opening the file for every span reset the kernel's readahead state each
    time; one descriptor per file with ``POSIX_FADV_SEQUENTIAL`` let a cold
    resharding load read about 12% faster (bench_load, tp-2). Descriptors are
    never closed while the storage is in use (no eviction: a read in another
    thread may be using one); past ``limit`` open files, reads fall back to
    opening per read. Only data files are kept open: they are written once
    under a unique name, while a manifest is replaced by rename and must be
    opened afresh. They close on :meth:`LocalStorage.close`, on deletion or
    rewrite of the file, and when the storage object is collected.

    Mappings of data files (:meth:`mapping`) are kept the same way; closing
    one drops this object's reference, and the pages are unmapped once no
    tensor made from them is left.
    """

    limit = 512

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.maps: dict[str, mmap.mmap | None] = {}
        self.lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_fds, self.fds)

    def __getstate__(self) -> dict:  # descriptors belong to this process
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def get(self, path: str, opener) -> tuple[int, bool]:
        """An open descriptor for ``path`` (``opener()`` opens it) and whether the caller must close it."""
        fd = self.fds.get(path)
        if fd is not None:
            return fd, False
        with self.lock:
            fd = self.fds.get(path)
            if fd is not None:
                return fd, False
            fd = opener()
            if len(self.fds) >= self.limit:
                return fd, True
            if hasattr(os, "posix_fadvise"):
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                except OSError:
                    pass
            self.fds[path] = fd
            return fd, False

    def mapping(self, path: str, opener) -> mmap.mmap | None:
        """A copy-on-write mapping of the whole file as it is now, or None where it cannot be mapped.

        Copy-on-write (never written) so that tensors can view it without a
        read-only warning; its length is the file's size when mapped, which
        bounds every range handed out.
        """
        if path in self.maps:
            return self.maps[path]
        try:
            fd, own = self.get(path, opener)
        except (OSError, StorageError):  # missing, unsafe or unreadable: the read that follows reports it
            return None
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
        except (OSError, ValueError) as e:  # a filesystem without mmap, or an empty file
            log.debug("cannot map %s: %s", path, e)
            mm = None
        finally:
            if own:
                os.close(fd)
        with self.lock:
            if len(self.maps) >= self.limit:
                return mm
            return self.maps.setdefault(path, mm)

    def forget(self, path: str) -> None:
        """Close and drop what is kept for ``path`` (it is being rewritten or deleted)."""
        with self.lock:
            fd = self.fds.pop(path, None)
            self.maps.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every kept descriptor and drop every kept mapping."""
        with self.lock:
            _close_fds(self.fds)
            self.maps.clear()


def _close_fds(fds: dict) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
