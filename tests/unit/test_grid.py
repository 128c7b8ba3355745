"""Grids: nested torch.chunk splits over a mesh, checked against torch's DTensor geometry."""

from __future__ import annotations

import itertools
import math
import pickle
import time

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardpoint.errors import FormatError
from shardpoint.geometry import Box
from shardpoint.adapters.tensors import describe_placements
from shardpoint.geometry.grid import DimPlacement, Grid, grid_of_placements
from shardpoint.runtime import torchcompat
from shardpoint.runtime.torchcompat import local_shape_and_offset


def _grid(mesh, ranks, placements, ndim):
    """The adapter's path: torch placements described as plain data, then the grid."""
    return grid_of_placements(mesh, ranks, describe_placements(placements), ndim)

SETTINGS = settings(max_examples=150, deadline=None)


# --- strategies -------------------------------------------------------------


@st.composite
def placed(draw):
    """(mesh shape, placements, tensor shape) using only placements the grid supports."""
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 3))
    kinds = [draw(st.sampled_from("RSXX")) for _ in mesh]  # Replicate, Shard, _StridedShard (twice as often)
    # Often aim every shard at one tensor dim: nested and strided splits need that.
    one_dim = draw(st.booleans())
    dims = [0 if one_dim else draw(st.integers(0, ndim - 1)) for _ in mesh]
    placements = []
    for m, (kind, d) in enumerate(zip(kinds, dims)):
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(d))
        else:  # the only split factor with a nested meaning: the later shards of d
            sf = math.prod(mesh[j] for j in range(m + 1, len(mesh)) if kinds[j] != "R" and dims[j] == d)
            placements.append(_StridedShard(d, split_factor=sf))
    # Up to 24: small enough to be smaller than the parts, large enough to be uneven in many ways.
    shape = tuple(draw(st.integers(0, 24)) for _ in range(ndim))
    return mesh, tuple(placements), shape


@st.composite
def grids(draw, max_mesh_dims=3, max_ndim=3):
    """A grid with each mesh dim splitting a random tensor dim (or none), in random order."""
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=max_mesh_dims)))
    ndim = draw(st.integers(0, max_ndim))
    splits: list[list[int]] = [[] for _ in range(ndim)]
    for m in draw(st.permutations(range(len(mesh)))):
        d = draw(st.integers(-1, ndim - 1))  # -1: a replicate dim
        if d >= 0:
            splits[d].append(m)
    ranks = draw(st.permutations(range(math.prod(mesh) + 3)))[: math.prod(mesh)]
    grid = Grid(mesh, tuple(ranks), tuple(tuple(s) for s in splits))
    shape = tuple(draw(st.integers(0, 11)) for _ in range(ndim))
    return grid, shape


@st.composite
def grid_and_query(draw):
    """A grid, a tensor shape, and a query box that may reach past the tensor."""
    grid, shape = draw(grids())
    offs, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, n + 1))  # may start past the end: then nothing overlaps
        offs.append(lo)
        sizes.append(draw(st.integers(0, n + 2 - lo)))
    return grid, shape, Box(tuple(offs), tuple(sizes))


# --- helpers ----------------------------------------------------------------


def _coords(mesh):
    return itertools.product(*(range(k) for k in mesh))


def _same(a: Box, b: Box) -> bool:
    # Zero-element boxes hold no data: their offsets are a convention, not a fact.
    return a == b or (a.numel == 0 and b.numel == 0)


def _torch_box(shape, mesh, coord, placements) -> Box:
    sizes, offs = local_shape_and_offset(shape, mesh, coord, placements)
    return Box(tuple(int(o) for o in offs), tuple(int(s) for s in sizes))


def _torch_rows(n, d, mesh, coord, placements) -> list[int] | None:
    """The global indices along dim ``d`` that torch's own splitting (``distribute_tensor``) puts at ``coord``."""
    idx = torch.arange(n)
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)) and p.dim == d:
            one_d = _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)
            try:
                idx = one_d._split_tensor(idx, mesh[m], with_padding=False)[0][coord[m]]
            except AssertionError:  # torch 2.6 splits only even strided dims: FSDP2's split is the only one
                return None
    return idx.tolist()


def _sharding(placements, d):
    return [(m, p) for m, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == d]


def _brute_shards(grid: Grid, shape, q: Box):
    out = set()
    for coord in _coords(grid.mesh_shape):
        if any(coord[m] for m in grid.replicate_dims):
            continue
        b = grid.box(shape, coord)
        if b.numel and b.intersect(q) is not None:
            out.add((coord, b))
    return out


