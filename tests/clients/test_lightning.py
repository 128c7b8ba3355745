"""ShardpointCheckpointIO under real Lightning: resume through ``fit(ckpt_path=...)`` matches an uninterrupted run bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")

import shardpoint as sp  # noqa: E402
from shardpoint.integrations.lightning import ShardpointCheckpointIO, from_state, to_state  # noqa: E402

from . import lightning_cases as C  # noqa: E402

STEPS_PER_EPOCH = C.N // C.BATCH


def assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"model tensor {k} differs"
    assert a["optimizer"].keys() == b["optimizer"].keys() and len(a["optimizer"]) == 4
    for i in a["optimizer"]:
        assert a["optimizer"][i].keys() == b["optimizer"][i].keys()
        for k, v in a["optimizer"][i].items():
            assert torch.equal(v, b["optimizer"][i][k]), f"optimizer state {i}.{k} differs"
    assert a["scheduler"] == b["scheduler"]


def test_state_round_trip_keeps_odd_keys():
    ck = {"epoch": 2, "state_dict": {"a.b": torch.ones(2)}, "my.key": [1, (2, 3)], 7: "seven"}
    state = to_state(ck)
    assert set(state) == {"epoch", "state_dict", "lightning_other_keys"}
    back = from_state(state)
    assert back.keys() == ck.keys() and back["my.key"] == [1, (2, 3)] and back[7] == "seven"


@pytest.mark.parametrize("async_io", [False, True], ids=["sync", "async"])
def test_single_process_resume_is_exact(tmp_path, async_io):
    full = C.run(0, 1, ckpt_dir=str(tmp_path / "full"), epochs=3, out=str(tmp_path / "full.pt"), async_io=async_io)
    first = C.run(0, 1, ckpt_dir=str(tmp_path / "ck"), epochs=2, out=str(tmp_path / "first.pt"), async_io=async_io)
    # save_top_k=1: the epoch-0 checkpoint was removed through the plugin, the epoch-1 one kept.
    assert first["files"] == [f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"]
    ckpt = tmp_path / "ck" / first["files"][0]
    assert ckpt.is_dir()  # a shardpoint folder at the path Lightning chose
    names = sp.read_manifest(str(ckpt)).tensors
    assert "state_dict.layer.0.weight" in names and "optimizer_states.0.state.0.exp_avg" in names

    resumed = C.run(0, 1, ckpt_dir=str(tmp_path / "ck2"), epochs=3, out=str(tmp_path / "resumed.pt"),
                    resume=str(ckpt), async_io=async_io)
    assert first["losses"] == full["losses"][: 2 * STEPS_PER_EPOCH]
    assert resumed["losses"] == full["losses"][2 * STEPS_PER_EPOCH:]
    assert [s for s, _ in resumed["losses"]] == list(range(2 * STEPS_PER_EPOCH, 3 * STEPS_PER_EPOCH))
    saved, again, ref = (torch.load(tmp_path / f, weights_only=False) for f in ("first.pt", "resumed.pt", "full.pt"))
    assert_same_state(again["start"], saved["end"])  # what landed is what was saved
    assert_same_state(again["end"], ref["end"])  # and training continues exactly as if never stopped


def test_load_rejects_a_corrupt_checkpoint(tmp_path):
    from shardpoint.testing import flip_byte

    io = ShardpointCheckpointIO()
    path = str(tmp_path / "c.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.arange(64.0)}, "epoch": 1}, path)
    got = io.load_checkpoint(path)
    assert torch.equal(got["state_dict"]["w"], torch.arange(64.0)) and got["epoch"] == 1
    chunk = sp.read_manifest(path).tensors["state_dict.w"].chunks[0]
    flip_byte(os.path.join(path, chunk.file), chunk.offset + 5)
    with pytest.raises(sp.CorruptCheckpointError, match="state_dict.w"):
        io.load_checkpoint(path)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"epoch": 1}, path, storage_options={"x": 1})
    io.remove_checkpoint(path)
    assert not os.path.exists(path)
    sharded = str(tmp_path / "fsdp.ckpt")  # the layout ShardpointFSDPStrategy writes
    sp.save(sharded, {"model": torch.nn.Linear(2, 2), "epoch": 1})
    with pytest.raises(sp.UnsupportedStateError, match="ShardpointFSDPStrategy"):
        io.load_checkpoint(sharded)
