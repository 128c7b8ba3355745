"""The read queue: waiting ``readinto`` calls of one storage tree, served by merged ranged GETs.

The queue holds the threads and the bookkeeping; what to merge and how to
cut it comes from the pure :mod:`~shardpoint.storage.s3.planner`, and each
GET is run by :meth:`S3Storage.get_scatter`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .planner import get_limit, merge_runs, run_gets

if TYPE_CHECKING:
    from .client import Shared
    from .storage import S3Storage

__all__ = ["Want", "ReadQueue"]


class Want:
    """One waiting ``readinto``: a byte range of one object and the buffer it fills."""

    __slots__ = ("storage", "key", "name", "start", "end", "mv", "left", "avail", "error", "done")

    def __init__(self, storage: "S3Storage", key: str, name: str, start: int, mv: memoryview):
        self.storage, self.key, self.name = storage, key, name
        self.start, self.end, self.mv = start, start + len(mv), mv
        self.left = 0  # GETs still running for it
        self.avail = len(mv)  # bytes the object holds from start (less when a GET found its end)
        self.error: BaseException | None = None
        self.done = threading.Event()


class ReadQueue:
    """Waiting reads of one storage tree, served by at most ``max_concurrency`` GETs at a time.

    When a GET slot is free, the oldest waiting read is taken with every
    waiting read of the same object within ``read_merge_gap`` of it, and the
    run is cut by :func:`split_run`. Reads wait only for a free slot, with
    one exception: a small read (under 1/8 of ``read_part_size``) of an
    object that already has GETs running does not start a GET of its own
    until a larger read of that object arrives (it joins that read's run
    when close) or the object's running GETs have all finished, so that it
    rides along with a neighbour instead of costing a request. A load
    consumes its reads in file order, behind the larger reads in flight, so
    this rarely delays what it waits for.
    """

    def __init__(self, shared: "Shared"):
        self._shared = shared
        self._lock = threading.Lock()
        self._pending: list[Want] = []
        self._in_flight = 0
        self._busy: dict[str, int] = {}  # object key -> GETs running

    def read(self, storage: "S3Storage", key: str, name: str, start: int, mv: memoryview) -> int:
        """Fill ``mv`` from ``start`` of ``key``; return how many bytes the object had there."""
        w = Want(storage, key, name, start, mv)
        with self._lock:
            self._pending.append(w)
            jobs = self._take()
        self._submit(jobs)
        w.done.wait()
        if w.error is not None:
            raise w.error
        return min(len(mv), w.avail)

    def _take(self) -> list[tuple[int, int, list[Want]]]:
        """Under the lock: the GETs to start now, each with the reads it feeds."""
        o = self._shared.options
        jobs = []
        small = o.read_part_size // 8
        while self._in_flight < o.max_concurrency:
            # The oldest read that may start a run. Held ones still join the run of a neighbour.
            head = next((w for w in self._pending if w.end - w.start >= small or not self._busy.get(w.key)), None)
            if head is None:
                break
            same = [w for w in self._pending if w.key == head.key]
            spans = [(w.start, w.end) for w in same]
            for start, end, idx in merge_runs(spans, o.read_merge_gap or 0, get_limit(o.read_part_size)):
                members = [same[i] for i in idx]
                if head in members:
                    break
            taken = set(map(id, members))
            self._pending = [w for w in self._pending if id(w) not in taken]
            gets = run_gets(start, end, o.read_part_size, [(w.start, w.end) for w in members])
            for lo, hi, idx in gets:
                fed = [members[i] for i in idx]
                for w in fed:
                    w.left += 1
                jobs.append((lo, hi, fed))
            self._in_flight += len(gets)
            self._busy[head.key] = self._busy.get(head.key, 0) + len(gets)
        return jobs

    def _submit(self, jobs: list[tuple[int, int, list[Want]]]) -> None:
        for job in jobs:
            try:
                self._shared.pool.submit(self._run, job)
            except BaseException as e:  # noqa: BLE001 - a shut-down pool: fail the reads, never hang them
                self._finished(job, e, 0)

    def _run(self, job: tuple[int, int, list[Want]]) -> None:
        lo, hi, fed = job
        head = fed[0]
        try:
            got = head.storage.get_scatter(head.key, head.name, lo, hi, [(w.start, w.end, w.mv) for w in fed])
        except BaseException as e:  # noqa: BLE001 - handed to every read this GET feeds
            self._finished(job, e, 0)
        else:
            self._finished(job, None, got)

    def _finished(self, job: tuple[int, int, list[Want]], error: BaseException | None, got: int) -> None:
        lo, hi, fed = job
        done = []
        with self._lock:
            self._in_flight -= 1
            key = fed[0].key
            self._busy[key] -= 1
            if not self._busy[key]:
                del self._busy[key]
            self._shared.count_gets(1)
            for w in fed:
                if error is not None:
                    w.error = w.error or error
                elif got < hi - lo:  # the object ends at lo + got
                    w.avail = min(w.avail, max(0, lo + got - w.start))
                w.left -= 1
                if w.left == 0:
                    done.append(w)
            jobs = self._take()
        for w in done:
            w.done.set()
        self._submit(jobs)
