"""The replica digest, the comparison table, copy names and replication declared by pattern (pure, no processes)."""

from __future__ import annotations

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.adapters.base import AdapterContext, Replicas, match_replicas
from shardpoint.adapters.context import is_name_pattern, resolve_patterns, resolve_replicas
from shardpoint.errors import ReplicaMismatchError
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget
from shardpoint.layouts import apply_load
from shardpoint.saving.digest import HOST_FULL_BYTES, SAMPLES, digest_all, digest_tensor
from shardpoint.planning.replicas import ReplicaTable, copies_of, commit_refusal, refusal, table_representatives
from shardpoint.loading.copies import copy_rule
from shardpoint.saving.replicas import (
    PendingTable, Row, table_of, copied_names, copy_name, encode_rows, mismatches, parse_copy_name, suspicious,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]


@pytest.mark.parametrize("host", [True, False], ids=["host", "device_path"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_copies_have_equal_digests_and_copies_differing_everywhere_never(dtype, host):
    torch.manual_seed(0)
    a = (torch.randn(37, 11) * 100).to(dtype)
    b = a.clone()
    assert digest_tensor(a, host) == digest_tensor(b, host)
    if dtype == torch.bool:
        c = torch.logical_not(a)
    elif dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        c = (a.view(ints) ^ 1).view(dtype)  # the lowest mantissa bit of every element
    else:
        c = a + 1
    assert bool((c.view(torch.uint8) != a.view(torch.uint8)).any()) and bool((c != a).all())
    assert digest_tensor(c, host) != digest_tensor(a, host)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 2**31 - 1), st.integers(0, 10**9), st.booleans())
def test_differing_everywhere_is_caught_for_any_size(n, seed, delta, host):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    b = a ^ torch.full_like(a, (delta % (2**31 - 1)) + 1)  # every element's bits changed
    assert digest_tensor(a, host) != digest_tensor(b, host)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device_path"])
