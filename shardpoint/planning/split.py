"""A span too large for a bounce slot, cut into consecutive spans that each fit one (pure, no I/O).

A load onto a device reads each span into a slot of its bounce ring and
copies it from there. A span larger than the ring (one tensor of several
hundred megabytes: an embedding, an LM head) would otherwise be read into
an ordinary buffer and copied from it without the ring.
:func:`split_span` cuts it along the outermost dimension of its regions
that has more than one index: each copy region becomes slabs of whole rows,
and each slab goes to the window of ``limit`` bytes its first byte lies in.
Each resulting span covers the bytes of its slabs (widened to checksum
blocks when verifying, so it can be verified alone: the windows are then
whole blocks), reads only what the original span read there, and feeds
exactly its slabs; together they feed every element of the original once.
Neighbouring spans may overlap by a row, or by the block a row straddles
when verifying: those bytes are read twice.

A region whose one row is larger than ``limit`` is not cut further; its
span may then exceed ``limit``.

Example::

    parts = split_span(read, 128 << 20, block=1 << 20, verify=True)
"""

from __future__ import annotations

import math
from typing import Sequence

from ..geometry import Box, row_major_strides, runs_within
from .load_plan import ReadOp
from .reads import ChunkRead, CopyJob

__all__ = ["split_span"]


def _cut_dim(region: Box) -> int | None:
    return next((d for d, s in enumerate(region.sizes) if s > 1), None)


def _slab(op: ReadOp, d: int, a: int, b: int) -> ReadOp:
    offsets = list(op.region.offsets)
    sizes = list(op.region.sizes)
    offsets[d] += a
    sizes[d] = b - a
    return ReadOp(op.chunk, op.src, op.dst, Box(tuple(offsets), tuple(sizes)))


def _bytes_of(op: ReadOp, itemsize: int) -> tuple[int, int]:
    """Chunk-relative bytes ``[first, end)`` from the region's first element to its last."""
    run = runs_within(op.src.box, op.region)
    first = op.src.start + run.base
    end = first + sum((c - 1) * s for c, s in zip(run.counts, run.strides)) + run.length
    return first * itemsize, end * itemsize


def _windows(op: ReadOp, itemsize: int, lo: int, limit: int) -> list[tuple[int, ReadOp]]:
    """``op`` cut into slabs of whole rows, each with the window (of ``limit`` bytes from ``lo``) its first byte lies in."""
    first, end = _bytes_of(op, itemsize)
    d = _cut_dim(op.region)
    if d is None or (end - 1 - lo) // limit == (first - lo) // limit:  # within one window
        return [((first - lo) // limit, op)]
    row = row_major_strides(op.src.box.sizes)[d] * itemsize  # bytes from one row's start to the next's
    n = op.region.sizes[d]
    out = []
    i = 0
    while i < n:
        w = (first + i * row - lo) // limit
        nxt = -(-(lo + (w + 1) * limit - first) // row)  # the first row starting in a later window
        j = min(n, max(i + 1, nxt))
        out.append((w, _slab(op, d, i, j)))
        i = j
    return out


def _clip(segments: Sequence[tuple[int, int]] | None, lo: int, hi: int) -> tuple[tuple[int, int], ...] | None:
    if segments is None:
        return None
    return tuple((max(a, lo), min(b, hi)) for a, b in segments if a < hi and b > lo)


def split_span(r: ChunkRead, limit: int, block: int, verify: bool) -> list[ChunkRead]:
    """``r`` as spans of about ``limit`` bytes each (see the module docs); ``[r]`` when it fits.

    Example::

        [p.hi - p.lo for p in split_span(read, 64 << 20, 1 << 20, False)]
    """
    if r.hi - r.lo <= limit or limit <= 0:
        return [r]
    if verify:  # windows of whole checksum blocks: neighbours then share at most the block a row straddles
        limit = max(1, limit // block) * block
    windows: dict[int, list[tuple[int, ReadOp]]] = {}
    for job in r.jobs:
        for op in job.ops:
            for w, slab in _windows(op, r.itemsize, r.lo, limit):
                windows.setdefault(w, []).append((job.target, slab))
    out = []
    for w in sorted(windows):
        slabs = windows[w]
        spans = [_bytes_of(op, r.itemsize) for _, op in slabs]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        if verify:  # whole checksum blocks, within what the span read
            lo, hi = max(r.lo, lo // block * block), min(r.hi, -(-hi // block) * block)
        jobs: dict[int, list[ReadOp]] = {}
        for target, op in slabs:
            jobs.setdefault(target, []).append(op)
        needed = sum(math.prod(op.region.sizes) for _, op in slabs) * r.itemsize
        segments = _clip(r.segments, lo, hi)
        out.append(ChunkRead(r.fqn, r.ci, r.chunk, lo, hi, r.dtype, r.itemsize,
                             tuple(CopyJob(t, tuple(ops)) for t, ops in jobs.items()), segments, needed))
    return out
