"""The load's typed errors: what a path holds instead of a checkpoint, key mismatches, state not restored."""

from __future__ import annotations

import logging
import os

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    KeyMismatchError,
    StateNotRestoredError,
)
from ..format.folders import STEP_PATTERN, committed_in, step_folder
from ..format.manifest import TensorMeta
from ..geometry import Box
from ..storage import Storage
from .names import suggestions

__all__ = ["check_provided", "missing_manifest_error", "key_mismatch", "not_restored"]

log = logging.getLogger("shardpoint")

# Files other tools write, and the command that converts each into a shardpoint checkpoint.
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
# What a shardpoint save leaves in a checkpoint folder before its manifest: its claim and its data files.
SAVE_TRACES = (".claim", "data/", "index/")


def check_provided(storage: Storage, meta: TensorMeta, name: str, box: Box) -> None:
    """Before allocating: the chunks must hold ``numel x itemsize`` bytes of ``box``, in files that big.

    A crafted shape or file size then fails here as a typed error instead of
    in ``torch.empty`` or a short read.
    """
    chunks = meta.chunks or ()
    have = 0
    for c in chunks:
        inter = c.box.intersect(box) if c.flat is None else None
        have += inter.numel if inter is not None else 0
    need = box.numel
    flat = any(c.flat is not None for c in chunks)
    if not flat and have < need:
        raise CorruptCheckpointError(
            f"{storage.url}: tensor {name!r}: its chunks provide {have} of the {need} elements "
            f"({need * meta.itemsize} bytes) of the box {box.offsets}+{box.sizes}; the checkpoint is corrupt"
        )
    sizes: dict[str, int] = {}
    for c in chunks:
        if c.file not in sizes:
            try:
                sizes[c.file] = storage.size(c.file)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{storage.url}: data file {c.file} of tensor {name!r} is missing") from None
        if c.offset + c.nbytes > sizes[c.file]:
            raise CorruptCheckpointError(
                f"{storage.url}: data file {c.file} of tensor {name!r} is shorter than the manifest says "
                f"(truncated?): its chunk bytes [{c.offset}, {c.offset + c.nbytes}) run past its {sizes[c.file]} bytes"
            )


def missing_manifest_error(storage: Storage) -> CheckpointError:
    """The error for a path with no committed manifest, saying what the path holds instead.

    A ``torch.save`` file, a manager's run folder (listing its steps), a
    folder of another tool or an empty one are not shardpoint checkpoints;
    only a folder with a shardpoint save's traces (its claim, data or index
    files) is called an interrupted save.

    Example::

        raise missing_manifest_error(storage_for("ckpt/run"))
    """
    url = storage.url
    if not storage.location_exists():
        return CheckpointNotFoundError(f"no checkpoint at {url}: the path does not exist")
    if "://" not in url and os.path.isfile(url):
        how = (
            f"convert it first: shardpoint import torch {url} OUT --allow-pickle (only for a file you trust)"
            if url.lower().endswith(TORCH_SUFFIXES) else "a shardpoint checkpoint is a folder holding manifest.json"
        )
        return CheckpointNotFoundError(f"{url} is a file, not a shardpoint checkpoint: {how}")
    try:
        names = storage.list("")
    except (OSError, CheckpointError):
        names = []
    run = _run_folder_error(storage, names)
    if run is not None:
        return run
    if any(n == t or n.startswith(t) for n in names for t in SAVE_TRACES):
        return IncompleteCheckpointError(
            f"{url} holds no committed manifest: the save that wrote it was interrupted or is still "
            "running; load an earlier checkpoint"
        )
    if not names:
        return IncompleteCheckpointError(
            f"{url} holds no committed manifest and no files: nothing was saved there, or a save there failed "
            "or has only just started"
        )
    return CheckpointNotFoundError(
        f"{url} is not a shardpoint checkpoint: it has no manifest.json and no shardpoint files "
        f"(it holds {sorted(names)[:5]}){_convert_hint(names)}"
    )


def _convert_hint(names: list[str]) -> str:
    if any(n.endswith(".distcp") or n == ".metadata" for n in names):
        return "; it looks like a PyTorch DCP checkpoint: convert it with shardpoint import dcp SRC OUT --allow-pickle"
    if any(n.endswith(".safetensors") for n in names):
        return "; it looks like a Hugging Face folder: convert it with shardpoint import hf SRC OUT"
    if any(n.lower().endswith(TORCH_SUFFIXES) for n in names):
        return "; for a torch.save file inside it, use shardpoint import torch FILE OUT --allow-pickle"
    return ""


def _run_folder_error(storage: Storage, names: list[str]) -> CheckpointError | None:
    """The error for a manager's run folder (``step_XXXXXXXX`` folders under it), listing its steps."""
    if not any(STEP_PATTERN.match(n.split("/", 1)[0]) for n in names):
        return None
    url = storage.url.rstrip("/")
    steps = committed_in(names)
    if not steps:
        return CheckpointNotFoundError(
            f"{url} is a CheckpointManager run folder, not one checkpoint, and none of its steps is complete "
            "(their saves were interrupted); there is nothing to load"
        )
    shown = ", ".join(map(str, steps)) if len(steps) <= 10 else f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-5:]))}"
    return CheckpointNotFoundError(
        f"{url} is a CheckpointManager run folder, not one checkpoint: it holds steps {shown} (newest {steps[-1]}). "
        f"Load one step, sp.load('{url}/{step_folder(steps[-1])}', state), or resume with "
        f"sp.CheckpointManager('{url}', interval=N).restore(state)"
    )


def key_mismatch(where: str, missing: list[str], unexpected: list[str], strict: bool) -> None:
    """Raise (``strict``) or log that the state and the checkpoint differ, with typo suggestions.

    Example::

        key_mismatch("ckpt", ["model.wieght"], ["model.weight"], strict=True)  # KeyMismatchError
    """
    msg = (
        f"{where}: state and checkpoint differ: missing from the checkpoint "
        f"{sorted(missing)[:20]}{' ...' if len(missing) > 20 else ''}; unexpected in the checkpoint "
        f"{sorted(unexpected)[:20]}{' ...' if len(unexpected) > 20 else ''}"
        f"{suggestions(sorted(missing), list(unexpected) + sorted({u.split('.', 1)[0] for u in unexpected}))}"
    )
    if strict:
        raise KeyMismatchError(msg + " (pass strict=False to load the intersection)", missing, unexpected)
    log.warning("%s", msg)


def not_restored(where: str, rank: int, names: list[str], strict: bool) -> None:
    """Raise (``strict``) or log that tensors a load read did not reach the live state.

    Example::

        not_restored("ckpt", 0, ["model.w"], strict=False)  # a warning
    """
    msg = (
        f"{where}: rank {rank}: {len(names)} tensor(s) read from the checkpoint did not reach the live state: "
        f"{names[:20]}{' ...' if len(names) > 20 else ''}. The object's load_state_dict (its hooks or a "
        "_load_from_state_dict override) did not install them, so training would resume from other values; "
        "fix how that object loads its state"
    )
    if strict:
        raise StateNotRestoredError(msg + " (pass strict=False to load anyway, keeping their current values)", names)
    log.warning("%s", msg)
