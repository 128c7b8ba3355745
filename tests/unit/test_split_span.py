"""A span too large for a bounce slot, cut into spans that fit one (pure, no I/O)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import example, given, settings, strategies as st

from shardpoint.format.manifest import ChunkMeta
from shardpoint.geometry import Box, Piece, row_major_strides
from shardpoint.planning.load_plan import ReadOp
from shardpoint.planning.reads import ChunkRead, CopyJob
from shardpoint.planning.split import split_span


def _bytes(op: ReadOp, itemsize: int) -> tuple[int, int]:
    st_ = row_major_strides(op.src.box.sizes)
    first = op.src.start + sum((o - c) * t for o, c, t in zip(op.region.offsets, op.src.box.offsets, st_))
    last = first + sum((s - 1) * t for s, t in zip(op.region.sizes, st_))
    return first * itemsize, (last + 1) * itemsize


def _elements(op: ReadOp) -> set[int]:
    """The chunk-relative element indexes ``op`` copies from."""
    st_ = row_major_strides(op.src.box.sizes)
    grids = np.meshgrid(*[np.arange(o - c, o - c + s) for o, c, s in zip(op.region.offsets, op.src.box.offsets, op.region.sizes)],
                        indexing="ij")
    idx = op.src.start + sum(g * t for g, t in zip(grids, st_)) if grids else np.array([op.src.start])
    return set(np.asarray(idx).ravel().tolist())


@st.composite
def spans(draw):
    ndim = draw(st.integers(1, 3))
    sizes = tuple(draw(st.integers(1, 24)) for _ in range(ndim))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    box = Box(tuple(draw(st.integers(0, 5)) for _ in range(ndim)), sizes)
    lead = draw(st.integers(0, 40))  # elements of the chunk before this piece (a flat-saved chunk's earlier pieces)
    src = Piece(box, lead)
    # Up to three targets, each a block of columns of the last dim (a TP shard) over some rows of the first.
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, sizes[-1] - 1)), max_size=2)))) if sizes[-1] > 1 else []
    edges = [0, *cuts, sizes[-1]]
    r0 = draw(st.integers(0, sizes[0] - 1)) if ndim > 1 else 0
    r1 = draw(st.integers(r0 + 1, sizes[0])) if ndim > 1 else sizes[0]
    jobs = []
    for t, (a, b) in enumerate(zip(edges, edges[1:])):
        first = (r0,) + (0,) * (ndim - 2) + (a,) if ndim > 1 else (a,)
        extent = (r1 - r0,) + sizes[1:-1] + (b - a,) if ndim > 1 else (b - a,)
        region = Box(tuple(o + f for o, f in zip(box.offsets, first)), extent)
        jobs.append(CopyJob(t, (ReadOp(0, src, Piece(region, 0), region),)))
    n = (lead + math.prod(sizes)) * itemsize
    block = draw(st.sampled_from([8, 64, 1 << 20]))
    verify = draw(st.booleans())
    lo = lead * itemsize // block * block if verify else lead * itemsize
    hi = min(n, -(-n // block) * block) if verify else n
    chunk = ChunkMeta(Box.full(sizes), "data/f.bin", 0, n, ("0" * 16,) * max(1, -(-n // block)), None, 0)
    needed = sum(math.prod(op.region.sizes) for j in jobs for op in j.ops) * itemsize
    r = ChunkRead("w", 0, chunk, lo, hi, "x", itemsize, tuple(jobs), None, needed)
    limit = draw(st.integers(1, max(itemsize, n)))
    return r, limit, block, verify


@settings(max_examples=300, deadline=None)
@given(spans())
def test_the_spans_feed_every_element_once_and_hold_their_bytes(case):
    r, limit, block, verify = case
    parts = split_span(r, limit, block, verify)
    fed = {}
    for p in parts:
        assert r.lo <= p.lo < p.hi <= r.hi
        if verify:
            assert p.lo % block == 0 and (p.hi % block == 0 or p.hi == r.hi)
        assert p.needed == sum(math.prod(op.region.sizes) for j in p.jobs for op in j.ops) * r.itemsize
        for job in p.jobs:
            for op in job.ops:
                a, b = _bytes(op, r.itemsize)
                assert p.lo <= a and b <= p.hi  # the slab lies in its span
                got = _elements(op)
                assert not (got & fed.setdefault(job.target, set()))  # fed once
                fed[job.target] |= got
    want = {job.target: set().union(*(_elements(op) for op in job.ops)) for job in r.jobs}
    assert fed == want
    if r.hi - r.lo <= limit:
        assert parts == [r]


@settings(max_examples=300, deadline=None)
@given(spans())
@example((ChunkRead("w", 0, ChunkMeta(Box((0,), (2,)), "data/f.bin", 0, 8, ("0" * 16,), None, 0), 0, 8, "x", 4,
                    tuple(CopyJob(t, (ReadOp(0, Piece(Box((0,), (2,)), 0), Piece(Box((t,), (1,)), 0), Box((t,), (1,))),))
                          for t in (0, 1)), None, 8), 5, 8, False))  # one-element regions, the second straddling a window
def test_every_span_fits_the_limit_whatever_its_rows(case):
    r, limit, block, verify = case
    window = max(1, limit // block) * block if verify else limit  # verified spans hold whole checksum blocks
    parts = split_span(r, limit, block, verify)
    for p in parts:
        # A verified span also holds the parts of the checksum blocks its ends straddle.
        assert p.hi - p.lo <= max(window, r.itemsize) + (2 * (block - 1) if verify else 0)
    # Spans are named by their bytes on every rank: two with the same bytes would be one span twice.
    assert len({(p.lo, p.hi) for p in parts}) == len(parts)


@settings(max_examples=200, deadline=None)
@given(spans())
def test_ranks_copying_other_regions_get_the_same_spans_where_both_copy(case):
    """Each target's spans alone are spans of all the targets together: a shared span stays shared once cut."""
    r, limit, block, verify = case
    together = {(p.lo, p.hi) for p in split_span(r, limit, block, verify)}
    for job in r.jobs:
        alone = ChunkRead(r.fqn, r.ci, r.chunk, r.lo, r.hi, r.dtype, r.itemsize, (job,), r.segments, 0)
        assert {(p.lo, p.hi) for p in split_span(alone, limit, block, verify)} <= together


