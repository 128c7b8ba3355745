"""Bounded host staging: a ring of reusable bytes with back-pressure, and the device seam.

The snapshot copies tensors into a fixed host buffer; the writer drains it in
the same order. When the ring is full the copier waits for the writer, so a
state larger than the budget streams through it: copy a piece, write it,
reuse the space. The buffer is allocated once and reused by every later save,
so steady state allocates nothing (a fresh ``clone()`` runs at a fraction of
the speed of a copy into memory that is already mapped).

Device seam: :func:`host_buffer` and :func:`copy_to_host` are the only places
that know about CUDA (pinned memory, a side stream, non-blocking copies).
Only the CPU path is exercised by the test suite on this project's machines;
the CUDA path is untested here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["host_buffer", "copy_to_host", "StagingRing", "Slot"]


def host_buffer(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """A host byte buffer; pinned when staging from a CUDA device (untested here)."""
    pin = device is not None and device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class _Done:
    """A completed copy (the CPU path is synchronous)."""

    def synchronize(self) -> None:
        return None


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, streams: dict | None = None) -> Any:
    """Copy raw bytes ``src`` (uint8, any device) into host ``dst``; return an object to ``synchronize()``.

    On CUDA the copy is issued on a side stream with ``non_blocking=True`` and
    the caller must call the returned event's ``synchronize()`` (which blocks
    the calling thread; an event's ``wait()`` only orders streams) before the
    bytes are used. The CUDA branch is not exercised by the CPU test suite.
    On CPU it is a plain copy.
    """
    if src.device.type == "cuda":  # pragma: no cover - no GPU in CI
        key = src.device.index
        stream = (streams or {}).get(key)
        if stream is None:
            stream = torch.cuda.Stream(device=src.device)
            if streams is not None:
                streams[key] = stream
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev
    dst.copy_(src)
    return _Done()


@dataclass
class Slot:
    """A region ``[start, start + size)`` of the ring holding staged bytes."""

    start: int
    size: int
    view: torch.Tensor


class StagingRing:
    """A fixed-capacity FIFO of byte regions in one reusable host buffer.

    ``acquire(n)`` blocks until ``n`` contiguous bytes are free (back-pressure);
    ``release(slot)`` must be called in acquisition order. ``high_water`` is
    the most bytes ever held at once, which never exceeds ``capacity``.

    Example::

        ring = StagingRing(64 << 20)
        slot = ring.acquire(1 << 20); ...; ring.release(slot)
    """

    def __init__(self, capacity: int, device: torch.device | None = None):
        if capacity <= 0:
            raise ValueError("staging capacity must be positive")
        self.capacity = int(capacity)
        self._buf: torch.Tensor | None = None
        self._device = device
        self._cv = threading.Condition()
        self._head = 0  # next free byte
        self._tail = 0  # oldest held byte
        self._used = 0  # bytes held, including skipped space at the end after a wrap
        self._held: list[tuple[int, int]] = []  # (start, size incl. skipped gap), FIFO
        self._closed = False
        self.high_water = 0
        self.allocations = 0
        self._warm = 0

    def _buffer(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = host_buffer(self.capacity, self._device)
            self.allocations += 1
        return self._buf

    @property
    def warm_bytes(self) -> int:
        """Bytes at the start of the buffer already touched by :meth:`warm` (0 before it)."""
        return self._warm

    def warm(self, nbytes: int | None = None) -> int:
        """Allocate the buffer now and touch its first ``nbytes`` (default: none); return the bytes touched.

        A save copies into the ring from its start, so touching the prefix a
        save will fill moves the page faults of its first copy out of the
        save. ``nbytes`` is capped at ``capacity``; a later, larger call
        touches the rest.

        Example::

            ring = StagingRing(1 << 30); ring.warm(300 << 20)
        """
        buf = self._buffer()
        n = min(self.capacity, max(0, int(nbytes or 0)))
        if n > self._warm:
            buf[self._warm : n].zero_()
            self._warm = n
        return self._warm

    def acquire(self, n: int, timeout: float | None = None) -> Slot:
        """Reserve ``n`` contiguous bytes (``0 < n <= capacity``), waiting for space."""
        if not 0 < n <= self.capacity:
            raise ValueError(f"cannot stage {n} bytes in a ring of {self.capacity}")
        buf = self._buffer()
        with self._cv:
            while True:
                if self._closed:
                    raise RuntimeError("staging ring closed")
                start, gap = self._fit(n)
                if start is not None:
                    break
                if not self._cv.wait(timeout):
                    raise TimeoutError(f"no staging space for {n} bytes within {timeout}s")
            self._held.append((start, n + gap))
            self._used += n + gap
            self._head = (start + n) % self.capacity
            self.high_water = max(self.high_water, self._used - gap)
            return Slot(start, n, buf[start : start + n])

    def _fit(self, n: int) -> tuple[int | None, int]:
        free = self.capacity - self._used
        if self._used == 0:
            self._head = self._tail = 0
            return 0, 0
        if self._head >= self._tail:  # free space: [head, cap) then [0, tail)
            if self.capacity - self._head >= n and free >= n:
                return self._head, 0
            gap = self.capacity - self._head
            if self._tail >= n and free - gap >= n:
                return 0, gap
            return None, 0
        if self._tail - self._head >= n:
            return self._head, 0
        return None, 0

    def release(self, slot: Slot) -> None:
        with self._cv:
            start, size = self._held.pop(0)
            if start != slot.start and not (start == 0 and slot.start == 0):
                # Releases are FIFO by construction; anything else is a bug.
                raise RuntimeError("staging slots released out of order")
            self._used -= size
            self._tail = (slot.start + slot.size) % self.capacity
            if self._used == 0:
                self._head = self._tail = 0
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def reopen(self) -> None:
        with self._cv:
            self._closed = False
            self._held.clear()
            self._used = 0
            self._head = self._tail = 0
