"""The data-file layout: where chunks sit in a rank's data file and how they are checked.

A data file is the raw little-endian bytes of its chunks, one after another.
Each chunk starts at a multiple of :data:`ALIGN` (64) bytes; the gap before
it is zero bytes. A chunk's bytes are cut into ``block_size`` blocks (the
last one may be shorter) and each block's xxh3_64 digest, as 16 lowercase hex
digits, is its checksum. An empty chunk has one checksum, that of no bytes,
so every chunk has ``max(1, ceil(nbytes / block_size))`` of them.

This module is the one place that writes and checks that layout. It does no
I/O of its own: :class:`DataFileWriter` lays chunks out into any ``sink``
with a ``write`` method (a storage writer), and :func:`verify_blocks` checks
bytes someone else read. Example::

    w = DataFileWriter(sink, "data/x-r00000.bin", block=DEFAULT_BLOCK_SIZE, rank=0)
    chunk = w.add(memoryview(b"abc"), Box((0,), (3,)))
    assert chunk.offset == 0 and w.pos == 3
"""

from __future__ import annotations

import time
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError
from ..geometry import Box
from .blocks import ALIGN, DEFAULT_BLOCK_SIZE, block_count, padding
from .manifest import ChunkMeta

__all__ = [
    "ALIGN",
    "DEFAULT_BLOCK_SIZE",
    "padding",
    "block_count",
    "block_checksums",
    "BlockHasher",
    "DataFileWriter",
    "verify_blocks",
]

_ZEROS = bytes(ALIGN)


def block_checksums(data: bytes | memoryview, block: int) -> list[str]:
    """The checksums of one whole chunk's bytes.

    Example::

        >>> len(block_checksums(bytes(40), 16))
        3
    """
    h = BlockHasher(block)
    h.update(data)
    return h.digests()


class BlockHasher:
    """Block checksums of a chunk whose bytes arrive in pieces of any size.

    Pieces need not line up with blocks; the result equals
    :func:`block_checksums` of all the pieces joined.

    Example::

        h = BlockHasher(16)
        h.update(b"x" * 10); h.update(b"y" * 30)
        assert h.digests() == block_checksums(b"x" * 10 + b"y" * 30, 16)
    """

    def __init__(self, block: int):
        if block < 1:
            raise ValueError(f"block must be positive, got {block}")
        self.block = block
        self._sums: list[str] = []
        self._part = xxhash.xxh3_64()
        self._fill = 0  # bytes of the current, unfinished block

    def update(self, data: bytes | memoryview) -> None:
        """Hash the next ``data`` bytes of the chunk."""
        mv = memoryview(data)
        n, k, block = len(mv), 0, self.block
        if self._fill:
            k = min(block - self._fill, n)
            self._part.update(mv[:k])
            self._fill += k
            if self._fill < block:
                return
            self._sums.append(self._part.hexdigest())
            self._part.reset()
            self._fill = 0
        # Whole blocks in one call each: no hasher state to carry.
        while n - k >= block:
            self._sums.append(xxhash.xxh3_64_hexdigest(mv[k : k + block]))
            k += block
        if k < n:
            self._part.update(mv[k:])
            self._fill = n - k

    def finished(self) -> list[str]:
        """The checksums of the blocks completed so far (the unfinished last one is not among them)."""
        return self._sums

    def digests(self) -> list[str]:
        """The chunk's checksums, the unfinished last block included (call once, at the end)."""
        if self._fill or not self._sums:
            self._sums.append(self._part.hexdigest())
            self._part.reset()
            self._fill = 0
        return self._sums


class DataFileWriter:
    """Lay chunks out in one data file: aligned, zero-padded, hashed in blocks.

    ``sink`` receives the file's bytes in order (anything with ``write``);
    this class decides every byte and records each chunk as a
    :class:`~shardpoint.format.manifest.ChunkMeta`. A chunk is either added
    whole (:meth:`add`) or streamed: :meth:`begin`, :meth:`write` any number
    of times, :meth:`end`. ``recorder``, when given, gets
    ``add(phase, t0, t1, nbytes)`` for the ``"checksum"`` and ``"write"``
    time of every piece.

    Example::

        w = DataFileWriter(sink, "data/x-r00000.bin", block=16, rank=0)
        w.begin(); w.write(b"ab"); w.write(b"cd")
        chunk = w.end(Box((0,), (4,)))
    """

    def __init__(self, sink: Any, file: str, block: int, rank: int = 0, recorder: Any = None):
        self.sink = sink
        self.file = file
        self.block = block
        self.rank = rank
        self.recorder = recorder
        self.pos = 0  # bytes written so far: the file's size once the last chunk ends
        self._start: int | None = None
        self._hasher: BlockHasher | None = None

    def begin(self, hasher: BlockHasher | None = None) -> None:
        """Start a chunk: pad to the next aligned offset.

        ``hasher``: one that already hashed the chunk's first bytes (written
        next with ``write(data, hashed=True)``), so that they are not hashed twice.
        """
        if self._start is not None:
            raise RuntimeError(f"{self.file}: a chunk is already open")
        n = padding(self.pos)
        if n:
            self.sink.write(_ZEROS[:n])
            self.pos += n
        self._start = self.pos
        self._hasher = hasher or BlockHasher(self.block)

    def write(self, data: bytes | memoryview, hashed: bool = False) -> None:
        """Append the next bytes of the open chunk, hashing them first (while they are in cache), unless ``hashed``."""
        if self._hasher is None:
            raise RuntimeError(f"{self.file}: write outside a chunk")
        t0 = time.monotonic()
        if not hashed:
            self._hasher.update(data)
        t1 = time.monotonic()
        self.sink.write(data)
        n = len(memoryview(data))
        if self.recorder is not None:
            self.recorder.add("checksum", t0, t1, n)
            self.recorder.add("write", t1, time.monotonic(), n)
        self.pos += n

    def end(self, box: Box, flat: tuple[int, int] | None = None) -> ChunkMeta:
        """Close the open chunk; its record, with ``box`` and ``flat`` as the caller describes them."""
        if self._hasher is None or self._start is None:
            raise RuntimeError(f"{self.file}: end outside a chunk")
        sums = tuple(self._hasher.digests())
        start, self._start, self._hasher = self._start, None, None
        return ChunkMeta(box, self.file, start, self.pos - start, sums, flat, self.rank)

    def add(self, data: bytes | memoryview, box: Box, flat: tuple[int, int] | None = None) -> ChunkMeta:
        """Write one whole chunk; its record."""
        self.begin()
        self.write(data)
        return self.end(box, flat)


def verify_blocks(buf: memoryview, chunk: ChunkMeta, first_block: int, block: int, fqn: str, where: str) -> None:
    """Check ``buf`` (whole blocks of ``chunk`` from block ``first_block``) against the stored checksums.

    Raises :class:`~shardpoint.errors.CorruptCheckpointError` naming the file,
    byte range and tensor of the first block that differs.

    Example::

        verify_blocks(memoryview(data), chunk, 0, manifest.block_size, "w", "ckpt")
    """
    for k in range(0, len(buf), block):
        bi = first_block + k // block
        got = xxhash.xxh3_64_hexdigest(buf[k : k + block])
        if got != chunk.checksums[bi]:
            lo = bi * block
            raise CorruptCheckpointError(
                f"{where}: checksum mismatch in {chunk.file} bytes "
                f"[{chunk.offset + lo}, {chunk.offset + min(lo + block, chunk.nbytes)}) of tensor {fqn!r} "
                f"(chunk at offsets {list(chunk.box.offsets)}); the checkpoint is corrupt"
            )
