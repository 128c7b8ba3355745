"""The load engine: plan chunk reads, fetch (locally or shared), verify, copy in place.

Each target shard is intersected with the saved chunks (pure planning); the
needed elements of one chunk become one byte *span*, widened to checksum
blocks so everything read can be verified. Spans are then fetched:

- locally, by a small pool of reader threads that prefetch ahead of the
  loading thread under a byte budget, reading straight into the destination
  when the chunk maps onto a contiguous piece of it, and neighbouring small
  spans with one request; the loading thread verifies and copies. Ranks
  walk the files in staggered orders (:func:`order_reads`); or
- shared ("read once"): ranks exchange the list of spans they need; each span
  needed by several ranks is read by one of them, chosen to balance bytes,
  and sent to the others over the process group. Replicas (DDP, HSDP) and TP
  ranks that need the same blocks then read storage once between them.
"""

from __future__ import annotations

import contextlib
import gc
import math
import socket
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from ..errors import CorruptCheckpointError, ShapeMismatchError
from ..format.datafile import ALIGN, verify_blocks
from ..format.manifest import ChunkMeta, Manifest
from ..items import LoadTarget, dtype_name, torch_dtype
from ..geometry import row_major_strides, runs_within
from ..planning.load_plan import ReadOp, SourceIndex, coverage_gaps, plan_reads
from ..storage.base import ShortReadError, Storage
from .io import dest_view, read_chunk_into, short_file_error

__all__ = [
    "LoadStats", "ChunkRead", "SharedSpan", "plan_chunk_reads", "plan_segments", "plan_sharing", "route_sharing",
    "route_rows", "owner_replies", "collect_replies", "order_reads", "batch_reads", "execute_reads",
]


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
    # Sub-ranges of [lo, hi) that are actually read (None: all of it). The
    # buffer still spans [lo, hi); the gaps hold bytes no copy looks at.
    segments: list[tuple[int, int]] | None = None

    @property
    def key(self) -> tuple[str, int, int, int]:
        # The chunk's file and offset, not its index: ranks may resolve different
        # subsets of a tensor's chunks (format version 2), so indexes differ.
        return (self.chunk.file, self.chunk.offset, self.lo, self.hi)

    @property
    def nread(self) -> int:
        """Bytes this read fetches from storage."""
        if self.segments is None:
            return self.hi - self.lo
        return sum(b - a for a, b in self.segments)

    def ranges(self) -> list[tuple[int, int]]:
        return [(self.lo, self.hi)] if self.segments is None else self.segments


def _overlapping(ops: Sequence[ReadOp]) -> bool:
    for i in range(len(ops)):
        for j in range(i + 1, len(ops)):
            if ops[i].region.intersect(ops[j].region) is not None:
                return True
    return False


# A chunk with more needed runs than this is read as one span: listing the runs
# would cost more than the bytes it saves.
MAX_RUNS = 1 << 20
DEFAULT_COALESCE = 4096


def _needed_intervals(r: ChunkRead) -> tuple[np.ndarray, np.ndarray] | None:
    """Byte ``[start, end)`` of every needed run of ``r``'s chunk, or None when too many."""
    starts, lens = [], []
    total = 0
    for _tgt, ops in r.jobs:
        for op in ops:
            run = runs_within(op.src.box, op.region)
            n = math.prod(run.counts)
            total += n
            if total > MAX_RUNS:
                return None
            e = np.full(1, op.src.start + run.base, dtype=np.int64)
            for c, st in zip(run.counts, run.strides):
                e = (e[:, None] + np.arange(c, dtype=np.int64)[None, :] * st).reshape(-1)
            starts.append(e)
            lens.append(np.full(e.shape[0], run.length, dtype=np.int64))
    st = np.concatenate(starts) * r.itemsize
    return st, st + np.concatenate(lens) * r.itemsize


def _merge(lo: np.ndarray, hi: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """Union of intervals, joining those less than ``gap`` apart (``gap=0``: only touching ones)."""
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])
    brk = np.nonzero(lo[1:] > hi[:-1] + gap)[0]
    first = np.concatenate(([0], brk + 1))
    last = np.concatenate((brk, [len(lo) - 1]))
    return [(int(lo[a]), int(hi[b])) for a, b in zip(first, last)]


