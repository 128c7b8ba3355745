"""Recognising DeepSpeed objects without importing DeepSpeed, and which module belongs to which ZeRO optimizer."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

from ...errors import UnsupportedStateError

__all__ = [
    "is_deepspeed_engine",
    "is_deepspeed_optimizer",
    "is_zero_optimizer",
    "is_zero3_param",
    "zero_stage",
    "world_and_rank",
    "remember_owner",
    "owner_of",
    "unsupported",
    "GROUP_IDENTITY",
    "live_group_keys",
]


def _class(module: str, name: str):
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def is_deepspeed_engine(obj: Any) -> bool:
    """True for a ``deepspeed.DeepSpeedEngine`` (never imports DeepSpeed)."""
    cls = _class("deepspeed.runtime.engine", "DeepSpeedEngine")
    return cls is not None and isinstance(obj, cls)


def is_deepspeed_optimizer(obj: Any) -> bool:
    """True for any of DeepSpeed's optimizer wrappers (ZeRO, fp16, bf16)."""
    cls = _class("deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer")
    return cls is not None and isinstance(obj, cls)


def zero_stage(opt: Any) -> int:
    """1 or 2 for ``DeepSpeedZeroOptimizer``, 3 for the stage-3 optimizer, 0 for anything else."""
    s3 = _class("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3")
    if s3 is not None and isinstance(opt, s3):
        return 3
    s12 = _class("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")
    if s12 is not None and isinstance(opt, s12):
        return 2 if getattr(opt, "partition_gradients", False) else 1
    return 0


def is_zero_optimizer(obj: Any) -> bool:
    """True for a ZeRO optimizer of stage 1, 2 or 3 (never imports DeepSpeed)."""
    return zero_stage(obj) > 0


# Param-group keys by which DeepSpeed names a group's process groups: a MoE group's ``name`` is
# its expert-parallel group (``ep_size_2``), ``moe`` marks it. They describe the engine that
# holds the optimizer, so a load at another expert-parallel degree keeps the live ones.
GROUP_IDENTITY = frozenset({"name", "moe"})


def live_group_keys(obj: Any) -> dict[int, frozenset[str]]:
    """``id(optimizer)`` -> :data:`GROUP_IDENTITY` for each optimizer entry ``obj`` shows to have groups DeepSpeed names.

    An engine declares the optimizer it steps (``engine.optimizer``); a
    ZeRO optimizer declares itself, and so does a torch
    optimizer whose param groups are DeepSpeed MoE groups (``moe: True``, as
    ``split_params_into_different_moe_groups_for_optimizer`` makes them).

    Example::

        live_group_keys(engine)  # {id(engine.optimizer): GROUP_IDENTITY} at stage 0
    """
    if "deepspeed" not in sys.modules:
        return {}
    if is_deepspeed_engine(obj):
        obj = getattr(obj, "optimizer", None)
        stepped = isinstance(obj, torch.optim.Optimizer)
    else:
        stepped = isinstance(obj, torch.optim.Optimizer) and any(isinstance(g, dict) and g.get("moe") for g in obj.param_groups)
    if stepped or is_deepspeed_optimizer(obj):
        return {id(obj): GROUP_IDENTITY}
    return {}


def is_zero3_param(p: Any) -> bool:
    """True for a parameter ZeRO-3 has partitioned (it carries ``ds_tensor`` and ``ds_numel``)."""
    return hasattr(p, "ds_tensor") and hasattr(p, "ds_numel")


# Modules that appeared next to their ZeRO optimizer in a state (``engine.module`` used
# instead of the engine): filled when the context is built, read when adapters claim.
# Process-wide on purpose, and weak: it describes live modules, and forgets each with its module.
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def remember_owner(module: nn.Module, zopt: Any) -> None:
    """Record that ``module``'s parameters belong to the ZeRO optimizer ``zopt`` (held weakly).

    Example::

        remember_owner(engine.module, engine.optimizer)
    """
    _OWNERS[module] = zopt


def owner_of(module: Any) -> Any:
    """The ZeRO optimizer recorded for ``module`` by :func:`remember_owner`, or ``None``.

    Example::

        zopt = owner_of(engine.module)
    """
    return _OWNERS.get(module)


def world_and_rank(group=None) -> tuple[int, int]:
    """``(world size, rank)`` in ``group``; ``(1, 0)`` without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def unsupported(where: str, what: str) -> UnsupportedStateError:
    """The error for a DeepSpeed setup the adapter does not handle, naming where it was found.

    Example::

        raise unsupported("state['model']", "DeepSpeed pipeline engines are not supported")
    """
    return UnsupportedStateError(f"{where}: {what}")
