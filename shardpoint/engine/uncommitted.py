"""What a checkpoint path without a committed manifest holds, in words for the error a load raises.

A path with no ``manifest.json`` is one of three things: a shardpoint save
that was interrupted or is still running (its claim or data files are
there), a single file (often a ``torch.save`` checkpoint), or a folder that
some other tool wrote. Only the first is called an interrupted save.

Example::

    raise IncompleteCheckpointError(describe_uncommitted(storage))
"""

from __future__ import annotations

import os

from ..errors import CheckpointError
from ..storage import Storage
from ..storage.local import LocalStorage
from .claim import CLAIM_NAME

__all__ = ["describe_uncommitted"]


def describe_uncommitted(storage: Storage) -> str:
    """Why ``storage`` (which exists) holds no loadable checkpoint, and what to do.

    Example::

        describe_uncommitted(storage_for("runs/last.ckpt"))  # "... is a file, not a shardpoint checkpoint folder ..."
    """
    where = storage.url
    if isinstance(storage, LocalStorage) and os.path.isfile(storage.root):
        return (
            f"{where} is a file, not a shardpoint checkpoint folder (one holding manifest.json); a file written "
            "by torch.save loads with torch.load(weights_only=True) or imports with `shardpoint import`, "
            "and Lightning's ShardpointCheckpointIO loads it directly"
        )
    try:
        names = storage.list()
    except (OSError, ValueError, CheckpointError):  # a listing that fails changes nothing about the missing manifest
        names = []
    ours = [n for n in names if n == CLAIM_NAME or n.startswith("data/") or n.endswith(".idx")]
    if ours:
        return (
            f"{where} holds no committed manifest: a shardpoint save to it was interrupted or is still running (in another "
            "process); load an earlier checkpoint"
        )
    if not names:
        return (
            f"{where} holds no committed manifest: the folder is empty, so no checkpoint was ever committed there "
            "(a save that failed before writing leaves it so); check the path, or load an earlier checkpoint"
        )
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return (
        f"{where} is not a shardpoint checkpoint: it holds no manifest.json and none of the files a shardpoint "
        f"save writes (it holds {shown}); another tool wrote it. Import it (`shardpoint import`, for safetensors, "
        "DCP and torch.save checkpoints) or load it with the tool that wrote it"
    )
