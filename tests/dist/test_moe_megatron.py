"""Megatron-Core's MoELayer (SequentialMLP experts) saved at EP 2 and loaded at EP 2 and EP 1 on gloo.

Needs ``megatron-core``; skipped when it is absent.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe"))
    return root, launch(2, "tests.dist.moe_cases:save_job", {"root": root})


def test_local_experts_are_stored_at_their_global_index(saved):
    _, results = saved
    assert [r["indices"] for r in results] == [[0, 1], [2, 3]]
    names = results[0]["names"]
    for g in range(4):
        assert f"model.experts.local_experts.{g}.linear_fc1.weight" in names
        assert f"optimizer.state.model.experts.local_experts.{g}.linear_fc2.weight.exp_avg_sq" in names
    assert "model.router.weight" in names and "model.router.expert_bias" in names
    assert not any("@ranks" in n for n in names)


@pytest.mark.parametrize("world", [2, 1], ids=["ep2", "ep1"])
def test_every_global_expert_router_and_moment_bit_exact(saved, world):
    root, _ = saved
    results = launch(world, "tests.dist.moe_cases:load_job", {"root": root})
    assert sorted(i for r in results for i in r["indices"]) == [0, 1, 2, 3]
    for r in results:
        # 2 matrices x (weight + exp_avg + exp_avg_sq + step) per expert, and the router's 4 + expert bias
        assert r["bad"] == [] and r["checked"] == 8 * len(r["indices"]) + 5, r


@pytest.mark.slow  # in `make test-slow`, which CI runs
def test_expert_tensor_parallel_experts_load_whole_at_ep1(tmp_path):
    """TP 2 x EP 2 on 4 ranks (experts split over the expert TP group) into one process at EP 1, TP 1."""
    root = str(tmp_path)
    saved = launch(4, "tests.dist.moe_cases:etp_save_job", {"root": root})
    assert [r["indices"] for r in saved] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["etp"] for r in saved] == [[2, 0], [2, 1], [2, 0], [2, 1]]
    (r,) = launch(1, "tests.dist.moe_cases:etp_load_job", {"root": root})
    assert r == {"checked": 8, "bad": []}
