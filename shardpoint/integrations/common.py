"""What the framework integrations share: optional imports, checkpoint keys and removal.

Kept small on purpose: each integration is a thin translation between a
framework's checkpoint hooks and :func:`shardpoint.save` / :func:`shardpoint.load`.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import Any

from ..errors import MissingDependencyError
from ..storage import storage_for

__all__ = ["require", "top_level_keys", "remove_path"]


def require(module: str, package: str, feature: str, hint: str = "") -> ModuleType:
    """Import ``module``, or raise :class:`MissingDependencyError` saying how to install ``package``.

    ``hint`` is the install command (``pip install <package>`` when empty).

    Example::

        L = require("lightning", "lightning", "shardpoint.integrations.lightning", "pip install 'shardpoint[lightning]'")
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = hint or f"pip install {package}"
        raise MissingDependencyError(
            f"{feature} needs the {package!r} package, which could not be imported ({e}); install it with: {hint}",
            package=package,
            hint=hint,
        ) from e


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
