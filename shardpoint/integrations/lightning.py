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

import inspect
import os
import re
from typing import Any

import torch

from ..api import load, read_manifest, save
from ..saving.handle import AsyncSaveHandle
from ..saving.async_save import async_save
from ..engine.inflight import saving, wait_for_saves
from ..errors import CheckpointNotFoundError, FormatError, IncompleteCheckpointError, UnsupportedStateError
from ..dist import LOCAL
from ..runtime.extras import require
from ..format.values import encode_value
from .common import remove_path, top_level_keys
from .file_checkpoints import is_local_file, is_remote_file, load_torch_file, remove_remote_file, replace_file
from .hparams import decode_plain, encode_plain

require("lightning", "lightning", "shardpoint.integrations.lightning")
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.pytorch.core.saving import load_hparams_from_tags_csv, load_hparams_from_yaml  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402
from lightning.pytorch.utilities.migration import migrate_checkpoint  # noqa: E402

from .lightning_build import build_from_checkpoint  # noqa: E402

__all__ = [
    "ShardpointCheckpointIO",
    "AsyncShardpointCheckpointIO",
    "ShardpointFSDPStrategy",
    "load_from_checkpoint",
    "to_state",
    "from_state",
]

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


def _target_device(map_location: Any) -> torch.device | None:
    """Where tensors read on the CPU go: ``map_location`` as ``torch.load`` reads it, for CPU tensors."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device, int)):
        return torch.device(map_location)
    if isinstance(map_location, dict):  # {saved location: target}; shardpoint's tensors come from the CPU
        target = map_location.get("cpu", map_location.get(torch.device("cpu")))
        return None if target is None else torch.device(target)
    if callable(map_location):  # called as torch.load calls it, with a CPU storage
        moved = map_location(torch.UntypedStorage(0), "cpu")
        return None if moved is None else torch.device(moved.device)
    raise TypeError(f"map_location must be a device, a device string, a dict or a callable, got {type(map_location).__name__}")


HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
PLAIN_TYPES = "numbers, strings, lists, dicts, pathlib paths, Enum members, dataclasses of these, torch.device or torch.dtype"


def encode_checkpoint(checkpoint: dict[Any, Any], allow_pickle: bool, plugin: str) -> dict[Any, Any]:
    """``checkpoint`` with hyperparameter types stored safely (see :mod:`shardpoint.integrations.hparams`).

    Without ``allow_pickle``, a hyperparameter that still needs pickle raises
    :class:`~shardpoint.errors.UnsupportedStateError` naming it and both
    fixes, before anything is written.

    Example::

        encode_checkpoint({"hyper_parameters": {"root": Path("/data")}}, False, "ShardpointCheckpointIO")
    """
    out = {k: encode_plain(v, str(k)) for k, v in checkpoint.items()}
    if not allow_pickle:
        for key in HPARAMS_KEYS:
            for name, value in (out.get(key) or {}).items():
                _check_hparam(key, name, value, plugin)
    return out


def _check_hparam(key: str, name: Any, value: Any, plugin: str) -> None:
    try:
        encode_value(value, f"{key}.{name}", lambda *_: None)
    except UnsupportedStateError as e:
        what = str(e).split(";", 1)[0]  # "cannot encode <type> at '<where>' safely"
        raise UnsupportedStateError(
            f"hyperparameter {name!r} (saved by save_hyperparameters()) cannot be stored without pickle: {what}. "
            f"Either make it a plain type ({PLAIN_TYPES}), or, if this checkpoint will only be loaded where it is "
            f"trusted, create the plugin as {plugin}(allow_pickle=True). A module or other object that needs no "
            f"saving can also be left out: save_hyperparameters(ignore=[{name!r}])"
        ) from None


def _drain_async_wrapper() -> None:
    """Wait for the saves that Lightning's ``AsyncCheckpointIO`` queued, when it wraps this plugin and is the caller.

    That wrapper runs saves on its own thread and passes removals and
    loads straight through, so a removal could otherwise overtake the save
    of the same path still waiting in its queue (leaving a checkpoint that
    ``ModelCheckpoint`` believes deleted). Its queue runs in order, so once
    a no-op submitted now has run, every earlier save has finished.
    """
    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame is not None else None
        for _ in range(6):
            if f is None:
                return
            owner = f.f_locals.get("self")
            if isinstance(owner, AsyncCheckpointIO):
                executor = getattr(owner, "_executor", None)
                if executor is not None:
                    executor.submit(lambda: None).result()
                return
            f = f.f_back
    finally:
        del frame


def _pickle_allowed(allow_pickle: bool, weights_only: bool | None) -> bool:
    # weights_only=False is the caller's own opt-in (Trainer.fit(..., weights_only=False)); True always refuses.
    return weights_only is False or (allow_pickle and weights_only is not True)


class ShardpointCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves and loads checkpoints with shardpoint.

    ``verify`` checks every checksum on load (the default). The save runs on
    the calling rank alone, so Lightning's rank-0-only saves under DDP never
    wait on the other ranks. Hyperparameters of common types (paths, Enum
    members, dataclasses, ``torch.device``, ``torch.dtype``) are stored
    without pickle; ``allow_pickle=True`` lets everything else be pickled
    (and unpickled on load, and lets ordinary torch checkpoint files load
    with ``weights_only=False``): use it only for checkpoints you trust.

    Example::

        trainer = L.Trainer(strategy="ddp", plugins=[ShardpointCheckpointIO()])
    """

    def __init__(self, *, verify: bool = True, allow_pickle: bool = False) -> None:
        super().__init__()
        self.verify = verify
        self.allow_pickle = allow_pickle

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to the folder ``path``, replacing what was there (a checkpoint or a file) atomically."""
        _no_storage_options(storage_options)
        where = _where(path)
        state = to_state(encode_checkpoint(checkpoint, self.allow_pickle, type(self).__name__))
        wait_for_saves(where)  # an asynchronous save of this path, from any plugin, commits first
        with saving(where):  # removal and loads of this path wait for this save
            if is_local_file(where):
                replace_file(where, lambda folder: save(folder, state, process_group=LOCAL, allow_pickle=self.allow_pickle))
            else:
                save(where, state, process_group=LOCAL, allow_pickle=self.allow_pickle)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the whole checkpoint at ``path`` on this rank, verifying checksums.

        A save of ``path`` still running in this process (from any plugin)
        is waited for first. An ordinary torch checkpoint file (what
        Lightning's default ``TorchCheckpointIO`` wrote) loads too, with
        ``torch.load(weights_only=True)`` unless pickle is allowed, so a run
        resumes after switching plugins. ``weights_only=False`` from the
        caller allows pickle for this load; ``True`` refuses it.
        ``map_location`` is applied as ``torch.load`` applies it; shardpoint
        reads tensors on the CPU.
        """
        where = _where(path)
        _drain_async_wrapper()
        wait_for_saves(where)
        pickle_ok = _pickle_allowed(self.allow_pickle, weights_only)
        if is_local_file(where):
            return load_torch_file(where, map_location=map_location, allow_pickle=pickle_ok)
        try:
            keys = top_level_keys(read_manifest(where, chunks=False))
        except (CheckpointNotFoundError, IncompleteCheckpointError) as e:
            if is_remote_file(where):  # a torch checkpoint file in object storage
                return load_torch_file(where, map_location=map_location, allow_pickle=pickle_ok)
            if isinstance(e, IncompleteCheckpointError):
                raise
            raise CheckpointNotFoundError(  # worded as Lightning's own CheckpointIO words it
                f"Checkpoint file not found: {where} (neither a shardpoint checkpoint folder nor a checkpoint file)"
            ) from None
        if "model" in keys and "state_dict" not in keys:
            raise UnsupportedStateError(
                f"{where}: this checkpoint holds sharded model and optimizer state written by "
                "ShardpointFSDPStrategy; resume it with ShardpointFSDPStrategy (on any number of ranks)"
            )
        state: dict[str, Any] = dict.fromkeys(keys)
        try:
            load(where, state, verify=self.verify, process_group=LOCAL, allow_pickle=pickle_ok)
        except FormatError as e:
            if pickle_ok or "pickled value" not in str(e):
                raise
            raise FormatError(
                f"{where}: this checkpoint holds values saved with pickle (it was saved with allow_pickle=True); "
                f"if you trust it, load it with {type(self).__name__}(allow_pickle=True), Trainer.fit(..., "
                "weights_only=False) or load_from_checkpoint(..., weights_only=False)"
            ) from None
        checkpoint = decode_plain(from_state(state), pickle_ok, where)
        device = _target_device(map_location)
        return checkpoint if device is None else _mapped(checkpoint, device)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``, once a save of it still running in this process has finished."""
        where = _where(path)
        _drain_async_wrapper()
        wait_for_saves(where)
        remove_path(where)
        if is_remote_file(where):  # object storage keeps a file and a folder of one name side by side
            remove_remote_file(where)


class AsyncShardpointCheckpointIO(ShardpointCheckpointIO):
    """:class:`ShardpointCheckpointIO` with asynchronous saves.

    ``save_checkpoint`` returns once the checkpoint's tensors are copied to
    host staging memory; checksums, writes and the commit run in the
    background while training goes on. A later save, any load or removal and
    ``teardown`` (at the end of ``fit``) first wait for the save in flight
    and raise its error if it failed, so a checkpoint is always complete
    before anything reads or deletes it. A load of the same path from any
    other plugin in the process (a new ``Trainer`` resuming) waits too.
    A save over an existing regular file runs synchronously.

    Example::

        trainer = L.Trainer(plugins=[AsyncShardpointCheckpointIO()])
    """

    def __init__(self, *, verify: bool = True, allow_pickle: bool = False) -> None:
        super().__init__(verify=verify, allow_pickle=allow_pickle)
        self._pending: AsyncSaveHandle | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Start writing ``checkpoint`` to ``path``; returns once its tensors are staged."""
        _no_storage_options(storage_options)
        self.wait()
        where = _where(path)
        if is_local_file(where):  # replacing an old single-file checkpoint: once, synchronously
            super().save_checkpoint(checkpoint, path)
            return
        state = to_state(encode_checkpoint(checkpoint, self.allow_pickle, type(self).__name__))
        wait_for_saves(where)
        self._pending = async_save(where, state, process_group=LOCAL, allow_pickle=self.allow_pickle)

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

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle

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
        state = to_state(encode_checkpoint(rest, self.allow_pickle, type(self).__name__))
        state.update(self._live())
        save(path, state, allow_pickle=self.allow_pickle)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers in place on every rank; return the rest of the checkpoint."""
        path = self.broadcast(_where(checkpoint_path))
        keys = top_level_keys(read_manifest(path, chunks=False))
        live = self._live()
        state: dict[str, Any] = {k: None for k in keys if not _LIVE.fullmatch(k)}
        state.update(live)
        saved_optimizers = [k for k in keys if k.startswith("optimizer_") and _LIVE.fullmatch(k)]
        if sorted(saved_optimizers) == sorted(k for k in live if k != "model"):
            load(path, state, allow_pickle=self.allow_pickle)
        else:  # restoring the model alone (e.g. for validation): the optimizers are left out on purpose
            state = {k: v for k, v in state.items() if not k.startswith("optimizer_")}
            load(path, state, keys=[f"{k}.*" for k in state] + list(state), allow_pickle=self.allow_pickle)
        checkpoint = decode_plain(from_state({k: v for k, v in state.items() if not _LIVE.fullmatch(k)}), self.allow_pickle, path)
        # The optimizers are already restored; Lightning only checks that the key exists.
        checkpoint["optimizer_states"] = [None] * len(saved_optimizers)
        return checkpoint

    def _live(self) -> dict[str, Any]:
        live: dict[str, Any] = {"model": self.model}
        for i, opt in enumerate(self.optimizers):
            live[f"optimizer_{i}"] = getattr(opt, "_optimizer", opt)
        return live


def load_from_checkpoint(
    cls: type,
    path: Any,
    map_location: Any = None,
    strict: bool | None = None,
    *,
    hparams_file: Any = None,
    weights_only: bool | None = None,
    verify: bool = True,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for a checkpoint that shardpoint saved (or a torch checkpoint file).

    Lightning's own semantics: ``cls`` (a ``LightningModule`` or
    ``LightningDataModule`` class) is constructed from the hyperparameters
    that ``save_hyperparameters()`` stored, ``kwargs`` overriding them;
    ``hparams_file`` (``.yaml`` or ``.csv``) replaces the stored ones.
    For a module, ``configure_model`` (if overridden) and
    ``on_load_checkpoint(checkpoint)`` run, then the state dict loads with
    ``strict`` (``None`` follows the module's ``strict_loading``). The model
    ends on the device of its loaded tensors: the CPU, or ``map_location``.
    ``weights_only=False`` allows pickled values (only for a checkpoint you
    trust). A save of ``path`` still running in this process is waited for.

    Example::

        model = load_from_checkpoint(MyModule, "runs/checkpoints/epoch=1-step=16.ckpt")
        model.eval()
    """
    io = ShardpointCheckpointIO(verify=verify)
    checkpoint = io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
    if "pytorch-lightning_version" in checkpoint:  # upgrade a file written by an older Lightning, as Lightning does
        checkpoint = migrate_checkpoint(checkpoint)[0]
    if hparams_file is not None:
        ext = str(hparams_file).rsplit(".", 1)[-1].lower()
        if ext not in ("csv", "yml", "yaml"):
            raise ValueError(f"hparams_file must be a .csv, .yml or .yaml file, got {hparams_file!r}")
        read = load_hparams_from_tags_csv if ext == "csv" else load_hparams_from_yaml
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = read(hparams_file)
    return build_from_checkpoint(cls, checkpoint, strict, kwargs)


def _where(path: Any) -> str:
    return os.fspath(path) if not isinstance(path, str) else path


def _no_storage_options(storage_options: Any) -> None:
    if storage_options is not None:
        raise TypeError(
            "shardpoint's CheckpointIO takes no storage_options; put storage settings in the path "
            "(e.g. s3://bucket/prefix) or the storage's environment"
        )
