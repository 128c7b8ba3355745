"""Peer memory without processes: host identity, the routed restore source, and a one-rank save and restore."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint as sp
from shardpoint.peer import RoutedStorage, host_id
from shardpoint.storage import MemoryStorage
from shardpoint.testing import flip_byte


def test_host_id_sources():
    assert host_id({"SHARDPOINT_HOST": "h7", "GROUP_RANK": "2"}) == "h7"
    assert host_id({"GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "4"}) == "node2"
    assert host_id({"RANK": "9", "LOCAL_WORLD_SIZE": "4"}) == "node2"
    assert host_id({}) == __import__("socket").gethostname()


def test_routed_storage_falls_back_and_counts_bytes():
    a, b = MemoryStorage(), MemoryStorage()
    b.put_atomic("data/x", b"0123456789")
    a.put_atomic("data/x", b"abcdefghij")
    r = RoutedStorage("peer-memory:t", b"{}", {"data/x": [("h0", MemoryStorage()), ("h1", b), ("h2", a)]})
    assert r.read("data/x", 2, 3) == b"234"  # h0 lacks it: h1 serves it
    assert r.bytes_from == {"h1": 3} and r.get("manifest.json") == b"{}"
    assert r.demote_named("checksum mismatch in data/x bytes 0..4") and r.read("data/x", 0, 2) == b"ab"
    assert not r.demote("data/x")  # the last copy is kept
    with pytest.raises(sp.StorageError):
        r.put_atomic("data/y", b"")


def test_one_rank_memory_restore_prefers_memory_and_detects_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPOINT_HOST", "solo")
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    mem = sp.PeerMemory(dir=str(tmp_path / "mem"), replicas=1, interval=2, mode=None)
    mgr = sp.CheckpointManager(str(tmp_path / "run"), interval=3, memory=mem, mode=None)
    for step in range(1, 5):
        state["w"] += 1
        mgr.maybe_save(step, state)
    mgr.close()
    assert mem.steps() == [4] and mgr.steps() == [3]
    want = state["w"].clone()
    got = {"w": torch.zeros(1000)}
    mgr2 = sp.CheckpointManager(str(tmp_path / "run"), interval=3, memory=mem, mode=None)
    assert mgr2.restore(got) == 4 and torch.equal(got["w"], want)
    assert mgr2.last_restore.source == "memory" and mgr2.storage.stats.bytes_read == 0
    # The only memory copy corrupt: the checksum rejects it and the stored step 3 loads.
    folder = tmp_path / "mem" / "step_00000004"
    data = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".bin")]
    flip_byte(data[0], 100)
    got = {"w": torch.zeros(1000)}
    assert mgr2.restore(got) == 3 and mgr2.last_restore.source == "storage"
    assert torch.equal(got["w"], want - 1)


def test_routed_load_takes_only_the_corrupt_chunk_from_the_next_copy(tmp_path):
    # Two hosts' copies of one checkpoint; one chunk of the first copy is corrupt.
    import shutil

    from shardpoint.storage import LocalStorage

    state = {"a": torch.arange(3 << 20, dtype=torch.float32), "b": torch.arange(1 << 20, dtype=torch.float32) * 2}
    sp.save(str(tmp_path / "h0"), state, process_group=sp.LOCAL)
    shutil.copytree(tmp_path / "h0", tmp_path / "h1")
    man = sp.read_manifest(str(tmp_path / "h0"))
    bad = man.tensors["a"].chunks[0]
    flip_byte(str(tmp_path / "h0" / bad.file), bad.offset + 5 * (1 << 20))  # inside its second checksum block
    h0, h1 = LocalStorage(str(tmp_path / "h0")), LocalStorage(str(tmp_path / "h1"))
    routed = RoutedStorage("peer-memory:t", h0.get("manifest.json"), {f: [("h0", h0), ("h1", h1)] for f in man.files})
    got = {"a": torch.zeros(3 << 20), "b": torch.zeros(1 << 20)}
    sp.load(routed, got, process_group=sp.LOCAL)
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])
    # Only chunk "a" was read again, whole, from h1; h0 served the rest (and a's blocks up to the bad one).
    assert routed.bytes_from["h1"] == bad.nbytes
    served = routed.bytes_from["h0"] - 2 * man.block_size - man.tensors["b"].chunks[0].nbytes
    assert 0 <= served < 4096, served  # plus the small index file
    # Every copy of the chunk bad: the load fails with the checksum error naming the file.
    flip_byte(str(tmp_path / "h1" / bad.file), bad.offset + 5 * (1 << 20))
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch in " + bad.file):
        sp.load(routed, {"a": torch.zeros(3 << 20), "b": torch.zeros(1 << 20)}, process_group=sp.LOCAL)