# --- agreement with torch -------------------------------------------------------


@SETTINGS
@given(placed())
# 2-D FSDP2 + TP, even: the pattern _StridedShard exists for.
@example(((2, 2), (_StridedShard(0, split_factor=2), Shard(0)), (8, 4)))
# The same, uneven: torch's rows are not contiguous for some coordinates.
@example(((3, 2), (_StridedShard(0, split_factor=2), Shard(0)), (7, 3)))
# A disagreement a per-rank check cannot see at coordinate (0, 1, 0).
@example(((2, 2, 3), (_StridedShard(0, split_factor=6), Shard(0), Shard(0)), (14,)))
# Plain Shard on two tensor dims, and two mesh dims splitting one dim.
@example(((3, 2), (Shard(1), Shard(0)), (5, 7)))
@example(((3, 2), (Shard(0), Shard(0)), (5, 2)))
# HSDP-like: replicate outside, shard inside; and a tensor smaller than the parts.
@example(((2, 4), (Replicate(), Shard(0)), (3, 2)))
def test_box_matches_torch(case):
    mesh, placements, shape = case
    grid = _grid(mesh, range(math.prod(mesh)), placements, len(shape))
    assert grid is not None
    differs, visible = [], False
    for coord in _coords(mesh):
        mine, theirs = grid.box(shape, coord), _torch_box(shape, mesh, coord, placements)
        bad_dims = [
            d
            for d, n in enumerate(shape)
            if _torch_rows(n, d, mesh, coord, placements) not in (None, list(range(mine.offsets[d], mine.ends[d])))
        ]
        if not bad_dims or (mine.numel == 0 and theirs.numel == 0):
            # torch holds exactly the grid's rows: the boxes agree.
            assert _same(mine, theirs), (coord, mine, theirs)
            continue
        # torch's rows differ from the nested model. This happens only for an
        # uneven _StridedShard; torch then holds non-contiguous rows (FSDP2's
        # own local shards still follow the nested model).
        differs.append(coord)
        visible |= not _same(mine, theirs)
        for d in bad_dims:
            sharding = _sharding(placements, d)
            assert any(isinstance(p, _StridedShard) for _, p in sharding)
            assert shape[d] % math.prod(mesh[m] for m, _ in sharding) != 0
            if _same(mine, theirs):
                # Silent at this coordinate (same first offset and size, different rows):
                # seen only with two or more later mesh dims sharding d after a strided one.
                first = min(m for m, p in sharding if isinstance(p, _StridedShard))
                assert sum(1 for m, _ in sharding if m > first) >= 2
    if differs:
        # The adapter-visible signal: some coordinate's box differs from torch's. Not
        # necessarily the differing rank's own, so the adapter must agree across ranks.
        assert visible, (mesh, placements, shape, differs)


@pytest.mark.skipif(
    not torchcompat.torch_places_uneven_strided_shards(), reason="this torch cannot split an uneven strided dim itself"
)
def test_strided_disagreement_example():
    # Mesh (dp=3, tp=2), 7 rows, (_StridedShard(0, sf=2), Shard(0)). FSDP2 + TP chunks
    # rows by tp ([0, 4), [4, 7)), then by dp: tp 0 -> [0,2) [2,4) [4,4), tp 1 -> [4] [5] [6].
    # torch's strided split gives dp ranks [0, 1, 4], [2, 3, 5], [6], then chunks
    # each by tp: dp 2 holds [6] at tp 0 and nothing at tp 1. The grid follows FSDP2.
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    grid = _grid((3, 2), range(6), placements, 1)
    assert grid.splits == ((1, 0),)
    assert [grid.box((7,), (r, t)) for r in range(3) for t in range(2)] == [
        Box((0,), (2,)), Box((4,), (1,)),
        Box((2,), (2,)), Box((5,), (1,)),
        Box((4,), (0,)), Box((6,), (1,)),
    ]
    for r in range(2):
        for t in range(2):
            assert _torch_box((7,), (3, 2), (r, t), placements) == grid.box((7,), (r, t))
    assert _torch_box((7,), (3, 2), (2, 0), placements) == Box((6,), (1,))
    assert _torch_box((7,), (3, 2), (2, 1), placements).numel == 0


