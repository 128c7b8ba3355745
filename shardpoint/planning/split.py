"""A span too large for a bounce slot, cut into consecutive spans that each fit one (pure, no I/O).

A load onto a device reads each span into a slot of its bounce ring and
copies it from there. A span larger than the ring (one tensor of several
hundred megabytes: an embedding, an LM head) would otherwise be read into
an ordinary buffer and copied from it without the ring.

:func:`split_span` cuts along windows of the saved piece itself, never of
the regions a rank copies: each window is a box of the piece whose bytes
are contiguous and at most ``limit`` long. It is a run of rows along the
outermost dimension whose row fits ``limit``, with every outer index fixed;
a row longer than ``limit`` is therefore cut along an inner dimension, down
to single elements. Each copy region becomes its intersection with every
window it meets, and each window that feeds a copy becomes a span: the
window's bytes within the original span (widened to whole checksum blocks
when verifying, so that it can be verified alone; windows that widen to the
same blocks make one span). Together the spans feed every element of the
original once and read only what it read; neighbours overlap only by the
checksum blocks they share.

The windows depend only on the piece, its item size and ``limit``, so
ranks that read the same span for different regions (replicas, tensor
parallel column blocks) get the same spans wherever both copy: a span read
once and sent to the others stays shared after the cut.

Example::

    parts = split_span(read, 128 << 20, block=1 << 20, verify=True)
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

from ..geometry import Box, row_major_strides
from .load_plan import ReadOp
from .reads import ChunkRead, CopyJob

__all__ = ["split_span"]


def _cut_dim(strides: Sequence[int], itemsize: int, limit: int) -> int:
    """The outermost dimension whose row (one step of its index) fits ``limit``; the innermost when none does."""
    return next((d for d, t in enumerate(strides) if t * itemsize <= limit), len(strides) - 1)


def _slabs(op: ReadOp, itemsize: int, limit: int) -> Iterator[tuple[tuple[int, int], ReadOp]]:
    """``op`` cut by the windows of its piece: each window's chunk bytes ``[first, end)`` and the slab of ``op`` inside it."""
    box, region, start = op.src.box, op.region, op.src.start
    if box.ndim == 0:
        yield (start * itemsize, (start + 1) * itemsize), op
        return
    strides = row_major_strides(box.sizes)
    d = _cut_dim(strides, itemsize, limit)
    rows = max(1, limit // (strides[d] * itemsize))  # indexes of dim d per window
    rel = [o - c for o, c in zip(region.offsets, box.offsets)]
    a, b = rel[d], rel[d] + region.sizes[d]
    for outer in itertools.product(*(range(rel[k], rel[k] + region.sizes[k]) for k in range(d))):
        base = start + sum(i * t for i, t in zip(outer, strides))
        for j in range(a // rows * rows, b, rows):
            end = min(j + rows, box.sizes[d])
            lo_d, hi_d = max(j, a), min(end, b)
            offsets = [box.offsets[k] + i for k, i in enumerate(outer)] + [box.offsets[d] + lo_d, *region.offsets[d + 1 :]]
            sizes = [1] * d + [hi_d - lo_d, *region.sizes[d + 1 :]]
            window = ((base + j * strides[d]) * itemsize, (base + end * strides[d]) * itemsize)
            yield window, ReadOp(op.chunk, op.src, op.dst, Box(tuple(offsets), tuple(sizes)))


def _clip(segments: Sequence[tuple[int, int]] | None, lo: int, hi: int) -> tuple[tuple[int, int], ...] | None:
    if segments is None:
        return None
    return tuple((max(a, lo), min(b, hi)) for a, b in segments if a < hi and b > lo)


def split_span(r: ChunkRead, limit: int, block: int, verify: bool) -> list[ChunkRead]:
    """``r`` as spans of at most ``limit`` bytes each (see the module docs); ``[r]`` when it fits.

    When verifying, windows are ``limit`` rounded down to whole checksum
    blocks (at least one), and a span may grow past that by the blocks its
    ends straddle; a window is never smaller than one element.

    Example::

        [p.hi - p.lo for p in split_span(read, 64 << 20, 1 << 20, False)]
    """
    if r.hi - r.lo <= limit or limit <= 0:
        return [r]
    if verify:  # a span verified alone holds whole checksum blocks: windows of fewer bytes would only repeat them
        limit = max(1, limit // block) * block
    spans: dict[tuple[int, int], list[tuple[int, ReadOp]]] = {}
    for job in r.jobs:
        for op in job.ops:
            for (first, end), slab in _slabs(op, r.itemsize, limit):
                lo, hi = max(r.lo, first), min(r.hi, end)
                if verify:  # whole checksum blocks, within what the span read
                    lo, hi = max(r.lo, lo // block * block), min(r.hi, -(-hi // block) * block)
                # Keyed by the bytes read: windows that widen to the same blocks are one span.
                spans.setdefault((lo, hi), []).append((job.target, slab))
    out = []
    for (lo, hi), slabs in sorted(spans.items()):
        jobs: dict[int, list[ReadOp]] = {}
        for target, op in slabs:
            jobs.setdefault(target, []).append(op)
        needed = sum(math.prod(op.region.sizes) for _, op in slabs) * r.itemsize
        out.append(ChunkRead(r.fqn, r.ci, r.chunk, lo, hi, r.dtype, r.itemsize,
                             tuple(CopyJob(t, tuple(ops)) for t, ops in jobs.items()), _clip(r.segments, lo, hi), needed))
    return out
