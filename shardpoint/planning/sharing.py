"""Read once, share: which rank reads each span several ranks need, and whom it sends it to (pure).

A span is named by a 63-bit id (:func:`span_id`) that every rank planning it
computes alike. Each rank describes its spans as int64 rows
``(span id, size, file index, offset)`` (:func:`span_rows`). The engine routes
the rows of span ``s`` to its owner, rank ``s % world`` (:func:`route_rows`);
the owner picks a reader among the needers it heard from
(:func:`plan_sharing`) and answers each needer (:func:`owner_replies`); each
rank turns its answers into its :class:`SharedSpan` list
(:func:`collect_replies`). The exchanges themselves run in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import xxhash

from .reads import ChunkRead

__all__ = [
    "SharedSpan", "span_id", "span_rows", "plan_sharing", "route_rows", "owner_replies", "collect_replies",
    "ROW_COLUMNS", "REPLY_COLUMNS",
]

# A rank's span row: (span id, size, file index, offset in the file).
ROW_COLUMNS = 4
# An owner's answer row: a span row, then (reader, needer).
REPLY_COLUMNS = 6


@dataclass(frozen=True)
class SharedSpan:
    """A span that several ranks need: ``reader`` fetches it and sends it to the other ``needers``."""

    sid: int
    size: int
    reader: int
    needers: tuple[int, ...]


def span_id(r: ChunkRead) -> int:
    """A 63-bit name for a span, the same on every rank that plans it."""
    return xxhash.xxh3_64_intdigest("\0".join(map(str, r.key)).encode()) >> 1


def span_rows(reads: Sequence[ChunkRead], file_index: Mapping[str, int]) -> tuple[dict[int, ChunkRead], np.ndarray]:
    """This rank's spans by id, and their rows ``(span id, size, file index, offset)``.

    ``file_index`` numbers the data files alike on every rank (an unknown
    file counts as 0).
    """
    by_id = {span_id(r): r for r in reads}
    rows = np.array(
        [[sid, r.hi - r.lo, file_index.get(r.chunk.file, 0), r.chunk.offset + r.lo] for sid, r in by_id.items()],
        dtype=np.int64,
    ).reshape(-1, ROW_COLUMNS)
    return by_id, rows


def plan_sharing(tables: Sequence[np.ndarray], world: int, rotate: int = 0) -> list[SharedSpan]:
    """Pick one reader per span needed by several ranks, balancing bytes.

    ``tables[q]`` holds rank ``q``'s rows ``(span id, size, file index,
    offset)``. The same input gives the same result, in the order the spans
    are processed (file, then offset). Ties between equally loaded needers
    go to the lowest rank counted from ``rotate``, so that owners planning
    disjoint sets of spans do not all pick rank 0.

    Example::

        a = np.array([[7, 100, 0, 0]]); b = np.array([[7, 100, 0, 0]])
        plan_sharing([a, b], 2)   # [SharedSpan(sid=7, size=100, reader=0, needers=(0, 1))]
    """
    rows = [np.asarray(t, dtype=np.int64).reshape(-1, ROW_COLUMNS) for t in tables]
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


def route_rows(rows: np.ndarray, world: int) -> list[np.ndarray]:
    """This rank's span rows split by owner (``span id % world``)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, ROW_COLUMNS)
    owner = rows[:, 0] % world
    return [np.ascontiguousarray(rows[owner == q]) for q in range(world)]


def owner_replies(tables: Sequence[np.ndarray], world: int, me: int) -> list[np.ndarray]:
    """An owner's answers: per rank, rows ``(span id, size, file, offset, reader, needer)``.

    The reader of a span gets one row per needer (it sends to all of them);
    every other needer gets one row naming the reader.
    """
    plan = plan_sharing(tables, world, rotate=me)
    where = {int(r[0]): (int(r[2]), int(r[3])) for t in tables for r in np.asarray(t).reshape(-1, ROW_COLUMNS)}
    replies: list[list[list[int]]] = [[] for _ in range(world)]
    for sp in plan:
        f, off = where[sp.sid]
        for q in sp.needers:
            for n in (sp.needers if q == sp.reader else (q,)):
                replies[q].append([sp.sid, sp.size, f, off, sp.reader, n])
    return [np.array(r, dtype=np.int64).reshape(-1, REPLY_COLUMNS) for r in replies]


def collect_replies(back: Sequence[np.ndarray]) -> list[SharedSpan]:
    """The shared spans of one rank from its owners' answers, in the global (file, offset, id) order."""
    spans: dict[int, list] = {}
    for t in back:
        for sid, size, f, off, reader, n in np.asarray(t).reshape(-1, REPLY_COLUMNS).tolist():
            spans.setdefault(sid, [f, off, size, reader, []])[4].append(n)
    order = sorted(spans.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
    return [SharedSpan(sid, size, reader, tuple(sorted(set(ns) | {reader}))) for sid, (_f, _o, size, reader, ns) in order]
