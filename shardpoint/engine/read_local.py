"""Run a read plan on this rank alone: fetch spans, verify them, copy them into their targets.

A small pool of reader threads prefetches ahead of the loading thread under a
byte budget. A span that lands whole on a contiguous destination is read
straight into it; one whose bytes must be narrowed or hashed anyway is viewed
in a mapping of its file where the backend offers one; the rest are read
into buffers, neighbouring small spans with one request. Spans bound for an
accelerator are read into bounce buffers and copied to the device in the
background (:class:`~shardpoint.engine.bounce.BounceRing`)
while the next spans are read. The plan (which
spans, which segments, in which order) comes from
:mod:`shardpoint.planning.reads`; its copy jobs name targets by index into
``targets``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..device import on_host
from ..items import LoadTarget
from ..errors import CorruptCheckpointError
from ..geometry import row_major_strides, runs_within
from ..planning.reads import ChunkRead, at_blocks, batch_reads, extent, fault_pieces
from ..planning.split import split_span
from ..storage.base import ShortReadError, Storage
from ..format.datafile import ALIGN, verify_blocks
from .io import dest_view, read_chunk_into, short_file_error
from .bounce import ALIGN as SLOT_ALIGN, BounceRing, aligned

__all__ = ["LoadStats", "ReadJob", "execute_local", "fetch", "whole_span", "count_read", "copy_timed", "copy_pairs", "map_span", "fault_in",
           "strided_bytes", "fit_spans"]


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


@dataclass(frozen=True)
class ReadJob:
    """What every read of one load shares: where it reads from and into, how it checks, what it counts.

    ``window`` bounds the bytes read ahead of the copies, ``threads`` the
    reads in flight; ``stats`` is filled as the reads land.

    Example::

        job = ReadJob(storage, targets, storage.url, manifest.block_size, True, LoadStats(), 64 << 20, 2)
        execute_local(job, reads)
    """

    storage: Storage
    targets: Sequence[LoadTarget]
    where: str
    block: int
    verify: bool
    stats: LoadStats
    window: int
    threads: int
    rec: Any = None


def count_read(stats: LoadStats, r: ChunkRead) -> None:
    """Count ``r``'s bytes as read from storage."""
    stats.chunks_read += 1
    stats.bytes_read += r.nread
    stats.per_file[r.chunk.file] += r.nread


