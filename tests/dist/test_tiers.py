"""Multi-level checkpointing under a crash: resume from host memory, finish the remote copy."""

from __future__ import annotations

import os
import shutil

import pytest

from shardpoint.testing import LaunchError, launch

pytestmark = pytest.mark.dist


def test_kill_before_remote_copy_then_restart(tmp_path):
    root = str(tmp_path)
    # 1. Save to the fast tier; the processes die while the slow remote copy runs.
    with pytest.raises(LaunchError, match="no result"):
        launch(2, "tests.dist.tier_cases:save_then_die", {"root": root}, timeout=120)
    assert os.path.exists(os.path.join(root, "host", "step_3", "manifest.json"))
    assert not os.path.exists(os.path.join(root, "remote", "step_3", "manifest.json"))
    # 2. Restart: resume from the host tier, and the remote copy completes.
    r = launch(2, "tests.dist.tier_cases:restart", {"root": root, "layout": "fsdp2"})
    assert r[0]["queued"] == ["step_3"] and r[0]["step"] == 3 and r[0]["remote"] is True
    # 3. Lose the fast tier: a restart (another layout) loads from remote.
    shutil.rmtree(os.path.join(root, "host"))
    r = launch(2, "tests.dist.tier_cases:restart", {"root": root, "layout": "tp"})
    assert r[0]["queued"] == [] and r[1]["step"] == 3
