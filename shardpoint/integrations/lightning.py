"""Lightning ``CheckpointIO`` plugins that write Lightning checkpoints with shardpoint.

Use as ``Trainer(plugins=[ShardpointCheckpointIO()])``. Each checkpoint is a
shardpoint folder (at the path Lightning chooses, ``.ckpt`` suffix included)
holding the checkpoint dict Lightning builds: ``state_dict``,
``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks`` and the rest.
Tensors are stored with checksums and read back verified; plain values use
shardpoint's value encoding (no pickle).

Under the single-device and DDP strategies Lightning calls the plugin on
global rank 0 only, with the full state, so the save runs on that rank alone
(:data:`shardpoint.LOCAL`) and involves no collective. Every rank loads the
whole checkpoint, so a checkpoint saved by N processes resumes with any other
number. Lightning's FSDP strategies bypass ``CheckpointIO`` for sharded
checkpoints and for loading; :class:`ShardpointFSDPStrategy` routes both
through shardpoint, each rank writing and reading only its shards.

Example::

    import lightning as L
    from shardpoint.integrations.lightning import ShardpointCheckpointIO

    trainer = L.Trainer(max_epochs=3, plugins=[ShardpointCheckpointIO()])
    trainer.fit(model, data, ckpt_path="checkpoints/last.ckpt")
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ..api import load, read_manifest, save
from ..async_handle import AsyncSaveHandle
from ..async_save import async_save
from ..errors import UnsupportedStateError
from ..dist import LOCAL
from ..extras import require
from .common import remove_path, top_level_keys

require("lightning", "lightning", "shardpoint.integrations.lightning")
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402

__all__ = ["ShardpointCheckpointIO", "AsyncShardpointCheckpointIO", "ShardpointFSDPStrategy", "to_state", "from_state"]

# Checkpoint keys that cannot be shardpoint state keys (not a string, empty, or holding '.') live under this key.
OTHER_KEYS = "lightning_other_keys"


def to_state(checkpoint: dict[Any, Any]) -> dict[str, Any]:
    """The shardpoint state for a Lightning checkpoint dict: one state key per checkpoint key.

    Keys that shardpoint cannot use as state keys are gathered under
    ``"lightning_other_keys"``; :func:`from_state` puts them back.

    Example::

        state = to_state({"state_dict": model.state_dict(), "epoch": 3})
    """
    state: dict[str, Any] = {}
    other: dict[Any, Any] = {}
    for k, v in checkpoint.items():
        if isinstance(k, str) and k and "." not in k and k != OTHER_KEYS:
            state[k] = v
        else:
            other[k] = v
    if other:
        state[OTHER_KEYS] = other
    return state


def from_state(state: dict[str, Any]) -> dict[Any, Any]:
    """The Lightning checkpoint dict for a state that :func:`to_state` built.

    Example::

        assert from_state(to_state(checkpoint)) == checkpoint
    """
    out: dict[Any, Any] = {k: v for k, v in state.items() if k != OTHER_KEYS}
    out.update(state.get(OTHER_KEYS) or {})
    return out


def _mapped(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _mapped(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mapped(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_mapped(v, device) for v in obj)
    return obj


class ShardpointCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves and loads checkpoints with shardpoint.

    ``verify`` checks every checksum on load (the default). The save runs on
    the calling rank alone, so Lightning's rank-0-only saves under DDP never
    wait on the other ranks.

    Example::

        trainer = L.Trainer(strategy="ddp", plugins=[ShardpointCheckpointIO()])
    """

    def __init__(self, *, verify: bool = True) -> None:
        super().__init__()
        self.verify = verify

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to the folder ``path`` (replacing a previous checkpoint there atomically)."""
        _no_storage_options(storage_options)
        save(_where(path), to_state(checkpoint), process_group=LOCAL)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the whole checkpoint at ``path`` on this rank, verifying checksums.

        ``weights_only`` is accepted for interface compatibility: shardpoint
        never unpickles, so every load is as safe as ``weights_only=True``.
        ``map_location`` may be a device (or device string); tensors load on
        the CPU otherwise.
        """
        where = _where(path)
        keys = top_level_keys(read_manifest(where, chunks=False))
        if "model" in keys and "state_dict" not in keys:
            raise UnsupportedStateError(
                f"{where}: this checkpoint holds sharded model and optimizer state written by "
                "ShardpointFSDPStrategy; resume it with ShardpointFSDPStrategy (on any number of ranks)"
            )
        state: dict[str, Any] = dict.fromkeys(keys)
        load(where, state, verify=self.verify, process_group=LOCAL)
        checkpoint = from_state(state)
        if map_location is not None:
            if not isinstance(map_location, (str, torch.device)):
                raise TypeError(f"map_location must be a device or device string, got {type(map_location).__name__}")
            checkpoint = _mapped(checkpoint, torch.device(map_location))
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint folder at ``path``."""
        remove_path(_where(path))


class AsyncShardpointCheckpointIO(ShardpointCheckpointIO):
    """:class:`ShardpointCheckpointIO` with asynchronous saves.

    ``save_checkpoint`` returns once the checkpoint's tensors are copied to
    host staging memory; checksums, writes and the commit run in the
    background while training goes on. A later save, any load or removal and
    ``teardown`` (at the end of ``fit``) first wait for the save in flight
    and raise its error if it failed, so a checkpoint is always complete
    before anything reads or deletes it.

    Example::

        trainer = L.Trainer(plugins=[AsyncShardpointCheckpointIO()])
    """

    def __init__(self, *, verify: bool = True) -> None:
        super().__init__(verify=verify)
        self._pending: AsyncSaveHandle | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Start writing ``checkpoint`` to ``path``; returns once its tensors are staged."""
        _no_storage_options(storage_options)
        self.wait()
        self._pending = async_save(_where(path), to_state(checkpoint), process_group=LOCAL)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Wait for the save in flight, then load as :class:`ShardpointCheckpointIO` does."""
        self.wait()
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Wait for the save in flight, then delete the checkpoint at ``path``."""
        self.wait()
        super().remove_checkpoint(path)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def teardown(self) -> None:
        """Wait for the last save; Lightning calls this when ``fit`` ends."""
        self.wait()


