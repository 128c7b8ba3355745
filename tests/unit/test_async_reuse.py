"""Repeated asynchronous saves reuse the adapter walk only while nothing it saw has changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardpoint as sp
from tests.unit.models import ClaimsNothing, stack, step


def _model():
    return stack(16, 16, 4)


def _step(m, opt):
    step(m, opt, batch=8)


def _stepped():
    """The test model and its AdamW optimizer after one step (the optimizer has its state)."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _step(m, opt)
    return m, opt


def _reused(saver) -> int:
    return saver._plan_cache.reused["part"]


def _check(path, m, opt):
    m2 = _model()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    sp.load(path, {"model": m2, "optimizer": opt2})
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for n, v in s1["state"][k].items():
            assert torch.equal(v, s2["state"][k][n]), (k, n)


def test_unchanged_state_reuses_parts_and_saves_current_values(tmp_path):
    m, opt = _stepped()
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    r1 = saver.save(str(tmp_path / "a"), {"model": m, "optimizer": opt}, mode="lazy").wait()
    assert _reused(saver) == 0 and not r1.plan_cached
    _step(m, opt)
    for g in opt.param_groups:
        g["lr"] = 3e-3  # a scheduler: the hyper-parameters are encoded afresh every time
    r2 = saver.save(str(tmp_path / "b"), {"model": m, "optimizer": opt}, mode="lazy").wait()
    assert _reused(saver) == 2 and r2.plan_cached
    _check(str(tmp_path / "b"), m, opt)
    assert sp.read_manifest(str(tmp_path / "b")).values["optimizer"]["groups"][0]["lr"] == 3e-3


def test_swapped_tensors_are_noticed(tmp_path):
    m, opt = _stepped()
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    saver.save(str(tmp_path / "a"), {"model": m, "optimizer": opt}).wait()

    # param.data = ...: the same Parameter object, new storage.
    with torch.no_grad():
        m[0].weight.data = torch.full_like(m[0].weight, 7.0)
    saver.save(str(tmp_path / "b"), {"model": m, "optimizer": opt}).wait()
    got = sp.read_tensor(str(tmp_path / "b"), "model.0.weight")
    assert torch.equal(got, torch.full((16, 16), 7.0))

    # An optimizer state tensor replaced by a new one.
    p = m[2].weight
    opt.state[p]["exp_avg"] = torch.full_like(p, 3.0)
    saver.save(str(tmp_path / "c"), {"model": m, "optimizer": opt}).wait()
    assert torch.equal(sp.read_tensor(str(tmp_path / "c"), "optimizer.state.model.2.weight.exp_avg"), torch.full((4, 16), 3.0))

    # A new buffer registered on a submodule.
    m[1].register_buffer("extra", torch.arange(5.0))
    saver.save(str(tmp_path / "d"), {"model": m, "optimizer": opt}).wait()
    assert torch.equal(sp.read_tensor(str(tmp_path / "d"), "model.1.extra"), torch.arange(5.0))

    # A parameter replaced by a new Parameter object of another shape.
    m[2].bias = nn.Parameter(torch.ones(4) * 2)
    saver.save(str(tmp_path / "e"), {"model": m}).wait()
    assert torch.equal(sp.read_tensor(str(tmp_path / "e"), "model.2.bias"), torch.full((4,), 2.0))
    _check_no_stale = sp.read_manifest(str(tmp_path / "e"))
    assert "optimizer" not in _check_no_stale.values


def test_renamed_submodules_are_noticed(tmp_path):
    m = nn.Module()
    m.enc, m.dec = nn.Linear(4, 4), nn.Linear(4, 4)
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    saver.save(str(tmp_path / "a"), {"model": m}).wait()
    enc, dec = m.enc, m.dec
    # The same module objects under swapped names, in the same order: only the names changed.
    m._modules.clear()
    m.dec, m.enc = enc, dec
    saver.save(str(tmp_path / "b"), {"model": m}).wait()
    assert torch.equal(sp.read_tensor(str(tmp_path / "b"), "model.dec.weight"), enc.weight.detach())
    assert torch.equal(sp.read_tensor(str(tmp_path / "b"), "model.enc.weight"), dec.weight.detach())


def test_non_tensor_optimizer_state_is_not_reused(tmp_path):
    m, opt = _stepped()
    for s in opt.state.values():
        s["note"] = 1  # a plain value may change from step to step
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    saver.save(str(tmp_path / "a"), {"model": m, "optimizer": opt}).wait()
    for s in opt.state.values():
        s["note"] = 2
    saver.save(str(tmp_path / "b"), {"model": m, "optimizer": opt}).wait()
    assert _reused(saver) == 1  # the module only
    doc = sp.read_manifest(str(tmp_path / "b")).values["optimizer"]["state"]
    assert {v["note"] for v in doc.values()} == {2}


def test_save_cache_reuses_only_on_an_equal_fingerprint():
    from shardpoint.saving.reuse import SaveCache

    cache, made = SaveCache(), []

    def make(v):
        return lambda: made.append(v) or v

    assert cache.reuse("plan", (1, "a"), make("x")) == ("x", False)
    assert cache.reuse("plan", (1, "a"), make("y")) == ("x", True)  # equal fingerprint: kept result
    assert cache.reuse("plan", (2, "a"), make("z")) == ("z", False)  # changed: made again and kept
    assert cache.reuse("plan", (1, "a"), make("w")) == ("w", False)  # only the last result is kept
    assert cache.reuse(("part", "m"), None, make("n1")) == ("n1", False)
    assert cache.reuse(("part", "m"), None, make("n2")) == ("n2", False)  # no fingerprint: never kept
    assert cache.reuse(("part", "m"), 5, make("p")) == ("p", False)
    cache.forget(("part", "m"))
    assert cache.reuse(("part", "m"), 5, make("q")) == ("q", False)
    assert made == ["x", "z", "w", "n1", "n2", "p", "q"]
    assert cache.reused == {"plan": 1}


