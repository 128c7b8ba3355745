"""Bounded host staging: a ring of reusable bytes with back-pressure.

The snapshot copies tensors into a fixed host buffer; the writer drains it in
the same order. When the ring is full the copier waits for the writer, so a
state larger than the budget passes through it piece by piece: copy a piece,
write it, reuse the space. The buffer comes from the ring's
:class:`~shardpoint.device.Device` (memory an accelerator copies into at
full speed), is allocated once and reused by every later save, so steady
state allocates nothing (a fresh ``clone()`` runs at a fraction of the speed
of a copy into memory that is already mapped).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..device import CpuDevice, Device, device_for, devices_of, host_budget

__all__ = ["StagingRing", "Slot", "SaverStaging", "optimizer_order", "pinned_capacity", "DEFAULT_STAGING_BYTES", "PINNED_SLACK"]

DEFAULT_STAGING_BYTES = 2 << 30
PINNED_SLACK = 1.25
"""The most memory an automatic staging ring on a pinning device takes, as a multiple of the state it stages."""
_ROUND = 64 << 20


def _block_below(device: Device, nbytes: int) -> int:
    """The largest size up to ``nbytes`` whose block the device's allocator does not round past ``nbytes``."""
    if device.held_size(nbytes) <= nbytes or device.held_size(1) > nbytes:
        return nbytes  # fits, or no smaller size takes less (a page is the least a buffer takes)
    lo, hi = 1, nbytes  # held_size grows with the size: the largest fitting size by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if device.held_size(mid) <= nbytes else (lo, mid - 1)
    return lo


def pinned_capacity(need: int, device: Device, limit: int) -> int:
    """The automatic ring for a state of ``need`` bytes on a device that pins host memory.

    The allocator hands out blocks rounded up (to a power of two), so a
    ring of exactly ``need`` bytes may hold up to twice that. The ring is the
    whole block when that block is within :data:`PINNED_SLACK` of the state
    (the snapshot then fits), else the largest block below the state, which
    the state streams through. It never passes ``limit`` (what
    :func:`~shardpoint.device.host_budget` allows this rank).

    Example::

        pinned_capacity(3 << 30, sim, 64 << 30)   # 2 GiB: a 4 GiB block would be 1.33x the state
    """
    limit = _block_below(device, max(1, int(limit)))
    if need <= 0:
        return min(DEFAULT_STAGING_BYTES, limit)
    block = device.held_size(need)
    size = block if block <= need * PINNED_SLACK else _block_below(device, need)
    return max(1, min(size, limit))


def _storage_key(t: Any) -> int | None:
    to_local = getattr(t, "to_local", None)  # a DTensor: its local shard holds the bytes
    local = to_local() if callable(to_local) else t
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def optimizer_order(items: Sequence[Any], tensors: Sequence[Any]) -> list[Any]:
    """``items`` (with ``.data``) sorted by where their memory first appears in ``tensors``; the rest last, as they were.

    Copies in this order deliver what the optimizer updates first, first.

    Example::

        optimizer_order(lazy_items, [p0, p0_exp_avg, p1, p1_exp_avg])
    """
    rank: dict[int, int] = {}
    for i, t in enumerate(tensors):
        k = _storage_key(t)
        if k is not None:
            rank.setdefault(k, i)
    end = len(tensors)
    return sorted(items, key=lambda it: rank.get(_storage_key(it.data), end))


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

    def __init__(self, capacity: int, device: Device | None = None):
        if capacity <= 0:
            raise ValueError("staging capacity must be positive")
        self.capacity = int(capacity)
        self._buf: torch.Tensor | None = None
        self.device = device if device is not None else CpuDevice()
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
            self._buf = self.device.host_buffer(self.capacity)
            self.allocations += 1
        return self._buf

    @property
    def allocated(self) -> bool:
        """Whether the buffer is allocated now."""
        return self._buf is not None

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
            return self._take(buf, start, gap, n)

    def try_acquire(self, n: int) -> Slot | None:
        """Reserve ``n`` contiguous bytes if they are free now, else None (never waits)."""
        if not 0 < n <= self.capacity:
            return None
        buf = self._buffer()
        with self._cv:
            if self._closed:
                raise RuntimeError("staging ring closed")
            start, gap = self._fit(n)
            return None if start is None else self._take(buf, start, gap, n)

    def _take(self, buf: torch.Tensor, start: int, gap: int, n: int) -> Slot:
        # Called with the lock held.
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

    def free(self) -> None:
        """Give the buffer back to the system (a new one is made if used again); no other memory is touched.

        Example::

            ring.free()   # the ring's host memory goes back to the system, and nothing else
        """
        with self._cv:
            buf, self._buf = self._buf, None
            self._warm = 0
        if buf is not None:
            self.device.free_host_buffer(buf)
            del buf  # the last reference: the memory goes back now
            self.device.reclaim_host_memory()

    def reopen(self) -> None:
        with self._cv:
            self._closed = False
            self._held.clear()
            self._used = 0
            self._head = self._tail = 0