def test_empty_shard_offsets():
    # Empty pieces sit at the end of their parent interval (torch.chunk formula);
    # torch reports the global dim size instead.
    grid = Grid((2, 4), tuple(range(8)), ((0, 1),))
    assert grid.box((3,), (0, 3)) == Box((2,), (0,))  # parent [0, 2): pieces [0,1), [1,2), [2,2), [2,2)
    assert grid.box((3,), (1, 2)) == Box((3,), (0,))
    assert grid.box((0,), (1, 1)) == Box((0,), (0,))
    assert _torch_box((3,), (2, 4), (0, 3), (Shard(0), Shard(0))) == Box((3,), (0,))


# --- tiling and lookups ---------------------------------------------------------


@SETTINGS
@given(grids())
def test_shards_tile_the_tensor(case):
    grid, shape = case
    cover = np.zeros(shape, dtype=np.int64)
    for coord in _coords(grid.mesh_shape):
        if any(coord[m] for m in grid.replicate_dims):
            continue
        b = grid.box(shape, coord)
        assert b.within(shape)
        if b.numel:
            cover[tuple(slice(o, e) for o, e in zip(b.offsets, b.ends))] += 1
    assert (cover == 1).all()


@SETTINGS
@given(grid_and_query())
def test_shards_finds_exactly_the_overlaps(case):
    grid, shape, q = case
    got = list(grid.shards(shape, q))
    assert len(got) == len(set(got))
    assert set(got) == _brute_shards(grid, shape, q)


def test_shards_zero_d_and_full():
    grid = Grid((2, 3), tuple(range(6)), ())
    assert list(grid.shards((), Box((), ()))) == [((0, 0), Box((), ()))]
    assert grid.box((), (1, 2)) == Box((), ())
    g2 = Grid((2,), (5, 7), ((), (0,)))
    assert list(g2.shards((3, 4), Box.full((3, 4)))) == [((0,), Box((0, 0), (3, 2))), ((1,), Box((0, 2), (3, 2)))]
    assert list(g2.shards((3, 4), Box((0, 0), (0, 4)))) == []
    with pytest.raises(ValueError, match="query box"):
        list(g2.shards((3, 4), Box((0,), (1,))))
    with pytest.raises(ValueError, match="dims"):
        g2.box((3,), (0,))
    with pytest.raises(ValueError, match="outside mesh"):
        g2.box((3, 4), (2,))


# --- ranks, copies, writers ------------------------------------------------------


@SETTINGS
@given(grids())
def test_rank_round_trips(case):
    grid, _ = case
    assert grid.copies == math.prod(grid.mesh_shape[m] for m in grid.replicate_dims)
    for i, coord in enumerate(_coords(grid.mesh_shape)):
        rank = grid.ranks[i]
        assert grid.coord_of(rank) == coord
        assert grid.writer(coord, grid.replica_index(coord)) == rank
        holders = {grid.writer(coord, c) for c in range(grid.copies)}
        same_shard = {
            grid.ranks[j]
            for j, other in enumerate(_coords(grid.mesh_shape))
            if all(other[m] == coord[m] for m in range(len(coord)) if m not in grid.replicate_dims)
        }
        assert holders == same_shard
        assert 0 <= grid.replica_index(coord) < grid.copies
    assert grid.coord_of(max(grid.ranks) + 1) is None
    with pytest.raises(ValueError, match="copy"):
        grid.writer((0,) * len(grid.mesh_shape), grid.copies)
    # The rank index is a cache, not state: pickling drops it and equality ignores it.
    again = pickle.loads(pickle.dumps(grid))
    assert again == grid and again.__dict__["_coords"] is None
    assert again.coord_of(grid.ranks[-1]) == grid.coord_of(grid.ranks[-1])


def test_replicate_dims_and_writer_order():
    grid = Grid((2, 3, 2), tuple(range(100, 112)), ((1,),))
    assert grid.replicate_dims == (0, 2) and grid.copies == 4
    assert grid.replica_index((1, 2, 0)) == 2
    # copy 3 = replicate coords (1, 1), row-major over dims (0, 2)
    assert grid.writer((0, 2, 0), 3) == 100 + 1 * 6 + 2 * 2 + 1
    assert Grid((), (4,), ((),)).copies == 1


