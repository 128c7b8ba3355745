"""The pure ranged-read planner: which GETs serve which waiting reads, and where their bytes land.

No I/O and no threads: :class:`~shardpoint.storage.s3.readqueue.ReadQueue`
asks it how to merge the reads waiting on one object (:func:`merge_runs`),
how to cut a merged run into GETs (:func:`split_run`, :func:`run_gets`),
and :meth:`S3Storage.get_scatter` how to stream one GET's body into the
buffers it feeds (:func:`scatter_plan`).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["merge_runs", "get_limit", "split_run", "run_gets", "scatter_plan"]

def merge_runs(
    spans: Sequence[tuple[int, int]], gap: int, limit: int | None = None
) -> list[tuple[int, int, list[int]]]:
    """Group byte spans ``[start, end)`` of one object into runs; pure.

    Spans (in any order, possibly overlapping) join a run when they start at
    most ``gap`` bytes after the end of what the run covers so far and, with
    a ``limit`` (the largest GET), when joining needs no more GETs than
    keeping them apart (two limit-sized reads with a gap between them stay
    two runs). Returns ``(start, end, indices into spans)`` per run, in file
    order.

    Example::

        merge_runs([(100, 200), (0, 90), (500, 600)], gap=16)
        # [(0, 200, [1, 0]), (500, 600, [2])]
    """

    def gets(n: int) -> int:
        return 1 if limit is None else max(1, -(-n // limit))

    order = sorted(range(len(spans)), key=lambda i: spans[i])
    runs: list[tuple[int, int, list[int]]] = []
    for i in order:
        a, b = spans[i]
        if runs and a - runs[-1][1] <= gap:
            s0, e0, members = runs[-1]
            e1 = max(e0, b)
            if gets(e1 - s0) <= gets(e0 - s0) + gets(b - a):
                members.append(i)
                runs[-1] = (s0, e1, members)
                continue
        runs.append((a, b, [i]))
    # A run that grew after its neighbour was left apart may now be worth joining to it: settle
    # until no two neighbouring runs pass the joining rule (each join removes a run, so this ends).
    joined = True
    while joined and len(runs) > 1:
        joined = False
        for k in range(len(runs) - 1):
            (s0, e0, m0), (s1, e1, m1) = runs[k], runs[k + 1]
            if s1 - e0 <= gap and gets(max(e0, e1) - s0) <= gets(e0 - s0) + gets(e1 - s1):
                runs[k : k + 2] = [(s0, max(e0, e1), m0 + m1)]
                joined = True
                break
    return runs


def get_limit(part: int) -> int:
    """The largest ranged GET for ``read_part_size`` ``part``: 9/8 of it, so small neighbours ride along."""
    return part + part // 8


def split_run(start: int, end: int, part: int) -> list[tuple[int, int]]:
    """Cut ``[start, end)`` into the fewest equal ranges of at most ``part + part // 8`` bytes; pure.

    The 1/8 allowance lets a small neighbour ride along with a part-sized
    read (a 32 MiB weight and its bias: 2 GETs at 16 MiB parts, not 3).

    Example::

        split_run(0, 100, 40)   # [(0, 33), (33, 66), (66, 100)]
    """
    n = max(1, -(-(end - start) // get_limit(part)))
    cuts = [start + (end - start) * i // n for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


def run_gets(start: int, end: int, part: int, wants: Sequence[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """The GETs for a merged run: :func:`split_run`'s pieces with the wants each feeds; pure.

    A piece that lies wholly in a gap between wants feeds nothing and is
    dropped (equal cuts can land one there). Returns ``(lo, hi, indices into
    wants)`` per GET.

    Example::

        run_gets(0, 232, 69, [(0, 93), (174, 175), (231, 232)])
        # [(0, 58, [0]), (58, 116, [0]), (174, 232, [1, 2])]
    """
    out = []
    for lo, hi in split_run(start, end, part):
        fed = [i for i, (a, b) in enumerate(wants) if a < hi and b > lo]
        if fed:
            out.append((lo, hi, fed))
    return out


def scatter_plan(lo: int, hi: int, wants: Sequence[tuple[int, int, memoryview]]) -> list[tuple[int, list[memoryview]]]:
    """How the body of a GET of ``[lo, hi)`` lands in the waiting buffers; pure.

    ``wants`` are ``(start, end, buffer)`` with ``len(buffer) == end - start``.
    Returns consecutive ``(length, views)`` pieces covering ``[lo, hi)``:
    the slices of every buffer that wants those bytes, or no views for a gap.

    Example::

        a, b = memoryview(bytearray(4)), memoryview(bytearray(2))
        scatter_plan(0, 8, [(0, 4, a), (6, 8, b)])   # [(4, [a]), (2, []), (2, [b])]
    """
    points = {lo, hi}
    for s, e, _ in wants:
        points.update(p for p in (s, e) if lo < p < hi)
    cuts = sorted(points)
    out = []
    for p, q in zip(cuts, cuts[1:]):
        views = [mv[p - s : q - s] for s, e, mv in wants if s <= p and q <= e]
        out.append((q - p, views))
    return out
