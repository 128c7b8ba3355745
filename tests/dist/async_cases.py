"""Rank functions for asynchronous-save tests."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.storage import LocalStorage
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=96, dim=64, heads=4, layers=2, seq=16)


class FailingStorage(LocalStorage):
    """Local storage whose data writes fail after ``limit`` bytes (on chosen ranks)."""

    def __init__(self, root: str, limit: int):
        super().__init__(root)
        self.limit = limit

    def open_writer(self, name):
        w = super().open_writer(name)
        inner_write, budget = w.write, [self.limit]

        def write(data):
            n = len(memoryview(data).cast("B"))
            if budget[0] < n:
                raise OSError(28, "No space left on device (injected)")
            budget[0] -= n
            inner_write(data)

        w.write = write
        return w


def _check(path, ref, layout="fsdp2"):
    model, opt = build(layout, CFG, seed=99)
    sp.load(path, {"model": model, "optimizer": opt})
    got = full_state(model, opt)
    bad = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not bad, f"{path}: differs in {bad[:5]}"


def async_job(rank: int, world: int, root: str) -> dict:
    out = {}
    model, opt = build("fsdp2", CFG, seed=0)
    train_step(model, opt, 0, CFG)
    saver = sp.AsyncSaver(staging_bytes=64 << 20, piece_bytes=1 << 20)
    # 1. Eager and lazy: the checkpoint holds the state at the call, although training goes on.
    for i, mode in enumerate(("eager", "lazy")):
        ref = full_state(model, opt)
        path = os.path.join(root, f"{mode}")
        h = saver.save(path, {"model": model, "optimizer": opt}, mode=mode, block_size=1 << 16)
        with torch.no_grad():  # an in-place change right after the call returns
            for p in model.parameters():
                p.add_(1.0) if mode == "eager" else None
        if mode == "eager":
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(1.0)
        train_step(model, opt, 1 + i, CFG)
        res = h.wait()
        out[mode] = {"blocked": res.timings["blocked"], "total": res.timings["total"]}
        _check(path, ref)
    # 2. Collectives in the training loop while saves complete in the background.
    for k in range(3):
        ref = full_state(model, opt)
        h = saver.save(os.path.join(root, f"loop{k}"), {"model": model, "optimizer": opt}, mode="lazy")
        t = torch.ones(1000)
        # The same number of all-reduces on every rank (a rank-local "until done" would
        # itself desynchronise the loop), overlapping the background commit collectives.
        for _ in range(150):
            dist.all_reduce(t)
            time.sleep(0.002)
        h.wait()
        train_step(model, opt, 10 + k, CFG)
        _check(os.path.join(root, f"loop{k}"), ref)
    out["loop"] = "ok"
    # The FSDP2 module and optimizer parts were reused by the later saves, and still bit-exact.
    out["reused"] = saver._plan_cache.reused["part"]
    # 3. A budget far smaller than the state still completes, within the budget.
    small = sp.AsyncSaver(staging_bytes=256 << 10, piece_bytes=64 << 10)
    ref = full_state(model, opt)
    small.save(os.path.join(root, "small"), {"model": model, "optimizer": opt}, trace_dir=os.path.join(root, "trace")).wait()
    _check(os.path.join(root, "small"), ref)
    out["small_high_water"] = small._ring.high_water
    out["small_capacity"] = small._ring.capacity
    out["state_bytes"] = sum(v.numel() * v.element_size() for v in ref.values())
    # 4. A storage that fails halfway on rank 1: wait() raises on every rank; the old checkpoint survives.
    good = os.path.join(root, "good")
    ref_good = full_state(model, opt)
    saver.save(good, {"model": model, "optimizer": opt}).wait()
    train_step(model, opt, 20, CFG)
    storage = FailingStorage(good, limit=10_000 if rank == 1 else 1 << 40)
    h = saver.save(storage, {"model": model, "optimizer": opt})
    try:
        h.wait()
        out["failure"] = "no error"
    except sp.CheckpointError as e:
        out["failure"] = f"{type(e).__name__}: {e}"
    except OSError as e:
        out["failure"] = f"OSError: {e}"
    _check(good, ref_good)
    # 5. The next save after a failure works again.
    ref = full_state(model, opt)
    saver.save(os.path.join(root, "after"), {"model": model, "optimizer": opt}).wait()
    _check(os.path.join(root, "after"), ref)
    return out
