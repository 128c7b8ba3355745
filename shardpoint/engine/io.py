"""Running plans against storage: write chunks with checksums; read, verify and copy.

This is the synchronous engine. Bytes move without pickle: a tensor is viewed
as raw little-endian bytes, written at a 64-byte aligned offset, and hashed in
``block_size`` blocks with xxh3_64 so that a partial read can still be checked.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import xxhash

from ..adapters.base import LoadTarget, SaveTensor, dtype_name, torch_dtype
from ..errors import CorruptCheckpointError, FormatError, ShapeMismatchError, StorageError
from ..format.manifest import ChunkMeta, Manifest
from ..geometry import row_major_strides, runs_within
from ..planning.load_plan import ReadOp, SourceIndex, coverage_gaps, plan_reads
from ..storage.base import ShortReadError, Storage

__all__ = ["ALIGN", "DEFAULT_BLOCK_SIZE", "tensor_bytes", "write_chunks", "read_targets", "verify_chunk", "LoadStats"]

ALIGN = 64
DEFAULT_BLOCK_SIZE = 4 << 20

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("shardpoint's format is little-endian; big-endian hosts are not supported")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor (copied to host and made contiguous only if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def block_checksums(mv: memoryview, block: int) -> list[str]:
    if len(mv) == 0:
        return [xxhash.xxh3_64_hexdigest(b"")]
    return [xxhash.xxh3_64_hexdigest(mv[i : i + block]) for i in range(0, len(mv), block)]


def write_chunks(
    storage: Storage, file: str, items: Sequence[SaveTensor], rank: int, block: int
) -> tuple[list[tuple[str, ChunkMeta]], int]:
    """Write ``items`` into one data file; return their chunk records and the file size."""
    try:
        return _write_chunks(storage, file, items, rank, block)
    except OSError as e:
        raise StorageError(f"{storage.url}: writing {file} failed: {e}") from e


def _write_chunks(storage, file, items, rank, block):
    records: list[tuple[str, ChunkMeta]] = []
    pos = 0
    pad = bytes(ALIGN)
    with storage.open_writer(file) as w:
        for it in items:
            mv = tensor_bytes(it.data)
            if len(mv) != it.nbytes:
                raise ShapeMismatchError(f"{it.fqn}: local data has {len(mv)} bytes, geometry says {it.nbytes}")
            if pos % ALIGN:
                n = ALIGN - pos % ALIGN
                w.write(pad[:n])
                pos += n
            sums = block_checksums(mv, block)
            w.write(mv)
            records.append((it.fqn, ChunkMeta(it.box, file, pos, len(mv), tuple(sums), it.flat, rank)))
            pos += len(mv)
    return records, pos


@dataclass
class LoadStats:
    """What one rank's load read and copied."""

    bytes_read: int = 0
    bytes_needed: int = 0
    chunks_read: int = 0
    direct_reads: int = 0
    per_file: dict = field(default_factory=lambda: defaultdict(int))


def _verify(buf: memoryview, chunk: ChunkMeta, first_block: int, block: int, fqn: str, where: str) -> None:
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


def _dst_view(target: LoadTarget, op: ReadOp) -> torch.Tensor:
    if target.flat is None:
        base = target.dest.view(target.box.sizes) if target.dest.dim() != len(target.box.sizes) else target.dest
        return base[op.region.relative_to(target.box)]
    seg = target.dest[op.dst.start : op.dst.start + op.dst.box.numel].view(op.dst.box.sizes)
    return seg[op.region.relative_to(op.dst.box)]


def _readinto(storage: Storage, chunk: ChunkMeta, lo: int, buf: memoryview, fqn: str, where: str) -> None:
    try:
        storage.readinto(chunk.file, chunk.offset + lo, buf)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{where}: data file {chunk.file} of tensor {fqn!r} is missing; the checkpoint is damaged"
        ) from None
    except ShortReadError as e:
        raise CorruptCheckpointError(
            f"{where}: data file {chunk.file} of tensor {fqn!r} is shorter than the manifest says "
            f"(truncated?): {e}"
        ) from None


