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

import errno
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import StorageError
from .base import ShortReadError, Storage, Writer, merged_options
from .durable import create_by_link, fsync_path
from .local_read import MADV_POPULATE_READ, MADV_WILLNEED, ReadFiles, madvise, populate_supported, resident_fraction
from .local_write import DIRECT_REFUSED, DirectState, DirectWriter, LocalWriter, aligned_buffer, makedirs_durable, pwrite_all
from .safe_open import open_inside, read_inside, size_inside

# aligned_buffer, fsync_path, populate_supported and resident_fraction are re-exported:
# callers import them from here.
__all__ = ["LocalOptions", "LocalStorage", "fsync_path", "aligned_buffer", "populate_supported", "resident_fraction"]

log = logging.getLogger("shardpoint.storage.local")

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # absent on macOS and Windows


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
        self._direct = DirectState()
        self._reads = ReadFiles()

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
            return LocalWriter(self, self._path(name))
        path = self._path(name)
        if not _O_DIRECT:
            self._direct.refuse(self.url, "this platform has no O_DIRECT")
        if self._direct.reason is not None:  # refused before: do not ask again for every file
            return LocalWriter(self, self._path(name))
        makedirs_durable(os.path.dirname(path))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno not in DIRECT_REFUSED:
                raise
            self._direct.refuse(self.url, f"open with O_DIRECT failed: {e}")
            return LocalWriter(self, self._path(name))
        return DirectWriter(self, self._direct, fd, path)

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
        err = madvise(mm, offset, length, MADV_POPULATE_READ)
        if err == errno.EFAULT:
            raise ShortReadError(f"{self.url}/{name}: bytes [{offset}, {offset + length}) are no longer in the file")
        return err == 0

    def prefetch(self, name: str, offset: int, length: int) -> None:
        """Ask the kernel to start reading ``[offset, offset + length)`` of a mapped data file."""
        mm = self._reads.maps.get(self._path(name))
        if mm is not None and length > 0:
            madvise(mm, offset, length, MADV_WILLNEED)  # only a hint: an error changes nothing

    def close(self) -> None:
        """Close the descriptors and mappings kept open for reading (the storage stays usable)."""
        self._reads.close()

    def put_atomic(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self._reads.forget(path)
        d = os.path.dirname(path)
        makedirs_durable(d)
        tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pwrite_all(fd, memoryview(data).cast("B"), 0)
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
        makedirs_durable(d)
        if not create_by_link(path, data):
            return False
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
        data = read_inside(self.root, name, self.url, limit, lambda n: self._too_large(name, n, limit))
        self.stats.add_read(len(data))
        return data

    def size(self, name: str) -> int:
        self._path(name)
        return size_inside(self.root, name, self.url)

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

    def sync_deletes(self) -> None:
        """fsync this folder, so the deletions in it are durable (errors are passed over)."""
        fsync_path(self.root, ignore_errors=True)

    def remove_empty_folders(self) -> None:
        """Remove the empty directories under this folder and the folder itself, deepest first."""
        for dirpath, _dirs, _files in sorted(os.walk(self.root), key=lambda x: -len(x[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass  # not empty: something else lives there

    def location_exists(self) -> bool:
        return os.path.exists(self.root)

    def child(self, sub: str) -> "LocalStorage":
        child = LocalStorage(os.path.join(self.root, sub), self.options)
        child.stats = self.stats
        child._share_direct(self._direct)
        return child

    def place(self) -> tuple[Any, str]:
        return ("file", self.root.replace(os.sep, "/"))

    def at(self, path: str) -> "LocalStorage":
        other = LocalStorage(path, self.options)
        other.stats = self.stats
        other._share_direct(self._direct)
        return other

    def _share_direct(self, direct: Any) -> None:
        """Use the parent's direct-I/O state, so a child learns what the parent learned."""
        self._direct = direct
