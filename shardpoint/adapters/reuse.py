"""Reusing what adapters produced for the previous save of the same objects.

An asynchronous save's blocking call is mostly the adapter walk: every
module tensor and optimizer state tensor becomes a :class:`SaveTensor`
(geometry, a local view, a value document). Between two checkpoints of one
training run none of that changes: the same parameter objects hold the same
storage, and the optimizer state tensors are updated in place. So the
:class:`SavePart` of a module or optimizer entry is kept, together with a
fingerprint of everything it was built from, and reused when the fingerprint
still matches.

The fingerprint is the object graph, not names: every submodule's parameter
and buffer objects (by identity), each tensor's storage pointer, shape,
strides and dtype (a ``param.data = ...`` swap keeps the object but changes
these), the optimizer's parameter list and the identity of every state
tensor. Anything else (a non-tensor optimizer state value, tensors inside
hyper-parameters, extra state, state-dict hooks other than FSDP2's
reshard hook, FSDP1/DeepSpeed/Megatron views) is not reused: those entries go through their adapter every time.
Optimizer hyper-parameters (``lr`` changes every step under a scheduler) are
always encoded afresh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..format.values import encode_value
from .base import Adapter, AdapterContext, SavePart
from .module import unwrap_module

__all__ = ["PartCache"]


def _tensor_fp(t: Any) -> tuple | None:
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", None)  # a DTensor's shard
    x = local if local is not None else t
    if x.layout is not _STRIDED:  # sparse and other layouts have no single storage to compare
        return None
    return (id(t), id(local), x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)


_STRIDED = torch.strided


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


def _module_fp(m: nn.Module) -> tuple | None:
    out = []
    for sub in m.modules():
        if not _known_hooks(sub) or type(sub).get_extra_state is not nn.Module.get_extra_state:
            return None
        ps = tuple((n, _tensor_fp(p)) for n, p in sub._parameters.items())
        bs = tuple((n, _tensor_fp(b)) for n, b in sub._buffers.items())
        out.append((id(sub), len(sub._modules), ps, bs, frozenset(sub._non_persistent_buffers_set)))
    return tuple(out)


def _optimizer_fp(opt: torch.optim.Optimizer, ctx: AdapterContext) -> tuple | None:
    out = []
    for g in opt.param_groups:
        ids = []
        for p in g["params"]:
            s = opt.state.get(p)
            st = []
            for k, v in (s or {}).items():
                fp = _tensor_fp(v)
                if fp is None:  # a non-tensor state value may change every step
                    return None
                st.append((k, fp))
            ids.append((id(p), ctx.param_names.get(id(p)), tuple(st)))
        out.append((tuple(sorted(k for k in g if k != "params")), tuple(ids)))
    return tuple(out)


def _ctx_key(ctx: AdapterContext) -> tuple:
    return (ctx.rank, ctx.world, ctx.allow_pickle, tuple(sorted(ctx.replicas.items())))


class PartCache:
    """Save parts of module and optimizer entries, reused while their fingerprint holds.

    One instance per :class:`~shardpoint.AsyncSaver`; it holds references to
    the saved objects' tensors only through the cached parts.
    """

    def __init__(self) -> None:
        self._parts: dict[str, tuple] = {}
        self._ctx: tuple | None = None
        self._checked: dict[str, SavePart] = {}  # modules validated by context() this round
        self.hits = 0

    def context(self, state, rank: int, world: int, allow_pickle: bool, replicated_over: Any) -> AdapterContext | None:
        """The previous save's context, if the state holds the same objects and no module changed.

        The context (parameter names, views, replica groups) is derived from
        the modules alone, so it is reused only when every module and
        optimizer entry still matches its cached part; anything else in the
        state must be a plain value (no framework object that build_context
        inspects).
        """
        self._checked = {}
        c = self._ctx
        ids = tuple((k, id(v)) for k, v in state.items())
        if c is None or c[0] != ids or c[1] != (rank, world, allow_pickle) or c[2] is not replicated_over:
            return None
        ctx = c[3]
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                hit = self._matching(key, obj, ctx)
                if hit is None or hit[2] != "module":
                    return None
                self._checked[key] = hit[4]
            elif isinstance(obj, torch.optim.Optimizer) and key not in self._parts:
                return None
        return ctx

    def remember_context(self, state, rank: int, world: int, allow_pickle: bool, replicated_over: Any, ctx: AdapterContext) -> None:
        """Keep ``ctx`` for :meth:`context`; holds a reference to ``replicated_over`` so its id stays unique."""
        self._ctx = (tuple((k, id(v)) for k, v in state.items()), (rank, world, allow_pickle), replicated_over, ctx)

    def get(self, key: str, obj: Any, ctx: AdapterContext) -> SavePart | None:
        """The part saved last time for ``state[key]``, if nothing it depends on changed."""
        if key in self._checked:
            self.hits += 1
            return self._checked.pop(key)
        hit = self._matching(key, obj, ctx)
        if hit is None:
            return None
        kind, part = hit[2], hit[4]
        if kind == "module":
            self.hits += 1
            return part
        groups = []
        for gi, g in enumerate(obj.param_groups):
            hyper = {k: v for k, v in g.items() if k != "params"}

            def no_tensor(f, t):
                raise _NotReusable

            try:
                groups.append(encode_value(hyper, f"{key}.groups.{gi}", no_tensor, ctx.allow_pickle))
            except _NotReusable:
                return None
        self.hits += 1
        value = dict(part.value)
        value["groups"] = groups
        return SavePart(part.tensors, value, part.framework)

    def _matching(self, key: str, obj: Any, ctx: AdapterContext) -> tuple | None:
        """The cache entry of ``state[key]`` if it was built from ``obj`` as it is now."""
        hit = self._parts.get(key)
        if hit is None or hit[0] is not obj or hit[1] != _ctx_key(ctx):
            return None
        fp = _module_fp(unwrap_module(obj)) if hit[2] == "module" else _optimizer_fp(obj, ctx)
        return hit if fp == hit[3] else None

    def put(self, key: str, obj: Any, adapter: Adapter, part: SavePart, ctx: AdapterContext) -> None:
        """Remember ``part`` for ``state[key]`` when the entry is of a reusable kind."""
        self._parts.pop(key, None)
        name = adapter.name
        if name == "module" and isinstance(obj, nn.Module) and not part.value:
            fp = _module_fp(unwrap_module(obj))
            kind = "module"
        elif name == "optimizer" and isinstance(obj, torch.optim.Optimizer) and not ctx.views and not getattr(ctx, "shards", None):
            fp = _optimizer_fp(obj, ctx)
            kind = "optimizer"
            if fp is not None and any(".groups." in t.fqn for t in part.tensors):
                fp = None  # tensors inside hyper-parameters
        else:
            return
        if fp is not None:
            self._parts[key] = (obj, _ctx_key(ctx), kind, fp, part)


class _NotReusable(Exception):
    pass
