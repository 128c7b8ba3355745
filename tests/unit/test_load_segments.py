"""Byte ranges inside a chunk, and the choice of readers for shared spans (pure, no I/O)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardpoint as sp
from shardpoint.planning.reads import ReadTarget, at_blocks, plan_chunk_reads
from shardpoint.planning.sharing import plan_sharing
from shardpoint.format.manifest import ChunkMeta, Manifest, TensorMeta
from shardpoint.geometry import Box
from shardpoint.storage import MemoryStorage


def _manifest(shape, row_splits, block, itemsize=4):
    """A fp32 tensor saved as row blocks ``row_splits`` (fake checksums, one per block)."""
    chunks, off = [], 0
    for lo, hi in row_splits:
        box = Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))
        nbytes = box.numel * itemsize
        sums = tuple("0" * 16 for _ in range(max(1, -(-nbytes // block))))
        chunks.append(ChunkMeta(box, "data/x-r00000.bin", off, nbytes, sums, None, 0))
        off += nbytes
    t = TensorMeta("float32", tuple(shape), tuple(chunks))
    return Manifest(save_id="x", world_size=1, block_size=block, tensors={"w": t}, values={}, files={"data/x-r00000.bin": off}, layout={})


def _plan(m, box, verify, coalesce=0):
    tgt = ReadTarget("w", "float32", tuple(m.tensors["w"].shape), box)
    return plan_chunk_reads(m, [tgt], "t", verify, coalesce)


def test_column_half_reads_only_its_runs_without_verification():
    m = _manifest((8, 1024), [(0, 8)], block=1 << 20)
    (r,) = _plan(m, Box((0, 0), (8, 512)), verify=False)
    # 8 rows of 512 fp32 values, 2 KiB apart: eight separate runs.
    assert r.segments == tuple((i * 4096, i * 4096 + 2048) for i in range(8))
    assert r.nread == 8 * 2048 and r.hi - r.lo == 7 * 4096 + 2048


def test_close_runs_are_coalesced():
    m = _manifest((8, 1024), [(0, 8)], block=1 << 20)
    (r,) = _plan(m, Box((0, 0), (8, 512)), verify=False, coalesce=2048)
    assert r.segments is None  # one span: the gaps are no wider than the coalescing distance
    assert r.nread == r.hi - r.lo == 7 * 4096 + 2048


def test_verification_reads_whole_blocks_and_skips_untouched_ones():
    # 64 rows of 256 fp32 = 1 KiB per row; 4 KiB blocks hold 4 rows each.
    m = _manifest((64, 256), [(0, 64)], block=4096)
    (r,) = _plan(m, Box((0, 0), (64, 8)), verify=True)
    assert r.segments is None  # every block holds a needed run
    # Rows 0..3 and 60..63 only: two blocks far apart, both read whole.
    tgt_a = ReadTarget("w", "float32", (64, 256), Box((0, 0), (4, 256)))
    tgt_b = ReadTarget("w", "float32", (64, 256), Box((60, 0), (4, 256)))
    (r,) = plan_chunk_reads(m, [tgt_a, tgt_b], "t", True, 0)
    assert (r.lo, r.hi) == (0, 64 * 1024)
    assert r.segments == ((0, 4096), (60 * 1024, 64 * 1024))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 40),
    data=st.data(),
    verify=st.booleans(),
    block=st.sampled_from([16, 64, 256]),
    coalesce=st.sampled_from([0, 8, 64]),
)
def test_segments_cover_exactly_what_is_copied(rows, cols, data, verify, block, coalesce):
    cut = data.draw(st.integers(0, rows))
    splits = [(0, cut), (cut, rows)] if 0 < cut < rows else [(0, rows)]
    m = _manifest((rows, cols), splits, block)
    r0 = data.draw(st.integers(0, rows - 1))
    c0 = data.draw(st.integers(0, cols - 1))
    box = Box((r0, c0), (data.draw(st.integers(1, rows - r0)), data.draw(st.integers(1, cols - c0))))
    for r in _plan(m, box, verify, coalesce):
        segs = r.ranges()
        assert all(r.lo <= a < b <= r.hi for a, b in segs)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(segs, segs[1:]))
        if verify:
            assert all(a % block == 0 and (b % block == 0 or b == r.chunk.nbytes) for a, b in segs)
        # Every byte a copy reads lies in a segment.
        got = np.zeros(r.chunk.nbytes, dtype=bool)
        for a, b in segs:
            got[a:b] = True
        cbox = r.chunk.box
        for i in range(box.offsets[0], box.offsets[0] + box.sizes[0]):
            if not cbox.offsets[0] <= i < cbox.offsets[0] + cbox.sizes[0]:
                continue
            row = (i - cbox.offsets[0]) * cols * 4
            assert got[row + c0 * 4 : row + (c0 + box.sizes[1]) * 4].all()


def test_partial_column_read_is_bit_exact_and_counts_only_segments():
    w = torch.arange(32 * 4096, dtype=torch.float32).reshape(32, 4096)
    store = MemoryStorage()
    sp.save(store, {"w": w}, block_size=1 << 20)
    # Metadata: the manifest, and the one index file of the rank that wrote "w".
    manifest = len(store.get("manifest.json")) + sum(n for f, n in sp.read_manifest(store, chunks=False).files.items() if f.endswith(".idx"))
    before = store.stats.bytes_read
    got = sp.read_tensor(store, "w", (slice(0, 32), slice(3072, 4096)), verify=False)
    assert torch.equal(got, w[:, 3072:])
    # 32 runs of 4 KiB, 12 KiB apart (wider than the 4 KiB coalescing distance):
    # exactly the needed bytes, plus the metadata.
    assert store.stats.bytes_read - before == 32 * 4096 + manifest
    before = store.stats.bytes_read
    got = sp.read_tensor(store, "w", (slice(0, 32), slice(3072, 4096)))
    assert torch.equal(got, w[:, 3072:])
    # Verified: the whole 512 KiB chunk is one checksum block, read whole.
    assert store.stats.bytes_read - before == 32 * 4096 * 4 + manifest


def _rows(*spans):
    return np.array(spans, dtype=np.int64).reshape(-1, 4)


def test_sharing_picks_one_needer_per_span_and_balances_bytes():
    # span id, size, file index, offset
    a = _rows([1, 100, 0, 0], [2, 100, 0, 100], [3, 50, 1, 0])
    b = _rows([1, 100, 0, 0], [2, 100, 0, 100], [4, 10, 1, 50])
    c = _rows([3, 50, 1, 0])
    plan = plan_sharing([a, b, c], 3)
    assert [(s.sid, s.size, s.needers) for s in plan] == [(1, 100, (0, 1)), (2, 100, (0, 1)), (3, 50, (0, 2))]
    readers = {s.sid: s.reader for s in plan}
    assert readers[1] != readers[2]  # two equal spans, two needers: one each
    assert readers[3] in (0, 2)
    assert plan_sharing([a, b, c], 3) == plan  # deterministic: every rank computes the same


def test_nothing_shared_gives_an_empty_plan():
    assert plan_sharing([_rows([1, 10, 0, 0]), _rows([2, 10, 0, 10]), _rows()], 3) == []
    assert plan_sharing([_rows(), _rows()], 2) == []


def test_ranges_cut_at_checksum_blocks():
    assert at_blocks(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert at_blocks(3, 10, 4) == [(3, 4), (4, 8), (8, 10)]  # an unaligned start keeps every byte
    assert at_blocks(4, 8, 4) == [(4, 8)]


def test_tensors_of_one_geometry_share_a_plan_but_keep_their_own_chunks():
    """Same chunk boxes and target box: planned once, yet each read points at its own tensor's bytes."""
    import pytest

    a = _manifest((8, 16), [(0, 4), (4, 8)], block=1 << 20)
    b = _manifest((8, 16), [(0, 4), (4, 8)], block=1 << 20)
    tb = b.tensors["w"]
    moved = tuple(ChunkMeta(c.box, "data/y-r00001.bin", c.offset + 4096, c.nbytes, c.checksums, None, 1) for c in tb.chunks)
    holey = (ChunkMeta(Box((0, 0), (3, 16)), "data/z.bin", 0, 3 * 16 * 4, ("0" * 16,), None, 0), tb.chunks[1])
    tensors = {"w": a.tensors["w"], "v": TensorMeta("float32", (8, 16), moved), "h": TensorMeta("float32", (8, 16), holey)}
    m = Manifest(save_id="x", world_size=2, block_size=1 << 20, tensors=tensors, values={}, layout={},
                 files={"data/x-r00000.bin": 512, "data/y-r00001.bin": 4608, "data/z.bin": 192})
    box = Box((2, 0), (4, 16))  # rows 2..5: the end of one chunk, the start of the next
    tw = ReadTarget("w", "float32", (8, 16), box)
    tv = ReadTarget("v", "float32", (8, 16), box)
    reads = plan_chunk_reads(m, [tw, tv], "t", False, 0)
    got = sorted((r.fqn, r.chunk.file, r.chunk.offset + r.lo, r.chunk.offset + r.hi) for r in reads)
    assert got == [
        ("v", "data/y-r00001.bin", 4096 + 2 * 64, 4096 + 4 * 64),
        ("v", "data/y-r00001.bin", 4096 + 256, 4096 + 256 + 2 * 64),
        ("w", "data/x-r00000.bin", 2 * 64, 4 * 64),
        ("w", "data/x-r00000.bin", 256, 256 + 2 * 64),
    ]
    assert sum(r.needed for r in reads) == 2 * 4 * 16 * 4
    # A tensor whose chunks leave a hole is named, even after a clean tensor of the same target box.
    th = ReadTarget("h", "float32", (8, 16), box)
    with pytest.raises(sp.CorruptCheckpointError, match=r"tensor 'h': saved chunks cover the target shard with 16 elements missing"):
        plan_chunk_reads(m, [tw, tv, th], "t", False, 0)
