"""Param-group keys that describe the live run (``AdapterContext.live_group_keys``) keep their live values on load."""

from __future__ import annotations

import torch

from shardpoint.adapters.base import AdapterContext
from shardpoint.adapters.optimizer import OptimizerAdapter


def _sgd(lr: float, name: str) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    w = torch.nn.Parameter(torch.ones(3))
    return torch.optim.SGD([{"params": [w], "name": name, "moe": True}], lr=lr, momentum=0.9), w


def _load_into(live: frozenset[str]) -> dict:
    saved, w = _sgd(0.1, "ep_size_2")
    doc = OptimizerAdapter().save("optimizer", saved, AdapterContext(0, 1, {id(w): "model.w"})).value
    opt, w2 = _sgd(0.5, "ep_size_1")
    del opt.param_groups[0]["moe"]  # a key the live group lacks stays absent when kept
    ctx = AdapterContext(0, 1, {id(w2): "model.w"}, live_group_keys={id(opt): live})
    part = OptimizerAdapter().load("optimizer", opt, doc, {}, ctx)
    assert part.missing == [] and part.unexpected == []
    part.finish()
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


def test_declared_keys_keep_the_live_values_and_the_rest_is_restored():
    g = _load_into(frozenset({"name", "moe"}))
    assert g["name"] == "ep_size_1" and "moe" not in g
    assert g["lr"] == 0.1 and g["momentum"] == 0.9  # hyper-parameters come from the checkpoint


def test_without_a_declaration_every_saved_key_is_restored():
    g = _load_into(frozenset())
    assert g["name"] == "ep_size_2" and g["moe"] is True and g["lr"] == 0.1
