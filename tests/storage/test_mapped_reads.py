"""Mapped reads: the local backend hands the load engine views of a data file's mapping.

Spans that must be narrowed or hashed in memory are viewed in a mapping of
the file instead of being read into a buffer first. These tests check the
backend's contract (exact bytes, counted, refused where a mapping would be
unsafe or could not hold the range) and that a load through mappings is
bit-exact and still reports damaged files with the usual typed errors.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

import shardpoint as sp
from shardpoint.storage import LocalStorage
from shardpoint.testing import flip_byte

DATA = bytes(range(256)) * 64  # 16 KiB


def _storage(tmp_path, **opts) -> LocalStorage:
    st = LocalStorage(str(tmp_path), **opts)
    with st.open_writer("data/x.bin") as w:
        w.write(DATA)
    with st.open_writer("data/empty.bin") as w:
        w.write(b"")
    st.put_atomic("manifest.json", b"{}")
    return st


def test_map_range_views_the_file_and_counts_bytes(tmp_path):
    st = _storage(tmp_path)
    before = st.stats.bytes_read
    mv = st.map_range("data/x.bin", 10, 1000)
    assert bytes(mv) == DATA[10:1010]
    assert st.stats.bytes_read - before == 1000
    mv2 = st.map_range("data/x.bin", 4096, 64, count=16)  # the caller touches 16 of the 64 bytes
    assert bytes(mv2) == DATA[4096:4160]
    assert st.stats.bytes_read - before == 1016
    st.prefetch("data/x.bin", 5, 9000)  # a hint: must not fail, even unaligned
    st.close()
    assert bytes(mv) == DATA[10:1010]  # views outlive the storage's own reference


def test_map_range_refuses_what_it_cannot_map_safely(tmp_path):
    st = _storage(tmp_path)
    assert st.map_range("manifest.json", 0, 2) is None  # replaced by rename: never mapped
    assert st.map_range("data/x.bin", len(DATA) - 10, 11) is None  # past the end: read it and report
    assert st.map_range("data/x.bin", -1, 4) is None
    assert st.map_range("data/x.bin", 0, 0) is None
    assert st.map_range("data/empty.bin", 0, 1) is None
    assert st.stats.bytes_read == 0
    off = _storage(tmp_path / "off", mmap_reads=False)
    assert off.map_range("data/x.bin", 0, 10) is None
    off.prefetch("data/x.bin", 0, 10)  # nothing mapped: nothing to do


class _M(nn.Module):
    def __init__(self, transposed: bool):
        super().__init__()
        w = torch.zeros(320, 256).t() if transposed else torch.zeros(256, 320)  # 320 KiB: above SMALL_SPAN
        self.w = nn.Parameter(w)  # transposed: a non-contiguous destination, copied from a mapping
        self.b1 = nn.Parameter(torch.zeros(3))  # small neighbours: one request or one mapping
        self.b2 = nn.Parameter(torch.zeros(5))


def _saved(tmp_path) -> tuple[str, _M]:
    torch.manual_seed(0)
    src = _M(transposed=False)
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(torch.randn_like(p))
    path = str(tmp_path / "ck")
    sp.save(path, {"model": src})
    return path, src


def _count_maps(monkeypatch) -> list:
    got: list = []
    real = LocalStorage.map_range

    def spy(self, *a, **k):
        mv = real(self, *a, **k)
        got.append(mv is not None)
        return mv

    monkeypatch.setattr(LocalStorage, "map_range", spy)
    return got


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("mmap_reads", [True, False])
def test_load_through_mappings_is_bit_exact(tmp_path, monkeypatch, mmap_reads, verify):
    # verify=False too: a verified load would mend wrong mapped bytes by reading them again
    path, src = _saved(tmp_path)
    got = _count_maps(monkeypatch)
    dst = _M(transposed=True)
    sp.load(LocalStorage(path, mmap_reads=mmap_reads), {"model": dst}, verify=verify)
    for name, p in src.named_parameters():
        assert torch.equal(getattr(dst, name), p), name
    assert not dst.w.is_contiguous()
    # the transposed weight is mapped (the small neighbours are one request); nothing is when it is off
    assert (sum(got) == 1) if mmap_reads else not any(got)


def test_truncated_file_under_a_mapped_span_is_corrupt(tmp_path, monkeypatch):
    path, _ = _saved(tmp_path)
    chunk = sp.read_manifest(path).tensors["model.w"].chunks[0]
    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.truncate(chunk.offset + chunk.nbytes - 5)  # into the weight, which would be mapped
    got = _count_maps(monkeypatch)
    with pytest.raises(sp.CorruptCheckpointError, match=rf"data file {re.escape(chunk.file)} of tensor 'model\.w' is shorter than the manifest says"):
        sp.load(path, {"model": _M(transposed=True)})
    assert got == [False]  # the cut-short span was refused a mapping and read instead


def test_missing_file_under_a_mapped_span_is_corrupt(tmp_path):
    path, _ = _saved(tmp_path)
    chunk = sp.read_manifest(path).tensors["model.w"].chunks[0]
    os.unlink(os.path.join(path, chunk.file))
    with pytest.raises(sp.CorruptCheckpointError, match=rf"data file {re.escape(chunk.file)} of tensor 'model\.\w+' is missing"):
        sp.load(path, {"model": _M(transposed=True)})


def test_flipped_byte_under_a_mapped_span_is_corrupt(tmp_path, monkeypatch):
    path, _ = _saved(tmp_path)
    chunk = sp.read_manifest(path).tensors["model.w"].chunks[0]
    flip_byte(os.path.join(path, chunk.file), chunk.offset + 7)
    got = _count_maps(monkeypatch)
    with pytest.raises(sp.CorruptCheckpointError, match=r"checksum mismatch in .* of tensor 'model\.w'"):
        sp.load(path, {"model": _M(transposed=True)})
    assert True in got


def test_strided_span_is_brought_in_with_few_calls(tmp_path, monkeypatch):
    """Unverified, a strided span's many runs are populated in one call, or hinted in one where that is missing."""
    import shardpoint.storage.local as local
    from shardpoint.engine.read_local import fault_in, map_span
    from shardpoint.planning.reads import PREFETCH_GAP, ChunkRead
    from shardpoint.format.manifest import ChunkMeta
    from shardpoint.geometry import Box

    st = _storage(tmp_path)
    n = len(DATA)
    chunk = ChunkMeta(Box((0,), (n // 4,)), "data/x.bin", 0, n, ("0" * 16,), None, 0)
    segments = tuple((k, k + 8) for k in range(0, 8192, 16)) + ((n - 8, n),)  # 513 runs, all within PREFETCH_GAP
    r = ChunkRead("w", 0, chunk, 0, n, "float32", 4, segments=segments)
    assert n < PREFETCH_GAP
    view = map_span(st, r)
    calls: list = []
    real = st.populate
    st.populate = lambda name, off, k: calls.append((off, k)) or real(name, off, k)
    assert bytes(fault_in(st, r, view, 1 << 20, False, "t", None).numpy()) == DATA
    assert calls == [(0, n)]  # one call, not one system call per run
    hints: list = []
    st.prefetch = lambda name, off, k: hints.append((off, k))
    monkeypatch.setattr(local, "populate_supported", lambda mm: False)  # a kernel before 5.14
    assert real("data/x.bin", 0, n) is False
    assert hints == [(0, n)]


def test_auto_maps_only_what_the_page_cache_holds(tmp_path, monkeypatch):
    """``mmap_reads="auto"`` (the default) maps a span only when most of its pages are resident."""
    import shardpoint.storage.local as local

    assert LocalStorage(str(tmp_path / "d")).options.mmap_reads == "auto"
    monkeypatch.setattr(local, "populate_supported", lambda mm: False)  # a kernel before 5.14
    seen = []

    def fraction(value):
        def f(mm, offset, length):
            seen.append((offset, length))
            return value
        return f

    monkeypatch.setattr(local, "resident_fraction", fraction(0.49))
    st = _storage(tmp_path / "cold")
    assert st.map_range("data/x.bin", 10, 1000) is None  # cold: read it into a buffer instead
    assert seen == [(10, 1000)] and st.stats.bytes_read == 0
    always = _storage(tmp_path / "always", mmap_reads=True)
    assert bytes(always.map_range("data/x.bin", 10, 1000)) == DATA[10:1010]  # True ignores residency
    assert seen == [(10, 1000)]
    monkeypatch.setattr(local, "resident_fraction", fraction(0.5))
    assert bytes(st.map_range("data/x.bin", 10, 1000)) == DATA[10:1010]
    with pytest.raises(ValueError, match=r"mmap_reads must be True, False or 'auto', got 'sometimes'"):
        LocalStorage(str(tmp_path / "bad"), mmap_reads="sometimes")


def test_resident_fraction_of_pages_just_read(tmp_path):
    import mmap

    from shardpoint.storage.local import resident_fraction

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 << 10))
    with open(path, "rb") as f:
        assert f.read() is not None  # in the page cache now
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        assert resident_fraction(mm, 5, 60 << 10) == 1.0
        assert resident_fraction(mm, 0, 0) == 1.0
    finally:
        mm.close()  # no export left behind: the mapping closes


def test_a_cold_load_through_auto_is_bit_exact_and_reads_into_buffers(tmp_path, monkeypatch):
    import shardpoint.storage.local as local

    path, src = _saved(tmp_path)
    monkeypatch.setattr(local, "populate_supported", lambda mm: False)  # a kernel before 5.14
    for value, mapped in ((0.0, False), (1.0, True)):
        monkeypatch.setattr(local, "resident_fraction", lambda mm, o, n, v=value: v)
        st = LocalStorage(path)
        calls = []
        orig = st.map_range
        st.map_range = lambda *a, **k: calls.append(orig(*a, **k)) or calls[-1]
        dst = _M(transposed=True)
        sp.load(st, {"model": dst})
        for name, p in src.named_parameters():
            assert torch.equal(getattr(dst, name), p), name
        assert calls and all((c is not None) == mapped for c in calls), value


def _populates() -> bool:
    import mmap

    from shardpoint.storage.local import populate_supported

    with open(__file__, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        return populate_supported(mm)


needs_populate = pytest.mark.skipif(not _populates(), reason="MADV_POPULATE_READ needs Linux 5.14 or later")


@needs_populate
def test_populate_reads_cold_pages_and_reports_a_shrunk_file(tmp_path):
    from shardpoint.storage.base import ShortReadError
    from shardpoint.storage.local import resident_fraction

    st = LocalStorage(str(tmp_path))
    with st.open_writer("data/p.bin") as w:
        w.write(os.urandom(1 << 20))
    fd = os.open(str(tmp_path / "data" / "p.bin"), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written and synced: clean pages, dropped
    os.close(fd)
    mv = st.map_range("data/p.bin", 0, 1 << 20)  # auto maps it although cold: it can be populated
    mm = st._reads.maps[str(tmp_path / "data" / "p.bin")]
    assert resident_fraction(mm, 512 << 10, 4096) == 0.0
    assert st.populate("data/p.bin", (512 << 10) + 5, 64 << 10) is True
    assert resident_fraction(mm, 512 << 10, 64 << 10) == 1.0
    os.truncate(str(tmp_path / "data" / "p.bin"), 256 << 10)
    with pytest.raises(ShortReadError, match=r"data/p\.bin: bytes \[786432, 851968\) are no longer in the file"):
        st.populate("data/p.bin", 768 << 10, 64 << 10)  # a fault here would be SIGBUS
    del mv


@needs_populate
def test_a_cold_load_through_auto_maps_and_populates(tmp_path, monkeypatch):
    import shardpoint.storage.local as local

    path, src = _saved(tmp_path)
    monkeypatch.setattr(local, "resident_fraction", lambda mm, o, n: 0.0)  # as cold as can be: no matter
    got = _count_maps(monkeypatch)
    st = LocalStorage(path)
    calls = []
    real = st.populate
    st.populate = lambda name, off, n: calls.append((name, off, n)) or real(name, off, n)
    dst = _M(transposed=True)
    sp.load(st, {"model": dst})
    for name, p in src.named_parameters():
        assert torch.equal(getattr(dst, name), p), name
    assert got and all(got)
    assert calls and all(name.startswith("data/") and n > 0 for name, _o, n in calls)


@needs_populate
def test_a_file_cut_short_after_it_was_mapped_is_corrupt_not_a_crash(tmp_path, monkeypatch):
    path, _ = _saved(tmp_path)
    m = sp.read_manifest(path)
    (file, size), = [(f, n) for f, n in m.files.items() if f.endswith(".bin")]
    real = LocalStorage.map_range

    def map_then_truncate(self, *a, **k):
        mv = real(self, *a, **k)
        os.truncate(os.path.join(path, file), 0)  # every later page of the mapping is gone
        return mv

    monkeypatch.setattr(LocalStorage, "map_range", map_then_truncate)
    with pytest.raises(sp.CorruptCheckpointError, match=rf"data file {re.escape(file)} of tensor 'model\.\w+' is shorter than the manifest says"):
        sp.load(path, {"model": _M(transposed=True)})
