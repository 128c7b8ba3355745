"""Read spans bound for device memory land in a ring of bounce buffers, then go on to the device.

A span bound for an accelerator is read (and verified) by a reader thread
into a slot of a ring of host memory the device copies from at full speed;
the loading thread then queues the copies into the destination on the
device and goes on to the next span. A slot is reused only once its copies'
event has completed, so reading the next spans overlaps the copies of the
earlier ones. When the load ends, the caller's later work is ordered after
the last copy and the ring goes back to the device.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import torch

from ..device import Completed, CopyEvent, Device
from ..items import LoadTarget
from .staging import Slot, StagingRing

__all__ = ["BounceRing", "ALIGN"]

ALIGN = 64  # slot alignment in bytes: every dtype's element size divides it


class BounceRing:
    """The bounce ring of one load on ``device``; ``capacity`` bytes of its host buffers.

    Example::

        bounce = BounceRing(device, 256 << 20)
        slot = bounce.slot(n)            # None: no room now
        ...                               # a reader fills slot.view
        bounce.land(slot, copies)        # copies: [(device view, host view), ...]
        bounce.finish()
    """

    def __init__(self, device: Device, capacity: int):
        self.device = device
        self.ring = StagingRing(max(1, int(capacity)), device)
        # Copies into the targets run after what the caller queued before the load (their initialisation).
        self.after = device.snapshot_point()
        self._inflight: collections.deque = collections.deque()  # (slot, event), in ring order
        self._last: CopyEvent | None = None
        self.landed_bytes = 0

    def serves(self, targets: Sequence[LoadTarget], indexes: Sequence[int]) -> bool:
        """Whether every target in ``indexes`` lives on this ring's device."""
        return bool(indexes) and all(self.device.owns(targets[i].dest) for i in indexes)

    def slot(self, n: int) -> Slot | None:
        """``n`` bytes of the ring, waiting only for copies already queued; None when no room can come free.

        Slots start on an aligned offset, so that a typed view of the bytes
        (any dtype) starts on its element boundary.
        """
        size = -(-n // ALIGN) * ALIGN
        if size > self.ring.capacity:
            return None
        while True:
            self._reap()
            got = self.ring.try_acquire(size)
            if got is not None:
                return dataclasses.replace(got, view=got.view[:n])
            if not self._inflight:
                return None
            slot, ev = self._inflight.popleft()
            ev.synchronize()
            self.ring.release(slot)

    def _last_event(self) -> CopyEvent:
        return self._last if self._last is not None else Completed()

    def _reap(self) -> None:
        while self._inflight and self._inflight[0][1].query():
            self.ring.release(self._inflight.popleft()[0])

    def land(self, slot: Slot, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue each ``(device view, host view of slot)`` copy; the slot comes free when they complete."""
        ev = None
        for dst, src in copies:
            ev = self.device.copy_to_device(dst, src, self.after)
            self.landed_bytes += src.numel() * src.element_size()
        if ev is not None:
            self._last = ev
        self._inflight.append((slot, self._last_event()))

    def finish(self) -> None:
        """Order the caller's later work after the last copy, wait for the copies, and free the ring."""
        try:
            if self._last is not None:
                self.device.order_after(self._last)
                self._last.synchronize()  # the ring's memory is in use until then
        finally:
            self._inflight.clear()
            self.ring.free()
