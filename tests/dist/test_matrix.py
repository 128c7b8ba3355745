"""Save under each layout and load under every other, as real gloo processes.

Each launch is one process group that runs several cases, because starting
processes is the expensive part on a small machine.
"""

from __future__ import annotations

import pytest

from shardpoint.testing import launch

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
    for r in results:
        assert sorted(r) == sorted(f"{s}->{l}{world}" for s, l in cases)
    # Every rank saw the same losses (the layout reproduces the computation).
    first = results[0]
    for k, v in first.items():
        for other in results[1:]:
            assert other[k]["losses"] == pytest.approx(v["losses"], rel=1e-5)


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
