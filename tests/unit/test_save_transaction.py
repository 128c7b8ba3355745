"""One save transaction: sync and async saves run the same phases and commit the same state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardpoint as sp
from shardpoint.adapters import build_context
from shardpoint.adapters.stepped import step_updates
from shardpoint.saving.handle import AsyncSaveHandle
from shardpoint.dist import Comm
from shardpoint.errors import ConcurrentSaveError
from shardpoint.saving.reuse import SaveCache
from shardpoint.saving.steps import SaveResult
from shardpoint.saving import SaveOptions, SaveTransaction
from shardpoint.saving.background import BackgroundSave


def _state():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {"model": m, "optimizer": opt, "extra": {"step": 3}}


def _leaves(doc, at: str = "") -> dict:
    """Every tensor of a loaded document by its path, as raw bytes and dtype (compared bit for bit)."""
    if isinstance(doc, torch.Tensor):
        return {at: (doc.dtype, tuple(doc.shape), doc.reshape(-1).contiguous().view(torch.uint8).tolist() if doc.numel() else [])}
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, (list, tuple)) else ()
    out: dict = {}
    for k, v in items:
        out.update(_leaves(v, f"{at}.{k}"))
    return out


def test_optimizer_state_declares_that_it_changes_only_in_step():
    state = _state()
    comm = Comm.resolve(None)
    prep = SaveTransaction("prewarm", state, SaveOptions()).rehearse(comm, comm, SaveCache())
    declared = {t.fqn for t in prep.tensors if t.step_only}
    state_names = {t.fqn for t in prep.tensors if t.fqn.startswith("optimizer.state.")}
    assert declared == state_names and len(state_names) == 6 * 3  # six parameters: exp_avg, exp_avg_sq, step
    params = {n for n, _ in state["model"].named_parameters()}
    assert prep.lazy_ok == declared | {f"model.{n}" for n in params}
    assert "model.1.running_mean" not in prep.lazy_ok  # a buffer changes in forward: copied in the call


def test_step_updates_lists_hooks_live_tensors_and_order():
    state = _state()
    updates = step_updates(state)
    opt = state["optimizer"]
    order = updates.order(build_context(state, 0, 1))
    first = next(iter(opt.param_groups[0]["params"]))
    assert order[0] is first and order[1] is opt.state[first]["step"]
    calls = []
    hooks = updates.add_pre_hooks(lambda o, a, k: calls.append(o))
    opt.step()
    for h in hooks:
        h.remove()
    opt.step()
    assert calls == [opt]
    assert not step_updates({"model": state["model"]})


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_sync_and_async_saves_commit_the_same_tensors_and_phases(tmp_path, mode):
    state = _state()
    r_sync = sp.save(str(tmp_path / "sync"), state)
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    r_async = saver.save(str(tmp_path / "async"), state, mode=mode).wait()
    saver.close()
    for phase in ("plan", "data_file", "commit", "total"):
        assert phase in r_sync.timings and phase in r_async.timings
    a = sp.load(str(tmp_path / "sync"), {}, strict=False)
    b = sp.load(str(tmp_path / "async"), {}, strict=False)
    assert a["extra"] == b["extra"] == {"step": 3}
    assert _leaves(a["model"]) == _leaves(b["model"]) and len(_leaves(a["model"])) == 9  # two Linears, BatchNorm: 5 tensors
    assert _leaves(a["optimizer"]) == _leaves(b["optimizer"]) and len(_leaves(a["optimizer"])) >= 18
    live = dict(state["model"].state_dict())
    assert all(torch.equal(b["model"][k], v) for k, v in live.items())


def test_background_save_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be 'eager' or 'lazy', got 'soon'"):
        BackgroundSave("x", {}, SaveOptions(), "soon")


def test_the_handle_raises_what_it_was_told():
    handle = AsyncSaveHandle("mem://x", SaveResult("mem://x", "id"))
    assert handle.phase == "snapshot" and not handle.done()
    handle.mark_copied()
    assert handle.phase == "write"
    handle.mark_written()
    assert handle.phase == "commit"
    err = ConcurrentSaveError("mem://x: another save is writing it")
    handle.fail(err)
    handle.finish()
    assert handle.done() and handle.phase == "done"
    with pytest.raises(ConcurrentSaveError, match="another save is writing it"):
        handle.wait()
    assert handle.reported
