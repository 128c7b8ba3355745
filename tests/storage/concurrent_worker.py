"""A save worker for the concurrent-writer tests: one process, many rounds, driven over stdin.

Each input line is a JSON command; each output line a JSON answer.

- ``{"op": "save", "kind": ..., "path": ..., "which": "small"|"large", "start_at": t}``: wait until
  wall-clock ``t``, save that state, answer ``{"ok", "error", "message", "save_id", "t_end"}``.
- ``{"op": "claim", "targets": [[kind, path], ...]}``: claim every target as a save would, answer,
  and keep the claims (the test then kills this process to leave them behind).
"""

from __future__ import annotations

import json
import sys
import time

import torch

import shardpoint as sp
from shardpoint.engine.claim import CommitPolicy, SaveClaim

__all__ = ["make_state", "storage_of", "main"]


def make_state(which: str) -> dict:
    """The two states the workers race with: equal keys, different sizes and values."""
    g = torch.Generator().manual_seed(1 if which == "small" else 2)
    n = 256 if which == "small" else 3 << 20
    return {"w": torch.randn(n, generator=g), "b": torch.arange(n % 1000 + 7, dtype=torch.int64), "extra": {"which": which}}


def storage_of(kind: str, path: str, endpoint: str | None = None):
    """A storage of ``kind`` (local, fsspec, s3) at ``path``, built the same way in every process."""
    if kind == "local":
        return sp.LocalStorage(path)
    if kind == "fsspec":
        from fsspec.implementations.local import LocalFileSystem

        from shardpoint.storage import FsspecStorage

        return FsspecStorage(LocalFileSystem(), path)
    if kind == "s3":
        from shardpoint.storage import S3Storage
        from tests.storage.s3_helpers import s3_options

        return S3Storage(path, s3_options(endpoint))
    raise ValueError(kind)


def main() -> None:
    held = []
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "save":
            st = storage_of(cmd["kind"], cmd["path"], cmd.get("endpoint"))
            state = make_state(cmd["which"])
            time.sleep(max(0.0, cmd["start_at"] - time.time()))
            try:
                res = sp.save(st, state)
                out = {"ok": True, "save_id": res.save_id}
            except sp.CheckpointError as e:
                out = {"ok": False, "error": type(e).__name__, "message": str(e)}
            out["t_end"] = time.time()
        elif cmd["op"] == "claim":
            for kind, path in cmd["targets"]:
                st = storage_of(kind, path, cmd.get("endpoint"))
                held.append(SaveClaim.acquire(st, CommitPolicy(), st.url))
            out = {"ok": True}
        else:
            out = {"ok": False, "error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
