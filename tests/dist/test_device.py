"""Asynchronous saves of FSDP2 state on 2 gloo ranks through the simulated asynchronous device: bit-exact."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


def test_fsdp2_saves_through_a_slow_device_are_exact(tmp_path):
    results = launch(2, "tests.dist.device_cases:device_job", {"root": str(tmp_path)})
    for r in results:
        assert all(d == [] for d in r["diffs"].values()), r["diffs"]
        assert len(r["diffs"]) == 4 and r["copies"] > 20
        assert r["pinned"] == [8 << 20] * 4 and r["pinned_after_close"] == 0
