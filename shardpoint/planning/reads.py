"""Which byte ranges of the data files each load target needs, merged and ordered (pure, no I/O).

Each target shard is intersected with the saved chunks; the needed elements
of one chunk become one byte *span* ``[lo, hi)`` (a :class:`ChunkRead`),
widened to checksum blocks when verifying so that everything read can be
verified. Where a span holds only some strided runs of the chunk, its
``segments`` list the byte ranges worth reading. :func:`order_reads` orders
the spans so that ranks on one disk stream different files, and
:func:`batch_reads` groups neighbouring small spans into one request.

A plan names its targets by their index in the list it was planned from; the
engine binds that index to the tensor it fills.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import CorruptCheckpointError, mismatch_error
from ..format.manifest import ChunkMeta, Manifest
from ..geometry import Box, runs_within
from .load_plan import ReadOp, SourceIndex, coverage_gaps, plan_reads

__all__ = [
    "ReadTarget", "CopyJob", "ChunkRead", "plan_chunk_reads", "plan_segments", "order_reads", "batch_reads",
    "extent", "at_blocks", "fault_pieces", "merge_intervals",
    "MAX_RUNS", "DEFAULT_COALESCE", "FOLLOW_LAG", "SMALL_SPAN", "BATCH_BYTES", "PREFETCH_GAP",
]

# A chunk with more needed runs than this is read as one span: listing the runs
# would cost more than the bytes it saves.
MAX_RUNS = 1 << 20
DEFAULT_COALESCE = 4096


# Plans of large loads hold tens of thousands of these records. The frozen
# dataclass __init__ sets each field through object.__setattr__, about four
# times the cost of filling the instance dict once; the records below do that.


@dataclass(frozen=True, init=False)
class ReadTarget:
    """What planning needs of one tensor to fill: its name, dtype name, global shape and place.

    ``box`` is the part of the global tensor it holds, optionally narrowed to
    the flat range ``flat`` of the box's row-major order.

    Example::

        ReadTarget("w", "float32", (8, 16), Box((0, 0), (4, 16)))
    """

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    flat: tuple[int, int] | None = None

    def __init__(self, fqn: str, dtype: str, shape: tuple[int, ...], box: Box, flat: tuple[int, int] | None = None):
        d = self.__dict__
        d["fqn"], d["dtype"], d["shape"], d["box"], d["flat"] = fqn, dtype, shape, box, flat


@dataclass(frozen=True, init=False)
class CopyJob:
    """The copies one chunk read feeds into one target (``target``: its index in the planned list)."""

    target: int
    ops: tuple[ReadOp, ...]

    def __init__(self, target: int, ops: tuple[ReadOp, ...]):
        d = self.__dict__
        d["target"], d["ops"] = target, ops


@dataclass(frozen=True, init=False)
class ChunkRead:
    """One byte span ``[lo, hi)`` of a saved chunk, and the copies it feeds.

    ``segments`` are the sub-ranges of ``[lo, hi)`` actually read (``None``:
    all of it); a buffer still spans ``[lo, hi)`` and the gaps hold bytes no
    copy looks at. ``needed`` counts the bytes the copies take from it.
    """

    fqn: str
    ci: int
    chunk: ChunkMeta
    lo: int
    hi: int
    dtype: str
    itemsize: int
    jobs: tuple[CopyJob, ...] = ()
    segments: tuple[tuple[int, int], ...] | None = None
    needed: int = 0

    def __init__(
        self, fqn: str, ci: int, chunk: ChunkMeta, lo: int, hi: int, dtype: str, itemsize: int,
        jobs: tuple[CopyJob, ...] = (), segments: tuple[tuple[int, int], ...] | None = None, needed: int = 0,
    ):
        d = self.__dict__
        d["fqn"], d["ci"], d["chunk"], d["lo"], d["hi"], d["dtype"], d["itemsize"] = fqn, ci, chunk, lo, hi, dtype, itemsize
        d["jobs"], d["segments"], d["needed"] = jobs, segments, needed

    @property
    def key(self) -> tuple[str, int, int, int]:
        """The span's file, chunk offset and range: the same on every rank that plans it."""
        # The chunk's file and offset, not its index: ranks may resolve different
        # subsets of a tensor's chunks (format version 2), so indexes differ.
        return (self.chunk.file, self.chunk.offset, self.lo, self.hi)

    @property
    def nread(self) -> int:
        """Bytes this read fetches from storage."""
        if self.segments is None:
            return self.hi - self.lo
        return sum(b - a for a, b in self.segments)

    def ranges(self) -> Sequence[tuple[int, int]]:
        """The chunk-relative byte ranges to read: the segments, or the whole span."""
        return ((self.lo, self.hi),) if self.segments is None else self.segments


