"""Rank functions for the incremental-save tests (run by tests/dist/test_incremental.py on gloo)."""

from __future__ import annotations

import json
import os

import torch

import shardpoint as sp
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=64, dim=32, heads=4, layers=2, seq=16)
BLOCK = 1 << 12


def _data_sizes(path: str) -> dict[int, int]:
    """Bytes of each rank's data file in a checkpoint folder (by rank)."""
    d = os.path.join(path, "data")
    return {int(n[-9:-4]): os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".bin")}


def save_job(rank: int, world: int, root: str) -> dict:
    """FSDP2 on two ranks: a base, a save where only rank 1's shard of one weight changed, then a resharded (DDP) save."""
    model, opt = build("fsdp2", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    state = {"model": model, "optimizer": opt}
    a, b, c = (os.path.join(root, n) for n in "abc")
    sp.save(a, state, block_size=BLOCK)
    name, p = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    local = p.to_local()
    if rank == 1:
        with torch.no_grad():
            local.add_(1.0)
    changed = local.numel() * local.element_size() if rank == 1 else 0
    rb = sp.save(b, state, block_size=BLOCK, base=a)
    want_b = full_state(model, opt)
    # The same values on another layout: every chunk lies elsewhere, so all is written.
    model2, opt2 = build("ddp", CFG, seed=3)
    sp.load(b, {"model": model2, "optimizer": opt2})
    rc = sp.save(c, {"model": model2, "optimizer": opt2}, block_size=BLOCK, base=b)
    out = {"changed": changed, "param": name, "referenced_b": rb.bytes_referenced, "written_b": rb.bytes_written,
           "referenced_c": rc.bytes_referenced}
    if rank == 0:
        torch.save(want_b, os.path.join(root, "want_b.pt"))
    return out


def manifest_refs(path: str) -> list:
    """The ``refs`` member of a checkpoint's manifest (empty when it has none)."""
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return json.loads(f.read()).get("refs", [])
