"""Rank functions for the snapshot guard under FSDP2: in-place changes after a lazy or eager save."""

from __future__ import annotations

import os

import torch

import shardpoint as sp
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=96, dim=64, heads=4, layers=2, seq=16)


def _ema(model, opt):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)


def _moments(model, opt):
    for st in opt.state.values():
        st["exp_avg_sq"].mul_(2.0)


def _clamp_data(model, opt):
    for p in model.parameters():
        p.data.clamp_(-0.01, 0.01)


CHANGES = {"ema": _ema, "moments": _moments, "clamp_data": _clamp_data}


def _equal(path, ref) -> list[str]:
    model, opt = build("fsdp2", CFG, seed=99)
    sp.load(path, {"model": model, "optimizer": opt})
    got = full_state(model, opt)
    return [k for k in ref if not torch.equal(ref[k], got[k])]


def guard_job(rank: int, world: int, root: str) -> dict:
    """Each change in lazy mode fails every rank's wait() and keeps the previous checkpoint; eager commits the call's state."""
    out: dict = {}
    model, opt = build("fsdp2", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    saver = sp.AsyncSaver(staging_bytes=32 << 20)
    path = os.path.join(root, "ckpt")
    try:
        for i, (name, change) in enumerate(CHANGES.items()):
            for mode in ("lazy", "eager"):
                before = full_state(model, opt)
                saver.save(path, {"model": model, "optimizer": opt}).wait()
                train_step(model, opt, 1 + i, CFG)
                at_call = full_state(model, opt)
                h = saver.save(path, {"model": model, "optimizer": opt}, mode=mode)
                change(model, opt)
                try:
                    h.wait()
                    out[f"{name}/{mode}"] = ("committed", _equal(path, at_call))
                except sp.TornSnapshotError as e:
                    out[f"{name}/{mode}"] = ("torn", _equal(path, before), str(e))
                # Steps after a fence are the normal lazy case, and commit the call's state.
                at_call = full_state(model, opt)
                h = saver.save(path, {"model": model, "optimizer": opt}, mode="lazy")
                train_step(model, opt, 10 + i, CFG)
                h.wait()
                out[f"{name}/{mode}/steps"] = _equal(path, at_call)
    finally:
        saver.close()
    return out
