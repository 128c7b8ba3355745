"""Rank functions for fused-QKV (GQA) and padded-vocabulary layouts under TP."""

from __future__ import annotations

import os

import torch

import shardpoint as sp
from shardpoint.layouts import Padded
from tests.dist.checks import check_continued_losses, check_reference, write_reference
from shardpoint.testing import GPTConfig, build, full_state, train_step

BASE = dict(vocab=62, dim=64, heads=8, kv_heads=4, layers=2, seq=16)
FUSED = GPTConfig(**BASE, fused=True)
PLAIN = GPTConfig(**BASE)
PADDED = GPTConfig(**BASE, vocab_pad=64)


def _logical(state: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """Unfuse and unpad full tensors by hand (independently of shardpoint's rules)."""
    hd, g = c.dim // c.heads, c.heads // c.kv
    out = {}
    for k, v in state.items():
        if "attn.wqkv.weight" in k and v.dim() == 0:  # per-parameter step counter
            for name in ("wq", "wk", "wv"):
                out[k.replace("wqkv", name)] = v.clone()
        elif "attn.wqkv.weight" in k:
            grp = v.reshape(c.kv, g + 2, hd, c.dim)
            for name, part in (("wq", grp[:, :g]), ("wk", grp[:, g]), ("wv", grp[:, g + 1])):
                out[k.replace("wqkv", name)] = part.reshape(-1, c.dim).contiguous()
        elif "tok.weight" in k and v.dim() == 2 and c.vocab_pad:
            out[k] = v[: c.vocab].contiguous()
        else:
            out[k] = v
    return out


def _rules(c: GPTConfig):
    rules = [c.qkv_rule()] if c.fused else []
    if c.vocab_pad:
        rules.append(Padded("model.tok.weight", dim=0, size=c.vocab))
    return rules


def save_job(rank: int, world: int, root: str, kind: str) -> dict:
    c = {"fused": FUSED, "padded": PADDED}[kind]
    model, opt = build("tp", c, seed=0)
    for s in range(2):
        train_step(model, opt, s, c)
    name = f"{kind}{world}"
    sp.save(os.path.join(root, name), {"model": model, "optimizer": opt}, layouts=_rules(c))
    ref = _logical(full_state(model, opt), c)
    losses = [train_step(model, opt, 2 + i, c) for i in range(2)]
    if rank == 0:
        write_reference(root, name, ref, losses)
    return {}


def load_job(rank: int, world: int, root: str, cases: list[list[str]]) -> dict:
    out = {}
    for src, target in cases:
        c = {"fused": FUSED, "plain": PLAIN, "padded": PADDED}[target]
        layout = "tp" if world > 1 else "single"
        model, opt = build(layout, c, seed=77)
        sp.load(os.path.join(root, src), {"model": model, "optimizer": opt}, layouts=_rules(c))
        got = _logical(full_state(model, opt), c)
        check_reference(root, src, got, f"{src} -> {target}{world}")
        if c.vocab_pad:  # padding rows come back zeroed
            tok = full_state(model, opt)["model.tok.weight"]
            assert torch.count_nonzero(tok[c.vocab:]) == 0
        losses = [train_step(model, opt, 2 + i, c) for i in range(2)]
        check_continued_losses(root, src, losses, f"{src} -> {target}{world}")
        out[f"{src}->{target}{world}"] = losses
    return out
