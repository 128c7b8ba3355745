"""Properties of the load planners on random save and load layouts, with no processes and no I/O.

A tensor saved by one layout (row shards, a 2-D grid, column shards, flat
FSDP1-style ranges) is planned into another. The plan is then run on paper:
every copy is replayed element by element, so each target element must be
written exactly once, from the saved element that holds its global index,
out of bytes the plan reads, and no byte of a data file is read twice.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.format.manifest import DTYPE_SIZES, ChunkMeta, Manifest, TensorMeta
from shardpoint.geometry import Box, even_chunks
from shardpoint.planning.reads import SMALL_SPAN, ReadTarget, batch_reads, order_reads, plan_chunk_reads
from shardpoint.planning.sharing import collect_replies, owner_replies, plan_sharing, route_rows, span_rows

ALIGN = 64  # the writer's chunk alignment
NAMES = ("a", "b")  # two tensors of one geometry: planned once, read from their own chunks


def parts(shape: tuple[int, ...], kind: str, k: int, k2: int = 1) -> list[tuple[Box, tuple[int, int] | None]]:
    """The non-empty shards of ``shape`` under a layout of ``k`` (x ``k2``) ranks."""
    rest = tuple(shape[1:])
    if kind == "rows":
        out = [(Box((lo,) + (0,) * len(rest), (n,) + rest), None) for lo, n in even_chunks(shape[0], k)]
    elif kind == "cols":
        out = [(Box((0, lo), (shape[0], n)), None) for lo, n in even_chunks(shape[1], k)]
    elif kind == "grid":
        out = [
            (Box((r0, c0), (nr, nc)), None)
            for r0, nr in even_chunks(shape[0], k) for c0, nc in even_chunks(shape[1], k2)
        ]
    else:  # flat: FSDP1/ZeRO slices of the whole tensor's row-major order
        whole = Box((0,) * len(shape), tuple(shape))
        out = [(whole, (lo, lo + n)) for lo, n in even_chunks(math.prod(shape), k)]
    return [(b, f) for b, f in out if (b.numel if f is None else f[1] - f[0]) > 0]


def manifest(shape, save, dtype: str, block: int) -> Manifest:
    """Each saving rank writes its shard of every tensor into its own file, at aligned offsets."""
    isz = DTYPE_SIZES[dtype]
    chunks: dict[str, list[ChunkMeta]] = {n: [] for n in NAMES}
    files = {}
    for q, (box, flat) in enumerate(save):
        name, off = f"data/s-r{q:05d}.bin", 0
        for n in NAMES:
            nbytes = (box.numel if flat is None else flat[1] - flat[0]) * isz
            sums = tuple("0" * 16 for _ in range(max(1, -(-nbytes // block))))
            chunks[n].append(ChunkMeta(box, name, off, nbytes, sums, flat, q))
            off = -(-(off + nbytes) // ALIGN) * ALIGN
        files[name] = off
    tensors = {n: TensorMeta(dtype, tuple(shape), tuple(c)) for n, c in chunks.items()}
    return Manifest("x", len(save), block, tensors, {}, files, {})


def elements(box: Box, flat, shape) -> np.ndarray:
    """Global row-major indices of the elements a (box, flat) shard holds, in its stored order."""
    idx = np.indices(box.sizes).reshape(len(shape), -1) + np.array(box.offsets)[:, None]
    lin = np.ravel_multi_index(tuple(idx), shape)
    return lin if flat is None else lin[flat[0] : flat[1]]


def replay(m: Manifest, targets: list[ReadTarget], reads, shape) -> list[np.ndarray]:
    """Run the plan on paper and check that it fills every target; return each read's copied chunk bytes."""
    isz = DTYPE_SIZES[m.tensors[NAMES[0]].dtype]
    block = m.block_size
    filled = [np.full(max(t.box.numel if t.flat is None else t.flat[1] - t.flat[0], 0), -1, dtype=np.int64) for t in targets]
    writes = [np.zeros(len(f), dtype=np.int64) for f in filled]
    file_bytes: dict[str, list[tuple[int, int]]] = {}
    copied = []
    assert [(r.chunk.file, r.chunk.offset + r.lo) for r in reads] == sorted((r.chunk.file, r.chunk.offset + r.lo) for r in reads)
    for r in reads:
        c = r.chunk
        assert 0 <= r.lo < r.hi <= c.nbytes
        readable = np.zeros(c.nbytes, dtype=bool)
        used = np.zeros(c.nbytes, dtype=bool)
        copied.append(used)
        for a, b in r.ranges():
            readable[a:b] = True
            file_bytes.setdefault(c.file, []).append((c.offset + a, c.offset + b))
        stored = elements(c.box, c.flat, shape)  # global index of each stored element of the chunk
        for job in r.jobs:
            t = targets[job.target]
            assert t.fqn == r.fqn
            mine = elements(t.box, t.flat, shape)
            where = {int(g): i for i, g in enumerate(mine)}
            for op in job.ops:
                reg = np.indices(op.region.sizes).reshape(len(shape), -1) + np.array(op.region.offsets)[:, None]
                rel = reg - np.array(op.src.box.offsets)[:, None]
                e = op.src.start + np.ravel_multi_index(tuple(rel), op.src.box.sizes)  # chunk elements copied
                for byte in range(isz):
                    assert readable[e * isz + byte].all(), "a copied byte lies outside what the plan reads"
                    used[e * isz + byte] = True
                glob = np.ravel_multi_index(tuple(reg), shape)
                assert (stored[e] == glob).all(), "the copy takes another element than the one it fills"
                local = np.array([where[int(g)] for g in glob], dtype=np.int64)
                np.add.at(writes[job.target], local, 1)
                filled[job.target][local] = stored[e]
    for t, f, w in zip(targets, filled, writes):
        assert (w == 1).all(), f"{t.fqn}: elements written {sorted(set(w.tolist()))} times"
        assert (f == elements(t.box, t.flat, shape)).all()
    assert sum(r.needed for r in reads) == sum(len(f) for f in filled) * isz
    for spans in file_bytes.values():  # no byte of a file is read twice
        spans.sort()
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))
    return copied


