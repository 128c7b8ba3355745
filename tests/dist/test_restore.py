"""Real-client state shapes on 2 gloo ranks, restored through their own protocol, bit for bit.

Fused-QKV state-dict hooks under FSDP2 (ours, and torchtitan's own fused
QKV linear when it is installed); an HF transformers Llama with tied
embeddings under FSDP2 and under TP; an optimizer container with one AdamW
per model part under FSDP2 (ours, shaped like torchtitan's, and torchtitan's
own when it is installed); and a load that cannot land, which raises the
same typed error on both ranks. All cases share one process group.
"""

from __future__ import annotations

import importlib.util

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


def test_protocol_restores_under_fsdp2_and_tp(tmp_path):
    pytest.importorskip("transformers")
    cases = ["hooks_fsdp2", "parts_fsdp2", "llama_fsdp2", "llama_tp"]
    if importlib.util.find_spec("torchtitan") is not None:
        cases += ["titan_fsdp2", "titan_hooks_fsdp2"]
    results = launch(2, "tests.dist.restore_cases:run_job", {"root": str(tmp_path), "cases": cases})
    assert sorted(results[0]) == sorted(cases + ["not_landed"])
    assert [r["not_landed"] for r in results] == ["StateNotRestoredError"] * 2
    for name in cases:  # both ranks computed the same next loss (checked against the run itself in the ranks)
        assert results[0][name] == results[1][name], name
        assert results[0][name]["tensors"] > 0
