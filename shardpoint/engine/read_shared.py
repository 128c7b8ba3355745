"""Run a read plan across ranks: read each span several ranks need once, and send it to the others.

Ranks exchange int64 rows naming their spans through :class:`~shardpoint.dist.Comm`
(two all-to-alls, :func:`route_sharing`); owners choose readers with the pure
planner of :mod:`shardpoint.planning.sharing`. Replicas (DDP, HSDP) and TP
ranks that need the same blocks then read storage once between them.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import numpy as np
import torch

from ..dist import Comm
from ..errors import CorruptCheckpointError
from ..planning.reads import ChunkRead, order_reads
from ..planning.sharing import REPLY_COLUMNS, ROW_COLUMNS, SharedSpan, collect_replies, owner_replies, route_rows, span_rows
from ..format.datafile import verify_blocks
from ..device import Device
from .bounce import BounceRing, BounceSlot
from .read_local import ReadJob, copy_pairs, copy_timed, count_read, execute_local, fetch, fit_spans, strided_bytes, whole_span

__all__ = ["route_sharing", "exchange_only", "execute_shared"]


def route_sharing(rows: np.ndarray, comm: Comm) -> list[SharedSpan]:
    """The shared spans this rank takes part in, planned by owners: no all-gather of plans.

    ``rows`` are this rank's ``(span id, size, file index, offset)``. Span
    ``s`` is planned by rank ``s % world``: each rank sends each row to its
    owner (one all-to-all), the owner picks a reader among the needers it
    heard from (:func:`~shardpoint.planning.sharing.plan_sharing`), and
    answers the reader with every needer and each other needer with the
    reader (a second all-to-all). A rank receives O(its own spans x their
    needers), never world x spans. The spans come back in one global order
    (file, offset, id) that every rank shares, which keeps the point-to-point
    transfers deadlock-free.
    """
    world, me = comm.world, comm.rank
    got = comm.all_to_all_rows([torch.from_numpy(p) for p in route_rows(rows, world)], ROW_COLUMNS)
    replies = owner_replies([g.numpy() for g in got], world, me)
    back = comm.all_to_all_rows([torch.from_numpy(r) for r in replies], REPLY_COLUMNS)
    return collect_replies([b.numpy() for b in back])


def exchange_only(comm: Comm) -> None:
    """Join the span exchange with no spans after a local failure.

    Peers then plan no sharing with this rank; the failure itself is reported
    by the collective check that follows the read phase.
    """
    route_sharing(np.zeros((0, ROW_COLUMNS), dtype=np.int64), comm)


def execute_shared(
    job: ReadJob, reads: Sequence[ChunkRead], comm: Comm, sizes: Mapping[str, int] | None = None, saved_world: int = 1,
    device: Device | None = None,
) -> None:
    """Read each span once across the ranks that need it; send it to the others.

    Ranks exchange a table of span ids (int64 rows, no pickling). Spans only
    one rank needs are read locally, in a background thread, while the shared
    ones stream: readers prefetch and send point to point, needers receive
    ahead into buffers, both bounded by ``window`` bytes. Every rank walks the
    shared spans in the same order and only ever waits on an earlier or the
    current span, so the exchange cannot deadlock. A rank's own failure
    (a read, a checksum, a copy) is recorded and the walk goes on, sending
    failure marks, so no peer waits on it; only a failure of the transport
    ends the walk early, and then the sends still in flight finish before
    their memory is given back.

    With ``device``, spans bound for it are read or received into bounce
    rings (one for the local spans, one for the exchange, each half the
    window) and copied to the device in the background; a slot a rank sends
    from comes free once its sends and copies are complete. A span larger
    than a slot is first cut (:func:`~shardpoint.engine.read_local.fit_spans`);
    the cut is the same on every rank, so it stays shared.
    """
    half = max(1, job.window // 2)
    # Made on the caller's thread: their copies are ordered after what it queued before the load.
    rings = (BounceRing(device, half), BounceRing(device, half)) if device is not None else (None, None)
    try:
        _walk(job, reads, comm, sizes or {}, saved_world, rings, half)
    finally:
        for ring in rings:
            if ring is not None:
                ring.finish()


def _walk(job: ReadJob, reads: Sequence[ChunkRead], comm: Comm, sizes: Mapping[str, int], saved_world: int,
          rings: tuple[BounceRing | None, BounceRing | None], half: int) -> None:
    if rings[1] is not None:
        try:
            reads = fit_spans(reads, rings[1], job)
        except Exception:
            exchange_only(comm)  # no peer waits for this rank's rows
            raise
    file_index = {f: i for i, f in enumerate(sorted(sizes))}
    by_id, rows = span_rows(reads, file_index)
    tc = time.monotonic()
    mine = route_sharing(rows, comm)
    if job.rec is not None:
        job.rec.add("communicate", tc, time.monotonic())
    shared_ids = {sp.sid for sp in mine}
    local = order_reads([r for sid, r in by_id.items() if sid not in shared_ids], comm.rank, comm.world, sizes, saved_world)
    errors: list[BaseException] = []
    # Unshared spans: the ordinary prefetching path, beside the exchange.
    local_pool = ThreadPoolExecutor(1, thread_name_prefix="shardpoint-local")
    local_done = local_pool.submit(execute_local, dataclasses.replace(job, window=job.window // 2), local, rings[0])
    ex = _Exchange(job, comm, mine, by_id, errors, half, rings[1])
    try:
        ex.run()
    finally:
        ex.settle()
        ex.pool.shutdown(wait=True)
        local_pool.shutdown(wait=True)
    try:
        local_done.result()
    except Exception as e:  # noqa: BLE001
        errors.insert(0, e)
    if errors:
        raise errors[0]


class _Send:
    """A send's handle that may be waited for more than once (by the ring and the exchange); a process group's may not."""

    def __init__(self, handle):
        self.handle, self.done = handle, False

    def wait(self) -> None:
        if not self.done:
            self.handle.wait()
            self.done = True

    def is_completed(self) -> bool:
        return self.done or bool(self.handle.is_completed())


class _Exchange:
    """The shared spans' traffic on one rank: reads and receives posted ahead, sends bounded in flight."""

    def __init__(self, job: ReadJob, comm, mine, by_id, errors, half, bounce: BounceRing | None = None):
        self.storage, self.comm, self.mine, self.by_id = job.storage, comm, mine, by_id
        self.targets, self.bounce = job.targets, bounce
        self.block, self.verify, self.where, self.stats, self.rec, self.errors = job.block, job.verify, job.where, job.stats, job.rec, errors
        self.half = half
        self.pool = ThreadPoolExecutor(max(1, job.threads), thread_name_prefix="shardpoint-shared")
        # Per span: ("read", future, buf, slot) or ("recv", work, buf, slot). Posted ahead in plan order.
        self.posted: list = []
        self.ahead = 0
        self.nxt = 0
        self.sends: list = []
        self.in_flight = 0

    def run(self) -> None:
        """Walk the shared spans in plan order: post ahead, finish the next, deliver it."""
        for i, sp in enumerate(self.mine):
            self.post_ahead(i)
            kind, work, buf, slot = self.posted.pop(0)
            self.ahead -= sp.size
            self.stats.shared_spans += 1
            ok, sends = self.finish_read(sp, work, buf) if kind == "read" else (self.finish_recv(sp, work, buf), ())
            self.deliver(sp, buf, slot, ok and not self.errors, sends)

    def settle(self) -> None:
        """Wait for every send still in flight: the memory they read (a ring slot) is given back next.

        After the walk this is where the last sends finish; after a transport
        failure, a send's own error is kept behind the first one.
        """
        while self.sends:
            h, n = self.sends.pop(0)
            try:
                h.wait()
            except Exception as e:  # noqa: BLE001 - wait for the others all the same
                self.errors.append(e)
            self.in_flight -= n

    def _fetch_whole(self, r: ChunkRead, buf: torch.Tensor) -> None:
        whole = whole_span(r)  # other needers may need other runs
        fetch(self.storage, whole, self.block, self.verify, self.where, buf[:-1], self.rec)
        count_read(self.stats, whole)

    def post_ahead(self, i: int) -> None:
        """Post span ``i`` and those after it while they fit in half the window."""
        mine, me = self.mine, self.comm.rank
        while self.nxt < len(mine) and (self.nxt <= i or self.ahead + mine[self.nxt].size <= self.half):
            q = mine[self.nxt]
            slot = self._slot(q)
            if slot is False:
                if self.nxt > i:
                    break  # room comes free as span i and those before it land: post this one then
                slot = None  # larger than the ring: read into host memory
            # Last byte: 1 = good data, 0 = reader failed.
            buf = torch.empty(q.size + 1, dtype=torch.uint8) if slot is None else slot.view
            if q.reader == me:
                self.posted.append(("read", self.pool.submit(self._fetch_whole, self.by_id[q.sid], buf), buf, slot))
            else:
                self.posted.append(("recv", self.comm.irecv(buf, q.reader), buf, slot))
            self.ahead += q.size
            self.nxt += 1

    def _slot(self, q) -> BounceSlot | None | bool:
        """A bounce slot for span ``q``; None when its targets are not on the ring's device, False when no room comes free."""
        r = self.by_id[q.sid]
        if self.bounce is None or not self.bounce.serves(self.targets, [j.target for j in r.jobs]):
            return None
        try:
            got = self.bounce.slot(q.size + 1, strided_bytes(r, self.targets))
        except Exception as e:  # noqa: BLE001 - the span still takes part in the exchange, through host memory
            self.errors.append(e)
            return None
        return False if got is None else got

    def deliver(self, sp, buf: torch.Tensor, slot: BounceSlot | None, good: bool, sends: Sequence = ()) -> None:
        """Copy a good span into its targets (from its slot, queued on the device); land every slot, in order."""
        r = self.by_id[sp.sid]
        pairs: list = []
        t0 = time.monotonic()
        try:
            if good and slot is None:
                copy_timed(r, buf[: sp.size], self.targets, self.rec)
            elif good:
                pairs = copy_pairs(r, buf[: sp.size], self.targets)
        except Exception as e:  # noqa: BLE001
            self.errors.append(e)
        if slot is None:
            return
        try:
            self.bounce.land(slot, pairs, sends)  # the slot is read by the sends of its bytes too
        except Exception as e:  # noqa: BLE001
            self.errors.append(e)
        if self.rec is not None and pairs:
            self.rec.add("copy", t0, time.monotonic(), r.hi - r.lo)

    def finish_read(self, sp, work, buf: torch.Tensor) -> tuple[bool, list[_Send]]:
        """A span this rank read: send it (or the failure mark) to every other needer; whether it is good, and the sends."""
        ok = True
        try:
            work.result()
            buf[sp.size] = 1
        except Exception as e:  # noqa: BLE001 - peers must still get an answer
            self.errors.append(e)
            buf[sp.size] = 0
            ok = False
        sends = []
        for q in sp.needers:
            if q != self.comm.rank:
                sends.append(_Send(self.comm.isend(buf, q)))
                self.sends.append((sends[-1], sp.size))
                self.in_flight += sp.size
                self.stats.bytes_sent += sp.size
        while self.in_flight > self.half and self.sends:
            h, n = self.sends.pop(0)
            h.wait()
            self.in_flight -= n
        return ok, sends

    def finish_recv(self, sp, work, buf: torch.Tensor) -> bool:
        """A span another rank read: wait for it, check its mark and checksums; whether it is good."""
        tc = time.monotonic()
        r = self.by_id[sp.sid]
        work.wait()
        self.stats.bytes_received += sp.size
        if self.rec is not None:
            self.rec.add("communicate", tc, time.monotonic(), sp.size)
        if int(buf[sp.size]) != 1:
            if not self.errors:
                self.errors.append(CorruptCheckpointError(
                    f"{self.where}: rank {sp.reader} could not read {r.chunk.file} for tensor {r.fqn!r}; see its error"
                ))
            return False
        if self.verify:  # what came over the wire is checked like what comes from storage
            try:
                verify_blocks(memoryview(buf[: sp.size].numpy()), r.chunk, r.lo // self.block, self.block, r.fqn, self.where)
            except Exception as e:  # noqa: BLE001
                self.errors.append(e)
                return False
        return True
