"""The optional storage abilities declared on Storage: defaults, and which backends override them."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.storage import LocalStorage, MemoryStorage, Storage
from shardpoint.storage.tiers import TieredStorage


def test_defaults_are_safe_to_call_and_read_piece_by_piece():
    st = MemoryStorage()
    st.put_atomic("data/a.bin", bytes(range(16)))
    a, b = bytearray(4), bytearray(3)
    st.readinto_many("data/a.bin", [(2, memoryview(a)), (10, memoryview(b))])
    assert bytes(a) == bytes([2, 3, 4, 5]) and bytes(b) == bytes([10, 11, 12])
    assert st.map_range("data/a.bin", 0, 8) is None
    assert st.populate("data/a.bin", 0, 8) is False
    assert st.alternatives() == []
    st.sync_deletes()
    st.remove_empty_folders()
    assert st.list("") == ["data/a.bin"]
    assert (st.vectored_reads, st.tiered, st.read_threads, st.coalesce_bytes) == (False, False, 0, None)
    with pytest.raises(NotImplementedError, match="is not tiered storage"):
        st.wait("remote")


def test_backends_declare_what_they_have(tmp_path):
    local = LocalStorage(str(tmp_path / "l"))
    assert local.vectored_reads and local.page_cached and not local.tiered
    tiers = TieredStorage([str(tmp_path / "a"), MemoryStorage()], names=("fast", "slow"))
    try:
        assert tiers.tiered and [t.url for t in tiers.alternatives()] == [tiers.tiers[1].url]
        # Reads fall back tier by tier per call, so the single-tier fast paths stay off.
        assert not tiers.vectored_reads and tiers.map_range("data/x", 0, 1) is None
    finally:
        tiers.close()
    assert Storage.readinto_many is MemoryStorage.readinto_many  # the default, not an override


def test_waiting_for_a_tier_of_plain_storage_is_refused(tmp_path):
    h = sp.async_save(str(tmp_path / "c"), {"model": torch.nn.Linear(4, 4)})
    with pytest.raises(ValueError, match="is not tiered storage"):
        h.wait(tier="remote")
