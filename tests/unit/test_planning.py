"""Resharding simulated with numpy and no processes: save layout -> plan -> load layout.

A *layout* is a list of chunks ``(box, flat)`` tiling a global tensor: ``flat``
is ``None`` for a whole box, or ``(a, b)`` for elements ``[a, b)`` of the box's
row-major order (an FSDP1/ZeRO flat slice). Each chunk's *storage* is a 1-D
array of its elements, exactly as the engine writes them. Reads are planned
with :class:`SourceIndex`/:func:`plan_reads` and executed with
:func:`runs_within` the way the engine does it, so a wrong plan shows up as a
wrong element or one covered twice.
"""

from __future__ import annotations

import math
import random
from itertools import product

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.geometry import Box, even_chunks, runs_within
from shardpoint.planning import ReplicaItem, SourceIndex, assign_writers, coverage_gaps, plan_reads

Chunk = tuple  # (Box, (a, b) | None)

SETTINGS = settings(max_examples=150, deadline=None)


# --- the simulated engine ---------------------------------------------------


def chunk_storage(global_arr: np.ndarray, box: Box, flat) -> np.ndarray:
    data = np.asarray(global_arr[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]).ravel()
    return data if flat is None else data[flat[0] : flat[1]]


def fill_target(index: SourceIndex, sources: list[np.ndarray], box: Box, flat, dtype):
    """Return (storage, hits): the target's 1-D storage and a per-element write count."""
    n = box.numel if flat is None else flat[1] - flat[0]
    out = np.full(n, -1, dtype=dtype)
    hits = np.zeros(n, dtype=np.int64)
    ops = plan_reads(index, box, flat)
    for op in ops:
        assert op.src.box.contains(op.region) and op.dst.box.contains(op.region)
        # source: read the region as runs of the piece's row-major storage
        src_store = sources[op.chunk]
        r = runs_within(op.src.box, op.region)
        parts = [src_store[op.src.start + s : op.src.start + s + r.length] for s in r.starts()]
        values = np.concatenate(parts).reshape(op.region.sizes)
        # destination: the region inside the target piece
        seg = slice(op.dst.start, op.dst.start + op.dst.box.numel)
        dst_view = out[seg].reshape(op.dst.box.sizes)
        hit_view = hits[seg].reshape(op.dst.box.sizes)
        sl = op.region.relative_to(op.dst.box)
        dst_view[sl] = values
        hit_view[sl] += 1
    return out, hits, ops


def reshard(global_arr: np.ndarray, src_layout: list[Chunk], dst_layout: list[Chunk]) -> None:
    """Save under ``src_layout``, load under ``dst_layout``, assert exact reproduction."""
    sources = [chunk_storage(global_arr, b, f) for b, f in src_layout]
    index = SourceIndex(src_layout)
    for box, flat in dst_layout:
        got, hits, ops = fill_target(index, sources, box, flat, global_arr.dtype)
        want = chunk_storage(global_arr, box, flat)
        assert coverage_gaps(ops, box, flat) == 0
        assert np.array_equal(hits, np.ones_like(hits)), f"target {box} {flat}: hits {hits}"
        assert np.array_equal(got, want), f"target {box} {flat}"


# --- layouts -------------------------------------------------------------------


def grid_layout(shape, cuts_per_dim) -> list[Chunk]:
    """Boxes of the grid given by sorted cut positions per dim."""
    edges = [[0, *c, n] for c, n in zip(cuts_per_dim, shape)]
    out = []
    for idx in product(*[range(len(e) - 1) for e in edges]):
        offs = tuple(edges[d][i] for d, i in enumerate(idx))
        sizes = tuple(edges[d][i + 1] - edges[d][i] for d, i in enumerate(idx))
        out.append((Box(offs, sizes), None))
    return out


def flatten_some(layout, draw_cuts) -> list[Chunk]:
    """Replace boxes by several flat ranges of their row-major order where asked."""
    out = []
    for box, _ in layout:
        cuts = draw_cuts(box)
        if cuts is None:
            out.append((box, None))
            continue
        bounds = [0, *cuts, box.numel]
        out.extend((box, (a, b)) for a, b in zip(bounds, bounds[1:]))
    return out


