"""Rank functions for FSDP1 flat parameters and pipeline stages (run by shardpoint.testing.launch).

Checkpoints are saved under one layout and loaded under another; after a load,
model and optimizer must equal the source's full reference bit for bit, and
the next training steps must give the source's losses.
"""

from __future__ import annotations

import os

import torch

import shardpoint as sp
from shardpoint.testing import PP_LAYOUTS, GPTConfig, build, full_state, replica_ranks, train_step
from tests.dist.checks import check_continued_losses, check_reference, load_record, write_reference

# Odd sizes, so that FSDP1 slices cut parameters in the middle of rows.
CFG = GPTConfig(vocab=61, dim=24, heads=4, layers=4, seq=8)
TRAIN_STEPS = 2
NEXT_STEPS = 2


def _replicated_over(layout: str, model, world: int):
    """Pipeline stages declare who holds their copies: a plain list for ``pp``, else per entry.

    In the per-entry form ``extra`` stays replicated over the whole world, so
    its tensor is written once although the stages hold different layers.
    """
    ranks = replica_ranks(model)
    if ranks is None or layout == "pp":
        return ranks
    return {"model": ranks, "optimizer": ranks}


def _extra(layout: str) -> dict:
    extra = {"step": TRAIN_STEPS, "layout": layout}
    if layout != "pp":  # with one list for all entries, a world-wide tensor would be written per stage
        extra["shared"] = torch.arange(7.0)
    return extra


def save_job(rank: int, world: int, root: str, layouts: list[str]) -> dict:
    """Train each layout a few steps, save it, and record the full reference and the next losses."""
    out = {}
    for layout in layouts:
        name = f"{layout}{world}"
        model, opt = build(layout, CFG, seed=0)
        for s in range(TRAIN_STEPS):
            train_step(model, opt, s, CFG)
        state = {"model": model, "optimizer": opt, "extra": _extra(layout)}
        res = sp.save(os.path.join(root, name), state, replicated_over=_replicated_over(layout, model, world))
        ref = full_state(model, opt)
        losses = [train_step(model, opt, TRAIN_STEPS + i, CFG) for i in range(NEXT_STEPS)]
        if rank == 0:
            write_reference(root, name, ref, losses)
        m = sp.read_manifest(os.path.join(root, name))
        flat = sum(1 for t in m.tensors.values() for c in t.chunks if c.flat is not None)
        out[name] = {"bytes": res.bytes_written, "flat_chunks": flat, "total": m.total_bytes}
    return out


def load_job(rank: int, world: int, root: str, cases: list[list[str]]) -> dict:
    """Load each saved checkpoint into another layout; compare bit-exactly, then train on."""
    out = {}
    for src, layout in cases:
        model, opt = build(layout, CFG, seed=1234)  # different init: the load must overwrite all
        state = {"model": model, "optimizer": opt, "extra": {}}
        report = sp.LoadResult()
        sp.load(os.path.join(root, src), state, report=report)
        extra = state["extra"]
        assert extra["step"] == TRAIN_STEPS, extra
        want_extra = _extra(extra["layout"])
        assert sorted(extra) == sorted(want_extra), extra
        if "shared" in extra:
            assert torch.equal(extra["shared"], want_extra["shared"])
        got = full_state(model, opt)
        check_reference(root, src, got, f"{src} -> {layout}{world}")
        losses = [train_step(model, opt, TRAIN_STEPS + i, CFG) for i in range(NEXT_STEPS)]
        check_continued_losses(root, src, losses, f"{src} -> {layout}{world}")
        out[f"{src}->{layout}{world}"] = load_record(losses, report)
    return out


def pp_guard_job(rank: int, world: int, root: str) -> dict:
    """Without ``replicated_over``, a pipeline save must fail loudly rather than drop layers."""
    model, opt = build("pp", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    try:
        sp.save(os.path.join(root, "pp_no_replicas"), {"model": model, "optimizer": opt})
        return {"error": None}
    except sp.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def fsdp1_stateless_job(rank: int, world: int, root: str) -> dict:
    """A never-stepped FSDP1 optimizer saves no state; loading it into a trained one clears the state."""
    out = {}
    for layout in ("fsdp1", "fsdp1_orig"):
        model, opt = build(layout, CFG, seed=0)
        path = os.path.join(root, f"fresh_{layout}")
        sp.save(path, {"model": model, "optimizer": opt})
        m = sp.read_manifest(path)
        out[layout] = sorted(k for k in m.tensors if k.startswith("optimizer."))
        model2, opt2 = build(layout, CFG, seed=5)
        train_step(model2, opt2, 0, CFG)
        sp.load(path, {"model": model2, "optimizer": opt2})
        out[layout + "_state_after"] = sum(len(s) for s in opt2.state.values())
    return out


__all__ = ["save_job", "load_job", "pp_guard_job", "fsdp1_stateless_job", "PP_LAYOUTS"]
