"""What a load asks of the objects in the state before their adapters build targets.

The load transaction stays free of framework specifics: Megatron's global
shapes and modules on the ``meta`` device are handled here; how a saved
value is read (the optimizer's naming views) is each adapter's
:meth:`~shardpoint.adapters.Adapter.read_value`.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

import torch
from torch import nn

from .megatron import is_megatron, megatron_global_shapes
from .module import unwrap_module

__all__ = ["physical_shapes", "materialize_meta"]


def physical_shapes(state: Mapping[str, Any]) -> dict[str, tuple]:
    """Global shapes of the modules' tensors by name, as layout rules see the target.

    Example::

        physical_shapes({"model": nn.Linear(2, 3)})  # {'model.weight': (3, 2), 'model.bias': (3,)}
    """
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
    """Give modules on the ``meta`` device real (uninitialised) CPU storage to load into.

    Example::

        materialize_meta({"model": model_built_under_torch_device_meta})
    """
    for obj in state.values():
        if isinstance(obj, nn.Module):
            m = unwrap_module(obj)
            if any(t.is_meta for t in m.parameters()) or any(t.is_meta for t in m.buffers()):
                m.to_empty(device=torch.device("cpu"))