def test_changing_plain_entries_keep_the_parts_and_the_plan(tmp_path):
    m, opt = _stepped()
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    for i in range(3):
        r = saver.save(str(tmp_path / f"s{i}"), {"model": m, "optimizer": opt, "step": i, "meta": {"i": [i]}}).wait()
        assert r.plan_cached == (i > 0)
        _step(m, opt)
    assert _reused(saver) == 4 and saver._plan_cache.reused["checked"] == 2
    m2 = _model()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    state = {"model": m2, "optimizer": opt2, "step": -1, "meta": {}}
    sp.load(str(tmp_path / "s2"), state)
    assert state["step"] == 2 and state["meta"] == {"i": [2]}


def test_context_facts_are_reused_while_the_modules_hold(tmp_path):
    m = nn.Module()
    m.enc, m.dec = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m.dec(m.enc(torch.randn(2, 4))).sum().backward()
    opt.step()
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    for i in range(3):
        saver.save(str(tmp_path / f"s{i}"), {"model": m, "optimizer": opt}).wait()
    assert saver._plan_cache.reused["facts"] == 2
    # The same modules under swapped names: the optimizer's state follows the new names.
    enc, dec = m.enc, m.dec
    m._modules.clear()
    m.dec, m.enc = enc, dec
    saver.save(str(tmp_path / "swapped"), {"model": m, "optimizer": opt}).wait()
    assert saver._plan_cache.reused["facts"] == 2  # gathered again
    got = sp.read_tensor(str(tmp_path / "swapped"), "optimizer.state.model.dec.weight.exp_avg")
    assert torch.equal(got, opt.state[enc.weight]["exp_avg"])
    got = sp.read_tensor(str(tmp_path / "swapped"), "optimizer.state.model.enc.weight.exp_avg")
    assert torch.equal(got, opt.state[dec.weight]["exp_avg"])


def test_facts_an_adapter_gives_for_an_entry_it_does_not_claim_are_gathered_every_time(tmp_path):
    from shardpoint.adapters import ContextFacts, register_adapter, unregister_adapter

    asked = []

    class GroupKeys(ClaimsNothing):
        """Declares a live param-group key of every torch optimizer."""

        name = "group-keys"

        def context_facts(self, key, obj, state):
            if not isinstance(obj, torch.optim.Optimizer):
                return None
            asked.append(key)
            return ContextFacts(live_group_keys={id(obj): frozenset({"tag"})})

    m, opt = _stepped()
    register_adapter(GroupKeys, before="whole")
    try:
        saver = sp.AsyncSaver(staging_bytes=1 << 20)
        for i in range(3):
            saver.save(str(tmp_path / f"s{i}"), {"model": m, "optimizer": opt}).wait()
    finally:
        unregister_adapter("group-keys")
    assert saver._plan_cache.reused["facts"] == 0 and asked == ["optimizer"] * 3
    assert _reused(saver) == 4  # the parts themselves are still reused


def _warm_lazy(tmp_path):
    """A stepped model, its optimizer, and a saver that made two lazy saves of them (its copy order kept)."""
    m, opt = _stepped()
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    for i in range(2):
        saver.save(str(tmp_path / f"s{i}"), {"model": m, "optimizer": opt}, mode="lazy").wait()
    return m, opt, saver


def test_a_replaced_state_tensor_is_watched_by_the_next_lazy_save(tmp_path):
    m, opt, saver = _warm_lazy(tmp_path)
    try:
        p = m[2].weight
        opt.state[p]["exp_avg"] = torch.full_like(p, 3.0)
        h = saver.save(str(tmp_path / "torn"), {"model": m, "optimizer": opt}, mode="lazy")
        opt.state[p]["exp_avg"].add_(1.0)  # before the fence: the new tensor is the one watched
        with pytest.raises(sp.TornSnapshotError, match=r"optimizer\.state\.model\.2\.weight\.exp_avg"):
            h.wait()
        h = saver.save(str(tmp_path / "ok"), {"model": m, "optimizer": opt}, mode="lazy")
        h.wait()
        got = sp.read_tensor(str(tmp_path / "ok"), "optimizer.state.model.2.weight.exp_avg")
        assert torch.equal(got, torch.full((4, 16), 4.0))
    finally:
        saver.close()


def test_a_data_swap_between_lazy_saves_samples_the_new_storage(tmp_path):
    m, opt, saver = _warm_lazy(tmp_path)
    try:
        w = m[0].weight  # the largest tensor: sampled by the guard
        with torch.no_grad():
            w.data = torch.full_like(w, 5.0)
        h = saver.save(str(tmp_path / "swapped"), {"model": m, "optimizer": opt}, mode="lazy")
        h.wait()  # no change after the call: commits
        assert torch.equal(sp.read_tensor(str(tmp_path / "swapped"), "model.0.weight"), torch.full((16, 16), 5.0))
        h = saver.save(str(tmp_path / "torn"), {"model": m, "optimizer": opt}, mode="lazy")
        w.data.mul_(2.0)  # through .data: no version bump, seen by the sample
        with pytest.raises(sp.TornSnapshotError, match=r"model\.0\.weight"):
            h.wait()
    finally:
        saver.close()
