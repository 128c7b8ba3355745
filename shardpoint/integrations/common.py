"""What the framework integrations share: checkpoint keys and removal.

Kept small on purpose: each integration is a thin translation between a
framework's checkpoint hooks and :func:`shardpoint.save` / :func:`shardpoint.load`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ..storage import storage_for

__all__ = ["top_level_keys", "remove_path"]


def top_level_keys(manifest: Any) -> list[str]:
    """The state keys a checkpoint was saved with, from its manifest, in a stable order.

    Example::

        keys = top_level_keys(sp.read_manifest("ckpt/step_100"))  # ["model", "optimizer", ...]
    """
    keys = dict.fromkeys(manifest.values)
    for name in manifest.tensors:
        keys.setdefault(name.split(".", 1)[0])
    return list(keys)


def remove_path(path: str) -> None:
    """Delete a checkpoint folder (a local path or a storage URL) and everything in it.

    Example::

        remove_path("ckpt/epoch=0-step=4.ckpt")
    """
    if "://" not in path or path.startswith("file://"):
        local = path[len("file://"):] if path.startswith("file://") else path
        if os.path.isdir(local) and not os.path.islink(local):
            shutil.rmtree(local)
        elif os.path.lexists(local):
            os.remove(local)
        return
    storage = storage_for(path)
    storage.delete_many(storage.list())
