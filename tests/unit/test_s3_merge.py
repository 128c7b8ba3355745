"""The pure arithmetic behind merged S3 reads: runs of nearby ranges, GET cuts, and where body bytes land.

A simulated GET streams the object's bytes through :func:`scatter_plan` the
way the backend does, so a wrong plan shows up as a wrong byte in a buffer.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.storage.s3 import get_limit, merge_runs, run_gets, scatter_plan, split_run

SETTINGS = settings(max_examples=200, deadline=None)
MiB = 1 << 20


def test_merge_runs_gap_is_inclusive():
    spans = [(0, 100), (110, 200), (211, 300)]
    assert merge_runs(spans, 10) == [(0, 200, [0, 1]), (211, 300, [2])]
    assert merge_runs(spans, 11) == [(0, 300, [0, 1, 2])]
    assert merge_runs(spans, 0) == [(0, 100, [0]), (110, 200, [1]), (211, 300, [2])]
    assert merge_runs([], 5) == []


def test_merge_runs_unordered_and_overlapping():
    spans = [(500, 600), (0, 90), (50, 400), (100, 120), (395, 410)]
    assert merge_runs(spans, 0) == [(0, 410, [1, 2, 3, 4]), (500, 600, [0])]
    # A span inside a longer one does not shrink the run's end.
    assert merge_runs([(0, 1000), (10, 20), (1005, 1010)], 5) == [(0, 1010, [0, 1, 2])]


def test_merge_runs_never_adds_a_get():
    # Two limit-sized reads 1 byte apart would need 3 GETs together, 2 apart: they stay apart.
    assert merge_runs([(0, 90), (91, 181)], 10, limit=90) == [(0, 90, [0]), (91, 181, [1])]
    # A small neighbour joins (1 + 1 GETs apart, 2 together), and so do two halves of one GET.
    assert merge_runs([(0, 90), (91, 100)], 10, limit=90) == [(0, 100, [0, 1])]
    assert merge_runs([(0, 50), (55, 100)], 10, limit=90) == [(0, 100, [0, 1])]


def test_split_run_examples():
    assert split_run(0, 100, 40) == [(0, 33), (33, 66), (66, 100)]
    # A 32 MiB weight and its 11 KB bias: two GETs at 16 MiB parts, not three.
    assert len(split_run(0, 32 * MiB + 11_000, 16 * MiB)) == 2
    assert split_run(7, 8, 16 * MiB) == [(7, 8)]
    assert len(split_run(0, 18 * MiB, 16 * MiB)) == 1  # within 9/8 of a part
    assert len(split_run(0, 18 * MiB + 1, 16 * MiB)) == 2


@SETTINGS
@given(st.integers(0, 10**9), st.integers(1, 10**8), st.integers(8, 64 * MiB))
def test_split_run_fewest_equal_pieces(start, length, part):
    cuts = split_run(start, start + length, part)
    limit = part + part // 8
    assert cuts[0][0] == start and cuts[-1][1] == start + length
    assert all(a < b for a, b in cuts) and all(cuts[i][1] == cuts[i + 1][0] for i in range(len(cuts) - 1))
    sizes = [b - a for a, b in cuts]
    assert max(sizes) <= limit and max(sizes) - min(sizes) <= 1
    assert len(cuts) == max(1, -(-length // limit))  # no fewer pieces could stay within the limit


def _simulate(obj: bytes, lo: int, hi: int, wants: list[tuple[int, int]]) -> list[bytes]:
    """Stream obj[lo:hi] into fresh buffers for ``wants`` through scatter_plan; return the buffers."""
    bufs = [bytearray(b - a) for a, b in wants]
    plan = scatter_plan(lo, hi, [(a, b, memoryview(buf)) for (a, b), buf in zip(wants, bufs)])
    assert sum(n for n, _ in plan) == hi - lo
    pos = lo
    for n, views in plan:
        assert all(len(v) == n for v in views)
        for v in views:
            v[:] = obj[pos : pos + n]
        pos += n
    return [bytes(b) for b in bufs]


def test_scatter_plan_gaps_and_overlaps():
    a, b = memoryview(bytearray(4)), memoryview(bytearray(2))
    plan = scatter_plan(0, 8, [(0, 4, a), (6, 8, b)])
    assert [(n, [v.obj is a.obj for v in vs]) for n, vs in plan] == [(4, [True]), (2, []), (2, [False])]
    obj = bytes(range(200))
    assert _simulate(obj, 10, 60, [(10, 30), (20, 40), (50, 60)]) == [obj[10:30], obj[20:40], obj[50:60]]


def _serve(obj: bytes, lo: int, hi: int, fed) -> None:
    """Stream ``obj[lo:hi]`` into the buffers as one GET's body would, following scatter_plan."""
    pos = lo
    for n, views in scatter_plan(lo, hi, fed):
        for v in views:
            v[:] = obj[pos : pos + n]
        pos += n


def test_scatter_plan_get_covers_part_of_each_want():
    """A run cut into several GETs: each GET fills only its slice of the wants it crosses."""
    obj = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    wants = [(0, 300), (310, 700), (700, 990)]
    bufs = [bytearray(b - a) for a, b in wants]
    for lo, hi in split_run(0, 990, 300):
        fed = [(a, b, memoryview(buf)) for (a, b), buf in zip(wants, bufs) if a < hi and b > lo]
        _serve(obj, lo, hi, fed)
    assert [bytes(b) for b in bufs] == [obj[a:b] for a, b in wants]


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 800)), min_size=1, max_size=12),
       st.integers(0, 300), st.integers(64, 2000))
def test_merged_reads_are_bit_exact(raw, gap, part):
    """Any set of waiting reads, merged and cut like the backend does, fills every buffer exactly."""
    obj = np.random.default_rng(len(raw)).integers(0, 256, 6000, dtype=np.uint8).tobytes()
    wants = [(a, a + n) for a, n in raw]
    bufs = [bytearray(b - a) for a, b in wants]
    gets = 0
    for start, end, idx in merge_runs(wants, gap, get_limit(part)):
        members = [(wants[i][0], wants[i][1], memoryview(bufs[i])) for i in idx]
        covered = sum(b - a for a, b, _ in members)
        assert end - start <= covered + gap * (len(members) - 1)  # at most one gap between neighbours
        for lo, hi, which in run_gets(start, end, part, [(a, b) for a, b, _ in members]):
            gets += 1
            fed = [members[k] for k in which]
            assert fed, "every GET feeds some read"
            assert fed == [m for m in members if m[0] < hi and m[1] > lo]
            _serve(obj, lo, hi, fed)
    assert [bytes(b) for b in bufs] == [obj[a:b] for a, b in wants]
    unmerged = sum(max(1, -(-(b - a) // get_limit(part))) for a, b in wants)
    assert gets <= unmerged  # merging never costs more requests than reading apart


def test_a_get_that_would_land_in_a_gap_is_dropped():
    """Equal cuts of a merged run can put one piece wholly between two wants: it is not requested."""
    wants = [(0, 93), (174, 175), (231, 232)]
    assert [(lo, hi) for lo, hi in split_run(0, 232, 69)] == [(0, 58), (58, 116), (116, 174), (174, 232)]
    assert run_gets(0, 232, 69, wants) == [(0, 58, [0]), (58, 116, [0]), (174, 232, [1, 2])]
