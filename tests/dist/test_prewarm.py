"""Pre-warmed asynchronous savers on 2 gloo ranks: what exists after construction, and the first save's stall."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


def test_prewarm(tmp_path):
    results = launch(2, "tests.dist.prewarm_cases:prewarm_job", {"root": str(tmp_path)})
    for r in results:
        w = r["prewarmed"]
        assert w["group"] is True and w["workers"] == 2 and w["threads"] == 2, w
        assert w["groups"] == 1 and w["allocations"] == 1, w
        # This rank's share of the FSDP2 state (~half of 24 MB) is touched, not the whole 64 MiB budget.
        assert 4 << 20 < w["staged"] == w["state"] < 64 << 20, w
        # No save made a group, a buffer or a thread; the state fitted the touched prefix.
        assert r["after"] == {"groups": 1, "allocations": 1, "high_water": w["state"], "threads": 2}, r["after"]
        assert r["plan_cached"] == [True] * 5
        assert r["diff"] == []
        assert r["closed_threads"] == 0
        # The first save stalls like the later ones (generous: the machine may be loaded).
        assert r["first_over_median"] < 1.5 or r["calls"][0] < 0.05, (r["calls"], r["blocked"])
        assert r["cold"] == {"prewarmed": None, "groups": 0, "ring": False, "threads": 0}, r["cold"]
        assert r["cold_after"] == {"groups": 1, "allocations": 1}
        m = r["manager"]
        assert m["comm"] is True and m["saver_group"] is True and m["staged"] == m["state"] == w["state"], m
        assert r["manager_cold"] == {"comm": False, "saver": False}


def test_a_saver_made_on_one_rank_does_not_wait_for_the_others(tmp_path):
    results = launch(2, "tests.dist.prewarm_cases:local_saver_job", {"root": str(tmp_path)}, timeout=120)
    assert results[1] == {}
    assert results[0] == {"workers": 2, "groups": 0, "step": 7}