def check_segments(reads, copied, verify: bool, block: int, coalesce: int) -> None:
    """Segments are sorted, disjoint and within the chunk, and read nothing they could skip."""
    for r, used in zip(reads, copied):
        for a, b in r.ranges():
            if verify:  # every checksum block read holds a copied byte
                assert all(used[x : x + block].any() for x in range(a - a % block, b, block))
            else:  # starts and ends on copied bytes, with no skipped stretch wider than coalesce inside
                inside = used[a:b]
                assert inside[0] and inside[-1]
                holes = np.diff(np.flatnonzero(inside)) - 1
                assert holes.max(initial=0) <= coalesce
        if verify:
            assert r.lo % block == 0 and (r.hi % block == 0 or r.hi == r.chunk.nbytes)
        if r.segments is None:
            continue
        segs = r.segments
        assert len(segs) >= 2 and segs[0][0] == r.lo and segs[-1][1] == r.hi
        assert all(a < b for a, b in segs)
        for (_, b0), (a1, _) in zip(segs, segs[1:]):
            assert a1 - b0 >= (block if verify else coalesce + 1)  # joined otherwise
        if verify:
            assert all(a % block == 0 and (b % block == 0 or b == r.chunk.nbytes) for a, b in segs)


def targets_of(shape, load, dtype: str) -> list[list[ReadTarget]]:
    return [[ReadTarget(n, dtype, tuple(shape), box, flat) for n in NAMES] for box, flat in load]


def check_layouts(shape, save, load, dtype="float32", block=64, verify=True, coalesce=0, replicas=1) -> None:
    m = manifest(shape, save, dtype, block)
    ranks = targets_of(shape, load, dtype) * replicas
    plans = []
    for rank, targets in enumerate(ranks):
        reads = plan_chunk_reads(m, targets, "t", verify, coalesce)
        copied = replay(m, targets, reads, shape)
        check_segments(reads, copied, verify, block, coalesce)
        check_order_and_batches(reads, rank, len(ranks), m)
        plans.append(reads)
    check_sharing(plans, m)


def check_order_and_batches(reads, rank: int, world: int, m: Manifest) -> None:
    ordered = order_reads(reads, rank, world, dict(m.files), m.world_size)
    assert sorted(map(id, ordered)) == sorted(map(id, reads))
    groups = batch_reads(ordered, ALIGN)
    assert [r for g in groups for r in g] == ordered
    for g in groups[:]:
        if len(g) > 1:  # only small whole spans of one file, separated by padding at most
            assert all(r.segments is None and r.hi - r.lo <= SMALL_SPAN and r.chunk.file == g[0].chunk.file for r in g)
            assert all(0 <= b.chunk.offset + b.lo - (a.chunk.offset + a.hi) < ALIGN for a, b in zip(g, g[1:]))


def check_sharing(plans, m: Manifest) -> None:
    """Each span several ranks need is read by exactly one of them and reaches every other one."""
    world = len(plans)
    file_index = {f: i for i, f in enumerate(sorted(m.files))}
    tables = [span_rows(reads, file_index) for reads in plans]
    needers: dict[int, set[int]] = {}
    for q, (by_id, _rows) in enumerate(tables):
        for sid in by_id:
            needers.setdefault(sid, set()).add(q)
    shared = {sid: qs for sid, qs in needers.items() if len(qs) > 1}
    plan = plan_sharing([rows for _, rows in tables], world)
    assert len(plan) == len({s.sid for s in plan})  # one entry, so one reader, per span
    assert {s.sid for s in plan} == set(shared)
    for s in plan:
        assert set(s.needers) == shared[s.sid] and s.reader in s.needers
        keys = {tables[q][0][s.sid].key for q in s.needers}
        assert len(keys) == 1 and s.size == tables[s.reader][0][s.sid].hi - tables[s.reader][0][s.sid].lo
    # The routed version (two all-to-alls, simulated by transposing lists) agrees on every rank.
    sent = [route_rows(rows, world) for _, rows in tables]
    replies = [owner_replies([sent[src][me] for src in range(world)], world, me) for me in range(world)]
    routed = [collect_replies([replies[owner][me] for owner in range(world)]) for me in range(world)]
    reader: dict[int, int] = {}
    for q, spans in enumerate(routed):
        assert {s.sid for s in spans} == {sid for sid, qs in shared.items() if q in qs}
        for s in spans:
            assert reader.setdefault(s.sid, s.reader) == s.reader and s.reader in shared[s.sid]
            if q == s.reader:
                assert set(s.needers) == shared[s.sid]  # the reader sends to every other needer


