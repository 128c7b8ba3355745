"""The module and optimizer fingerprints change with every change a reused part would miss, and only then."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardpoint.adapters.context import build_context
from shardpoint.adapters.reuse import module_fingerprint, optimizer_fingerprint
from tests.unit.models import step


def _stepped():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 6, bias=False))  # square: its transpose has its shape
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    step(m, opt, batch=4)
    return m, opt


def _fps(m, opt):
    state = {"model": m, "optimizer": opt}
    return module_fingerprint(m), optimizer_fingerprint(opt, build_context(state, 0, 1))


def test_an_unchanged_state_and_a_training_step_keep_both_fingerprints():
    m, opt = _stepped()
    before = _fps(m, opt)
    step(m, opt, batch=4)  # in place: the same objects and storage
    assert _fps(m, opt) == before


MODULE_CHANGES = {
    "data swapped": lambda m, o: setattr(m[0].weight, "data", m[0].weight.detach().clone()),
    "reshaped on the same storage": lambda m, o: setattr(m[0].weight, "data", m[0].weight.detach().view(3, 16)),
    "transposed on the same storage (the same shape)": lambda m, o: setattr(m[2].weight, "data", m[2].weight.detach().t()),
    "another dtype on the same storage": lambda m, o: setattr(m[1].running_var, "data", m[1].running_var.view(torch.int32)),
    "parameter replaced": lambda m, o: setattr(m[1], "weight", nn.Parameter(m[1].weight.detach().clone())),
    "parameter removed": lambda m, o: setattr(m[0], "bias", None),
    "buffer added": lambda m, o: m[1].register_buffer("scale", torch.ones(2)),
    "buffer made non-persistent": lambda m, o: m[1].register_buffer("scale", torch.ones(2), persistent=False),
    "submodule added": lambda m, o: m.append(nn.ReLU()),
    "submodules renamed": lambda m, o: m._modules.update({"0": m[2], "2": m[0]}),
    "state-dict hook": lambda m, o: m[1]._register_state_dict_hook(lambda *a: None),
}


@pytest.mark.parametrize("change", sorted(MODULE_CHANGES))
def test_a_module_change_changes_the_module_fingerprint(change):
    m, opt = _stepped()
    before = module_fingerprint(m)
    MODULE_CHANGES[change](m, opt)
    after = module_fingerprint(m)
    assert after is None if change == "state-dict hook" else (after is not None and after != before)


OPTIMIZER_CHANGES = {
    "state tensor replaced": lambda m, o: o.state[m[0].weight].update(exp_avg=o.state[m[0].weight]["exp_avg"].clone()),
    "state tensor's data swapped": lambda m, o: setattr(o.state[m[0].weight]["exp_avg_sq"], "data", torch.zeros(6, 8)),
    "state key added": lambda m, o: o.state[m[0].weight].update(extra=torch.zeros(1)),
    "state dropped": lambda m, o: o.state.pop(m[2].weight),
    "parameter group added": lambda m, o: o.add_param_group({"params": [nn.Parameter(torch.zeros(3))]}),
    "hyper-parameter key added": lambda m, o: o.param_groups[0].update(momentum_decay=0.1),
    "parameters reordered": lambda m, o: o.param_groups[0].update(params=o.param_groups[0]["params"][::-1]),
}


@pytest.mark.parametrize("change", sorted(OPTIMIZER_CHANGES))
def test_an_optimizer_change_changes_the_optimizer_fingerprint(change):
    m, opt = _stepped()
    _, before = _fps(m, opt)
    OPTIMIZER_CHANGES[change](m, opt)
    _, after = _fps(m, opt)
    assert after is not None and after != before


def test_a_renamed_parameter_changes_the_optimizer_fingerprint():
    m, opt = _stepped()
    _, before = _fps(m, opt)
    m._modules = {"a": m[0], "b": m[1], "c": m[2]}
    _, after = _fps(m, opt)
    assert after != before


def test_what_the_graph_cannot_capture_gives_no_fingerprint():
    m, opt = _stepped()
    opt.state[m[0].weight]["count"] = 3  # a non-tensor state value may change every step
    assert _fps(m, opt)[1] is None
    m2, opt2 = _stepped()
    opt2.param_groups[0]["lr"] = torch.tensor(0.01)  # a tensor among the hyper-parameters
    assert _fps(m2, opt2)[1] is None
    m3, _ = _stepped()
    m3[1].register_buffer("mask", torch.eye(2).to_sparse())  # no single storage to compare
    assert module_fingerprint(m3) is None
