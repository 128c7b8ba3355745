"""The staged save pipeline: copy into a bounded ring, then checksum and write.

A copier stages each tensor's bytes into a :class:`StagingRing` in pieces,
through the ring's :class:`~shardpoint.device.Device` (an accelerator queues
the copies and signals their completion with events); a writer drains the ring in order into a
:class:`~shardpoint.format.datafile.DataFileWriter`, which hashes
``block_size`` blocks incrementally (pieces need not align with blocks) and
appends to the rank's data file. A piece is read only once its copy event
has completed, and its ring space is reused only once it is written.
Copier and writer run concurrently, so a state larger than the ring passes
through it with back-pressure. With :class:`SinkThread` the storage writes
run on one more thread, so hashing a piece overlaps writing the one before.

Small tensors (norms, biases, step counts: thousands of them in a large
model) are staged together: neighbours of at most :data:`SMALL_BYTES` each
share one slot and one completion event, up to :data:`BATCH_BYTES`, and
neighbours adjacent in one storage (views of one flat buffer) are one copy.
A strided tensor larger than a piece is copied in row-major blocks of at
most a piece (:func:`~shardpoint.engine.blocks.row_blocks`), so the
contiguous temporary each needs stays bounded.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..device import Completed, CopyEvent, Device
from ..errors import ShapeMismatchError, StorageError
from ..format.datafile import DataFileWriter
from ..format.manifest import ChunkMeta
from ..items import SaveTensor
from ..storage.base import Storage
from .blocks import row_blocks
from .staging import Slot, StagingRing

__all__ = ["Staged", "StagedWrite", "SinkThread", "WRITE_THREADS", "SPLIT_BYTES", "SMALL_BYTES", "BATCH_BYTES", "adjacent_runs"]

_END = object()
WRITE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))  # parallel writes of one file, where the storage takes them
SPLIT_BYTES = 4 << 20  # no parallel write smaller than this
SMALL_BYTES = 256 << 10
"""A tensor of at most this many bytes is staged with its small neighbours (one slot, one event)."""
BATCH_BYTES = 4 << 20
"""The most bytes one batch of small tensors stages (also at most a piece)."""


@dataclass(frozen=True)
class Staged:
    """What the copier hands the writer: a slot, its copies' event, and the items' parts it holds, in order.

    ``parts``: ``(item index, offset in the item, bytes, last part of the item)``.
    """

    slot: Slot | None
    event: CopyEvent
    parts: tuple[tuple[int, int, int, bool], ...]


def adjacent_runs(raws: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of ``raws`` (flat byte views) that lie back to back in one storage.

    Each range is copied as one: small tensors carved from one flat buffer
    (as a flat-parameter wrapper makes them) cost one copy, not one each.

    Example::

        flat = torch.zeros(8, dtype=torch.uint8)
        adjacent_runs([flat[:3], flat[3:8], torch.zeros(2, dtype=torch.uint8)])   # [(0, 2), (2, 3)]
    """
    out: list[tuple[int, int]] = []
    for i, r in enumerate(raws):
        if out and _follows(raws[i - 1], r):
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.numel() > 0 and b.numel() > 0
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() + a.numel() == b.storage_offset())


