"""Rank-local calls, subset groups and disagreeing ranks on 3 gloo ranks (see ``rank_cases``)."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

from .rank_cases import SHORT

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ranks"))
    return launch(3, "tests.dist.rank_cases:ranks_job", {"root": root}, timeout=300)


def test_rank_local_save_load_read_and_async_while_others_wait_in_a_barrier(ranks):
    r0 = ranks[0]["local"]
    assert r0["load_equal"] is True and r0["read_equal"] is True
    assert r0["async_world"] == 1
    for r, res in enumerate(ranks):
        assert res["local"]["all_load_local"] is True and res["local"]["all_load_local_async"] is True, r


def test_rank_local_dtensors(ranks):
    d = ranks[1]["dtensor"]
    assert d["zeroed"] is True and d["local_shard_load"] is True
    assert d["replicated"] is True
    err = d["sharded"]
    assert err["type"] == "UnsupportedStateError"
    assert "tensor 'model.tok.weight' of shape (64, 16) is sharded across ranks" in err["message"]
    assert "process_group=sp.LOCAL" in err["message"] and "full_tensor()" in err["message"]
    assert d["sharded_left_nothing"] is True


def test_subset_group_save_load_and_async_without_the_other_rank(ranks):
    for r in (0, 1):
        s = ranks[r]["subset"]
        assert s == {"equal_sub": True, "equal_sub_async": True, "world": 2}, (r, s)
    assert ranks[2]["subset"] == {}


def test_disagreeing_ranks_raise_distributed_error_on_every_rank(ranks):
    for r, res in enumerate(ranks):
        e = res["disagree"]["save_vs_load"]
        assert e["type"] == "DistributedError", (r, e)
        assert "the ranks of the process group are in different calls: rank 0 is in save of " in e["message"]
        assert "dis_a, rank 1 is in load of " in e["message"] and "dis_b" in e["message"]
        assert e["seconds"] < SHORT, (r, e)  # a disagreement is seen at once, not after the timeout
        p = res["disagree"]["paths"]
        assert p["type"] == "DistributedError" and "rank 2 is in save of " in p["message"] and "dis_c" in p["message"], (r, p)
        assert res["disagree"]["recovered"] == 3 and res["disagree"]["nothing_committed"] is True
        a = res["disagree_async"]
        if r != 1:
            assert a["call_s"] < 0.5, (r, a)  # did not wait for the late rank
        assert a["committed"] == 3 and a["recovered"] is True, (r, a)
        p = a["paths"]
        assert p["type"] == "DistributedError" and "rank 0 is in async_save of " in p["message"], (r, p)
        assert "rank 2 is in async_save of " in p["message"] and "dis_async_f" in p["message"], (r, p)
        assert a["paths_call_s"] < SHORT and p["seconds"] < SHORT and a["paths_nothing_committed"] is True, (r, a)
    alone = ranks[0]["disagree"]["save_vs_barrier"]
    assert alone["type"] == "DistributedError"
    assert f"on rank 0: waited {SHORT:g} s for rank(s) [1, 2] of 3 to enter the same call" in alone["message"]
    assert SHORT <= alone["seconds"] < SHORT + 5


def test_non_strict_load_of_an_empty_dict_returns_everything(ranks):
    for r, res in enumerate(ranks):
        assert res["everything"] == {"keys": ["extra", "model", "optimizer"], "model": True, "optimizer": True, "extra": True}, r
