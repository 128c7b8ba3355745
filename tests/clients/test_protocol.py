"""Loads go through each object's own protocol, in one process, and the landing check proves it.

Each case trains, saves, takes one more step (the uninterrupted run), then
loads into objects built from another seed and checks every live tensor bit
for bit and the next step's loss.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import shardpoint as sp

from .shapes import Forgetful, HookedNet, PartsOptimizer, TwoParts, loss_of, tensors_of


def _train(model, opt, steps: int, start: int = 0) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        loss = loss_of(model, s)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _assert_same(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got)
    bad = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not bad, bad


def _round_trip(tmp_path, make, steps: int = 3):
    """(state after saving, next loss of the uninterrupted run, loaded state, next loss after the load)."""
    model, opt = make(0)
    _train(model, opt, steps)
    path = str(tmp_path / "ck")
    sp.save(path, {"model": model, "optimizer": opt})
    ref = tensors_of(model, opt)
    want = _train(model, opt, 1, steps)
    model2, opt2 = make(1)
    report = sp.load(path, {"model": model2, "optimizer": opt2}, return_result=True)
    got = tensors_of(model2, opt2)
    return ref, want, got, _train(model2, opt2, 1, steps), report


def _hooked(titan: bool):
    def make(seed: int):
        torch.manual_seed(seed)
        m = HookedNet(titan=titan)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    return make


@pytest.mark.parametrize("qkv", ["ours", "torchtitan"])
def test_fused_qkv_hooks_and_load_override_restore_exactly(tmp_path, qkv):
    if qkv == "torchtitan":
        pytest.importorskip("torchtitan.models.common.attention")
    ref, want, got, after, report = _round_trip(tmp_path, _hooked(qkv == "torchtitan"))
    names = set(sp.read_manifest(str(tmp_path / "ck")).tensors)
    # The checkpoint holds the split copies (what the hook returns), never the fused weight.
    assert "model.blocks.0.attn.wq.weight" in names and "model.blocks.0.attn.wqkv.weight" not in names
    assert "optimizer.state.model.blocks.0.attn.wqkv.weight.exp_avg" in names
    _assert_same(ref, got)
    assert after == want  # the scale that ScaledLinear recomputes on load is right too
    assert report.not_restored == [] and "landing" in report.timings


def test_plain_parameters_are_filled_in_place(tmp_path):
    """Entries that alias the live parameters skip load_state_dict: same storage before and after."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    sp.save(str(tmp_path / "ck"), {"model": m, "optimizer": opt})
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    ptrs = [p.data_ptr() for p in m2.parameters()]
    calls = []
    m2.register_load_state_dict_post_hook(lambda *a: calls.append(1))  # would run inside load_state_dict
    m3 = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    ptrs3 = [p.data_ptr() for p in m3.parameters()]
    sp.load(str(tmp_path / "ck"), {"model": m3, "optimizer": torch.optim.AdamW(m3.parameters())})
    assert [p.data_ptr() for p in m3.parameters()] == ptrs3
    for a, b in zip(m.parameters(), m3.parameters()):
        assert torch.equal(a, b)
    # A module that registers its own load hook goes through load_state_dict: the hook runs.
    sp.load(str(tmp_path / "ck"), {"model": m2}, keys="model.*")
    assert calls == [1] and [p.data_ptr() for p in m2.parameters()] == ptrs
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_a_load_that_cannot_land_raises(tmp_path, caplog):
    torch.manual_seed(0)
    m = HookedNet(forgetful=True)
    sp.save(str(tmp_path / "ck"), {"model": m})
    torch.manual_seed(1)
    m2 = HookedNet(forgetful=True)
    fresh_bias = m2.tail.bias.detach().clone()
    with pytest.raises(sp.StateNotRestoredError) as e:
        sp.load(str(tmp_path / "ck"), {"model": m2})
    assert isinstance(e.value, sp.CheckpointError)
    assert e.value.entries == ["model.tail.bias"]
    msg = str(e.value)
    assert "'model.tail.bias'" in msg and "did not reach the live state" in msg and "rank 0" in msg
    assert "strict=False" in msg
    assert torch.equal(m2.tail.bias, fresh_bias)  # indeed not loaded
    assert torch.equal(m2.tail.weight, m.tail.weight)  # the rest was
    # strict=False: a warning naming it, and the report lists it.
    m3 = HookedNet(forgetful=True)
    with caplog.at_level(logging.WARNING, logger="shardpoint"):
        report = sp.load(str(tmp_path / "ck"), {"model": m3}, strict=False, return_result=True)
    assert report.not_restored == ["model.tail.bias"]
    assert any("model.tail.bias" in r.getMessage() and "did not reach" in r.getMessage() for r in caplog.records)


def _container(seed: int):
    torch.manual_seed(seed)
    m = TwoParts()
    return m, PartsOptimizer(m.parts())