class SaverStaging:
    """A saver's device and its one staging ring.

    The device is the one given (a device object, a device, or a list of
    them), or learned from the devices of the state's tensors (and learned
    again only if the state moves to a device it does not serve). Tensors on
    several devices of the process get a
    :class:`~shardpoint.device.DeviceSet`: each is copied through its own
    device's copy queue, into the one ring. ``budget=None`` sizes the ring automatically. In host memory
    it is the default, or a state's bytes when more, so that a whole
    snapshot fits and an eager save never waits for storage. On a device
    that pins host memory it is :func:`pinned_capacity`: the state's size
    as the allocator hands it out, at most :data:`PINNED_SLACK` times the
    state (a larger state streams through a smaller ring) and at most
    ``host_limit`` (default :func:`~shardpoint.device.host_budget`, this
    rank's share of the host's available memory). A given budget is kept
    as given. The ring is made once and kept; it is made again only for
    another device or a larger automatic budget (the old one's memory then
    goes back to the system), never from one save of the same state to the next.

    Example::

        staging = SaverStaging(None, 64 << 20)
        staging.adopt(prep.mine)
        ring = staging.ring_for(sum(t.nbytes for t in prep.mine))
    """

    def __init__(self, budget: int | None, piece: int, device: Any = None):
        self.auto = budget is None
        self.budget = DEFAULT_STAGING_BYTES if budget is None else int(budget)
        self.max_piece = int(piece)
        self.piece = max(1, min(self.max_piece, self.budget // 2 or 1))
        self.given = device is not None
        # Made now, on the constructing thread: what an accelerator needs for its copies is made once, here.
        self.device: Device | None = None if device is None else device_for(device)
        self.ring: StagingRing | None = None
        self.host_limit: int | None = None  # None: host_budget() when the ring is sized

    def _auto_budget(self, need: int) -> int:
        dev = self.device
        if dev.pins and need > 0:
            ring = self.ring
            size = pinned_capacity(need, dev, host_budget() if self.host_limit is None else self.host_limit)
            if ring is not None and ring.device is dev and ring.allocated and ring.capacity >= size:
                return ring.capacity  # a ring made for a larger state stays: no reallocation from save to save
            return size
        if need > self.budget:
            # All of what the device's allocator hands out anyway.
            return dev.held_size(-(-need // _ROUND) * _ROUND)
        return self.budget

    def adopt(self, items: Sequence[Any]) -> Device:
        """The device for ``items`` (objects with ``.data``): as given, else one serving every device they are on."""
        return self.serve(None if self.given else devices_of(t.data for t in items))

    def serve(self, where: torch.device | Sequence[torch.device] | None) -> Device:
        """The device for tensors on ``where`` (a device, or every device a save's tensors are on): as given, else one serving them.

        Example::

            staging.serve(torch.device("cpu"))  # CpuDevice, unless a device was given
            staging.serve((gpu0, gpu1))  # a DeviceSet serving both devices
        """
        if not self.given and where is not None:
            wanted = tuple(where) if isinstance(where, (tuple, list)) else (torch.device(where),)
            wanted = tuple(w for w in wanted if torch.device(w).type != "cpu")
            if self.device is None or not all(self.device.serves(w) for w in wanted or (torch.device("cpu"),)):
                self.device = device_for(wanted or None)
        elif self.device is None:
            self.device = device_for(None)
        return self.device

    def ring_for(self, need: int = 0) -> StagingRing:
        """The staging ring on the current device; with an automatic budget, holding ``need`` bytes."""
        if self.device is None:
            self.device = device_for(None)
        if self.auto:
            self.budget = self._auto_budget(int(need))
            self.piece = max(1, min(self.max_piece, self.budget // 2 or 1))
        ring = self.ring
        if ring is None or ring.device is not self.device or ring.capacity != self.budget:
            if ring is not None:
                ring.free()
            self.ring = ring = StagingRing(self.budget, self.device)
        return ring

    def close(self) -> None:
        """Give the ring's memory back now (a later save allocates it again) and stop the device's helpers."""
        if self.ring is not None:
            self.ring.free()
        if self.device is not None:
            self.device.close()
