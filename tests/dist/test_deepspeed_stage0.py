"""A DeepSpeed engine without ZeRO (stage 0) saves and loads as a plain module, bit for bit, on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

from shardpoint.testing import launch

pytestmark = [
    pytest.mark.dist,
    pytest.mark.slow,  # in `make test-slow`, which CI runs
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def stage0_job(rank: int, world: int, root: str) -> dict:
    import deepspeed
    import deepspeed.ops

    import shardpoint as sp

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # ZeRO needs no shared-memory op; gloo carries all
    deepspeed.utils.logger.setLevel(logging.WARNING)
    torch.manual_seed(0)
    m = torch.nn.Linear(5, 3)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}
    engine, opt, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=0.1), config=config)
    torch.manual_seed(1)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 5)).sum())
        engine.step()
    ckpt = os.path.join(root, "ckpt")
    sp.save(ckpt, {"engine": engine, "optimizer": opt})
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[m.weight].items()}
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(7.0)
    for v in opt.state[m.weight].values():
        v.zero_()
    sp.load(ckpt, {"engine": engine, "optimizer": opt})
    return {
        "entries": sp.read_manifest(ckpt).layout["entries"],
        "model": all(torch.equal(saved[k], v) for k, v in m.state_dict().items()),
        "moments": all(torch.equal(moments[k], v) for k, v in opt.state[m.weight].items()),
        "moment_names": sorted(moments),
    }


def test_a_stage0_engine_round_trips_as_a_module(tmp_path):
    results = launch(2, "tests.dist.test_deepspeed_stage0:stage0_job", {"root": str(tmp_path)})
    for r in results:
        assert r["entries"] == {"engine": "deepspeed_zero0", "optimizer": "optimizer:AdamW"}, r
        assert r["model"] and r["moments"], r
        assert r["moment_names"] == ["exp_avg", "exp_avg_sq", "step"], r
