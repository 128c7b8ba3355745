"""Incremental background saves: ``AsyncSaver.save(..., base=)`` and ``CheckpointManager(incremental=True)`` in eager and lazy mode."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import shardpoint as sp
from shardpoint.engine.pipeline import StagedWrite
from shardpoint.errors import CheckpointNotFoundError, MissingBaseError
from shardpoint.manager.folders import committed_steps
from shardpoint.manager.incremental import BaseLease, referenced_by
from shardpoint.manager.retention import Retention, StepsInUse
from shardpoint.manager.steplock import StepLock
from shardpoint.saving.incremental import ChosenBase
from shardpoint.storage import MemoryStorage
from tests.unit.incremental_states import data_bytes, lora_pair

BLOCK = 1 << 12
MODES = ["eager", "lazy"]


def _where(path) -> dict[str, set[str]]:
    """Tensor names whose chunks the checkpoint wrote itself and those it references, by kind."""
    m = sp.read_manifest(path)
    out = {"written": set(), "referenced": set()}
    for k, t in m.tensors.items():
        for ch in t.chunks:
            out["referenced" if ch.file.startswith("../") else "written"].add(k)
    return out


def _async_save(path, state, mode, saver=None, **kw):
    own = saver is None
    saver = saver or sp.AsyncSaver(prewarm=False)
    try:
        return saver.save(path, state, mode=mode, block_size=BLOCK, **kw).wait()
    finally:
        if own:
            saver.close()


def _same(path, state) -> None:
    out = sp.load(path, {}, strict=False)
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k], v), k


@pytest.mark.parametrize("mode", MODES)
def test_background_save_writes_only_the_changed_chunks(tmp_path, mode):
    st = lora_pair()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    st["model"]["adapter"].add_(1)
    r = _async_save(b, st, mode, base=a)
    assert data_bytes(b) == 8 * 8 * 4  # the adapter alone
    assert r.bytes_referenced == 256 * 64 * 4
    assert _where(b) == {"written": {"model.adapter"}, "referenced": {"model.frozen"}}
    assert sp.references_outside(b) == {"../a": {n: data_bytes(a) for n in sp.references_outside(b)["../a"]}}
    _same(b, st)


@pytest.mark.parametrize("mode", MODES)
def test_small_tensors_staged_together_are_compared_one_by_one(tmp_path, mode):
    # Tensors this small share one staging slot (a batch); each is still referenced or written on its own.
    g = torch.Generator().manual_seed(3)
    st = {"model": {f"t{k:02d}": torch.randn(16, 16, generator=g) for k in range(40)}}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    changed = {f"model.t{k:02d}" for k in range(0, 40, 3)}
    for name in changed:
        st["model"][name.split(".")[1]][5, 7] += 1.0
    r = _async_save(b, st, mode, base=a)
    assert _where(b) == {"written": changed, "referenced": {f"model.t{k:02d}" for k in range(40)} - changed}
    assert data_bytes(b) == len(changed) * 16 * 16 * 4
    assert r.bytes_referenced == (40 - len(changed)) * 16 * 16 * 4
    _same(b, st)


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_frozen_tensor_is_written_and_an_unchanged_rank_writes_no_data_file(tmp_path, mode):
    st = lora_pair()
    a, b, c = (str(tmp_path / n) for n in "abc")
    sp.save(a, st, block_size=BLOCK)
    st["model"]["frozen"].requires_grad_(False)[200, 5] += 1.0  # "frozen", changed in one late block
    r = _async_save(b, st, mode, base=a)
    assert _where(b) == {"written": {"model.frozen"}, "referenced": {"model.adapter"}} and r.bytes_referenced == 8 * 8 * 4
    assert data_bytes(b) == 256 * 64 * 4
    _same(b, st)
    r = _async_save(c, st, mode, base=b)  # nothing changed since b: every chunk is referenced
    assert r.bytes_referenced == (256 * 64 + 64) * 4
    assert not [n for n in os.listdir(os.path.join(c, "data")) if n.endswith(".bin")]
    _same(c, st)


@pytest.mark.parametrize("mode", MODES)
def test_the_comparison_reads_the_state_at_the_call(tmp_path, mode):
    st = lora_pair()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    at_call = {k: v.clone() for k, v in st["model"].items()}
    saver = sp.AsyncSaver(prewarm=False)
    try:
        h = saver.save(b, st, mode=mode, block_size=BLOCK, base=a)
        h.fence()  # a lazy save's snapshot is complete once past its fence
        st["model"]["frozen"].add_(1)  # after the snapshot: neither compared nor written
        r = h.wait()
    finally:
        saver.close()
    assert r.bytes_referenced == (256 * 64 + 64) * 4
    _same(b, {"model": at_call})


@pytest.mark.parametrize("mode", MODES)
def test_pieces_are_held_across_blocks_and_a_chunk_larger_than_the_ring_is_written(tmp_path, mode):
    """A ring of 48 KiB in pieces of 6000 bytes (not a multiple of the 4 KiB block)."""
    g = torch.Generator().manual_seed(3)
    st = {"model": {k: torch.randn(n, generator=g) for k, n in
                    (("big", 16384), ("same", 6144), ("late", 6144), ("early", 6144), ("small", 64))}}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    st["model"]["late"][-1] += 1.0  # differs in the last block: all held pieces are written then
    st["model"]["early"][0] += 1.0  # differs in the first block: the rest streams as usual
    st["model"]["small"][0] += 1.0
    saver = sp.AsyncSaver(staging_bytes=48 << 10, piece_bytes=6000, prewarm=False)
    try:
        r = _async_save(b, st, mode, saver=saver, base=a)
    finally:
        saver.close()
    # "big" (64 KiB) cannot be held beside a piece in the ring: written in full although unchanged.
    assert _where(b) == {"written": {"model.big", "model.late", "model.early", "model.small"}, "referenced": {"model.same"}}
    assert r.bytes_referenced == 6144 * 4
    _same(b, st)  # every written block verifies against its checksum


@pytest.mark.parametrize("mode", MODES)
def test_a_missing_base_fails_at_wait_naming_it(tmp_path, mode):
    st = lora_pair()
    gone, b = str(tmp_path / "gone"), str(tmp_path / "b")
    saver = sp.AsyncSaver(prewarm=False)
    try:
        h = saver.save(b, st, mode=mode, block_size=BLOCK, base=gone)  # returns: the base is opened in the background
        with pytest.raises(CheckpointNotFoundError, match=r"base=.*gone.* holds no committed checkpoint"):
            h.wait()
    finally:
        saver.close()
    assert not os.path.exists(os.path.join(b, "manifest.json"))


def test_a_base_removed_while_the_save_runs_fails_it_naming_the_base(tmp_path, monkeypatch):
    st = lora_pair()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(a, st, block_size=BLOCK)
    write = StagedWrite.write

    def write_then_remove_base(self, *args, **kw):
        write(self, *args, **kw)
        shutil.rmtree(os.path.join(a, "data"))

    monkeypatch.setattr(StagedWrite, "write", write_then_remove_base)
    saver = sp.AsyncSaver(prewarm=False)
    try:
        with pytest.raises(MissingBaseError, match=r"changed or was removed while this save ran") as ei:
            saver.save(b, st, block_size=BLOCK, base=a).wait()
    finally:
        saver.close()
    assert "../a/data/" in str(ei.value) and isinstance(ei.value, sp.CheckpointError)
    assert not os.path.exists(os.path.join(b, "manifest.json"))  # never a commit referencing missing data


@pytest.mark.parametrize("mode", MODES)
def test_memory_storage_and_a_chosen_base(mode):
    run = MemoryStorage()
    st = lora_pair()
    sp.save(run.child("s1"), st, block_size=BLOCK)
    st["model"]["adapter"].add_(2)
    r = _async_save(run.child("s2"), st, mode, base=ChosenBase(lambda: run.child("s1")))
    assert r.bytes_referenced == 256 * 64 * 4
    _same(run.child("s2"), st)
    r = _async_save(run.child("s3"), st, mode, base=ChosenBase(lambda: None))  # no base chosen: written in full
    assert r.bytes_referenced == 0 and "refs" not in run.child("s3").get("manifest.json").decode()
    _same(run.child("s3"), st)


# --- the manager ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_manager_background_incremental_saves_keep_every_kept_step_loadable(tmp_path, mode):
    root = str(tmp_path)
    st, saved, results = lora_pair(), {}, {}
    mgr = sp.CheckpointManager(root, interval=1, keep_last=2, mode=mode, incremental=True, prewarm=False,
                               save_options={"block_size": BLOCK})
    try:
        for step in range(1, 7):
            st["model"]["adapter"].add_(1)
            results[step] = mgr.save(step, st)  # the next save waits for this one: saves and retention overlap
            saved[step] = {"model": {k: v.clone() for k, v in st["model"].items()}}
        mgr.wait()
    finally:
        mgr.close()
    assert mgr.retention_errors == []
    assert mgr.steps() == [5, 6]
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000001", "step_00000005", "step_00000006"]
    assert ["data/" + n for n in os.listdir(os.path.join(root, "step_00000001", "data"))] == sorted(referenced_by(sp.LocalStorage(root), [5, 6])["step_00000001"])
    assert data_bytes(os.path.join(root, "step_00000001")) >= 256 * 64 * 4
    for step in range(2, 7):
        assert results[step].wait().bytes_referenced == 256 * 64 * 4, step
    for step in (5, 6):
        path = os.path.join(root, f"step_{step:08d}")
        assert data_bytes(path) == 8 * 8 * 4  # the adapter alone
        _same(path, saved[step])


def test_manager_base_removed_by_hand_falls_back_to_the_next_newest_step_or_a_full_write(tmp_path):
    root = str(tmp_path)
    st = lora_pair()
    path = lambda step: os.path.join(root, f"step_{step:08d}")  # noqa: E731
    mgr = sp.CheckpointManager(root, interval=1, keep_last=None, mode="lazy", incremental=True, prewarm=False,
                               save_options={"block_size": BLOCK})
    try:
        for step in (1, 2):
            st["model"]["adapter"].add_(1)
            mgr.save(step, st)
            mgr.wait()
        shutil.rmtree(path(2))  # the base the next save would take
        st["model"]["adapter"].add_(1)
        r3 = mgr.save(3, st).wait()
        _same(path(3), st)
        assert r3.bytes_referenced == 256 * 64 * 4 and set(sp.references_outside(path(3))) == {"../step_00000001"}
        shutil.rmtree(path(1))
        shutil.rmtree(path(3))
        r4 = mgr.save(4, st).wait()
    finally:
        mgr.close()
    assert r4.bytes_referenced == 0 and sp.references_outside(path(4)) == {}
    _same(path(4), st)


def test_a_chosen_base_is_protected_from_retention_until_released(tmp_path):
    run = sp.LocalStorage(str(tmp_path))
    st = lora_pair()
    for step in (1, 2):
        sp.save(run.child(f"step_{step:08d}"), st, block_size=BLOCK)
    in_use = StepsInUse()
    lease = BaseLease(run, 3, in_use)
    assert lease.choose().url == run.child("step_00000002").url
    sp.save(run.child("step_00000003"), st, block_size=BLOCK)
    sp.save(run.child("step_00000004"), st, block_size=BLOCK)
    retention = Retention(run, 1, None, in_use, StepLock(owner="t", stale_lock_s=3600.0), incremental=True)
    retention.run_pass()
    assert committed_steps(run) == [2, 4]  # 2 is the chosen base
    lease.release()
    assert lease.choose() is None  # a choice after the save ended protects nothing
    retention.run_pass()
    assert committed_steps(run) == [4]
