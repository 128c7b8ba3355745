"""CheckpointManager on 4 gloo ranks: FSDP2 saves restored into TP, collective policies,
disk full, racing saves and hang reports (rank and phase)."""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

pytestmark = pytest.mark.dist


@pytest.mark.slow
def test_manager_four_ranks(tmp_path):
    results = launch(4, "tests.dist.manager_cases:manager_job", {"root": str(tmp_path)})
    for rank, r in enumerate(results):
        # Retention kept the last two; a restore reshards into TP and FSDP2 bit-exactly.
        assert r["steps"] == [6, 8], r["steps"]
        assert r["restored_tp"] == r["restored_fsdp2"] == 8
        assert r["diff_tp"] == [] and r["diff_fsdp2"] == []
        # Rank 0's clock and rank 3's request decide for everyone; the stop is agreed too.
        assert r["policy_saves"] == [4, 5, 8, 11] and r["stop_at"] == 5
        # Disk full on rank 1 fails the save everywhere and keeps the older checkpoints.
        assert "rank(s) [1]" in r["enospc"] and "No space left on device" in r["enospc"], r["enospc"]
        assert r["after_enospc"] == [1, 2] and r["after_recovery"] == [2, 4] and r["diff_enospc"] == []
        # The second save to a locked step folder is rejected; the first one's data is intact.
        assert r["race"].startswith("conflict:") and "raced" in r["race"] and r["diff_race"] == []
        # A stalled write names the rank and the phase on every rank, and completes afterwards.
        stall = r["stall"]
        assert stall is not None and stall["rank"] == rank and stall["step"] == 1
        assert stall["phase"] == ("write" if rank == 1 else "commit"), stall
        assert f"rank {rank}:" in stall["msg"] and "step_00000001" in stall["msg"]
        assert r["stall_steps"] == [1]
        # A collective that never completes times out with the rank and phase, not forever.
        late = r["late"]
        if rank != 1:
            assert late["rank"] == rank and late["phase"] == "decide" and late["step"] == 2, late
            assert late["seconds"] < 3.5 and f"rank {rank}: checkpoint phase 'decide'" in late["msg"]
            assert "unusable" in r["late_after"]
        else:
            text = late.get("msg") or late.get("other")
            assert "rank 1: checkpoint phase 'decide'" in text, late
