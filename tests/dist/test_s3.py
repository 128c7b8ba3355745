"""Multi-process save and load through S3 (moto on loopback, real HTTP from every rank)."""

from __future__ import annotations

import uuid

import pytest

from shardpoint.testing import launch

from ..storage.s3_helpers import make_bucket, moto_server

pytest.importorskip("moto")
pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_server() as endpoint:
        yield endpoint


@pytest.mark.slow
def test_fsdp2_save_reshard_and_read_once(s3_endpoint, tmp_path):
    bucket = make_bucket(s3_endpoint)
    args = {"url": f"s3://{bucket}/run/{uuid.uuid4().hex}/step_2", "endpoint": s3_endpoint, "root": str(tmp_path)}
    # FSDP2 on 4 ranks saves; DDP on 4 ranks loads it, reading each byte from S3 once with share_reads.
    r4 = launch(4, "tests.dist.s3_cases:save_then_replicated_load", args)
    ckpt, manifest = r4[0]["checkpoint_bytes"], r4[0]["manifest_bytes"]
    assert sum(r["written"] for r in r4) >= ckpt
    shared = sum(r["True"]["storage_bytes"] for r in r4)
    alone = sum(r["False"]["storage_bytes"] for r in r4)
    assert ckpt * 0.999 <= shared - manifest <= ckpt, (shared, ckpt)
    assert max(r["True"]["storage_bytes"] for r in r4) < 0.75 * ckpt  # the reading is spread
    assert sum(r["True"]["received"] for r in r4) > 0
    assert alone - manifest >= 3.9 * ckpt  # without sharing every replica reads it all
    # Resharding: the 4-rank FSDP2 checkpoint into FSDP2 on 2 ranks.
    r2 = launch(2, "tests.dist.s3_cases:reshard_load", args)
    assert r2[0]["loss"] == pytest.approx(r2[1]["loss"])