@st.composite
def layouts(draw, shape):
    cuts = [sorted(set(draw(st.lists(st.integers(0, n), max_size=3)))) for n in shape]
    layout = grid_layout(shape, cuts)

    def draw_cuts(box):
        if not draw(st.booleans()):
            return None
        return sorted(draw(st.lists(st.integers(0, box.numel), max_size=3)))

    return flatten_some(layout, draw_cuts)


@st.composite
def reshard_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    return shape, draw(layouts(shape)), draw(layouts(shape))


@SETTINGS
@given(reshard_cases())
def test_reshard_property(case):
    shape, src, dst = case
    g = np.arange(math.prod(shape), dtype=np.int64).reshape(shape) * 7 + 3
    # sanity of the generator: both layouts tile the tensor
    assert sum(b.numel if f is None else f[1] - f[0] for b, f in src) == g.size
    assert sum(b.numel if f is None else f[1] - f[0] for b, f in dst) == g.size
    reshard(g, src, dst)


# --- explicit cases ---------------------------------------------------------------


def dim0_layout(shape, parts) -> list[Chunk]:
    rest = tuple(shape[1:])
    return [
        (Box((lo,) + (0,) * len(rest), (size,) + rest), None)
        for lo, size in even_chunks(shape[0], parts)
        if size
    ]


def test_eight_ranks_to_three():
    g = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    src = dim0_layout(g.shape, 8)  # 2,2,2,2,2 and three empty ranks
    assert len(src) == 5
    dst = dim0_layout(g.shape, 3)  # 4,4,2
    assert [b.sizes[0] for b, _ in dst] == [4, 4, 2]
    reshard(g, src, dst)
    # rank 1 of 3 needs rows [4, 8): two saved chunks, nothing else
    index = SourceIndex(src)
    ops = plan_reads(index, dst[1][0])
    assert sorted(op.chunk for op in ops) == [2, 3]


def test_four_ranks_to_one():
    g = np.arange(36, dtype=np.int32).reshape(6, 6)
    src = dim0_layout(g.shape, 4)
    reshard(g, src, [(Box.full(g.shape), None)])
    ops = plan_reads(SourceIndex(src), Box.full(g.shape))
    assert len(ops) == len(src) == 3  # ceil(6/4) = 2 rows each: 2,2,2 and one empty rank


def test_2x2_grid_to_rows():
    g = np.arange(8 * 6, dtype=np.float64).reshape(8, 6)
    src = grid_layout(g.shape, [[4], [3]])
    assert len(src) == 4
    reshard(g, src, dim0_layout(g.shape, 3))
    # a row block spanning the dim-0 cut touches all four grid chunks
    ops = plan_reads(SourceIndex(src), Box((2, 0), (4, 6)))
    assert sorted(op.chunk for op in ops) == [0, 1, 2, 3]


def test_0d_tensor():
    g = np.array(42.5)
    reshard(g, [(Box((), ()), None)], [(Box((), ()), None)])
    reshard(g, [(Box((), ()), (0, 1))], [(Box((), ()), None)])


