"""``torch.optim.Optimizer`` state, keyed by parameter names, never by integer ids.

Each per-parameter state tensor is stored as ``<key>.state.<param fqn>.<name>``
and follows its parameter's geometry (a DTensor for FSDP2/TP, a replicated
tensor for DDP). Loading works on a freshly built optimizer that has never
stepped: state tensors are allocated from the manifest, sharded like their
parameter, and installed without running a step.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import ShapeMismatchError
from ..format.values import decode_value, encode_value
from .base import AdapterContext, LoadPart, SavePart, dtype_name, torch_dtype
from .tensors import empty_like_target, load_target, save_tensor

__all__ = ["OptimizerAdapter", "param_name"]


def param_name(key: str, p: torch.Tensor, gi: int, i: int, ctx: AdapterContext) -> str:
    """The parameter's fully qualified name, or a positional fallback if no module owns it."""
    return ctx.param_names.get(id(p), f"{key}.unnamed.{gi}.{i}")


class OptimizerAdapter:
    name = "optimizer"

    def claims(self, obj: Any) -> bool:
        return isinstance(obj, torch.optim.Optimizer)

    def save(self, key: str, opt: torch.optim.Optimizer, ctx: AdapterContext) -> SavePart:
        part = SavePart(framework=f"optimizer:{type(opt).__name__}")

        def on_tensor(fqn, t):
            st = save_tensor(fqn, t, ctx)
            if st is not None:
                part.tensors.append(st)

        groups, group_of, state = [], {}, {}
        for gi, g in enumerate(opt.param_groups):
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.append(encode_value(hyper, f"{key}.groups.{gi}", on_tensor, ctx.allow_pickle))
            for i, p in enumerate(g["params"]):
                name = param_name(key, p, gi, i, ctx)
                group_of[name] = gi
                s = opt.state.get(p)
                if s:
                    state[name] = encode_value(dict(s), f"{key}.state.{name}", on_tensor, ctx.allow_pickle)
        part.value = {"groups": groups, "group_of": group_of, "state": state}
        return part

    def load(self, key, opt, doc, tensors: Mapping[str, Any], ctx, where="<checkpoint>") -> LoadPart:
        part = LoadPart()
        saved_state = doc.get("state", {})
        saved_groups = doc.get("groups", [])
        group_of = doc.get("group_of", {})
        new_state: dict[int, tuple[torch.Tensor, Any]] = {}
        cleared: list[torch.Tensor] = []
        seen = set()
        group_updates = []
        for gi, g in enumerate(opt.param_groups):
            sgi = None
            for i, p in enumerate(g["params"]):
                name = param_name(key, p, gi, i, ctx)
                seen.add(name)
                if sgi is None and name in group_of:
                    sgi = group_of[name]
                if name not in saved_state:
                    # A parameter the saved optimizer knew but held no state for (never got a
                    # gradient) is fine; one it never knew is missing.
                    if name not in group_of:
                        part.missing.append(f"{key}.state.{name}")
                    cleared.append(p)
                    continue

                def get_tensor(fqn, p=p):
                    meta = tensors.get(fqn)
                    if meta is None:
                        part.missing.append(fqn)
                        return None
                    part.consumed.add(fqn)
                    dt = torch_dtype(meta.dtype)
                    dest = empty_like_target(p, tuple(meta.shape), dt)
                    if dest.dtype != dt:
                        raise ShapeMismatchError(f"{where}: tensor {fqn!r}: cannot allocate {meta.dtype}, got {dtype_name(dest.dtype)}")
                    tgt = load_target(fqn, dest)
                    if tgt is not None:
                        part.targets.append(tgt)
                    return dest

                new_state[id(p)] = (p, decode_value(saved_state[name], get_tensor, ctx.allow_pickle, where))
            if sgi is None:
                sgi = gi
            if sgi < len(saved_groups):
                group_updates.append((g, saved_groups[sgi], f"{key}.groups.{sgi}"))
            else:
                part.missing.append(f"{key}.groups.{gi}")
        for name in saved_state:
            if name not in seen:
                part.unexpected.append(f"{key}.state.{name}")
        # Hyper-parameters may hold tensors (e.g. a tensor lr): decode them now so targets exist.
        decoded_groups = []
        for g, gdoc, gpath in group_updates:
            def get_tensor(fqn):
                meta = tensors.get(fqn)
                if meta is None:
                    part.missing.append(fqn)
                    return None
                part.consumed.add(fqn)
                dest = torch.zeros(tuple(meta.shape), dtype=torch_dtype(meta.dtype))
                part.targets.append(load_target(fqn, dest))
                return dest

            decoded_groups.append((g, decode_value(gdoc, get_tensor, ctx.allow_pickle, where)))

        def finish():
            for p in cleared:  # the checkpoint had no state for it: drop stale state
                opt.state.pop(p, None)
            for p, s in new_state.values():
                opt.state[p] = s
            for g, hyper in decoded_groups:
                for k, v in hyper.items():
                    if k != "params":
                        g[k] = v
            return opt

        part.finish = finish
        return part
