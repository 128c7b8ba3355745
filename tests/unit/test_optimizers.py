"""Adam, AdamW and SGD with momentum: state keyed by names, bit-exact, training continues identically."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.testing import GPTConfig, TinyGPT, train_step

CFG = GPTConfig(vocab=40, dim=16, heads=2, layers=1, seq=8)
MAKERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_round_trip_and_next_step(tmp_path, kind):
    torch.manual_seed(0)
    m = TinyGPT(CFG)
    opt = MAKERS[kind](m.parameters())
    for s in range(3):
        train_step(m, opt, s, CFG)
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optimizer": opt})
    torch.manual_seed(1)
    m2 = TinyGPT(CFG)
    opt2 = MAKERS[kind](m2.parameters())  # fresh, never stepped
    sp.load(path, {"model": m2, "optimizer": opt2})
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for i in s1["state"]:
        assert s1["state"][i].keys() == s2["state"][i].keys(), kind
        for k, v in s1["state"][i].items():
            assert torch.equal(v, s2["state"][i][k]), (kind, i, k)
    assert train_step(m, opt, 3, CFG) == train_step(m2, opt2, 3, CFG)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
