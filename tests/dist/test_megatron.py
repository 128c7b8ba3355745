"""A Megatron-Core GPT at TP 2 x PP 2 (4 gloo ranks on CPU), saved and loaded into plain PyTorch.

Needs ``megatron-core`` (``make install`` puts it in with ``--no-deps``);
skipped when it is absent.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron"))
    return root, launch(4, "tests.dist.megatron_cases:save_job", {"root": root})


def test_megatron_save_stores_logical_global_tensors(saved):
    _, results = saved
    # Stage-local layer indices became global: stage 0 holds 0, 1 and stage 1 holds 2, 3.
    assert [r["layers"] for r in results] == [["0", "1"], ["0", "1"], ["2", "3"], ["2", "3"]]
    tensors = results[0]["tensors"]
    assert all(r["tensors"] == tensors for r in results)
    assert not any("linear_qkv" in t or "linear_fc1" in t for t in tensors)
    for i in range(4):
        for part in ("linear_q", "linear_k", "linear_v"):
            assert f"model.decoder.layers.{i}.self_attention.{part}.weight" in tensors
            assert f"optimizer.state.model.decoder.layers.{i}.self_attention.{part}.weight.exp_avg" in tensors
        assert f"model.decoder.layers.{i}.mlp.linear_gate.weight" in tensors


@pytest.mark.parametrize("world", [1, 2], ids=["to1", "to_fsdp2"])
def test_megatron_tp2_pp2_to_plain(saved, world):
    root, _ = saved
    for r in launch(world, "tests.dist.megatron_cases:load_job", {"root": root}):
        assert r["n"] > 0 and r["max_diff"] < 1e-5, r


def test_megatron_expert_parameters_are_refused(saved):
    for r in saved[1]:
        err = r["expert_error"]
        assert err is not None and err.startswith("UnsupportedStateError") and "expert" in err, r
