"""The staged save pipeline: copy into a bounded ring, then checksum and write.

A copier stages each tensor's bytes into a :class:`StagingRing` in pieces; a
writer drains the ring in order into a
:class:`~shardpoint.format.datafile.DataFileWriter`, which hashes
``block_size`` blocks incrementally (pieces need not align with blocks) and
appends to the rank's data file.
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

from ..errors import ShapeMismatchError, StorageError
from ..format.datafile import DataFileWriter
from ..format.manifest import ChunkMeta
from ..items import SaveTensor
from ..storage.base import Storage
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
        writer = None
        try:
            writer = self.storage.open_writer(self.file)
            out = DataFileWriter(writer, self.file, self.block, self.rank, self.recorder)
            while True:
                msg = self._q.get()
                if msg is _END:
                    break
                if isinstance(msg, BaseException):
                    raise msg
                i, off, slot, ev, final = msg
                it = self.items[i]
                if off == 0:
                    out.begin()
                if slot is not None:
                    ev.synchronize()  # blocks this thread until the copy into the slot is done
                    out.write(memoryview(slot.view.numpy()))
                    self.ring.release(slot)
                if final:
                    self.records.append((it.fqn, out.end(it.box, it.flat)))
            writer.close()
            writer = None
            self.size = out.pos
        except BaseException as e:
            self.failed.set()
            if writer is not None:
                writer.abort()
            self.ring.close()  # unblock a copier waiting for space
            if isinstance(e, OSError):
                raise StorageError(f"{self.storage.url}: writing {self.file} failed: {e}") from e
            raise
