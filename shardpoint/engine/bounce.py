"""Read spans bound for device memory land in a ring of bounce buffers, then go on to the device.

A span bound for an accelerator is read (and verified) by a reader thread
into a slot of a ring of host memory the device copies from at full speed;
the loading thread then queues the copies into the destination on the
device and goes on to the next span. A slot is reused only once its copies'
event has completed, so reading the next spans overlaps the copies of the
earlier ones. When the load ends, the caller's later work is ordered after
the last copy and the ring goes back to the device.

A region that is strided in the span (a column block of a row-major chunk,
as tensor parallelism's ``Shard(1)`` reads) cannot be copied by the device
from where it lies: the framework would pack it into a pageable temporary
and copy synchronously. Its span's slot therefore comes with a packing
area in the same ring of device-ready host memory: the loading thread packs each such
region there, in row-major blocks that fit the area
(:func:`~shardpoint.engine.blocks.row_blocks`), and the device copies the
packed bytes asynchronously.

A strided destination (a transposed or column-block view on the device)
is filled through a contiguous device temporary the size of what one copy
carries, then scattered on the device: so each copy into one carries at
most :data:`DEVICE_BLOCK` bytes, in ``row_blocks``, and the temporary
stays that small whatever the region's size.

A slot may hold a batch of neighbouring small spans (one read) or a span
also sent to other ranks: it comes free once its copies and any other
work handed to :meth:`BounceRing.land` (the sends) are complete.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import torch

from ..device import Completed, CopyEvent, Device
from ..items import LoadTarget
from .blocks import row_blocks
from .staging import Slot, StagingRing

__all__ = ["BounceRing", "BounceSlot", "ALIGN", "DEVICE_BLOCK", "aligned"]

ALIGN = 64  # slot alignment in bytes: every dtype's element size divides it
DEVICE_BLOCK = 4 << 20
"""The most bytes one copy into a strided device destination carries: the bound of its device temporary."""


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`: where the next typed view may start.

    Example::

        aligned(65)   # 128
    """
    return -(-int(n) // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class BounceSlot:
    """One span's part of the bounce ring: ``view`` receives its bytes, ``pack`` packs its strided regions.

    ``pack`` is empty when the span needs no packing (or the ring has no
    room beside it: strided regions are then copied as they lie).

    Example::

        got = bounce.slot(n, pack=4096); got.view.numel()  # n
    """

    slot: Slot
    view: torch.Tensor
    pack: torch.Tensor


class _Packer:
    """Hands out aligned, consecutive parts of a packing area; wraps around once the copies from it completed."""

    def __init__(self, area: torch.Tensor):
        self.area = area
        self.pos = 0
        self.last: CopyEvent | None = None

    def take(self, n: int) -> torch.Tensor:
        size = aligned(n)
        if self.pos + size > self.area.numel():
            if self.last is not None:
                self.last.synchronize()  # copies complete in order: the whole area is free again
            self.pos = 0
        out = self.area[self.pos : self.pos + n]
        self.pos += size
        return out


class _Joined(CopyEvent):
    """Completes once ``event`` and every handle (a send of the slot's bytes) completed."""

    def __init__(self, event: CopyEvent, holds: Sequence):
        self.event, self.holds = event, list(holds)

    def synchronize(self) -> None:
        for h in self.holds:
            h.wait()
        self.event.synchronize()

    def query(self) -> bool:
        return all(h.is_completed() for h in self.holds) and self.event.query()


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

    @property
    def span_limit(self) -> int:
        """The most bytes one span reads into a slot: a quarter of the ring, so reads of the next spans overlap its copies.

        A larger span is cut into spans of this size (:func:`~shardpoint.planning.split.split_span`).
        """
        return max(ALIGN, self.ring.capacity // 4 // ALIGN * ALIGN)

    def serves(self, targets: Sequence[LoadTarget], indexes: Sequence[int]) -> bool:
        """Whether every target in ``indexes`` lives on this ring's device."""
        return bool(indexes) and all(self.device.owns(targets[i].dest) for i in indexes)

    def slot(self, n: int, pack: int = 0) -> BounceSlot | None:
        """``n`` bytes of the ring and up to ``pack`` bytes to pack strided regions in; None when no room can come free.

        Waits only for copies already queued. Slots start on an aligned
        offset, so that a typed view of the bytes (any dtype) starts on its
        element boundary. The packing area is what the ring holds beside the
        span, up to ``pack``: a smaller one is reused block by block.
        """
        size = aligned(n)
        if size > self.ring.capacity:
            return None
        room = min(aligned(pack), self.ring.capacity - size) if pack > 0 else 0
        while True:
            self._reap()
            got = self.ring.try_acquire(size + room)
            if got is not None:
                return BounceSlot(got, got.view[:n], got.view[size : size + room])
            if not self._inflight:
                return None
            held, ev = self._inflight.popleft()
            ev.synchronize()
            self.ring.release(held)

    def _last_event(self) -> CopyEvent:
        return self._last if self._last is not None else Completed()

    def _reap(self) -> None:
        while self._inflight and self._inflight[0][1].query():
            self.ring.release(self._inflight.popleft()[0])

    def land(self, slot: BounceSlot, copies: Sequence[tuple[torch.Tensor, torch.Tensor]], holds: Sequence = ()) -> None:
        """Queue each ``(device view, host view of slot)`` copy; the slot comes free when they complete.

        A strided host view is packed into the slot's packing area first
        (block by block where the area is smaller), so that every copy the
        device runs reads contiguous bytes of the ring. ``holds`` are other
        readers of the slot (handles with ``wait()``, which may be called again
        once done, and ``is_completed()``, as sends of its bytes to other
        ranks): the slot waits for them too.
        Every slot taken is landed once, in order, even with no copies.
        """
        packer = _Packer(slot.pack) if slot.pack.numel() else None
        for dst, src in copies:
            if src.numel() == 0:
                continue
            if packer is None or src.is_contiguous():
                self._queue(dst, src)
                continue
            for idx in row_blocks(src.shape, src.element_size(), packer.area.numel()):
                part = src[idx]
                packed = packer.take(part.numel() * part.element_size()).view(part.dtype).view(part.shape)
                packed.copy_(part)  # on the host, into the ring
                packer.last = self._queue(dst[idx], packed)
        ev = self._last_event()
        self._inflight.append((slot.slot, _Joined(ev, holds) if holds else ev))

    def _queue(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        nbytes = src.numel() * src.element_size()
        if dst.is_contiguous() or nbytes <= DEVICE_BLOCK:
            parts = [(dst, src)]
        else:  # the same row-major blocks of both (of a contiguous src, each block is contiguous too)
            parts = [(dst[idx], src[idx]) for idx in row_blocks(dst.shape, dst.element_size(), DEVICE_BLOCK)]
        for d, s in parts:
            ev = self.device.copy_to_device(d, s, self.after)
        self.landed_bytes += nbytes
        self._last = ev
        return ev

    def finish(self) -> None:
        """Order the caller's later work after the last copy, wait for the copies, and free the ring."""
        try:
            if self._last is not None:
                self.device.order_after(self._last)
                self._last.synchronize()  # the ring's memory is in use until then
            for _slot, ev in self._inflight:
                ev.synchronize()  # copies are done by now; a slot's sends may still read it
        finally:
            self._inflight.clear()
            self.ring.free()
