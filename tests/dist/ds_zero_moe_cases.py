"""Rank functions for DeepSpeed MoE experts inside a ZeRO-1/2 engine, across EP degrees (run by launch).

A small network (a dense input projection, then a ``deepspeed.moe.layer.MoE``
of linear experts) trains under ``deepspeed.initialize`` with ZeRO stage 1
or 2 and a torch AdamW whose param groups DeepSpeed's
``split_params_into_different_moe_groups_for_optimizer`` made. ZeRO keeps
the experts' fp32 masters and moments in flat partitions over the expert
data-parallel group. Every global expert starts from, and is trained on, data
that depends on its global index only, so copies of one expert agree on
every EP degree. The reference is DeepSpeed's own ``safe_get_full_fp32_param``
and ``safe_get_full_optimizer_state``, keyed by global expert index.
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

HIDDEN, EXPERTS = 8, 4

__all__ = ["Net", "build", "save_job", "load_job", "stray_job"]


class Net(nn.Module):
    """A dense projection and a DeepSpeed MoE layer of ``EXPERTS`` linear experts at EP ``ep``."""

    def __init__(self, ep: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(hidden_size=HIDDEN, expert=nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, ep_size=ep, k=1)

    def experts(self):
        return self.moe.deepspeed_moe.experts.deepspeed_experts


def _deepspeed():
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo carries every collective
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def build(ep: int, stage: int, seed: int, stray: bool = False, bf16: bool = False):
    """(engine, ZeRO optimizer, global index of local expert 0); global expert ``g`` starts from seed ``seed + g``.

    ``stray``: the network also holds an expert-parallel parameter outside the MoE layer's experts.
    ``bf16``: the engine computes in bf16 with fp32 masters.
    """
    ds = _deepspeed()
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(seed)
    net = Net(ep)
    if stray:
        net.stray = nn.Parameter(torch.zeros(3))
        net.stray.allreduce, net.stray.group_name = False, f"ep_size_{ep}"
    offset = (dist.get_rank() % ep) * (EXPERTS // ep)
    with torch.no_grad():
        for i, e in enumerate(net.experts()):
            torch.manual_seed(seed + offset + i)
            e.weight.normal_()
            e.bias.normal_()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "dense"})
    opt = torch.optim.AdamW(groups, lr=0.1)
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "bf16": {"enabled": bf16},
    }
    engine, zopt, _, _ = ds.initialize(model=net, optimizer=opt, config=cfg)
    return engine, zopt, offset


def _step(engine, offset: int, s: int) -> None:
    # Each expert's gradient depends on its global index only; the dense ones are the same on every rank.
    net = engine.module
    dt = net.inp.weight.dtype
    loss = 0
    for i, e in enumerate(net.experts()):
        torch.manual_seed(500 + 10 * s + offset + i)
        loss = loss + e(torch.randn(3, HIDDEN, dtype=dt)).float().square().sum()
    torch.manual_seed(7 + s)
    loss = loss + net.moe.deepspeed_moe.gate.wg(net.inp(torch.randn(3, HIDDEN, dtype=dt))).float().square().sum()
    engine.backward(loss)
    engine.step()


def _by_global(engine, offset: int) -> dict[str, torch.Tensor]:
    """fp32 masters and AdamW moments (DeepSpeed's own gathers), experts keyed by global index."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state, safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed links each parameter to its moments after the first group's first step, when
    # later groups (the experts') hold no state yet: link them again before reading.
    zopt = engine.optimizer
    for i, flat in enumerate(zopt.single_partition_of_fp32_groups):
        lazy_init_hp_params_optimizer_state(zopt.bit16_groups[i], flat, zopt.optimizer.state)
    net, out = engine.module, {}
    named = [(f"e{offset + i}.{n}", p) for i, e in enumerate(net.experts()) for n, p in e.named_parameters()]
    named += [(n, p) for n, p in net.named_parameters() if "deepspeed_experts" not in n]
    for name, p in named:
        out[name] = safe_get_full_fp32_param(p).detach().clone()
        out[f"{name}.live"] = p.detach().clone()  # the copy the module computes with
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{k}"] = safe_get_full_optimizer_state(p, k).detach().clone()
    return out


def save_job(rank: int, world: int, root: str, ep: int, stage: int, bf16: bool = False) -> dict:
    engine, zopt, offset = build(ep, stage, seed=100, bf16=bf16)
    for s in range(2):
        _step(engine, offset, s)
    path = os.path.join(root, "ck")
    sp.save(path, {"model": engine, "optimizer": zopt})
    save_file(_by_global(engine, offset), os.path.join(root, f"ref{rank}.safetensors"))
    names = sorted(sp.read_manifest(path, chunks=False).tensors)
    return {"offset": offset, "experts": [n for n in names if n.startswith("model.") and "deepspeed_experts" in n]}


def load_job(rank: int, world: int, root: str, ep: int, stage: int, saved_world: int, bf16: bool = False) -> dict:
    ref = {}
    for r in range(saved_world):
        ref.update(load_file(os.path.join(root, f"ref{r}.safetensors")))
    engine, zopt, offset = build(ep, stage, seed=900, bf16=bf16)
    _step(engine, offset, 5)  # state the load must overwrite
    sp.load(os.path.join(root, "ck"), {"model": engine, "optimizer": zopt})
    got = _by_global(engine, offset)
    bad = [k for k, v in got.items() if k not in ref or not torch.equal(v, ref[k])]
    groups = [[g.get("name"), bool(g.get("moe", False))] for g in zopt.optimizer.param_groups]
    _step(engine, offset, 2)  # the loaded engine trains on
    return {"checked": len(got), "bad": bad, "offset": offset, "groups": groups}


def stray_job(rank: int, world: int, root: str) -> dict:
    """An expert-parallel parameter outside any MoE expert list: the save must refuse it, naming it."""
    engine, zopt, _ = build(world, 1, seed=3, stray=True)
    try:
        sp.save(os.path.join(root, "stray"), {"model": engine, "optimizer": zopt})
    except sp.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e), "exists": os.path.exists(os.path.join(root, "stray"))}
    return {"error": None}
