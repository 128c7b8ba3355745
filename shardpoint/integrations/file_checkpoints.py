"""Checkpoints that are single files: reading ``torch.save`` files, and replacing a file by a checkpoint folder.

Frameworks' default checkpoint writers produce one file per checkpoint
(``epoch=3.ckpt``, ``last.ckpt``). A run that switches to shardpoint meets
those files twice: when it resumes from one, and when its first save lands
on a path an old file still holds. Both are handled here for local paths.

Example::

    if is_local_file(path):
        checkpoint = load_torch_file(path, map_location="cpu", allow_pickle=False)
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import enum
import errno
import io
import logging
import os
import pathlib
import pickle
import shutil
import sys
import uuid
from typing import Any, Callable

import torch

from ..errors import UnsupportedStateError

__all__ = ["SAFE_CLASSES", "is_local_file", "is_remote_file", "load_torch_file", "plain_classes_in", "remove_remote_file", "replace_file"]

log = logging.getLogger("shardpoint")

# Classes a torch checkpoint file may hold that are safe to rebuild (their pickled form only names the class
# and passes strings), allowed on top of what torch.load(weights_only=True) allows.
SAFE_CLASSES = (
    pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath,
    argparse.Namespace,
)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _local(path: str) -> str | None:
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if "://" in path else path


def is_local_file(path: str) -> bool:
    """Whether ``path`` is a regular file on a local disk (a single-file checkpoint, not a shardpoint folder).

    Example::

        is_local_file("runs/last.ckpt")  # True for a file written by torch.save
    """
    local = _local(path)
    return local is not None and os.path.isfile(local)


def is_remote_file(path: str) -> bool:
    """Whether the storage URL ``path`` (``s3://...``, ``gcs://...``) names a single file, asked through fsspec.

    ``False`` for local paths, ``memory://`` (shardpoint's own in-memory
    storage) and URLs whose filesystem is not installed or cannot answer.

    Example::

        is_remote_file("s3://bucket/run/last.ckpt")  # True for a file written by torch.save
    """
    if _local(path) is not None or path.startswith("memory://"):
        return False
    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(path)
        return bool(fs.isfile(root))
    except Exception:  # noqa: BLE001 - no such filesystem, no credentials: not a file we can read
        return False


def remove_remote_file(path: str) -> None:
    """Delete the single file at the storage URL ``path`` (an old checkpoint file beside a checkpoint folder).

    Example::

        remove_remote_file("s3://bucket/run/epoch=0.ckpt")
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    fs.rm_file(root)


def load_torch_file(path: str, map_location: Any = None, allow_pickle: bool = False) -> Any:
    """Read a ``torch.save`` checkpoint file: ``weights_only=True`` unless ``allow_pickle``.

    A file that ``weights_only`` refuses (it holds objects beyond tensors
    and plain containers) raises :class:`~shardpoint.errors.UnsupportedStateError`
    naming the file, what torch refused and how to opt in.

    Example::

        checkpoint = load_torch_file("runs/epoch=3.ckpt", map_location="cpu")
    """
    local = _local(path)
    try:
        if local is None:  # a storage URL: read the file into memory first
            import fsspec

            with fsspec.open(path, "rb") as f:
                local = io.BytesIO(f.read())
        allowed = [] if allow_pickle else [*SAFE_CLASSES, *plain_classes_in(local)]
        if isinstance(local, io.BytesIO):
            local.seek(0)
        with torch.serialization.safe_globals(allowed):
            return torch.load(local, map_location=map_location, weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        if allow_pickle:
            raise
        lines = str(e).strip().splitlines()
        detail = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
        detail = detail.split(" was not an allowed global", 1)[0].split("Unsupported global: ", 1)[-1].strip()
        raise UnsupportedStateError(
            f"{path}: this torch checkpoint file holds objects that a safe load (torch.load(weights_only=True)) "
            f"refuses ({detail}). If you trust the file, load it with pickle allowed: "
            "ShardpointCheckpointIO(allow_pickle=True) (or load_from_checkpoint(..., weights_only=False)); "
            "once saved again by shardpoint, such values are stored without pickle where they are plain types"
        ) from e


def plain_classes_in(path: Any) -> list[type]:
    """The classes a torch checkpoint file names that a safe load may rebuild: Enum, dataclass and namedtuple
    classes, found among the modules this program has already imported (none is imported for the file).

    Rebuilding them runs none of their code but the Enum's lookup of a member
    by value; the same kinds shardpoint stores without pickle.

    Example::

        with torch.serialization.safe_globals(plain_classes_in("last.ckpt")):
            checkpoint = torch.load("last.ckpt", weights_only=True)
    """
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a zip checkpoint, or an older torch: the load itself will tell
        return []
    found = []
    for name in names:
        cls = _imported(name)
        if isinstance(cls, type) and (
            issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))
        ):
            found.append(cls)
    return found


def _imported(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        obj = sys.modules.get(".".join(parts[:i]))
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        if obj is not None:
            return obj
    return None


def replace_file(path: str, write: Callable[[str], None]) -> None:
    """Replace the regular file ``path`` by the checkpoint folder that ``write(folder)`` writes.

    The folder is written beside the file under a hidden name, then put in
    its place: with one atomic exchange where the system offers it (Linux's
    ``renameat2``), so ``path`` always holds either the old file or the new
    checkpoint; elsewhere by moving the file aside first, so a crash in
    between leaves it under ``.<name>.replaced-<id>``. If ``write`` fails,
    the file is untouched and the hidden folder removed.

    Example::

        replace_file("runs/last.ckpt", lambda folder: sp.save(folder, state))
    """
    local = os.path.abspath(_local(path) or path)
    parent, name = os.path.split(local)
    tag = uuid.uuid4().hex[:12]
    new = os.path.join(parent, f".{name}.new-{tag}")
    try:
        write(new)
    except BaseException:
        _remove(new)
        raise
    if _exchange(new, local):
        _sync_dir(parent)
        _remove(new)  # now the old file
        return
    aside = os.path.join(parent, f".{name}.replaced-{tag}")
    os.replace(local, aside)
    try:
        os.replace(new, local)
    except BaseException:
        os.replace(aside, local)
        raise
    _sync_dir(parent)
    _remove(aside)


def _sync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap ``a`` and ``b`` atomically; False where the system or file system cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP, errno.EXDEV):
        log.debug("atomic exchange of %s unavailable (%s); moving the old file aside", b, os.strerror(err))
        return False
    raise OSError(err, os.strerror(err), b)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)
