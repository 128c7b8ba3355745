"""Incremental saves on tiered storage and fsspec filesystems: where a base can be referenced, and where not."""

from __future__ import annotations

import os
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import shardpoint as sp
from shardpoint.errors import BaseLocationError
from shardpoint.storage import FsspecStorage, LocalStorage, MemoryStorage
from shardpoint.storage.tiers import TieredStorage
from tests.unit.compaction_runs import check_exact, run_steps

BLOCK = 1 << 12


def _state():
    g = torch.Generator().manual_seed(3)
    return {"model": {"frozen": torch.randn(256, 64, generator=g), "adapter": torch.randn(8, 8, generator=g)}}


def _same(out, st) -> bool:
    return all(torch.equal(out["model"][k], v) for k, v in st["model"].items())


def _two_saves(run):
    st = _state()
    sp.save(run.child("s1"), st, block_size=BLOCK)
    st["model"]["adapter"].add_(1)
    r = sp.save(run.child("s2"), st, block_size=BLOCK, base=run.child("s1"))
    assert r.bytes_referenced == 256 * 64 * 4
    return st


def test_tiered_references_resolve_in_every_tier(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    run = TieredStorage([fast, slow], names=("fast", "slow"))
    try:
        st = _two_saves(run)
        run.wait("slow")
        assert sp.references_outside(run.child("s2")) == {"../s1": {sp.read_manifest(run.child("s2"), chunks=False).refs[0].data: 256 * 64 * 4 + 256}}
        assert _same(sp.load(run.child("s2"), {}, strict=False), st)
        assert _same(sp.load(os.path.join(slow, "s2"), {}, strict=False), st)  # the slow tier alone
        fast_base = LocalStorage(os.path.join(fast, "s1"))
        fast_base.delete_many(fast_base.list(""))
        assert _same(sp.load(run.child("s2"), {}, strict=False), st)  # the base's bytes come from the slow tier
    finally:
        run.close()


def test_tiered_copy_brings_the_referenced_data_down_with_it(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    st = _state()
    sp.save(os.path.join(fast, "s1"), st, block_size=BLOCK)  # the base on the fast tier only
    run = TieredStorage([fast, slow], names=("fast", "slow"))
    try:
        st["model"]["adapter"].add_(1)
        sp.save(run.child("s2"), st, block_size=BLOCK, base=run.child("s1"))
        run.wait("slow")
    finally:
        run.close()
    assert not os.path.exists(os.path.join(slow, "s1", "manifest.json"))  # only the referenced data file went down
    assert len(os.listdir(os.path.join(slow, "s1", "data"))) == 1
    assert _same(sp.load(os.path.join(slow, "s2"), {}, strict=False), st)


def test_tiered_and_plain_bases_are_refused_with_the_fix(tmp_path):
    run = TieredStorage([str(tmp_path / "fast"), str(tmp_path / "slow")])
    other = TieredStorage([str(tmp_path / "fast2"), str(tmp_path / "slow")])
    try:
        st = _state()
        sp.save(run.child("s1"), st, block_size=BLOCK)
        sp.save(str(tmp_path / "plain"), st, block_size=BLOCK)
        with pytest.raises(BaseLocationError, match="only one of the two is tiered.*same TieredStorage"):
            sp.save(run.child("s2"), st, block_size=BLOCK, base=str(tmp_path / "plain"))
        with pytest.raises(BaseLocationError, match="only one of the two is tiered"):
            sp.save(str(tmp_path / "plain2"), st, block_size=BLOCK, base=run.child("s1"))
        with pytest.raises(BaseLocationError, match="tiers with other roots"):
            sp.save(other.child("s2"), st, block_size=BLOCK, base=run.child("s1"))
        assert not os.path.exists(tmp_path / "fast2" / "s2" / "manifest.json")
    finally:
        run.close()
        other.close()


@pytest.mark.parametrize("fs", ["memory", "local"])
def test_fsspec_bases_on_the_same_filesystem(tmp_path, fs):
    if fs == "memory":
        run = FsspecStorage(fsspec.filesystem("memory"), f"/incr-{uuid.uuid4().hex}")
    else:
        run = FsspecStorage(LocalFileSystem(), str(tmp_path / "run"))
    st = _two_saves(run)
    m = sp.read_manifest(run.child("s2"), chunks=False)
    assert [r.base for r in m.refs] == ["../s1"]
    assert _same(sp.load(run.child("s2"), {}, strict=False), st)


def test_fsspec_and_another_storage_are_refused_with_the_fix(tmp_path):
    st = _state()
    sp.save(str(tmp_path / "s1"), st, block_size=BLOCK)
    run = FsspecStorage(fsspec.filesystem("memory"), f"/incr-{uuid.uuid4().hex}")
    with pytest.raises(BaseLocationError, match="another storage.*same run folder"):
        sp.save(run.child("s2"), st, block_size=BLOCK, base=str(tmp_path / "s1"))


class Placeless(MemoryStorage):
    """A storage that cannot name other places of its tree (the base class's default)."""

    def place(self):
        return None

    def child(self, sub):
        return Placeless(self._objects, f"{self._prefix}{sub.strip('/')}/", self._times, self._lock)


def test_a_storage_without_places_is_refused_with_the_fix():
    run = Placeless()
    st = _state()
    sp.save(run.child("s1"), st, block_size=BLOCK)
    with pytest.raises(BaseLocationError, match="Placeless .* cannot name another location.*save without base="):
        sp.save(run.child("s2"), st, block_size=BLOCK, base=run.child("s1"))


def test_manager_compaction_on_an_fsspec_filesystem():
    run = FsspecStorage(fsspec.filesystem("memory"), f"/incr-{uuid.uuid4().hex}")
    saved = run_steps(run, range(1, 6), keep_last=2)
    check_exact(run, saved)
