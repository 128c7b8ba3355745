"""Rank functions for CheckpointManager tests on gloo (see test_manager.py)."""

from __future__ import annotations

import os
import random
import time

import torch

import shardpoint as sp
from shardpoint.manager import (
    ConcurrentSaveError,
    CheckpointManager,
    CheckpointTimeoutError,
    EveryTSeconds,
    OnDemand,
)
from shardpoint.storage import LocalStorage
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=96, dim=32, heads=4, layers=2, seq=16)


class SlowOrFullStorage(LocalStorage):
    """Local storage whose data writes on this rank stall or fail with ENOSPC (children inherit)."""

    def __init__(self, root: str, faults: dict):
        super().__init__(root)
        self.faults = faults

    def child(self, sub: str) -> "SlowOrFullStorage":
        c = SlowOrFullStorage(os.path.join(self.root, sub), self.faults)
        c.stats = self.stats
        return c

    def open_writer(self, name):
        w = super().open_writer(name)
        inner, faults = w.write, self.faults

        def write(data):
            if faults.get("sleep"):
                time.sleep(faults["sleep"])
            if faults.get("enospc"):
                raise OSError(28, "No space left on device (injected)")
            inner(data)

        w.write = write
        return w


def _equal(ref: dict, got: dict) -> list[str]:
    return [k for k in ref if not torch.equal(ref[k], got[k])]


def manager_job(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    state_of = lambda m, o: {"model": m, "optimizer": o}  # noqa: E731

    # 1. FSDP2 + lazy background saves + retention; restore into TP and into a fresh FSDP2.
    run = os.path.join(root, "run")
    model, opt = build("fsdp2", CFG, seed=0)
    mgr = CheckpointManager(run, interval=2, keep_last=2, mode="lazy", timeout=120, on_hang="log")
    assert mgr.restore(state_of(model, opt)) is None
    refs = {}
    for step in range(1, 9):
        train_step(model, opt, step, CFG)
        if step % 2 == 0:
            refs[step] = full_state(model, opt)
        mgr.maybe_save(step, state_of(model, opt))
    mgr.close()
    out["steps"] = mgr.steps()
    for layout in ("tp", "fsdp2"):
        m2, o2 = build(layout, CFG, seed=5)
        with CheckpointManager(run, interval=2, timeout=120) as mgr2:
            out[f"restored_{layout}"] = mgr2.restore(state_of(m2, o2))
        out[f"diff_{layout}"] = _equal(refs[8], full_state(m2, o2))

    # 2. A time policy with skewed clocks and a save requested on one rank: all ranks agree.
    skew = random.Random(rank).uniform(-50, 50) if rank else 0.0
    ticks = [0.0]
    demand = OnDemand()
    mgr = CheckpointManager(
        os.path.join(root, "policies"), policies=[EveryTSeconds(10), demand], keep_last=None,
        mode="eager", clock=lambda: ticks[0] + skew, timeout=120,
    )
    saved, stops = [], []
    for step in range(1, 13):
        ticks[0] += 4.0 if rank == 0 else random.Random(step * 7 + rank).uniform(0, 30)
        if step == 5 and rank == world - 1:
            demand.request(stop=True)
        if mgr.maybe_save(step, {"x": torch.full((4,), float(step))}) is not None:
            saved.append(step)
        stops.append(mgr.stop_requested)
    mgr.close()
    out["policy_saves"] = saved
    out["stop_at"] = stops.index(True) + 1 if True in stops else None

    # 3. Disk full on rank 1: the save fails on every rank, older checkpoints stay, the next works.
    faults: dict = {}
    full = SlowOrFullStorage(os.path.join(root, "full"), faults if rank == 1 else {})
    mgr = CheckpointManager(full, interval=1, keep_last=2, mode="eager", timeout=120)
    st = state_of(model, opt)
    mgr.save(1, st)
    mgr.save(2, st)
    mgr.wait()
    ref2 = full_state(model, opt)
    faults["enospc"] = True
    train_step(model, opt, 100, CFG)
    try:
        mgr.save(3, st)
        mgr.wait()
        out["enospc"] = "no error"
    except (sp.CheckpointError, OSError) as e:
        out["enospc"] = f"{type(e).__name__}: {e}"
    out["after_enospc"] = mgr.steps()
    faults["enospc"] = False
    mgr.save(4, st)
    mgr.close()
    out["after_recovery"] = mgr.steps()
    m3, o3 = build("fsdp2", CFG, seed=9)
    CheckpointManager(full, timeout=120, policies=[OnDemand()]).restore(state_of(m3, o3), step=2)
    out["diff_enospc"] = _equal(ref2, full_state(m3, o3))

    # 4. Two managers racing to the same step folder: the second is rejected on every rank.
    race = os.path.join(root, "race")
    a = CheckpointManager(race, mode="eager", timeout=120, policies=[OnDemand()])
    b = CheckpointManager(race, mode=None, timeout=120, policies=[OnDemand()])
    ref_a = full_state(model, opt)
    a.save(10, st)  # lock held until a observes the commit
    try:
        b.save(10, st)
        out["race"] = "no error"
    except ConcurrentSaveError as e:
        out["race"] = f"conflict: {e}"
    a.close()
    b.close()
    m4, o4 = build("fsdp2", CFG, seed=9)
    sp.load(os.path.join(race, "step_00000010"), state_of(m4, o4))
    out["diff_race"] = _equal(ref_a, full_state(m4, o4))

    # 5. A stalled write on rank 1 (one write call blocks for longer than the timeout, so no bytes move):
    #    wait() reports rank and phase on every rank, then completes.
    slow: dict = {}
    stall = SlowOrFullStorage(os.path.join(root, "stall"), slow if rank == 1 else {})
    mgr = CheckpointManager(stall, mode="eager", timeout=1.0, on_hang="log", policies=[OnDemand()])
    slow["sleep"] = 2.5  # per write call: the first one blocks past the 1 s timeout with no progress
    mgr.save(1, st)
    try:
        mgr.wait()
        out["stall"] = None
    except CheckpointTimeoutError as e:
        out["stall"] = {"rank": e.rank, "phase": e.phase, "step": e.step, "msg": str(e)}
    slow["sleep"] = 0.0
    for _ in range(60):
        try:
            mgr.wait()
            break
        except CheckpointTimeoutError:
            pass
    mgr.close()
    out["stall_steps"] = mgr.steps()

    # 6. A collective that does not complete: rank 1 arrives late; the others time out in 'decide'.
    late = CheckpointManager(os.path.join(root, "late"), policies=[OnDemand()], timeout=1.5, on_hang="log")
    late.maybe_save(1, {"x": torch.ones(1)})  # the group exists and works
    if rank == 1:
        time.sleep(4.0)
    t0 = time.monotonic()
    try:
        late.maybe_save(2, {"x": torch.ones(1)})
        out["late"] = None
    except CheckpointTimeoutError as e:
        out["late"] = {"rank": e.rank, "phase": e.phase, "step": e.step, "seconds": time.monotonic() - t0, "msg": str(e)}
    except sp.CheckpointError as e:
        out["late"] = {"other": f"{type(e).__name__}: {e}"}
    try:
        late.maybe_save(3, {"x": torch.ones(1)})
        out["late_after"] = None
    except sp.CheckpointError as e:
        out["late_after"] = f"{type(e).__name__}: {e}"
    return out
