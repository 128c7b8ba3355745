"""Running plans against storage: write chunks with checksums; read, verify and copy.

This is the synchronous engine. Bytes move without pickle: a tensor is viewed
as raw little-endian bytes and laid out by
:class:`shardpoint.format.datafile.DataFileWriter` (64-byte aligned, hashed in
``block_size`` blocks with xxh3_64 so that a partial read can still be checked).

A save runs as a pipeline: the calling thread hashes piece by piece while a
second thread writes the previous pieces to storage. Tensors on an
accelerator are first staged through a small ring of the device's host
buffers by a third thread (:class:`~shardpoint.engine.pipeline.StagedWrite`), so the
device-to-host copies overlap hashing and writing too.
"""

from __future__ import annotations

import sys
import threading
from typing import Sequence

import torch

from ..device import Device, device_for, devices_of, host_copy
from ..errors import CorruptCheckpointError, ShapeMismatchError, StorageError
from ..format.datafile import DataFileWriter, verify_blocks
from ..format.manifest import ChunkMeta, Manifest
from ..items import LoadTarget, SaveTensor
from ..planning.load_plan import ReadOp
from ..storage.base import ShortReadError, Storage
from .pipeline import SinkThread, StagedWrite
from .staging import StagingRing

__all__ = ["tensor_bytes", "write_chunks", "verify_chunk", "dest_view", "read_chunk_into", "SYNC_STAGING_BYTES", "PIECE_BYTES"]

SYNC_STAGING_BYTES = 256 << 20  # host staging of a synchronous save from an accelerator
PIECE_BYTES = 16 << 20  # hashed, then written while the next piece is hashed

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("shardpoint's format is little-endian; big-endian hosts are not supported")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor (copied to host and made contiguous only if needed)."""
    t = host_copy(t.detach()).contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def write_chunks(
    storage: Storage, file: str, items: Sequence[SaveTensor], rank: int, block: int, recorder=None, device: Device | None = None
) -> tuple[list[tuple[str, ChunkMeta]], int]:
    """Write ``items`` into one data file; return their chunk records and the file size.

    ``device`` (default: the devices of the tensors not in host memory)
    is what an asynchronous device's tensors are staged through.

    Example::

        records, size = write_chunks(storage, "data/ab-r00000.bin", prep.mine, 0, DEFAULT_BLOCK_SIZE)
    """
    try:
        return _write_chunks(storage, file, items, rank, block, recorder, device)
    except OSError as e:
        raise StorageError(f"{storage.url}: writing {file} failed: {e}") from e


def _write_chunks(storage, file, items, rank, block, recorder, device):
    dev = device if device is not None else device_for(devices_of(it.data for it in items))
    if dev.asynchronous:
        return _write_staged(storage, file, items, rank, block, recorder, dev)
    records: list[tuple[str, ChunkMeta]] = []
    w = storage.open_writer(file)
    sink = SinkThread(w)
    try:
        out = DataFileWriter(sink, file, block, rank, recorder)
        for it in items:
            mv = tensor_bytes(it.data)
            if len(mv) != it.nbytes:
                raise ShapeMismatchError(f"{it.fqn}: local data has {len(mv)} bytes, geometry says {it.nbytes}")
            out.begin()
            for off in range(0, len(mv), PIECE_BYTES):
                out.write(mv[off : off + PIECE_BYTES])
            records.append((it.fqn, out.end(it.box, it.flat)))
        sink.close()
        w.close()
    except BaseException:
        try:
            sink.close()
        finally:
            w.abort()
        raise
    return records, out.pos


def _write_staged(storage, file, items, rank, block, recorder, dev: Device):
    """Accelerator tensors: copies into a small ring of host buffers on one thread, hashing and writing on two more."""
    total = sum(it.nbytes for it in items)
    ring = StagingRing(max(1, min(SYNC_STAGING_BYTES, total)), dev)
    piece = max(1, min(PIECE_BYTES * 2, ring.capacity // 4))
    staged = StagedWrite(storage, file, items, ring, rank, block, piece, recorder=recorder)
    staged.after = dev.snapshot_point()  # the copies read what the caller's queued work leaves

    def copy() -> None:
        try:
            staged.copy(0, len(items), last=True)
        except BaseException:  # noqa: BLE001 - handed to the writer through the queue, raised there
            pass

    copier = threading.Thread(target=copy, name="shardpoint-copy", daemon=True)
    copier.start()
    try:
        staged.write(threaded=True)
    finally:
        copier.join()
        staged.wait_copied()  # no queued copy may still target the ring when it is freed
        ring.free()
    return staged.records, staged.size


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
