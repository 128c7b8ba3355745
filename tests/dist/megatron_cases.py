"""Rank functions for a Megatron-Core GPT (TP 2 x PP 2) saved and loaded into plain PyTorch.

The Megatron model is ``megatron.core.models.gpt.GPTModel`` with the local
(non Transformer Engine) layer spec, on CPU with gloo. Its fused
``linear_qkv`` (grouped-query attention) and SwiGLU ``linear_fc1`` are saved as
logical tensors through layout rules; :class:`PlainGPT` is the same network in
plain PyTorch with those logical names, loaded under FSDP2 or in one process.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import shardpoint as sp

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

TP, PP = 2, 2
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, BATCH = 4, 32, 4, 2, 48, 64, 8, 2
HD = HIDDEN // HEADS
RULES = [
    sp.Fused("*.linear_qkv.weight", dim=0, groups=GROUPS,
             parts=[("linear_q", HEADS // GROUPS * HD), ("linear_k", HD), ("linear_v", HD)]),
    sp.Fused("*.linear_fc1.weight", dim=0, parts=[("linear_gate", FFN), ("linear_up", FFN)]),
]


def _cpu_shims() -> None:
    """Two CUDA-only spots of Megatron's local attention path, replaced for CPU (see docs/design.md).

    The attention scratch buffer asks for ``torch.cuda.current_device()``: keep it on CPU.
    """
    import operator
    from functools import reduce

    from megatron.core.utils import GlobalMemoryBuffer

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(*tensor_shape)

    GlobalMemoryBuffer.get_tensor = get_tensor
    # Its RNG tracker (used around attention dropout, 0 here) keeps CUDA generator states only.
    import contextlib

    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def build_megatron(seed: int = 0, init: bool = True):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    _cpu_shims()
    if init:
        ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
    )
    torch.manual_seed(seed + ps.get_pipeline_model_parallel_rank())
    stage = ps.get_pipeline_model_parallel_rank()
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB, max_sequence_length=SEQ,
        pre_process=stage == 0, post_process=stage == PP - 1, position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=False,
    )
    return model


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, y


def megatron_losses(model, step: int, backward: bool) -> torch.Tensor | None:
    """Per-token losses ``[batch, seq]`` through the two stages (last stage returns them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    x, y = batch(step)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    # An explicit causal mask (True: masked): Megatron's default one is built on "cuda".
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    if ps.is_pipeline_first_stage():
        out = model(x, pos, mask)
        dist.send(out.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
        if backward:
            grad = torch.empty_like(out)
            dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
        return None
    inp = torch.empty(SEQ, BATCH, HIDDEN)
    dist.recv(inp, ps.get_pipeline_model_parallel_prev_rank())
    inp.requires_grad_(True)
    model.set_input_tensor(inp)
    loss = model(None, pos, mask, labels=y)
    if backward:
        loss.mean().backward()
        dist.send(inp.grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank())
    return loss.detach()


def _gather_tp(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The global tensor of a Megatron TP shard ``t`` of parameter ``p`` (honours partition_stride)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not getattr(p, "tensor_model_parallel", False):
        return t.detach().clone()
    dim, stride = p.partition_dim, p.partition_stride
    g = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(g))]
    dist.all_gather(parts, t.detach().contiguous(), group=g)
    chunks = [c.chunk(stride, dim) for c in parts]
    return torch.cat([chunks[r][j] for j in range(stride) for r in range(len(parts))], dim)


def save_job(rank: int, world: int, root: str) -> dict:
    """Train one step at TP 2 x PP 2, save with layout rules, write the gathered reference."""
    from megatron.core import parallel_state as ps

    from shardpoint.adapters.megatron import megatron_names

    model = build_megatron()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    megatron_losses(model, 0, backward=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sp.save(os.path.join(root, "mcore"), {"model": model, "optimizer": opt}, layouts=RULES)
    # The full reference, gathered along partition_dim, with global (fused) names.
    names = megatron_names(model)
    ref = {}
    for n, p in model.named_parameters():
        g = names[n]
        ref[f"model.{g}"] = _gather_tp(p, p)
        for k, v in opt.state[p].items():
            ref[f"opt.{g}.{k}"] = _gather_tp(v, p) if v.dim() else v.clone()
    losses = megatron_losses(model, 1, backward=False)
    stage = ps.get_pipeline_model_parallel_rank()
    if ps.get_tensor_model_parallel_rank() == 0:
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(root, f"ref{stage}.safetensors"))
        if losses is not None:
            save_file({"losses": losses.contiguous()}, os.path.join(root, "losses.safetensors"))
    m = sp.read_manifest(os.path.join(root, "mcore"))
    # Back into a freshly built Megatron model (same layout, other init): the load path, in place.
    model2 = build_megatron(seed=77, init=False)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sp.load(os.path.join(root, "mcore"), {"model": model2, "optimizer": opt2}, layouts=RULES)
    names2 = megatron_names(model2)
    back = {}
    for n, p in model2.named_parameters():
        back[f"model.{names2[n]}"] = _gather_tp(p, p)
        for k, v in opt2.state[p].items():
            back[f"opt.{names2[n]}.{k}"] = _gather_tp(v, p) if v.dim() else v.clone()
    assert sorted(back) == sorted(ref), sorted(set(back) ^ set(ref))
    bad = [k for k in ref if not torch.equal(back[k], ref[k])]
    assert not bad, f"Megatron -> Megatron not bit-exact: {bad[:5]}"
    error = _expert_refusal(root, model.config)
    return {"expert_error": error, "tensors": sorted(m.tensors), "layers": sorted({n.split(".")[2] for n in names.values() if ".layers." in n})}


# ---------------------------------------------------------------- the plain PyTorch twin
class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_q = nn.Linear(HIDDEN, HEADS * HD, bias=False)
        self.linear_k = nn.Linear(HIDDEN, GROUPS * HD, bias=False)
        self.linear_v = nn.Linear(HIDDEN, GROUPS * HD, bias=False)
        self.linear_proj = nn.Linear(HEADS * HD, HIDDEN, bias=False)

    def forward(self, x):  # [b, s, h]
        b, s, _ = x.shape
        q = self.linear_q(x).view(b, s, HEADS, HD).transpose(1, 2)
        k = self.linear_k(x).view(b, s, GROUPS, HD).transpose(1, 2).repeat_interleave(HEADS // GROUPS, dim=1)
        v = self.linear_v(x).view(b, s, GROUPS, HD).transpose(1, 2).repeat_interleave(HEADS // GROUPS, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(HD)
        att = att.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        return self.linear_proj((att @ v).transpose(1, 2).reshape(b, s, HEADS * HD))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_gate = nn.Linear(HIDDEN, FFN, bias=False)
        self.linear_up = nn.Linear(HIDDEN, FFN, bias=False)
        self.linear_fc2 = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.linear_fc2(F.silu(self.linear_gate(x)) * self.linear_up(x))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.self_attention = _Attn()
        self.pre_mlp_layernorm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.mlp = _MLP()

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.final_layernorm = nn.RMSNorm(HIDDEN, eps=1e-5)


class _Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)


class PlainGPT(nn.Module):
    """The Megatron GPT above in plain PyTorch, with unfused (logical) q/k/v and gate/up."""

    def __init__(self):
        super().__init__()
        self.embedding = _Embedding()
        self.decoder = _Decoder()
        self.output_layer = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x, y):
        h = self.embedding.word_embeddings(x) + self.embedding.position_embeddings(torch.arange(x.shape[1]))
        for layer in self.decoder.layers:
            h = layer(h)
        logits = self.output_layer(self.decoder.final_layernorm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none").view(y.shape)


def _logical(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split the fused reference (global Megatron names) into PlainGPT's logical tensors."""
    out = {}
    for k, v in ref.items():
        if ".linear_qkv." in k and v.dim() > 0:
            per = (HEADS // GROUPS + 2) * HD
            q, kk, vv = v.view(GROUPS, per, *v.shape[1:]).split([HEADS // GROUPS * HD, HD, HD], dim=1)
            for part, t in (("linear_q", q), ("linear_k", kk), ("linear_v", vv)):
                out[k.replace("linear_qkv", part)] = t.reshape(-1, *v.shape[1:]).contiguous()
        elif ".linear_fc1." in k and v.dim() > 0:
            gate, up = v.chunk(2, 0)
            out[k.replace("linear_fc1", "linear_gate")], out[k.replace("linear_fc1", "linear_up")] = gate, up
        elif ".linear_qkv." in k or ".linear_fc1." in k:  # step: one per logical part
            parts = ("linear_q", "linear_k", "linear_v") if "linear_qkv" in k else ("linear_gate", "linear_up")
            fused = "linear_qkv" if "linear_qkv" in k else "linear_fc1"
            for part in parts:
                out[k.replace(fused, part)] = v
        else:
            out[k] = v
    return out


def load_job(rank: int, world: int, root: str) -> dict:
    """Load into PlainGPT (FSDP2 over the world, or one process); bit-exact, then the forward."""
    from shardpoint.testing import full_state

    torch.manual_seed(1234)
    model = PlainGPT()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.decoder.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sp.load(os.path.join(root, "mcore"), {"model": model, "optimizer": opt})
    ref = {}
    for stage in range(PP):
        ref.update(load_file(os.path.join(root, f"ref{stage}.safetensors")))
    want = _logical(ref)
    got = full_state(model, opt)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"not bit-exact: {bad[:5]}"
    x, y = batch(1)
    with torch.no_grad():
        losses = model(x, y)
    ref_losses = load_file(os.path.join(root, "losses.safetensors"))["losses"]
    diff = float((losses - ref_losses).abs().max())
    assert diff < 1e-5, f"forward differs from Megatron's by {diff}"
    return {"n": len(got), "max_diff": diff}


def _expert_refusal(root: str, cfg) -> str | None:
    """Expert-parallel parameters (``allreduce=False``) are refused with a clear error."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    lin = ColumnParallelLinear(8, 16, config=cfg, init_method=nn.init.normal_, bias=False)
    lin.weight.allreduce = False
    try:
        sp.save(os.path.join(root, "expert"), {"model": lin})
    except sp.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return None


__all__ = ["save_job", "load_job", "build_megatron", "PlainGPT", "RULES"]
