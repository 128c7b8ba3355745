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


def test_expert_tp4_with_attention_tp1_loads_at_other_layouts(tmp_path):
    """Expert TP 4 beside attention TP 1 on 4 ranks (each expert split four ways), reloaded at EP 2 x ETP 2
    and at EP 4 x ETP 1 (each rank one whole expert)."""
    root = str(tmp_path)
    saved = launch(4, f"{CASES}:save_job", {"root": root, "ep": 1, "tp": 1, "etp": 4, "glu": True})
    all4 = [0, 1, 2, 3]
    assert [r["layout"] for r in saved] == [[1, 0, 4, t, 1, all4] for t in range(4)]
    for r in saved:
        assert r["local"] == [[8, 24], [12, 8]]  # 4 local experts, a quarter of each expert's ffn columns
        assert r["stored"] == [[4, 8, 24], [4, 12, 8]]
        assert r["megatron"] == [["experts.linear_fc1.weight", [4, 24, 8]], ["experts.linear_fc2.weight", [4, 8, 12]]]
    layouts = {  # (EP, expert TP): each rank's [EP size, EP rank, ETP size, ETP rank, TP, global experts]
        (2, 2): [[2, e, 2, t, 1, [2 * e, 2 * e + 1]] for e in range(2) for t in range(2)],
        (4, 1): [[4, e, 1, 0, 1, [e]] for e in range(4)],
    }
    for (ep, etp), want in layouts.items():
        results = launch(4, f"{CASES}:load_job", {"root": root, "ep": ep, "tp": 1, "etp": etp, "glu": True})
        assert [r["layout"] for r in results] == want
        for r in results:
            assert r["bad"] == [] and r["checked"] == GLU_CHECKS, (ep, etp, r)
