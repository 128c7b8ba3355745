"""The frozen save plan and the one reuse rule: kept results are never changed, and reused only on an equal fingerprint."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import shardpoint as sp
from shardpoint.dist import Comm
from shardpoint.planning.save_plan import SavePlan, describe_plan
from shardpoint.saving import SaveOptions, SaveTransaction
from shardpoint.saving.prepare import describe_on, prepare_save
from shardpoint.saving.result import SaveResult
from shardpoint.saving.reuse import Same, SameItems, SaveCache


def _state():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": m, "optimizer": opt}


def test_save_options_are_keyword_only():
    with pytest.raises(TypeError):
        SaveOptions(True)  # type: ignore[misc]
    o = SaveOptions(block_size=1 << 20, allow_pickle=True)
    assert (o.block_size, o.allow_pickle, o.layouts) == (1 << 20, True, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.block_size = 16  # type: ignore[misc]


def test_a_repeated_prepare_reuses_the_kept_plan_and_never_changes_it():
    state, comm, cache = _state(), Comm.resolve(None), SaveCache()
    r1, r2 = SaveResult("a", "1"), SaveResult("b", "2")
    p1 = prepare_save({**state, "step": 1}, comm, SaveOptions(), r1, cache)
    p2 = prepare_save({**state, "step": 2}, comm, SaveOptions(), r2, cache)
    assert (r1.plan_cached, r2.plan_cached) == (False, True)
    assert p1 is not p2 and p1.tensors is p2.tensors and p1.choice is p2.choice  # the kept plan's values, reused
    assert (p1.values["step"], p2.values["step"]) == (1, 2)  # each save's own documents, on a new value
    with pytest.raises(dataclasses.FrozenInstanceError):
        p2.values = {}  # type: ignore[misc]
    assert [t.fqn for t in p2.mine] == [p2.tensors[i].fqn for i in p2.choice.picked]
    assert cache.reused["checked"] == 1 and cache.reused["part"] == 2


def test_the_description_is_reused_only_for_the_same_plan_rank_and_group():
    state, comm, cache = _state(), Comm.resolve(None), SaveCache()
    p1 = prepare_save(state, comm, SaveOptions(), SaveResult("a", "1"), cache)
    d1 = describe_on(p1, comm, cache)
    p2 = prepare_save(state, comm, SaveOptions(), SaveResult("b", "2"), cache)
    d2 = describe_on(p2, comm, cache)
    assert d2 is d1 and cache.reused["described"] == 1
    fresh = describe_plan(p2, comm.rank, comm.world)  # the pure function gives the same description
    assert fresh.digest == d1.digest and fresh is not d1
    state["model"][1] = nn.Linear(8, 5)  # new shapes: a new plan, so a new description
    p3 = prepare_save(state, comm, SaveOptions(), SaveResult("c", "3"), cache)
    d3 = describe_on(p3, comm, cache)
    assert d3 is not d1 and d3.digest != d1.digest and cache.reused["described"] == 1


def test_same_compares_by_identity_only():
    a, b = torch.zeros(3), torch.zeros(3)
    assert Same(a) == Same(a) and Same(a) != Same(b) and Same(a) != a
    assert (1, Same(a)) == (1, Same(a))
    assert SameItems([a, b]) == SameItems((a, b)) and SameItems([a, b]) != SameItems([b, a])
    assert SameItems([a]) != SameItems([a, b]) and SameItems([a]) != (a,)


def test_a_plan_is_made_with_its_writers_and_new_documents_make_a_new_value():
    state, comm = _state(), Comm.resolve(None)
    plan = SaveTransaction("prewarm", state, SaveOptions()).rehearse(comm, comm, SaveCache())
    again = SavePlan.make(plan.tensors, plan.choice, plan.lazy_ok, replica_ranks={})
    assert again == dataclasses.replace(plan, values={}, frameworks={})  # references are not compared
    assert again.for_save({"x": 1}, {}).values == {"x": 1} and again.values == {}


def test_async_saver_refuses_an_unknown_option_by_name(tmp_path):
    saver = sp.AsyncSaver(staging_bytes=1 << 20, prewarm=False)
    with pytest.raises(TypeError, match=r"AsyncSaver.save\(\) got unexpected keyword argument\(s\) 'blocksize'.*block_size"):
        saver.save(str(tmp_path / "a"), _state(), blocksize=1 << 20)
    with pytest.raises(TypeError, match=r"AsyncSaver\(\) got unexpected keyword argument\(s\) 'nice'.*background_nice"):
        sp.AsyncSaver(nice=3)
    with pytest.raises(TypeError):
        sp.AsyncSaver(None, 1 << 20, None, None, 5)  # after timeout: keyword-only
    r = saver.save(str(tmp_path / "b"), _state(), block_size=1 << 16, mode="lazy").wait()
    assert sp.read_manifest(str(tmp_path / "b")).block_size == 1 << 16 and r.bytes_written > 0
    saver.close()


def test_plan_cached_means_the_writer_choice_was_reused_whichever_way():
    state, comm, cache = _state(), Comm.resolve(None), SaveCache()
    results = [SaveResult(str(i), str(i)) for i in range(3)]
    prepare_save(state, comm, SaveOptions(), results[0], cache)
    with torch.no_grad():
        state["model"][0].weight.data = torch.full((8, 8), 7.0)  # new storage: the parts are made again
    p = prepare_save(state, comm, SaveOptions(), results[1], cache)
    assert cache.reused["checked"] == 0 and cache.reused["plan"] == 1  # same names and shapes: the same writers
    assert torch.equal(next(t for t in p.mine if t.fqn == "model.0.weight").data, torch.full((8, 8), 7.0))
    state["model"][0] = nn.Linear(8, 8, bias=False)  # a name fewer: writers chosen again
    prepare_save(state, comm, SaveOptions(), results[2], cache)
    assert [r.plan_cached for r in results] == [False, True, False]
