"""Making filesystem changes durable: the one ``fsync`` of a path that every backend uses.

A file fsynced inside a folder is durable only once the folder's entry for
it is too, so local commits fsync the folder after a rename or create. The
local backend and the fsspec bridge on local filesystems do this through
:func:`fsync_path`; best-effort callers pass ``ignore_errors``.
"""

from __future__ import annotations

import os

__all__ = ["fsync_path"]


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