KINDS_1D = ("rows", "flat")
KINDS_2D = ("rows", "cols", "grid", "flat")


@st.composite
def cases(draw):
    if draw(st.booleans()):
        shape = (draw(st.integers(1, 40)),)
        kinds = KINDS_1D
    else:
        shape = (draw(st.integers(1, 10)), draw(st.integers(1, 10)))
        kinds = KINDS_2D
    save = parts(shape, draw(st.sampled_from(kinds)), draw(st.integers(1, 8)), draw(st.integers(1, 3)))
    load = parts(shape, draw(st.sampled_from(kinds)), draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    return dict(
        shape=shape, save=save, load=load,
        dtype=draw(st.sampled_from(["float32", "float16", "float64", "int8"])),
        block=draw(st.sampled_from([16, 64, 256])),
        verify=draw(st.booleans()),
        coalesce=draw(st.sampled_from([0, 8, 100])),
        replicas=draw(st.integers(1, 3)),
    )


@settings(max_examples=250, deadline=None)
@given(cases())
def test_random_layouts_plan_every_needed_byte_once(case):
    check_layouts(**case)


@pytest.mark.parametrize("verify", [True, False])
def test_eight_row_shards_into_three_ranks(verify):
    shape = (24, 10)
    check_layouts(shape, parts(shape, "rows", 8), parts(shape, "rows", 3), verify=verify, coalesce=8)
    check_layouts(shape, parts(shape, "rows", 8), parts(shape, "cols", 3), verify=verify, coalesce=8)


@pytest.mark.parametrize("verify", [True, False])
def test_two_dim_grid_into_one_dim(verify):
    shape = (12, 9)
    check_layouts(shape, parts(shape, "grid", 4, 2), parts(shape, "rows", 3), verify=verify, replicas=2)
    check_layouts(shape, parts(shape, "grid", 4, 2), parts(shape, "flat", 5), verify=verify)


@pytest.mark.parametrize("coalesce", [0, 4, 8, 12])
def test_runs_join_exactly_within_the_coalescing_distance(coalesce):
    shape = (4, 3)  # column shards of 2 and 1 float32: the runs lie 4 and 8 bytes apart
    check_layouts(shape, parts(shape, "rows", 1), parts(shape, "cols", 2), verify=False, coalesce=coalesce)
    m = manifest(shape, parts(shape, "rows", 1), "float32", 64)
    (r,) = plan_chunk_reads(m, targets_of(shape, parts(shape, "cols", 2), "float32")[0][:1], "t", False, coalesce)
    assert r.segments == (None if coalesce >= 4 else tuple((12 * i, 12 * i + 8) for i in range(4)))


def test_replicated_targets_share_every_span():
    shape = (16, 8)
    m = manifest(shape, parts(shape, "rows", 4), "float32", 64)
    ranks = targets_of(shape, parts(shape, "rows", 1), "float32") * 3  # three replicas of the whole tensor
    plans = [plan_chunk_reads(m, t, "t", True) for t in ranks]
    plan = plan_sharing([span_rows(p, {})[1] for p in plans], 3)
    assert len(plan) == 2 * 4 and all(s.needers == (0, 1, 2) for s in plan)
    load = [sum(s.size for s in plan if s.reader == q) for q in range(3)]
    assert max(load) - min(load) <= 16 * 8 * 4 // 4  # balanced to within one span
    check_sharing(plans, m)


def test_a_failing_property_is_caught():
    """The replay notices a plan that skips a copy: the checks can fail."""
    import dataclasses

    shape = (8, 4)
    m = manifest(shape, parts(shape, "rows", 2), "float32", 64)
    targets = targets_of(shape, parts(shape, "rows", 1), "float32")[0]
    reads = plan_chunk_reads(m, targets, "t", False)
    broken = [dataclasses.replace(reads[0], jobs=())] + reads[1:]
    with pytest.raises(AssertionError, match=r"elements written \[0, 1\] times"):
        replay(m, targets, broken, shape)
    narrowed = [dataclasses.replace(reads[0], segments=((reads[0].lo, reads[0].lo + 4), (reads[0].hi - 4, reads[0].hi)))] + reads[1:]
    with pytest.raises(AssertionError, match="a copied byte lies outside what the plan reads"):
        replay(m, targets, narrowed, shape)
