"""Rank functions for the multi-process S3 tests (run by shardpoint.testing.launch).

Each rank builds its own :class:`S3Storage` (clients do not cross processes)
against the moto server that the test process runs on loopback.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

import shardpoint as sp
from shardpoint.storage import S3Options, S3Storage
from shardpoint.testing import GPTConfig, build, full_state, train_step

CFG = GPTConfig(vocab=96, dim=32, heads=4, layers=2, seq=16)
STEPS = 2


def _storage(url: str, endpoint: str) -> S3Storage:
    return S3Storage(url, S3Options(endpoint_url=endpoint, access_key_id="testing", secret_access_key="testing",
                                    region="us-east-1", part_size=5 << 20, read_part_size=64 << 10,
                                    max_concurrency=4, backoff_base=0.01))


def _same(ref: dict, got: dict, what: str) -> None:
    assert sorted(ref) == sorted(got), sorted(set(ref) ^ set(got))
    bad = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not bad, f"{what}: not bit-exact: {bad[:5]}"


def save_then_replicated_load(rank: int, world: int, url: str, endpoint: str, root: str) -> dict:
    """FSDP2 on all ranks saves to S3; then DDP replicas load it with and without read-once sharing."""
    model, opt = build("fsdp2", CFG, seed=0)
    for s in range(STEPS):
        train_step(model, opt, s, CFG)
    st = _storage(url, endpoint)
    res = sp.save(st, {"model": model, "optimizer": opt, "extra": {"step": STEPS}})
    ref = full_state(model, opt)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(root, "ref.safetensors"))
    out = {"written": res.bytes_written}
    for share in (True, False):
        m, o = build("ddp", CFG, seed=7)
        reader = _storage(url, endpoint)  # fresh counters
        state = {"model": m, "optimizer": o, "extra": {}}
        report = sp.LoadResult()
        sp.load(reader, state, share_reads=share, report=report)
        assert state["extra"] == {"step": STEPS}
        _same(ref, full_state(m, o), f"fsdp2{world} -> ddp{world} share={share}")
        out[str(share)] = {"storage_bytes": reader.stats.bytes_read - report.index_bytes, "received": report.bytes_received}
    out["checkpoint_bytes"] = sp.read_manifest(st).total_bytes
    out["manifest_bytes"] = len(st.get("manifest.json"))
    return out


def reshard_load(rank: int, world: int, url: str, endpoint: str, root: str) -> dict:
    """Load the FSDP2 checkpoint into FSDP2 on a different number of ranks; then train on."""
    model, opt = build("fsdp2", CFG, seed=1234)
    state = {"model": model, "optimizer": opt, "extra": {}}
    sp.load(_storage(url, endpoint), state)
    assert state["extra"] == {"step": STEPS}
    _same(load_file(os.path.join(root, "ref.safetensors")), full_state(model, opt), f"fsdp2 -> fsdp2{world}")
    return {"loss": train_step(model, opt, STEPS, CFG)}