def test_grid_validation():
    with pytest.raises(ValueError, match="positive"):
        Grid((2, 0), (), ((0,),))
    with pytest.raises(ValueError, match="coordinates"):
        Grid((2, 2), (0, 1, 2), ((0,),))
    with pytest.raises(ValueError, match="distinct"):
        Grid((2,), (1, 1), ((0,),))
    with pytest.raises(ValueError, match="non-negative"):
        Grid((2,), (0, -1), ((0,),))
    with pytest.raises(ValueError, match="more than once"):
        Grid((2,), (0, 1), ((0,), (0,)))
    with pytest.raises(ValueError, match="mesh dim 1"):
        Grid((2,), (0, 1), ((1,),))
    # lists are normalised to tuples, so grids stay hashable and comparable
    g = Grid([2], [0, 1], [[0]])
    assert g == Grid((2,), (0, 1), ((0,),)) and hash(g) == hash(Grid((2,), (0, 1), ((0,),)))


# --- JSON -------------------------------------------------------------------


@SETTINGS
@given(grids())
def test_json_round_trip(case):
    grid, shape = case
    doc = grid.to_json()
    assert all(type(x) is int for x in doc["shape"] + doc["ranks"] + sum(doc["splits"], []))
    world = max(grid.ranks) + 1
    assert Grid.from_json(doc, world, len(shape), "t") == grid


GOOD = {"shape": [2, 2], "ranks": [0, 1, 2, 3], "splits": [[1, 0], []]}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ranks": [0, 1, 2, 4]}, "rank 4 outside"),
        ({"ranks": [0, 1, 2, -1]}, "rank -1 outside"),
        ({"ranks": [0, 1, 1, 2]}, "rank 1 appears twice"),
        ({"ranks": [0, 1, 2, True]}, "ranks must be ints"),
        ({"ranks": [0, 1, 2, 3.0]}, "ranks must be ints"),
        ({"shape": [2, True]}, "positive ints"),
        ({"shape": [2, 0], "ranks": []}, "positive ints"),
        ({"splits": [[1, False], []]}, "must list ints"),
        ({"splits": [[1, 0]]}, "1 splits for a 2-d tensor"),
        ({"splits": [[1, 0], [0]]}, "mesh dim 0 splits more than once"),
        ({"splits": [[2], []]}, "names mesh dim 2"),
        ({"ranks": [0, 1, 2]}, "needs 4 ranks, got 3"),
        ({"shape": (2, 2)}, "shape must be a list"),
        ({"ranks": "0123"}, "ranks must be a list"),
        ({"splits": {"0": [1]}}, "splits must be a list"),
        ({"splits": [(1, 0), []]}, "split of dim 0 must be a list"),
        ({"shape": [4, 4], "ranks": list(range(16))}, "more coordinates than the 4 ranks"),
    ],
)
def test_from_json_rejects(change, message):
    with pytest.raises(FormatError, match=rf"^model\.w: grid .*{message}"):
        Grid.from_json({**GOOD, **change}, 4, 2, "model.w")


def test_from_json_rejects_shapes_of_documents():
    with pytest.raises(FormatError, match="must be an object"):
        Grid.from_json([1, 2], 4, 2, "w")
    with pytest.raises(FormatError, match="keys"):
        Grid.from_json({**GOOD, "extra": 1}, 4, 2, "w")
    with pytest.raises(FormatError, match="keys"):
        Grid.from_json({"shape": [1], "ranks": [0]}, 4, 0, "w")


def test_from_json_huge_mesh_fails_fast():
    t0 = time.perf_counter()
    with pytest.raises(FormatError, match="more coordinates"):
        Grid.from_json({"shape": [10**9], "ranks": [], "splits": [[0]]}, 8, 1, "w")
    with pytest.raises(FormatError, match="more coordinates"):
        Grid.from_json({"shape": [10**400, 1], "ranks": [0], "splits": [[0], []]}, 8, 2, "w")
    with pytest.raises(FormatError, match="more coordinates"):
        Grid.from_json({"shape": [2] * 10_000, "ranks": [0], "splits": []}, 8, 0, "w")
    assert time.perf_counter() - t0 < 0.1


# --- placements ---------------------------------------------------------------


def test_grid_of_placements_splits():
    def splits(mesh, placements, ndim):
        g = _grid(mesh, range(math.prod(mesh)), placements, ndim)
        return g.splits, g.replicate_dims

    assert splits((4, 2), (_StridedShard(0, split_factor=2), Shard(0)), 2) == (((1, 0), ()), ())
    assert splits((4, 2), (Shard(0), Shard(0)), 1) == (((0, 1),), ())
    assert splits((4, 2), (Shard(1), Shard(0)), 2) == (((1,), (0,)), ())
    assert splits((4, 2), (Replicate(), Shard(-1)), 2) == (((), (1,)), (0,))
    assert splits((2, 3, 4), (Shard(0), _StridedShard(0, split_factor=4), Shard(0)), 1) == (((0, 2, 1),), ())
    assert splits(
        (2, 3, 4), (_StridedShard(0, split_factor=12), _StridedShard(0, split_factor=4), Shard(0)), 1
    ) == (((2, 1, 0),), ())
    # a strided shard with nothing after it splits like a plain one
    assert splits((3,), (_StridedShard(0, split_factor=1),), 1) == (((0,),), ())