class SinkThread:
    """Storage writes off the hashing thread; ``then(fn)`` runs ``fn`` once all earlier bytes are written.

    The hashing thread hands bytes over with :meth:`write` and goes on with
    the next piece. A ``positional`` writer (:attr:`Writer.positional`) gets
    each piece split over ``threads`` threads, each writing at its own
    offset, so one file is written as fast as the storage takes parallel
    writes; any other writer gets the pieces in order on one thread.
    :meth:`close` waits for the last write and raises what a writing thread
    raised; :attr:`error` is set as soon as a write failed.

    Example::

        sink = SinkThread(storage.open_writer(name))
        sink.write(b"abc"); sink.then(lambda: ring.release(slot)); sink.close()
    """

    def __init__(self, writer: Any, on_error: Callable[[], None] | None = None, threads: int | None = None):
        self.writer = writer
        self.on_error = on_error  # unblocks whoever waits for space the failed writes would free
        self.error: BaseException | None = None
        self.pos = 0
        self._threads = max(1, int(WRITE_THREADS if threads is None else threads))
        self._pool = cf.ThreadPoolExecutor(self._threads, "shardpoint-pwrite") if writer.positional and self._threads > 1 else None
        self._q: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="shardpoint-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            kind, item = self._q.get()
            if kind is _END:
                return
            if self.error is not None:
                continue  # drain: the hashing thread sees the error and stops
            try:
                if kind == "w":
                    self.writer.write(item)
                elif kind == "p":
                    for f in item:  # this piece's parallel writes, in order: earlier bytes are written first
                        f.result()
                else:
                    item()
            except BaseException as e:  # noqa: BLE001 - raised by close() or seen through .error
                self.error = e
                if self.on_error is not None:
                    self.on_error()

    def write(self, data: Any) -> None:
        """Queue ``data`` to be written after (or, positional, beside) everything queued before it."""
        if self.error is not None:
            raise self.error
        if self._pool is None:
            self._q.put(("w", data))
            return
        mv = memoryview(data).cast("B")
        n = len(mv)
        step = max(SPLIT_BYTES, -(-n // self._threads))
        futs = [self._pool.submit(self.writer.write_at, self.pos + a, mv[a : a + step]) for a in range(0, n, step)]
        self.pos += n
        self._q.put(("p", futs))

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writing thread once everything queued before it is written."""
        self._q.put(("f", fn))

    def close(self) -> None:
        """Wait for every queued write; raise the first write error."""
        self._q.put((_END, None))
        self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.error is not None:
            raise self.error


@dataclass
class StagedWrite:
    """Stage ``items`` through ``ring`` into ``file``; collect chunk records.

    Call :meth:`copy` (any thread, in item order, possibly in two calls that
    split the item list), and :meth:`write` in another thread. ``piece`` caps
    one staged piece so copying and writing overlap. ``after`` is the
    snapshot point (:meth:`~shardpoint.device.Device.snapshot_point`) the
    copies are ordered after; :meth:`wait_copied` blocks until every copy
    queued so far is complete. ``chooser``, when set before :meth:`write`,
    sees each piece first and may take it (an incremental save's
    comparison with its base).
    """

    storage: Storage
    file: str
    items: Sequence[SaveTensor]
    ring: StagingRing
    rank: int
    block: int
    piece: int
    records: list[tuple[str, ChunkMeta]] = field(default_factory=list)
    size: int = 0
    copied_bytes: int = 0
    _q: "queue.Queue" = field(default_factory=queue.Queue)
    failed: threading.Event = field(default_factory=threading.Event)
    recorder: Any = None
    after: CopyEvent | None = None
    last_event: CopyEvent = field(default_factory=Completed)
    chooser: Any = None  # takes the pieces of chunks it may reference instead (shardpoint.saving.staged_base)

    def copy(self, start: int, stop: int, last: bool) -> None:
        """Stage items ``[start, stop)``; ``last`` closes the queue afterwards."""
        dev = self.ring.device
        try:
            i = start
            while i < stop and not self.failed.is_set():
                j = self.batch_end(i, stop)
                if j - i > 1:
                    self._copy_batch(dev, i, j)
                else:
                    self._copy_one(dev, i)
                i = j
        except BaseException as e:
            self.failed.set()
            self._q.put(e)
            raise
        finally:
            if last:
                self._q.put(_END)

    def batch_end(self, i: int, stop: int) -> int:
        """The end of the batch of small items starting at ``i`` (``i + 1``: not batched)."""
        cap = min(BATCH_BYTES, self.piece, self.ring.capacity)
        total, j = 0, i
        while j < stop and self.items[j].nbytes <= SMALL_BYTES and total + self.items[j].nbytes <= cap:
            total += self.items[j].nbytes
            j += 1
        return max(j, i + 1)

    def _check(self, i: int) -> torch.Tensor:
        it = self.items[i]
        n = it.data.numel() * it.data.element_size()
        if n != it.nbytes:
            raise ShapeMismatchError(f"{it.fqn}: local data has {n} bytes, geometry says {it.nbytes}")
        return it.data

    def _queued(self, ev: CopyEvent, t0: float, nbytes: int) -> None:
        if not isinstance(ev, Completed):
            self.last_event = ev  # copies of one device complete in order
        if self.recorder is not None:
            self.recorder.add("copy", t0, time.monotonic(), nbytes)
        self.copied_bytes += nbytes

    def _copy_batch(self, dev: Device, i: int, j: int) -> None:
        """Small items ``[i, j)``: one slot, one event; neighbours adjacent in memory are one copy."""
        raws = [dev.byte_view(self._check(k), self.after) for k in range(i, j)]
        total = sum(r.numel() for r, _ in raws)
        parts = tuple((k, 0, raws[k - i][0].numel(), True) for k in range(i, j))
        if total == 0:
            self._q.put(Staged(None, Completed(), parts))
            return
        slot = self.ring.acquire(total)
        t0 = time.monotonic()
        pairs, pos = [], 0
        for a, b in adjacent_runs([r for r, temporary in raws]):
            first, n = raws[a][0], sum(r.numel() for r, _ in raws[a:b])
            src = first if b - a == 1 else first.as_strided((n,), (1,), first.storage_offset())
            pairs.append((slot.view[pos : pos + n], src))
            pos += n
        ev = dev.copy_many_to_host(pairs, self.after)
        for r, temporary in raws:
            if temporary:
                dev.keep_alive(r, ev)  # the copy may run after this loop dropped it
        self._queued(ev, t0, total)
        self._q.put(Staged(slot, ev, parts))

    def _copy_one(self, dev: Device, i: int) -> None:
        """Item ``i`` in pieces; a strided one larger than a piece in row-major blocks of at most a piece."""
        t = self._check(i)
        n = self.items[i].nbytes
        if n == 0:
            self._q.put(Staged(None, Completed(), ((i, 0, 0, True),)))
            return
        blocks = [()] if t.is_contiguous() or n <= self.piece else row_blocks(t.shape, t.element_size(), self.piece)
        off = 0
        for idx in blocks:
            if self.failed.is_set():
                return
            raw, temporary = dev.byte_view(t[idx], self.after)
            for a in range(0, raw.numel(), self.piece):
                m = min(self.piece, raw.numel() - a)
                slot = self.ring.acquire(m)
                t0 = time.monotonic()
                ev = dev.copy_to_host(slot.view, raw[a : a + m], self.after)
                if temporary:
                    dev.keep_alive(raw, ev)  # the copy may run after this loop dropped it
                self._queued(ev, t0, m)
                self._q.put(Staged(slot, ev, ((i, off, m, off + m == n),)))
                off += m

    def wait_copied(self) -> None:
        """Block until every copy queued so far has completed (the snapshot is then in host memory)."""
        self.last_event.synchronize()

    def abandon(self) -> None:
        """Give up before :meth:`write` started: a copier waiting for staging space stops instead of blocking."""
        self.failed.set()
        self.ring.close()

    def write(self, threaded: bool | None = None) -> None:
        """Drain the queue into the data file; raises what the copier raised.

        ``threaded`` writes to storage on a :class:`SinkThread` while this
        thread hashes the next piece; by default where the machine has the
        cores for parallel writes (:data:`WRITE_THREADS` above one).
        """
        writer = None
        sink = None
        if threaded is None:
            threaded = WRITE_THREADS > 1
        try:
            writer = self.storage.open_writer(self.file)
            sink = SinkThread(writer, self.ring.close) if threaded else None
            out = DataFileWriter(sink or writer, self.file, self.block, self.rank, self.recorder)
            self._drain(out, sink)
            if sink is not None:
                sink, s = None, sink
                s.close()
            writer.close()
            writer = None
            self.size = out.pos
        except BaseException as e:
            self.failed.set()
            if sink is not None:
                try:
                    sink.close()
                except BaseException as first:  # noqa: BLE001 - the write error is the cause
                    e = first
            if writer is not None:
                writer.abort()
            self.ring.close()  # unblock a copier waiting for space
            if isinstance(e, OSError):
                raise StorageError(f"{self.storage.url}: writing {self.file} failed: {e}") from e
            raise e

    def _drain(self, out: DataFileWriter, sink: SinkThread | None) -> None:
        while True:
            msg = self._q.get()
            if msg is _END:
                return
            if isinstance(msg, BaseException):
                raise msg
            if self.chooser is not None and self.chooser.take(msg, out, sink):
                continue  # compared with the base, then written or referenced by the chooser
            slot = msg.slot
            mv = None
            if slot is not None:
                msg.event.synchronize()  # blocks this thread until the copies into the slot are done
                mv = memoryview(slot.view.numpy())
            pos = 0
            for i, off, n, final in msg.parts:
                it = self.items[i]
                if off == 0:
                    out.begin()
                if n:
                    out.write(mv[pos : pos + n])
                    pos += n
                if final:
                    self.records.append((it.fqn, out.end(it.box, it.flat)))
            if slot is not None:
                if sink is None:
                    self.ring.release(slot)
                else:
                    sink.then(lambda s=slot: self.ring.release(s))
