"""Boxes, flat ranges and runs: the integer arithmetic every read and write relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.geometry import (
    Box,
    Piece,
    Runs,
    even_chunks,
    flat_range_pieces,
    pieces_of,
    row_major_strides,
    runs_within,
)

SETTINGS = settings(max_examples=150, deadline=None)


# --- strategies -------------------------------------------------------------


@st.composite
def boxes(draw, min_ndim=0, max_ndim=4, max_size=7, max_offset=5):
    ndim = draw(st.integers(min_ndim, max_ndim))
    sizes = tuple(draw(st.integers(0, max_size)) for _ in range(ndim))
    offsets = tuple(draw(st.integers(0, max_offset)) for _ in range(ndim))
    return Box(offsets, sizes)


@st.composite
def box_and_range(draw):
    box = draw(boxes())
    n = box.numel
    start = draw(st.integers(0, n))
    stop = draw(st.integers(start, n))
    return box, start, stop


@st.composite
def container_and_inner(draw):
    c = draw(boxes(max_size=6))
    offs, sizes = [], []
    for o, s in zip(c.offsets, c.sizes):
        lo = draw(st.integers(0, s))
        hi = draw(st.integers(lo, s))
        offs.append(o + lo)
        sizes.append(hi - lo)
    return c, Box(tuple(offs), tuple(sizes))


def _mask(box: Box, shape) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] = True
    return m


# --- Box ----------------------------------------------------------------------


def test_box_basics():
    b = Box((1, 2), (3, 4))
    assert b.ndim == 2 and b.numel == 12 and b.ends == (4, 6)
    assert Box.full((5, 6)) == Box((0, 0), (5, 6))
    assert Box((), ()).numel == 1  # a 0-d tensor has one element
    assert b.within((4, 6)) and not b.within((4, 5)) and not b.within((4, 6, 1))
    assert b.relative_to(Box((1, 0), (5, 8))) == (slice(0, 3), slice(2, 6))


def test_box_rejects_bad_geometry():
    with pytest.raises(ValueError, match="rank mismatch"):
        Box((0,), (1, 2))
    with pytest.raises(ValueError, match="negative box"):
        Box((-1,), (2,))
    with pytest.raises(ValueError, match="negative box"):
        Box((0,), (-2,))


def test_intersect_examples():
    a, b = Box((0, 0), (4, 6)), Box((2, 3), (4, 6))
    assert a.intersect(b) == Box((2, 3), (2, 3))
    assert b.intersect(a) == Box((2, 3), (2, 3))
    # touching edges share nothing
    assert Box((0,), (2,)).intersect(Box((2,), (2,))) is None
    assert Box((0, 0), (2, 2)).intersect(Box((0, 5), (2, 2))) is None
    # empty boxes intersect nothing
    assert Box((0,), (0,)).intersect(Box((0,), (5,))) is None
    # 0-d boxes are the single element
    assert Box((), ()).intersect(Box((), ())) == Box((), ())
    with pytest.raises(ValueError, match="rank"):
        a.intersect(Box((0,), (1,)))


def test_contains_examples():
    outer = Box((1, 1), (4, 4))
    assert outer.contains(Box((1, 1), (4, 4)))
    assert outer.contains(Box((2, 3), (1, 2)))
    assert not outer.contains(Box((0, 1), (2, 2)))
    assert not outer.contains(Box((4, 4), (2, 1)))
    assert Box((), ()).contains(Box((), ()))


@st.composite
def box_pairs(draw):
    """Two boxes of one rank (drawn together: filtering by rank tripped hypothesis' health check)."""
    ndim = draw(st.integers(1, 3))
    return tuple(draw(boxes(min_ndim=ndim, max_ndim=ndim, max_size=4, max_offset=4)) for _ in range(2))


@SETTINGS
@given(box_pairs())
def test_intersect_and_contains_match_masks(pair):
    a, b = pair
    shape = tuple(9 for _ in range(a.ndim))
    ma, mb = _mask(a, shape), _mask(b, shape)
    both = ma & mb
    got = a.intersect(b)
    if not both.any():
        assert got is None
    else:
        assert got is not None
        assert np.array_equal(_mask(got, shape), both)
    if b.numel > 0:
        assert a.contains(b) == bool(np.all(ma[mb]))


# --- flat ranges -------------------------------------------------------------


def test_flat_range_pieces_example():
    # Elements [5, 23) of a 4x6 box: the tail of row 0, rows 1-2, the head of row 3.
    box = Box((10, 0), (4, 6))
    got = flat_range_pieces(box, 5, 23)
    assert got == [
        Piece(Box((10, 5), (1, 1)), 0),
        Piece(Box((11, 0), (2, 6)), 1),
        Piece(Box((13, 0), (1, 5)), 13),
    ]


def test_flat_range_pieces_edges():
    box = Box((0, 0, 0), (2, 3, 4))
    assert flat_range_pieces(box, 7, 7) == []
    assert flat_range_pieces(box, 0, 24) == [Piece(box, 0)]
    assert flat_range_pieces(Box((), ()), 0, 1) == [Piece(Box((), ()), 0)]
    with pytest.raises(ValueError, match=r"flat range \[3, 25\) outside box of 24 elements"):
        flat_range_pieces(box, 3, 25)
    with pytest.raises(ValueError, match="outside box"):
        flat_range_pieces(box, 5, 4)


def test_pieces_of():
    box = Box((0, 0), (3, 3))
    assert pieces_of(box, None) == [Piece(box, 0)]
    assert pieces_of(Box((0, 0), (0, 3)), None) == []
    assert pieces_of(Box((), ()), None) == [Piece(Box((), ()), 0)]
    assert pieces_of(box, (2, 5)) == flat_range_pieces(box, 2, 5)


@SETTINGS
@given(box_and_range())
def test_flat_range_pieces_property(args):
    box, start, stop = args
    pieces = flat_range_pieces(box, start, stop)
    arange = np.arange(max(box.numel, 1)).reshape(box.sizes) if box.numel else np.zeros(box.sizes, dtype=np.int64)
    if box.ndim >= 1:
        assert len(pieces) <= 2 * box.ndim - 1
    covered = np.zeros(box.sizes, dtype=np.int64)
    total = 0
    for p in pieces:
        assert p.box.ndim == box.ndim
        assert p.box.numel > 0
        assert box.contains(p.box)
        sl = p.box.relative_to(box)
        covered[sl] += 1
        got = np.asarray(arange[sl]).ravel()
        want = np.arange(start + p.start, start + p.start + p.box.numel)
        assert np.array_equal(got, want), (p, got, want)
        total += p.box.numel
    assert total == stop - start
    # disjoint, and exactly the elements [start, stop) of the row-major order
    flat_cov = covered.ravel()
    assert flat_cov.max(initial=0) <= 1
    expect = np.zeros(box.numel, dtype=np.int64)
    expect[start:stop] = 1
    assert np.array_equal(flat_cov, expect)
    # pieces come in storage order: their starts are increasing and back to back
    pos = 0
    for p in pieces:
        assert p.start == pos
        pos += p.box.numel


# --- runs ----------------------------------------------------------------------


def test_row_major_strides():
    assert row_major_strides((2, 3, 4)) == (12, 4, 1)
    assert row_major_strides(()) == ()
    assert row_major_strides((5,)) == (1,)


def test_runs_within_examples():
    c = Box((0, 0), (4, 6))
    # a full-width band is one run
    assert runs_within(c, Box((1, 0), (2, 6))) == Runs(6, 12, (), ())
    # a column block is one run per row
    r = runs_within(c, Box((1, 2), (3, 2)))
    assert r == Runs(8, 2, (3,), (6,))
    assert list(r.starts()) == [8, 14, 20]
    assert r.count == 3 and r.span == (8, 22)
    # an empty inner box has no runs at all
    empty = runs_within(c, Box((1, 0), (0, 3)))
    assert empty.count == 0 and list(empty.starts()) == []
    # the 0-d box is one run of one element
    assert runs_within(Box((), ()), Box((), ())) == Runs(0, 1, (), ())
    with pytest.raises(ValueError, match="is not inside"):
        runs_within(c, Box((3, 0), (2, 6)))


@SETTINGS
@given(container_and_inner())
def test_runs_within_property(args):
    container, inner = args
    runs = runs_within(container, inner)
    storage = np.arange(container.numel)
    got = [storage[s : s + runs.length] for s in runs.starts()]
    packed = np.concatenate(got) if got else np.zeros(0, dtype=storage.dtype)
    want = np.asarray(storage.reshape(container.sizes)[inner.relative_to(container)]).ravel()
    assert np.array_equal(packed, want)
    assert len(list(runs.starts())) == runs.count
    if inner.numel == 0:
        return
    assert runs.count * runs.length == inner.numel
    lo, hi = runs.span
    assert lo == want.min() and hi == want.max() + 1


# --- even chunks ---------------------------------------------------------------


def test_even_chunks_examples():
    assert even_chunks(10, 3) == [(0, 4), (4, 4), (8, 2)]
    assert even_chunks(5, 4) == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert even_chunks(0, 3) == [(0, 0), (0, 0), (0, 0)]
    assert even_chunks(3, 1) == [(0, 3)]
    with pytest.raises(ValueError, match="parts must be positive"):
        even_chunks(4, 0)


@SETTINGS
@given(st.integers(0, 60), st.integers(1, 12))
def test_even_chunks_matches_torch_chunk(n, parts):
    got = even_chunks(n, parts)
    assert len(got) == parts
    pos = 0
    for lo, size in got:
        assert lo == pos and size >= 0
        pos += size
    assert pos == n
    want = [c.numel() for c in torch.chunk(torch.arange(n), parts)] if n else []
    assert [s for _, s in got if s] == want
