"""Rebuild a LightningModule or LightningDataModule from a loaded Lightning checkpoint dict.

The same steps as Lightning's own ``load_from_checkpoint``, applied to a
checkpoint dict that shardpoint read: the class is constructed from the
hyperparameters that ``save_hyperparameters()`` stored (keyword arguments
override them), ``configure_model`` and ``on_load_checkpoint`` run, and the
state dict loads with Lightning's rules for ``strict``. Used by
:func:`shardpoint.integrations.lightning.load_from_checkpoint`.

Example::

    model = build_from_checkpoint(MyModule, checkpoint, strict=None, overrides={"lr": 1e-3})
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import torch

from ..runtime.extras import require

require("lightning", "lightning", "shardpoint.integrations.lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.utilities.data import AttributeDict  # noqa: E402
from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402
from lightning.pytorch.utilities.parsing import parse_class_init_keys  # noqa: E402

__all__ = ["build_from_checkpoint", "TRUSTED_INSTANTIATORS"]

# Hyperparameter keys of checkpoints from Lightning before 0.8, still read by Lightning.
PAST_HPARAMS_KEYS = ("hparams", "module_arguments")

TRUSTED_INSTANTIATORS = frozenset({"lightning.pytorch.cli.instantiate_module", "pytorch_lightning.cli.instantiate_module"})
"""The instantiators (written by ``LightningCLI``) that a checkpoint may name; any other is refused."""


def build_from_checkpoint(cls: type, checkpoint: dict[str, Any], strict: bool | None, overrides: dict[str, Any]) -> Any:
    """Construct ``cls`` from ``checkpoint``'s hyperparameters and ``overrides``, then load its state.

    A LightningDataModule gets its ``load_state_dict`` called with its saved
    state, if any; a LightningModule its ``on_load_checkpoint`` and then
    ``load_state_dict(checkpoint["state_dict"], strict=...)``, where
    ``strict=None`` follows the module's ``strict_loading``.

    Example::

        model = build_from_checkpoint(MyModule, checkpoint, strict=None, overrides={})
    """
    if not (isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))):
        raise TypeError(f"load_from_checkpoint needs a LightningModule or LightningDataModule class, got {cls!r}")
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    checkpoint.setdefault(key, {})
    checkpoint[key].update(overrides)
    obj = _construct(cls, checkpoint, overrides)
    if isinstance(obj, pl.LightningDataModule):
        saved = checkpoint.get(type(obj).__qualname__)
        if saved is not None:
            obj.load_state_dict(saved)
        return obj
    chosen = getattr(obj, "_strict_loading", None)  # None: the module leaves it to the caller
    if chosen is not None and strict is not None and strict != obj.strict_loading:
        raise ValueError(
            f"load_from_checkpoint(..., strict={strict!r}) conflicts with {cls.__name__}.strict_loading="
            f"{obj.strict_loading!r}; set the same value for both"
        )
    strict = obj.strict_loading if strict is None else strict
    if is_overridden("configure_model", obj):
        obj.configure_model()
    obj.on_load_checkpoint(checkpoint)
    keys = obj.load_state_dict(checkpoint["state_dict"], strict=strict)
    if not strict and keys.missing_keys:
        warnings.warn(f"Found keys that are in the model state dict but not in the checkpoint: {keys.missing_keys}")
    if not strict and keys.unexpected_keys:
        warnings.warn(f"Found keys that are not in the model state dict but in the checkpoint: {keys.unexpected_keys}")
    state_dict = checkpoint["state_dict"]
    first = next((t for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return obj if first is None else obj.to(first.device)


def _construct(cls: type, checkpoint: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """``cls`` made from the saved hyperparameters, ``overrides`` taking precedence."""
    params = inspect.signature(cls.__init__).parameters
    self_name, args_name, kwargs_name = parse_class_init_keys(cls)
    init_names = [n for n in params if n not in (self_name, args_name, kwargs_name)]
    loaded: dict[str, Any] = {}
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    if key in checkpoint:
        if issubclass(cls, pl.LightningModule):
            for old in PAST_HPARAMS_KEYS:
                loaded.update(checkpoint.get(old, {}))
        loaded.update(checkpoint.get(key, {}))
        kind = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_TYPE)
        if kind:  # a container class (unpickled, so trusted), or in old checkpoints its name
            loaded = AttributeDict(loaded) if isinstance(kind, str) else kind(loaded)
        hparams_name = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
        if hparams_name and hparams_name in init_names:  # save_hyperparameters(hparams_object): one argument
            loaded = {hparams_name: loaded}
    kwargs = {**loaded, **overrides}
    instantiator = _instantiator(cls, kwargs.pop("_instantiator", None), kwargs.get("_class_path"))
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in init_names}
    return instantiator(cls, kwargs) if instantiator is not None else cls(**kwargs)


def _instantiator(cls: type, path: Any, class_path: Any) -> Any:
    """The ``LightningCLI`` instantiator a checkpoint names, if any, after the same checks Lightning makes."""
    if path is None:
        return None
    if not isinstance(path, str) or path not in TRUSTED_INSTANTIATORS:
        raise ValueError(
            f"the checkpoint names the instantiator {path!r}, which is not one of {sorted(TRUSTED_INSTANTIATORS)}; "
            "it was refused so that loading cannot run arbitrary code"
        )
    if class_path is not None:
        module, _, name = str(class_path).rpartition(".")
        target = getattr(sys.modules.get(module), name, None)
        if not (isinstance(target, type) and issubclass(target, cls)):
            raise ValueError(
                f"the checkpoint asks for class {class_path!r}, which is not an imported subclass of {cls.__name__}; "
                "import the module that defines it before loading"
            )
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)