def test_optimizer_container_goes_through_its_protocol(tmp_path):
    ref, want, got, after, report = _round_trip(tmp_path, _container)
    m = sp.read_manifest(str(tmp_path / "ck"))
    # Keyed as DCP keys a flattened optimizer state dict, every Adam tensor present.
    assert "optimizer.state.front.0.weight.exp_avg" in m.tensors
    assert "optimizer.state.back.2.bias.exp_avg_sq" in m.tensors
    assert m.values["optimizer"]["param_groups.front.0.weight.lr"] == 1e-2
    assert len([k for k in ref if k.startswith("opt.")]) == 3 * 8  # step, exp_avg, exp_avg_sq x 8 params
    _assert_same(ref, got)
    assert after == want and report.not_restored == []


def test_torchtitan_optimizers_container(tmp_path):
    # torchtitan 0.3.0 fails to import (ImportError) on a torch older than it needs, as it does when absent
    tt = pytest.importorskip("torchtitan.components.optimizer", exc_type=ImportError)

    def make(seed: int):
        torch.manual_seed(seed)
        m = TwoParts()
        cfg = tt.OptimizersContainer.Config(
            param_groups=[tt.ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop",
        )
        return m, tt.OptimizersContainer(cfg, model_parts=m.parts())

    ref, want, got, after, report = _round_trip(tmp_path, make)
    assert "optimizer.state.front.0.weight.exp_avg" in sp.read_manifest(str(tmp_path / "ck")).tensors
    _assert_same(ref, got)
    assert after == want and report.not_restored == []


class _HiddenState(torch.optim.Optimizer):
    """An optimizer only by inheritance that forgot to declare how its state is saved."""

    def __init__(self, params):
        params = list(params)
        self.inner = torch.optim.AdamW(params)
        super().__init__(params, {})

    def step(self, closure=None):
        self.inner.step()


class _EmptyDict(_HiddenState):
    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def test_save_refuses_state_that_is_certainly_incomplete(tmp_path, caplog):
    m = nn.Linear(3, 2)
    m(torch.randn(2, 3)).sum().backward()
    hidden = _HiddenState(m.parameters())
    hidden.step()
    with pytest.raises(sp.IncompleteStateError, match=r"state\['optimizer'\].*_HiddenState.*inner.*state_dict"):
        sp.save(str(tmp_path / "a"), {"model": m, "optimizer": hidden})
    with pytest.raises(sp.IncompleteStateError, match=r"state\['optimizer'\].*_EmptyDict.*state_dict\(\) is empty"):
        sp.save(str(tmp_path / "b"), {"optimizer": _EmptyDict(m.parameters())})

    class NoState(nn.Linear):
        def state_dict(self, *a, **k):
            return {}

    with pytest.raises(sp.IncompleteStateError, match=r"state\['model'\].*NoState has parameters"):
        sp.save(str(tmp_path / "c"), {"model": NoState(3, 2)})
    with pytest.raises(sp.CheckpointError):  # nothing was committed
        sp.read_manifest(str(tmp_path / "c"))
    # A stock optimizer that has not stepped yet holds no state, legitimately.
    sp.save(str(tmp_path / "d"), {"model": m, "optimizer": torch.optim.AdamW(m.parameters())})
    # Nothing is lost yet when the inner optimizers have not stepped: a warning, not an error.
    with caplog.at_level(logging.WARNING, logger="shardpoint"):
        sp.save(str(tmp_path / "e"), {"optimizer": _HiddenState(m.parameters())})
    assert any("_HiddenState" in r.getMessage() and "would not be saved" in r.getMessage() for r in caplog.records)
    # A placeholder over a frozen dummy tensor (as Lightning uses when there is no optimizer) saves.
    sp.save(str(tmp_path / "f"), {"optimizer": _EmptyDict([torch.zeros(1)])})


def test_selected_keys_leave_the_rest_of_a_protocol_object_as_it_was(tmp_path):
    model, opt = _container(0)
    _train(model, opt, 2)
    path = str(tmp_path / "ck")
    sp.save(path, {"model": model, "optimizer": opt})
    ref = tensors_of(model, opt)
    model2, opt2 = _container(1)
    _train(model2, opt2, 1)
    before = tensors_of(model2, opt2)
    sp.load(path, {"model": model2, "optimizer": opt2}, keys="optimizer.state.front.*")
    got = tensors_of(model2, opt2)
    for k, v in got.items():
        want = ref[k] if k.startswith("opt.front.") else before[k]
        assert torch.equal(v, want), k


def test_container_state_missing_from_the_checkpoint_is_reported(tmp_path):
    torch.manual_seed(0)
    m = TwoParts()
    front_only = PartsOptimizer(m.parts()[:1])
    loss_of(m, 0).backward()
    front_only.step()
    sp.save(str(tmp_path / "ck"), {"optimizer": front_only})
    full = PartsOptimizer(TwoParts().parts())
    with pytest.raises(sp.KeyMismatchError) as e:
        sp.load(str(tmp_path / "ck"), {"optimizer": full})
    assert "optimizer.state.back.0.weight.exp_avg" in e.value.missing
    assert not [n for n in e.value.missing if ".front." in n]