def test_a_region_whose_one_row_exceeds_the_limit_is_cut_along_the_row():
    sizes = (2, 3, 4096)  # rows of 48 KiB along dim 0, of 16 KiB along dim 1
    box = Box((0, 0, 0), sizes)
    n = math.prod(sizes) * 4
    chunk = ChunkMeta(box, "data/f.bin", 0, n, ("0" * 16,), None, 0)
    r = ChunkRead("w", 0, chunk, 0, n, "float32", 4, (CopyJob(0, (ReadOp(0, Piece(box, 0), Piece(box, 0), box),)),), None, n)
    parts = split_span(r, 10_000, 1 << 20, False)
    assert all(p.hi - p.lo <= 10_000 for p in parts)
    assert len(parts) == 2 * 3 * 2  # each 16 KiB row of dim 1 in two windows of 2,500 elements
    regions = [op.region for p in parts for j in p.jobs for op in j.ops]
    assert [(g.offsets, g.sizes) for g in regions[:2]] == [((0, 0, 0), (1, 1, 2500)), ((0, 0, 2500), (1, 1, 1596))]
    assert sum(g.numel for g in regions) == math.prod(sizes)


def test_a_large_column_block_becomes_row_slabs_of_the_same_columns():
    sizes = (1000, 64)
    box, region = Box((0, 0), sizes), Box((0, 16), (1000, 32))
    chunk = ChunkMeta(box, "data/f.bin", 0, 1000 * 64 * 4, ("0" * 16,), None, 0)
    r = ChunkRead("w", 0, chunk, 0, 1000 * 64 * 4, "float32", 4,
                  (CopyJob(0, (ReadOp(0, Piece(box, 0), Piece(region, 0), region),)),), None, 1000 * 32 * 4)
    parts = split_span(r, 64 << 10, 1 << 20, False)
    assert len(parts) == 4  # 256,000 bytes in windows of 65,536
    regions = [op.region for p in parts for j in p.jobs for op in j.ops]
    assert all(g.offsets[1] == 16 and g.sizes[1] == 32 for g in regions)
    assert sum(g.sizes[0] for g in regions) == 1000
    assert [g.offsets[0] for g in regions] == [0, 256, 512, 768]
