"""Rank functions for the multi-process tests (run by shardpoint.testing.launch)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import shardpoint as sp
from shardpoint.testing import GPTConfig, build, full_state, train_step
from tests.dist.checks import check_continued_losses, check_reference, load_record, write_reference

CFG = GPTConfig(vocab=96, dim=32, heads=4, layers=2, seq=16)
TRAIN_STEPS = 3


def save_job(rank: int, world: int, root: str, layouts: list[str]) -> dict:
    """Train each layout a few steps, save it, and record the full reference and next losses."""
    out = {}
    for layout in layouts:
        name = f"{layout}{world}"
        model, opt = build(layout, CFG, seed=0)
        for s in range(TRAIN_STEPS):
            train_step(model, opt, s, CFG)
        res = sp.save(os.path.join(root, name), {"model": model, "optimizer": opt, "extra": {"step": TRAIN_STEPS, "layout": layout}})
        ref = full_state(model, opt)
        losses = [train_step(model, opt, TRAIN_STEPS + i, CFG) for i in range(2)]
        if rank == 0:
            write_reference(root, name, ref, losses)
        out[name] = res.bytes_written
    return out


def load_job(rank: int, world: int, root: str, cases: list[list[str]]) -> dict:
    """Load each saved checkpoint into a new layout; compare bit-exactly, then train on."""
    out = {}
    for src, layout in cases:
        model, opt = build(layout, CFG, seed=1234)  # different init: the load must overwrite all
        state = {"model": model, "optimizer": opt, "extra": {}}
        report = sp.LoadResult()
        sp.load(os.path.join(root, src), state, report=report)
        assert state["extra"] == {"step": TRAIN_STEPS, "layout": src[:-1]}, state["extra"]
        got = full_state(model, opt)
        check_reference(root, src, got, f"{src} -> {layout}{world}")
        losses = [train_step(model, opt, TRAIN_STEPS + i, CFG) for i in range(2)]
        check_continued_losses(root, src, losses, f"{src} -> {layout}{world}")
        out[f"{src}->{layout}{world}"] = load_record(losses, report)
    return out


def error_job(rank: int, world: int, root: str) -> dict:
    """Failures on one rank must raise the same typed error on every rank, with no hang."""
    out = {}
    model, opt = build("fsdp2", CFG, seed=0)
    path = os.path.join(root, "err")
    sp.save(path, {"model": model, "optimizer": opt})
    # 1. A key mismatch on rank 1 only.
    state = {"model": model, "optimizer": opt}
    if rank == 1:
        state["extra"] = {"x": 1}
    try:
        sp.load(path, state)
        out["mismatch"] = "no error"
    except sp.KeyMismatchError as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
        out["mismatch_lists"] = [e.missing, e.unexpected]
    # 2. A corrupt chunk that only rank 1 reads (its own FSDP2 shard of one weight).
    dist.barrier()
    m = sp.read_manifest(path)
    chunk = next(c for c in m.tensors["model.layers.0.mlp.w1.weight"].chunks if c.box.offsets[0] > 0)
    if rank == 0:
        fp = os.path.join(path, chunk.file)
        with open(fp, "r+b") as f:
            f.seek(chunk.offset + 5)
            b = f.read(1)
            f.seek(chunk.offset + 5)
            f.write(bytes([b[0] ^ 0x40]))
    dist.barrier()
    try:
        sp.load(path, {"model": model, "optimizer": opt})
        out["corrupt"] = "no error"
    except sp.CorruptCheckpointError as e:
        out["corrupt"] = f"{type(e).__name__}: {e}"
    # 3. A save that fails on one rank leaves no checkpoint and raises everywhere.
    bad = {"model": model, "optimizer": opt}
    if rank == 1:
        bad["extra"] = {"obj": object()}
    try:
        sp.save(os.path.join(root, "failed"), bad)
        out["save"] = "no error"
    except sp.UnsupportedStateError as e:
        out["save"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    try:
        sp.load(os.path.join(root, "failed"), {"model": model})
        out["after"] = "loaded"
    except (sp.IncompleteCheckpointError, sp.CheckpointNotFoundError) as e:
        out["after"] = type(e).__name__
    return out


def read_once_job(rank: int, world: int, root: str, src: str, layout: str) -> dict:
    """Storage bytes each rank reads with and without shared reads (counted in the storage layer)."""
    from shardpoint.storage import LocalStorage

    out = {}
    ref = load_file(os.path.join(root, f"{src}.ref.safetensors"))
    import shardpoint.engine.load as engine_load

    for share in (True, False, "auto", "auto-hosts"):
        model, opt = build(layout, CFG, seed=7)
        storage = LocalStorage(os.path.join(root, src))
        report = sp.LoadResult()
        host_id = engine_load._host_id
        if share == "auto-hosts":  # pretend every rank runs on its own host
            engine_load._host_id = lambda: 1000 + rank
        try:
            sp.load(storage, {"model": model, "optimizer": opt, "extra": {}}, share_reads=share.split("-")[0] if isinstance(share, str) else share, report=report)
        finally:
            engine_load._host_id = host_id
        got = full_state(model, opt)
        assert all(torch.equal(got[k], ref[k]) for k in ref), f"share={share}: not bit-exact"
        out[str(share)] = {
            "storage_bytes": storage.stats.bytes_read,
            "index_bytes": report.index_bytes,
            "needed": report.bytes_needed,
            "received": report.bytes_received,
        }
    m = sp.read_manifest(os.path.join(root, src))
    out["checkpoint_bytes"] = m.total_bytes
    out["manifest_bytes"] = len(open(os.path.join(root, src, "manifest.json"), "rb").read())
    return out


def reduced_job(rank: int, world: int, root: str) -> dict:
    """Per-rank statistics saved as their mean across ranks (the Reduced rule)."""
    ema = torch.full((3,), float(rank))
    count = torch.tensor(rank + 1)
    path = os.path.join(root, "reduced")
    sp.save(path, {"extra": {"ema": ema, "count": count}},
            layouts=[sp.Reduced("extra.ema", op="mean"), sp.Reduced("extra.count", op="sum")])
    out = sp.load(path, {"extra": {}})
    assert torch.equal(ema, torch.full((3,), float(rank)))  # the live tensor is untouched
    return {"ema": out["extra"]["ema"].tolist(), "count": int(out["extra"]["count"])}
