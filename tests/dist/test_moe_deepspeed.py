"""DeepSpeed's MoE layer: local experts detected and stored at their global index, EP 2 loaded at EP 1 and EP 2.

Needs ``deepspeed`` (run with ``DS_ACCELERATOR=cpu``); skipped when it is absent.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch
from tests.dist.agree_cases import CAUSE, LIMIT

pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # in `make test-slow`, which CI runs


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ds_moe"))
    return root, launch(2, "tests.dist.ds_moe_cases:save_job", {"root": root})


def test_deepspeed_experts_are_stored_at_their_global_index(saved):
    _, results = saved
    assert [r["offset"] for r in results] == [0, 2]
    want = sorted(f"model.deepspeed_moe.experts.deepspeed_experts.{g}.{n}" for g in range(4) for n in ("weight", "bias"))
    assert all(r["experts"] == want for r in results)


@pytest.mark.parametrize("world", [1, 2], ids=["ep1", "ep2"])
def test_each_expert_and_its_moments_load_bit_exact(saved, world):
    root, _ = saved
    for r in launch(world, "tests.dist.ds_moe_cases:load_job", {"root": root}):
        # per expert: weight and bias, each with exp_avg, exp_avg_sq and step; and the gate
        assert r["bad"] == [] and r["checked"] == 2 * 4 * (4 // world) + 1, r


def test_expert_detection_failing_on_one_rank_fails_every_rank_in_time(saved):
    root, _ = saved
    results = launch(2, "tests.dist.ds_moe_cases:failing_job", {"root": root})
    for what in ("save", "load"):
        recs = [r[what] for r in results]
        assert len({(rec["type"], rec["message"]) for rec in recs}) == 1, recs
        for rec in recs:
            assert rec["type"] == "DistributedError" and rec["seconds"] < LIMIT, rec
            assert f"{CAUSE}: expert-parallel groups" in rec["message"] and "rank(s) [1]" in rec["message"], rec
    assert [r["committed"] for r in results] == [False, False]