def copy_pairs(r: ChunkRead, buf: torch.Tensor, targets: Sequence[LoadTarget]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every ``(destination view, view of buf)`` copy that lands ``r``'s span (``buf``: its bytes)."""
    if not r.jobs:
        return []
    # Every job of a span fills the same tensor's shards, whose dtype the plan checked.
    typed = buf.view(targets[r.jobs[0].target].dest.dtype)
    base_e = r.lo // r.itemsize
    out = []
    for job in r.jobs:
        tgt = targets[job.target]
        for op in job.ops:
            strides = row_major_strides(op.src.box.sizes)
            run = runs_within(op.src.box, op.region)
            src = typed.as_strided(op.region.sizes, strides, typed.storage_offset() + op.src.start + run.base - base_e)
            out.append((dest_view(tgt, op), src))
    return out


def strided_bytes(r: ChunkRead, targets: Sequence[LoadTarget]) -> int:
    """Bytes of ``r``'s regions that are strided in its span (aligned as packed): what packing them takes.

    A region is strided when it is more than one run of its chunk's
    row-major order, as a column block of a row-major chunk is.

    Example::

        strided_bytes(r, targets)   # 0 when every region is one run
    """
    total = 0
    for job in r.jobs:
        for op in job.ops:
            if runs_within(op.src.box, op.region).counts:
                total += aligned(op.region.numel * r.itemsize)
    return total


def _copy_jobs(r: ChunkRead, buf: torch.Tensor, targets: Sequence[LoadTarget]) -> None:
    for dst, src in copy_pairs(r, buf, targets):
        dst.copy_(src)


def copy_timed(r: ChunkRead, buf: torch.Tensor, targets: Sequence[LoadTarget], rec) -> None:
    """Copy ``buf`` (the bytes of ``r``'s span) into every target it feeds; timed as "copy"."""
    t0 = time.monotonic()
    _copy_jobs(r, buf, targets)
    if rec is not None:
        rec.add("copy", t0, time.monotonic(), r.hi - r.lo)


def _direct_view(r: ChunkRead, targets: Sequence[LoadTarget]) -> torch.Tensor | None:
    """The destination bytes when the whole chunk lands on one contiguous host view."""
    if len(r.jobs) != 1 or r.lo != 0 or r.hi != r.chunk.nbytes or r.chunk.flat is not None or r.segments is not None:
        return None
    job = r.jobs[0]
    if len(job.ops) != 1 or job.ops[0].region != job.ops[0].src.box:
        return None
    dv = dest_view(targets[job.target], job.ops[0])
    if not dv.is_contiguous() or not on_host(dv) or dv.numel() * r.itemsize != r.chunk.nbytes:
        return None
    return dv.reshape(-1).view(torch.uint8)


def whole_span(r: ChunkRead) -> ChunkRead:
    """``r`` read whole, with no copies: what a rank fetches for peers that may need other runs."""
    return dataclasses.replace(r, jobs=(), segments=None, needed=0)


def fetch(storage: Storage, r: ChunkRead, block: int, verify: bool, where: str, into: torch.Tensor | None = None, rec=None) -> torch.Tensor:
    """The bytes of ``r``'s span (its segments filled), verified when asked; from another tier if corrupt."""
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
        rs = [piece for a, b in rs for piece in at_blocks(a, b, block)]
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


def _fetch_group(storage: Storage, group: Sequence[ChunkRead], where: str, rec, into: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One request for a group of neighbouring spans; a view of the buffer (or of ``into``) per span (not verified)."""
    a, b = extent(group)
    buf = torch.empty(b - a, dtype=torch.uint8) if into is None else into[: b - a]
    first = group[0]
    parts = []
    for r in group:
        o = r.chunk.offset + r.lo - a
        parts.append(buf[o : o + r.hi - r.lo])
    try:
        t0 = time.monotonic()
        read_chunk_into(storage, first.chunk, a - first.chunk.offset, memoryview(buf.numpy()), first.fqn, where)
        if rec is not None:
            rec.add("read", t0, time.monotonic(), b - a)
    except CorruptCheckpointError:
        # Span by span: names the damaged chunk, and lets tiered storage fall back per span.
        return [fetch(storage, r, 0, False, where, None if into is None else part, rec) for r, part in zip(group, parts)]
    if into is not None:
        return parts  # placed in the bounce slot so that every span starts on its element boundary
    # Typed views need aligned offsets.
    return [part if (r.chunk.offset + r.lo - a) % r.itemsize == 0 else part.clone() for r, part in zip(group, parts)]


def _verified(storage: Storage, r: ChunkRead, buf: torch.Tensor, block: int, where: str, into: torch.Tensor | None, rec) -> torch.Tensor:
    """``buf`` once its ranges match their checksums; else ``r`` read again, verified (other tiers too)."""
    t0 = time.monotonic()
    mv = memoryview(buf.numpy())
    try:
        for a, b in r.ranges():
            verify_blocks(mv[a - r.lo : b - r.lo], r.chunk, a // block, block, r.fqn, where)
    except CorruptCheckpointError:
        return fetch(storage, r, block, True, where, into, rec)
    if rec is not None:
        rec.add("verify", t0, time.monotonic(), r.nread)
    return buf


def map_span(storage: Storage, r: ChunkRead) -> memoryview | None:
    """A view of ``r``'s span in a mapping of its file, or None to read it instead.

    Where the bytes must be narrowed or hashed in memory anyway, reading them
    into a buffer first is one more copy of every byte; a view of the page
    cache skips it. The view is not yet backed by memory: :func:`fault_in`
    brings it in.
    """
    return storage.map_range(r.chunk.file, r.chunk.offset + r.lo, r.hi - r.lo, r.nread)


def fault_in(storage: Storage, r: ChunkRead, mv: memoryview, block: int, verify: bool, where: str, rec) -> torch.Tensor:
    """In a reader thread: bring a mapped span into memory, verifying each block as it lands.

    ``storage.populate`` reads the cold pages of each piece and maps them
    without holding the interpreter lock; the piece is hashed right after,
    while it is still in the CPU cache. The loading thread then only copies.
    """
    populate = storage.populate  # the default does nothing: the hash's page faults bring pages in
    for a, b in fault_pieces(r, verify, block):
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


def _fault_in_or_fetch(storage: Storage, r: ChunkRead, mv: memoryview, block: int, verify: bool, where: str, rec) -> torch.Tensor:
    """:func:`fault_in`; a span whose mapped bytes fail their checksum is read again, from every tier."""
    try:
        return fault_in(storage, r, mv, block, verify, where, rec)
    except CorruptCheckpointError:
        if not verify:
            raise
        # Name the damaged span exactly, and let tiered storage fall back to a slower copy.
        return fetch(storage, r, block, True, where, None, rec)


def _size(group: Sequence[ChunkRead]) -> int:
    a, b = extent(group)
    return b - a if len(group) > 1 else group[0].hi - group[0].lo


def _pad(g) -> int:
    """Where a group's bytes start in its bounce slot: each span then lies as aligned as in its file."""
    return extent(g)[0] % SLOT_ALIGN if len(g) > 1 else 0


def _submit(pool, job: ReadJob, g, slot):
    """Start fetching group ``g``; what the loading thread needs to finish it."""
    storage, targets, block, verify, where, stats, rec = job.storage, job.targets, job.block, job.verify, job.where, job.stats, job.rec
    # Into a bounce slot (bound for a device), else straight into a host destination.
    direct = _direct_view(g[0], targets) if len(g) == 1 and slot is None else None
    # A batch of small spans is one request into one buffer; a mapping would cost a call per span.
    view = map_span(storage, g[0]) if direct is None and slot is None and len(g) == 1 else None
    # A span read into memory alone, or mapped, is verified by its reader, block by block.
    pv = verify and len(g) == 1
    if view is not None:
        fut = pool.submit(_fault_in_or_fetch, storage, g[0], view, block, pv, where, rec)
        count_read(stats, g[0])
    elif len(g) == 1:
        into = direct if slot is None else slot.view
        fut = pool.submit(fetch, storage, g[0], block, pv, where, into, rec)
        count_read(stats, g[0])
    else:
        fut = pool.submit(_fetch_group, storage, g, where, rec, None if slot is None else slot.view[_pad(g) :])
        for r in g:
            count_read(stats, r)
        gap = _size(g) - sum(r.hi - r.lo for r in g)
        stats.bytes_read += gap
        stats.per_file[g[0].chunk.file] += gap
    return g, direct, fut, pv, slot


def _bounce_slot(bounce: BounceRing | None, g, targets, pending: list):
    """A bounce slot for ``g`` (a span, or a group of small ones) when it lands on the device; ``False`` to wait for earlier spans first."""
    if bounce is None or not bounce.serves(targets, [j.target for r in g for j in r.jobs]):
        return None
    if len(g) > 1 and any((r.chunk.offset + r.lo) % r.itemsize for r in g):
        return None  # a span off its element boundary in the file: its typed view would need a copy
    slot = bounce.slot(_pad(g) + _size(g), sum(strided_bytes(r, targets) for r in g))
    return False if slot is None and pending else slot


def execute_local(job: ReadJob, reads: Sequence[ChunkRead], bounce: BounceRing | None = None) -> None:
    """Fetch in a thread pool, at most ``job.window`` bytes ahead of the copies.

    A reader thread verifies each block of a span it read or faulted in
    right after it landed, while the block is still in the CPU cache
    (xxhash releases the GIL, so this runs beside the loading thread). This
    thread verifies the batches of small spans read with one request, and
    does every copy. Spans that land whole on their destination are read
    straight into it; the rest are viewed in a mapping of the file where
    the backend offers one (:func:`map_span`, :func:`fault_in`), else read
    into a buffer. With ``bounce``, a span bound for its device is read
    into a bounce slot (a batch of small spans into one) and its copies are
    queued on the device.
    """
    targets, rec, window = job.targets, job.rec, job.window
    if bounce is not None:
        reads = fit_spans(reads, bounce, job)
    groups = batch_reads(reads, ALIGN)
    with ThreadPoolExecutor(max(1, job.threads), thread_name_prefix="shardpoint-read") as pool:
        pending: list = []
        ahead = 0
        i = 0
        while i < len(groups) or pending:
            while i < len(groups) and (not pending or ahead + _size(groups[i]) <= window):
                slot = _bounce_slot(bounce, groups[i], targets, pending)
                if slot is False:
                    break
                pending.append(_submit(pool, job, groups[i], slot))
                ahead += _size(groups[i])
                i += 1
            g, direct, fut, pv, slot = pending.pop(0)
            waiting = rec is not None and not fut.done()  # the loading thread idles until the read lands
            t0 = time.monotonic()
            bufs = fut.result()
            if waiting:
                rec.add("wait", t0, time.monotonic())
            ahead -= _size(g)
            if len(g) == 1:
                bufs = [bufs]
            _finish(job, g, bufs, direct, pv, slot, bounce)


def fit_spans(reads: Sequence[ChunkRead], bounce: BounceRing, job: ReadJob) -> list[ChunkRead]:
    """``reads`` with every span bound for the ring's device cut to fit a slot (:func:`split_span`).

    The cut depends only on each span and the ring's size, so ranks that
    read the same span cut it alike (the shared path relies on it).

    Example::

        reads = fit_spans(reads, bounce, job)   # each span on the device <= bounce.span_limit (+ checksum blocks)
    """
    limit, out = bounce.span_limit, []
    for r in reads:
        if r.hi - r.lo > limit and bounce.serves(job.targets, [j.target for j in r.jobs]):
            out.extend(split_span(r, limit, job.block, job.verify))
        else:
            out.append(r)
    return out


def _finish(job: ReadJob, g, bufs, direct, pv: bool, slot, bounce: BounceRing | None) -> None:
    """On the loading thread: verify what the reader did not, then copy ``g``'s spans (a slot's with one landing)."""
    targets, rec = job.targets, job.rec
    pairs: list = []
    for r, buf in zip(g, bufs):
        if job.verify and not pv:
            # Read again where it lies (the slot, the destination), if it fails its checksums.
            buf = _verified(job.storage, r, buf, job.block, job.where, buf if slot is not None else direct, rec)
        if direct is not None:
            job.stats.direct_reads += 1
        elif slot is not None:
            pairs.extend(copy_pairs(r, buf, targets))
        else:
            copy_timed(r, buf, targets, rec)
    if slot is not None:
        t0 = time.monotonic()
        bounce.land(slot, pairs)
        if rec is not None:
            rec.add("copy", t0, time.monotonic(), sum(r.hi - r.lo for r in g))
