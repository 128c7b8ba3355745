"""Rank functions for Megatron-Core's ``MoELayer`` (SequentialMLP local experts) across EP degrees.

A layer is trained at EP 2 over gloo with AdamW, saved, and loaded at EP 2
and EP 1: every global expert's weights and AdamW moments, the router and
the expert-bias buffer must be bit-exact at the expert's global index.

Two CPU bridges live here only: without Transformer Engine Megatron never
defines ``moe_utils.te_general_gemm`` (set to ``None``), and the router and
the dispatcher allocate on ``torch.cuda.current_device()``, made to answer
``"cpu"`` while the layer is built and run.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import shardpoint as sp

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

EXPERTS, HIDDEN, FFN, TOKENS = 4, 8, 12, 6


@contextlib.contextmanager
def on_cpu():
    """Megatron's router and dispatcher ask for ``torch.cuda.current_device()``: answer the CPU."""
    old = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = old


def build(ep: int, seed: int):
    """A ``MoELayer`` with ``EXPERTS`` SequentialMLP experts at EP ``ep`` (parallel state initialised here)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moe_utils.te_general_gemm = None
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(expert_model_parallel_size=ep)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN, num_moe_experts=EXPERTS,
        moe_router_topk=2, moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
        params_dtype=torch.float32, add_bias_linear=False, gradient_accumulation_fusion=False,
        moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, hidden_dropout=0.0, bias_activation_fusion=False,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    torch.manual_seed(seed)
    with on_cpu():
        layer = MoELayer(cfg, submodules=spec.submodules)
    return layer


def _train(layer, opt, steps: int) -> None:
    for s in range(steps):
        torch.manual_seed(1000 + s)  # the same tokens on every rank
        x = torch.randn(TOKENS, 1, HIDDEN)
        with on_cpu():
            out, _ = layer(x)
            out.square().sum().backward()
        for p in layer.parameters():  # dense (router) gradients averaged over the ranks, as Megatron's DDP would
            if getattr(p, "allreduce", True) and p.grad is not None and dist.get_world_size() > 1:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()


def _by_global(layer, opt) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds, keyed by global expert index."""
    out = {}
    for i, g in enumerate(layer.local_expert_indices):
        for n, p in layer.experts.local_experts[i].named_parameters():
            out[f"expert{g}.{n}"] = p.detach().clone()
            for k, v in opt.state[p].items():
                out[f"expert{g}.{n}.{k}"] = v.detach().clone().reshape(-1)
    out["router.weight"] = layer.router.weight.detach().clone()
    for k, v in opt.state[layer.router.weight].items():
        out[f"router.weight.{k}"] = v.detach().clone().reshape(-1)
    out["router.expert_bias"] = layer.router.expert_bias.detach().clone()
    return out


def save_job(rank: int, world: int, root: str) -> dict:
    """Train at EP ``world``, save, and write each rank's tensors by global index as the reference."""
    layer = build(world, seed=rank)  # each EP rank's experts start differently
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.arange(EXPERTS, dtype=torch.float32) / 10)
        dist.broadcast(layer.router.weight, 0)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.01)
    _train(layer, opt, 2)
    sp.save(os.path.join(root, "moe"), {"model": layer, "optimizer": opt})
    save_file(_by_global(layer, opt), os.path.join(root, f"ref{rank}.safetensors"))
    names = sorted(sp.read_manifest(os.path.join(root, "moe"), chunks=False).tensors)
    return {"indices": list(layer.local_expert_indices), "names": names}


def load_job(rank: int, world: int, root: str, saved_world: int = 2) -> dict:
    """Load the EP ``saved_world`` checkpoint at EP ``world`` into a freshly built, once-stepped layer."""
    ref = {}
    for r in range(saved_world):
        ref.update(load_file(os.path.join(root, f"ref{r}.safetensors")))
    layer = build(world, seed=50 + rank)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.01)
    _train(layer, opt, 1)  # state to overwrite
    sp.load(os.path.join(root, "moe"), {"model": layer, "optimizer": opt})
    got = _by_global(layer, opt)
    bad = [k for k, v in got.items() if k not in ref or v.dtype != ref[k].dtype or not torch.equal(v, ref[k])]
    return {"indices": list(layer.local_expert_indices), "checked": len(got), "bad": bad}


__all__ = ["build", "on_cpu", "save_job", "load_job"]
