"""Fingerprints of module and optimizer entries, so a repeated save can reuse their parts.

An asynchronous save's blocking call is mostly the adapter walk: every
module tensor and optimizer state tensor becomes a :class:`SaveTensor`
(geometry, a local view, a value document). Between two checkpoints of one
training run none of that changes: the same parameter objects hold the same
storage, and the optimizer state tensors are updated in place. The adapters
of modules and optimizers therefore give a fingerprint of everything their
part is built from (:meth:`~shardpoint.adapters.Adapter.fingerprint`), and
the saver's cache (:class:`~shardpoint.saving.reuse.SaveCache`) reuses the
part while the fingerprint is unchanged.

The fingerprint is the object graph and the names in it: every submodule
(by identity) with the names of its children, its parameter and buffer
objects (by identity, with their names), each tensor's storage pointer, shape,
strides and dtype (a ``param.data = ...`` swap keeps the object but changes
these), the optimizer's parameter list, the parameters' names and the
identity of every state tensor. Whatever the graph does not capture gives no
fingerprint, and the entry goes through its adapter every time: a non-tensor
optimizer state value, tensors inside hyper-parameters, extra state,
state-dict hooks other than FSDP2's reshard hook, and optimizers over
FSDP1, DeepSpeed or Megatron parameters (views and shards in the context).
Optimizer hyper-parameters (``lr`` changes every step under a scheduler) are
encoded afresh at every reuse (:func:`refresh_groups`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..format.values import encode_value
from .base import AdapterContext, SavePart
from .graph import submodules

__all__ = ["module_fingerprint", "optimizer_fingerprint", "refresh_groups"]

_STRIDED = torch.strided


def _tensor_fp(t: Any) -> tuple | None:
    local = getattr(t, "_local_tensor", None)  # a DTensor's shard
    if local is not None:
        x = local
    elif isinstance(t, torch.Tensor):
        x = t
    else:
        return None
    if getattr(x, "layout", None) is not _STRIDED:  # sparse and other layouts have no single storage to compare
        return None
    return (id(t), id(local), x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)


def _known_hooks(sub: nn.Module) -> bool:
    """Only FSDP2's hook, which reshards parameters before ``state_dict``.

    When the parameters are sharded (always so after a full training step)
    the hook changes nothing; when they are not, the registered parameter
    objects differ from the sharded ones cached, so the fingerprint misses
    and the full walk runs through ``state_dict`` and its hook.
    """
    if sub._state_dict_hooks:
        return False
    for h in sub._state_dict_pre_hooks.values():
        name = getattr(h, "__qualname__", "")
        if not (name.endswith("to_sharded_hook") and "FSDP" in name):
            return False
    return True


def module_fingerprint(m: nn.Module) -> tuple | None:
    """What a module's saved part is built from, or ``None`` when that cannot be captured.

    Example::

        module_fingerprint(model) == module_fingerprint(model)  # True while nothing was swapped
    """
    out = []
    for sub in submodules(m):
        if not _known_hooks(sub) or type(sub).get_extra_state is not nn.Module.get_extra_state:
            return None
        ps = tuple((n, _tensor_fp(p)) for n, p in sub._parameters.items())
        bs = tuple((n, _tensor_fp(b)) for n, b in sub._buffers.items())
        out.append((id(sub), tuple(sub._modules), ps, bs, frozenset(sub._non_persistent_buffers_set)))
    return tuple(out)


def _tensor_inside(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_tensor_inside(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_tensor_inside(x) for x in v)
    return False


def optimizer_fingerprint(opt: torch.optim.Optimizer, ctx: AdapterContext) -> tuple | None:
    """What an optimizer's saved part is built from (hyper-parameter values excepted), or ``None``.

    Example::

        optimizer_fingerprint(opt, ctx)
    """
    if ctx.views or ctx.shards:
        return None  # FSDP1, DeepSpeed or Megatron parameters: state split through the context
    out = []
    for g in opt.param_groups:
        if any(_tensor_inside(v) for k, v in g.items() if k != "params"):
            return None
        ids = []
        for p in g["params"]:
            st = []
            for k, v in (opt.state.get(p) or {}).items():
                fp = _tensor_fp(v)
                if fp is None:  # a non-tensor state value may change every step
                    return None
                st.append((k, fp))
            ids.append((id(p), ctx.param_names.get(id(p)), tuple(st)))
        out.append((tuple(sorted(k for k in g if k != "params")), tuple(ids)))
    return tuple(out)


def refresh_groups(key: str, opt: torch.optim.Optimizer, part: SavePart, ctx: AdapterContext) -> SavePart:
    """``part`` with the optimizer's hyper-parameters as they are now.

    Example::

        part = refresh_groups("optim", opt, kept, ctx)
    """
    def no_tensor(fqn, t):
        raise ValueError(f"{fqn}: a tensor appeared inside the hyper-parameters")

    groups = []
    for gi, g in enumerate(opt.param_groups):
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append(encode_value(hyper, f"{key}.groups.{gi}", no_tensor, ctx.allow_pickle))
    return SavePart(part.tensors, {**part.value, "groups": groups}, part.framework)
