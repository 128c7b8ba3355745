"""The pure ZeRO partition arithmetic: which elements of which parameter each rank's flat slice holds.

No torch, no processes, no DeepSpeed: numbers in, pieces out, so the
adapter, the converter of native DeepSpeed checkpoints and the tests share
one definition of ZeRO-1/2 and ZeRO-3 partitioning.
"""

from __future__ import annotations

from typing import Sequence

from ..fsdp1 import Piece1D

__all__ = [
    "zero12_partitions",
    "zero12_pieces",
    "zero12_holders",
    "zero3_partition_size",
    "zero3_pieces",
    "zero3_holders",
]


def zero12_partitions(total: int, world: int) -> list[tuple[int, int]]:
    """(start, size) of each rank's slice of a ZeRO-1/2 flat group of ``total`` elements.

    Mirrors ``DeepSpeedZeroOptimizer.get_data_parallel_partitions``: ``total
    // world`` elements each, the first ``total % world`` ranks one more (the
    group is padded to a multiple of ``2 * world``, so in practice all equal).

    Example::

        >>> zero12_partitions(10, 3)
        [(0, 4), (4, 3), (7, 3)]
    """
    if world <= 0:
        raise ValueError("world must be positive")
    base, rem = divmod(int(total), world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < rem else 0)
        out.append((start, size))
        start += size
    return out


def _check_spans(numels: Sequence[int], offsets: Sequence[int], total: int) -> None:
    if len(numels) != len(offsets):
        raise ValueError("numels and offsets differ in length")
    end = 0
    for n, off in zip(numels, offsets):
        if n < 0 or off < end:
            raise ValueError(f"parameters overlap or are out of order: numels {list(numels)}, offsets {list(offsets)}")
        end = off + n
    if end > total:
        raise ValueError(f"parameters end at {end}, past the group's {total} elements")


def zero12_pieces(numels: Sequence[int], offsets: Sequence[int], total: int, world: int, rank: int) -> list[Piece1D]:
    """The pieces of a ZeRO-1/2 group's parameters in ``rank``'s slice.

    Parameter ``i`` of ``numels[i]`` elements sits at ``offsets[i]`` of the
    flat group of ``total`` elements (padding between and after them). A
    piece's ``offset`` is its position in the rank's fp32 partition.

    Example::

        >>> zero12_pieces([6, 5], [0, 6], 12, 2, 1)
        [Piece1D(index=1, offset=0, start=0, stop=5)]
        >>> zero12_pieces([7, 3], [0, 8], 12, 2, 1)
        [Piece1D(index=0, offset=0, start=6, stop=7), Piece1D(index=1, offset=2, start=0, stop=3)]
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    _check_spans(numels, offsets, total)
    lo, size = zero12_partitions(total, world)[rank]
    hi = lo + size
    out = []
    for i, (n, off) in enumerate(zip(numels, offsets)):
        s, t = max(off, lo), min(off + n, hi)
        if s < t:
            out.append(Piece1D(i, s - lo, s - off, t - off))
    return out


def zero12_holders(numels: Sequence[int], offsets: Sequence[int], total: int, world: int) -> list[list[int]]:
    """For each parameter of a ZeRO-1/2 group, the ranks whose slice holds some of it."""
    _check_spans(numels, offsets, total)
    parts = zero12_partitions(total, world)
    return [
        [r for r, (lo, size) in enumerate(parts) if max(off, lo) < min(off + n, lo + size)]
        for n, off in zip(numels, offsets)
    ]


def zero3_partition_size(numel: int, world: int) -> int:
    """Elements of each rank's ZeRO-3 slice of a ``numel``-element parameter: ``ceil(numel / world)``.

    Example::

        zero3_partition_size(10, 4)  # 3
    """
    return -(-int(numel) // world) if numel else 0


def zero3_pieces(numels: Sequence[int], world: int, rank: int) -> list[Piece1D]:
    """The pieces of a ZeRO-3 sub-group's parameters in ``rank``'s fp32 partition.

    Each parameter is split on its own into ``ceil(numel / world)``-element
    slices (the last one padded); the rank's partition concatenates its
    padded slices, in sub-group order.

    Example::

        >>> zero3_pieces([5, 4], 2, 1)
        [Piece1D(index=0, offset=0, start=3, stop=5), Piece1D(index=1, offset=3, start=2, stop=4)]
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    out, pos = [], 0
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"negative numel {n}")
        ps = zero3_partition_size(n, world)
        s, t = rank * ps, min(rank * ps + ps, n)
        if s < t:
            out.append(Piece1D(i, pos, s, t))
        pos += ps
    return out


def zero3_holders(numels: Sequence[int], world: int) -> list[list[int]]:
    """For each ZeRO-3 parameter, the ranks whose slice holds some of it."""
    return [[r for r in range(world) if r * zero3_partition_size(n, world) < n] for n in numels]
