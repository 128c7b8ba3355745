"""ShardpointCheckpointIO under Lightning DDP on 2 gloo ranks: rank 0 saves alone, any world size resumes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")

from shardpoint.integrations.lightning import ShardpointCheckpointIO  # noqa: E402
from shardpoint.testing import launch  # noqa: E402

from . import lightning_cases as C  # noqa: E402
from .test_lightning import assert_same_state  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # in `make test-slow`, which CI runs

# Lightning catches SIGTERM under DDP, so a hang is cut off by the launcher's hard timeout instead.
TIMEOUT = 240
STEPS = C.N // C.BATCH // 2  # per epoch, per rank


def ckpt_state(path: str) -> dict:
    """The model, optimizer and scheduler state inside a Lightning checkpoint, as ``snapshot`` lays it out."""
    ck = ShardpointCheckpointIO().load_checkpoint(path)
    return {
        "model": {k[len("layer."):]: v for k, v in ck["state_dict"].items()},
        "optimizer": ck["optimizer_states"][0]["state"],
        "scheduler": ck["lr_schedulers"][0],
    }


def test_ddp_resume_is_exact_and_resumes_on_one_process(tmp_path):
    full_dir, again_dir, one_dir = (str(tmp_path / d) for d in ("full", "again", "one"))
    full = launch(2, "tests.clients.lightning_cases:run", {
        "ckpt_dir": full_dir, "epochs": 3, "out": str(tmp_path / "full.pt"), "strategy": "ddp", "keep": -1,
    }, timeout=TIMEOUT)
    names = [f"epoch={e}-step={(e + 1) * STEPS}.ckpt" for e in range(3)]
    assert full[0]["files"] == names
    mid = f"{full_dir}/{names[1]}"

    # Same world size, saving asynchronously this time: the same losses and the same final state.
    again = launch(2, "tests.clients.lightning_cases:run", {
        "ckpt_dir": again_dir, "epochs": 3, "out": str(tmp_path / "again.pt"), "strategy": "ddp",
        "resume": mid, "async_io": True,
    }, timeout=TIMEOUT)
    for r in range(2):
        assert again[r]["losses"] == full[r]["losses"][2 * STEPS:], f"rank {r}: losses after resume differ"
    ref, got = (torch.load(tmp_path / f, weights_only=False) for f in ("full.pt", "again.pt"))
    assert_same_state(got["start"], ckpt_state(mid))
    assert_same_state(got["end"], ref["end"])
    assert again[0]["files"] == [names[2]]
    assert_same_state(ckpt_state(f"{again_dir}/{names[2]}"), ckpt_state(f"{full_dir}/{names[2]}"))

    # Saved by 2 processes, resumed by 1: everything lands exactly, and training goes on.
    one = launch(1, "tests.clients.lightning_cases:run", {
        "ckpt_dir": one_dir, "epochs": 3, "out": str(tmp_path / "one.pt"), "resume": mid,
    }, timeout=TIMEOUT)
    assert [s for s, _ in one[0]["losses"]] == list(range(2 * STEPS, 2 * STEPS + 2 * STEPS))
    assert_same_state(torch.load(tmp_path / "one.pt", weights_only=False)["start"], ckpt_state(mid))
