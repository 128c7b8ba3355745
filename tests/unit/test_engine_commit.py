"""The commit's I/O, shared by save() and the converters' CheckpointWriter (no processes)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardpoint as sp
from shardpoint.convert.common import CheckpointWriter
from shardpoint.engine.claim import CommitPolicy
from shardpoint.engine.commit import commit_manifest
from shardpoint.errors import StorageError
from shardpoint.format.manifest import FORMAT_VERSION, MANIFEST_NAME
from shardpoint.storage.memory import MemoryStorage


def _orphan(root: str) -> str:
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    path = os.path.join(root, "data", "0123abcd-r00000.bin")
    with open(path, "wb") as f:
        f.write(b"left by a crashed save")
    return path


@pytest.mark.parametrize("how", ["save", "writer"])
def test_save_and_converter_commit_the_current_format_and_clean_up_alike(tmp_path, how):
    root = str(tmp_path / "ck")
    orphan = _orphan(root)
    t = torch.arange(6.0).view(2, 3)
    if how == "save":
        sp.save(root, {"t": t}, commit=CommitPolicy(cleanup_grace_s=0))
    else:
        with CheckpointWriter(root, policy=CommitPolicy(cleanup_grace_s=0)) as w:
            w.add("t", t)
            w.commit()
    with open(os.path.join(root, MANIFEST_NAME), "rb") as f:
        assert json.loads(f.read())["format_version"] == FORMAT_VERSION == 3
    assert not os.path.exists(orphan)  # listed by no committed manifest and past its grace period
    m = sp.read_manifest(root)
    assert {f"data/{n}" for n in os.listdir(os.path.join(root, "data"))} == set(m.files)  # exactly the new files
    assert torch.equal(sp.read_tensor(root, "t"), t)


def test_a_young_orphan_is_kept_for_its_grace_period(tmp_path):
    root = str(tmp_path / "ck")
    orphan = _orphan(root)
    with CheckpointWriter(root) as w:  # default grace: 300 s
        w.add("t", torch.ones(3))
        w.commit()
    assert os.path.exists(orphan)


class _FailingPut(MemoryStorage):
    def put_atomic(self, name, data):
        raise OSError(28, "No space left on device")


def test_a_failed_manifest_write_is_a_storage_error_naming_the_manifest():
    st = _FailingPut()
    with pytest.raises(StorageError, match=r"ck: committing manifest.json failed: .*No space left on device"):
        commit_manifest(st, b"{}", {}, None, 0.0, "ck")
    assert not st.exists(MANIFEST_NAME)