def test_fsdp1_flat_buffer_to_boxes():
    """Several tensors laid end to end in one flat buffer, cut at arbitrary positions."""
    rng = np.random.default_rng(1)
    shapes = {"a": (5, 3), "b": (7,), "c": (2, 3, 4), "d": (1, 1)}
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    total = sum(t.size for t in tensors.values())
    ranks = 5
    cuts = sorted(rng.choice(np.arange(1, total), ranks - 1, replace=False).tolist())
    bounds = [0, *cuts, total]
    # each rank's flat slice [r0, r1) of the buffer intersects tensor k's span
    pos = 0
    for k, t in tensors.items():
        box = Box.full(t.shape)
        lo, hi = pos, pos + t.size
        src = []
        for r0, r1 in zip(bounds, bounds[1:]):
            a, b = max(r0, lo), min(r1, hi)
            if a < b:
                src.append((box, (a - lo, b - lo)))
        pos = hi
        assert sum(f[1] - f[0] for _, f in src) == t.size
        # load as whole tensor, as dim-0 shards, and as a different flat split
        reshard(t, src, [(box, None)])
        reshard(t, src, dim0_layout(t.shape, 2))
        n = t.size
        reshard(t, src, [(box, (0, n // 3)), (box, (n // 3, n))])


def test_incomplete_and_overlapping_sources_detected():
    box = Box.full((4, 4))
    half = [(Box((0, 0), (2, 4)), None)]
    ops = plan_reads(SourceIndex(half), box)
    assert coverage_gaps(ops, box) == 8
    twice = [(Box((0, 0), (4, 4)), None), (Box((1, 0), (1, 4)), None)]
    ops = plan_reads(SourceIndex(twice), box)
    assert coverage_gaps(ops, box) == -4


def test_source_index_skips_far_pieces():
    # 100 row chunks; a query of one row looks at one piece, not all of them
    src = [(Box((i, 0), (1, 8)), None) for i in range(100)]
    index = SourceIndex(src)
    seen = list(index.overlapping(Box((57, 0), (1, 8))))
    assert [ci for ci, _ in seen] == [57]


# --- writer assignment ---------------------------------------------------------------


def test_assign_writers_example():
    got = assign_writers([ReplicaItem("a", 2, 10), ReplicaItem("b", 2, 10)])
    assert got == {"a": 0, "b": 1}
    got = assign_writers([ReplicaItem("big", 3, 100), ReplicaItem("s1", 3, 40), ReplicaItem("s2", 3, 40),
                          ReplicaItem("s3", 3, 30), ReplicaItem("solo", 1, 5)])
    assert got == {"big": 0, "s1": 1, "s2": 2, "s3": 1, "solo": 0}
    assert assign_writers([]) == {}


@st.composite
def replica_items(draw, same_count=False):
    n = draw(st.integers(0, 25))
    names = draw(st.lists(st.text("abcxyz._", min_size=1, max_size=6), min_size=n, max_size=n, unique=True))
    count = draw(st.integers(1, 6))
    return [
        ReplicaItem(nm, count if same_count else draw(st.integers(1, 6)), float(draw(st.integers(0, 1000))))
        for nm in names
    ]


def _assign_by_scan(items):
    """The definition: largest first, each onto its least-loaded copy index (lowest on ties)."""
    ordered = sorted(items, key=lambda it: (-it.cost, it.fqn))
    load = [0.0] * max((it.count for it in ordered), default=1)
    out = {}
    for it in ordered:
        if it.count <= 1:
            out[it.fqn] = 0
            continue
        best = min(range(it.count), key=lambda i: (load[i], i))
        load[best] += it.cost
        out[it.fqn] = best
    return out


@SETTINGS
@given(replica_items())
def test_assign_writers_matches_the_linear_scan(items):
    assert assign_writers(items) == _assign_by_scan(items)


def test_assign_writers_with_many_copies():
    items = [ReplicaItem(f"s{i}", 1024, 4.0) for i in range(723)] + [ReplicaItem(f"w{i}", 8, 1e6 + i) for i in range(2000)]
    got = assign_writers(items)
    assert got == _assign_by_scan(items)
    # 723 equal scalars over 1,024 copies after the big items filled copies 0..7: all distinct.
    assert len({got[f"s{i}"] for i in range(723)}) == 723


@SETTINGS
@given(replica_items(), st.randoms(use_true_random=False))
def test_assign_writers_valid_and_order_independent(items, rnd):
    got = assign_writers(items)
    assert set(got) == {it.fqn for it in items}
    for it in items:
        assert 0 <= got[it.fqn] < it.count
    shuffled = list(items)
    rnd.shuffle(shuffled)
    assert assign_writers(shuffled) == got
    assert assign_writers(iter(shuffled)) == got  # any iterable


@SETTINGS
@given(replica_items(same_count=True))
def test_assign_writers_balanced(items):
    got = assign_writers(items)
    if not items:
        return
    count = items[0].count
    load = [0.0] * count
    for it in items:
        load[got[it.fqn]] += it.cost
    largest = max(it.cost for it in items)
    assert max(load) <= min(load) + largest


def test_assign_writers_spreads_many_equal_items():
    items = [ReplicaItem(f"t{i:03d}", 4, 1.0) for i in range(100)]
    got = assign_writers(random.Random(3).sample(items, len(items)))
    assert sorted(list(got.values()).count(k) for k in range(4)) == [25, 25, 25, 25]
