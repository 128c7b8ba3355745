"""Rank functions for the tiered-storage crash test."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import shardpoint as sp
from shardpoint.storage import LocalStorage
from shardpoint.storage.tiers import TieredStorage
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=64, dim=32, heads=4, layers=2, seq=16)


class SlowStorage(LocalStorage):
    """A remote tier that takes its time (so a kill lands mid-copy)."""

    def open_writer(self, name):
        time.sleep(1.0)
        return super().open_writer(name)

    def child(self, sub):
        c = SlowStorage(os.path.join(self.root, sub))
        c.stats = self.stats
        return c


def _tiers(root: str, slow: bool) -> TieredStorage:
    remote = SlowStorage(os.path.join(root, "remote")) if slow else os.path.join(root, "remote")
    return TieredStorage([os.path.join(root, "host"), remote], names=("host", "remote"))


def save_then_die(rank: int, world: int, root: str) -> dict:
    model, opt = build("fsdp2", CFG, seed=0)
    for s in range(3):
        train_step(model, opt, s, CFG)
    tiers = _tiers(root, slow=True)
    sp.save(tiers.child("step_3"), {"model": model, "optimizer": opt, "extra": {"step": 3}})
    ref = full_state(model, opt)
    if rank == 0:
        save_file(ref, os.path.join(root, "ref.safetensors"))
    dist.barrier()
    time.sleep(0.3)  # the remote copy is under way, far from done
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def restart(rank: int, world: int, root: str, layout: str) -> dict:
    tiers = _tiers(root, slow=False)
    queued = tiers.resume_replication() if rank == 0 else []
    model, opt = build(layout, CFG, seed=5)
    state = {"model": model, "optimizer": opt, "extra": {}}
    rep = sp.LoadResult()
    sp.load(tiers.child("step_3"), state, report=rep)
    got, ref = full_state(model, opt), load_file(os.path.join(root, "ref.safetensors"))
    assert all(torch.equal(got[k], ref[k]) for k in ref), "not bit-exact"
    if rank == 0:
        tiers.wait("remote")
    dist.barrier()
    return {"queued": queued, "step": state["extra"]["step"], "remote": tiers.child("step_3").durable_on("remote")}
