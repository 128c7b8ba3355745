"""Rank functions for DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``) across EP degrees (run by launch).

The layer's local experts (``deepspeed_moe.experts.deepspeed_experts.<i>``)
are detected through the expert-parallel group DeepSpeed made for them and
stored at their global index; a checkpoint saved at EP 2 loads at EP 1.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

import shardpoint as sp
from tests.dist.agree_cases import CAUSE, error_of

HIDDEN, EXPERTS = 8, 4


def build(ep: int, seed: int):
    """A DeepSpeed ``MoE`` layer at EP ``ep`` whose global expert ``g`` starts from seed ``g + seed``."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(hidden_size=HIDDEN, expert=nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, ep_size=ep, k=1)
    moe.set_deepspeed_parallelism()
    rank = dist.get_rank() % ep
    local = EXPERTS // ep
    with torch.no_grad():
        for i, e in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            torch.manual_seed(seed + rank * local + i)
            e.weight.normal_()
            e.bias.normal_()
    return moe, rank * local


def _by_global(moe, opt, offset: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, e in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        for n, p in e.named_parameters():
            out[f"e{offset + i}.{n}"] = p.detach().clone()
            for k, v in opt.state[p].items():
                out[f"e{offset + i}.{n}.{k}"] = v.detach().clone().reshape(-1)
    out["gate"] = moe.deepspeed_moe.gate.wg.weight.detach().clone()
    return out


def _step(moe, opt, offset: int) -> None:
    # Each expert's gradient depends on its global index only, so expert copies stay equal.
    for i, e in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        torch.manual_seed(500 + offset + i)
        e(torch.randn(3, HIDDEN)).square().sum().backward()
    torch.manual_seed(7)
    moe.deepspeed_moe.gate.wg(torch.randn(3, HIDDEN)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def save_job(rank: int, world: int, root: str) -> dict:
    moe, offset = build(world, seed=100)
    opt = torch.optim.AdamW(moe.parameters(), lr=0.1)
    _step(moe, opt, offset)
    sp.save(os.path.join(root, "ds"), {"model": moe, "optimizer": opt})
    save_file(_by_global(moe, opt, offset), os.path.join(root, f"ref{rank}.safetensors"))
    names = sorted(sp.read_manifest(os.path.join(root, "ds"), chunks=False).tensors)
    return {"offset": offset, "experts": [n for n in names if n.startswith("model.") and "deepspeed_experts" in n]}


def load_job(rank: int, world: int, root: str, saved_world: int = 2) -> dict:
    ref = {}
    for r in range(saved_world):
        ref.update(load_file(os.path.join(root, f"ref{r}.safetensors")))
    moe, offset = build(world, seed=900)
    opt = torch.optim.AdamW(moe.parameters(), lr=0.1)
    _step(moe, opt, offset)
    sp.load(os.path.join(root, "ds"), {"model": moe, "optimizer": opt})
    got = _by_global(moe, opt, offset)
    return {"checked": len(got), "bad": [k for k, v in got.items() if not torch.equal(v, ref[k])]}


def failing_job(rank: int, world: int, root: str) -> dict:
    """Expert detection fails on rank 1: a save and a load of the MoE layer, each timed with its error.

    DeepSpeed's table of expert-parallel groups raises on rank 1 while
    its experts are detected; the save must leave nothing committed.
    """
    from deepspeed.utils import groups

    moe, _ = build(world, seed=100)
    state = {"model": moe, "optimizer": torch.optim.AdamW(moe.parameters(), lr=0.1)}
    path = os.path.join(root, "failing")
    real = groups._get_expert_parallel_group_dict

    def broken():
        raise RuntimeError(f"{CAUSE}: expert-parallel groups")

    if rank == 1:
        groups._get_expert_parallel_group_dict = broken
    try:
        out = {"save": error_of(lambda: sp.save(path, state)), "load": error_of(lambda: sp.load(os.path.join(root, "ds"), state))}
    finally:
        groups._get_expert_parallel_group_dict = real
    dist.barrier()
    out["committed"] = os.path.exists(os.path.join(path, "manifest.json"))
    return out


__all__ = ["build", "save_job", "load_job", "failing_job"]
