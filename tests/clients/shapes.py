"""Small stand-ins for real clients' state shapes: fused weights with state-dict hooks, a module that
loads through its own ``_load_from_state_dict``, one that drops a key, and an optimizer container.

Shared by the one-process tests in this folder and the multi-process cases in ``tests/dist``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FusedQKV",
    "titan_qkv",
    "ScaledLinear",
    "Forgetful",
    "HookedNet",
    "PartsOptimizer",
    "TwoParts",
    "batch",
    "loss_of",
    "tensors_of",
]

DIM = 16


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class FusedQKV(nn.Module):
    """Q, K and V in one weight; its state dict holds them split (``wq``/``wk``/``wv``), as torchtitan's does.

    The post-hook splits the fused weight into copies (gathered to replicated
    first under FSDP2, so the split is local); the load pre-hook merges them
    back.
    """

    def __init__(self, dim: int, q: int, kv: int):
        super().__init__()
        self.sizes = (q, kv, kv)
        self.wqkv = nn.Linear(dim, q + 2 * kv, bias=False)
        self.register_state_dict_post_hook(FusedQKV._split)
        self.register_load_state_dict_pre_hook(FusedQKV._merge)

    def forward(self, x):
        return self.wqkv(x).split(self.sizes, dim=-1)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata) -> None:
        w = state_dict.pop(f"{prefix}wqkv.weight")
        if _is_dtensor(w):
            from torch.distributed.tensor import Replicate

            w = w.redistribute(w.device_mesh, [Replicate()] * w.device_mesh.ndim)
        for name, piece in zip(("wq", "wk", "wv"), w.split(module.sizes, dim=0)):
            state_dict[f"{prefix}{name}.weight"] = piece.clone()  # copies, as a regrouping split makes

    @staticmethod
    def _merge(module, state_dict, prefix, *args) -> None:
        names = [f"{prefix}{n}.weight" for n in ("wq", "wk", "wv")]
        if not all(n in state_dict for n in names):
            return
        # Under FSDP2 the merged weight stays replicated: copying it into the sharded parameter
        # (inside load_state_dict) keeps this rank's rows.
        state_dict[f"{prefix}wqkv.weight"] = torch.cat([state_dict.pop(n) for n in names], dim=0)


class ScaledLinear(nn.Module):
    """A linear layer with a derived, unsaved cache that its ``_load_from_state_dict`` rebuilds.

    ``offset`` is saved; ``cache`` (twice the offset, like a quantised layer's
    unpacked weights) is not, and the override recomputes it from the loaded
    offset. A load that fills ``offset`` without running the override leaves
    a stale cache, and the next loss differs.
    """

    def __init__(self, i: int, o: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / i**0.5)
        self.register_buffer("offset", torch.randn(o))
        self.register_buffer("cache", self.offset * 2, persistent=False)

    def forward(self, x):
        return F.linear(x, self.weight) + self.cache

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        with torch.no_grad():
            self.cache.copy_(self.offset * 2)


class Forgetful(nn.Linear):
    """A linear layer whose ``_load_from_state_dict`` silently drops its bias: a load that cannot land."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(f"{prefix}bias", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def titan_qkv(dim: int) -> nn.Module:
    """torchtitan's own fused QKV linear (with its own split/merge state-dict hooks), shaped like FusedQKV's."""
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.common.linear import Linear

    hd, heads, kv = 4, dim // 4, dim // 8
    out = kv * (heads // kv + 2) * hd
    cfg = FusedQKVLinear.Config(head_dim=hd, n_heads=heads, n_kv_heads=kv, wqkv=Linear.Config(in_features=dim, out_features=out))
    return FusedQKVLinear(cfg)


class Block(nn.Module):
    def __init__(self, dim: int, titan: bool = False):
        super().__init__()
        self.attn = titan_qkv(dim) if titan else FusedQKV(dim, dim, dim // 2)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x):
        q, k, v = (t.flatten(-2) if t.dim() == 4 else t for t in self.attn(x))  # torchtitan's: per head
        return x + torch.tanh(self.out(torch.cat([q, k * v.sum(-1, keepdim=True).tanh(), v], dim=-1)))


class HookedNet(nn.Module):
    """Two blocks with fused, hook-split QKV weights (ours or torchtitan's), a cached head; optionally a forgetful layer."""

    def __init__(self, dim: int = DIM, forgetful: bool = False, titan: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, titan) for _ in range(2)])
        self.head = ScaledLinear(dim, dim)
        self.tail = Forgetful(dim, 1) if forgetful else nn.Linear(dim, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.tail(torch.tanh(self.head(x)))


class TwoParts(nn.Module):
    """A model in two parts with distinct names, each given its own optimizer by :class:`PartsOptimizer`."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.front = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.back = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1))

    def parts(self) -> list[nn.Module]:
        return [_Part("front", self.front), _Part("back", self.back)]

    def forward(self, x):
        return self.back(self.front(x))


class _Part(nn.Module):
    """A model part whose parameter names are those of the whole model (as pipeline stages keep them)."""

    def __init__(self, name: str, inner: nn.Module):
        super().__init__()
        self.add_module(name, inner)


class PartsOptimizer(torch.optim.Optimizer):
    """One AdamW per model part behind one optimizer, shaped like torchtitan's optimizer container.

    Its own ``.state`` stays empty; ``state_dict``/``load_state_dict`` go
    through DCP's flattened ``get_/set_optimizer_state_dict`` (keys like
    ``state.<fqn>.exp_avg`` and ``param_groups.<fqn>.lr``).
    """

    def __init__(self, parts: list[nn.Module], lr: float = 1e-2):
        self.parts = parts
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=lr, weight_decay=0.1) for p in parts]
        torch.optim.Optimizer.__init__(self, [q for p in parts for q in p.parameters()], {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out = {}
        for m, o in zip(self.parts, self.optimizers):
            out.update(get_optimizer_state_dict(m, o, options=self._options()))
        return out

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        for m, o in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(m, o, state_dict, options=self._options())


def batch(step: int, dim: int = DIM, n: int = 8) -> torch.Tensor:
    """A deterministic input for ``step``, the same on every rank."""
    return torch.randn(n, 4, dim, generator=torch.Generator().manual_seed(500 + step))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    return model(batch(step)).pow(2).mean()


def tensors_of(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every model parameter and buffer and every optimizer state tensor, full and cloned (collective).

    Read directly from the modules and the (inner) optimizers, not through
    any state-dict hook, so it shows the live state.
    """
    def full(t):
        t = t.detach()
        return (t.full_tensor() if _is_dtensor(t) else t).clone()

    out = {f"model.{n}": full(p) for n, p in model.named_parameters()}
    out.update({f"model.{n}": full(b) for n, b in model.named_buffers()})
    names = {id(p): n for n, p in model.named_parameters()}
    for i, o in enumerate(getattr(opt, "optimizers", [opt])):
        for p, s in o.state.items():
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    out[f"opt.{names[id(p)]}.{k}"] = full(v)
    return out
