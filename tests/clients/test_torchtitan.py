"""ShardpointCheckpointManager with torchtitan's own Llama, parallelize_llama (FSDP2), optimizers and schedulers.

Its OptimizersContainer is an Optimizer by inheritance only (its own ``.state`` is empty; its
``state_dict``/``load_state_dict`` delegate to one AdamW per model part), so an exact resume proves
that the container was saved and restored through its own protocol.

Also the import of a checkpoint written by torchtitan's own DCP CheckpointManager.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan's model package imports it, even on CPU

from shardpoint.runtime import torchcompat  # noqa: E402

if not torchcompat.torchtitan_runs():  # test_optional_imports checks the error such a torch gives
    pytest.skip("torchtitan 0.3.0 needs torch 2.11 or later", allow_module_level=True)

import shardpoint as sp  # noqa: E402
from shardpoint.convert import ConversionError  # noqa: E402
from shardpoint.testing import launch  # noqa: E402

pytestmark = pytest.mark.dist

TIMEOUT = 300
AT, STEPS = 3, 6


def _run(world: int, base: str, out: str, phase: str, kind: str = "shardpoint", async_save: bool = False) -> list:
    return launch(world, "tests.clients.torchtitan_cases:run", {
        "base": base, "out": out, "phase": phase, "kind": kind, "steps": STEPS, "at": AT, "async_save": async_save,
    }, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted run saving asynchronously with shardpoint, its resume on 2 ranks and on 1, and a run saving with DCP."""
    d = tmp_path_factory.mktemp("titan")
    out = {"dir": d}
    out["full"] = _run(2, str(d / "sp"), str(d / "full.pt"), "full", async_save=True)
    out["resumed"] = _run(2, str(d / "sp"), str(d / "resumed.pt"), "resume")
    out["one"] = _run(1, str(d / "sp"), str(d / "one.pt"), "resume")
    out["dcp"] = _run(2, str(d / "dcp"), str(d / "dcp_full.pt"), "full", kind="dcp")
    out["snaps"] = {n: torch.load(d / f"{n}.pt", weights_only=False) for n in ("full", "resumed", "one", "dcp_full")}
    return out


def assert_same(a: dict, b: dict, parts=("model", "optimizer")) -> None:
    for part in parts:
        assert a[part].keys() == b[part].keys(), part
        for k, v in a[part].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b[part][k]), f"{part} tensor {k} differs"
            else:
                assert v == b[part][k], f"{part} value {k} differs"
    assert a["lr"] == b["lr"] and a["train"] == b["train"]


def test_steps_are_shardpoint_checkpoints(runs):
    folder = runs["dir"] / "sp" / "checkpoint"
    assert sorted(os.listdir(folder)) == [f"step-{s}" for s in range(AT, STEPS + 1, AT)]
    m = sp.read_manifest(str(folder / f"step-{AT}"))
    # The model goes through ModelWrapper, so the fused QKV weight is stored split, as its hooks present it.
    assert "model.layers.0.attention.qkv_linear.wq.weight" in m.tensors
    assert m.values["train_state"] == {"step": AT, "ntokens_seen": AT * 2 * 32}
    assert m.values["dataloader"] is None


def test_resumed_model_lands_exactly(runs):
    s = runs["snaps"]
    for name in ("resumed", "one"):  # same world size, and 2 ranks -> 1
        for k, v in s["full"]["mid"]["model"].items():
            assert torch.equal(v, s[name]["mid"]["model"][k]), f"{name}: model tensor {k} differs after load"
        assert s[name]["mid"]["lr"] == s["full"]["mid"]["lr"] and s[name]["mid"]["train"] == s["full"]["mid"]["train"]


def test_resume_is_exact(runs):
    s = runs["snaps"]
    assert_same(s["resumed"]["mid"], s["full"]["mid"])
    for r in range(2):
        assert runs["resumed"][r]["losses"] == runs["full"][r]["losses"][AT:], f"rank {r}: losses after resume differ"
    assert_same(s["resumed"]["end"], s["full"]["end"])
    assert_same(s["one"]["mid"], s["full"]["mid"])


def test_import_dcp_keeps_torchtitan_names(runs, tmp_path):
    from shardpoint.integrations.torchtitan import import_dcp

    src = str(runs["dir"] / "dcp" / "checkpoint" / f"step-{AT}")
    assert os.path.exists(os.path.join(src, ".metadata"))
    dst = str(tmp_path / "checkpoint" / f"step-{AT}")
    with pytest.raises(ConversionError, match="allow_pickle"):
        import_dcp(src, dst)
    import_dcp(src, dst, allow_pickle=True)
    m = sp.read_manifest(dst)
    assert "model.tok_embeddings.weight" in m.tensors and "model.layers.0.attention.qkv_linear.wq.weight" in m.tensors
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in m.tensors
    assert not [k for k in m.tensors if not k.startswith(("model.", "optimizer."))]
    assert m.values["train_state"] == {"step": AT, "ntokens_seen": AT * 2 * 32}
    emb = runs["snaps"]["dcp_full"]["mid"]["model"]["tok_embeddings.weight"]
    assert torch.equal(sp.read_tensor(dst, "model.tok_embeddings.weight"), emb)


def test_resume_from_imported_dcp_is_exact(runs, tmp_path):
    from shardpoint.integrations.torchtitan import import_dcp

    import_dcp(str(runs["dir"] / "dcp" / "checkpoint" / f"step-{AT}"), str(tmp_path / "checkpoint" / f"step-{AT}"),
               allow_pickle=True)
    resumed = _run(2, str(tmp_path), str(tmp_path / "resumed.pt"), "resume")
    ref = runs["snaps"]["dcp_full"]
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert_same(got["mid"], ref["mid"])
    for r in range(2):
        assert resumed[r]["losses"] == runs["dcp"][r]["losses"][AT:]
