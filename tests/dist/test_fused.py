"""Fused GQA QKV at TP 4 loads into TP 2 (fused), unfused TP 2 and one process; padded vocab TP 2 -> 1."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


@pytest.mark.slow
def test_fused_and_padded_layouts(tmp_path):
    root = str(tmp_path)
    launch(4, "tests.dist.fused_cases:save_job", {"root": root, "kind": "fused"})
    launch(2, "tests.dist.fused_cases:save_job", {"root": root, "kind": "padded"})
    r2 = launch(2, "tests.dist.fused_cases:load_job", {"root": root, "cases": [["fused4", "fused"], ["fused4", "plain"], ["padded2", "padded"]]})
    r1 = launch(1, "tests.dist.fused_cases:load_job", {"root": root, "cases": [["fused4", "plain"], ["fused4", "fused"], ["padded2", "plain"]]})
    assert set(r2[0]) == {"fused4->fused2", "fused4->plain2", "padded2->padded2"}
    assert set(r1[0]) == {"fused4->plain1", "fused4->fused1", "padded2->plain1"}
