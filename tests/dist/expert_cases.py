"""Rank functions for a plain module's per-rank expert list declared with ``sp.Experts`` (run by launch).

Global expert ``g`` starts from seed ``1000 + g`` and trains on inputs seeded
by ``g``, so ranks holding the same global expert (expert data parallelism)
hold identical copies. Checkpoints are saved at one EP degree and loaded at
another; every global expert's weight and AdamW moments must then be
bit-exact at its global index.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

import shardpoint as sp

DIM = 6


class PlainMoe(nn.Module):
    """A router, a dense layer, an expert-bias buffer and ``local`` experts."""

    def __init__(self, local: int, num_experts: int):
        super().__init__()
        self.router = nn.Linear(DIM, num_experts, bias=False)
        self.dense = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(local))
        self.register_buffer("expert_bias", torch.zeros(num_experts))


def _ep_groups(world: int, ep: int) -> tuple[list[int], int]:
    """This rank's EP group (consecutive ranks) and its EP rank."""
    me = dist.get_rank() if dist.is_initialized() else 0
    first = me // ep * ep
    return list(range(first, first + ep)), me - first


def _build(world: int, ep: int, num_experts: int, seed: int):
    group, ep_rank = _ep_groups(world, ep)
    local = num_experts // ep
    offset = ep_rank * local
    torch.manual_seed(seed)
    model = PlainMoe(local, num_experts)
    with torch.no_grad():
        for i, e in enumerate(model.experts):
            torch.manual_seed(seed * 7919 + 1000 + offset + i)
            e.weight.normal_()
        model.expert_bias.copy_(torch.arange(num_experts, dtype=torch.float32) * (seed + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt, offset, group


def _train(model: PlainMoe, opt, offset: int, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(3, DIM)
    loss = model.dense(x).square().sum() + model.router(x).square().sum()
    for i, e in enumerate(model.experts):
        torch.manual_seed(seed * 31 + offset + i)
        loss = loss + e(torch.randn(3, DIM)).square().sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _by_global(model: PlainMoe, opt, offset: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, e in enumerate(model.experts):
        out[f"e{offset + i}.weight"] = e.weight.detach().clone()
        for k, v in opt.state[e.weight].items():
            out[f"e{offset + i}.{k}"] = v.detach().clone().reshape(-1)
    for n in ("router.weight", "dense.weight", "dense.bias"):
        p = model.get_parameter(n)
        out[n] = p.detach().clone()
        for k, v in opt.state[p].items():
            out[f"{n}.{k}"] = v.detach().clone().reshape(-1)
    out["expert_bias"] = model.expert_bias.clone()
    return out


def _rule(num_experts: int, group) -> sp.Experts:
    return sp.Experts("model.experts", num_experts=num_experts, group=group)


def _error(fn) -> list:
    try:
        fn()
    except sp.CheckpointError as e:
        return [type(e).__name__, str(e)]
    return []


def save_one(root: str, name: str, world: int, ep: int, num_experts: int) -> dict:
    """Train at EP ``ep`` (expert data parallelism ``world / ep``), save, and write the reference."""
    model, opt, offset, group = _build(world, ep, num_experts, seed=0)
    _train(model, opt, offset, 1)
    _train(model, opt, offset, 2)
    path = os.path.join(root, name)
    sp.save(path, {"model": model, "optimizer": opt}, layouts=[_rule(num_experts, group)])
    rank = dist.get_rank() if dist.is_initialized() else 0
    save_file(_by_global(model, opt, offset), os.path.join(root, f"{name}.ref{rank}.safetensors"))
    return {"offset": offset, "names": sorted(sp.read_manifest(path, chunks=False).tensors)}


def load_one(root: str, name: str, world: int, ep: int, num_experts: int) -> list[str]:
    """Load checkpoint ``name`` at EP ``ep``; the names that differ from the reference (empty: bit-exact)."""
    ref = {}
    for f in sorted(os.listdir(root)):
        if f.startswith(f"{name}.ref"):
            ref.update(load_file(os.path.join(root, f)))
    model, opt, offset, group = _build(world, ep, num_experts, seed=5)
    _train(model, opt, offset, 9)  # state to overwrite
    sp.load(os.path.join(root, name), {"model": model, "optimizer": opt}, layouts=[_rule(num_experts, group)])
    got = _by_global(model, opt, offset)
    missing = sorted(set(ref) - set(got)) if len(model.experts) == num_experts else []
    return missing + [k for k, v in got.items() if k not in ref or not torch.equal(v, ref[k])]


def save_tp(root: str) -> dict:
    """EP 2 x TP 2 on 4 ranks: each expert a DTensor sharded over its TP pair, experts split over EP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ep_rank = mesh["ep"].get_local_rank()
    torch.manual_seed(0)  # the dense part the same everywhere
    model = PlainMoe(2, 4)
    ref = {}
    for i in range(2):
        g = ep_rank * 2 + i
        torch.manual_seed(1000 + g)
        full = torch.randn(DIM, DIM)
        ref[f"e{g}.weight"] = full.clone()
        model.experts[i].weight = nn.Parameter(distribute_tensor(full, mesh["tp"], [Shard(0)]))
    opt = torch.optim.AdamW([e.weight for e in model.experts], lr=0.1)
    for i, e in enumerate(model.experts):
        g = ep_rank * 2 + i
        torch.manual_seed(2000 + g)
        e.weight.grad = distribute_tensor(torch.randn(DIM, DIM), mesh["tp"], [Shard(0)])
    opt.step()
    for i, e in enumerate(model.experts):
        g = ep_rank * 2 + i
        ref[f"e{g}.weight"] = e.weight.full_tensor()
        for k, v in opt.state[e.weight].items():
            ref[f"e{g}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).reshape(-1)
    path = os.path.join(root, "eptp")
    state = {"model": model, "optimizer": opt}
    sp.save(path, state, layouts=[_rule(4, mesh["ep"].get_group())])
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(root, f"eptp.ref{dist.get_rank()}.safetensors"))
    return {"chunks": len(sp.read_manifest(path).tensors["model.experts.3.weight"].chunks)}


def load_tp_plain(root: str) -> list[str]:
    """The EP 2 x TP 2 checkpoint into one process holding all 4 experts whole."""
    ref = {}
    for f in sorted(os.listdir(root)):
        if f.startswith("eptp.ref"):
            ref.update(load_file(os.path.join(root, f)))
    model = PlainMoe(4, 4)
    opt = torch.optim.AdamW([e.weight for e in model.experts], lr=0.1)
    for e in model.experts:
        e.weight.grad = torch.ones_like(e.weight)
    opt.step()
    sp.load(os.path.join(root, "eptp"), {"model": model, "optimizer": opt}, layouts=[_rule(4, None)], strict=False)
    bad = []
    for g, e in enumerate(model.experts):
        if not torch.equal(e.weight, ref[f"e{g}.weight"]):
            bad.append(f"e{g}.weight")
        for k, v in opt.state[e.weight].items():
            if not torch.equal(v.reshape(-1), ref[f"e{g}.{k}"]):
                bad.append(f"e{g}.{k}")
    return bad


def four_job(rank: int, world: int, root: str) -> dict:
    """Saves on 4 ranks: EP 4 (8 and 12 experts), EP 2 x expert DP 2, EP 2 x TP 2; 6 experts at EP 4 refused."""
    out = {
        "ep4": save_one(root, "ep4", world, 4, 8),
        "ep4u": save_one(root, "ep4u", world, 4, 12),
        "ep2dp2": save_one(root, "ep2dp2", world, 2, 4),
        "eptp": save_tp(root),
    }
    model = PlainMoe(1, 6)
    out["indivisible"] = _error(lambda: sp.save(os.path.join(root, "bad"), {"model": model}, layouts=[_rule(6, list(range(4)))]))
    # Expert copies that should agree but do not are caught like any replica.
    model, opt, offset, group = _build(world, 2, 4, seed=0)
    with torch.no_grad():
        model.experts[0].weight.add_(float(rank >= 2))
    out["diverged"] = _error(lambda: sp.save(os.path.join(root, "div"), {"model": model}, layouts=[_rule(4, group)]))
    return out


def one_job(rank: int, world: int, root: str) -> dict:
    """One process (EP 1): loads of EP 4, EP 2 and EP 2 x TP 2 checkpoints; saves EP 1."""
    return {
        "ep4_to1": load_one(root, "ep4", 1, 1, 8),
        "ep2_to1": load_one(root, "ep2dp2", 1, 1, 4),
        "eptp_to1": load_tp_plain(root),
        "ep1": save_one(root, "ep1", 1, 1, 4),
    }


def two_job(rank: int, world: int, root: str) -> dict:
    """Two ranks at EP 2: loads of EP 4 (8 and 12 experts), EP 2 x DP 2 and EP 1."""
    return {
        "ep4_to2": load_one(root, "ep4", world, 2, 8),
        "ep4u_to2": load_one(root, "ep4u", world, 2, 12),
        "ep2dp2_to2": load_one(root, "ep2dp2", world, 2, 4),
        "ep1_to2": load_one(root, "ep1", world, 2, 4),
    }


def eight_job(rank: int, world: int, root: str) -> dict:
    """Eight ranks at EP 8: the EP 4 checkpoint loads; 12 experts cannot be split over 8."""
    return {
        "ep4_to8": load_one(root, "ep4", world, 8, 8),
        "ep4u_to8": _error(lambda: load_one(root, "ep4u", world, 8, 12)),
    }


__all__ = ["PlainMoe", "four_job", "one_job", "two_job", "eight_job"]
