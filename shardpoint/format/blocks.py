"""The data-file layout's numbers: chunk alignment, block size, and how many checksums a chunk has.

The facts every reader and writer of data files shares, apart from the code
that writes and checks them (:mod:`shardpoint.format.datafile`), so that the
manifest parser can count a chunk's checksums without importing the writer.
Example::

    assert padding(100) == 28 and block_count(17, 16) == 2
"""

from __future__ import annotations

__all__ = ["ALIGN", "DEFAULT_BLOCK_SIZE", "padding", "block_count"]

ALIGN = 64
DEFAULT_BLOCK_SIZE = 4 << 20


def padding(pos: int) -> int:
    """How many zero bytes go at ``pos`` so that the next chunk starts aligned.

    Example::

        >>> padding(0), padding(1), padding(64), padding(100)
        (0, 63, 0, 28)
    """
    return -pos % ALIGN


def block_count(nbytes: int, block: int) -> int:
    """How many checksums a chunk of ``nbytes`` has: one per block, and one for an empty chunk.

    Example::

        >>> block_count(0, 16), block_count(16, 16), block_count(17, 16)
        (1, 1, 2)
    """
    return max(1, -(-nbytes // block))
