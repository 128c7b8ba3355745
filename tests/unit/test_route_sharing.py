"""Owner-routed sharing plans (no processes): each rank's two all-to-alls simulated by transposing lists.

The routed plan must give every needer of a span the same reader, give the
reader every needer, order spans identically everywhere, and keep what any
rank receives proportional to its own spans, never world x spans.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.planning.sharing import collect_replies, owner_replies, route_rows

SETTINGS = settings(max_examples=120, deadline=None)


def simulate(rows_per_rank, world):
    """Run route_sharing's pure steps for every rank; return each rank's spans and rows received."""
    sent = [route_rows(r, world) for r in rows_per_rank]  # sent[src][dst]
    got = [[sent[src][dst] for src in range(world)] for dst in range(world)]
    replies = [owner_replies(got[me], world, me) for me in range(world)]  # replies[owner][dst]
    back = [[replies[owner][dst] for owner in range(world)] for dst in range(world)]
    plans = [collect_replies(back[me]) for me in range(world)]
    received = [sum(len(t) for t in got[me]) + sum(len(t) for t in back[me]) for me in range(world)]
    return plans, received


@st.composite
def worlds(draw):
    world = draw(st.integers(2, 7))
    nspans = draw(st.integers(0, 30))
    # Span ids are hashes of (file, offset, range): distinct spans have distinct ids.
    sids = draw(st.lists(st.integers(1, 1 << 40), min_size=nspans, max_size=nspans, unique=True))
    spans = [(sid, draw(st.integers(1, 1000)), i % 3, i * 1000) for i, sid in enumerate(sids)]
    need = [[s for s in spans if draw(st.booleans())] for _ in range(world)]
    return world, spans, need


@given(worlds())
@SETTINGS
def test_routed_plans_agree_and_cover_every_shared_span(case):
    world, spans, need = case
    rows = [np.array(n, dtype=np.int64).reshape(-1, 4) for n in need]
    plans, _ = simulate(rows, world)
    needers = {}
    for q, n in enumerate(need):
        for s in n:
            needers.setdefault(s[0], set()).add(q)
    shared = {sid for sid, qs in needers.items() if len(qs) > 1}
    reader_of = {}
    for q, plan in enumerate(plans):
        assert {sp.sid for sp in plan} == {sid for sid in shared if q in needers[sid]}
        for sp in plan:
            assert reader_of.setdefault(sp.sid, sp.reader) == sp.reader  # one reader everywhere
            assert sp.reader in needers[sp.sid] and q in sp.needers
            if q == sp.reader:
                assert set(sp.needers) == needers[sp.sid]  # the reader knows whom to send to
    # One global order: each rank's list is a subsequence of the (file, offset, id) order.
    where = {s[0]: (s[2], s[3], s[0]) for s in spans}
    for plan in plans:
        keys = [where[sp.sid] for sp in plan]
        assert keys == sorted(keys)


def test_received_rows_stay_proportional_to_own_spans():
    # 64 ranks, each needing 50 spans of its own plus 10 spans shared with one neighbour.
    world = 64
    rows = []
    for q in range(world):
        own = [[(q << 20) + i, 100, 0, q * 10_000 + i] for i in range(50)]
        pair = [[(1 << 40) + ((q // 2) << 10) + i, 100, 1, i] for i in range(10)]
        rows.append(np.array(own + pair, dtype=np.int64))
    plans, received = simulate(rows, world)
    assert all(len(p) == 10 for p in plans)
    # An all-gather would hand every rank 64 x 60 rows; routing hands it about its own 60 plus replies.
    assert max(received) < 4 * 60, max(received)


def test_readers_are_spread_over_needers():
    # 4 replicas need the same 40 equal spans: each should read about a quarter.
    world = 4
    spans = [[i * 7 + 1, 100, 0, i * 100] for i in range(40)]
    rows = [np.array(spans, dtype=np.int64)] * world
    plans, _ = simulate(rows, world)
    reads = [sum(1 for sp in plans[q] if sp.reader == q) for q in range(world)]
    assert sum(reads) == 40 and max(reads) <= 14, reads