def test_one_changed_element_is_caught(host):
    a = torch.randn(HOST_FULL_BYTES // 4)
    for i in (0, 1, 499, a.numel() - 1, 12_345):
        b = a.clone()
        b[i] = torch.nextafter(b[i], torch.tensor(float("inf")))  # one ulp
        assert digest_tensor(a, host) != digest_tensor(b, host), i


def test_the_device_path_sample_catches_moved_values_the_sum_cannot():
    n = SAMPLES * 64
    a = torch.zeros(n, dtype=torch.int32)
    b = a.clone()
    stretch = n // SAMPLES
    b[3 * stretch] = 5  # two sampled positions: the plain sum and the first element stay equal
    b[700 * stretch] = -5
    da, db = digest_tensor(a, False), digest_tensor(b, False)
    assert da[0] == db[0] == 1 and da[1] == db[1] and da[3] == db[3] and da[2] != db[2]


@pytest.mark.parametrize("host", [True, False], ids=["host", "device_path"])
def test_signed_zero_and_nan_bits_count(host):
    assert digest_tensor(torch.tensor([0.0, 1.0]), host) != digest_tensor(torch.tensor([-0.0, 1.0]), host)
    nan = torch.tensor([float("nan")])
    other = nan.view(torch.int32) ^ 1
    assert digest_tensor(nan, host) != digest_tensor(other.view(torch.float32), host)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device_path"])
def test_views_digest_like_their_contiguous_copies(host):
    a = torch.randn(40, 30)
    for v in (a.t(), a[:, 3:17], a[::3], a.narrow(0, 5, 10)):
        assert digest_tensor(v, host) == digest_tensor(v.contiguous(), host)
    z = torch.randn(8, dtype=torch.complex128)
    assert digest_tensor(z, host) == digest_tensor(z.clone(), host) != digest_tensor(z + 1, host)
    empty = (0, xxhash.xxh3_64_intdigest(b""), 0, 0) if host else (1, 0, 0, 0)
    assert digest_tensor(torch.empty(0), host) == empty
    assert digest_all([a, a.t()], host) == [digest_tensor(a, host), digest_tensor(a.t(), host)]
    # Sampled: a view's gathered sample and a contiguous tensor's strided one are the same elements.
    for big in (torch.randn(300, 301), torch.randn(256, 256)):
        assert digest_tensor(big.t(), host) == digest_tensor(big.t().contiguous(), host)


def _row(fqn, group, digest, box=((0,), (4,))):
    return Row(fqn, box[0], box[1], None, group, (0, *digest))


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
    # A copy on the CPU and one on a GPU are digested differently: not comparable, not a mismatch.
    mixed = [[Row("w", (0,), (4,), None, "", (0, 1, 2, 3))], [Row("w", (0,), (4,), None, "", (1, 7, 8, 9))]]
    assert mismatches(mixed) == []
    mixed.append([Row("w", (0,), (4,), None, "", (0, 5, 5, 5))])
    assert mismatches(mixed) == [("w", [[0], [1], [2]])]


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


def test_copies_of_picks_the_copies_of_this_ranks_group_only():
    names = ["w@ranks0,1", "w@ranks2,3", "b", "v@ranks3", "x@ranksab"]
    assert copies_of(names, 3) == {"w": "w@ranks2,3", "v": "v@ranks3"}
    assert copies_of(names, 1) == {"w": "w@ranks0,1"}
    assert copies_of(names, 7) == {}


def test_patterns_match_names_prefixes_and_optimizer_state_of_the_parameter():
    r = Replicas(0, 2, frozenset({0, 1}))
    pats = (("model.experts.*", r), ("model.router", None), ("*", None))
    assert match_replicas(pats, "model.experts.3.w") == (True, r)
    assert match_replicas(pats, "optim.state.model.experts.3.w.exp_avg") == (True, r)
    assert match_replicas(pats, "model.router.weight") == (True, None)
    assert match_replicas(pats, "model.dense.weight") == (True, None)
    assert match_replicas((("model.experts.*", r),), "model.dense.weight") == (False, None)
    # Like layout rules, a pattern may name the tail of a name after a dot.
    assert match_replicas((("experts.*", r),), "model.layers.1.experts.0.w") == (True, r)
    assert match_replicas((("experts.*", r),), "model.shared_experts.0.w") == (False, None)
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


def test_large_cpu_tensors_are_sampled_unless_the_check_is_full(monkeypatch):
    a = torch.randn(HOST_FULL_BYTES)  # 4x the limit in float32 bytes
    b = a.clone()
    b[1] += 1  # between two sampled elements
    assert digest_tensor(a) == digest_tensor(b)
    assert digest_tensor(a) != digest_tensor(a + 1)  # differing everywhere: always caught
    monkeypatch.setenv("SHARDPOINT_REPLICA_CHECK", "full")
    assert digest_tensor(a) != digest_tensor(b)
    monkeypatch.setenv("SHARDPOINT_REPLICA_CHECK", "sometimes")
    with pytest.raises(ValueError, match="SHARDPOINT_REPLICA_CHECK"):
        digest_tensor(a)


def test_the_fast_path_sees_what_the_named_table_sees():
    agree = [[_row("w", "", (1, 1, 1))], [_row("w", "", (1, 1, 1))]]
    assert not suspicious([encode_rows(r) for r in agree])
    differ = [[_row("w", "", (1, 1, 1))], [_row("w", "", (1, 1, 2))]]
    assert suspicious([encode_rows(r) for r in differ]) and mismatches(differ) == [("w", [[0], [1]])]
    grouped = [[_row("w", "0", (1, 1, 1))], [_row("w", "1", (5, 1, 1))]]
    assert suspicious([encode_rows(r) for r in grouped]) and copied_names(grouped) == {"w": ["0", "1"]}
    big = [_row("w", "", (2**64 - 1, 2**63, 7))]  # unsigned 64-bit digests fit the int64 table
    assert encode_rows(big).shape == (1, 6)
    assert not suspicious([encode_rows([]), encode_rows([])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.complex128])
def test_large_tensors_read_from_memory_digest_like_the_torch_path(dtype):
    torch.manual_seed(1)
    n = HOST_FULL_BYTES + 4099  # sampled on every dtype
    a = torch.randn(n, dtype=dtype) if dtype.is_complex else (torch.randn(n) * 1000).to(dtype)
    strided = torch.stack([a, a], 1)[:, 1]  # the same elements, not contiguous: torch ops sample it
    assert not strided.is_contiguous() and torch.equal(strided, a)
    assert digest_tensor(a) == digest_tensor(strided)
    b = a.clone()
    b[-1] = b[0] if not bool(b[0] == b[-1]) else b[1]  # the last element is always sampled
    assert digest_tensor(a) != digest_tensor(b)


def test_the_commit_reads_the_tables_as_bytes_and_refuses_with_names():
    agree = [[_row("w", "", (1, 1, 1))], [_row("w", "", (1, 1, 1))]]
    differ = [[_row("w", "", (1, 1, 1)), _row("b", "", (3, 3, 3))], [_row("w", "", (1, 2, 1)), _row("b", "", (3, 3, 3))]]
    assert not suspicious([ReplicaTable.of(r).encoded for r in agree]) and refusal(agree, "ck") is None
    tables = [ReplicaTable.of(r) for r in differ]
    assert tables[1].rows() == differ[1] and suspicious([t.encoded for t in tables])
    err = refusal(differ, "ck")
    assert isinstance(err, ReplicaMismatchError) and err.tensor == "w" and err.groups == [[0], [1]]
    assert str(err).startswith("ck: tensor 'w' is to be saved as one copy") and "ranks [0]; ranks [1]" in str(err)
    # Several groups holding one name, with no declaration to store a copy per group: refused, naming them.
    grouped = [[_row("e", "0", (1, 1, 1))], [_row("e", "1", (2, 1, 1))]]
    assert suspicious([ReplicaTable.of(r).encoded for r in grouped])
    err = refusal(grouped, "ck")
    assert err.tensor == "e" and err.groups == [[0], [1]] and "replicated_over" in str(err)
    with pytest.raises(ReplicaMismatchError, match="overlapping"):
        refusal([[_row("e", "0,1", (1, 1, 1))], [_row("e", "", (1, 1, 1))]], "ck")


def test_the_commit_fetches_one_table_per_distinct_digest_and_names_every_rank():
    same = ReplicaTable.of([_row("w", "", (1, 1, 1)), _row("b", "", (3, 3, 3))])
    other = ReplicaTable.of([_row("w", "", (1, 1, 2)), _row("b", "", (3, 3, 3))])
    assert same.digest() == ReplicaTable.of(same.rows()).digest() != other.digest()
    digests = [same.digest(), same.digest(), other.digest(), other.digest(), ""]
    assert table_representatives(digests) == frozenset({0, 2})
    assert commit_refusal(digests[:2], {0: same}, "ck") is None  # one distinct table: nothing to compare
    err = commit_refusal(digests, {0: same, 2: other}, "ck")
    assert err.tensor == "w" and err.groups == [[0, 1], [2, 3]] and "ranks [0, 1]; ranks [2, 3]" in str(err)
    assert commit_refusal(["", ""], {}, "ck") is None


def _tensors():
    import shardpoint as sp
    from shardpoint.dist import Comm
    from shardpoint.saving.options import SaveOptions
    from shardpoint.saving.prepare import prepare_save
    from shardpoint.saving.result import SaveResult

    state = {"w": torch.arange(12.0).view(3, 4), "big": torch.randn(HOST_FULL_BYTES)}
    return list(prepare_save(state, Comm.resolve(None), SaveOptions(), SaveResult("ck", "x")).tensors)


def test_a_pending_table_computes_on_a_thread_or_now_and_raises_its_error_where_asked():
    tensors = _tensors()
    want = table_of(tensors)
    started = PendingTable(tensors)
    started.start()
    assert started.thread is not None and started.table() == want  # a thread, joined by table()
    now = PendingTable(tensors)
    assert now.table() == want and now.thread is None  # nothing computed before: computed when asked

    class Broken:
        replica_count, layout = 2, "replicated"
        fqn, flat, replica_group = "x", None, ""
        data = torch.ones(2)
        box = None  # table_of cannot read its offsets

    # A lazy save leaves the named tensors to its worker: table() waits for that part, and the values are the same.
    split = PendingTable(tensors)
    split.start(later={"big"})
    assert [split.tensors[i].fqn for i in split.later] == ["big"] and not split.later_done.is_set()
    split.join()
    assert split.found[split.later[0]] is None  # not digested until the worker's turn
    split.digest_later()
    assert split.later_done.is_set() and split.table() == want

    failing = PendingTable([Broken()])
    failing.start()
    with pytest.raises(AttributeError):
        failing.table()