def test_placements_are_described_as_plain_data():
    assert describe_placements((Shard(-1), Replicate(), _StridedShard(0, split_factor=4), Partial())) == (
        DimPlacement("shard", -1), DimPlacement("replicate"), DimPlacement("strided", 0, 4), DimPlacement("other"),
    )
    assert describe_placements((_OddShard(0),)) == (DimPlacement("other"),)


def test_the_grid_reads_plain_placements_without_torch():
    strided, shard = DimPlacement("strided", 0, 2), DimPlacement("shard", 0)
    assert grid_of_placements((4, 2), range(8), (strided, shard), 2).splits == ((1, 0), ())
    assert grid_of_placements((4, 2), range(8), (DimPlacement("strided", 0, None), shard), 1) is None  # symbolic
    assert grid_of_placements((2,), range(2), (DimPlacement("other"),), 1) is None
    with pytest.raises(ValueError, match="kind must be one of"):
        DimPlacement("partial")
    with pytest.raises(ValueError, match="needs tensor dim"):
        DimPlacement("shard")
    with pytest.raises(ValueError, match="takes no tensor dim"):
        DimPlacement("replicate", 0)


class _OddShard(Shard):
    """A Shard subclass the grid knows nothing about."""


def test_grid_of_placements_unsupported():
    assert _grid((2, 2), range(4), (Partial(), Shard(0)), 1) is None
    assert _grid((2, 2), range(4), (Replicate(), Partial("max")), 1) is None
    assert _grid((2, 2), range(4), (_StridedShard(0, split_factor=3), Shard(0)), 1) is None
    assert _grid((2, 2), range(4), (_StridedShard(0, split_factor=2), Shard(1)), 2) is None
    assert _grid((2,), range(2), (_StridedShard(0, split_factor=2),), 1) is None
    assert _grid((2,), range(2), (_OddShard(0),), 1) is None
    with pytest.raises(ValueError, match="placements"):
        _grid((2, 2), range(4), (Shard(0),), 1)
    with pytest.raises(ValueError, match="dim 2"):
        _grid((2,), range(2), (Shard(2),), 2)


# --- scale --------------------------------------------------------------------


def _best_of(fn, runs=5):
    best, out = math.inf, None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def test_scale_16k_ranks():
    shape = (8192, 8192)
    # Stage 5 of a (pp=16, dp=128, tp=8) job: a (dp, tp) mesh of 1,024 of the 16,384 ranks.
    stage = Grid((128, 8), tuple(range(5 * 1024, 6 * 1024)), ((1, 0), ()))
    assert stage.box(shape, (3, 1)) == Box((1024 + 3 * 8, 0), (8, 8192))
    # dim 0: tp splits into 1,024-row blocks, dp into 8-row shards.
    secs, got = _best_of(lambda: list(stage.shards(shape, Box((0, 0), (1024, 8192)))))
    assert len(got) == 128 and {c[1] for c, _ in got} == {0} and secs < 0.05
    secs, got = _best_of(lambda: list(stage.shards(shape, Box((1020, 100), (1024, 10)))))
    assert len(got) == 1 + 128 and secs < 0.05  # dp 127 of tp 0, then all of tp 1
    assert sum(b.intersect(Box((1020, 100), (1024, 10))).numel for _, b in got) == 1024 * 10

    # The whole 16,384-rank mesh, its first dim a replicate dim.
    world = Grid((16, 128, 8), tuple(range(16 * 128 * 8)), ((2, 1), ()))
    assert world.replicate_dims == (0,) and world.copies == 16
    secs, got = _best_of(lambda: list(world.shards(shape, Box((7 * 1024, 0), (1024, 8192)))))
    assert len(got) == 128 and all(c[0] == 0 and c[2] == 7 for c, _ in got) and secs < 0.05
    assert world.coord_of(16383) == (15, 127, 7)
    secs, _ = _best_of(lambda: [world.coord_of(r) for r in range(0, 16384, 16)], runs=3)
    assert secs < 0.05  # O(1) per lookup once the index exists
    assert world.writer((0, 3, 2), 9) == 9 * 1024 + 3 * 8 + 2
