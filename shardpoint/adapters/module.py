"""``nn.Module`` state: plain modules, DDP, FSDP2 (``fully_shard``, HSDP) and DTensor TP.

All of these expose their shards through ``state_dict()``: DDP wraps a plain
module, FSDP2 and ``parallelize_module`` leave DTensor parameters whose
placements say where each local shard sits. Names are the unwrapped module's
names, so a checkpoint taken under DDP loads into FSDP2 and back.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..errors import UnsupportedStateError
from ..format.values import decode_value, encode_value
from .base import AdapterContext, LoadPart, SavePart
from .tensors import is_dtensor, load_target, save_tensor

__all__ = ["ModuleAdapter", "unwrap_module", "module_framework"]


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


class ModuleAdapter:
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
        for name, t in m.state_dict().items():
            fqn = f"{key}.{name}"
            if isinstance(t, torch.Tensor):
                st = save_tensor(fqn, t, ctx)
                if st is not None:
                    part.tensors.append(st)
            else:  # get_extra_state() values
                def on_tensor(f, tt):
                    raise UnsupportedStateError(f"{f}: tensors inside extra_state are not supported")

                extra[name] = encode_value(t, fqn, on_tensor, ctx.allow_pickle)
        part.value = {"extra": extra} if extra else {}
        return part

    def load(self, key, obj, doc, tensors: Mapping[str, Any], ctx, where="<checkpoint>") -> LoadPart:
        m = self._check(key, obj)
        part = LoadPart()
        extra_docs = (doc or {}).get("extra", {}) if isinstance(doc, dict) else {}
        extras = {}
        for name, t in m.state_dict().items():
            fqn = f"{key}.{name}"
            if not isinstance(t, torch.Tensor):
                if name in extra_docs:
                    extras[name] = extra_docs[name]
                else:
                    part.missing.append(fqn)
                continue
            if part.expect(tensors, fqn, tuple(t.shape), t.dtype, where) is None:
                continue
            tgt = load_target(fqn, t)
            if tgt is not None:
                part.targets.append(tgt)

        def finish():
            if extras:
                # Extra state holds no shards; let the module restore it its own way.
                def get_tensor(f):
                    raise UnsupportedStateError(f"{where}: tensors inside extra_state ({f}) are not supported")

                sd = {n: decode_value(d, get_tensor, ctx.allow_pickle, where) for n, d in extras.items()}
                m.load_state_dict(sd, strict=False)
            return obj

        part.finish = finish
        return part
