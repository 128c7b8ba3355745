"""The staged save pipeline: copy into a bounded ring, then checksum and write.

A copier stages each tensor's bytes into a :class:`StagingRing` in pieces; a
writer drains the ring in order, hashing ``block_size`` blocks incrementally
(pieces need not align with blocks) and appending to the rank's data file.
Copier and writer run concurrently, so a state larger than the ring streams
through it with back-pressure.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import xxhash

from ..adapters.base import SaveTensor
from ..errors import ShapeMismatchError, StorageError
from ..format.manifest import ChunkMeta
from ..storage.base import Storage
from .io import ALIGN
from .staging import StagingRing, copy_to_host

__all__ = ["StagedWrite"]

_END = object()


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


@dataclass
class StagedWrite:
    """Stage ``items`` through ``ring`` into ``file``; collect chunk records.

    Call :meth:`copy` (any thread, in item order, possibly in two calls that
    split the item list), and :meth:`write` in another thread. ``piece`` caps
    one staged piece so copying and writing overlap.
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
    _streams: dict = field(default_factory=dict)
    failed: threading.Event = field(default_factory=threading.Event)
    recorder: Any = None

    def copy(self, start: int, stop: int, last: bool) -> None:
        """Stage items ``[start, stop)``; ``last`` closes the queue afterwards."""
        try:
            for i in range(start, stop):
                if self.failed.is_set():
                    break
                it = self.items[i]
                raw = _raw(it.data)
                n = raw.numel()
                if n != it.nbytes:
                    raise ShapeMismatchError(f"{it.fqn}: local data has {n} bytes, geometry says {it.nbytes}")
                if n == 0:
                    self._q.put((i, 0, None, None, True))
                    continue
                for off in range(0, n, self.piece):
                    m = min(self.piece, n - off)
                    slot = self.ring.acquire(m)
                    t0 = time.monotonic()
                    ev = copy_to_host(slot.view, raw[off : off + m], self._streams)
                    if self.recorder is not None:
                        self.recorder.add("copy", t0, time.monotonic(), m)
                    self.copied_bytes += m
                    self._q.put((i, off, slot, ev, off + m == n))
        except BaseException as e:
            self.failed.set()
            self._q.put(e)
            raise
        finally:
            if last:
                self._q.put(_END)

    def abandon(self) -> None:
        """Give up before :meth:`write` started: a copier waiting for staging space stops instead of blocking."""
        self.failed.set()
        self.ring.close()

    def write(self) -> None:
        """Drain the queue into the data file; raises what the copier raised."""
        pos = 0
        pad = bytes(ALIGN)
        hasher = None
        sums: list[str] = []
        in_block = 0
        chunk_start = 0
        writer = None
        try:
            writer = self.storage.open_writer(self.file)
            while True:
                msg = self._q.get()
                if msg is _END:
                    break
                if isinstance(msg, BaseException):
                    raise msg
                i, off, slot, ev, final = msg
                it = self.items[i]
                if off == 0:
                    if pos % ALIGN:
                        k = ALIGN - pos % ALIGN
                        writer.write(pad[:k])
                        pos += k
                    chunk_start, sums, in_block, hasher = pos, [], 0, xxhash.xxh3_64()
                if slot is not None:
                    ev.synchronize()  # blocks this thread until the copy into the slot is done
                    mv = memoryview(slot.view.numpy())
                    t0 = time.monotonic()
                    # Hash incrementally in block_size blocks, whatever the piece size.
                    k = 0
                    while k < len(mv):
                        take = min(self.block - in_block, len(mv) - k)
                        hasher.update(mv[k : k + take])
                        in_block += take
                        k += take
                        if in_block == self.block:
                            sums.append(hasher.hexdigest())
                            hasher, in_block = xxhash.xxh3_64(), 0
                    t1 = time.monotonic()
                    writer.write(mv)
                    if self.recorder is not None:
                        self.recorder.add("checksum", t0, t1, len(mv))
                        self.recorder.add("write", t1, time.monotonic(), len(mv))
                    pos += len(mv)
                    self.ring.release(slot)
                if final:
                    if in_block or not sums:
                        sums.append(hasher.hexdigest())
                    self.records.append(
                        (it.fqn, ChunkMeta(it.box, self.file, chunk_start, pos - chunk_start, tuple(sums), it.flat, self.rank))
                    )
            writer.close()
            writer = None
            self.size = pos
        except BaseException as e:
            self.failed.set()
            if writer is not None:
                writer.abort()
            self.ring.close()  # unblock a copier waiting for space
            if isinstance(e, OSError):
                raise StorageError(f"{self.storage.url}: writing {self.file} failed: {e}") from e
            raise
