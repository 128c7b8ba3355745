"""A plain module's per-rank expert list declared with ``sp.Experts``, resharded across EP degrees on gloo.

Saves run on 4 ranks (EP 4 with 8 and 12 experts, EP 2 x expert DP 2,
EP 2 x TP 2), then loads on 1, 2 and 8 ranks, each launch grouping its cases.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("experts"))
    out = {"four": launch(4, "tests.dist.expert_cases:four_job", {"root": root})}
    out["one"] = launch(1, "tests.dist.expert_cases:one_job", {"root": root})
    out["two"] = launch(2, "tests.dist.expert_cases:two_job", {"root": root})
    out["eight"] = launch(8, "tests.dist.expert_cases:eight_job", {"root": root}, timeout=400)
    return out


def test_experts_are_stored_once_each_at_their_global_index(runs):
    four = runs["four"]
    assert [r["ep4"]["offset"] for r in four] == [0, 2, 4, 6]
    assert [r["ep4u"]["offset"] for r in four] == [0, 3, 6, 9]
    assert [r["ep2dp2"]["offset"] for r in four] == [0, 2, 0, 2]
    names = four[0]["ep4"]["names"]
    assert [n for n in names if n.startswith("model.experts.")] == sorted(f"model.experts.{g}.weight" for g in range(8))
    assert "optimizer.state.model.experts.7.weight.exp_avg_sq" in names and "model.expert_bias" in names
    # EP 2 x TP 2: each expert's two TP shards are separate chunks of one global tensor.
    assert four[0]["eptp"] == {"chunks": 2}


@pytest.mark.parametrize("case", ["ep4_to1", "ep2_to1", "eptp_to1"])
def test_loads_into_one_process_bit_exact(runs, case):
    assert runs["one"][0][case] == []


@pytest.mark.parametrize("case", ["ep4_to2", "ep4u_to2", "ep2dp2_to2", "ep1_to2"])
def test_loads_at_ep2_bit_exact(runs, case):
    for r in runs["two"]:
        assert r[case] == [], r


def test_ep4_loads_at_ep8_bit_exact(runs):
    for r in runs["eight"]:
        assert r["ep4_to8"] == [], r


def test_an_ep_degree_that_does_not_divide_the_experts_is_a_typed_error(runs):
    for r in runs["eight"]:
        name, msg = r["ep4u_to8"]
        assert name == "ExpertLayoutError" and "12 experts" in msg and "degree of 8" in msg, msg
    for r in runs["four"]:
        name, msg = r["indivisible"]
        assert name == "ExpertLayoutError" and "6 experts" in msg and "degree of 4" in msg, msg


def test_diverged_expert_copies_are_refused(runs):
    for r in runs["four"]:
        name, msg = r["diverged"]
        assert name == "ReplicaMismatchError" and "'model.experts.0.weight'" in msg and "ranks [0]; ranks [2]" in msg, msg
