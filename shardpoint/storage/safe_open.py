"""Opening a checkpoint's files as untrusted input, on a local or local-like filesystem.

A checkpoint folder may hold symbolic links (to ``/dev/zero``, ``/etc/passwd``,
a copy elsewhere), FIFOs that block a plain ``open`` forever, devices, or
folders where files belong. :func:`open_inside` refuses all of them before a
byte is read, so every backend that reads local files (``LocalStorage``, and
``FsspecStorage`` on a local filesystem) opens through it.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable

from ..errors import StorageError, UnsafeCheckpointError

__all__ = ["open_inside", "size_inside", "read_inside"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return word
    return "not a regular file"


def open_inside(root: str, name: str, url: str = "") -> int:
    """Open ``root/name`` for reading as untrusted input; return the descriptor (the caller closes it).

    Each component of ``name`` is opened relative to the previous one with
    ``O_NOFOLLOW`` (a symbolic link anywhere below ``root`` is refused, so
    nothing outside ``root`` is reached); the file is checked with
    ``lstat`` before and ``fstat`` after a non-blocking open, and only a
    regular file is accepted. Raises ``FileNotFoundError`` for a missing
    file, :class:`UnsafeCheckpointError` naming the file for anything else
    that is not a plain file, and :class:`StorageError` for other failures.

    Example::

        fd = open_inside("ckpt/step_100", "manifest.json")
        try: data = os.pread(fd, 100, 0)
        finally: os.close(fd)
    """
    where = f"{url or root}: {name}"
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UnsafeCheckpointError(f"{where}: refusing unsafe file name {name!r}")
    try:
        dfd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{where} does not exist") from None
    except OSError as e:
        raise StorageError(f"{where}: cannot open the checkpoint folder: {e}") from None
    try:
        for i, comp in enumerate(parts):
            try:
                st = os.stat(comp, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise FileNotFoundError(f"{where} does not exist") from None
            last = i == len(parts) - 1
            if stat.S_ISLNK(st.st_mode) or (not last and not stat.S_ISDIR(st.st_mode)) or (last and not stat.S_ISREG(st.st_mode)):
                what = "" if last else f" (its folder {'/'.join(parts[: i + 1])})"
                raise UnsafeCheckpointError(
                    f"{where}{what} is {_kind(st.st_mode)}; a checkpoint holds only regular files and folders "
                    "(links, FIFOs and devices are refused)"
                )
            flags = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | (_O_NONBLOCK if last else _O_DIRECTORY)
            try:
                nfd = os.open(comp, flags, dir_fd=dfd)
            except FileNotFoundError:
                raise FileNotFoundError(f"{where} does not exist") from None
            except OSError as e:  # ELOOP: replaced by a link since the lstat
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EISDIR):
                    raise UnsafeCheckpointError(f"{where}: refused ({e.strerror}); it is not a regular file") from None
                raise StorageError(f"{where}: cannot open: {e}") from None
            os.close(dfd)
            dfd = nfd
        fd, dfd = dfd, -1
    finally:
        if dfd >= 0:
            os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(f"{where} is {_kind(st.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def size_inside(root: str, name: str, url: str = "") -> int:
    """The size of ``root/name``, opened as :func:`open_inside` opens it (so a link or FIFO is refused).

    Example::

        n = size_inside("ckpt/step_100", "manifest.json")
    """
    fd = open_inside(root, name, url)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_inside(root: str, name: str, url: str, limit: int | None, refuse: Callable[[int], Exception]) -> bytes:
    """The whole of ``root/name`` through one safely opened descriptor, never more than ``limit`` bytes.

    The ``fstat`` size is checked against ``limit`` before reading, and the
    read stops one byte past the limit in case the file grew meanwhile; either
    way ``refuse(size)`` gives the error to raise. ``limit=None`` reads to the
    end.

    Example::

        data = read_inside(root, "manifest.json", url, 1 << 20, lambda n: ValueError(n))
    """
    fd = open_inside(root, name, url)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise refuse(size)
        parts, got = [], 0
        while True:  # to the end, in case the file grew; never past the limit
            want = 16 << 20 if limit is None else max(1, min(limit + 1 - got, 16 << 20))
            chunk = os.pread(fd, want, got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
            if limit is not None and got > limit:
                raise refuse(got)
    finally:
        os.close(fd)
    return b"".join(parts)
