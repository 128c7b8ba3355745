"""Megatron-Core ``GroupedMLP`` experts with expert tensor parallelism, across EP and expert-TP degrees, on gloo.

Each weight is checked element by element where Megatron's own
``sharded_state_dict`` places it (see ``tests/dist/grouped_cases.py``).
Needs ``megatron-core``; skipped when it is absent.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # in `make test-slow`, which CI runs

CASES = "tests.dist.grouped_cases"
# weight1 (fc1: Megatron's gate and up halves) and weight2, each with exp_avg and exp_avg_sq
GLU_CHECKS, PLAIN_CHECKS = 9, 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("grouped"))
    return root, launch(4, f"{CASES}:save_job", {"root": root, "ep": 2, "tp": 2, "glu": True})


def test_grouped_weights_are_stored_as_every_global_expert(saved):
    _, results = saved
    for r in results:
        assert r["local"] == [[8, 24], [12, 8]]  # 2 local experts, a quarter of fc1's and fc2's ffn columns
        assert r["stored"] == [[4, 8, 24], [4, 12, 8]]  # [experts, hidden, gate+up] and [experts, ffn, hidden]
        assert r["megatron"] == [["experts.linear_fc1.weight", [4, 24, 8]], ["experts.linear_fc2.weight", [4, 8, 12]]]


@pytest.mark.parametrize("world,ep,tp", [(1, 1, 1), (2, 1, 2), (2, 2, 1)], ids=["ep1", "etp2", "ep2"])
def test_ep2_etp2_checkpoint_loads_bit_exact(saved, world, ep, tp):
    root, _ = saved
    results = launch(world, f"{CASES}:load_job", {"root": root, "ep": ep, "tp": tp, "glu": True})
    assert len(results) == world
    for r in results:
        assert r["bad"] == [] and r["checked"] == GLU_CHECKS, r


def test_ep1_checkpoint_loads_at_ep2_etp2(tmp_path):
    root = str(tmp_path)
    (one,) = launch(1, f"{CASES}:save_job", {"root": root, "ep": 1, "tp": 1, "glu": True})
    assert one["local"] == [[8, 96], [48, 8]] and one["stored"] == [[4, 8, 24], [4, 12, 8]]
    for r in launch(4, f"{CASES}:load_job", {"root": root, "ep": 2, "tp": 2, "glu": True}):
        assert r["bad"] == [] and r["checked"] == GLU_CHECKS and r["local"] == [[8, 24], [12, 8]], r


def test_without_gated_units_ep2_loads_at_etp2(tmp_path):
    root = str(tmp_path)
    saved = launch(2, f"{CASES}:save_job", {"root": root, "ep": 2, "tp": 1, "glu": False})
    assert [r["stored"] for r in saved] == [[[4, 8, 12], [4, 12, 8]]] * 2
    for r in launch(2, f"{CASES}:load_job", {"root": root, "ep": 1, "tp": 2, "glu": False}):
        assert r["bad"] == [] and r["checked"] == PLAIN_CHECKS and r["local"] == [[8, 24], [24, 8]], r
