"""The load engine: plan chunk reads, fetch (locally or shared), verify, copy in place.

Each target shard is intersected with the saved chunks (pure planning); the
needed elements of one chunk become one byte *span*, widened to checksum
blocks so everything read can be verified. Spans are then fetched:

- locally, with a small thread pool that prefetches ahead of the copies under
  a byte budget, reading straight into the destination when the chunk maps
  onto a contiguous piece of it; or
- shared ("read once"): ranks exchange the list of spans they need; each span
  needed by several ranks is read by one of them, chosen to balance bytes,
  and sent to the others over the process group. Replicas (DDP, HSDP) and TP
  ranks that need the same blocks then read storage once between them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..adapters.base import LoadTarget, dtype_name, torch_dtype
from ..errors import CorruptCheckpointError, ShapeMismatchError
from ..format.manifest import ChunkMeta, Manifest
from ..geometry import row_major_strides, runs_within
from ..planning.load_plan import ReadOp, SourceIndex, coverage_gaps, plan_reads
from ..storage.base import Storage
from .io import _dst_view, _readinto, _verify

__all__ = ["LoadStats", "ChunkRead", "plan_chunk_reads", "execute_reads"]


@dataclass
class LoadStats:
    """What one rank's load read from storage, received from peers, and needed."""

    bytes_read: int = 0
    bytes_needed: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    chunks_read: int = 0
    direct_reads: int = 0
    shared_spans: int = 0
    per_file: dict = field(default_factory=lambda: defaultdict(int))


@dataclass
class ChunkRead:
    """One byte span ``[lo, hi)`` of a saved chunk, and the copies it feeds."""

    fqn: str
    ci: int
    chunk: ChunkMeta
    lo: int
    hi: int
    dtype: torch.dtype
    itemsize: int
    jobs: list[tuple[LoadTarget, list[ReadOp]]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.fqn, self.ci, self.lo, self.hi)


def _overlapping(ops: Sequence[ReadOp]) -> bool:
    for i in range(len(ops)):
        for j in range(i + 1, len(ops)):
            if ops[i].region.intersect(ops[j].region) is not None:
                return True
    return False


