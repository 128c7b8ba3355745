"""DCP <-> shardpoint with model AND optimizer under FSDP2 on 2 gloo ranks (see ``dcp_optim_cases``)."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp_optim"))
    return launch(2, "tests.dist.dcp_optim_cases:dcp_job", {"root": root}, timeout=300)


def test_conversions_ran_and_named_the_optimizer_both_ways(ranks):
    r0 = ranks[0]
    assert r0["rc"] == [0, 0]
    assert r0["ref_steps"] == [2.0]  # AdamW's step counts are part of what must come back
    # Imported from DCP: stored in shardpoint's scheme (state key in the name).
    names = {f"optimizer.state.{p}.{k}" for p in ("model.head.weight", "model.layers.1.mlp.w2.weight") for k in ("exp_avg", "exp_avg_sq", "step")}
    assert names <= set(r0["imported_names"]) and all(n.startswith("optimizer.state.model.") for n in r0["imported_names"])
    # Saved from get_optimizer_state_dict's dict: the DCP names, mapped at load time.
    assert {n.replace("state.model.", "state.", 1) for n in names} <= set(r0["keyed_names"])
    assert len(r0["keyed_names"]) == len(r0["imported_names"]) == 3 * 29  # 29 parameters, 3 state tensors each


@pytest.mark.parametrize("way", ["import", "export", "keyed"])
def test_bit_exact_state_and_the_same_next_losses(ranks, way):
    for r, res in enumerate(ranks):
        assert res["ref_tensors"] == 29 + 3 * 29
        assert res[f"{way}_diff"] == [], (r, res[f"{way}_diff"][:10])
        assert res[f"{way}_next"] == res["uninterrupted"], (r, res[f"{way}_next"], res["uninterrupted"])
