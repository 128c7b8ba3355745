"""CheckpointManager(incremental=True): bases, retention of referenced data, and faults in save and retention."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint as sp
from shardpoint.manager.incremental import referenced_by
from tests.unit.incremental_runs import four_steps_keep_last_one

BLOCK = 1 << 12


def _state():
    g = torch.Generator().manual_seed(1)
    return {"model": {"frozen": torch.randn(256, 64, generator=g), "adapter": torch.randn(8, 8, generator=g)}}


def _files(root: str) -> dict[str, list[str]]:
    out = {}
    for d in sorted(os.listdir(root)):
        if d.startswith("step_"):
            out[d] = sorted(os.path.join(p[len(root) + len(d) + 2:], n) for p, _, ns in os.walk(os.path.join(root, d)) for n in ns)
    return out


def _manager(root, **kw):
    return sp.CheckpointManager(root, interval=1, mode=None, incremental=True, prewarm=False,
                                save_options={"block_size": BLOCK}, **kw)


def _run(root, steps, keep_last=2, hook=None):
    st, saved = _state(), {}
    mgr = _manager(root, keep_last=keep_last, fault_hook=hook)
    try:
        for step in steps:
            st["model"]["adapter"].add_(1)
            mgr.save(step, st)
            mgr.wait()
            saved[step] = {k: v.clone() for k, v in st["model"].items()}
    finally:
        mgr.close()
    return saved, mgr


def test_each_save_writes_the_adapter_only_and_retention_keeps_what_is_referenced(tmp_path):
    root = str(tmp_path)
    saved, mgr = _run(root, range(1, 7), keep_last=2)
    assert mgr.retention_errors == []
    files = _files(root)
    # Steps 5 and 6 are kept; step 1 holds the frozen weights they reference, and nothing else.
    assert sorted(files) == ["step_00000001", "step_00000005", "step_00000006"]
    assert len(files["step_00000001"]) == 1 and files["step_00000001"][0].endswith(".bin")
    assert referenced_by(sp.LocalStorage(root), [5, 6]) == {"step_00000001": {files["step_00000001"][0]}}
    for step in (5, 6):
        data = os.path.join(root, f"step_{step:08d}", "data")
        written = sum(os.path.getsize(os.path.join(data, n)) for n in os.listdir(data) if n.endswith(".bin"))
        assert written == 8 * 8 * 4  # the adapter alone
        out = sp.load(os.path.join(root, f"step_{step:08d}"), {}, strict=False)
        for k, v in saved[step].items():
            assert torch.equal(out["model"][k], v), (step, k)


def test_unreferenced_data_is_removed_when_a_full_save_replaces_it(tmp_path):
    root = str(tmp_path)
    _run(root, range(1, 4), keep_last=1)
    st = _state()
    st["model"]["frozen"].add_(1)  # everything changes: nothing is referenced any more
    mgr = _manager(root, keep_last=1)
    mgr.save(10, st)
    mgr.wait()
    mgr.close()
    assert sorted(_files(root)) == ["step_00000010"]
    assert sp.references_outside(os.path.join(root, "step_00000010")) == {}


class Boom(Exception):
    pass


@pytest.mark.parametrize("phase,nth", [("retention", 1), ("retention", 2), ("retention", 3), ("write", 3), ("snapshot", 4)])
def test_a_fault_in_save_or_retention_leaves_every_kept_step_loadable(tmp_path, phase, nth):
    root = str(tmp_path)
    seen = {"n": 0}

    def hook(p, step, rank):
        if p == phase:
            seen["n"] += 1
            if seen["n"] == nth:
                raise Boom(f"{p} {step}")

    try:
        saved, _ = _run(root, range(1, 6), keep_last=2, hook=hook)
    except Boom:
        saved = None
    for step in sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_")):
        path = os.path.join(root, f"step_{step:08d}")
        if os.path.exists(os.path.join(path, "manifest.json")):
            out = sp.load(path, {}, strict=False)  # every committed step loads, bit for bit what it holds
            assert out["model"]["frozen"].shape == (256, 64)
            if saved and step in saved:
                assert torch.equal(out["model"]["adapter"], saved[step]["adapter"])
    # A later clean run removes what no kept step references.
    _run(root, range(20, 23), keep_last=1)
    files = _files(root)
    assert "step_00000022" in files
    referenced = referenced_by(sp.LocalStorage(root), [22]) or {}
    for folder, names in files.items():
        if folder != "step_00000022":
            # The torn step's lock is another manager's until it goes stale; no data stays unreferenced.
            assert set(names) - {".lock"} <= referenced.get(folder, set()), (folder, names)


def test_memory_storage_run_keeps_referenced_data_only():
    run = sp.MemoryStorage()
    st = _state()
    four_steps_keep_last_one(run, st, _manager(run, keep_last=1))
