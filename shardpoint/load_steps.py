"""Helpers of :func:`shardpoint.load` and :func:`shardpoint.read_tensor`: key selection, targets, checks."""

from __future__ import annotations

import difflib
import fnmatch
import logging
import os
from typing import Any, Iterable, MutableMapping

import torch
from torch import nn

from .adapters import AdapterContext, unwrap_module
from .adapters.megatron import is_megatron, megatron_global_shapes
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    KeyMismatchError,
    StateNotRestoredError,
)
from .format.manifest import Manifest, TensorMeta
from .geometry import Box
from .storage import Storage

__all__ = [
    "entry_selected", "name_selected", "entry_keys", "param_names", "physical_shapes", "materialize_meta",
    "check_provided", "close_names", "suggestions", "check_patterns", "missing_manifest_error",
    "key_mismatch", "not_restored",
]

log = logging.getLogger("shardpoint")

# Files other tools write, and the command that converts each into a shardpoint checkpoint.
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
# What a shardpoint save leaves in a checkpoint folder before its manifest: its claim and its data files.
SAVE_TRACES = (".claim", "data/", "index/")


def entry_selected(key: str, patterns: list[str]) -> bool:
    """Whether ``keys=`` patterns select anything under the top-level entry ``key``."""
    return any(fnmatch.fnmatchcase(key, p) or p.startswith(key + ".") or fnmatch.fnmatchcase(key + ".x", p) for p in patterns)


def name_selected(name: str, patterns: list[str]) -> bool:
    """Whether ``keys=`` patterns select the tensor or entry ``name``."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def entry_keys(manifest: Manifest) -> list[str]:
    """Every top-level key of the checkpoint: entries with values, and the tops of tensor names."""
    keys = dict.fromkeys(manifest.values)
    keys.update(dict.fromkeys(f.split(".", 1)[0] for f in manifest.tensors))
    return list(keys)


def param_names(opt: torch.optim.Optimizer, ctx: AdapterContext) -> list[str]:
    """The state names of ``opt``'s parameters (those a module in the state owns)."""
    names = (ctx.param_names.get(id(p)) for g in opt.param_groups for p in g["params"])
    return [n for n in names if n is not None]


def physical_shapes(state) -> dict[str, tuple]:
    """Global shapes of the modules' tensors by name, as layout rules see the target."""
    shapes = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            if is_megatron(unwrap_module(obj)):  # local TP shards and stage-local layer names
                shapes.update(megatron_global_shapes(key, unwrap_module(obj)))
                continue
            for n, t in unwrap_module(obj).state_dict().items():
                if isinstance(t, torch.Tensor):
                    shapes[f"{key}.{n}"] = tuple(t.shape)
    return shapes


def materialize_meta(state: MutableMapping[str, Any]) -> None:
    """Give modules on the ``meta`` device real (uninitialised) CPU storage to load into."""
    for obj in state.values():
        if isinstance(obj, nn.Module):
            m = unwrap_module(obj)
            if any(t.is_meta for t in m.parameters()) or any(t.is_meta for t in m.buffers()):
                m.to_empty(device=torch.device("cpu"))


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


def close_names(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The names of ``candidates`` closest to ``name`` (a typo's likely fix), best first.

    Example::

        close_names("model.layr.0.w", ["model.layer.0.w", "model.head.w"])  # ['model.layer.0.w']
    """
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.6)


def suggestions(names: Iterable[str], candidates: Iterable[str], limit: int = 5) -> str:
    """``"; did you mean 'a.b' for 'a.c'?"`` for the first ``limit`` of ``names`` with a close candidate, else ``""``.

    Example::

        suggestions(["model.wieght"], ["model.weight"])  # "; did you mean 'model.weight' for 'model.wieght'?"
    """
    pool = list(candidates)
    hints = []
    for name in list(names)[:limit]:
        close = close_names(name, pool, 1)
        if close:
            hints.append(f"{close[0]!r} for {name!r}")
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def check_patterns(where: str, patterns: list[str], manifest: Manifest, strict: bool) -> None:
    """Raise (``strict``) or log for ``keys=`` patterns that select nothing in the checkpoint (typos, most likely).

    The message suggests the closest names and name prefixes (``model.layers.*``).

    Example::

        check_patterns("ckpt", ["model.layrs.*"], manifest, strict=True)  # KeyMismatchError
    """
    names = list(manifest.tensors) + list(manifest.values)
    bad = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) or n.startswith(p + ".") for n in names)]
    if not bad:
        return
    prefixes = {".".join(n.split(".")[:i]) + ".*" for n in names for i in range(1, n.count(".") + 1)}
    msg = f"{where}: keys= pattern(s) {bad} select nothing in the checkpoint{suggestions(bad, names + sorted(prefixes))}"
    if strict:
        raise KeyMismatchError(msg + " (pass strict=False to load what the other patterns select)", bad, [])
    log.warning("%s", msg)


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
    from .manager.layout import STEP_PATTERN, committed_steps, step_folder  # the manager imports this module's users

    if not any(STEP_PATTERN.match(n.split("/", 1)[0]) for n in names):
        return None
    url = storage.url.rstrip("/")
    steps = committed_steps(storage)
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
