"""Making filesystem changes durable: the one ``fsync`` of a path that every backend uses.

A file fsynced inside a folder is durable only once the folder's entry for
it is too, so local commits fsync the folder after a rename or create. The
local backend and the fsspec bridge on local filesystems do this through
:func:`fsync_path`; best-effort callers pass ``ignore_errors``.
"""

from __future__ import annotations

import os
import uuid

__all__ = ["fsync_path", "create_by_link"]


def fsync_path(path: str, ignore_errors: bool = False) -> None:
    """fsync a file or a folder by path (a folder's fsync makes its entries durable).

    With ``ignore_errors`` a path that cannot be opened or synced is passed
    over (best effort, for cleanups that must not fail the caller).

    Example::

        os.replace(tmp, final)
        fsync_path(os.path.dirname(final))
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if ignore_errors:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not ignore_errors:
            raise
    finally:
        os.close(fd)


def create_by_link(path: str, data: bytes) -> bool:
    """Create the file ``path`` holding ``data`` only if no file of that name exists; ``False`` if one does.

    The bytes go into a private file in the same folder first, fsynced, which
    is then hard-linked to ``path``: a link fails if the name exists, so of
    several racing creators exactly one wins, and nobody ever sees the file
    half written. The folder must exist; it is fsynced after the link.

    Example::

        if not create_by_link(os.path.join(folder, ".claim"), body):
            ...  # another writer holds it
    """
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        os.unlink(tmp)
    fsync_path(folder)
    return True
