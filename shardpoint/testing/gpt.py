"""A tiny but real GPT for tests, examples and benchmarks, and its deterministic batches.

``TinyGPT`` has an embedding, attention (optionally grouped-query, optionally
one fused ``wqkv``), an MLP, layer norms and an optionally tied head. Its
weights depend only on the seed, whatever the process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "Attention", "MLP", "Block", "TinyGPT", "batch", "loss_of"]


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`TinyGPT`: vocabulary, width, heads, layers, sequence length and variants."""

    vocab: int = 96
    dim: int = 32
    heads: int = 4
    layers: int = 2
    seq: int = 16
    tied: bool = False
    hidden: int = 0  # MLP width; 0 means 4 * dim
    kv_heads: int = 0  # grouped-query attention; 0 means heads (plain multi-head)
    fused: bool = False  # one wqkv projection, group-interleaved (Megatron style)
    vocab_pad: int = 0  # embedding rows padded to this size (0: none)

    @property
    def mlp(self) -> int:
        return self.hidden or 4 * self.dim

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def emb_rows(self) -> int:
        return max(self.vocab, self.vocab_pad)

    def qkv_rule(self):
        """The layout rule that maps ``wqkv`` onto ``wq``, ``wk`` and ``wv``."""
        from ..layouts import Fused

        hd, g = self.dim // self.heads, self.heads // self.kv
        return Fused("*.attn.wqkv.weight", dim=0, groups=self.kv, parts=[("wq", g * hd), ("wk", hd), ("wv", hd)])


class Attention(nn.Module):
    """Causal self-attention with separate or fused (``wqkv``) projections."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.head_dim = hd = c.dim // c.heads
        self.group = c.heads // c.kv
        if c.fused:
            self.wqkv = nn.Linear(c.dim, c.kv * (self.group + 2) * hd, bias=False)
        else:
            self.wq = nn.Linear(c.dim, c.heads * hd, bias=False)
            self.wk = nn.Linear(c.dim, c.kv * hd, bias=False)
            self.wv = nn.Linear(c.dim, c.kv * hd, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        hd, g = self.head_dim, self.group
        # Head counts come from the local width, so column-wise TP shards work unchanged.
        if hasattr(self, "wqkv"):
            y = self.wqkv(x).view(b, t, -1, g + 2, hd)
            q = y[:, :, :, :g].reshape(b, t, -1, hd).transpose(1, 2)
            k = y[:, :, :, g].transpose(1, 2)
            v = y[:, :, :, g + 1].transpose(1, 2)
        else:
            q = self.wq(x).view(b, t, -1, hd).transpose(1, 2)
            k = self.wk(x).view(b, t, -1, hd).transpose(1, 2)
            v = self.wv(x).view(b, t, -1, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g > 1)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Two linear layers around a GELU."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.mlp)
        self.w2 = nn.Linear(c.mlp, c.dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """One pre-norm transformer block: attention, then MLP, each with a residual."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.dim)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT. Deterministic for a given seed, whatever the process."""

    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.emb_rows, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.layers:
            x = blk(x)
        return self.head(self.norm(x))


def batch(step: int, c: GPTConfig, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, c.vocab, (n, c.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_of(model, x, y) -> torch.Tensor:
    """Cross-entropy of ``model(x)`` against ``y`` (a DTensor output is gathered first)."""
    logits = model(x)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

