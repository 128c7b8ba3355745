"""Incremental saves on S3 (moto on loopback): references are relative keys, with no server-side copy."""

from __future__ import annotations

import uuid

import pytest
import torch

import shardpoint as sp
from shardpoint.errors import MissingBaseError
from shardpoint.storage import S3Storage

from tests.unit.incremental_runs import four_steps_keep_last_one

from .s3_helpers import FaultProxy, s3_options

pytest.importorskip("moto")

BLOCK = 1 << 16


def _frozen_and_adapter() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"frozen": torch.randn(1 << 20, generator=g), "adapter": torch.randn(64, 64, generator=g)}}


def _base_saved_then_adapter_changed(proxy, bucket: str):
    """A run on S3 through ``proxy`` with ``s1`` saved; the adapter then changed. (run, state, first request to count)."""
    run = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(proxy.endpoint))
    st = _frozen_and_adapter()
    sp.save(run.child("s1"), st, block_size=BLOCK)
    st["model"]["adapter"].add_(1)
    return run, st, len(proxy.log)


def _uploaded_only_the_adapter(proxy, first: int, result) -> None:
    """What went up since request ``first``: the adapter, indexes and manifest; nothing under the base."""
    puts = [req for req, _ in proxy.log[first:] if req.method in ("PUT", "POST")]
    uploaded = sum(req.length for req in puts)
    adapter = 64 * 64 * 4
    assert result.bytes_referenced == (1 << 20) * 4
    assert adapter <= uploaded < adapter + 64_000  # no 4 MiB body, no server-side copy
    assert not any("s1" in req.target for req in puts)


def test_incremental_save_on_s3_uploads_only_what_changed(s3_endpoint, bucket):
    with FaultProxy(s3_endpoint) as proxy:
        run, st, first = _base_saved_then_adapter_changed(proxy, bucket)
        r = sp.save(run.child("s2"), st, block_size=BLOCK, base=run.child("s1"))
        _uploaded_only_the_adapter(proxy, first, r)
        out = sp.load(run.child("s2"), {}, strict=False)
        assert torch.equal(out["model"]["frozen"], st["model"]["frozen"])
        assert torch.equal(out["model"]["adapter"], st["model"]["adapter"])
        sp.consolidate(run.child("s2"), run.child("copy"))
        base = run.child("s1")
        base.delete_many(base.list(""))
        with pytest.raises(MissingBaseError, match="s1"):
            sp.load(run.child("s2"), {}, strict=False)
        got = sp.load(run.child("copy"), {}, strict=False)
        assert torch.equal(got["model"]["frozen"], st["model"]["frozen"])


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_background_incremental_save_on_s3_uploads_only_what_changed(s3_endpoint, bucket, mode):
    with FaultProxy(s3_endpoint) as proxy:
        run, st, first = _base_saved_then_adapter_changed(proxy, bucket)
        saver = sp.AsyncSaver(prewarm=False)
        try:
            r = saver.save(run.child("s2"), st, mode=mode, block_size=BLOCK, base=run.child("s1")).wait()
        finally:
            saver.close()
        _uploaded_only_the_adapter(proxy, first, r)
        out = sp.load(run.child("s2"), {}, strict=False)
        assert torch.equal(out["model"]["frozen"], st["model"]["frozen"])
        assert torch.equal(out["model"]["adapter"], st["model"]["adapter"])


@pytest.mark.parametrize("mode", [None, "lazy"])
def test_incremental_manager_on_s3_keeps_referenced_data_only(s3_endpoint, bucket, mode):
    run = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(s3_endpoint))
    g = torch.Generator().manual_seed(1)
    st = {"model": {"frozen": torch.randn(1 << 16, generator=g), "adapter": torch.randn(16, 16, generator=g)}}
    mgr = sp.CheckpointManager(run, interval=1, keep_last=1, mode=mode, incremental=True, prewarm=False,
                               save_options={"block_size": BLOCK})
    four_steps_keep_last_one(run, st, mgr)
