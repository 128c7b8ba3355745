"""The order in which ranks on one disk walk their spans, and the planning shortcuts (pure, no I/O)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.format.datafile import ALIGN
from shardpoint.planning.reads import BATCH_BYTES, ChunkRead, ReadTarget, batch_reads, order_reads, plan_chunk_reads, plan_segments
from shardpoint.format.manifest import ChunkMeta, Manifest, TensorMeta
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget
from shardpoint.testing import flip_byte

SIZE = 1000


def _read(file: str, writer: int, offset: int, n: int = 100) -> ChunkRead:
    chunk = ChunkMeta(Box((0,), (n // 4,)), file, offset, n, ("0" * 16,), None, writer)
    return ChunkRead("w", 0, chunk, 0, n, "float32", 4)


def _files(n: int) -> dict[str, int]:
    return {f"data/f{i}-r{i:05d}.bin": SIZE for i in range(n)}


def _spans(reads):
    return [(r.chunk.rank, r.chunk.offset) for r in reads]


def test_each_rank_streams_its_part_and_follows_the_others():
    files = _files(4)
    reads = [_read(f, w, off) for w, f in enumerate(files) for off in (0, 500)]
    # Two ranks: rank 0 streams writers 0 and 1, and reads what it needs of writers
    # 2 and 3 a little behind where rank 1 is expected to be.
    assert _spans(order_reads(reads, 0, 2, files, 4)) == [(0, 0), (2, 0), (0, 500), (2, 500), (1, 0), (3, 0), (1, 500), (3, 500)]
    assert _spans(order_reads(reads, 1, 2, files, 4)) == [(2, 0), (0, 0), (2, 500), (0, 500), (3, 0), (1, 0), (3, 500), (1, 500)]
    # Four ranks: each starts in its own file.
    assert [order_reads(reads, q, 4, files, 4)[0].chunk.rank for q in range(4)] == [0, 1, 2, 3]


def test_index_files_and_partial_views_keep_ranks_apart():
    # Format version 2 lists each rank's index file beside its data file; a rank
    # that reads only some writers still places them on the same line.
    files = {**_files(4), **{f"data/f{i}-r{i:05d}.idx": 10 for i in range(4)}}
    data = [f for f in files if f.endswith(".bin")]
    reads = [_read(f, w, 0) for w, f in enumerate(data)]
    assert order_reads(reads, 1, 2, files, 4)[0].chunk.rank == 2
    assert [r.chunk.rank for r in order_reads(reads[2:], 1, 2, files, 4)] == [2, 3]
    assert [r.chunk.rank for r in order_reads(reads[1:], 1, 2, files, 4)] == [2, 3, 1]


def test_one_file_is_split_by_offset():
    files = _files(1)
    f = next(iter(files))
    reads = [_read(f, 0, off) for off in range(0, SIZE, 100)]
    assert [r.chunk.offset for r in order_reads(reads, 1, 2, files)] == [500, 0, 600, 100, 700, 200, 800, 300, 900, 400]


def test_writer_with_several_files_falls_back_to_names():
    files = {"data/a.bin": SIZE, "data/b.bin": SIZE}
    reads = [_read("data/b.bin", 0, 0), _read("data/a.bin", 0, 0)]
    assert [r.chunk.file for r in order_reads(reads, 0, 2, files)] == ["data/a.bin", "data/b.bin"]
    assert [r.chunk.file for r in order_reads(reads, 1, 2, files)] == ["data/b.bin", "data/a.bin"]


def test_one_rank_keeps_file_order():
    files = _files(3)
    reads = [_read(f, w, off) for w, f in reversed(list(enumerate(files))) for off in (500, 0)]
    assert _spans(order_reads(reads, 0, 1, files)) == [(0, 0), (0, 500), (1, 0), (1, 500), (2, 0), (2, 500)]


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_order_is_a_permutation_and_walks_each_part_in_order(data):
    nfiles = data.draw(st.integers(1, 5))
    files = _files(nfiles)
    names = list(files)
    reads = [_read(names[w], w, off * 100) for w in range(nfiles) for off in data.draw(st.sets(st.integers(0, 9), min_size=1))]
    world = data.draw(st.integers(1, 6))
    rank = data.draw(st.integers(0, world - 1))
    out = order_reads(reads, rank, world, files, nfiles)
    assert sorted(map(id, out)) == sorted(map(id, reads))
    # Within each rank's part of the line (writer + offset / size), spans go front to back.
    part = nfiles / world
    where = [((r.chunk.rank + r.chunk.offset / SIZE) - rank * part) % nfiles for r in out]
    for k in range(world):
        mine = [d for d in where if min(int(d // part), world - 1) == k]
        assert mine == sorted(mine)


def _manifest(shape, splits, block):
    chunks, off = [], 0
    for lo, hi in splits:
        box = Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))
        nbytes = box.numel * 4
        chunks.append(ChunkMeta(box, "data/x-r00000.bin", off, nbytes, tuple("0" * 16 for _ in range(max(1, -(-nbytes // block)))), None, 0))
        off += nbytes
    return Manifest(save_id="x", world_size=1, block_size=block, tensors={"w": TensorMeta("float32", tuple(shape), tuple(chunks))},
                    values={}, files={"data/x-r00000.bin": off}, layout={})


def test_a_span_within_one_block_is_read_whole_when_verifying():
    m = _manifest((8, 64), [(0, 8)], block=4096)  # 2 KiB chunk, one block
    tgt = ReadTarget("w", "float32", (8, 64), Box((0, 0), (8, 32)))
    (r,) = plan_chunk_reads(m, [tgt], "t", True, 0)
    assert r.segments is None and (r.lo, r.hi) == (0, 2048)
    (r,) = plan_chunk_reads(m, [tgt], "t", False, 0)
    assert r.segments == tuple((i * 256, i * 256 + 128) for i in range(8))  # the strided runs, without verification


def test_a_contiguous_run_is_one_segment():
    m = _manifest((8, 64), [(0, 8)], block=256)
    tgt = ReadTarget("w", "float32", (8, 64), Box((3, 0), (2, 64)))
    for verify in (True, False):
        (r,) = plan_chunk_reads(m, [tgt], "t", verify, 0)
        assert r.segments is None
        assert plan_segments(r, verify, 256, 0) is None


def _span(file: str, offset: int, n: int, lo: int = 0, segments=None) -> ChunkRead:
    chunk = ChunkMeta(Box((0,), (n // 4,)), file, offset, n, ("0" * 16,), None, 0)
    return ChunkRead("w", 0, chunk, lo, n, "float32", 4, segments=segments)


def test_neighbouring_small_spans_share_one_request():
    a = [_span("data/a.bin", o, 768) for o in (0, 768, 1568)]  # 32 bytes of padding before the third
    far = _span("data/a.bin", 1_000_000, 768)
    other = _span("data/b.bin", 2368, 768)
    big = _span("data/b.bin", 3200, 1 << 20)
    groups = batch_reads(a + [far, other, big], ALIGN)
    assert [len(g) for g in groups] == [3, 1, 1, 1]
    assert groups[0] == a
    # A gap of ALIGN bytes could hold another chunk (a span another rank reads): never read it.
    assert [len(g) for g in batch_reads([_span("data/a.bin", 0, 768), _span("data/a.bin", 768 + ALIGN, 768)], ALIGN)] == [1, 1]


def test_batches_keep_order_and_respect_limits():
    reads = [_span("data/a.bin", i * 200_000, 200_000) for i in range(40)]  # 8 MB of touching 200 kB spans
    groups = batch_reads(reads, ALIGN)
    assert [r for g in groups for r in g] == reads
    assert all(sum(r.hi - r.lo for r in g) <= BATCH_BYTES for g in groups)
    assert len(groups) == 2
    # Backwards, overlapping or segmented spans are never merged.
    assert len(batch_reads([_span("data/a.bin", 768, 768), _span("data/a.bin", 0, 768)], ALIGN)) == 2
    assert len(batch_reads([_span("data/a.bin", 0, 768, segments=((0, 64),)), _span("data/a.bin", 768, 768)], ALIGN)) == 2


def test_batched_small_tensors_load_and_name_the_corrupt_one(tmp_path):
    import os
    import re

    import pytest

    import shardpoint as sp

    state = {f"t{i:02d}": torch.arange(i, i + 50, dtype=torch.float32) for i in range(30)}
    path = str(tmp_path / "ck")
    sp.save(path, state)
    out = {k: None for k in state}
    sp.load(path, out)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    chunk = sp.read_manifest(path).tensors["t17"].chunks[0]
    flip_byte(os.path.join(path, chunk.file), chunk.offset + 9, mask=1)
    with pytest.raises(sp.CorruptCheckpointError, match=rf"{re.escape(chunk.file)} .* of tensor 't17'"):
        sp.load(path, {k: None for k in state})


def test_strided_runs_without_verification_read_in_one_storage_call(tmp_path):
    import os

    import pytest

    import shardpoint as sp
    from shardpoint.storage import LocalStorage

    w = torch.arange(64 * 4096, dtype=torch.float32).reshape(64, 4096)
    path = str(tmp_path / "ck")
    sp.save(path, {"w": w})
    st = LocalStorage(path)
    got = sp.read_tensor(st, "w", (slice(None), slice(0, 2048)), verify=False)
    assert torch.equal(got, w[:, :2048])
    assert st.stats.bytes_read < w.numel() * 4  # the runs, not the whole rows
    chunk = sp.read_manifest(path).tensors["w"].chunks[0]
    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.truncate(chunk.offset + chunk.nbytes // 2)
    with pytest.raises(sp.CorruptCheckpointError, match="of tensor 'w' is shorter than the manifest says"):
        sp.read_tensor(path, "w", (slice(None), slice(0, 2048)), verify=False)


def test_garbage_collection_is_paused_during_reads_and_restored(tmp_path, monkeypatch):
    import gc

    import pytest

    import shardpoint as sp
    import shardpoint.engine.load as L

    path = str(tmp_path / "ck")
    sp.save(path, {"t": torch.arange(10.0)})
    seen = []
    real = L.execute_local
    monkeypatch.setattr(L, "execute_local", lambda *a, **k: (seen.append(gc.isenabled()), real(*a, **k))[1])
    assert gc.isenabled()
    sp.load(path, {"t": None})
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        sp.load(path, {"t": None})
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
    monkeypatch.setattr(L, "execute_local", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        sp.load(path, {"t": None})
    assert gc.isenabled()
