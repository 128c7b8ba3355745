"""DeepSpeed MoE layers: their local experts as :class:`~shardpoint.adapters.experts.Experts` rules.

DeepSpeed keeps a layer's local experts in ``<...>.deepspeed_experts`` and
tags their parameters with the expert-parallel group it made for the layer;
:func:`deepspeed_expert_rules` turns each such list into a rule, so experts
are stored at their global index in plain modules and ZeRO engines alike.
Example::

    rules = deepspeed_expert_rules({"model": model_with_deepspeed_moe})
"""

from __future__ import annotations

from typing import Any, Mapping

import torch.distributed as dist
from torch import nn

from ..experts import Experts
from ..module import unwrap_module
from .detect import is_deepspeed_engine

__all__ = ["deepspeed_expert_rules", "expert_groups_made"]


def expert_groups_made() -> bool:
    """Whether DeepSpeed made any expert-parallel group in this process (every rank makes them together).

    Without one no expert list can be found, so a save need not look for them.

    Example::

        expert_groups_made()  # False before the first MoE layer is built
    """
    try:
        from deepspeed.utils import groups
    except ImportError:
        return False
    return bool(groups._get_expert_parallel_group_dict())


def deepspeed_expert_rules(state: Mapping[str, Any]) -> list[Experts]:
    """An :class:`Experts` rule for every DeepSpeed MoE expert list in the state's modules.

    DeepSpeed keeps a layer's local experts in ``<...>.deepspeed_experts``
    and tags their parameters with the name of the expert-parallel group
    it created for the layer (``group_name``), from which the EP group and
    the number of global experts follow.

    Example::

        rules = deepspeed_expert_rules({"model": model_with_deepspeed_moe})
    """
    rules: list[Experts] = []
    for key, obj in state.items():
        if not isinstance(obj, nn.Module):
            continue
        if is_deepspeed_engine(obj):  # named as its module's own tensors
            obj = obj.module
        for name, mod in unwrap_module(obj).named_modules():
            local = getattr(mod, "deepspeed_experts", None)
            if not isinstance(local, nn.ModuleList) or not type(mod).__module__.startswith("deepspeed."):
                continue
            group = _deepspeed_group(mod)
            if group is None:
                continue
            prefix = f"{key}.{name}.deepspeed_experts" if name else f"{key}.deepspeed_experts"
            rules.append(Experts(prefix, len(local) * dist.get_world_size(group), group))
    return rules


def _deepspeed_group(mod: nn.Module) -> Any:
    """The expert-parallel group DeepSpeed made for an expert list, or ``None`` before it made one."""
    name = next((getattr(p, "group_name", None) for p in mod.parameters()), None)
    if name is None:
        return None
    try:
        from deepspeed.utils import groups
    except ImportError:
        return None
    table = groups._get_expert_parallel_group_dict()
    return table.get(name)
