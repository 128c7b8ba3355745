"""Rank functions for Megatron-Core ``GroupedMLP`` experts across EP and expert-TP degrees (run by launch).

The reference is Megatron's own ``GroupedMLP.sharded_state_dict``: filling
``weight1``/``weight2`` with their element indices and building its sharded
tensors tells, for every local element, which global expert tensor
(``experts.linear_fc1.weight``, ``[experts, 2 x ffn, hidden]`` with gated
linear units) and which position in it the element is. Every global tensor
is drawn from a seed, so each rank fills its weights and gradients with its
elements of it, takes one AdamW step (elementwise: the same bits as a step
on the whole tensor) and saves; a load at another layout must give every
element, and its AdamW moments, the values of the same step on the whole
tensor.
"""

from __future__ import annotations

import os

import torch

import shardpoint as sp
from tests.dist.moe_cases import build

__all__ = ["megatron_map", "save_job", "load_job"]

_WEIGHTS = ("weight1", "weight2")


def megatron_map(layer) -> dict[str, list[tuple[str, tuple, tuple, torch.Tensor]]]:
    """Per weight: Megatron's pieces ``(key, global shape, global offset, local element indices)``."""
    ex = layer.experts
    params = {n: getattr(ex, n) for n in _WEIGHTS}
    kept = {n: p.detach().clone() for n, p in params.items()}
    out: dict[str, list] = {}
    with torch.no_grad():
        for p in params.values():  # element indices, exact in float32 at these sizes
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p))
        sd = ex.sharded_state_dict(prefix="")
        for n in _WEIGHTS:
            built = sd[n].build()
            built = built if isinstance(built, list) else [built]
            out[n] = [(t.key, tuple(t.global_shape), tuple(t.global_offset), t.data.long()) for t in built]
        for n, p in params.items():
            p.copy_(kept[n])
    return out


def _whole(key: str, shape: tuple, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(salt * 1000 + sum(map(ord, key)))
    return torch.randn(*shape, generator=gen)


def _expected(pieces) -> dict[str, dict[str, torch.Tensor]]:
    """Per global key: the weight and AdamW moments after one step on the whole seeded tensor."""
    out = {}
    for plist in pieces.values():
        for key, shape, _, _ in plist:
            if key in out:
                continue
            w = torch.nn.Parameter(_whole(key, shape, 1))
            w.grad = _whole(key, shape, 2)
            opt = torch.optim.AdamW([w], lr=0.01)
            opt.step()
            out[key] = {"param": w.detach(), **{k: opt.state[w][k] for k in ("exp_avg", "exp_avg_sq")}}
    return out


def _slice(t: torch.Tensor, off: tuple, idx: torch.Tensor) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(off, idx.shape))]


def _layout(layer) -> list:
    """[EP size, EP rank, expert TP size, expert TP rank, attention TP size, global expert ids] of this rank."""
    from megatron.core import parallel_state as ps

    return [
        ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(), [int(i) for i in layer.local_expert_indices],
    ]


def save_job(rank: int, world: int, root: str, ep: int, tp: int, glu: bool, etp: int | None = None) -> dict:
    """Seeded experts at EP ``ep`` x expert TP ``etp`` (default: attention TP ``tp``), one AdamW step, saved."""
    layer = build(ep, seed=0, tp=tp, grouped=True, glu=glu, etp=etp)
    pieces = megatron_map(layer)
    params = [getattr(layer.experts, n) for n in _WEIGHTS]
    with torch.no_grad():
        for n, p in zip(_WEIGHTS, params):
            p.grad = torch.zeros_like(p)
            for key, shape, off, idx in pieces[n]:
                p.view(-1)[idx.reshape(-1)] = _slice(_whole(key, shape, 1), off, idx).reshape(-1)
                p.grad.view(-1)[idx.reshape(-1)] = _slice(_whole(key, shape, 2), off, idx).reshape(-1)
    opt = torch.optim.AdamW(params, lr=0.01)
    opt.step()
    path = os.path.join(root, "grouped")
    sp.save(path, {"model": layer, "optimizer": opt})
    man = sp.read_manifest(path, chunks=False).tensors
    return {
        "local": [list(p.shape) for p in params],
        "stored": [list(man[f"model.experts.{n}"].shape) for n in _WEIGHTS],
        "megatron": sorted({k: list(s) for plist in pieces.values() for k, s, _, _ in plist}.items()),
        "layout": _layout(layer),
    }


def load_job(rank: int, world: int, root: str, ep: int, tp: int, glu: bool, etp: int | None = None) -> dict:
    """Load at EP ``ep`` x expert TP ``etp`` (default ``tp``) over stale state.

    Every element, and its AdamW moments, is checked where Megatron places it.
    """
    layer = build(ep, seed=4, tp=tp, grouped=True, glu=glu, etp=etp)
    pieces = megatron_map(layer)
    params = [getattr(layer.experts, n) for n in _WEIGHTS]
    opt = torch.optim.AdamW(params, lr=0.01)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # state the load must overwrite
    sp.load(os.path.join(root, "grouped"), {"model": layer, "optimizer": opt})
    want = _expected(pieces)
    bad, checked = [], 0
    for n, p in zip(_WEIGHTS, params):
        covered = torch.zeros(p.numel(), dtype=torch.bool)
        for key, _, off, idx in pieces[n]:
            covered[idx.reshape(-1)] = True
            for field in ("param", "exp_avg", "exp_avg_sq"):
                got = (p.detach() if field == "param" else opt.state[p][field]).reshape(-1)[idx.reshape(-1)]
                checked += 1
                if not torch.equal(got, _slice(want[key][field], off, idx).reshape(-1)):
                    bad.append(f"{n}:{key}@{list(off)}.{field}")
        if not bool(covered.all()):
            bad.append(f"{n}: Megatron's pieces miss elements")
    return {"checked": checked, "bad": bad, "local": [list(p.shape) for p in params], "layout": _layout(layer)}
