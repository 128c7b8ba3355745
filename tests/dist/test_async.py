"""Asynchronous saves on 4 gloo ranks: exact snapshots, no deadlock, bounded memory, failures."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


def test_async_save(tmp_path):
    results = launch(4, "tests.dist.async_cases:async_job", {"root": str(tmp_path)})
    for r in results:
        assert r["loop"] == "ok"
        assert r["reused"] >= 6, r["reused"]  # model and optimizer, on at least 3 of the 5 saves
        assert r["small_high_water"] <= r["small_capacity"] == 256 << 10
        assert r["state_bytes"] > 4 * r["small_capacity"]
        assert "rank(s) [1]" in r["failure"] and "No space left on device" in r["failure"], r["failure"]
    # Every rank's phases land on one timeline.
    from shardpoint.runtime.monitor import merge_traces

    doc = merge_traces(str(tmp_path / "trace"))
    ranks = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert ranks == {0, 1, 2, 3}
    phases = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"plan", "copy", "checksum", "write", "total"} <= phases and "commit" in phases
