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
    box = Box((0,) * ndim, sizes)
    src = Piece(box, 0)
    # Up to three targets, each a block of columns of the last dim (a TP shard), or the whole box.
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, sizes[-1] - 1)), max_size=2)))) if sizes[-1] > 1 else []
    edges = [0, *cuts, sizes[-1]]
    jobs = []
    for t, (a, b) in enumerate(zip(edges, edges[1:])):
        region = Box((0,) * (ndim - 1) + (a,), sizes[:-1] + (b - a,))
        jobs.append(CopyJob(t, (ReadOp(0, src, Piece(region, 0), region),)))
    n = math.prod(sizes) * itemsize
    block = draw(st.sampled_from([8, 64, 1 << 20]))
    verify = draw(st.booleans())
    hi = -(-n // block) * block if verify else n
    chunk = ChunkMeta(box, "data/f.bin", 0, n, ("0" * 16,) * max(1, -(-n // block)), None, 0)
    r = ChunkRead("w", 0, chunk, 0, min(hi, n), "x", itemsize, tuple(jobs), None, n)
    limit = draw(st.integers(itemsize, max(itemsize, n)))
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


def _row(op: ReadOp, itemsize: int) -> int:
    """Bytes from one row of ``op``'s region to the next, along its outermost dim with more than one index.

    A one-element region is one row of ``itemsize`` bytes: it may straddle a window's end too.
    """
    d = next((i for i, s in enumerate(op.region.sizes) if s > 1), None)
    return itemsize if d is None else row_major_strides(op.src.box.sizes)[d] * itemsize


@settings(max_examples=200, deadline=None)
@given(spans())
@example((ChunkRead("w", 0, ChunkMeta(Box((0,), (2,)), "data/f.bin", 0, 8, ("0" * 16,), None, 0), 0, 8, "x", 4,
                    tuple(CopyJob(t, (ReadOp(0, Piece(Box((0,), (2,)), 0), Piece(Box((t,), (1,)), 0), Box((t,), (1,))),))
                          for t in (0, 1)), None, 8), 5, 8, False))  # one-element regions, the second straddling the window
def test_each_span_stays_near_the_limit_when_its_rows_fit(case):
    r, limit, block, verify = case
    row = max(_row(op, r.itemsize) for j in r.jobs for op in j.ops)
    if row > limit:
        return  # one row larger than the limit is not cut further
    window = max(1, limit // block) * block if verify else limit  # verified spans are cut at whole blocks
    for p in split_span(r, limit, block, verify):
        assert p.hi - p.lo <= window + row + (block if verify else 0)


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
