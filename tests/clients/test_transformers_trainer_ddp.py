"""ShardpointTrainer on two processes (DDP on gloo): an interrupted run resumes bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from shardpoint.testing import launch  # noqa: E402


@pytest.mark.dist
@pytest.mark.slow  # in `make test-slow`, which CI runs
def test_two_process_resume_is_bit_exact(tmp_path):
    ranks = launch(2, "tests.clients.transformers_cases:run", {"root": str(tmp_path)}, timeout=400)
    assert ranks[0]["distributed"] == "DistributedType.MULTI_CPU"
    for r in ranks:
        assert len(r["full"]) == 6 and r["resumed"] == r["full"], "step, learning rate or loss differs after the resume"
        assert r["folders"] == ["checkpoint-4", "checkpoint-6"]
    w = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert w["full"].keys() == w["resumed"].keys()
    for k, v in w["full"].items():
        assert torch.equal(v, w["resumed"][k]), f"{k} differs after the resume"
