"""Compaction on S3 (moto on loopback): moving referenced chunks is a new object, manifests are replaced by one PUT."""

from __future__ import annotations

import uuid

import pytest

from shardpoint.storage import S3Storage
from tests.unit.compaction_runs import check_exact, committed, lora_state, run_steps, stored_data_bytes

from .s3_helpers import s3_options

pytest.importorskip("moto")


def test_retention_on_s3_leaves_exactly_the_referenced_bytes(s3_endpoint, bucket):
    run = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(s3_endpoint))
    saved = run_steps(run, range(1, 7), keep_last=2)
    assert committed(run) == [5, 6]
    check_exact(run, saved)
    (name,) = run.child("step_00000001").list("")
    base = sum(v.numel() * 4 for k, v in lora_state()["model"].items() if k.startswith("base."))
    assert run.child("step_00000001").size(name) == base
    assert stored_data_bytes(run) == base + 2 * sum(v.numel() * 4 for g in saved[6].values() for k, v in g.items() if "lora" in k)
