"""What a load asks of the objects in the state before their adapters build targets.

The load transaction stays free of framework specifics: the optimizer's
naming views (a document keyed the way ``get_optimizer_state_dict`` keys
it, or by logical names under layout rules), Megatron's global shapes and
modules on the ``meta`` device are handled here.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Sequence

import torch
from torch import nn

from .dcp_names import dcp_to_native, is_dcp_optimizer_doc
from ..format.values import check_optimizer_doc
from ..layouts import optimizer_doc_to_physical
from .base import AdapterContext
from .megatron import is_megatron, megatron_global_shapes
from .module import unwrap_module
from .optimizer import own_protocol

__all__ = ["param_names", "physical_shapes", "materialize_meta", "native_doc"]


def param_names(opt: torch.optim.Optimizer, ctx: AdapterContext) -> list[str]:
    """The state names of ``opt``'s parameters (those a module in the state owns).

    Example::

        param_names(opt, build_context(state, 0, 1, False))  # ['model.w', 'model.b']
    """
    names = (ctx.param_names.get(id(p)) for g in opt.param_groups for p in g["params"])
    return [n for n in names if n is not None]


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


def native_doc(key: str, obj: Any, doc: Any, ctx: AdapterContext, layouts: Sequence[Any], where: str) -> Any:
    """The saved value document of ``key`` as ``obj``'s adapter reads it.

    A torch optimizer's document keyed the way ``get_optimizer_state_dict``
    keys it (state by the model's parameter names) is viewed in the
    optimizer's own naming; under layout rules its logical names become the
    target's physical ones. Every other document is returned unchanged.

    Example::

        doc = native_doc("optimizer", opt, manifest.values.get("optimizer"), ctx, (), "ckpt")
    """
    if not (isinstance(obj, torch.optim.Optimizer) and not own_protocol(type(obj))):
        return doc
    if is_dcp_optimizer_doc(doc):
        # Keyed the way get_optimizer_state_dict keys it: a naming view onto this optimizer.
        doc = dcp_to_native(doc, param_names(obj, ctx), where)
    if layouts:
        check_optimizer_doc(doc, f"{where}: entry {key!r}")
        doc = optimizer_doc_to_physical(key, doc, layouts, ctx.param_names.values())
    return doc
