"""Local filesystem backend: positional I/O, fsync, atomic rename, directory fsync, optional O_DIRECT.

Every read and write names its file offset (``os.preadv``/``os.pwrite``), so
no file position is shared between threads. A data file is made durable on
``close()`` (``fsync`` of the file, then of its folder); ``put_atomic`` is
write-temp, ``fsync``, rename, ``fsync`` of the folder, and folders created
on the way are made durable in their parents too.

O_DIRECT (``LocalOptions(direct=True)``, off by default) writes data files
around the page cache: writes are copied into page-aligned buffers, and full
buffers are written at aligned offsets by a background thread while the
caller fills the next one. The unaligned tail of a file (less than
``direct_alignment`` bytes) is written with a normal buffered write before
the ``fsync``. A filesystem that refuses O_DIRECT (at ``open`` or on the
first write) gets buffered writes instead, with the reason logged once and
kept in :attr:`LocalStorage.direct_fallback_reason`. Reads and manifests are
always buffered. See docs/design.md ("Local writes: positional, O_DIRECT")
for when O_DIRECT pays.

Every file is opened for reading as untrusted
(:func:`shardpoint.storage.safe_open.open_inside`): path
components are opened one by one relative to the checkpoint folder with
``O_NOFOLLOW``, so no symbolic link inside the checkpoint is followed (the
checkpoint folder itself may be one); the file is opened with ``O_NONBLOCK``
(a FIFO cannot block the open) and refused unless ``fstat`` says it is a
regular file. Refusals raise :class:`~shardpoint.errors.UnsafeCheckpointError`
naming the file.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import queue
import sys
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StorageError
from .base import ShortReadError, Storage, Writer, merged_options
from .durable import fsync_path
from .safe_open import open_inside

__all__ = ["LocalOptions", "LocalStorage", "fsync_path"]

log = logging.getLogger("shardpoint.storage.local")

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # absent on macOS and Windows
# errno values with which a filesystem says "no O_DIRECT here" (not a disk or permission problem).
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


@dataclass(frozen=True)
class LocalOptions:
    """How :class:`LocalStorage` writes data files.

    - ``direct``: write data files with ``O_DIRECT`` through aligned
      buffers, bypassing the page cache (default ``False``; see
      docs/benchmarks.md for the measurement behind the default). Manifests
      and reads stay buffered. Where the filesystem refuses ``O_DIRECT`` the
      writes are buffered, with the reason logged.
    - ``direct_buffer_size``: bytes per aligned staging buffer (a multiple of
      ``direct_alignment``).
    - ``direct_buffers``: staging buffers per open file. With 2 or more, a
      background thread writes full buffers while the caller fills the next;
      with 1, each full buffer is written in the caller's thread.
    - ``direct_alignment``: alignment of buffer addresses, file offsets and
      write sizes for ``O_DIRECT`` (a power of two, at least 512). 4096 suits
      Linux filesystems on 512-byte and 4 KiB-sector devices.
    - ``mmap_reads``: let the load engine hash and copy the parts of data
      files it must narrow straight from a read-only mapping instead of
      reading them into a buffer first: one memory copy less per byte
      (docs/design.md, "Mapped reads"). A reader thread faults each mapped
      span in with ``MADV_POPULATE_READ`` (Linux 5.14 and later), which
      reads cold pages from the disk without the copy ``read`` makes, and
      hashes it there. ``"auto"`` (the default) maps every such span where
      that call works; on older kernels it maps a span only when most of
      its pages are already in the page cache (``mincore``), since page
      faults on cold pages are slower than reading into a buffer. ``True``
      always maps, ``False`` never does.

    Example::

        st = LocalStorage("ckpt/step_100", LocalOptions(direct=True))
        st = storage_for("ckpt/step_100", direct=True)  # the same
    """

    direct: bool = False
    direct_buffer_size: int = 8 << 20
    direct_buffers: int = 2
    direct_alignment: int = 4096
    mmap_reads: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.mmap_reads not in (True, False, "auto"):
            raise ValueError(f"LocalOptions.mmap_reads must be True, False or 'auto', got {self.mmap_reads!r}")
        a = self.direct_alignment
        if a < 512 or a & (a - 1):
            raise ValueError(f"LocalOptions.direct_alignment must be a power of two >= 512, got {a}")
        if self.direct_buffer_size < a or self.direct_buffer_size % a:
            raise ValueError(
                f"LocalOptions.direct_buffer_size must be a positive multiple of direct_alignment ({a}), "
                f"got {self.direct_buffer_size}"
            )
        if self.direct_buffers < 1:
            raise ValueError(f"LocalOptions.direct_buffers must be at least 1, got {self.direct_buffers}")


_LIBC: Any = None


def _libc(name: str) -> Any:
    """The C library's function ``name`` (called without the interpreter lock), or None."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        return getattr(_LIBC, name)
    except (OSError, AttributeError):
        return None


_MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)  # 3 on Linux and the BSDs
MADV_POPULATE_READ = 22  # Linux 5.14+: fault a range in, reading it from disk, without copying it anywhere
_POPULATE: list[bool] = []  # [whether MADV_POPULATE_READ works here], found on first use


def _madvise(mm: mmap.mmap, offset: int, length: int, advice: int) -> int:
    """``madvise(2)`` on ``[offset, offset + length)`` of a writable mapping: 0, or the errno.

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
    """Whether ``MADV_POPULATE_READ`` works on this kernel (tried once, on one page of ``mm``)."""
    if not _POPULATE:
        _POPULATE.append(sys.platform.startswith("linux") and len(mm) > 0 and _madvise(mm, 0, 1, MADV_POPULATE_READ) == 0)
    return _POPULATE[0]


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


def _makedirs_durable(path: str) -> None:
    """``os.makedirs``, then fsync the parent of every folder it created.

    A file fsynced inside a new folder is not durable until the folder's own
    entry in its parent is: a crash could otherwise lose the whole folder.
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


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
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


class _ReadFiles:
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
        with self.lock:
            fd = self.fds.pop(path, None)
            self.maps.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
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


class _DirectState:
    """Shared by a storage and its children: why O_DIRECT was refused, if it was."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.lock = threading.Lock()

    def __getstate__(self) -> dict:  # picklable: the lock is per process
        return {"reason": self.reason}

    def __setstate__(self, state: dict) -> None:
        self.reason, self.lock = state["reason"], threading.Lock()

    def refuse(self, url: str, reason: str) -> None:
        with self.lock:
            first, self.reason = self.reason is None, self.reason or reason
        if first:
            log.warning("%s: O_DIRECT refused (%s); writing data files buffered instead", url, reason)


class _LocalWriter(Writer):
    """Buffered positional writes; ``close()`` fsyncs the file and its folder."""

    def __init__(self, storage: "LocalStorage", name: str):
        self._storage = storage
        self._path = storage._path(name)
        _makedirs_durable(os.path.dirname(self._path))
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pos = 0
        self._closed = False

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        _pwrite_all(self._fd, mv, self._pos)
        self._pos += len(mv)
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


class _DirectWriter(Writer):
    """O_DIRECT writes through aligned staging buffers; see the module documentation.

    Bytes are copied into the current buffer; a full buffer goes to the
    writing thread (or is written at once with one buffer). On ``close()``
    the aligned part of the last buffer is written with O_DIRECT, the
    remainder through a buffered descriptor, and the file is fsynced. If the
    first O_DIRECT write fails with EINVAL (the flag was accepted at open but
    the filesystem cannot do it), that buffer and the rest of the file are
    written buffered instead.
    """

    def __init__(self, storage: "LocalStorage", name: str, fd: int, path: str):
        o = storage.options
        self._storage = storage
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
                _pwrite_all(self._fd, mv, offset)
                self._direct_bytes += len(mv)
                return
            except OSError as e:
                if e.errno not in _REFUSED or self._direct_bytes:
                    raise
                self._direct_ok = False
                self._storage._direct.refuse(self._storage.url, f"the first O_DIRECT write failed: {e}")
        _pwrite_all(self._buffered_fd(), mv, offset)

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
                _pwrite_all(self._buffered_fd(), self._buf[head : self._fill], self._flushed + head)
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


class LocalStorage(Storage):
    """A folder on a local or shared POSIX filesystem.

    ``options`` is a :class:`LocalOptions`; keyword arguments override its
    fields (``LocalStorage(path, direct=True)``). Children share the options,
    the counters and the O_DIRECT fallback state.

    Example::

        st = LocalStorage("ckpt/step_100")
        st.put_atomic("manifest.json", b"{}")
        fast = LocalStorage("ckpt/step_100", direct=True)  # O_DIRECT data files
    """

    page_cached = True
    vectored_reads = True

    def __init__(self, root: str, options: LocalOptions | None = None, **overrides: Any):
        super().__init__()
        if root.startswith("file://"):
            root = root[len("file://"):]
        self.root = os.path.abspath(root)
        self.url = root
        opts = merged_options(options, overrides, LocalOptions(), "local storage")
        self.options = opts
        self._direct = _DirectState()
        self._reads = _ReadFiles()

    @property
    def direct_fallback_reason(self) -> str | None:
        """Why O_DIRECT writes fell back to buffered ones here (``None`` if they did not)."""
        return self._direct.reason

    def _path(self, name: str) -> str:
        if name.startswith("/") or ".." in name.split("/"):
            raise StorageError(f"{self.url}: refusing unsafe name {name!r}")
        return os.path.join(self.root, name)

    def open_writer(self, name: str) -> Writer:
        self._reads.forget(self._path(name))
        if not self.options.direct:
            return _LocalWriter(self, name)
        path = self._path(name)
        if not _O_DIRECT:
            self._direct.refuse(self.url, "this platform has no O_DIRECT")
        if self._direct.reason is not None:  # refused before: do not ask again for every file
            return _LocalWriter(self, name)
        _makedirs_durable(os.path.dirname(path))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self._direct.refuse(self.url, f"open with O_DIRECT failed: {e}")
            return _LocalWriter(self, name)
        return _DirectWriter(self, name, fd, path)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        self.readinto_many(name, [(offset, buf)])

    def readinto_many(self, name: str, parts) -> None:
        """``readinto`` for several ``(offset, buffer)`` pieces of one file.

        One name check and descriptor lookup for all of them: a strided
        partial read of a chunk can be thousands of small pieces.
        """
        path = self._path(name)
        if name.startswith("data/"):  # written once under a unique name: safe to keep open
            fd, own = self._reads.get(path, lambda: open_inside(self.root, name, self.url))
        else:  # manifests and the like are replaced by rename: open the current file
            fd, own = open_inside(self.root, name, self.url), True
        total = 0
        try:
            for offset, buf in parts:
                mv = memoryview(buf).cast("B")
                want = len(mv)
                got = 0
                while got < want:
                    n = os.preadv(fd, [mv[got:]], offset + got)
                    if n == 0:
                        raise self._short(name, offset, want, got)
                    got += n
                total += want
        finally:
            if own:
                os.close(fd)
            if total:
                self.stats.add_read(total)

    def map_range(self, name: str, offset: int, length: int, count: int | None = None) -> memoryview | None:
        """Bytes ``[offset, offset + length)`` of a data file as a view of a mapping, or None.

        None means "read it instead": mapped reads are off, the name is not
        a data file (only those are written once under a unique name and
        never rewritten in place, so a mapping of one cannot shrink under a
        reader), the file cannot be mapped, or the range runs past its end
        (the read then reports the short file as usual). ``count`` is the
        number of bytes the caller will touch, for :attr:`stats` (default
        ``length``).
        """
        if not self.options.mmap_reads or not name.startswith("data/") or length <= 0 or offset < 0:
            return None
        mm = self._reads.mapping(self._path(name), lambda: open_inside(self.root, name, self.url))
        if mm is None or offset + length > len(mm):
            return None
        if self.options.mmap_reads == "auto" and not populate_supported(mm) and resident_fraction(mm, offset, length) < 0.5:
            return None  # cold, and only page faults would bring it in: a reader thread reads it into a buffer
        self.stats.add_read(length if count is None else count)
        return memoryview(mm)[offset : offset + length]

    def populate(self, name: str, offset: int, length: int) -> bool:
        """Bring ``[offset, offset + length)`` of a file mapped by :meth:`map_range` into memory now.

        One ``MADV_POPULATE_READ`` call, made without the interpreter lock:
        cold pages are read from the disk, and every page is mapped, so the
        hashing and copying that follow take no page faults. Where the call
        is not available (before Linux 5.14) the range is only hinted
        (:meth:`prefetch`) and False returned: page faults then bring the
        pages in as they are touched. A file that shrank after it was
        mapped raises :class:`ShortReadError` here instead of killing the
        process with ``SIGBUS`` later.
        """
        mm = self._reads.maps.get(self._path(name))
        if mm is None or length <= 0:
            return False
        if not populate_supported(mm):
            self.prefetch(name, offset, length)
            return False
        err = _madvise(mm, offset, length, MADV_POPULATE_READ)
        if err == errno.EFAULT:
            raise ShortReadError(f"{self.url}/{name}: bytes [{offset}, {offset + length}) are no longer in the file")
        return err == 0

    def prefetch(self, name: str, offset: int, length: int) -> None:
        """Ask the kernel to start reading ``[offset, offset + length)`` of a mapped data file."""
        mm = self._reads.maps.get(self._path(name))
        if mm is not None and length > 0:
            _madvise(mm, offset, length, _MADV_WILLNEED)  # only a hint: an error changes nothing

    def close(self) -> None:
        """Close the descriptors and mappings kept open for reading (the storage stays usable)."""
        self._reads.close()

    def put_atomic(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self._reads.forget(path)
        d = os.path.dirname(path)
        _makedirs_durable(d)
        tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _pwrite_all(fd, memoryview(data).cast("B"), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        fsync_path(d)
        self.stats.add_write(len(data))

    atomic_create = True

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create ``name`` only if absent: the bytes go to a private file, which is then hard-linked into place.

        ``link`` fails when the name exists, so exactly one of several
        processes wins (also on NFS, where ``O_EXCL`` on the final name is
        not reliable everywhere), and readers never see a partial object.
        """
        path = self._path(name)
        d = os.path.dirname(path)
        _makedirs_durable(d)
        tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _pwrite_all(fd, memoryview(data).cast("B"), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        finally:
            os.unlink(tmp)
        fsync_path(d)
        self.stats.add_write(len(data))
        return True

    def modified_times(self, prefix: str = "") -> dict[str, float | None]:
        """``st_mtime`` of every file under ``prefix`` (a vanished file is left out)."""
        out: dict[str, float | None] = {}
        for name in self.list(prefix):
            try:
                out[name] = os.stat(self._path(name)).st_mtime
            except FileNotFoundError:
                continue
        return out

    def get(self, name: str) -> bytes:
        return self._read_whole(name, None)

    def get_limited(self, name: str, limit: int) -> bytes:
        """``get`` through one descriptor: opened safely, its ``fstat`` size checked, then at most ``limit`` bytes read."""
        return self._read_whole(name, limit)

    def _read_whole(self, name: str, limit: int | None) -> bytes:
        self._path(name)
        fd = open_inside(self.root, name, self.url)
        try:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise self._too_large(name, size, limit)
            cap = size if limit is None else limit
            parts, got = [], 0
            while True:  # to the end, in case the file grew; never past the limit
                chunk = os.pread(fd, max(1, min(cap + 1 - got, 16 << 20)) if limit is not None else 16 << 20, got)
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
                if limit is not None and got > limit:
                    raise self._too_large(name, got, limit)
        finally:
            os.close(fd)
        data = b"".join(parts)
        self.stats.add_read(len(data))
        return data

    def size(self, name: str) -> int:
        self._path(name)
        fd = open_inside(self.root, name, self.url)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

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
        self._reads.forget(self._path(name))
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def location_exists(self) -> bool:
        return os.path.exists(self.root)

    def child(self, sub: str) -> "LocalStorage":
        child = LocalStorage(os.path.join(self.root, sub), self.options)
        child.stats = self.stats
        child._direct = self._direct
        return child