def read_targets(
    storage: Storage,
    manifest: Manifest,
    targets: Iterable[LoadTarget],
    where: str,
    verify: bool = True,
) -> LoadStats:
    """Fill every target from the checkpoint, reading each needed block once per rank."""
    stats = LoadStats()
    indexes: dict[str, SourceIndex] = {}
    block = manifest.block_size
    for tgt in targets:
        meta = manifest.tensors[tgt.fqn]
        dt = torch_dtype(meta.dtype)
        if tuple(meta.shape) != tuple(tgt.shape) or dt != tgt.dest.dtype:
            raise ShapeMismatchError(
                f"{where}: tensor {tgt.fqn!r}: checkpoint has {meta.dtype}{list(meta.shape)}, "
                f"target has {dtype_name(tgt.dest.dtype)}{list(tgt.shape)}"
            )
        idx = indexes.get(tgt.fqn)
        if idx is None:
            idx = indexes[tgt.fqn] = SourceIndex([(c.box, c.flat) for c in meta.chunks])
        ops = plan_reads(idx, tgt.box, tgt.flat)
        gap = coverage_gaps(ops, tgt.box, tgt.flat)
        if gap == 0 and len(ops) <= 256 and _overlapping(ops):
            gap = -1  # an overlap hidden by an equal-sized hole
        if gap != 0:
            raise CorruptCheckpointError(
                f"{where}: tensor {tgt.fqn!r}: saved chunks cover the target shard "
                f"{'with overlaps' if gap < 0 else f'with {gap} elements missing'}; the manifest is inconsistent"
            )
        by_chunk: dict[int, list[ReadOp]] = defaultdict(list)
        for op in ops:
            by_chunk[op.chunk].append(op)
        itemsize = meta.itemsize
        for ci, cops in sorted(by_chunk.items()):
            chunk = meta.chunks[ci]
            _read_chunk(storage, chunk, cops, tgt, itemsize, dt, block, verify, stats, where)
    return stats


def _overlapping(ops: Sequence[ReadOp]) -> bool:
    """Whether two read regions of one target overlap (a tampered or inconsistent manifest)."""
    for i in range(len(ops)):
        for j in range(i + 1, len(ops)):
            if ops[i].region.intersect(ops[j].region) is not None:
                return True
    return False


def _read_chunk(storage, chunk: ChunkMeta, ops, tgt, itemsize, dt, block, verify, stats, where) -> None:
    spans = []
    for op in ops:
        r = runs_within(op.src.box, op.region)
        a, b = r.span
        spans.append((op.src.start + a, op.src.start + b))
        stats.bytes_needed += op.region.numel * itemsize
    lo_e, hi_e = min(s[0] for s in spans), max(s[1] for s in spans)
    lo, hi = lo_e * itemsize, hi_e * itemsize
    if verify:
        lo = (lo // block) * block
        hi = min(-(-hi // block) * block, chunk.nbytes)
    stats.chunks_read += 1
    stats.bytes_read += hi - lo
    stats.per_file[chunk.file] += hi - lo
    # Fast path: one op that needs the whole chunk, into a contiguous host view.
    if len(ops) == 1 and lo == 0 and hi == chunk.nbytes and chunk.flat is None:
        op = ops[0]
        dv = _dst_view(tgt, op)
        if op.region == op.src.box and dv.is_contiguous() and dv.device.type == "cpu":
            mv = memoryview(dv.reshape(-1).view(torch.uint8).numpy())
            if len(mv) == chunk.nbytes:
                _readinto(storage, chunk, 0, mv, tgt.fqn, where)
                if verify:
                    _verify(mv, chunk, 0, block, tgt.fqn, where)
                stats.direct_reads += 1
                return
    buf = torch.empty(hi - lo, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    _readinto(storage, chunk, lo, mv, tgt.fqn, where)
    if verify:
        _verify(mv, chunk, lo // block, block, tgt.fqn, where)
    typed = buf.view(dt)
    base_e = lo // itemsize
    for op in ops:
        strides = row_major_strides(op.src.box.sizes)
        r = runs_within(op.src.box, op.region)
        src = typed.as_strided(op.region.sizes, strides, op.src.start + r.base - base_e)
        dv = _dst_view(tgt, op)
        dv.copy_(src)


def verify_chunk(storage: Storage, manifest: Manifest, fqn: str, chunk: ChunkMeta) -> None:
    """Read one whole chunk and check every block checksum (used by ``shardpoint verify``)."""
    block = manifest.block_size
    buf = bytearray(min(block, max(chunk.nbytes, 0)) or 0)
    for first in range(0, max(chunk.nbytes, 1), block):
        n = min(block, chunk.nbytes - first)
        mv = memoryview(buf)[:n]
        _readinto(storage, chunk, first, mv, fqn, storage.url)
        _verify(mv, chunk, first // block, block, fqn, storage.url)
