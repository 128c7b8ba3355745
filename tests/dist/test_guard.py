"""The snapshot guard under FSDP2 on 2 gloo ranks: in-place changes after the call never commit a torn state."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


def test_guard_fsdp2(tmp_path):
    results = launch(2, "tests.dist.guard_cases:guard_job", {"root": str(tmp_path)})
    for r in results:
        for name in ("ema", "moments", "clamp_data"):
            lazy = r[f"{name}/lazy"]
            assert lazy[0] == "torn" and lazy[1] == [], lazy  # failed, and the previous checkpoint is intact
            assert "changed in place" in lazy[2] and "handle.fence()" in lazy[2], lazy[2]
            assert list(r[f"{name}/eager"]) == ["committed", []], r[f"{name}/eager"]
            assert r[f"{name}/lazy/steps"] == [] and r[f"{name}/eager/steps"] == []
