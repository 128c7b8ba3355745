"""Internal: geometry of shards: boxes, flat ranges inside boxes, and their intersections.

A saved chunk is a *box* (global offsets and sizes) of a logical tensor. An
irregular shard, such as an FSDP1 or ZeRO flat-parameter slice, is a *flat
range* inside a box's row-major order. Both reduce to a list of *pieces*: a
box whose elements are stored contiguously, row-major, starting at a known
element position of the stored data. Resharding is then box intersection.

Everything here is pure integer arithmetic: no torch, no I/O.

Example::

    >>> a = Box((0, 0), (4, 6)); b = Box((2, 3), (4, 6))
    >>> a.intersect(b)
    Box(offsets=(2, 3), sizes=(2, 3))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = [
    "Box",
    "Piece",
    "Runs",
    "row_major_strides",
    "pieces_of",
    "flat_range_pieces",
    "runs_within",
    "even_chunks",
]


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``sizes``."""
    strides = [1] * len(sizes)
    acc = 1
    for d in range(len(sizes) - 1, -1, -1):
        strides[d] = acc
        acc *= int(sizes[d])
    return tuple(strides)


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a global tensor: ``offsets`` and ``sizes`` per dim.

    A 0-d tensor is the box with empty offsets and sizes (one element).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box rank mismatch: offsets {self.offsets} vs sizes {self.sizes}")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ValueError(f"negative box {self.offsets}/{self.sizes}")

    @staticmethod
    def full(shape: Sequence[int]) -> "Box":
        """The box covering a whole tensor of ``shape``."""
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: "Box") -> "Box | None":
        """The common box, or ``None`` when the two share no element."""
        if self.ndim != other.ndim:
            raise ValueError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        offs, sizes = [], []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(o1, o2), min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        if self.ndim == 0 and (self.numel == 0 or other.numel == 0):
            return None
        return Box(tuple(offs), tuple(sizes))

    def contains(self, other: "Box") -> bool:
        return all(
            o1 <= o2 and o2 + s2 <= o1 + s1
            for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def within(self, shape: Sequence[int]) -> bool:
        """True when the box lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(
            o + s <= int(n) for o, s, n in zip(self.offsets, self.sizes, shape)
        )

    def relative_to(self, outer: "Box") -> tuple[slice, ...]:
        """Slices that select this box from a tensor holding ``outer``."""
        return tuple(
            slice(o - oo, o - oo + s) for o, s, oo in zip(self.offsets, self.sizes, outer.offsets)
        )


@dataclass(frozen=True)
class Piece:
    """A box stored contiguously, row-major, from element ``start`` of its data."""

    box: Box
    start: int


def flat_range_pieces(box: Box, start: int, stop: int) -> list[Piece]:
    """Split the flat range ``[start, stop)`` of ``box``'s row-major order into pieces.

    Each piece is a sub-box whose elements are contiguous in that order; the
    piece's ``start`` is its position inside the stored slice (relative to
    ``start``). At most ``2 * ndim - 1`` pieces are returned.
    """
    n = box.numel
    if not (0 <= start <= stop <= n):
        raise ValueError(f"flat range [{start}, {stop}) outside box of {n} elements")
    if start == stop:
        return []
    if box.ndim == 0:
        return [Piece(box, 0)]
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    _split(tuple(box.sizes), start, stop, (), 0, out)
    return [
        Piece(Box(tuple(o + bo for o, bo in zip(offs, box.offsets)), sizes), pos - start)
        for offs, sizes, pos in out
    ]


def _split(sizes, start, stop, prefix, flat_base, out) -> None:
    # Pieces of [start, stop) in a block of ``sizes`` whose leading coordinates are
    # ``prefix`` and whose first element sits at flat position ``flat_base``.
    # Emits (offsets, sizes, absolute flat position) with offsets relative to the box.
    k = len(prefix)
    if len(sizes) == 1:
        out.append((prefix + (start,), (1,) * k + (stop - start,), flat_base + start))
        return
    inner = math.prod(sizes[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        _split(sizes[1:], c0, c1, prefix + (r0,), flat_base + r0 * inner, out)
        return
    if c0:
        _split(sizes[1:], c0, inner, prefix + (r0,), flat_base + r0 * inner, out)
        r0 += 1
    if r1 > r0:
        out.append(
            (prefix + (r0,) + (0,) * (len(sizes) - 1), (1,) * k + (r1 - r0,) + tuple(sizes[1:]), flat_base + r0 * inner)
        )
    if c1:
        _split(sizes[1:], 0, c1, prefix + (r1,), flat_base + r1 * inner, out)


def pieces_of(box: Box, flat: tuple[int, int] | None) -> list[Piece]:
    """The pieces of a shard: the box itself, or its flat range split into boxes."""
    if flat is None:
        return [Piece(box, 0)] if box.numel > 0 or box.ndim == 0 else []
    return flat_range_pieces(box, flat[0], flat[1])


@dataclass(frozen=True)
class Runs:
    """Contiguous runs of elements that an inner box occupies inside a stored box.

    Run ``k`` (over the grid ``counts``) starts at element
    ``base + sum(i_d * strides[d])`` of the container's row-major storage and
    is ``length`` elements long. Runs are listed in the inner box's row-major
    order, so reading them in order packs the inner box contiguously.
    """

    base: int
    length: int
    counts: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.counts)

    @property
    def span(self) -> tuple[int, int]:
        """First and one-past-last element touched, relative to the container."""
        last = self.base + sum((c - 1) * s for c, s in zip(self.counts, self.strides))
        return self.base, last + self.length

    def starts(self) -> Iterator[int]:
        """Element offsets of every run, in order (none when a count is zero)."""
        if any(c == 0 for c in self.counts):
            return
        if not self.counts:
            yield self.base
            return
        idx = [0] * len(self.counts)
        while True:
            yield self.base + sum(i * s for i, s in zip(idx, self.strides))
            d = len(idx) - 1
            while d >= 0:
                idx[d] += 1
                if idx[d] < self.counts[d]:
                    break
                idx[d] = 0
                d -= 1
            if d < 0:
                return


def runs_within(container: Box, inner: Box) -> Runs:
    """Describe ``inner`` (which must lie inside ``container``) as runs in its storage."""
    if not container.contains(inner):
        raise ValueError(f"{inner} is not inside {container}")
    c, s = container.sizes, inner.sizes
    st = row_major_strides(c)
    rel = [o - co for o, co in zip(inner.offsets, container.offsets)]
    base = sum(r * t for r, t in zip(rel, st))
    j = len(c) - 1
    while j >= 0 and s[j] == c[j]:
        j -= 1
    if j < 0:
        return Runs(base, inner.numel, (), ())
    length = s[j] * st[j]
    counts, strides = [], []
    for d in range(j):
        if s[d] != 1:
            counts.append(s[d])
            strides.append(st[d])
    return Runs(base, length, tuple(counts), tuple(strides))


def even_chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk``-style split of ``n`` into at most ``parts`` (start, size) ranges.

    Matches how FSDP2 and DTensor ``Shard`` split a dim: ceil-sized chunks,
    with trailing ranks possibly empty.
    """
    if parts <= 0:
        raise ValueError("parts must be positive")
    size = -(-n // parts) if n else 0
    out = []
    for i in range(parts):
        lo = min(i * size, n)
        hi = min(lo + size, n)
        out.append((lo, hi - lo))
    return out
