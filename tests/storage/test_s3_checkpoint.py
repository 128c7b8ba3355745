"""sp.save / sp.load through S3 (moto on loopback), with and without injected faults.

The state holds a TinyGPT with a trained AdamW, plus one 12 MiB tensor so the
data file is a multipart upload of three 5 MiB parts.
"""

from __future__ import annotations

import uuid

import pytest
import torch

import shardpoint as sp
from shardpoint.errors import CheckpointError, StorageError
from shardpoint.storage import S3Storage, S3StorageError
from shardpoint.testing import GPTConfig, build, full_state, train_step

from .s3_helpers import FaultProxy, s3_options

pytest.importorskip("moto")

CFG = GPTConfig(vocab=64, dim=32, heads=4, layers=2, seq=16)


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint) as p:
        yield p


def _trained(seed: int = 0, steps: int = 2):
    model, opt = build("single", CFG, seed=seed)
    for s in range(steps):
        train_step(model, opt, s, CFG)
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3 << 20, generator=g)  # 12 MiB
    return model, opt, big


def _state(model, opt, big, step):
    return {"model": model, "optimizer": opt, "big": big, "extra": {"step": step}}


def _check_loads(storage, model, opt, big, step):
    m2, o2 = build("single", CFG, seed=99)
    state = {"model": m2, "optimizer": o2, "big": torch.zeros_like(big), "extra": {}}
    sp.load(storage, state)
    want, got = full_state(model, opt), full_state(m2, o2)
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]
    assert torch.equal(state["big"], big) and state["extra"] == {"step": step}
    # Training goes on identically.
    assert train_step(m2, o2, 10, CFG) == train_step(model, opt, 10, CFG)


def test_save_load_bit_exact(s3_endpoint, bucket):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}/step_2", s3_options(s3_endpoint))
    model, opt, big = _trained()
    res = sp.save(st, _state(model, opt, big, 2))
    assert res.bytes_written > 12 << 20
    names = st.list()
    assert "manifest.json" in names and any(n.startswith("data/") for n in names)
    assert st.client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    st.stats.bytes_read = 0
    _check_loads(st, model, opt, big, 2)
    # Reads went through ranged GETs of the data file, about once.
    assert st.stats.bytes_read < 1.2 * res.bytes_written + 100_000


def test_save_load_by_url_from_aws_environment(s3_endpoint, bucket, monkeypatch):
    for k, v in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{bucket}/{uuid.uuid4().hex}/ckpt"
    model, opt, _ = _trained(steps=1)
    sp.save(url, {"model": model, "optimizer": opt})
    m2, o2 = build("single", CFG, seed=5)
    sp.load(url, {"model": m2, "optimizer": o2})
    want, got = full_state(model, opt), full_state(m2, o2)
    assert all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(f"s3://{bucket}/{uuid.uuid4().hex}", {"model": m2})


def test_uncommitted_save_is_invisible(s3_endpoint, bucket):
    """Data objects without a manifest are not a checkpoint (the manifest PUT is the commit)."""
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(s3_endpoint))
    st.put_atomic("data/orphan.bin", b"x" * 100)
    model, opt, _ = _trained(steps=1)
    with pytest.raises(sp.IncompleteCheckpointError, match="no committed manifest"):
        sp.load(st, {"model": model, "optimizer": opt})


def test_save_survives_throttling_and_5xx(proxy, bucket):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}/ckpt", s3_options(proxy.endpoint))
    model, opt, big = _trained()
    # One 503 and one 500 among the part uploads, one 500 on the manifest PUT.
    # Counted among part uploads (retries included), not among all requests: the claim's requests come first.
    plan = {1: ("status", 503, "SlowDown"), 3: ("status", 500, "InternalError")}
    parts = []

    def faults(req):
        if req.op == "UploadPart":
            parts.append(req)
            return plan.get(len(parts) - 1)
        if req.op == "PutObject" and "manifest.json" in req.target and not proxy.injected("status")[2:]:
            return ("status", 500, "InternalError")
        return None

    proxy.faults = faults
    sp.save(st, _state(model, opt, big, 2))
    injected = [r.op for r, _ in proxy.injected("status")]
    assert injected.count("PutObject") == 1 and "UploadPart" in injected, injected
    gets = []

    def get_faults(req):
        if req.op == "GetObject" and len(gets) < 2 and req.index % 2 == 0:
            gets.append(req)
            return ("status", 503, "SlowDown")
        return None

    proxy.faults = get_faults
    _check_loads(st, model, opt, big, 2)
    assert any(r.op == "GetObject" for r, _ in proxy.injected("status"))


def test_save_survives_reset_mid_part(proxy, bucket):
    st = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}/ckpt", s3_options(proxy.endpoint))
    model, opt, big = _trained()
    hit = []

    def faults(req):
        if req.op == "UploadPart" and not hit:
            hit.append(req)
            return ("reset_body", 0.4)
        return None

    proxy.faults = faults
    sp.save(st, _state(model, opt, big, 2))
    assert len(hit) == 1
    _check_loads(st, model, opt, big, 2)


def test_permanent_failure_keeps_previous_checkpoint(proxy, s3_endpoint, bucket):
    url = f"s3://{bucket}/{uuid.uuid4().hex}/ckpt"
    st = S3Storage(url, s3_options(proxy.endpoint, retries=1, max_attempts=2))
    model, opt, big = _trained(steps=1)
    sp.save(st, _state(model, opt, big, 1))
    old = {k: v.clone() for k, v in full_state(model, opt).items()}
    old_manifest = st.get("manifest.json")
    train_step(model, opt, 1, CFG)
    big2 = big + 1
    proxy.faults = lambda req: ("status", 500, "InternalError") if req.method in ("PUT", "POST") else None
    with pytest.raises(StorageError) as ei:
        sp.save(st, _state(model, opt, big2, 2))
    assert isinstance(ei.value, CheckpointError)
    assert isinstance(ei.value, S3StorageError) or isinstance(ei.value.__cause__, S3StorageError), repr(ei.value)
    assert "failed" in str(ei.value)
    # The previous checkpoint is untouched and loads bit-exactly (read directly, no proxy).
    direct = S3Storage(url, s3_options(s3_endpoint))
    assert direct.get("manifest.json") == old_manifest
    assert direct.client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    m2, o2 = build("single", CFG, seed=3)
    state = {"model": m2, "optimizer": o2, "big": torch.zeros_like(big), "extra": {}}
    sp.load(direct, state)
    got = full_state(m2, o2)
    assert all(torch.equal(old[k], got[k]) for k in old)
    assert torch.equal(state["big"], big) and state["extra"] == {"step": 1}
    # Once the store recovers, the next save succeeds and replaces it.
    proxy.faults = lambda req: None
    sp.save(st, _state(model, opt, big2, 2), commit=sp.CommitPolicy(cleanup_grace_s=0))
    _check_loads(direct, model, opt, big2, 2)
    # The failed save's orphans and the replaced checkpoint are gone (no grace period): one
    # data file and its index remain.
    assert sorted(n.rsplit(".", 1)[1] for n in direct.list("data/")) == ["bin", "idx"]
