"""A fine-tuning run under CheckpointManager(incremental=True), and the byte accounting of its run folder.

Shared by the local, memory and S3 tests of compaction. The state is a
frozen base with trainable adapters and optimizer state for the adapters
only; every tensor's byte count is a multiple of 64, so data files have no
alignment padding and the bytes on storage must equal the referenced bytes
exactly.
"""

from __future__ import annotations

import posixpath

import torch

import shardpoint as sp
from shardpoint.manager import step_folder
from shardpoint.storage import Storage

BLOCK = 1 << 12
METADATA = ("manifest.json", ".lock", "latest")


def lora_state() -> dict:
    """A frozen base (64 KiB), two adapters and their optimizer moments."""
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "base.w": torch.randn(256, 64, generator=g),
            "base.b": torch.randn(64, generator=g),
            "lora.a": torch.randn(8, 64, generator=g),
            "lora.b": torch.randn(64, 8, generator=g),
        },
        "optim": {"lora.a.exp_avg": torch.zeros(8, 64), "lora.b.exp_avg": torch.zeros(64, 8)},
    }


def train(st: dict) -> None:
    """One "step": the adapters and their moments change, the base does not."""
    for k in ("lora.a", "lora.b"):
        st["model"][k].add_(0.5)
        st["optim"][f"{k}.exp_avg"].add_(st["model"][k] * 0.1)


def clone(st: dict) -> dict:
    return {g: {k: v.clone() for k, v in d.items()} for g, d in st.items()}


def manager(run, keep_last: int = 2, hook=None) -> sp.CheckpointManager:
    return sp.CheckpointManager(run, interval=1, mode=None, incremental=True, prewarm=False, keep_last=keep_last,
                                fault_hook=hook, save_options={"block_size": BLOCK})


def run_steps(run, steps, keep_last: int = 2, hook=None, st: dict | None = None) -> dict[int, dict]:
    """Save ``steps`` with a fresh manager (training between saves); return the state saved at each step."""
    st = st if st is not None else lora_state()
    saved = {}
    mgr = manager(run, keep_last, hook)
    try:
        for step in steps:
            train(st)
            mgr.save(step, st)
            mgr.wait()
            saved[step] = clone(st)
    finally:
        mgr.close()
    return saved


def stored_data_bytes(run: Storage) -> int:
    """Bytes of every object under the run root except manifests, index files, locks and the hint."""
    return sum(run.size(n) for n in run.list("") if not n.endswith(".idx") and posixpath.basename(n) not in METADATA)


def referenced_bytes(run: Storage, steps) -> int:
    """Bytes of the distinct chunks the manifests of ``steps`` reference, wherever they lie (from the chunk records)."""
    chunks = set()
    for s in steps:
        folder = step_folder(s)
        m = sp.read_manifest(run.child(folder), chunks=True)
        for t in m.tensors.values():
            for c in t.chunks:
                chunks.add((posixpath.normpath(posixpath.join(folder, c.file)), c.offset, c.nbytes))
    return sum(n for _, _, n in chunks)


def committed(run: Storage) -> list[int]:
    return sorted(int(n[5:13]) for n in run.list("") if n.startswith("step_") and n.endswith("/manifest.json"))


def check_loads(run: Storage, saved: dict[int, dict]) -> None:
    """Every committed step loads, bit for bit what was saved at it (when known)."""
    for s in committed(run):
        out = sp.load(run.child(step_folder(s)), {}, strict=False)
        for g, d in saved.get(s, {}).items():
            for k, v in d.items():
                assert torch.equal(out[g][k], v), (s, g, k)


def check_exact(run: Storage, saved: dict[int, dict]) -> None:
    """The run holds exactly the bytes its kept steps reference, and every kept step loads bit for bit."""
    kept = committed(run)
    assert stored_data_bytes(run) == referenced_bytes(run, kept), (run.list(""), kept)
    listed = {f"{step_folder(s)}/{n}" for s in kept for n in sp.read_manifest(run.child(step_folder(s)), chunks=False).files}
    assert {n for n in run.list("") if n.endswith(".idx")} == {n for n in listed if n.endswith(".idx")}
    check_loads(run, saved)
