"""shardpoint.integrations.accelerate with a real Accelerator: resume matches an uninterrupted run bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

import shardpoint as sp  # noqa: E402
from shardpoint.testing import launch  # noqa: E402

TIMEOUT = 240


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"model tensor {k} differs"
    assert a["optimizer"].keys() == b["optimizer"].keys() and len(a["optimizer"]) == 4
    for i, s in a["optimizer"].items():
        for k, v in s.items():
            assert torch.equal(v, b["optimizer"][i][k]), f"optimizer state {i}.{k} differs"
    assert (a["scheduler"], a["counter"], a["step"]) == (b["scheduler"], b["counter"], b["step"])


def phases(tmp_path, world: int) -> tuple[list, list, dict]:
    ck = str(tmp_path / "ck")
    full = launch(world, "tests.clients.accelerate_cases:run", {"path": ck, "out": str(tmp_path / "full.pt"), "phase": "full"}, timeout=TIMEOUT)
    resumed = launch(world, "tests.clients.accelerate_cases:run", {"path": ck, "out": str(tmp_path / "resumed.pt"), "phase": "resume"}, timeout=TIMEOUT)
    snaps = {n: torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("full", "resumed")}
    return full, resumed, snaps


def test_one_process_resume_is_exact(tmp_path):
    full, resumed, s = phases(tmp_path, 1)
    assert full[0]["losses"][4:] == resumed[0]["losses"]
    assert_same(s["resumed"]["mid"], s["full"]["mid"])  # what landed is what was saved
    assert_same(s["resumed"]["end"], s["full"]["end"])  # and training goes on as if never stopped
    m = sp.read_manifest(str(tmp_path / "ck"))
    assert {"model_0.0.weight", "optimizer_0.state.model_0.0.weight.exp_avg", "rng.rows_w1.torch"} <= set(m.tensors)
    assert m.values["custom_0"] == {"seen": 4} and m.values["step"] == {"step": 4}


@pytest.mark.slow
@pytest.mark.dist
def test_two_processes_resume_exact_and_on_one(tmp_path):
    full, resumed, s = phases(tmp_path, 2)
    assert full[0]["distributed"] == "DistributedType.MULTI_CPU"
    for r in range(2):
        assert full[r]["losses"][4:] == resumed[r]["losses"], f"rank {r}: losses after resume differ"
    assert_same(s["resumed"]["mid"], s["full"]["mid"])
    assert_same(s["resumed"]["end"], s["full"]["end"])
    # Saved by 2 processes, loaded by 1: the model, optimizer and scheduler land exactly.
    one = launch(1, "tests.clients.accelerate_cases:run",
                 {"path": str(tmp_path / "ck"), "out": str(tmp_path / "one.pt"), "phase": "resume"}, timeout=TIMEOUT)
    assert len(one[0]["losses"]) == 4
    assert_same(torch.load(tmp_path / "one.pt", weights_only=False)["mid"], s["full"]["mid"])
