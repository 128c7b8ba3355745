"""The replica digest, the comparison table, copy names and replication declared by pattern (pure, no processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.adapters.base import AdapterContext, Replicas, match_replicas
from shardpoint.adapters.context import is_name_pattern, resolve_patterns, resolve_replicas
from shardpoint.errors import ReplicaMismatchError
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget
from shardpoint.layouts import apply_load
from shardpoint.replicas import (
    FULL_CPU_BYTES, SAMPLES, Row, copied_names, copy_name, copy_rule, digest_all, digest_tensor, mismatches, parse_copy_name,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_copies_have_equal_digests_and_copies_differing_everywhere_never(dtype):
    torch.manual_seed(0)
    a = (torch.randn(37, 11) * 100).to(dtype)
    b = a.clone()
    assert digest_tensor(a) == digest_tensor(b)
    if dtype == torch.bool:
        c = torch.logical_not(a)
    elif dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        c = (a.view(ints) ^ 1).view(dtype)  # the lowest mantissa bit of every element
    else:
        c = a + 1
    assert bool((c.view(torch.uint8) != a.view(torch.uint8)).any()) and bool((c != a).all())
    assert digest_tensor(c) != digest_tensor(a)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 2**31 - 1), st.integers(0, 10**9))
def test_differing_everywhere_is_caught_for_any_size(n, seed, delta):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    b = a ^ torch.full_like(a, (delta % (2**31 - 1)) + 1)  # every element's bits changed
    assert digest_tensor(a) != digest_tensor(b)


def test_one_changed_element_is_caught_by_the_full_sum_on_small_tensors():
    a = torch.randn(1000)
    assert a.numel() * 4 <= FULL_CPU_BYTES
    for i in (0, 1, 499, 999, 123):
        b = a.clone()
        b[i] = torch.nextafter(b[i], torch.tensor(float("inf")))  # one ulp
        assert digest_tensor(a) != digest_tensor(b), i


def test_large_tensors_are_sampled_in_every_stretch():
    n = FULL_CPU_BYTES  # 4x the full-sum limit in float32 bytes
    a = torch.zeros(n)
    stretch = n // SAMPLES
    for k in (0, 7, SAMPLES - 1):
        b = a.clone()
        b[k * stretch: (k + 1) * stretch] = 1.0  # one whole stretch differs
        assert digest_tensor(a) != digest_tensor(b), k


def test_signed_zero_and_nan_bits_count():
    assert digest_tensor(torch.tensor([0.0, 1.0])) != digest_tensor(torch.tensor([-0.0, 1.0]))
    nan = torch.tensor([float("nan")])
    other = nan.view(torch.int32) ^ 1
    assert digest_tensor(nan) != digest_tensor(other.view(torch.float32))


def test_views_digest_like_their_contiguous_copies():
    a = torch.randn(40, 30)
    for v in (a.t(), a[:, 3:17], a[::3], a.narrow(0, 5, 10)):
        assert digest_tensor(v) == digest_tensor(v.contiguous())
    z = torch.randn(8, dtype=torch.complex128)
    assert digest_tensor(z) == digest_tensor(z.clone()) != digest_tensor(z + 1)
    assert digest_tensor(torch.empty(0)) == (0, 0, 0)
    assert digest_all([a, a.t()]) == [digest_tensor(a), digest_tensor(a.t())]


def _row(fqn, group, digest, box=((0,), (4,))):
    return Row(fqn, box[0], box[1], None, group, digest)


def test_mismatches_group_ranks_by_value_within_one_declared_group():
    table = [
        [_row("w", "", (1, 1, 1)), _row("b", "", (5, 5, 5))],
        [_row("w", "", (1, 1, 1)), _row("b", "", (5, 5, 5))],
        [_row("w", "", (2, 2, 2)), _row("b", "", (5, 5, 5))],
        [_row("w", "", (2, 2, 2)), _row("b", "", (5, 5, 5))],
    ]
    assert mismatches(table) == [("w", [[0, 1], [2, 3]])]
    # Different pieces (TP shards) and different declared groups never compare with each other.
    sharded = [[_row("w", "", (1, 1, 1), ((0,), (2,)))], [_row("w", "", (2, 2, 2), ((2,), (2,)))]]
    assert mismatches(sharded) == []
    grouped = [[_row("e", "0,1", (1, 1, 1))], [_row("e", "0,1", (1, 1, 1))], [_row("e", "2,3", (9, 9, 9))], [_row("e", "2,3", (9, 9, 9))]]
    assert mismatches(grouped) == []
    assert copied_names(grouped) == {"e": ["0,1", "2,3"]}


def test_overlapping_declarations_are_refused():
    table = [[_row("e", "0,1", (1, 1, 1))], [_row("e", "", (1, 1, 1))]]
    with pytest.raises(ReplicaMismatchError, match="'e'.*overlapping replica groups"):
        copied_names(table)
    with pytest.raises(ReplicaMismatchError, match="overlapping"):
        copied_names([[_row("e", "0,1", (1, 1, 1))], [_row("e", "1,2", (1, 1, 1))]])


def test_copy_names_round_trip():
    n = copy_name("optimizer.state.model.experts.0.w.exp_avg", "2,3")
    assert n == "optimizer.state.model.experts.0.w.exp_avg@ranks2,3"
    assert parse_copy_name(n) == ("optimizer.state.model.experts.0.w.exp_avg", frozenset({2, 3}))
    assert parse_copy_name("model.w") is None and parse_copy_name("x@ranksab") is None


def test_copy_rule_reads_the_copy_of_this_ranks_group():
    names = ["model.e@ranks0,1", "model.e@ranks2,3", "model.d"]
    assert copy_rule(names, 4) is None
    rule = copy_rule(names, 3)
    dest = torch.empty(4)
    (t,) = apply_load([LoadTarget("model.e", dest, (4,), Box.full((4,)))], [rule])
    assert t.fqn == "model.e@ranks2,3" and t.dest.data_ptr() == dest.data_ptr() and t.box == Box.full((4,))
    (t,) = apply_load([LoadTarget("model.d", dest, (4,), Box.full((4,)))], [rule])
    assert t.fqn == "model.d"


def test_patterns_match_names_prefixes_and_optimizer_state_of_the_parameter():
    r = Replicas(0, 2, frozenset({0, 1}))
    pats = (("model.experts.*", r), ("model.router", None), ("*", None))
    assert match_replicas(pats, "model.experts.3.w") == (True, r)
    assert match_replicas(pats, "optim.state.model.experts.3.w.exp_avg") == (True, r)
    assert match_replicas(pats, "model.router.weight") == (True, None)
    assert match_replicas(pats, "model.dense.weight") == (True, None)
    assert match_replicas((("model.experts.*", r),), "model.dense.weight") == (False, None)
    assert is_name_pattern("model.experts.*") and is_name_pattern("*") and not is_name_pattern("model")


def test_context_answers_per_tensor_and_keeps_the_whole_key_form():
    decl = {"model.experts.*": [0], "*": None}
    ctx = AdapterContext(0, 4, {}, replicas=resolve_replicas(decl, ["model"]), patterns=resolve_patterns(decl))
    assert ctx.plain_replica("model.experts.0.w") == (0, 1) and ctx.replica_group("model.experts.0.w") == "0"
    assert ctx.plain_replica("model.dense.w") == (0, 4) and ctx.replica_group("model.dense.w") == ""
    old = AdapterContext(0, 4, {}, replicas=resolve_replicas({"model": [0, 1]}, ["model", "extra"]))
    assert old.plain_replica("model.w") == (0, 2) and old.plain_replica("extra.x") == (0, 4)
    with pytest.raises(ValueError, match="state keys"):
        resolve_replicas({"modle": [0]}, ["model"])
    pairs = [("model.experts.*", [0]), ("model", None)]
    assert resolve_patterns(pairs)[0][1] == Replicas(0, 1, frozenset({0}))
