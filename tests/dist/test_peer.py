"""Peer-memory checkpoints on 2 simulated hosts of 2 gloo ranks each: host loss, a restore into
fewer ranks and another layout, a corrupt copy, a kill during replication and the fallback to storage."""

from __future__ import annotations

import pytest

from shardpoint.testing import LaunchError, launch

pytestmark = pytest.mark.dist

JOB = "tests.dist.peer_cases"


@pytest.mark.slow
def test_lost_host_restores_from_peer_memory(tmp_path):
    root = str(tmp_path)
    trained = launch(4, f"{JOB}:train_job", {"root": root})
    for r in trained:
        # At most two steps per copy after the last complete one; steps 5 and 10 are stored.
        assert r["memory_steps"] == [12], r
        assert r["stored"] == [5, 10], r
    # First h1's own copy of rank 2's data is corrupt in one chunk: the checksum catches it and h0's replica
    # serves that chunk alone (per-chunk fallback: no second load, no other chunk moves).
    # Then h1 is lost (memory folder gone) and the stored checkpoints away: step 12 from h0's memory,
    # 0 stored bytes read.
    got = launch(4, f"{JOB}:restore_job", {"root": root, "scenarios": [
        [[], "fsdp2", "h1"], [["h1", "root-away"], "fsdp2", None]]})
    bad = got[0][0]["corrupt_chunk_bytes"]
    assert bad and bad > 0, got[0][0]
    for rank, (res, _) in enumerate(got):
        assert res["step"] == 12 and res["diff"] == [] and res["storage_read"] == 0, res
        assert res["attempts"] == 1 and res["source"] == "peer", res
        # Rank 2 reads its own shard: from h1's memory, except the corrupt chunk, read again from h0's copy.
        want = {0: {"h0"}, 1: {"h0"}, 2: {"h0", "h1"}, 3: {"h1"}}[rank]
        assert set(res["bytes_from"]) == want and res["rank_source"] == ("peer" if rank == 2 else "memory"), res
    assert got[2][0]["bytes_from"]["h0"] == bad, (got[2][0], bad)
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


@pytest.mark.slow  # in `make test-slow`, which CI runs
@pytest.mark.parametrize("kill_round", [0, 1])
def test_kill_during_replication(tmp_path, kill_round):
    root = str(tmp_path)
    # h1's ranks are SIGKILLed while step 6 replicates (round 0: before any copy reaches h0; round 1: after the
    # first pieces landed there) and its folder is lost: step 6 is torn, step 5 is the newest complete one.
    with pytest.raises(LaunchError):
        launch(4, f"{JOB}:train_job", {"root": root, "steps": 6, "kill_at": 6, "kill_round": kill_round,
                                       "budget": 64 << 10}, timeout=120)
    # h0's folder of step 6 holds the save's manifest and its own shards, but not all of h1's bytes.
    import os

    import shardpoint as sp

    torn = tmp_path / "mem" / "h0" / "step_00000006"
    man = sp.read_manifest(str(torn), chunks=False)
    short = [f for f, n in man.files.items() if not (torn / f).exists() or os.path.getsize(torn / f) < n]
    assert short and all(man.ranks[r].data not in short for r in (0, 1)), short
    got = launch(2, f"{JOB}:restore_job", {"root": root, "scenarios": [[["h1", "root-away"], "fsdp2", None]]})
    for res, in got:
        assert res["step"] == 5 and res["diff"] == [] and res["source"] == "memory" and res["storage_read"] == 0, res
        assert res["memory_folders"] == ["step_00000005"], res  # the torn step 6 of the lost run is dropped


@pytest.mark.slow  # in `make test-slow`, which CI runs
def test_three_hosts_second_loss_falls_back_to_storage(tmp_path):
    root = str(tmp_path)
    # Three hosts of two ranks, replicas=1 (h0 -> h1 -> h2 -> h0): steps 1..6 in memory, step 5 stored.
    trained = launch(6, f"{JOB}:train_job", {"root": root, "steps": 6})
    for r in trained:
        assert r["memory_steps"] == [6] and r["stored"] == [5], r
    # h1 lost: its shards come from h2's replica, bit-exact, nothing read from storage.
    # Then h2 lost too: h1's shards have no copy left, so step 5 comes from storage.
    got = launch(6, f"{JOB}:restore_job", {"root": root, "scenarios": [
        [["h1"], "fsdp2", None], [["h2"], "fsdp2", None]]})
    for rank, (one, two) in enumerate(got):
        assert one["step"] == 6 and one["diff"] == [] and one["storage_read"] == 0 and one["source"] == "peer", one
        assert one["bytes_from"] and set(one["bytes_from"]) <= {"h0", "h2"}, one
        assert two["step"] == 5 and two["diff"] == [] and two["source"] == "storage" and two["storage_read"] > 0, two
