"""Peer-memory checkpoints on 2 simulated hosts of 2 gloo ranks each: host loss, a restore into
fewer ranks and another layout, a corrupt copy, a kill during replication and the fallback to storage."""

from __future__ import annotations

import pytest

from shardpoint.testing import LaunchError, launch

pytestmark = pytest.mark.dist

JOB = "tests.dist.peer_cases"


def test_lost_host_restores_from_peer_memory(tmp_path):
    root = str(tmp_path)
    trained = launch(4, f"{JOB}:train_job", {"root": root})
    for r in trained:
        # At most two steps per copy after the last complete one; steps 5 and 10 are stored.
        assert r["memory_steps"] == [12], r
        assert r["stored"] == [5, 10], r
    # First h1's own copy of rank 2's data is corrupt: the checksum catches it and h0's replica serves it.
    # Then h1 is lost (memory folder gone) and the stored checkpoints away: step 12 from h0's memory,
    # 0 stored bytes read.
    got = launch(4, f"{JOB}:restore_job", {"root": root, "scenarios": [
        [[], "fsdp2", "h1"], [["h1", "root-away"], "fsdp2", None]]})
    for res, _ in got:
        assert res["step"] == 12 and res["diff"] == [] and res["storage_read"] == 0, res
        assert res["attempts"] == 2 and res["source"] == "peer", res  # the first attempt met the bad checksum
    # The file that failed was read again from h0's replica (by whichever rank the load had read it).
    assert any(res["rank_source"] == "peer" for res, _ in got), got
    for rank, (_, res) in enumerate(got):
        assert res["step"] == 12 and res["diff"] == [], res
        assert res["storage_read"] == 0, res
        assert res["source"] == "peer" and res["rank_source"] == ("memory" if rank < 2 else "peer"), res
        assert set(res["bytes_from"]) == {"h0"} and res["bytes_from"]["h0"] > 0, res
    # Into 2 ranks (one host) and tensor parallel; then both hosts lost, the root back: step 10 from storage.
    got = launch(2, f"{JOB}:restore_job", {"root": root, "scenarios": [
        [[], "fsdp2", None], [[], "tp", None], [["h0", "root-back"], "fsdp2", None]]})
    for res_fsdp, res_tp, res_storage in got:
        for res in (res_fsdp, res_tp):
            assert res["step"] == 12 and res["diff"] == [] and res["source"] == "memory", res
            assert res["storage_read"] == 0
        assert res_storage["step"] == 10 and res_storage["diff"] == [] and res_storage["source"] == "storage", res_storage
        assert res_storage["storage_read"] > 0


def test_kill_during_replication(tmp_path):
    root = str(tmp_path)
    # h1's ranks are SIGKILLed as replication of step 6 starts (before their copies reach h0) and its folder
    # is lost: step 6 is torn, step 5 is the newest complete one.
    with pytest.raises(LaunchError):
        launch(4, f"{JOB}:train_job", {"root": root, "steps": 6, "kill_at": 6}, timeout=120)
    got = launch(2, f"{JOB}:restore_job", {"root": root, "scenarios": [[["h1", "root-away"], "fsdp2", None]]})
    for res, in got:
        assert res["step"] == 5 and res["diff"] == [] and res["source"] == "memory" and res["storage_read"] == 0, res
        assert res["memory_folders"] == ["step_00000005"], res  # the torn step 6 of the lost run is dropped
