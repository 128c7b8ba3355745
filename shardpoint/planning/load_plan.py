"""Which saved bytes each target shard needs: intersection of pieces, no I/O.

Saved chunks and targets are both reduced to pieces (boxes stored row-major
from a known element). Every overlap of a saved piece with a target piece is a
:class:`ReadOp`; the engine turns its region into byte runs of the data file.
Saved chunks of one tensor never overlap, so the ops for a target cover it
exactly once when the checkpoint is complete; :func:`coverage_gaps` checks it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from ..geometry import Box, Piece, pieces_of

__all__ = ["ReadOp", "SourceIndex", "plan_reads", "coverage_gaps"]


@dataclass(frozen=True)
class ReadOp:
    """Copy ``region`` from saved chunk ``chunk`` (piece ``src``) into target piece ``dst``."""

    chunk: int
    src: Piece
    dst: Piece
    region: Box


class SourceIndex:
    """The saved pieces of one tensor, indexed by their start along dim 0.

    Building it is ``O(n log n)``; each query touches only pieces whose dim-0
    interval can overlap, which keeps planning near-linear at large world sizes.
    """

    def __init__(self, chunks: Sequence[tuple[Box, tuple[int, int] | None]]):
        entries = []
        for ci, (box, flat) in enumerate(chunks):
            for p in pieces_of(box, flat):
                entries.append((p.box.offsets[0] if p.box.ndim else 0, ci, p))
        entries.sort(key=lambda e: (e[0], e[1], e[2].start))
        self._starts = [e[0] for e in entries]
        self._entries = entries
        # Longest dim-0 extent bounds how far back an overlapping piece can start.
        self._max_len = max((e[2].box.sizes[0] if e[2].box.ndim else 1 for e in entries), default=0)

    def overlapping(self, box: Box):
        if box.ndim == 0:
            yield from ((ci, p) for _, ci, p in self._entries)
            return
        lo = box.offsets[0] - self._max_len + 1
        hi = box.offsets[0] + box.sizes[0]
        i = bisect.bisect_left(self._starts, lo)
        j = bisect.bisect_left(self._starts, hi)
        for _, ci, p in self._entries[i:j]:
            yield ci, p


def plan_reads(index: SourceIndex, box: Box, flat: tuple[int, int] | None = None) -> list[ReadOp]:
    """The reads that fill one target shard (``box``, optionally a flat range of it)."""
    ops = []
    for dst in pieces_of(box, flat):
        for ci, src in index.overlapping(dst.box):
            region = src.box.intersect(dst.box)
            if region is not None and region.numel > 0:
                ops.append(ReadOp(ci, src, dst, region))
    return ops


def coverage_gaps(ops: Sequence[ReadOp], box: Box, flat: tuple[int, int] | None = None) -> int:
    """Elements of the target left uncovered (negative if some are covered twice)."""
    want = sum(p.box.numel for p in pieces_of(box, flat))
    return want - sum(op.region.numel for op in ops)
