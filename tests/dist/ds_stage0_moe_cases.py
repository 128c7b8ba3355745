"""Rank functions for DeepSpeed MoE experts in a stage-0 engine (no ZeRO), across EP degrees (run by launch).

The network of :mod:`tests.dist.ds_zero_moe_cases` (a dense projection, then
a ``deepspeed.moe.layer.MoE``) trains under ``deepspeed.initialize`` with
ZeRO stage 0: the engine steps the torch AdamW itself, whose param groups
DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` made
(``dense`` and the MoE group ``ep_size_<ep>``). The reference is what the
saving engine held: each parameter and its AdamW state, experts keyed by
their global index.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere

import torch
from safetensors.torch import load_file, save_file

import shardpoint as sp

from .ds_zero_moe_cases import HIDDEN, Net, build

__all__ = ["save_job", "load_job", "zero_after_load_job", "train_step", "by_global"]


def train_step(engine, offset: int, s: int) -> None:
    """One engine step; each expert's gradient depends on its global index only, the dense ones on ``s``."""
    net, loss = engine.module, 0
    for i, e in enumerate(net.experts()):
        torch.manual_seed(500 + 10 * s + offset + i)
        loss = loss + e(torch.randn(3, HIDDEN)).square().sum()
    torch.manual_seed(7 + s)
    loss = loss + net.moe.deepspeed_moe.gate.wg(net.inp(torch.randn(3, HIDDEN))).square().sum()
    engine.backward(loss)
    engine.step()


def by_global(engine, opt, offset: int) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW state (``step`` included), experts keyed by global index."""
    net, out = engine.module, {}
    named = [(f"e{offset + i}.{n}", p) for i, e in enumerate(net.experts()) for n, p in e.named_parameters()]
    named += [(n, p) for n, p in net.named_parameters() if "deepspeed_experts" not in n]
    for name, p in named:
        out[name] = p.detach().clone()
        for k, v in opt.state[p].items():
            out[f"{name}.{k}"] = v.detach().clone().reshape(-1)
    return out


_PARAM = ("weight", "bias")


def _groups(opt) -> list[list]:
    return [[g.get("name"), bool(g.get("moe", False))] for g in opt.param_groups]


def save_job(rank: int, world: int, root: str, ep: int) -> dict:
    engine, opt, offset = build(ep, 0, seed=100)
    for s in range(2):
        train_step(engine, offset, s)
    path = os.path.join(root, "ck")
    sp.save(path, {"model": engine, "optimizer": opt})
    save_file(by_global(engine, opt, offset), os.path.join(root, f"ref{rank}.safetensors"))
    entries = sp.read_manifest(path, chunks=False).layout["entries"]
    return {"offset": offset, "optimizer": type(opt).__name__, "groups": _groups(opt), "entries": entries}


def load_job(rank: int, world: int, root: str, ep: int, saved_world: int) -> dict:
    ref = {}
    for r in range(saved_world):
        ref.update(load_file(os.path.join(root, f"ref{r}.safetensors")))
    engine, opt, offset = build(ep, 0, seed=900)
    train_step(engine, offset, 5)  # state the load must overwrite
    sp.load(os.path.join(root, "ck"), {"model": engine, "optimizer": opt})
    got = by_global(engine, opt, offset)
    bad = [k for k, v in got.items() if k not in ref or not torch.equal(v, ref[k])]
    groups = _groups(opt)
    before = by_global(engine, opt, offset)
    error = None
    try:
        train_step(engine, offset, 2)  # the loaded engine trains on
    except Exception as e:  # reported, so that a failing step shows what failed
        error = f"{type(e).__name__}: {e}"
    after = by_global(engine, opt, offset)
    moved = sorted(k for k, v in after.items() if k.rpartition(".")[2] in _PARAM and not torch.equal(v, before[k]))
    return {"checked": len(got), "bad": bad, "offset": offset, "groups": groups, "step_error": error, "moved": moved}


def zero_after_load_job(rank: int, world: int, root: str, ep: int) -> dict:
    """Load into a torch optimizer over DeepSpeed's MoE groups, then hand it to a ZeRO-1 engine.

    No engine is in the state: the groups' ``moe`` key marks them. ZeRO looks
    each MoE group's expert data-parallel group up by the group's ``name``.
    """
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    build(ep, 0, seed=1)  # DeepSpeed's expert-parallel process groups for EP ``ep``
    net = Net(ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "dense"})
    opt = torch.optim.AdamW(groups, lr=0.1)
    sp.load(os.path.join(root, "ck"), {"model": net, "optimizer": opt})
    names = _groups(opt)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    try:
        deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    except Exception as e:  # reported, so that the test names what failed
        return {"groups": names, "error": f"{type(e).__name__}: {e}"}
    return {"groups": names, "error": None}
