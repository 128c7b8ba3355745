"""Running plans against storage: write chunks with checksums; read, verify and copy.

This is the synchronous engine. Bytes move without pickle: a tensor is viewed
as raw little-endian bytes and laid out by
:class:`shardpoint.format.datafile.DataFileWriter` (64-byte aligned, hashed in
``block_size`` blocks with xxh3_64 so that a partial read can still be checked).
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch

from ..errors import CorruptCheckpointError, ShapeMismatchError, StorageError
from ..format.datafile import DataFileWriter, verify_blocks
from ..format.manifest import ChunkMeta, Manifest
from ..items import LoadTarget, SaveTensor
from ..planning.load_plan import ReadOp
from ..storage.base import ShortReadError, Storage

__all__ = ["tensor_bytes", "write_chunks", "verify_chunk", "dest_view", "read_chunk_into"]

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("shardpoint's format is little-endian; big-endian hosts are not supported")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor (copied to host and made contiguous only if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def write_chunks(
    storage: Storage, file: str, items: Sequence[SaveTensor], rank: int, block: int, recorder=None
) -> tuple[list[tuple[str, ChunkMeta]], int]:
    """Write ``items`` into one data file; return their chunk records and the file size."""
    try:
        return _write_chunks(storage, file, items, rank, block, recorder)
    except OSError as e:
        raise StorageError(f"{storage.url}: writing {file} failed: {e}") from e


def _write_chunks(storage, file, items, rank, block, recorder):
    records: list[tuple[str, ChunkMeta]] = []
    with storage.open_writer(file) as w:
        out = DataFileWriter(w, file, block, rank, recorder)
        for it in items:
            mv = tensor_bytes(it.data)
            if len(mv) != it.nbytes:
                raise ShapeMismatchError(f"{it.fqn}: local data has {len(mv)} bytes, geometry says {it.nbytes}")
            records.append((it.fqn, out.add(mv, it.box, it.flat)))
    return records, out.pos


def dest_view(target: LoadTarget, op: ReadOp) -> torch.Tensor:
    """The part of ``target``'s destination tensor that ``op`` fills (a view, never a copy).

    Example::

        dest_view(target, op).copy_(source)
    """
    if target.flat is None:
        base = target.dest.view(target.box.sizes) if target.dest.dim() != len(target.box.sizes) else target.dest
        return base[op.region.relative_to(target.box)]
    seg = target.dest[op.dst.start : op.dst.start + op.dst.box.numel].view(op.dst.box.sizes)
    return seg[op.region.relative_to(op.dst.box)]


def read_chunk_into(storage: Storage, chunk: ChunkMeta, lo: int, buf: memoryview, fqn: str, where: str) -> None:
    """Fill ``buf`` from byte ``lo`` of ``chunk``; a missing or short file raises a typed error naming the tensor.

    Example::

        read_chunk_into(storage, chunk, 0, memoryview(buf), "w", "ckpt")
    """
    try:
        storage.readinto(chunk.file, chunk.offset + lo, buf)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{where}: data file {chunk.file} of tensor {fqn!r} is missing; the checkpoint is damaged"
        ) from None
    except ShortReadError as e:
        raise short_file_error(chunk, fqn, where, e) from None


def short_file_error(chunk: ChunkMeta, fqn: str, where: str, e: Exception) -> CorruptCheckpointError:
    """The error for a data file that ends before ``chunk`` does (read or mapped)."""
    return CorruptCheckpointError(
        f"{where}: data file {chunk.file} of tensor {fqn!r} is shorter than the manifest says (truncated?): {e}"
    )


def verify_chunk(storage: Storage, manifest: Manifest, fqn: str, chunk: ChunkMeta) -> None:
    """Read one whole chunk and check every block checksum (used by ``shardpoint verify``)."""
    block = manifest.block_size
    buf = bytearray(min(block, max(chunk.nbytes, 0)) or 0)
    for first in range(0, max(chunk.nbytes, 1), block):
        n = min(block, chunk.nbytes - first)
        mv = memoryview(buf)[:n]
        read_chunk_into(storage, chunk, first, mv, fqn, storage.url)
        verify_blocks(mv, chunk, first // block, block, fqn, storage.url)
