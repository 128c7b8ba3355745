"""Properties of the pure S3 ranged-read planner, on random spans (no S3, no threads)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.storage.s3.planner import get_limit, merge_runs, run_gets, scatter_plan, split_run

spans_st = st.lists(
    st.tuples(st.integers(0, 5000), st.integers(1, 3000)).map(lambda t: (t[0], t[0] + t[1])), min_size=1, max_size=25
)


def _gets(n, limit):
    return 1 if limit is None else max(1, -(-n // limit))


@settings(max_examples=300, deadline=None)
@given(spans_st, st.integers(0, 2000), st.one_of(st.none(), st.integers(1, 4000)))
def test_merge_runs_partitions_the_spans_into_ordered_covering_runs(spans, gap, limit):
    runs = merge_runs(spans, gap, limit)
    members = sorted(i for _, _, idx in runs for i in idx)
    assert members == list(range(len(spans)))  # every span in exactly one run
    for s, e, idx in runs:
        assert s == min(spans[i][0] for i in idx) and e == max(spans[i][1] for i in idx)
    starts = [s for s, _, _ in runs]
    assert starts == sorted(starts)
    for (s0, e0, _), (s1, e1, _) in zip(runs, runs[1:]):
        # Two runs stay apart only when the gap is too wide or joining would cost more GETs.
        assert s1 - e0 > gap or _gets(max(e0, e1) - s0, limit) > _gets(e0 - s0, limit) + _gets(e1 - s1, limit)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 50_000), st.integers(1, 9000))
def test_split_run_tiles_the_run_within_the_limit(start, length, part):
    pieces = split_run(start, start + length, part)
    assert pieces[0][0] == start and pieces[-1][1] == start + length
    assert all(a < b <= a + get_limit(part) for a, b in pieces)
    assert all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
    sizes = [b - a for a, b in pieces]
    assert max(sizes) - min(sizes) <= 1  # equal cuts
    assert len(pieces) == max(1, -(-length // get_limit(part)))  # the fewest


@settings(max_examples=300, deadline=None)
@given(spans_st, st.integers(1, 4000))
def test_run_gets_cover_every_want_and_feed_only_what_they_touch(spans, part):
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    gets = run_gets(start, end, part, spans)
    for lo, hi, fed in gets:
        assert fed and all(spans[i][0] < hi and spans[i][1] > lo for i in fed)
        assert all(i in fed for i, (a, b) in enumerate(spans) if a < hi and b > lo)
    for i, (a, b) in enumerate(spans):
        covered = sorted((max(lo, a), min(hi, b)) for lo, hi, fed in gets if i in fed)
        assert covered[0][0] == a and covered[-1][1] == b
        assert all(q == r for (_, q), (r, _) in zip(covered, covered[1:]))


@settings(max_examples=200, deadline=None)
@given(spans_st, st.integers(0, 6000), st.integers(1, 4000))
def test_scatter_plan_lands_every_byte_where_it_belongs(spans, lo, length):
    hi = lo + length
    body = bytes((i * 7 + 3) % 251 for i in range(hi))
    bufs = [bytearray(b - a) for a, b in spans]
    wants = [(a, b, memoryview(buf)) for (a, b), buf in zip(spans, bufs)]
    pieces = scatter_plan(lo, hi, wants)
    assert sum(n for n, _ in pieces) == hi - lo
    pos = lo
    for n, views in pieces:
        for v in views:
            v[:] = body[pos : pos + n]
        pos += n
    for (a, b), buf in zip(spans, bufs):
        for k in range(a, b):  # bytes inside the GET are the object's; the rest untouched
            assert buf[k - a] == (body[k] if lo <= k < hi else 0)


def test_a_run_that_grew_is_joined_to_its_neighbour_when_that_costs_no_more_gets():
    # (735, 1847) alone stays apart from (127, 545): 13 GETs joined against 4 + 8. Once (739, 1852)
    # extends it, joining costs 13 against 4 + 9, so the three spans become one run.
    assert merge_runs([(127, 545), (735, 1847), (739, 1852)], 748, 139) == [(127, 1852, [0, 1, 2])]
