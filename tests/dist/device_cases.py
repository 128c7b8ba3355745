"""Rank functions for saves and loads through the simulated asynchronous device (2 gloo ranks, FSDP2 + AdamW)."""

from __future__ import annotations

import os

import torch

import shardpoint as sp
from shardpoint.device import SimulatedDevice
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=256, dim=128, heads=4, layers=2, seq=8)


def _diff(path, ref) -> list[str]:
    model, opt = build("fsdp2", CFG, seed=99)
    train_step(model, opt, 0, CFG)  # optimizer state exists, with other values
    sp.load(path, {"model": model, "optimizer": opt})
    got = full_state(model, opt)
    return [k for k in ref if not torch.equal(ref[k], got[k])]


def device_job(rank: int, world: int, root: str) -> dict:
    """Eager and lazy saves of sharded state copied by a slow simulated device, with the loop going on at once."""
    sim = SimulatedDevice(delay=0.002)
    model, opt = build("fsdp2", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    state = {"model": model, "optimizer": opt}
    saver = sp.AsyncSaver(staging_bytes=8 << 20, piece_bytes=64 << 10, device=sim, prewarm_state=state)
    out: dict = {"diffs": {}, "pinned": []}
    for k, mode in enumerate(("eager", "lazy", "eager", "lazy")):
        ref = full_state(model, opt)
        path = os.path.join(root, f"{mode}{k}")
        h = saver.save(path, state, mode=mode)
        train_step(model, opt, k + 1, CFG)  # at once: the lazy step waits for the copy through its pre-hook
        if mode == "eager":
            with torch.no_grad():  # eager allows any change once the call returned
                for p in model.parameters():
                    p.to_local().mul_(0.5)
        h.wait()
        out["diffs"][path] = _diff(path, ref)
        out["pinned"].append(sim.pinned_bytes)
    out["copies"] = sim.copies
    saver.close()
    out["pinned_after_close"] = sim.pinned_bytes
    return out
