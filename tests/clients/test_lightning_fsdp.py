"""ShardpointFSDPStrategy under Lightning FSDP on 2 gloo ranks: sharded saves, exact resume, resume on 1 process."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")

import shardpoint as sp  # noqa: E402
from shardpoint.testing import launch  # noqa: E402

from . import lightning_cases as C  # noqa: E402
from .test_lightning import assert_same_state  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # in `make test-slow`, which CI runs

TIMEOUT = 240  # Lightning catches SIGTERM under DDP/FSDP: a hang ends at the launcher's hard timeout
STEPS = C.N // C.BATCH // 2  # per epoch, per rank


def test_fsdp_resume_is_exact_and_resumes_on_one_process(tmp_path):
    full_dir = str(tmp_path / "full")
    args = {"strategy": "shardpoint_fsdp"}
    full = launch(2, "tests.clients.lightning_cases:run", {
        **args, "ckpt_dir": full_dir, "epochs": 3, "out": str(tmp_path / "full.pt"), "keep": -1,
    }, timeout=TIMEOUT)
    names = [f"epoch={e}-step={(e + 1) * STEPS}.ckpt" for e in range(3)]
    assert full[0]["files"] == names
    mid = f"{full_dir}/{names[1]}"
    m = sp.read_manifest(mid)
    # Sharded: each rank wrote its own half of every flat parameter, and the optimizer state beside it.
    assert m.tensors["model.layer.0.weight"].shape == (16, 8) and "optimizer_0.state.model.layer.0.weight.exp_avg" in m.tensors
    assert m.values["global_step"] == 2 * STEPS

    again = launch(2, "tests.clients.lightning_cases:run", {
        **args, "ckpt_dir": str(tmp_path / "again"), "epochs": 3, "out": str(tmp_path / "again.pt"), "resume": mid,
    }, timeout=TIMEOUT)
    for r in range(2):
        assert again[r]["losses"] == full[r]["losses"][2 * STEPS:], f"rank {r}: losses after resume differ"
    ref, got = (torch.load(tmp_path / f, weights_only=False) for f in ("full.pt", "again.pt"))
    assert_same_state(got["start"], ref["epochs"][1])
    assert_same_state(got["end"], ref["end"])

    # Saved by 2 ranks, resumed by 1: the model and optimizer reshard and land exactly.
    one = launch(1, "tests.clients.lightning_cases:run", {
        **args, "ckpt_dir": str(tmp_path / "one"), "epochs": 3, "out": str(tmp_path / "one.pt"), "resume": mid,
    }, timeout=TIMEOUT)
    assert [s for s, _ in one[0]["losses"]] == list(range(2 * STEPS, 2 * STEPS + 2 * STEPS))
    assert_same_state(torch.load(tmp_path / "one.pt", weights_only=False)["start"], ref["epochs"][1])
