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

A fingerprint is two flat tuples: the names and devices in the graph, and
integers (identities, storage pointers, sizes, strides, dtypes by identity,
and the count of everything that follows, so two different graphs never
give the same sequence). The fingerprint is made at every save, just after
a training step has pushed these objects out of the CPU caches, and
compared with the kept one: flat tuples of integers are quicker to make and
to compare than one small tuple per tensor.
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


def _tensor_codes(t: Any, codes: list[int], objs: list) -> bool:
    """Append what identifies ``t`` and its data to ``codes`` (its device to ``objs``); False where it has no single storage to compare."""
    # A DTensor's shard, as tensors.local_shard reads it but never through to_local(): that makes a
    # new tensor at each call, so a fingerprint holding its identity would never match.
    local = getattr(t, "_local_tensor", None)
    x = t if local is None else local
    if getattr(x, "layout", None) is not _STRIDED:  # not a tensor, or sparse and other layouts
        return False
    # dtypes are interned for the life of the process: their identities are codes.
    codes += (id(t), id(local), x.data_ptr(), id(x.dtype), x.dim(), *x.shape, *x.stride())
    objs.append(x.device)
    return True


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


def _slots(d: dict, objs: list, codes: list[int]) -> bool:
    """A module's parameters or buffers: their count, names, and each tensor (``None`` coded as its identity)."""
    codes.append(len(d))
    for n, t in d.items():
        objs.append(n)
        if t is None:
            codes.append(id(None))
        elif not _tensor_codes(t, codes, objs):
            return False
    return True


def module_fingerprint(m: nn.Module) -> tuple | None:
    """What a module's saved part is built from, or ``None`` when that cannot be captured.

    Example::

        module_fingerprint(model) == module_fingerprint(model)  # True while nothing was swapped
    """
    objs: list = []
    codes: list[int] = []
    for sub in submodules(m):
        if not _known_hooks(sub) or type(sub).get_extra_state is not nn.Module.get_extra_state:
            return None
        codes += (id(sub), len(sub._modules), len(sub._non_persistent_buffers_set))
        objs.extend(sub._modules)
        objs.extend(sorted(sub._non_persistent_buffers_set))
        if not (_slots(sub._parameters, objs, codes) and _slots(sub._buffers, objs, codes)):
            return None
    return tuple(objs), tuple(codes)


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
    state = {id(p): st for p, st in opt.state.items()}  # by identity: a tensor's __hash__ is a Python call
    param_names = ctx.param_names
    objs: list = []
    codes: list[int] = [len(opt.param_groups)]
    for g in opt.param_groups:
        if any(_tensor_inside(v) for k, v in g.items() if k != "params"):
            return None
        objs.append(tuple(sorted(k for k in g if k != "params")))
        params = g["params"]
        codes.append(len(params))
        for p in params:
            st = state.get(id(p)) or {}
            codes += (id(p), len(st))
            objs.append(param_names.get(id(p)))
            for k, v in st.items():
                objs.append(k)
                if not _tensor_codes(v, codes, objs):  # a non-tensor state value may change every step
                    return None
    return tuple(objs), tuple(codes)


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
