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


def _base_then_one_changed_shard(rank: int, root: str):
    """FSDP2 after one step, saved to ``root/a``; then rank 1's shard of the first matrix changed (rank 0's not)."""
    model, opt = build("fsdp2", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    state = {"model": model, "optimizer": opt}
    sp.save(os.path.join(root, "a"), state, block_size=BLOCK)
    name, p = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    local = p.to_local()
    if rank == 1:
        with torch.no_grad():
            local.add_(1.0)
    changed = local.numel() * local.element_size() if rank == 1 else 0
    return model, opt, state, name, changed


def save_job(rank: int, world: int, root: str) -> dict:
    """FSDP2 on two ranks: a base, a save where only rank 1's shard of one weight changed, then a resharded (DDP) save."""
    model, opt, state, name, changed = _base_then_one_changed_shard(rank, root)
    a, b, c = (os.path.join(root, n) for n in "abc")
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


def async_save_job(rank: int, world: int, root: str) -> dict:
    """FSDP2 on two ranks, background saves with base=: eager (rank 1 changed one shard), lazy (nothing changed since),
    then a lazy incremental manager over three training steps with a frozen embedding (``keep_last=1``)."""
    model, opt, state, _, changed = _base_then_one_changed_shard(rank, root)
    a, b, c = (os.path.join(root, n) for n in "abc")
    saver = sp.AsyncSaver()
    try:
        rb = saver.save(b, state, mode="eager", block_size=BLOCK, base=a).wait()
        want_b = full_state(model, opt)
        rc = saver.save(c, state, mode="lazy", block_size=BLOCK, base=b).wait()
    finally:
        saver.close()
    for name, q in model.named_parameters():
        if name.startswith(("tok.", "pos.")):
            q.requires_grad_(False)  # frozen: every later save references it
    mgr = sp.CheckpointManager(os.path.join(root, "run"), interval=1, keep_last=1, mode="lazy", incremental=True,
                               save_options={"block_size": BLOCK})
    handles = []
    for s in range(1, 4):
        train_step(model, opt, s, CFG)
        handles.append(mgr.save(s, state))  # the next step runs while it is written
    mgr.wait()
    want_run = full_state(model, opt)
    mgr.close()
    frozen = sum(q.to_local().numel() * q.element_size() for n, q in model.named_parameters() if n.startswith(("tok.", "pos.")))
    if rank == 0:
        torch.save(want_b, os.path.join(root, "want_b.pt"))
        torch.save(want_run, os.path.join(root, "want_run.pt"))
    return {"changed": changed, "referenced_b": rb.bytes_referenced,
            "referenced_c": rc.bytes_referenced, "written_c": rc.bytes_written, "frozen": frozen,
            "referenced_run": [h.wait().bytes_referenced for h in handles]}
