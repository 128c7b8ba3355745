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


def build(ep: int, seed: int, tp: int = 1, grouped: bool = False, glu: bool = False, etp: int | None = None):
    """A ``MoELayer`` with ``EXPERTS`` experts at EP ``ep`` and TP ``tp`` (parallel state initialised here).

    ``etp``: the expert tensor-parallel size when it differs from the attention
    TP ``tp`` (Megatron's default is ``tp``).

    ``grouped``: ``GroupedMLP`` experts, built without the grouped-GEMM kernel
    (which has no CPU build), so such a layer is saved and loaded but never run.
    ``glu``: gated linear units (SwiGLU), fc1 holding a gate and an up half per expert.
    """
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moe_utils.te_general_gemm = None
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN, num_moe_experts=EXPERTS,
        moe_router_topk=2, moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
        params_dtype=torch.float32, add_bias_linear=False, gradient_accumulation_fusion=False,
        moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, hidden_dropout=0.0, bias_activation_fusion=False,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, moe_grouped_gemm=grouped,
        gated_linear_unit=glu, activation_func=F.silu if glu else F.gelu, expert_tensor_parallel_size=etp,
    )
    if grouped:
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=grouped)
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


__all__ = ["build", "on_cpu", "save_job", "load_job", "etp_save_job", "etp_load_job"]


def _global(g: int, name: str, shape, salt: int) -> torch.Tensor:
    """The full tensor ``name`` of global expert ``g`` (``shape`` its global shape), from a seed."""
    gen = torch.Generator().manual_seed(salt + 97 * g + len(name))
    return torch.randn(*shape, generator=gen)


def _shard_spec(p, r: int) -> tuple[int, int, int]:
    """(dim, offset, size) of expert TP rank ``r``'s rows of ``p`` in its global tensor."""
    if not getattr(p, "tensor_model_parallel", False):
        return 0, 0, p.shape[0]
    dim = int(p.partition_dim)
    return dim, r * p.shape[dim], p.shape[dim]


def etp_save_job(rank: int, world: int, root: str) -> dict:
    """TP 2 x EP 2 on 4 ranks: each expert split over the expert TP group; values and grads from global seeds."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    layer = build(2, seed=0, tp=2)
    etp, er = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    opt = torch.optim.AdamW([p for e in layer.experts.local_experts for p in e.parameters()], lr=0.01)
    with torch.no_grad():
        for i, g in enumerate(layer.local_expert_indices):
            for n, p in layer.experts.local_experts[i].named_parameters():
                dim, off, size = _shard_spec(p, er)
                shape = list(p.shape)
                shape[dim] = size * (etp if getattr(p, "tensor_model_parallel", False) else 1)
                p.copy_(_global(g, n, shape, 1).narrow(dim, off, size))
                p.grad = _global(g, n, shape, 2).narrow(dim, off, size).clone()
    opt.step()
    sp.save(os.path.join(root, "etp"), {"model": layer, "optimizer": opt})
    return {"indices": list(layer.local_expert_indices), "etp": [etp, er]}


def etp_load_job(rank: int, world: int, root: str) -> dict:
    """The TP 2 x EP 2 checkpoint into EP 1, TP 1: each expert whole, checked against its global seeds."""
    layer = build(1, seed=3)
    opt = torch.optim.AdamW([p for e in layer.experts.local_experts for p in e.parameters()], lr=0.01)
    refs = {}
    for g, e in enumerate(layer.experts.local_experts):
        for n, p in e.named_parameters():
            whole = torch.nn.Parameter(_global(g, n, p.shape, 1))
            whole.grad = _global(g, n, p.shape, 2)
            ref = torch.optim.AdamW([whole], lr=0.01)
            ref.step()  # elementwise: the same bits as the step on each TP shard
            refs[(g, n)] = (whole.detach(), ref.state[whole])
            p.grad = torch.ones_like(p)
    opt.step()
    sp.load(os.path.join(root, "etp"), {"model": layer, "optimizer": opt}, strict=False)
    bad = []
    for (g, n), (w, st) in refs.items():
        p = layer.experts.local_experts[g].get_parameter(n)
        if not torch.equal(p, w):
            bad.append(f"e{g}.{n}")
        for k in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(opt.state[p][k], st[k]):
                bad.append(f"e{g}.{n}.{k}")
    return {"checked": len(refs), "bad": bad}
