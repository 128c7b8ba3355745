"""Incremental saves on two gloo ranks: each rank reuses from its base's indexes; a resharded save writes in full."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint as sp
from shardpoint.testing import build, full_state, launch
from tests.dist.incremental_cases import CFG, _data_sizes, manifest_refs
from tests.unit.compaction_runs import referenced_bytes, stored_data_bytes

pytestmark = pytest.mark.dist


def _loads_as(path: str, want: dict) -> None:
    """The checkpoint at ``path`` loads into one process as ``want``, bit for bit, with no tensor more or less."""
    model, opt = build("single", CFG, seed=7)
    sp.load(path, {"model": model, "optimizer": opt})
    got = full_state(model, opt)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_each_rank_references_its_own_unchanged_chunks_and_a_reshard_writes_in_full(tmp_path):
    root = str(tmp_path)
    r0, r1 = launch(2, "tests.dist.incremental_cases:save_job", {"root": root})
    b, c = os.path.join(root, "b"), os.path.join(root, "c")
    # Rank 0 changed nothing: it wrote no data file; rank 1 wrote its changed shard only.
    sizes = _data_sizes(b)
    assert 0 not in sizes and sizes[1] == r1["changed"] > 0
    assert r0["referenced_b"] > 0 and r1["referenced_b"] > 0
    refs = manifest_refs(b)
    assert {e[0] for e in refs} == {0, 1} and {e[1] for e in refs} == {"../a"}
    # DDP after FSDP2: only whole tensors (scalars, unsharded ones) lie at the same place; every shard is written.
    m = sp.read_manifest(c)
    shared = [(k, ch) for k, t in m.tensors.items() for ch in t.chunks if ch.file.startswith("../")]
    assert all(ch.box.sizes == tuple(m.tensors[k].shape) for k, ch in shared), shared
    assert r0["referenced_c"] + r1["referenced_c"] == sum(ch.nbytes for _, ch in shared)
    assert sum(ch.nbytes for _, ch in shared) < 0.05 * m.total_bytes
    want = torch.load(os.path.join(root, "want_b.pt"))
    for path in (b, c):
        _loads_as(path, want)


def test_background_saves_reference_per_rank_and_a_lazy_incremental_manager_keeps_what_it_references(tmp_path):
    root = str(tmp_path)
    r0, r1 = launch(2, "tests.dist.incremental_cases:async_save_job", {"root": root})
    b, c = os.path.join(root, "b"), os.path.join(root, "c")
    # Eager, base a: rank 0 changed nothing and wrote no data file; rank 1 wrote its changed shard only.
    sizes = _data_sizes(b)
    assert 0 not in sizes and sizes[1] == r1["changed"] > 0
    assert r0["referenced_b"] > 0 and r1["referenced_b"] > 0
    assert {e[0] for e in manifest_refs(b)} == {0, 1}
    # Lazy, base b, nothing changed: no data file at all, every byte referenced (from a, or from b's changed shard).
    assert _data_sizes(c) == {}
    assert r0["referenced_c"] + r1["referenced_c"] == sp.read_manifest(c).total_bytes
    assert {e[1] for e in manifest_refs(c)} == {"../a", "../b"}
    want = torch.load(os.path.join(root, "want_b.pt"))
    for path in (b, c):
        _loads_as(path, want)
    # The manager: each save after the first references at least the frozen embeddings, on each rank.
    for r in (r0, r1):
        assert r["referenced_run"][0] == 0 and all(n >= r["frozen"] > 0 for n in r["referenced_run"][1:]), r
    run = os.path.join(root, "run")
    assert sorted(n for n in os.listdir(run) if n.startswith("step_")) == ["step_00000001", "step_00000003"]
    # Step 1's folder holds what step 3 references and nothing more (but the 64-byte alignment of each chunk).
    st = sp.LocalStorage(run)
    chunks = sum(len(t.chunks) for t in sp.read_manifest(os.path.join(run, "step_00000003"), chunks=True).tensors.values())
    assert 0 <= stored_data_bytes(st) - referenced_bytes(st, [3]) < 64 * chunks
    assert all(n.startswith("data/") and n.endswith(".bin") for n in st.child("step_00000001").list("")), st.child("step_00000001").list("")
    _loads_as(os.path.join(run, "step_00000003"), torch.load(os.path.join(root, "want_run.pt")))
