"""Cutting a tensor's row-major order into bounded blocks that are views.

A strided region copied between host and device goes through a contiguous
buffer of bounded size (a packing area in the bounce ring on load, a
staging piece on save). Each block is an index into the tensor (slices
only, so every block keeps the tensor's rank), the blocks are in
row-major order, and laid end to end their row-major bytes are the
tensor's. The same indexes cut a destination and its source alike.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["row_blocks"]


def row_blocks(shape: Sequence[int], itemsize: int, limit: int) -> list[tuple[slice, ...]]:
    """Indexes of the blocks of a tensor of ``shape``, each at most ``limit`` bytes (at least one element).

    A block spans whole rows of the outermost dimension it can; a row
    larger than ``limit`` is cut along the next dimension, and so on.

    Example::

        row_blocks((4, 3), 4, 24)   # [(slice(0, 2),), (slice(2, 4),)]: two rows of 12 bytes each
    """
    shape = tuple(int(s) for s in shape)
    limit = max(1, int(limit))
    out: list[tuple[slice, ...]] = []

    def walk(prefix: tuple[slice, ...], d: int) -> None:
        if d == len(shape):
            out.append(prefix)
            return
        row = math.prod(shape[d + 1 :]) * itemsize  # bytes of one index along dim d
        if row * shape[d] <= limit or shape[d] == 0:
            out.append(prefix)
            return
        if row <= limit:
            step = max(1, limit // row)
            out.extend(prefix + (slice(a, min(a + step, shape[d])),) for a in range(0, shape[d], step))
            return
        for a in range(shape[d]):
            walk(prefix + (slice(a, a + 1),), d + 1)

    walk((), 0)
    return out