def plan_chunk_reads(
    manifest: Manifest, targets: Sequence[LoadTarget], where: str, verify: bool, stats: LoadStats
) -> list[ChunkRead]:
    """Group every target's read ops by saved chunk, one span per chunk (no I/O)."""
    indexes: dict[str, SourceIndex] = {}
    block = manifest.block_size
    reads: dict[tuple[str, int], ChunkRead] = {}
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
        isz = meta.itemsize
        for ci, cops in by_chunk.items():
            chunk = meta.chunks[ci]
            lo_e = min(op.src.start + runs_within(op.src.box, op.region).span[0] for op in cops)
            hi_e = max(op.src.start + runs_within(op.src.box, op.region).span[1] for op in cops)
            stats.bytes_needed += sum(op.region.numel for op in cops) * isz
            r = reads.get((tgt.fqn, ci))
            if r is None:
                r = reads[(tgt.fqn, ci)] = ChunkRead(tgt.fqn, ci, chunk, lo_e * isz, hi_e * isz, dt, isz)
            else:
                r.lo, r.hi = min(r.lo, lo_e * isz), max(r.hi, hi_e * isz)
            r.jobs.append((tgt, cops))
    out = sorted(reads.values(), key=lambda r: (r.chunk.file, r.chunk.offset + r.lo))
    if verify:
        for r in out:
            r.lo = (r.lo // block) * block
            r.hi = min(-(-r.hi // block) * block, r.chunk.nbytes)
    return out


def _copy_jobs(r: ChunkRead, buf: torch.Tensor) -> None:
    typed = buf.view(r.dtype)
    base_e = r.lo // r.itemsize
    for tgt, ops in r.jobs:
        for op in ops:
            strides = row_major_strides(op.src.box.sizes)
            run = runs_within(op.src.box, op.region)
            src = typed.as_strided(op.region.sizes, strides, op.src.start + run.base - base_e)
            _dst_view(tgt, op).copy_(src)


def _direct_view(r: ChunkRead) -> torch.Tensor | None:
    """The destination bytes when the whole chunk lands on one contiguous host view."""
    if len(r.jobs) != 1 or r.lo != 0 or r.hi != r.chunk.nbytes or r.chunk.flat is not None:
        return None
    tgt, ops = r.jobs[0]
    if len(ops) != 1 or ops[0].region != ops[0].src.box:
        return None
    dv = _dst_view(tgt, ops[0])
    if not dv.is_contiguous() or dv.device.type != "cpu" or dv.numel() * r.itemsize != r.chunk.nbytes:
        return None
    return dv.reshape(-1).view(torch.uint8)


def _fetch(storage: Storage, r: ChunkRead, block: int, verify: bool, where: str, into: torch.Tensor | None = None, rec=None) -> torch.Tensor:
    try:
        return _fetch_one(storage, r, block, verify, where, into, rec)
    except CorruptCheckpointError:
        # Tiered storage: a corrupt or missing copy on a fast tier comes from the next tier.
        for alt in getattr(storage, "alternatives", lambda: [])():
            try:
                return _fetch_one(alt, r, block, verify, where, into, rec)
            except CorruptCheckpointError:
                continue
        raise


def _fetch_one(storage: Storage, r: ChunkRead, block: int, verify: bool, where: str, into: torch.Tensor | None, rec) -> torch.Tensor:
    buf = into if into is not None else torch.empty(r.hi - r.lo, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    t0 = time.monotonic()
    _readinto(storage, r.chunk, r.lo, mv, r.fqn, where)
    t1 = time.monotonic()
    if verify:
        _verify(mv, r.chunk, r.lo // block, block, r.fqn, where)
    if rec is not None:
        rec.add("read", t0, t1, len(mv))
        if verify:
            rec.add("verify", t1, time.monotonic(), len(mv))
    return buf


def _copy_timed(r: ChunkRead, buf: torch.Tensor, rec) -> None:
    t0 = time.monotonic()
    _copy_jobs(r, buf)
    if rec is not None:
        rec.add("copy", t0, time.monotonic(), r.hi - r.lo)


def _count(stats: LoadStats, r: ChunkRead) -> None:
    stats.chunks_read += 1
    stats.bytes_read += r.hi - r.lo
    stats.per_file[r.chunk.file] += r.hi - r.lo


def _execute_local(storage, reads: Sequence[ChunkRead], block, verify, where, stats, window: int, threads: int, rec=None) -> None:
    """Fetch in a thread pool, at most ``window`` bytes ahead of the copies."""
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="shardpoint-read") as pool:
        pending: list = []
        ahead = 0
        i = 0
        while i < len(reads) or pending:
            while i < len(reads) and (not pending or ahead + (reads[i].hi - reads[i].lo) <= window):
                r = reads[i]
                direct = _direct_view(r)
                pending.append((r, direct, pool.submit(_fetch, storage, r, block, verify, where, direct, rec)))
                ahead += r.hi - r.lo
                _count(stats, r)
                i += 1
            r, direct, fut = pending.pop(0)
            buf = fut.result()
            ahead -= r.hi - r.lo
            if direct is not None:
                stats.direct_reads += 1
            else:
                _copy_timed(r, buf, rec)


def _execute_shared(storage, reads: Sequence[ChunkRead], comm, block, verify, where, stats, window: int, rec=None, threads: int = 2) -> None:
    """Read each span once across the ranks that need it; send it to the others."""
    mine = {r.key: r for r in reads}
    tc = time.monotonic()
    everyone = comm.all_gather(sorted(mine))
    if rec is not None:
        rec.add("communicate", tc, time.monotonic())
    needers: dict[tuple, list[int]] = defaultdict(list)
    for rank, keys in enumerate(everyone):
        for k in keys:
            needers[tuple(k)].append(rank)
    order = sorted(needers)
    load = [0] * comm.world
    reader: dict[tuple, int] = {}
    for k in sorted(order, key=lambda k: (-(k[3] - k[2]), k)):
        best = min(needers[k], key=lambda q: (load[q], q))
        reader[k] = best
        load[best] += k[3] - k[2]
    local = [mine[k] for k in order if k in mine and len(needers[k]) == 1]
    error: BaseException | None = None
    try:
        _execute_local(storage, local, block, verify, where, stats, window, threads=threads, rec=rec)
    except Exception as e:  # noqa: BLE001 - keep serving peers, raise at the end
        error = e
    sends: list = []
    in_flight = 0
    for k in order:
        ns = needers[k]
        if len(ns) == 1 or comm.rank not in ns:
            continue
        size = k[3] - k[2]
        r = mine[k]
        buf = torch.empty(size + 1, dtype=torch.uint8)  # last byte: 1 = good data, 0 = reader failed
        src = reader[k]
        stats.shared_spans += 1
        if comm.rank == src:
            if error is None:
                try:
                    _fetch(storage, r, block, verify, where, buf[:size], rec)
                    _count(stats, r)
                    buf[size] = 1
                except Exception as e:  # noqa: BLE001 - peers must still get an answer
                    error = e
                    buf[size] = 0
            else:
                buf[size] = 0
            tc = time.monotonic()
            if len(ns) == comm.world:
                dist.broadcast(buf, src=comm._global(src), group=comm.group)
            else:
                for q in ns:
                    if q != src:
                        sends.append((dist.isend(buf, dst=comm._global(q), group=comm.group), buf))
                        in_flight += size
                        stats.bytes_sent += size
                while in_flight > window and sends:
                    h, b = sends.pop(0)
                    h.wait()
                    in_flight -= b.numel() - 1
            if rec is not None:
                rec.add("communicate", tc, time.monotonic(), size)
        else:
            tc = time.monotonic()
            if len(ns) == comm.world:
                dist.broadcast(buf, src=comm._global(src), group=comm.group)
            else:
                dist.recv(buf, src=comm._global(src), group=comm.group)
            if rec is not None:
                rec.add("communicate", tc, time.monotonic(), size)
            stats.bytes_received += size
            if int(buf[size]) != 1 and error is None:
                error = CorruptCheckpointError(
                    f"{where}: rank {src} could not read {r.chunk.file} for tensor {r.fqn!r}; see its error"
                )
        if error is None:
            try:
                _copy_timed(r, buf[:size], rec)
            except Exception as e:  # noqa: BLE001
                error = e
    for h, _b in sends:
        h.wait()
    if error is not None:
        raise error


def execute_reads(
    storage: Storage,
    manifest: Manifest,
    targets: Sequence[LoadTarget],
    where: str,
    verify: bool = True,
    comm=None,
    share: bool = True,
    window: int = 256 << 20,
    threads: int = 2,
    recorder=None,
) -> LoadStats:
    """Fill every target. ``share`` reads spans needed by several ranks only once.

    With ``share`` and a process group, this is a collective: every rank of
    ``comm`` must call it, even with no targets.
    """
    stats = LoadStats()
    # Backends with high per-request latency (object stores) ask for more reads in flight.
    threads = max(threads, int(getattr(storage, "read_threads", threads)))
    reads = plan_chunk_reads(manifest, targets, where, verify, stats)
    if comm is not None and share and comm.active and comm.world > 1:
        _execute_shared(storage, reads, comm, manifest.block_size, verify, where, stats, window, recorder, threads)
    else:
        _execute_local(storage, reads, manifest.block_size, verify, where, stats, window, threads, recorder)
    return stats
