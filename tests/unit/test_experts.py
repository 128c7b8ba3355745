"""Expert naming: global indices, the EP degree check, prefix renaming (pure, one process)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardpoint as sp
from shardpoint.adapters.experts import check_divides, rename_prefix
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget, SaveTensor
from shardpoint.layouts import apply_load, apply_save, optimizer_doc_to_logical


@given(st.integers(1, 64), st.integers(1, 16))
def test_the_ep_degree_must_divide_the_experts(n, ep):
    if n % ep == 0:
        assert check_divides(n, ep, "x") == n // ep
    else:
        with pytest.raises(sp.ExpertLayoutError, match=f"{n} experts .* degree of {ep}"):
            check_divides(n, ep, "x")


def test_longest_prefix_wins():
    prefixes = {"a.experts.local_experts.1.": "a.experts.local_experts.3.", "a.": "b."}
    assert rename_prefix("a.experts.local_experts.1.w", prefixes) == "a.experts.local_experts.3.w"
    assert rename_prefix("a.router.w", prefixes) == "b.router.w"
    assert rename_prefix("c.w", prefixes) == "c.w"
    assert rename_prefix("a.experts.local_experts.10.w", {"a.experts.local_experts.1.": "x."}) == "a.experts.local_experts.10.w"


def _st(fqn, t):
    return SaveTensor(fqn, t, tuple(t.shape), Box.full(tuple(t.shape)))


def test_one_process_holds_every_expert_under_its_own_name():
    rule = sp.Experts("model.experts", num_experts=3)
    w, step = torch.ones(2, 2), torch.tensor(4.0)
    out = apply_save([_st("model.experts.2.w", w), _st("opt.state.model.experts.1.w.step", step), _st("model.router.w", w)], [rule])
    assert [t.fqn for t in out] == ["model.experts.2.w", "opt.state.model.experts.1.w.step", "model.router.w"]
    assert out[0].data.data_ptr() == w.data_ptr()  # a view: nothing copied
    (t,) = apply_load([LoadTarget("model.experts.0.w", w, (2, 2), Box.full((2, 2)))], [rule])
    assert t.fqn == "model.experts.0.w" and t.dest.data_ptr() == w.data_ptr()
    with pytest.raises(sp.ExpertLayoutError, match="local expert 3"):
        rule.logical_name("model.experts.3.w", "")
    assert rule.param_match("model.expertsX.0.w") is None and rule.param_match("model.experts.w") is None


def test_optimizer_documents_follow_the_global_names():
    rule = sp.Experts("model.experts", num_experts=2)
    doc = {"state": {"model.experts.1.w": {"exp_avg": {"__sp__": "tensor", "key": "opt.state.model.experts.1.w.exp_avg"}}},
           "group_of": {"model.experts.1.w": 0}}
    assert optimizer_doc_to_logical("opt", doc, [rule]) == doc  # one process: local index == global index


class _Shifted(sp.layouts.WholeRule):
    """Experts renamed as EP rank 1 of 2 renames them: local ``i`` -> global ``i + 2``."""

    pattern, dim = "model.experts.*", 0

    def logical_name(self, param, part):
        return re.sub(r"(model\.experts\.)(\d+)", lambda m: f"{m.group(1)}{int(m.group(2)) + 2}", param, count=1)


def test_flat_pieces_of_experts_are_renamed_and_keep_their_range():
    """ZeRO keeps experts as flat ranges of their parameters: a rename moves the range under the global name."""
    rule = _Shifted()
    data = torch.arange(3.0)
    piece = SaveTensor("model.experts.1.w", data, (2, 3), Box.full((2, 3)), (2, 5))
    moment = SaveTensor("opt.state.model.experts.0.w.exp_avg", data, (2, 3), Box.full((2, 3)), (2, 5))
    out = apply_save([piece, moment], [rule])
    assert [(t.fqn, t.flat, t.shape) for t in out] == [("model.experts.3.w", (2, 5), (2, 3)), ("opt.state.model.experts.2.w.exp_avg", (2, 5), (2, 3))]
    assert out[0].data.data_ptr() == data.data_ptr()
    (t,) = apply_load([LoadTarget("model.experts.1.w", data, (2, 3), Box.full((2, 3)), (2, 5))], [rule])
    assert (t.fqn, t.flat, t.dest.data_ptr()) == ("model.experts.3.w", (2, 5), data.data_ptr())


def test_rules_that_cut_tensors_still_refuse_flat_pieces():
    rule = sp.Fused("*.fc1.weight", dim=0, parts=[("gate", 1), ("up", 1)])
    piece = SaveTensor("m.fc1.weight", torch.zeros(2), (2, 3), Box.full((2, 3)), (0, 2))
    with pytest.raises(sp.UnsupportedStateError, match="m.fc1.weight: layout rules do not apply to flat-parameter shards"):
        apply_save([piece], [rule])
    with pytest.raises(sp.UnsupportedStateError, match="flat-parameter targets"):
        apply_load([LoadTarget("m.fc1.weight", torch.zeros(2), (2, 3), Box.full((2, 3)), (0, 2))], [rule])
