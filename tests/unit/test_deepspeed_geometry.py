"""DeepSpeed ZeRO partition arithmetic (pure: no processes, no DeepSpeed).

The pieces are checked against flat buffers built and split the way
DeepSpeed builds and splits them (ZeRO-1/2: one padded flat group, cut into
``world`` equal slices; ZeRO-3: every parameter padded and cut on its own).
The multi-process tests check the same arithmetic against live engines.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.adapters.deepspeed import (
    zero3_holders,
    zero3_pieces,
    zero12_holders,
    zero12_partitions,
    zero12_pieces,
)
from shardpoint.adapters.fsdp1 import Piece1D
from shardpoint.errors import ConversionError
from shardpoint.convert.deepspeed_native import (
    DEEPSPEED_TRUST_HELP,
    deepspeed_files,
    import_deepspeed,
)


def test_zero12_examples():
    assert zero12_partitions(12, 2) == [(0, 6), (6, 6)]
    assert zero12_partitions(10, 3) == [(0, 4), (4, 3), (7, 3)]
    # 7 + 1 alignment padding + 3, padded to 12: the second parameter starts at 8
    assert zero12_pieces([7, 3], [0, 8], 12, 2, 0) == [Piece1D(0, 0, 0, 6)]
    assert zero12_pieces([7, 3], [0, 8], 12, 2, 1) == [Piece1D(0, 0, 6, 7), Piece1D(1, 2, 0, 3)]
    assert zero12_holders([7, 3], [0, 8], 12, 2) == [[0, 1], [1]]
    # trailing padding: the last rank may hold nothing
    assert zero12_pieces([3], [0], 8, 4, 3) == []
    assert zero12_holders([3], [0], 8, 4) == [[0, 1]]


def test_zero3_examples():
    # 5 elements over 2 ranks: slices of 3, the second padded by 1
    assert zero3_pieces([5, 4], 2, 0) == [Piece1D(0, 0, 0, 3), Piece1D(1, 3, 0, 2)]
    assert zero3_pieces([5, 4], 2, 1) == [Piece1D(0, 0, 3, 5), Piece1D(1, 3, 2, 4)]
    # more ranks than elements: trailing ranks hold empty (padded) slices
    assert zero3_pieces([2], 4, 1) == [Piece1D(0, 0, 1, 2)]
    assert zero3_pieces([2], 4, 3) == []
    assert zero3_holders([2, 0, 9], 4) == [[0, 1], [], [0, 1, 2]]  # 9 = 3 + 3 + 3 + 0


def test_bad_input():
    with pytest.raises(ValueError):
        zero12_pieces([4], [0], 4, 2, 2)
    with pytest.raises(ValueError):
        zero12_pieces([4, 4], [0, 2], 8, 2, 0)  # overlapping parameters
    with pytest.raises(ValueError):
        zero12_pieces([4], [2], 4, 2, 0)  # past the end of the group
    with pytest.raises(ValueError):
        zero3_pieces([3], 2, -1)
    with pytest.raises(ValueError):
        zero12_partitions(4, 0)


shapes_st = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=6)


def _params(shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(tuple(s), generator=g) for s in shapes]


def _check_cover(numels, found, holders):
    for i, n in enumerate(numels):
        spans = sorted(found[i])
        pos = 0
        for a, b, _ in spans:
            assert a == pos
            pos = b
        assert pos == n
        assert sorted({r for _, _, r in spans}) == holders[i]


@settings(max_examples=200, deadline=None)
@given(shapes_st, st.integers(1, 7), st.data())
def test_zero12_pieces_match_a_padded_flat_group(shapes, world, data):
    """Build the group as ZeRO-1/2 does (alignment padding after parameters, padded to 2 * world)."""
    params = _params(shapes)
    pads = [data.draw(st.integers(0, 3)) for _ in params]
    pads[-1] = 0
    parts, offsets, pos = [], [], 0
    for t, k in zip(params, pads):
        offsets.append(pos)
        parts += [t.reshape(-1), torch.full((k,), float("nan"))]
        pos += t.numel() + k
    align = 2 * world
    total = -(-pos // align) * align
    flat = torch.cat(parts + [torch.full((total - pos,), float("nan"))])
    numels = [t.numel() for t in params]
    holders = zero12_holders(numels, offsets, total, world)
    found = [[] for _ in params]
    for r, (lo, size) in enumerate(zero12_partitions(total, world)):
        local = flat[lo : lo + size]
        for p in zero12_pieces(numels, offsets, total, world, r):
            want = params[p.index].reshape(-1)[p.start : p.stop]
            assert torch.equal(local[p.offset : p.offset + p.numel], want)
            found[p.index].append((p.start, p.stop, r))
    _check_cover(numels, found, holders)


@settings(max_examples=200, deadline=None)
@given(shapes_st, st.integers(1, 7))
def test_zero3_pieces_match_per_parameter_partitions(shapes, world):
    """Split each parameter as ZeRO-3's _partition_param does, concatenate a rank's slices."""
    params = _params(shapes)
    numels = [t.numel() for t in params]
    holders = zero3_holders(numels, world)
    found = [[] for _ in params]
    for r in range(world):
        slices = []
        for t in params:
            ps = -(-t.numel() // world)
            padded = torch.cat([t.reshape(-1), torch.full((ps * world - t.numel(),), float("nan"))])
            slices.append(padded[r * ps : (r + 1) * ps])
        local = torch.cat(slices) if slices else torch.empty(0)
        for p in zero3_pieces(numels, world, r):
            want = params[p.index].reshape(-1)[p.start : p.stop]
            assert torch.equal(local[p.offset : p.offset + p.numel], want)
            assert math.prod(params[p.index].shape) >= p.stop
            found[p.index].append((p.start, p.stop, r))
    _check_cover(numels, found, holders)


def test_native_import_requires_trust_and_a_zero_folder(tmp_path):
    with pytest.raises(ConversionError, match="allow_pickle"):
        import_deepspeed(str(tmp_path), str(tmp_path / "out"))
    assert "weights_only" in DEEPSPEED_TRUST_HELP
    with pytest.raises(ConversionError, match="no such"):
        deepspeed_files(str(tmp_path / "missing"))
    (tmp_path / "latest").write_text("global_step7")
    (tmp_path / "global_step7").mkdir()
    with pytest.raises(ConversionError, match="optim_states"):
        deepspeed_files(str(tmp_path))
    step = tmp_path / "global_step7"
    for r in (0, 2):  # rank 1's file is missing
        (step / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ConversionError, match="missing"):
        deepspeed_files(str(tmp_path))
    (step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    (step / "mp_rank_00_model_states.pt").write_bytes(b"")
    folder, optim, models = deepspeed_files(str(tmp_path))
    assert folder == str(step) and [p.rsplit("/", 1)[1][:14] for p in optim] == ["zero_pp_rank_0", "zero_pp_rank_1", "zero_pp_rank_2"]
    assert models == [str(step / "mp_rank_00_model_states.pt")]
    (step / "zero_pp_rank_0_mp_rank_01_optim_states.pt").write_bytes(b"")
    with pytest.raises(ConversionError, match="model-parallel"):
        deepspeed_files(str(tmp_path))
