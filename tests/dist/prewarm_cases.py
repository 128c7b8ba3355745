"""Rank functions for pre-warmed asynchronous savers (2 gloo ranks, FSDP2 + AdamW)."""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

import shardpoint as sp
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=512, dim=256, heads=4, layers=2, seq=16)


def _save_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("shardpoint-save"))


def _check(path, ref) -> list[str]:
    model, opt = build("fsdp2", CFG, seed=99)
    sp.load(path, {"model": model, "optimizer": opt})
    got = full_state(model, opt)
    return [k for k in ref if not torch.equal(ref[k], got[k])]


def prewarm_job(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    model, opt = build("fsdp2", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    state = {"model": model, "optimizer": opt}
    # 1. Constructed pre-warmed: the group, both workers and the touched staging exist before any save.
    threads0 = _save_threads()
    saver = sp.AsyncSaver(staging_bytes=64 << 20, prewarm_state=state)
    out["prewarmed"] = {
        "group": saver.prewarmed.group, "workers": saver.prewarmed.workers, "staged": saver.prewarmed.staged_bytes,
        "state": saver.prewarmed.state_bytes, "threads": _save_threads() - threads0,
        "groups": len(saver._owned), "allocations": saver._ring.allocations,
    }
    # 2. Saves make nothing new; the first one reuses the plan made by the pre-warm.
    calls, blocked, cached = [], [], []
    ref = None
    for k in range(5):
        if k == 0:
            ref = full_state(model, opt)
        t0 = time.monotonic()
        h = saver.save(os.path.join(root, f"warm{k}"), state)
        calls.append(time.monotonic() - t0)
        res = h.wait()
        blocked.append(res.timings["blocked"])
        cached.append(res.plan_cached)
        train_step(model, opt, 1 + k, CFG)
    out["after"] = {"groups": len(saver._owned), "allocations": saver._ring.allocations,
                    "high_water": saver._ring.high_water, "threads": _save_threads() - threads0}
    out["calls"], out["blocked"], out["plan_cached"] = calls, blocked, cached
    out["first_over_median"] = calls[0] / statistics.median(calls[1:])
    out["diff"] = _check(os.path.join(root, "warm0"), ref)
    saver.close()
    out["closed_threads"] = _save_threads() - threads0
    # 3. prewarm=False keeps everything for the first save.
    cold = sp.AsyncSaver(staging_bytes=64 << 20, prewarm=False)
    out["cold"] = {"prewarmed": cold.prewarmed, "groups": len(cold._owned), "ring": cold._ring is not None,
                   "threads": _save_threads() - threads0}
    cold.save(os.path.join(root, "cold"), state).wait()
    out["cold_after"] = {"groups": len(cold._owned), "allocations": cold._ring.allocations}
    cold.close()
    # 4. The manager pre-warms its group and its saver (sized by prewarm_state) on construction.
    mgr = sp.CheckpointManager(os.path.join(root, "run"), interval=1, prewarm_state=state)
    warm = mgr._saver.prewarmed
    out["manager"] = {"comm": mgr._coll.ready, "saver_group": warm.group, "staged": warm.staged_bytes,
                      "state": warm.state_bytes}
    mgr.save(1, state)
    mgr.close()
    lazy = sp.CheckpointManager(os.path.join(root, "run2"), interval=1, prewarm=False)
    out["manager_cold"] = {"comm": lazy._coll.ready, "saver": lazy._saver is not None}
    lazy.close()
    return out


def local_saver_job(rank: int, world: int, root: str) -> dict:
    """A saver made on rank 0 alone (for rank-local saves) must not wait for the other ranks."""
    import torch.distributed as dist

    model, opt = build("fsdp2", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    state = {"model": model, "optimizer": opt}
    out: dict = {}
    if rank == 0:
        saver = sp.AsyncSaver(staging_bytes=16 << 20)
        out["workers"] = _save_threads()
        out["groups"] = len(saver._owned)
        saver.save(os.path.join(root, "local"), {"step": torch.tensor([7])}, process_group=sp.LOCAL).wait()
        out["step"] = int(sp.load(os.path.join(root, "local"), {}, strict=False, process_group=sp.LOCAL)["step"])
        saver.close()
    dist.barrier()
    return out
