"""Tiered storage: fast commit, background copies, per-tier durability, fallback reads, retention."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint as sp
from shardpoint.storage import LocalStorage, MemoryStorage
from shardpoint.storage.tiers import TieredStorage
from shardpoint.testing import flip_byte


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture
def tiers(tmp_path):
    remote = MemoryStorage()
    t = TieredStorage([str(tmp_path / "host"), str(tmp_path / "local"), remote],
                      names=("host", "local", "remote"), keep_last={"host": 1})
    yield t, remote
    t.close()


def test_save_lands_on_every_tier(tiers, tmp_path):
    t, remote = tiers
    m = _model()
    h = sp.async_save(t.child("step_1"), {"model": m})
    h.wait(tier="remote")
    for tier in ("host", "local", "remote"):
        assert t.child("step_1").durable_on(tier), tier
    assert remote.child("step_1").exists("manifest.json")
    m2 = _model(1)
    sp.load(remote.child("step_1"), {"model": m2})  # the remote copy alone is a full checkpoint
    assert _same(m, m2)


def test_reads_fall_back_to_slower_tiers(tiers, tmp_path):
    t, _ = tiers
    m = _model()
    sp.save(t.child("step_1"), {"model": m})
    t.wait("remote")
    host = LocalStorage(str(tmp_path / "host" / "step_1"))
    f = next(n for n in host.list("data/"))
    flip_byte(os.path.join(host.root, f), 100, mask=1)  # corrupt the fast copy
    m2 = _model(1)
    sp.load(t.child("step_1"), {"model": m2})
    assert _same(m, m2)
    # Without the slower tiers the corruption is caught, not loaded.
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch"):
        sp.load(host, {"model": _model(2)})
    # A fast tier that lost the data entirely: everything comes from below.
    for n in host.list(""):
        host.delete(n)
    m3 = _model(3)
    sp.load(t.child("step_1"), {"model": m3})
    assert _same(m, m3)


def test_fast_tier_retention_keeps_last_k(tiers, tmp_path):
    t, remote = tiers
    for step in (1, 2, 3):
        sp.save(t.child(f"step_{step}"), {"model": _model(step)})
        t.wait("remote")
    host = LocalStorage(str(tmp_path / "host"))
    assert sorted({n.split("/")[0] for n in host.list("") if n.endswith("manifest.json")}) == ["step_3"]
    assert sorted({n.split("/")[0] for n in remote.list("") if n.endswith("manifest.json")}) == ["step_1", "step_2", "step_3"]
    m = _model(0)
    sp.load(t.child("step_1"), {"model": m})  # evicted from host, still loads from below
    assert _same(m, _model(1))


def test_resume_replication_completes_interrupted_copies(tmp_path):
    host, remote = str(tmp_path / "host"), MemoryStorage()
    only_host = TieredStorage([host], names=("host",))
    sp.save(only_host.child("step_7"), {"model": _model(7)})  # as if killed before any copy
    t = TieredStorage([host, remote], names=("host", "remote"))
    assert t.resume_replication() == ["step_7"]
    t.wait("remote")
    assert t.resume_replication() == []
    m = _model(0)
    sp.load(remote.child("step_7"), {"model": m})
    assert _same(m, _model(7))
    t.close()


def test_a_corrupt_large_span_on_the_fast_tier_comes_from_below(tiers, tmp_path):
    """A span read straight into its destination and found corrupt is read again from a slower tier."""
    t, _ = tiers
    w = torch.randn(300_000)  # 1.2 MB: read alone, into place
    sp.save(t.child("step_1"), {"w": w}, block_size=256 << 10)
    t.wait("remote")
    host = LocalStorage(str(tmp_path / "host" / "step_1"))
    chunk = sp.read_manifest(host).tensors["w"].chunks[0]
    flip_byte(os.path.join(host.root, chunk.file), chunk.offset + 3 * (256 << 10) + 11)  # the fourth block
    state = {"w": torch.zeros(300_000)}
    sp.load(t.child("step_1"), state)
    assert torch.equal(state["w"], w)
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch"):
        sp.load(host, {"w": torch.zeros(300_000)})


def test_an_overwrite_cleans_every_tier_of_the_replaced_files(tmp_path):
    remote = MemoryStorage()
    t = TieredStorage([str(tmp_path / "host"), remote], names=("host", "remote"), cleanup_grace_s=0)
    try:
        first, second = _model(0), _model(1)
        sp.async_save(t.child("ck"), {"model": first}, commit=sp.CommitPolicy(cleanup_grace_s=0)).wait(tier="remote")
        old = set(sp.read_manifest(remote.child("ck")).files)
        sp.async_save(t.child("ck"), {"model": second}, commit=sp.CommitPolicy(cleanup_grace_s=0)).wait(tier="remote")
        new = set(sp.read_manifest(remote.child("ck")).files)
        assert old and new and not old & new
        for tier in (LocalStorage(str(tmp_path / "host" / "ck")), remote.child("ck")):
            data = {n for n in tier.list("data/")}
            assert data == new, (tier.url, sorted(data))
        loaded = _model(2)
        sp.load(remote.child("ck"), {"model": loaded})
        assert _same(second, loaded)
    finally:
        t.close()
