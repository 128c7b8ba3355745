"""Save under each layout and load under every other, as real gloo processes.

Each launch is one process group that runs several cases, because starting
processes is the expensive part on a small machine.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch
from tests.dist.checks import check_ranks_agree

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("matrix"))
    launch(1, "tests.dist.cases:save_job", {"root": root, "layouts": ["single"]})
    launch(2, "tests.dist.cases:save_job", {"root": root, "layouts": ["fsdp2", "tp"]})
    launch(4, "tests.dist.cases:save_job", {"root": root, "layouts": ["fsdp2", "ddp", "2d", "hsdp"]})
    return root


@pytest.mark.parametrize(
    "world,cases",
    [
        (1, [["ddp4", "single"], ["hsdp4", "single"], ["fsdp24", "single"], ["2d4", "single"]]),
        (2, [["fsdp24", "fsdp2"], ["2d4", "tp"], ["single1", "tp"]]),
        (3, [["fsdp22", "fsdp2"], ["tp2", "ddp"]]),
        (4, [["fsdp24", "ddp"], ["tp2", "fsdp2"], ["single1", "fsdp2"], ["fsdp22", "2d"], ["ddp4", "hsdp"]]),
    ],
    ids=["to1", "to2", "to3", "to4"],
)
def test_reshard_matrix(saved, world, cases):
    results = launch(world, "tests.dist.cases:load_job", {"root": saved, "cases": cases})
    check_ranks_agree(results, cases, world)


def test_errors_reach_every_rank(tmp_path):
    results = launch(2, "tests.dist.cases:error_job", {"root": str(tmp_path)})
    for r in results:
        assert r["mismatch"].startswith("KeyMismatchError") and "extra" in r["mismatch"], r
        # The failing rank's key lists travel with the error to every rank.
        assert r["mismatch_lists"] == [["extra"], []], r["mismatch_lists"]
        assert r["corrupt"].startswith("CorruptCheckpointError") and "checksum mismatch" in r["corrupt"], r
        assert "model.layers.0.mlp.w1.weight" in r["corrupt"]
        assert r["save"].startswith("UnsupportedStateError") and "rank(s) [1]" in r["save"], r
        assert r["after"] in ("IncompleteCheckpointError", "CheckpointNotFoundError")


@pytest.mark.parametrize("src,layout,world", [("ddp4", "ddp", 4), ("fsdp24", "tp", 2)], ids=["ddp4", "fsdp2-to-tp2"])
def test_read_once(saved, src, layout, world):
    """Replicas and TP ranks share what they read: storage reads stay near 1x the checkpoint."""
    results = launch(world, "tests.dist.cases:read_once_job", {"root": saved, "src": src, "layout": layout})
    ckpt = results[0]["checkpoint_bytes"]
    manifest = results[0]["manifest_bytes"]
    # Metadata is not data: each rank reads the index files of the ranks whose chunks it needs.
    shared = sum(r["True"]["storage_bytes"] - r["True"]["index_bytes"] for r in results)
    alone = sum(r["False"]["storage_bytes"] - r["False"]["index_bytes"] for r in results)
    assert all(0 < r["True"]["index_bytes"] < 0.25 * ckpt for r in results)
    # Only rank 0 reads the manifest; data bytes are read once in total.
    assert shared - manifest <= 1.0 * ckpt, (shared, ckpt)
    assert shared - manifest >= ckpt * 0.999, (shared, ckpt)
    # Spread: no rank reads everything (when there is enough to spread).
    assert max(r["True"]["storage_bytes"] for r in results) < 0.75 * ckpt
    if layout == "ddp":
        assert alone - manifest >= 3.9 * ckpt  # every replica reads it all
    assert sum(r["True"]["received"] for r in results) > 0
    # "auto" on one host and a local path: re-reads come from the page cache, so nothing is sent.
    assert [r["auto"]["storage_bytes"] for r in results] == [r["False"]["storage_bytes"] for r in results]
    assert sum(r["auto"]["received"] for r in results) == 0
    # "auto" across hosts shares exactly as share_reads=True does.
    assert [r["auto-hosts"]["storage_bytes"] for r in results] == [r["True"]["storage_bytes"] for r in results]


def test_reduced_values(tmp_path):
    results = launch(4, "tests.dist.cases:reduced_job", {"root": str(tmp_path)})
    for r in results:
        assert r == {"ema": [1.5, 1.5, 1.5], "count": 10}