def _overlapping(ops: Sequence[ReadOp]) -> bool:
    for i in range(len(ops)):
        for j in range(i + 1, len(ops)):
            if ops[i].region.intersect(ops[j].region) is not None:
                return True
    return False


def _needed_intervals(jobs: Sequence[CopyJob], itemsize: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Byte ``[start, end)`` of every needed run of the jobs' chunk, or None when too many."""
    starts, lens = [], []
    total = 0
    for job in jobs:
        for op in job.ops:
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
    st = np.concatenate(starts) * itemsize
    return st, st + np.concatenate(lens) * itemsize


def merge_intervals(lo: np.ndarray, hi: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """Union of intervals ``[lo, hi)``, joining those less than ``gap`` apart (``gap=0``: only touching ones).

    Example::

        merge_intervals(np.array([0, 10, 30]), np.array([5, 20, 40]), 5)   # [(0, 20), (30, 40)]
    """
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])
    brk = np.nonzero(lo[1:] > hi[:-1] + gap)[0]
    first = np.concatenate(([0], brk + 1))
    last = np.concatenate((brk, [len(lo) - 1]))
    return [(int(lo[a]), int(hi[b])) for a, b in zip(first, last)]


def _segments(
    jobs: Sequence[CopyJob], span: tuple[int, int], chunk: ChunkMeta, itemsize: int, verify: bool, block: int, coalesce: int
) -> tuple[tuple[int, int], ...] | None:
    lo, hi = span
    if verify and hi - lo <= block:
        return None  # one checksum block: read it whole
    if len(jobs) == 1 and len(jobs[0].ops) == 1:
        op = jobs[0].ops[0]
        if not runs_within(op.src.box, op.region).counts:
            return None  # one contiguous run, already the span
    iv = _needed_intervals(jobs, itemsize)
    if iv is None or len(iv[0]) <= 1:
        return None
    st, en = iv
    if verify:  # whole checksum blocks, so that everything read can be verified
        merged = merge_intervals(st // block, (en + block - 1) // block, 0)
        segs = [(a * block, min(b * block, chunk.nbytes)) for a, b in merged]
    else:
        segs = merge_intervals(st, en, coalesce)
    if len(segs) == 1 and segs[0] == (lo, hi):
        return None
    return tuple(segs)


def plan_segments(r: ChunkRead, verify: bool, block: int, coalesce: int) -> tuple[tuple[int, int], ...] | None:
    """What of ``r``'s span to read: the needed runs, widened to checksum blocks when verifying.

    Runs closer than ``coalesce`` bytes are read as one (one request costs more
    than a small gap). ``None`` means the whole span ``[lo, hi)``.
    """
    return _segments(r.jobs, (r.lo, r.hi), r.chunk, r.itemsize, verify, block, coalesce)


@dataclass(frozen=True)
class _ChunkPart:
    """What one target needs of one saved chunk, in elements of the chunk's stored order."""

    ci: int
    ops: tuple[ReadOp, ...]
    lo: int
    hi: int
    numel: int


def _plan_target(idx: SourceIndex, box: Box, flat: tuple[int, int] | None) -> tuple[int, list[_ChunkPart]]:
    """Geometry of one target: its coverage gap (0: exact, <0: overlaps) and what it needs of each chunk."""
    ops = plan_reads(idx, box, flat)
    gap = coverage_gaps(ops, box, flat)
    if gap == 0 and len(ops) <= 256 and _overlapping(ops):
        gap = -1  # an overlap hidden by an equal-sized hole
    by_chunk: dict[int, list[ReadOp]] = defaultdict(list)
    for op in ops:
        by_chunk[op.chunk].append(op)
    parts = []
    for ci, cops in by_chunk.items():
        spans = [runs_within(op.src.box, op.region).span for op in cops]
        lo_e = min(op.src.start + a for op, (a, _b) in zip(cops, spans))
        hi_e = max(op.src.start + b for op, (_a, b) in zip(cops, spans))
        parts.append(_ChunkPart(ci, tuple(cops), lo_e, hi_e, sum(op.region.numel for op in cops)))
    return gap, parts


class _Span:
    """A chunk read while targets widen it: mutable, and private to :func:`plan_chunk_reads`."""

    __slots__ = ("fqn", "ci", "chunk", "dtype", "itemsize", "lo", "hi", "jobs", "needed")

    def __init__(self, fqn: str, ci: int, chunk: ChunkMeta, dtype: str, itemsize: int, lo: int, hi: int):
        self.fqn, self.ci, self.chunk, self.dtype, self.itemsize = fqn, ci, chunk, dtype, itemsize
        self.lo, self.hi = lo, hi
        self.jobs: list[CopyJob] = []
        self.needed = 0


def plan_chunk_reads(
    manifest: Manifest, targets: Sequence[ReadTarget], where: str, verify: bool, coalesce: int = DEFAULT_COALESCE,
) -> list[ChunkRead]:
    """Group every target's read ops by saved chunk, one span per chunk, in file order.

    Where the targets need only some strided runs of a chunk, the span's
    ``segments`` list the byte ranges to read (see :func:`plan_segments`).
    Raises :class:`ShapeMismatchError` for a target whose dtype or shape
    differs from the checkpoint's, and :class:`CorruptCheckpointError` when
    the saved chunks do not cover a target exactly once.

    Example::

        reads = plan_chunk_reads(manifest, [ReadTarget("w", "float32", (8, 16), Box((0, 0), (4, 16)))], "ckpt", True)
        sum(r.needed for r in reads)   # 256: 4 x 16 float32 values
    """
    block = manifest.block_size
    spans: dict[tuple[str, int], _Span] = {}
    # The plan of a target depends only on the geometry (saved chunk boxes, target box), which
    # every layer's weights and their optimizer states share: planned once per geometry.
    indexes: dict[tuple, SourceIndex] = {}
    plans: dict[tuple, tuple[int, list[_ChunkPart]]] = {}
    for ti, tgt in enumerate(targets):
        fqn = tgt.fqn
        meta = manifest.tensors[fqn]
        if tuple(meta.shape) != tuple(tgt.shape) or meta.dtype != tgt.dtype:
            raise mismatch_error(where, fqn, (meta.dtype, meta.shape), (tgt.dtype, tgt.shape))
        src = tuple((c.box, c.flat) for c in meta.chunks)
        key = (src, tgt.box, tgt.flat)
        plan = plans.get(key)
        if plan is None:
            idx = indexes.get(src)
            if idx is None:
                idx = indexes[src] = SourceIndex(list(src))
            plan = plans[key] = _plan_target(idx, tgt.box, tgt.flat)
        gap, parts = plan
        if gap != 0:
            raise CorruptCheckpointError(
                f"{where}: tensor {fqn!r}: saved chunks cover the target shard "
                f"{'with overlaps' if gap < 0 else f'with {gap} elements missing'}; the manifest is inconsistent"
            )
        isz = meta.itemsize
        for p in parts:
            sp = spans.get((fqn, p.ci))
            if sp is None:
                sp = spans[(fqn, p.ci)] = _Span(fqn, p.ci, meta.chunks[p.ci], meta.dtype, isz, p.lo * isz, p.hi * isz)
            else:
                sp.lo, sp.hi = min(sp.lo, p.lo * isz), max(sp.hi, p.hi * isz)
            sp.jobs.append(CopyJob(ti, p.ops))
            sp.needed += p.numel * isz
    out = []
    for sp in sorted(spans.values(), key=lambda sp: (sp.chunk.file, sp.chunk.offset + sp.lo)):
        lo, hi, chunk = sp.lo, sp.hi, sp.chunk
        if verify:
            lo = (lo // block) * block
            hi = min(-(-hi // block) * block, chunk.nbytes)
        jobs = tuple(sp.jobs)
        segs = _segments(jobs, (lo, hi), chunk, sp.itemsize, verify, block, coalesce)
        out.append(ChunkRead(sp.fqn, sp.ci, chunk, lo, hi, sp.dtype, sp.itemsize, jobs, segs, sp.needed))
    return out


# How far behind a peer's expected position a rank reads the spans it shares
# with that peer: a fraction of the peer's part of the line (see order_reads).
FOLLOW_LAG = 0.1


def order_reads(reads: Sequence[ChunkRead], rank: int, world: int, files: Mapping[str, int], saved_world: int = 1) -> list[ChunkRead]:
    """Order ``reads`` so that ranks sharing a disk stream different files.

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


# Spans up to SMALL_SPAN bytes that follow each other in a file are read with one
# request, up to BATCH_BYTES. Only alignment padding may lie between them: a gap
# of the writer's alignment or more could hold another chunk (another rank's
# shared span, or a tensor this load does not want), which would be read for nothing.
SMALL_SPAN = 256 << 10
BATCH_BYTES = 4 << 20


def batch_reads(reads: Sequence[ChunkRead], align: int) -> list[list[ChunkRead]]:
    """Group neighbouring small spans into one request each, keeping the order.

    Norms, biases and step counts are many tiny chunks saved next to each
    other; one request per chunk cost more in Python and system-call overhead
    than the bytes themselves. Any other span is a group of its own. ``align``
    is the data files' chunk alignment: only a gap smaller than it (padding)
    may lie between two spans of a group.
    """
    out: list[list[ChunkRead]] = []
    total = 0
    for r in reads:
        small = r.segments is None and r.hi - r.lo <= SMALL_SPAN
        if small and out:
            last = out[-1][-1]
            gap = r.chunk.offset + r.lo - (last.chunk.offset + last.hi)
            if (last.segments is None and last.hi - last.lo <= SMALL_SPAN and last.chunk.file == r.chunk.file
                    and 0 <= gap < align and total + gap + r.hi - r.lo <= BATCH_BYTES):
                out[-1].append(r)
                total += gap + r.hi - r.lo
                continue
        out.append([r])
        total = r.hi - r.lo
    return out


def extent(group: Sequence[ChunkRead]) -> tuple[int, int]:
    """File offsets ``[start, end)`` that one request for ``group`` (a :func:`batch_reads` group) reads."""
    return group[0].chunk.offset + group[0].lo, group[-1].chunk.offset + group[-1].hi


def at_blocks(a: int, b: int, block: int) -> list[tuple[int, int]]:
    """``[a, b)`` cut at every multiple of ``block``.

    Example::

        at_blocks(3, 10, 4)   # [(3, 4), (4, 8), (8, 10)]
    """
    cuts = [a, *range((a // block + 1) * block, b, block), b]
    return list(zip(cuts, cuts[1:]))


# Needed ranges of a mapped span closer than this are brought in with one call:
# a strided span can hold thousands of runs, one system call each.
PREFETCH_GAP = 64 << 10


def fault_pieces(r: ChunkRead, verify: bool, block: int) -> Sequence[tuple[int, int]]:
    """The pieces of a mapped span to bring into memory with one call each.

    Checksum blocks when verifying (each is hashed as it lands), else the
    span's needed ranges joined across gaps under ``PREFETCH_GAP``.
    """
    rs = r.ranges()
    if verify:
        return [piece for a, b in rs for piece in at_blocks(a, b, block)]
    if len(rs) > 1:
        return merge_intervals(np.array([a for a, _ in rs]), np.array([b for _, b in rs]), PREFETCH_GAP)
    return rs