def plan_segments(r: ChunkRead, verify: bool, block: int, coalesce: int) -> list[tuple[int, int]] | None:
    """What of ``r``'s span to read: the needed runs, widened to checksum blocks when verifying.

    Runs closer than ``coalesce`` bytes are read as one (one request costs more
    than a small gap). ``None`` means the whole span ``[lo, hi)``.
    """
    if verify and r.hi - r.lo <= block:
        return None  # one checksum block: read it whole
    if len(r.jobs) == 1 and len(r.jobs[0][1]) == 1:
        op = r.jobs[0][1][0]
        if not runs_within(op.src.box, op.region).counts:
            return None  # one contiguous run, already the span
    iv = _needed_intervals(r)
    if iv is None or len(iv[0]) <= 1:
        return None
    st, en = iv
    if verify:  # whole checksum blocks, so that everything read can be verified
        segs = [(a * block, min(b * block, r.chunk.nbytes)) for a, b in _merge(st // block, (en + block - 1) // block, 0)]
    else:
        segs = _merge(st, en, coalesce)
    if len(segs) == 1 and segs[0] == (r.lo, r.hi):
        return None
    return segs


def _plan_target(idx: SourceIndex, box, flat) -> tuple[int, list]:
    """Geometry of one target: its coverage gap (0: exact, <0: overlaps) and, per saved
    chunk, ``(chunk index, ops, first element, end element, elements needed)``; pure."""
    ops = plan_reads(idx, box, flat)
    gap = coverage_gaps(ops, box, flat)
    if gap == 0 and len(ops) <= 256 and _overlapping(ops):
        gap = -1  # an overlap hidden by an equal-sized hole
    by_chunk: dict[int, list[ReadOp]] = defaultdict(list)
    for op in ops:
        by_chunk[op.chunk].append(op)
    groups = []
    for ci, cops in by_chunk.items():
        spans = [runs_within(op.src.box, op.region).span for op in cops]
        lo_e = min(op.src.start + a for op, (a, _b) in zip(cops, spans))
        hi_e = max(op.src.start + b for op, (_a, b) in zip(cops, spans))
        groups.append((ci, cops, lo_e, hi_e, sum(op.region.numel for op in cops)))
    return gap, groups


def plan_chunk_reads(
    manifest: Manifest, targets: Sequence[LoadTarget], where: str, verify: bool, stats: LoadStats,
    coalesce: int = DEFAULT_COALESCE,
) -> list[ChunkRead]:
    """Group every target's read ops by saved chunk, one span per chunk (no I/O).

    Where the target needs only some strided runs of a chunk, the span's
    ``segments`` list the byte ranges to read (see :func:`plan_segments`).
    """
    block = manifest.block_size
    reads: dict[tuple[str, int], ChunkRead] = {}
    # The plan of a target depends only on the geometry (saved chunk boxes, target box), which
    # every layer's weights and their optimizer states share: planned once per geometry.
    indexes: dict[tuple, SourceIndex] = {}
    plans: dict[tuple, tuple[int, list]] = {}
    for tgt in targets:
        meta = manifest.tensors[tgt.fqn]
        dt = torch_dtype(meta.dtype)
        if tuple(meta.shape) != tuple(tgt.shape) or dt != tgt.dest.dtype:
            raise ShapeMismatchError(
                f"{where}: tensor {tgt.fqn!r}: checkpoint has {meta.dtype}{list(meta.shape)}, "
                f"target has {dtype_name(tgt.dest.dtype)}{list(tgt.shape)}"
            )
        src = tuple((c.box, c.flat) for c in meta.chunks)
        key = (src, tgt.box, tgt.flat)
        plan = plans.get(key)
        if plan is None:
            idx = indexes.get(src)
            if idx is None:
                idx = indexes[src] = SourceIndex(list(src))
            plan = plans[key] = _plan_target(idx, tgt.box, tgt.flat)
        gap, groups = plan
        if gap != 0:
            raise CorruptCheckpointError(
                f"{where}: tensor {tgt.fqn!r}: saved chunks cover the target shard "
                f"{'with overlaps' if gap < 0 else f'with {gap} elements missing'}; the manifest is inconsistent"
            )
        isz = meta.itemsize
        for ci, cops, lo_e, hi_e, nel in groups:
            chunk = meta.chunks[ci]
            stats.bytes_needed += nel * isz
            r = reads.get((tgt.fqn, ci))
            if r is None:
                r = reads[(tgt.fqn, ci)] = ChunkRead(tgt.fqn, ci, chunk, lo_e * isz, hi_e * isz, dt, isz)
            else:
                r.lo, r.hi = min(r.lo, lo_e * isz), max(r.hi, hi_e * isz)
            r.jobs.append((tgt, cops))
    out = sorted(reads.values(), key=lambda r: (r.chunk.file, r.chunk.offset + r.lo))
    for r in out:
        if verify:
            r.lo = (r.lo // block) * block
            r.hi = min(-(-r.hi // block) * block, r.chunk.nbytes)
        r.segments = plan_segments(r, verify, block, coalesce)
    return out


# How far behind a peer's expected position a rank reads the spans it shares
# with that peer: a fraction of the peer's part of the line (see order_reads).
FOLLOW_LAG = 0.1


def order_reads(reads: Sequence[ChunkRead], rank: int, world: int, files: dict[str, int], saved_world: int = 1) -> list[ChunkRead]:
    """Order ``reads`` so that ranks sharing a disk stream different files (pure, no I/O).

    The saved bytes are laid on one line, data file after data file by writer
    rank (by name when writers repeat), and the line is cut into ``world``
    equal parts. Rank ``r`` streams its own part, ``r``, in order; a TP or
    FSDP rank's own dim-0 share of the saved chunks lies there. The spans it
    needs from another part are interleaved with its own, each at its
    position in that part plus ``FOLLOW_LAG``: the part's rank, walking it at
    the same pace, has just brought them into the page cache. Ranks on one
    host so read each page from the device once, on as many sequential
    streams as ranks, with no tail of page-cache re-reads at the end (ranks
    walking the files in one order read them together, one stream; see
    docs/benchmarks.md, loading). If the owner is slower, the follower reads
    those pages from the device and the owner finds them cached. ``files``
    maps file names to sizes (the manifest's ``files``) and ``saved_world``
    is the saving world size: every rank places a file at the same point.
    """
    if world <= 1 or not reads:
        return sorted(reads, key=lambda r: (r.chunk.file, r.chunk.offset + r.lo))
    writer: dict[str, int] = {}
    for r in reads:
        writer[r.chunk.file] = min(writer.get(r.chunk.file, r.chunk.rank), r.chunk.rank)
    if len(set(writer.values())) == len(writer):
        pos = {f: float(w) for f, w in writer.items()}
        n = max(max(writer.values()) + 1, saved_world)
    else:  # a writer with several files: the manifest's names order them
        names = sorted(set(files) | set(writer))
        pos = {f: float(i) for i, f in enumerate(names)}
        n = len(names)
    part = n / world

    def key(r: ChunkRead):
        size = files.get(r.chunk.file) or (r.chunk.offset + r.chunk.nbytes)
        x = pos[r.chunk.file] + min((r.chunk.offset + r.lo) / max(size, 1), 0.999999)
        d = (x - rank * part) % n  # distance along the line from the start of this rank's part
        k = min(int(d // part), world - 1)  # 0: this rank's part; k: the k-th part after it
        along = d / part - k
        return (along + (FOLLOW_LAG if k else 0.0), k, r.chunk.file, r.chunk.offset + r.lo)

    return sorted(reads, key=key)


def _copy_jobs(r: ChunkRead, buf: torch.Tensor) -> None:
    typed = buf.view(r.dtype)
    base_e = r.lo // r.itemsize
    for tgt, ops in r.jobs:
        for op in ops:
            strides = row_major_strides(op.src.box.sizes)
            run = runs_within(op.src.box, op.region)
            src = typed.as_strided(op.region.sizes, strides, typed.storage_offset() + op.src.start + run.base - base_e)
            dest_view(tgt, op).copy_(src)


def _direct_view(r: ChunkRead) -> torch.Tensor | None:
    """The destination bytes when the whole chunk lands on one contiguous host view."""
    if len(r.jobs) != 1 or r.lo != 0 or r.hi != r.chunk.nbytes or r.chunk.flat is not None or r.segments is not None:
        return None
    tgt, ops = r.jobs[0]
    if len(ops) != 1 or ops[0].region != ops[0].src.box:
        return None
    dv = dest_view(tgt, ops[0])
    if not dv.is_contiguous() or dv.device.type != "cpu" or dv.numel() * r.itemsize != r.chunk.nbytes:
        return None
    return dv.reshape(-1).view(torch.uint8)


def _fetch(storage: Storage, r: ChunkRead, block: int, verify: bool, where: str, into: torch.Tensor | None = None, rec=None) -> torch.Tensor:
    try:
        return _fetch_one(storage, r, block, verify, where, into, rec)
    except CorruptCheckpointError:
        # Tiered storage: a corrupt or missing copy on a fast tier comes from the next tier.
        for alt in storage.alternatives():
            try:
                return _fetch_one(alt, r, block, verify, where, into, rec)
            except CorruptCheckpointError:
                continue
        raise


def _read_segments(storage: Storage, r: ChunkRead, mv: memoryview, where: str, rec) -> None:
    """All of ``r``'s segments with one storage call: thousands of strided runs cost little each."""
    t0 = time.monotonic()
    try:
        storage.readinto_many(r.chunk.file, [(r.chunk.offset + a, mv[a - r.lo : b - r.lo]) for a, b in r.segments])
    except (FileNotFoundError, ShortReadError):
        for a, b in r.segments:  # piece by piece: the usual error, naming the tensor
            read_chunk_into(storage, r.chunk, a, mv[a - r.lo : b - r.lo], r.fqn, where)
    if rec is not None:
        rec.add("read", t0, time.monotonic(), r.nread)


def _fetch_one(storage: Storage, r: ChunkRead, block: int, verify: bool, where: str, into: torch.Tensor | None, rec) -> torch.Tensor:
    buf = into if into is not None else torch.empty(r.hi - r.lo, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    if not verify and r.segments is not None and len(r.segments) > 1 and storage.vectored_reads:
        _read_segments(storage, r, mv, where, rec)
        return buf
    rs = r.ranges()
    if verify:  # read and hash block by block: each block is hashed while still in cache
        rs = [piece for a, b in rs for piece in _at_blocks(a, b, block)]
    for a, b in rs:
        part = mv[a - r.lo : b - r.lo]
        t0 = time.monotonic()
        read_chunk_into(storage, r.chunk, a, part, r.fqn, where)
        t1 = time.monotonic()
        if verify:
            verify_blocks(part, r.chunk, a // block, block, r.fqn, where)
        if rec is not None:
            rec.add("read", t0, t1, len(part))
            if verify:
                rec.add("verify", t1, time.monotonic(), len(part))
    return buf


def _at_blocks(a: int, b: int, block: int) -> list[tuple[int, int]]:
    """``[a, b)`` cut at every multiple of ``block``; pure."""
    cuts = [a, *range((a // block + 1) * block, b, block), b]
    return list(zip(cuts, cuts[1:]))


def _copy_timed(r: ChunkRead, buf: torch.Tensor, rec) -> None:
    t0 = time.monotonic()
    _copy_jobs(r, buf)
    if rec is not None:
        rec.add("copy", t0, time.monotonic(), r.hi - r.lo)


def _count(stats: LoadStats, r: ChunkRead) -> None:
    stats.chunks_read += 1
    stats.bytes_read += r.nread
    stats.per_file[r.chunk.file] += r.nread


# Spans up to SMALL_SPAN bytes that follow each other in a file are read with one
# request, up to BATCH_BYTES. Only alignment padding may lie between them: a gap
# of ALIGN bytes or more could hold another chunk (another rank's shared span,
# or a tensor this load does not want), which would be read for nothing.
SMALL_SPAN = 256 << 10
BATCH_BYTES = 4 << 20


def batch_reads(reads: Sequence[ChunkRead]) -> list[list[ChunkRead]]:
    """Group neighbouring small spans into one request each, keeping the order (pure, no I/O).

    Norms, biases and step counts are many tiny chunks saved next to each
    other; one request per chunk cost more in Python and system-call overhead
    than the bytes themselves. Any other span is a group of its own.
    """
    out: list[list[ChunkRead]] = []
    total = 0
    for r in reads:
        small = r.segments is None and r.hi - r.lo <= SMALL_SPAN
        if small and out:
            last = out[-1][-1]
            gap = r.chunk.offset + r.lo - (last.chunk.offset + last.hi)
            if (last.segments is None and last.hi - last.lo <= SMALL_SPAN and last.chunk.file == r.chunk.file
                    and 0 <= gap < ALIGN and total + gap + r.hi - r.lo <= BATCH_BYTES):
                out[-1].append(r)
                total += gap + r.hi - r.lo
                continue
        out.append([r])
        total = r.hi - r.lo
    return out


def _extent(group: Sequence[ChunkRead]) -> tuple[int, int]:
    """File offsets ``[start, end)`` that one request for ``group`` reads."""
    return group[0].chunk.offset + group[0].lo, group[-1].chunk.offset + group[-1].hi


def _fetch_group(storage: Storage, group: Sequence[ChunkRead], where: str, rec) -> list[torch.Tensor]:
    """One request for a group of neighbouring spans; a view of the buffer per span (not verified)."""
    a, b = _extent(group)
    buf = torch.empty(b - a, dtype=torch.uint8)
    first = group[0]
    try:
        t0 = time.monotonic()
        read_chunk_into(storage, first.chunk, a - first.chunk.offset, memoryview(buf.numpy()), first.fqn, where)
        if rec is not None:
            rec.add("read", t0, time.monotonic(), b - a)
    except CorruptCheckpointError:
        # Span by span: names the damaged chunk, and lets tiered storage fall back per span.
        return [_fetch(storage, r, 0, False, where, None, rec) for r in group]
    parts = []
    for r in group:
        o = r.chunk.offset + r.lo - a
        part = buf[o : o + r.hi - r.lo]
        parts.append(part if o % r.itemsize == 0 else part.clone())  # typed views need aligned offsets
    return parts


def _verified(storage: Storage, r: ChunkRead, buf: torch.Tensor, block: int, where: str, into: torch.Tensor | None, rec) -> torch.Tensor:
    """``buf`` once its ranges match their checksums; else ``r`` read again, verified (other tiers too)."""
    t0 = time.monotonic()
    mv = memoryview(buf.numpy())
    try:
        for a, b in r.ranges():
            verify_blocks(mv[a - r.lo : b - r.lo], r.chunk, a // block, block, r.fqn, where)
    except CorruptCheckpointError:
        return _fetch(storage, r, block, True, where, into, rec)
    if rec is not None:
        rec.add("verify", t0, time.monotonic(), r.nread)
    return buf


# Needed ranges of a mapped span closer than this are brought in with one call:
# a strided span can hold thousands of runs, one system call each.
PREFETCH_GAP = 64 << 10


def _mapped(storage, r: ChunkRead) -> memoryview | None:
    """A view of ``r``'s span in a mapping of its file, or None to read it instead.

    Where the bytes must be narrowed or hashed in memory anyway, reading them
    into a buffer first is one more copy of every byte; a view of the page
    cache skips it. The view is not yet backed by memory: :func:`_fault_in`
    brings it in.
    """
    return storage.map_range(r.chunk.file, r.chunk.offset + r.lo, r.hi - r.lo, r.nread)


def _fault_pieces(r: ChunkRead, verify: bool, block: int) -> list[tuple[int, int]]:
    """The pieces of ``r`` to bring in one call each: checksum blocks when verifying
    (each is hashed as it lands), else its needed ranges joined across small gaps; pure."""
    rs = r.ranges()
    if verify:
        return [piece for a, b in rs for piece in _at_blocks(a, b, block)]
    if len(rs) > 1:
        return _merge(np.array([a for a, _ in rs]), np.array([b for _, b in rs]), PREFETCH_GAP)
    return rs


def _fault_in(storage, r: ChunkRead, mv: memoryview, block: int, verify: bool, where: str, rec) -> torch.Tensor:
    """In a reader thread: bring a mapped span into memory, verifying each block as it lands.

    ``storage.populate`` reads the cold pages of each piece and maps them
    without holding the interpreter lock; the piece is hashed right after,
    while it is still in the CPU cache. The loading thread then only copies.
    """
    populate = storage.populate  # the default does nothing: the hash's page faults bring pages in
    for a, b in _fault_pieces(r, verify, block):
        t0 = time.monotonic()
        try:
            populate(r.chunk.file, r.chunk.offset + a, b - a)
        except ShortReadError as e:
            raise short_file_error(r.chunk, r.fqn, where, e) from None
        t1 = time.monotonic()
        if rec is not None:
            rec.add("read", t0, t1, b - a)
        if verify:
            verify_blocks(mv[a - r.lo : b - r.lo], r.chunk, a // block, block, r.fqn, where)
            if rec is not None:
                rec.add("verify", t1, time.monotonic(), b - a)
    return torch.frombuffer(mv, dtype=torch.uint8)


def _fault_in_or_fetch(storage, r: ChunkRead, mv: memoryview, block: int, verify: bool, where: str, rec) -> torch.Tensor:
    """:func:`_fault_in`; a span whose mapped bytes fail their checksum is read again, from every tier."""
    try:
        return _fault_in(storage, r, mv, block, verify, where, rec)
    except CorruptCheckpointError:
        if not verify:
            raise
        # Name the damaged span exactly, and let tiered storage fall back to a slower copy.
        return _fetch(storage, r, block, True, where, None, rec)


def _execute_local(storage, reads: Sequence[ChunkRead], block, verify, where, stats, window: int, threads: int, rec=None) -> None:
    """Fetch in a thread pool, at most ``window`` bytes ahead of the copies.

    A reader thread verifies each block of a span it read or faulted in
    right after it landed, while the block is still in the CPU cache
    (xxhash releases the GIL, so this runs beside the loading thread). This
    thread verifies the batches of small spans read with one request, and
    does every copy. Spans that land whole on their destination are read
    straight into it; the rest are viewed in a mapping of the file where
    the backend offers one (:func:`_mapped`, :func:`_fault_in`), else read
    into a buffer.
    """
    groups = batch_reads(reads)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="shardpoint-read") as pool:
        pending: list = []
        ahead = 0
        i = 0
        while i < len(groups) or pending:
            while i < len(groups) and (not pending or ahead + _size(groups[i]) <= window):
                g = groups[i]
                direct = _direct_view(g[0]) if len(g) == 1 else None
                # A batch of small spans is one request into one buffer; a mapping would cost a call per span.
                view = _mapped(storage, g[0]) if direct is None and len(g) == 1 else None
                # A span read into memory alone, or mapped, is verified by its reader, block by block.
                pv = verify and len(g) == 1
                if view is not None:
                    fut = pool.submit(_fault_in_or_fetch, storage, g[0], view, block, pv, where, rec)
                    _count(stats, g[0])
                elif len(g) == 1:
                    fut = pool.submit(_fetch, storage, g[0], block, pv, where, direct, rec)
                    _count(stats, g[0])
                else:
                    fut = pool.submit(_fetch_group, storage, g, where, rec)
                    for r in g:
                        _count(stats, r)
                    gap = _size(g) - sum(r.hi - r.lo for r in g)
                    stats.bytes_read += gap
                    stats.per_file[g[0].chunk.file] += gap
                pending.append((g, direct, fut, pv))
                ahead += _size(g)
                i += 1
            g, direct, fut, pv = pending.pop(0)
            waiting = rec is not None and not fut.done()  # the loading thread idles until the read lands
            t0 = time.monotonic()
            bufs = fut.result()
            if waiting:
                rec.add("wait", t0, time.monotonic())
            ahead -= _size(g)
            if len(g) == 1:
                bufs = [bufs]
            for r, buf in zip(g, bufs):
                if verify and not pv:
                    buf = _verified(storage, r, buf, block, where, direct, rec)
                if direct is not None:
                    stats.direct_reads += 1
                else:
                    _copy_timed(r, buf, rec)


def _size(group: Sequence[ChunkRead]) -> int:
    a, b = _extent(group)
    return b - a if len(group) > 1 else group[0].hi - group[0].lo


def _span_id(r: ChunkRead) -> int:
    """A 63-bit name for a span, the same on every rank that plans it."""
    return xxhash.xxh3_64_intdigest("\0".join(map(str, r.key)).encode()) >> 1


@dataclass
class SharedSpan:
    """A span that several ranks need: ``reader`` fetches it and sends it to the others."""

    sid: int
    size: int
    reader: int
    needers: tuple[int, ...]


def plan_sharing(tables: Sequence[np.ndarray], world: int, rotate: int = 0) -> list[SharedSpan]:
    """Pick one reader per span needed by several ranks, balancing bytes (pure, no I/O).

    ``tables[q]`` holds rank ``q``'s rows ``(span id, size, file index,
    offset)``. The same input gives the same result, in the order the spans
    are processed (file, then offset). Ties between equally loaded needers
    go to the lowest rank counted from ``rotate``, so that owners planning
    disjoint sets of spans (:func:`route_sharing`) do not all pick rank 0.
    """
    rows = [np.asarray(t, dtype=np.int64).reshape(-1, 4) for t in tables]
    if not any(len(t) for t in rows):
        return []
    allr = np.concatenate(rows)
    owner = np.concatenate([np.full(len(t), q, dtype=np.int64) for q, t in enumerate(rows)])
    order = np.lexsort((owner, allr[:, 0]))
    allr, owner = allr[order], owner[order]
    ids = allr[:, 0]
    starts = np.concatenate(([0], np.nonzero(ids[1:] != ids[:-1])[0] + 1))
    counts = np.diff(np.concatenate((starts, [len(ids)])))
    shared = counts > 1
    spans = [
        (int(allr[i, 2]), int(allr[i, 3]), int(ids[i]), int(allr[i, 1]), tuple(int(q) for q in owner[i : i + n]))
        for i, n in zip(starts[shared], counts[shared])
    ]
    if not spans:
        return []
    # Greedy balance, largest first: each span goes to its least-loaded needer.
    load = [0] * world
    reader = {}
    for f, off, sid, size, needers in sorted(spans, key=lambda x: (-x[3], x[2])):
        best = min(needers, key=lambda q: (load[q], (q - rotate) % world))
        reader[sid] = best
        load[best] += size
    spans.sort(key=lambda x: (x[0], x[1], x[2]))
    return [SharedSpan(sid, size, reader[sid], needers) for _f, _o, sid, size, needers in spans]


def route_sharing(rows: np.ndarray, comm) -> list[SharedSpan]:
    """The shared spans this rank takes part in, planned by owners: no all-gather of plans.

    ``rows`` are this rank's ``(span id, size, file index, offset)``. Span
    ``s`` is planned by rank ``s % world``: each rank sends each row to its
    owner (one all-to-all), the owner picks a reader among the needers it
    heard from (:func:`plan_sharing`), and answers the reader with every
    needer and each other needer with the reader (a second all-to-all). A
    rank receives O(its own spans x their needers), never world x spans.
    The spans come back in one global order (file, offset, id) that every
    rank shares, which keeps the point-to-point transfers deadlock-free.
    """
    world, me = comm.world, comm.rank
    got = comm.all_to_all_rows([torch.from_numpy(p) for p in route_rows(rows, world)], 4)
    replies = owner_replies([g.numpy() for g in got], world, me)
    back = comm.all_to_all_rows([torch.from_numpy(r) for r in replies], 6)
    return collect_replies([b.numpy() for b in back])


def route_rows(rows: np.ndarray, world: int) -> list[np.ndarray]:
    """This rank's span rows split by owner (``span id % world``); pure."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    owner = rows[:, 0] % world
    return [np.ascontiguousarray(rows[owner == q]) for q in range(world)]


def owner_replies(tables: Sequence[np.ndarray], world: int, me: int) -> list[np.ndarray]:
    """An owner's answers: per rank, rows ``(span id, size, file, offset, reader, needer)``; pure.

    The reader of a span gets one row per needer (it sends to all of them);
    every other needer gets one row naming the reader.
    """
    plan = plan_sharing(tables, world, rotate=me)
    where = {int(r[0]): (int(r[2]), int(r[3])) for t in tables for r in np.asarray(t).reshape(-1, 4)}
    replies: list[list[list[int]]] = [[] for _ in range(world)]
    for sp in plan:
        f, off = where[sp.sid]
        for q in sp.needers:
            for n in (sp.needers if q == sp.reader else (q,)):
                replies[q].append([sp.sid, sp.size, f, off, sp.reader, n])
    return [np.array(r, dtype=np.int64).reshape(-1, 6) for r in replies]


def collect_replies(back: Sequence[np.ndarray]) -> list[SharedSpan]:
    """The shared spans of one rank from its owners' answers, in the global (file, offset, id) order; pure."""
    spans: dict[int, list] = {}
    for t in back:
        for sid, size, f, off, reader, n in np.asarray(t).reshape(-1, 6).tolist():
            spans.setdefault(sid, [f, off, size, reader, []])[4].append(n)
    order = sorted(spans.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
    return [SharedSpan(sid, size, reader, tuple(sorted(set(ns) | {reader}))) for sid, (_f, _o, size, reader, ns) in order]


def _one_host(comm) -> bool:
    """Whether every rank of ``comm`` runs on this host (a collective: one all-gather)."""
    hosts = comm.all_gather_rows(torch.tensor([[_host_id()]], dtype=torch.int64))
    return len({int(h[0, 0]) for h in hosts}) == 1


def _host_id() -> int:
    return xxhash.xxh3_64_intdigest(socket.gethostname().encode()) >> 1


def _execute_shared(storage, reads: Sequence[ChunkRead], comm, block, verify, where, stats, window: int, rec=None, threads: int = 2, file_index=None, sizes=None, saved_world: int = 1) -> None:
    """Read each span once across the ranks that need it; send it to the others.

    Ranks exchange a table of span ids (int64 rows, no pickling). Spans only
    one rank needs are read locally, in a background thread, while the shared
    ones stream: readers prefetch and send point to point, needers receive
    ahead into buffers, both bounded by ``window`` bytes. Every rank walks the
    shared spans in the same order and only ever waits on an earlier or the
    current span, so the exchange cannot deadlock.
    """
    file_index = file_index or {}
    by_id = {_span_id(r): r for r in reads}
    rows = np.array(
        [[sid, r.hi - r.lo, file_index.get(r.chunk.file, 0), r.chunk.offset + r.lo] for sid, r in by_id.items()],
        dtype=np.int64,
    ).reshape(-1, 4)
    tc = time.monotonic()
    mine = route_sharing(rows, comm)
    if rec is not None:
        rec.add("communicate", tc, time.monotonic())
    shared_ids = {sp.sid for sp in mine}
    me = comm.rank
    local = order_reads([r for sid, r in by_id.items() if sid not in shared_ids], me, comm.world, sizes or {}, saved_world)
    errors: list[BaseException] = []
    # Unshared spans: the ordinary prefetching path, beside the exchange.
    local_pool = ThreadPoolExecutor(1, thread_name_prefix="shardpoint-local")
    local_done = local_pool.submit(_execute_local, storage, local, block, verify, where, stats, window // 2, threads, rec)
    reads_pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="shardpoint-shared")

    def fetch_whole(r: ChunkRead, buf: torch.Tensor) -> None:
        whole = ChunkRead(r.fqn, r.ci, r.chunk, r.lo, r.hi, r.dtype, r.itemsize)  # other needers may need other runs
        _fetch(storage, whole, block, verify, where, buf[:-1], rec)
        _count(stats, whole)

    # Per span: ("read", future, buf) or ("recv", work, buf). Posted ahead in plan order.
    posted: list = []
    ahead = 0
    nxt = 0
    sends: list = []
    in_flight = 0
    half = max(1, window // 2)
    try:
        for i, sp in enumerate(mine):
            while nxt < len(mine) and (nxt <= i or ahead + mine[nxt].size <= half):
                q = mine[nxt]
                buf = torch.empty(q.size + 1, dtype=torch.uint8)  # last byte: 1 = good data, 0 = reader failed
                if q.reader == me:
                    posted.append(("read", reads_pool.submit(fetch_whole, by_id[q.sid], buf), buf))
                else:
                    posted.append(("recv", dist.irecv(buf, src=comm._global(q.reader), group=comm.group), buf))
                ahead += q.size
                nxt += 1
            kind, work, buf = posted.pop(0)
            ahead -= sp.size
            r = by_id[sp.sid]
            stats.shared_spans += 1
            tc = time.monotonic()
            if kind == "read":
                try:
                    work.result()
                    buf[sp.size] = 1
                except Exception as e:  # noqa: BLE001 - peers must still get an answer
                    errors.append(e)
                    buf[sp.size] = 0
                for q in sp.needers:
                    if q != me:
                        sends.append((dist.isend(buf, dst=comm._global(q), group=comm.group), sp.size))
                        in_flight += sp.size
                        stats.bytes_sent += sp.size
                while in_flight > half and sends:
                    h, n = sends.pop(0)
                    h.wait()
                    in_flight -= n
            else:
                work.wait()
                stats.bytes_received += sp.size
                if rec is not None:
                    rec.add("communicate", tc, time.monotonic(), sp.size)
                if int(buf[sp.size]) != 1:
                    if not errors:
                        errors.append(CorruptCheckpointError(
                            f"{where}: rank {sp.reader} could not read {r.chunk.file} for tensor {r.fqn!r}; see its error"
                        ))
                    continue
                if verify:  # what came over the wire is checked like what comes from storage
                    try:
                        verify_blocks(memoryview(buf[: sp.size].numpy()), r.chunk, r.lo // block, block, r.fqn, where)
                    except Exception as e:  # noqa: BLE001
                        errors.append(e)
                        continue
            if not errors:
                try:
                    _copy_timed(r, buf[: sp.size], rec)
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
        for h, _n in sends:
            h.wait()
    finally:
        reads_pool.shutdown(wait=True)
        local_pool.shutdown(wait=True)
    try:
        local_done.result()
    except Exception as e:  # noqa: BLE001
        errors.insert(0, e)
    if errors:
        raise errors[0]


def _exchange_only(comm) -> None:
    """Join the span exchange with no spans after a local failure.

    Peers then plan no sharing with this rank; the failure itself is reported
    by the collective check that follows the read phase.
    """
    route_sharing(np.zeros((0, 4), dtype=np.int64), comm)


def execute_reads(
    storage: Storage,
    manifest: Manifest,
    targets: Sequence[LoadTarget],
    where: str,
    verify: bool = True,
    comm=None,
    share: bool | str = "auto",
    window: int = 256 << 20,
    threads: int = 2,
    recorder=None,
) -> LoadStats:
    """Fill every target. ``share`` reads spans needed by several ranks only once.

    ``share="auto"`` shares unless every rank is on one host and the storage
    is page-cached (``Storage.page_cached``). With sharing and a process
    group, this is a collective: every rank of ``comm`` must call it, even
    with no targets.
    """
    if share not in (True, False, "auto"):
        raise ValueError(f"share_reads must be True, False or 'auto', got {share!r}")
    auto = share == "auto"
    if auto and not storage.page_cached:
        share, auto = True, False
    with _gc_paused():
        return _execute_reads(storage, manifest, targets, where, verify, comm, share, auto, window, threads, recorder)


@contextlib.contextmanager
def _gc_paused():
    """No automatic garbage collection while the reads run.

    The read phase allocates tens of thousands of short-lived objects; each
    young-generation collection promoted the live ones, and every few loads
    that triggered a full collection of the whole process (0.15 to 0.37 s
    for a training process holding about 290k tracked objects, longer than
    the resharding load itself). Paused, the objects die by reference
    counting before the next collection looks at them.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _execute_reads(storage, manifest, targets, where, verify, comm, share, auto, window, threads, recorder) -> LoadStats:
    stats = LoadStats()
    t_plan = time.monotonic()
    # Backends with high per-request latency (object stores) ask for more reads in flight
    # and for wider coalescing of nearby runs.
    threads = max(threads, int(storage.read_threads))
    coalesce = DEFAULT_COALESCE if storage.coalesce_bytes is None else int(storage.coalesce_bytes)
    group = comm is not None and comm.active and comm.world > 1
    # With auto, every rank on one host means page-cached storage: re-reads come from memory.
    share = share and group and not (auto and _one_host(comm))
    if share:
        try:
            reads = plan_chunk_reads(manifest, targets, where, verify, stats, coalesce)
            if recorder is not None:
                recorder.add("plan", t_plan, time.monotonic())
        except Exception:
            # Still take part in the exchange (with nothing), so no peer waits for this rank.
            _exchange_only(comm)
            raise
        files = {f: i for i, f in enumerate(sorted(manifest.files))}
        _execute_shared(storage, reads, comm, manifest.block_size, verify, where, stats, window, recorder, threads, files, dict(manifest.files), manifest.world_size)
    else:
        reads = plan_chunk_reads(manifest, targets, where, verify, stats, coalesce)
        if group:
            reads = order_reads(reads, comm.rank, comm.world, dict(manifest.files), manifest.world_size)
        if recorder is not None:
            recorder.add("plan", t_plan, time.monotonic())
        _execute_local(storage, reads, manifest.block_size, verify, where, stats, window, threads, recorder)
    return stats
