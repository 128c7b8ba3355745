"""The landing check's building blocks: aliasing keys, bitwise equality, unlanded targets."""

from __future__ import annotations

import torch
from torch import nn

from shardpoint.items import LoadTarget
from shardpoint.adapters.landing import alias_key, live_storages, module_tensors, same_bits, unlanded
from shardpoint.adapters.module import protocol_prefixes
from shardpoint.geometry import Box


def _target(name: str, t: torch.Tensor) -> LoadTarget:
    return LoadTarget(name, t, tuple(t.shape), Box.full(tuple(t.shape)))


def test_alias_key_is_the_same_memory_read_the_same_way():
    w = torch.randn(4, 6)
    assert alias_key(w.detach()) == alias_key(w)
    assert alias_key(w[1:]) != alias_key(w)  # offset
    assert alias_key(w.t()) != alias_key(w)  # shape and strides
    assert alias_key(w.view(torch.int32)) != alias_key(w)  # dtype
    assert alias_key(w.clone()) != alias_key(w)  # storage


def test_same_bits_compares_bits_not_values():
    a = torch.tensor([1.0, float("nan"), -0.0])
    assert same_bits(a, a.clone())
    assert not same_bits(a, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 == 0.0 as values, not as bits
    assert not same_bits(torch.tensor([-0.0]), torch.tensor([0.0]))
    assert same_bits(torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([1.5], dtype=torch.bfloat16))
    assert not same_bits(a, a.double())
    assert not same_bits(a, a[:2])
    assert same_bits(torch.tensor([1 + 2j, complex("nan")]), torch.tensor([1 + 2j, complex("nan")]))
    assert same_bits(torch.arange(3), torch.arange(3)) and not same_bits(torch.arange(3), torch.arange(1, 4))
    assert not same_bits(a, None)


def test_unlanded_names_targets_outside_live_memory_unless_vouched():
    m = nn.Linear(3, 2)
    live = live_storages(module_tensors(m))
    copy = torch.empty(2)
    targets = [_target("w", m.weight.detach()), _target("b_copy", copy), _target("rows", m.weight.detach()[1:])]
    assert unlanded(targets, live) == ["b_copy"]
    assert unlanded(targets, live, {copy.untyped_storage().data_ptr(): True}) == []
    assert unlanded(targets, live, {copy.untyped_storage().data_ptr(): False}) == ["b_copy"]
    assert unlanded([_target("empty", torch.empty(0))], set()) == []  # wrote nothing


def test_modules_that_load_their_own_way_are_routed():
    plain = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert protocol_prefixes(plain) == ()
    bn = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))  # overrides _load_from_state_dict
    assert protocol_prefixes(bn) == ("1.",)
    hooked = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    hooked[0].register_load_state_dict_post_hook(lambda *a: None)
    assert protocol_prefixes(hooked) == ("0.",)
    hooked.register_load_state_dict_pre_hook(lambda *a: None)
    assert protocol_prefixes(hooked) == ("",)  # the root: every entry