_LIVE = re.compile(r"model|optimizer_\d+")


class ShardpointFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with sharded checkpoints written and read by shardpoint.

    Every rank saves its own shards of the model and optimizers (no full
    state is gathered) with one collective :func:`shardpoint.save`; the rest
    of Lightning's checkpoint (loops, callbacks, schedulers) is stored beside
    them as plain values. Loading reshards, so a checkpoint saved by N ranks
    resumes on any other number. The model is stored under ``model`` and the
    optimizers under ``optimizer_0``, ``optimizer_1``, ... Takes the same
    arguments as ``FSDPStrategy``.

    Example::

        strategy = ShardpointFSDPStrategy(auto_wrap_policy={nn.Linear})
        trainer = L.Trainer(strategy=strategy, devices=2)
        trainer.fit(model, data, ckpt_path="checkpoints/last.ckpt")
    """

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: :meth:`save_checkpoint` saves the live sharded model, so no full copy is gathered."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Nothing: :meth:`save_checkpoint` saves the live sharded optimizers."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save the live sharded model and optimizers and the rest of ``checkpoint``; every rank calls this."""
        _no_storage_options(storage_options)
        path = self.broadcast(_where(filepath))
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state = to_state(rest)
        state.update(self._live())
        save(path, state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers in place on every rank; return the rest of the checkpoint."""
        path = self.broadcast(_where(checkpoint_path))
        keys = top_level_keys(read_manifest(path, chunks=False))
        live = self._live()
        state: dict[str, Any] = {k: None for k in keys if not _LIVE.fullmatch(k)}
        state.update(live)
        saved_optimizers = [k for k in keys if k.startswith("optimizer_") and _LIVE.fullmatch(k)]
        if sorted(saved_optimizers) == sorted(k for k in live if k != "model"):
            load(path, state)
        else:  # restoring the model alone (e.g. for validation): the optimizers are left out on purpose
            state = {k: v for k, v in state.items() if not k.startswith("optimizer_")}
            load(path, state, keys=[f"{k}.*" for k in state] + list(state))
        checkpoint = from_state({k: v for k, v in state.items() if not _LIVE.fullmatch(k)})
        # The optimizers are already restored; Lightning only checks that the key exists.
        checkpoint["optimizer_states"] = [None] * len(saved_optimizers)
        return checkpoint

    def _live(self) -> dict[str, Any]:
        live: dict[str, Any] = {"model": self.model}
        for i, opt in enumerate(self.optimizers):
            live[f"optimizer_{i}"] = getattr(opt, "_optimizer", opt)
        return live


def _where(path: Any) -> str:
    return os.fspath(path) if not isinstance(path, str) else path


def _no_storage_options(storage_options: Any) -> None:
    if storage_options is not None:
        raise TypeError(
            "shardpoint's CheckpointIO takes no storage_options; put storage settings in the path "
            "(e.g. s3://bucket/prefix) or the storage's environment"
        )
