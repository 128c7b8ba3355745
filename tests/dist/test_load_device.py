"""Shared loads onto the simulated asynchronous device on 2 gloo ranks: every device copy reads page-locked memory, bit-exact."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("window", [8 << 20, 1 << 20])  # 1 MiB: slots wait for earlier copies and sends
def test_spans_read_once_and_sent_land_on_the_device_from_the_ring(tmp_path, window):
    results = launch(2, "tests.dist.load_device_cases:shared_load_job", {"root": str(tmp_path), "window": window})
    for r in results:
        assert all(r["exact"]) and len(r["exact"]) == 21, r["exact"]
        # Before: every span read by another rank or by this one was copied from a pageable buffer.
        assert r["pageable"] == 0 and r["sim_pageable"] == 0, r
        assert r["shared_spans"] == 17 and r["pinned_after"] == 0
    assert sum(r["received"] for r in results) > 0


def test_spans_larger_than_the_ring_are_cut_alike_on_every_rank_and_stay_shared(tmp_path):
    # A 128 KiB exchange ring: every 300 KiB span, and each 100 KiB column-sharded one, is larger than a slot may take.
    results = launch(2, "tests.dist.load_device_cases:shared_load_job", {"root": str(tmp_path), "window": 256 << 10, "block": 16 << 10})
    for r in results:
        assert all(r["exact"]) and len(r["exact"]) == 21, r["exact"]
        # Before: a shared span larger than its ring was received into host memory and copied from there.
        assert r["pageable"] == 0 and r["sim_pageable"] == 0, r
        assert r["shared_spans"] > 17 and r["pinned_after"] == 0, r
    # Cut alike on both ranks, the pieces are still read once between them, the column blocks too (each rank
    # reading its own would read every replicated tensor twice); neighbouring pieces share a checksum block.
    assert sum(r["read"] for r in results) < results[0]["data"] * 1.2, results
    assert sum(r["received"] for r in results) > 6 * 300 * 1024


def test_a_span_failing_its_checksum_fails_every_rank_and_frees_the_rings(tmp_path):
    results = launch(2, "tests.dist.load_device_cases:shared_load_job", {"root": str(tmp_path), "window": 1 << 20, "corrupt": True})
    for r in results:
        assert "extra.big3" in r["error"], r  # the reader names it; the other rank points to the reader's error
        assert r["pinned_after"] == 0
