"""Partial loads: selected keys, model only, meta-device modules, and read_tensor."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.testing import GPTConfig, TinyGPT, train_step

CFG = GPTConfig(vocab=40, dim=16, heads=2, layers=2, seq=8)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    m = TinyGPT(CFG)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train_step(m, opt, 0, CFG)
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optimizer": opt, "extra": {"step": 1}})
    return path, m, opt


def test_model_only(saved):
    path, m, _ = saved
    torch.manual_seed(5)
    m2 = TinyGPT(CFG)
    opt2 = torch.optim.AdamW(m2.parameters())
    sp.load(path, {"model": m2, "optimizer": opt2}, keys="model.*")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert len(opt2.state) == 0  # the optimizer was not selected: untouched


def test_subset_of_tensors(saved):
    path, m, _ = saved
    torch.manual_seed(5)
    m2 = TinyGPT(CFG)
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    rep = sp.load(path, {"model": m2}, keys=["model.layers.0.*"], return_result=True)
    for k, v in m2.state_dict().items():
        want = m.state_dict()[k] if k.startswith("layers.0.") else before[k]
        assert torch.equal(v, want), k
    assert rep.missing == [] and rep.unexpected == []


def test_meta_module_is_materialised(saved):
    path, m, _ = saved
    with torch.device("meta"):
        m2 = TinyGPT(CFG)
    sp.load(path, {"model": m2}, keys="model.*")
    assert all(not t.is_meta for t in m2.parameters())
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


def test_read_tensor_whole_and_box(saved):
    path, m, opt = saved
    w = m.layers[1].mlp.w1.weight.detach()
    assert torch.equal(sp.read_tensor(path, "model.layers.1.mlp.w1.weight"), w)
    assert torch.equal(sp.read_tensor(path, "model.layers.1.mlp.w1.weight", (slice(3, 9), slice(2, 5))), w[3:9, 2:5])
    st = opt.state[m.layers[0].attn.wq.weight]
    assert torch.equal(sp.read_tensor(path, "optimizer.state.model.layers.0.attn.wq.weight.exp_avg"), st["exp_avg"])
    with pytest.raises(sp.KeyMismatchError, match=r"no tensor 'model\.nope' in the checkpoint"):
        sp.read_tensor(path, "model.nope")
