"""The fsspec bridge, on fsspec's local and memory filesystems.

fsspec's memory filesystem is process-global: every test uses a unique root
and removes it afterwards.
"""

from __future__ import annotations

import os
import uuid

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

import shardpoint as sp
from shardpoint.errors import StorageError
from shardpoint.storage import FsspecStorage, MissingDependencyError, storage_for

from .test_conformance import StorageConformance, write_file


@pytest.fixture
def memory_root():
    fs = MemoryFileSystem()
    root = f"/shardpoint-test-{uuid.uuid4().hex}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)
    assert not any(p.startswith(root) for p in list(MemoryFileSystem.store)), "memory filesystem not cleaned"


class TestFsspecLocal(StorageConformance):
    @pytest.fixture
    def make_storage(self, tmp_path):
        counter = iter(range(1_000_000))
        fs = LocalFileSystem()
        return lambda: FsspecStorage(fs, str(tmp_path / f"loc{next(counter)}" / "ckpt"), read_part_size=1000)

    def test_files_on_disk_and_fsync(self, storage, monkeypatch):
        synced = []
        real = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
        write_file(storage, "data/a.bin", b"hello")
        storage.put_atomic("manifest.json", b"{}")
        with open(os.path.join(storage.root, "data", "a.bin"), "rb") as f:
            assert f.read() == b"hello"
        assert sorted(os.listdir(storage.root)) == ["data", "manifest.json"]
        assert len(synced) == 4  # data file + its folder, manifest temp + the folder

    def test_pickles(self, storage):
        import pickle

        storage.put_atomic("m", b"1")
        assert pickle.loads(pickle.dumps(storage)).get("m") == b"1"

    def test_parallel_ranged_reads(self, storage):
        payload = os.urandom(10_000)
        write_file(storage, "r.bin", payload)
        out = np.empty(8_765, dtype=np.uint8)
        storage.readinto("r.bin", 1_000, memoryview(out))  # 9 ranges of 1000 bytes
        assert out.tobytes() == payload[1_000:9_765]


class TestFsspecMemory(StorageConformance):
    @pytest.fixture
    def make_storage(self, memory_root):
        fs, root = memory_root
        counter = iter(range(1_000_000))
        return lambda: FsspecStorage(fs, f"{root}/loc{next(counter)}/ckpt", read_part_size=1000)

    def test_no_fsync_and_manifest_is_one_write(self, storage, monkeypatch):
        calls = []
        monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))
        fs = storage.fs
        piped = []
        real_pipe = fs.pipe_file
        monkeypatch.setattr(fs, "pipe_file", lambda path, data, **kw: (piped.append(path), real_pipe(path, data, **kw)))
        write_file(storage, "data/a.bin", b"x" * 5000)
        storage.put_atomic("manifest.json", b"{}")
        assert calls == []
        assert piped == [f"{storage.root}/manifest.json"]
        assert storage.read("data/a.bin", 100, 4500) == b"x" * 4500

    def test_url(self, storage):
        assert storage.url.startswith("memory://") and storage.url.endswith("/ckpt")


def test_storage_for_fsspec_schemes(memory_root, tmp_path):
    # Any scheme fsspec knows goes through the bridge (memory:// stays an error: it is global state).
    st = storage_for(f"local://{tmp_path}/x")
    assert isinstance(st, FsspecStorage) and isinstance(st.fs, LocalFileSystem)
    with pytest.raises(StorageError, match="memory:// has no shared state"):
        storage_for("memory://x")
    # A known protocol whose package is missing gives an install hint.
    missing = []
    for scheme in ("gcs", "abfs", "oci", "hdfs"):
        try:
            fsspec.get_filesystem_class(scheme)
        except ImportError:
            missing.append(scheme)
    if missing:
        with pytest.raises(MissingDependencyError, match=f"the {missing[0]}:// backend needs .*install"):
            storage_for(f"{missing[0]}://bucket/x")
    with pytest.raises(StorageError, match="no storage backend for scheme 'gopher'"):
        storage_for("gopher://x/y")


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_save_load_through_the_bridge(kind, memory_root, tmp_path):
    if kind == "local":
        st = FsspecStorage(LocalFileSystem(), str(tmp_path / "run"))
    else:
        fs, root = memory_root
        st = FsspecStorage(fs, f"{root}/run")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    sp.save(st.child("step_1"), {"model": model, "optimizer": opt, "extra": {"step": 1}})
    m2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    o2 = torch.optim.AdamW(m2.parameters())
    state = {"model": m2, "optimizer": o2, "extra": {}}
    sp.load(st.child("step_1"), state)
    assert state["extra"] == {"step": 1}
    for a, b in zip(model.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(v, o2.state_dict()["state"][0][k])
    assert "step_1/manifest.json" in st.list()
