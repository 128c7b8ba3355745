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


def _saved_and_fresh(tmp_path, kind):
    """A model and optimizer after 3 steps, saved; a second pair built from another seed, never stepped."""
    torch.manual_seed(0)
    m = TinyGPT(CFG)
    opt = MAKERS[kind](m.parameters())
    for s in range(3):
        train_step(m, opt, s, CFG)
    path = str(tmp_path / "ck")
    sp.save(path, {"model": m, "optimizer": opt})
    torch.manual_seed(1)
    m2 = TinyGPT(CFG)
    return m, opt, path, m2, MAKERS[kind](m2.parameters())


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_round_trip_and_next_step(tmp_path, kind):
    m, opt, path, m2, opt2 = _saved_and_fresh(tmp_path, kind)
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


def test_existing_state_is_filled_in_place(tmp_path):
    """Loading into an optimizer that already has state reuses its tensors: no second copy while loading."""
    m, opt, path, m2, opt2 = _saved_and_fresh(tmp_path, "adamw")
    train_step(m2, opt2, 7, CFG)  # different state, same shapes
    params = list(m2.parameters())
    # One state tensor of another dtype cannot be reused: it is replaced, at the saved dtype. (Kept
    # alive here so that the replacement cannot be allocated at its address.)
    wrong = opt2.state[params[0]]["exp_avg"] = opt2.state[params[0]]["exp_avg"].double()
    before = {(i, k): v.data_ptr() for i, p in enumerate(params) for k, v in opt2.state[p].items() if v.dim() > 0}
    assert before and len(before) == 2 * len(params)  # exp_avg and exp_avg_sq of every parameter
    sp.load(path, {"model": m2, "optimizer": opt2})
    after = {(i, k): v.data_ptr() for i, p in enumerate(params) for k, v in opt2.state[p].items() if v.dim() > 0}
    reused = {key for key in before if after[key] == before[key]}
    assert reused == set(before) - {(0, "exp_avg")}
    assert opt2.state[params[0]]["exp_avg"].dtype == torch.float32 and wrong.dtype == torch.float64
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for i in s1["state"]:
        for k, v in s1["state"][i].items():
            assert torch.equal(v, s2["state"][i][k]), (i, k)
    assert train_step(m, opt, 3, CFG) == train_step(m2, opt2, 3, CFG)
