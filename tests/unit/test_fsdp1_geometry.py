"""FSDP1 flat-parameter piece arithmetic (pure: no processes, no FSDP)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.adapters.fsdp1 import Piece1D, clean_name, piece_holders, shard_pieces
from shardpoint.geometry import Box, pieces_of


def test_example_with_alignment_padding():
    # params of 6 and 4 elements with 2 elements of alignment padding between them
    nums, pad = [6, 2, 4], [False, True, False]
    assert shard_pieces(nums, pad, 2, 0) == [Piece1D(0, 0, 0, 6)]
    assert shard_pieces(nums, pad, 2, 1) == [Piece1D(1, 2, 0, 4)]  # after 2 padding elements
    assert piece_holders(nums, pad, 2) == [[0], [1]]


def test_cuts_inside_parameters_and_trailing_padding():
    # 10 + 7 = 17 elements over 3 ranks: slices of 6, the last padded by 1
    nums, pad = [10, 7], [False, False]
    assert shard_pieces(nums, pad, 3, 0) == [Piece1D(0, 0, 0, 6)]
    assert shard_pieces(nums, pad, 3, 1) == [Piece1D(0, 0, 6, 10), Piece1D(1, 4, 0, 2)]
    assert shard_pieces(nums, pad, 3, 2) == [Piece1D(1, 0, 2, 7)]
    assert piece_holders(nums, pad, 3) == [[0, 1], [1, 2]]


def test_more_ranks_than_elements():
    nums, pad = [2, 1], [False, False]
    assert [shard_pieces(nums, pad, 5, r) for r in range(5)] == [
        [Piece1D(0, 0, 0, 1)], [Piece1D(0, 0, 1, 2)], [Piece1D(1, 0, 0, 1)], [], [],
    ]
    assert piece_holders(nums, pad, 5) == [[0, 1], [2]]


def test_empty_parameter_and_bad_input():
    assert shard_pieces([0, 4], [False, False], 2, 0) == [Piece1D(1, 0, 0, 2)]
    assert piece_holders([0, 4], [False, False], 2) == [[], [0, 1]]
    with pytest.raises(ValueError):
        shard_pieces([4], [False], 2, 2)
    with pytest.raises(ValueError):
        shard_pieces([4], [False, True], 2, 0)


def test_clean_name():
    assert clean_name("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn.wq.weight") == "layers.0.attn.wq.weight"
    assert clean_name("layers.1._checkpoint_wrapped_module.mlp.w1.bias") == "layers.1.mlp.w1.bias"
    assert clean_name("_orig_mod.tok.weight") == "tok.weight"
    assert clean_name("tok.weight") == "tok.weight"


entries = st.lists(st.tuples(st.integers(0, 40), st.booleans()), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(entries, st.integers(1, 9))
def test_pieces_partition_every_parameter_once(spec, world):
    nums = [n for n, _ in spec]
    pad = [p for _, p in spec]
    real = [n for n, p in spec if not p]
    total = sum(nums)
    size = -(-total // world) if total else 0
    covered = [[] for _ in real]
    holders = piece_holders(nums, pad, world)
    for r in range(world):
        for p in shard_pieces(nums, pad, world, r):
            assert 0 <= p.start < p.stop <= real[p.index]
            assert 0 <= p.offset and p.offset + p.numel <= size  # inside the padded slice
            assert r in holders[p.index]
            covered[p.index].append((p.start, p.stop, r))
    for i, n in enumerate(real):
        spans = sorted(covered[i])
        assert sum(b - a for a, b, _ in spans) == n
        pos = 0
        for a, b, _ in spans:
            assert a == pos
            pos = b
        assert sorted({r for _, _, r in spans}) == holders[i]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=5), st.integers(1, 6), st.data())
def test_pieces_match_torch_chunk_of_the_flat_parameter(shapes, world, data):
    """The slices FSDP1 makes with torch.chunk, cut back into parameters, give the same pieces."""
    shapes = [tuple(s) for s in shapes]
    pads = [data.draw(st.integers(0, 3)) for _ in shapes]
    nums, pad, params = [], [], []
    g = torch.Generator().manual_seed(0)
    for shape, k in zip(shapes, pads):
        t = torch.randn(shape, generator=g)
        params.append(t)
        nums.append(t.numel())
        pad.append(False)
        if k:
            nums.append(k)
            pad.append(True)
    flat = torch.cat([
        t.reshape(-1) if not p else torch.full((n,), float("nan"))
        for t, p, n in zip(_interleave(params, pad), pad, nums)
    ])
    chunks = list(flat.chunk(world)) if flat.numel() else []
    size = chunks[0].numel() if chunks else 0
    for r in range(world):
        local = chunks[r] if r < len(chunks) else flat.new_empty(0)
        local = torch.cat([local, flat.new_zeros(size - local.numel())])
        for p in shard_pieces(nums, pad, world, r):
            want = params[p.index].reshape(-1)[p.start : p.stop]
            assert torch.equal(local[p.offset : p.offset + p.numel], want)
            # The flat range resolves to boxes of the parameter that hold exactly those elements.
            shape = params[p.index].shape
            got = torch.cat([params[p.index][b.box.relative_to(Box.full(shape))].reshape(-1) for b in pieces_of(Box.full(shape), (p.start, p.stop))]) if shape else params[p.index].reshape(-1)
            assert torch.equal(got, want)
            assert math.prod(shape) >= p.stop


def _interleave(params, pad):
    it = iter(params)
    return [None if p else next(it) for p in pad]
