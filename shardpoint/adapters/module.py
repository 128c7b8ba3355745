"""``nn.Module`` state: plain modules, DDP, FSDP2 (``fully_shard``, HSDP) and DTensor TP.

All of these expose their shards through ``state_dict()``: DDP wraps a plain
module, FSDP2 and ``parallelize_module`` leave DTensor parameters whose
placements say where each local shard sits. Names are the unwrapped module's
names, so a checkpoint taken under DDP loads into FSDP2 and back.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch
from torch import nn

from ..errors import IncompleteStateError, UnsupportedStateError
from ..format.values import decode_value, encode_value
from .base import Adapter, AdapterContext, ContextFacts, LoadPart, SavePart
from .reuse import module_fingerprint
from .landing import alias_key, live_storages, local_of, module_tensors, same_bits, storage_of, unlanded
from .tensors import is_dtensor, load_target, save_tensor

__all__ = ["ModuleAdapter", "unwrap_module", "module_framework", "protocol_prefixes"]


def unwrap_module(m: nn.Module) -> nn.Module:
    """Strip wrappers that only prefix names (DDP, ``torch.compile``)."""
    while True:
        if isinstance(m, nn.parallel.DistributedDataParallel):
            m = m.module
        elif hasattr(m, "_orig_mod") and isinstance(getattr(m, "_orig_mod"), nn.Module):
            m = m._orig_mod
        else:
            return m


def module_framework(m: nn.Module) -> str:
    """A short name for the save-time layout of a module (information only)."""
    if isinstance(m, nn.parallel.DistributedDataParallel):
        return "ddp"
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

        if isinstance(m, FSDP1) or any(isinstance(x, FSDP1) for x in m.modules()):
            return "fsdp1"
    except ImportError:  # pragma: no cover
        pass
    u = unwrap_module(m)
    fsdp2 = any(type(x).__name__.startswith("FSDP") for x in u.modules())
    dt = any(is_dtensor(p) for p in u.parameters())
    if fsdp2:
        return "fsdp2"
    if dt:
        return "dtensor"
    return "module"


# Load hooks that torch's own parallelisms register and that a fill in place already honours:
# FSDP2 reshards before loading (``to_sharded_hook``) and re-points its sharded parameter after
# loading (a lambda made in ``FSDPParam.__init__``); neither changes what the values are.
_KNOWN_LOAD_HOOKS = frozenset({
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam.__init__.<locals>.<lambda>"),
})


def _hook_name(h: Any) -> tuple[str, str]:
    fn = getattr(h, "hook", h)  # pre-hooks are stored wrapped (torch's _WrappedHook)
    return getattr(fn, "__module__", "") or "", getattr(fn, "__qualname__", "") or ""


def _own_load(sub: nn.Module, root: bool) -> bool:
    """Whether ``sub`` declares its own way of loading: an override, or a hook torch does not own.

    Overriding ``_load_from_state_dict`` (or ``load_state_dict`` on the root,
    the only place torch calls it) or registering a load pre- or post-hook is
    the module's declaration that loading is more than copying values into
    its tensors; its entries then go through ``load_state_dict``.
    """
    cls = type(sub)
    if cls._load_from_state_dict is not nn.Module._load_from_state_dict:
        return True
    if root and cls.load_state_dict is not nn.Module.load_state_dict:
        return True
    for hooks in (sub._load_state_dict_pre_hooks, sub._load_state_dict_post_hooks):
        for h in hooks.values():
            if _hook_name(h) not in _KNOWN_LOAD_HOOKS:
                return True
    return False


def protocol_prefixes(m: nn.Module) -> tuple[str, ...]:
    """State-dict name prefixes of the submodules of ``m`` that load their own way (``""``: all of ``m``)."""
    out = []
    for name, sub in m.named_modules():
        if _own_load(sub, sub is m):
            if not name:
                return ("",)
            out.append(name + ".")
    return tuple(out)


class ModuleAdapter(Adapter):
    """Modules: in place where the state dict's tensors are the live ones, ``load_state_dict`` elsewhere.

    A state-dict entry that aliases a parameter or buffer (same storage,
    offset, shape, strides and placements) is filled in place: that is what
    ``load_state_dict`` would copy into, minus the copy. Every other entry
    (a copy made by a state-dict hook, a tensor of a module that overrides
    ``_load_from_state_dict`` or registers load hooks) is read into a fresh
    tensor shaped like the state dict's own, DTensors keeping their mesh and
    placements, and handed to ``module.load_state_dict``; afterwards the
    state dict is taken again to prove that the values arrived.
    """

    name = "module"

    def claims(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module)

    def _check(self, key: str, m: nn.Module) -> nn.Module:
        fw = module_framework(m)
        if fw == "fsdp1":
            raise UnsupportedStateError(
                f"state[{key!r}] is wrapped in FSDP1 (FullyShardedDataParallel); FSDP1 flat "
                "parameters are not supported yet, use fully_shard (FSDP2)"
            )
        return unwrap_module(m)

    def save(self, key: str, obj: nn.Module, ctx: AdapterContext) -> SavePart:
        fw = module_framework(obj)
        m = self._check(key, obj)
        part = SavePart(framework=fw)
        extra = {}
        sd = m.state_dict()
        for name, t in sd.items():
            fqn = f"{key}.{name}"
            if isinstance(t, torch.Tensor):
                st = save_tensor(fqn, t, ctx)
                if st is not None:
                    part.tensors.append(st)
            else:  # get_extra_state() values
                def on_tensor(f, tt):
                    raise UnsupportedStateError(f"{f}: tensors inside extra_state are not supported")

                extra[name] = encode_value(t, fqn, on_tensor, ctx.allow_pickle)
        if not sd and next(iter(m.parameters()), None) is not None:
            raise IncompleteStateError(
                f"state[{key!r}]: {type(m).__qualname__} has parameters but its state_dict() is empty, so the "
                "checkpoint would restore nothing; check its state_dict hooks or overrides, or save the "
                "module that holds the parameters"
            )
        part.value = {"extra": extra} if extra else {}
        return part

    def fingerprint(self, key: str, obj: nn.Module, ctx: AdapterContext) -> Hashable | None:
        """The module's object graph (:func:`~shardpoint.adapters.reuse.module_fingerprint`).

        The graph holds every submodule by identity, so it also fixes the
        framework the part names (an FSDP1 module is refused at save and never kept).
        """
        return module_fingerprint(unwrap_module(obj))

    def context_facts(self, key: str, obj: Any, state: Mapping[str, Any]) -> ContextFacts | None:
        """Any module's parameters by their unwrapped names (``model.layers.0.weight``)."""
        if not isinstance(obj, nn.Module):
            return None
        return ContextFacts(names={id(p): f"{key}.{n}" for n, p in unwrap_module(obj).named_parameters()})

    def load(self, key, obj, doc, tensors: Mapping[str, Any], ctx, where="<checkpoint>") -> LoadPart:
        m = self._check(key, obj)
        part = LoadPart()
        extra_docs = (doc or {}).get("extra", {}) if isinstance(doc, dict) else {}
        extras = {}
        sd = m.state_dict()
        routed = protocol_prefixes(m)
        live = None  # alias keys of parameters and buffers, built on the first tensor entry
        fresh: dict[str, torch.Tensor] = {}  # entries handed to load_state_dict
        for name, t in sd.items():
            fqn = f"{key}.{name}"
            if not isinstance(t, torch.Tensor):
                if name in extra_docs:
                    extras[name] = extra_docs[name]
                else:
                    part.missing.append(fqn)
                continue
            if part.expect(tensors, fqn, tuple(t.shape), t.dtype, where) is None:
                continue
            if live is None:
                live = {alias_key(x) for x in module_tensors(m)}
            if not name.startswith(routed) and alias_key(t) in live:
                tgt = load_target(fqn, t)  # proven to be the live tensor: fill in place
            else:
                dest = torch.empty_like(t.detach(), memory_format=torch.contiguous_format)
                fresh[name] = dest
                tgt = load_target(fqn, dest)
            if tgt is not None:
                part.targets.append(tgt)
        vouched: dict[int, bool] = {}

        def finish():
            given: dict[str, Any] = {}
            if fresh:
                # Only entries the load still reads (``keys=`` may have dropped some targets).
                wanted = {storage_of(t.dest) for t in part.targets}
                given = {n: d for n, d in fresh.items() if local_of(d).numel() == 0 or storage_of(d) in wanted}
            if extras:
                # Extra state holds no shards; let the module restore it its own way.
                def get_tensor(f):
                    raise UnsupportedStateError(f"{where}: tensors inside extra_state ({f}) are not supported")

                given.update({n: decode_value(d, get_tensor, ctx.allow_pickle, where) for n, d in extras.items()})
            if given:
                m.load_state_dict(given, strict=False)
            if fresh:
                after = m.state_dict()
                for n, d in fresh.items():
                    if n in given and local_of(d).numel() > 0:
                        now = after.get(n)
                        vouched[storage_of(d)] = isinstance(now, torch.Tensor) and (
                            alias_key(now) == alias_key(d) or same_bits(now, d)
                        )
            return obj

        def landed(targets):
            return unlanded(targets, live_storages(module_tensors(m)), vouched)

        part.finish = finish
        part.landed = landed
        return part
