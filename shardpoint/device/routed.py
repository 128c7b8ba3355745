"""Several devices of one process behind one :class:`~shardpoint.device.Device`: each tensor is copied by its own.

A state may hold tensors on several accelerators of one process (a model
split over two GPUs). Copying them all through the first tensor's device
would make every other device's copy a plain, synchronous one from another
device's memory. A :class:`DeviceSet` routes each call to the member device
the tensor lives on (its copy stream, its events); host buffers come from
the first member, whose page-locked memory is registered for every device
of the process.

Events of a set (:class:`EventSet`) hold one event per member. A copy's
event completes the copy and every copy the set queued before it on any
member, as one device's event does for its own queue; ordering work after
it makes each member's current stream wait on that member's part.

Example::

    devices = DeviceSet([device_for("cuda:0"), device_for("cuda:1")])
    ev = devices.copy_to_host(buf, w_on_gpu1_bytes, devices.snapshot_point())
    devices.order_after(ev)   # each device's current stream waits on its own copies
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Sequence

import torch

from .base import CopyEvent, Device

__all__ = ["DeviceSet", "EventSet"]


class EventSet(CopyEvent):
    """One event per member device of a :class:`DeviceSet` (keyed by the member's ``id``).

    Example::

        ev = EventSet({id(d0): e0, id(d1): e1}); ev.synchronize()
    """

    def __init__(self, parts: dict[int, CopyEvent]):
        self.parts = dict(parts)

    def part(self, device: Device) -> CopyEvent | None:
        """``device``'s part of this event, or None where it has none."""
        return self.parts.get(id(device))

    def synchronize(self) -> None:
        for ev in self.parts.values():
            ev.synchronize()

    def query(self) -> bool:
        return all(ev.query() for ev in self.parts.values())


def _part(event: CopyEvent | None, device: Device) -> CopyEvent | None:
    return event.part(device) if isinstance(event, EventSet) else event


class DeviceSet(Device):
    """Member devices of one process, each serving its own tensors; see the module docs.

    ``members[0]`` serves what no member owns (host tensors) and hands out
    the host buffers. Made by :func:`~shardpoint.device.device_for` for
    tensors on several devices.

    Example::

        devices = DeviceSet([gpu0, gpu1])
        devices.member_for(w)   # gpu1 for a tensor on the second device
    """

    def __init__(self, members: Sequence[Device]):
        super().__init__()
        members = tuple(members)
        if len(members) < 2:
            raise ValueError(f"a DeviceSet needs two or more devices, got {len(members)}")
        self.members = members
        self.primary = members[0]
        self.type = self.primary.type
        self.asynchronous = any(m.asynchronous for m in members)
        self.pins = self.primary.pins
        self._latest: dict[int, CopyEvent] = {}  # each member's last queued copy
        self._latest_lock = threading.Lock()

    # --- which member ------------------------------------------------------------------------------

    def member_for(self, t: torch.Tensor) -> Device:
        for m in self.members:
            if m.owns(t):
                return m.member_for(t)
        return self.primary

    def owns(self, t: torch.Tensor) -> bool:
        return any(m.owns(t) for m in self.members)

    def serves(self, where: torch.device) -> bool:
        return any(m.serves(where) for m in self.members)

    # --- host memory: the first member's ------------------------------------------------------------

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buf = self.primary.host_buffer(nbytes)
        with self._lock:
            self.host_allocations += 1
            self.pinned_bytes += self.primary.held_size(int(nbytes)) if self.pins else 0
        return buf

    def free_host_buffer(self, buf: torch.Tensor) -> None:
        self.primary.free_host_buffer(buf)
        if self.pins:
            with self._lock:
                self.pinned_bytes -= self.primary.held_size(buf.numel())

    def held_size(self, nbytes: int) -> int:
        return self.primary.held_size(nbytes)

    def empty_host_cache(self) -> None:
        self.primary.empty_host_cache()

    def reclaim_host_memory(self) -> None:
        self.primary.reclaim_host_memory()

    def host_memory(self) -> dict[str, int]:
        return self.primary.host_memory()

    # --- capture: every member's guard --------------------------------------------------------------

    @contextlib.contextmanager
    def _guards(self) -> Any:
        with contextlib.ExitStack() as stack:
            for m in self.members:
                stack.enter_context(m.capture_guard())
            yield

    def capture_guard(self) -> contextlib.AbstractContextManager:
        return self._guards()

    def capturing(self) -> bool:
        return any(m.capturing() for m in self.members)

    # --- copies and events --------------------------------------------------------------------------

    def snapshot_point(self) -> CopyEvent:
        return EventSet({id(m): m.snapshot_point() for m in self.members})

    def _queued(self, member: Device, ev: CopyEvent) -> EventSet:
        with self._latest_lock:
            self._latest[id(member)] = ev
            return EventSet(self._latest)

    def byte_view(self, t: torch.Tensor, after: CopyEvent | None = None) -> tuple[torch.Tensor, bool]:
        m = self.member_for(t)
        return m.byte_view(t, _part(after, m))

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        m = self.member_for(src)
        return self._queued(m, m.copy_to_host(dst, src, _part(after, m)))

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        m = self.member_for(dst)
        return self._queued(m, m.copy_to_device(dst, src, _part(after, m)))

    def queue_to_host(self, compute: Callable[[], torch.Tensor], after: CopyEvent | None = None) -> tuple[torch.Tensor, CopyEvent]:
        # The work's device is unknown here: the first member's. Callers queue per device (device_for each).
        out, ev = self.primary.queue_to_host(compute, _part(after, self.primary))
        return out, EventSet({id(self.primary): ev})

    def order_after(self, event: CopyEvent) -> None:
        if not isinstance(event, EventSet):
            self.primary.order_after(event)
            return
        for m in self.members:
            ev = event.part(m)
            if ev is not None:
                m.order_after(ev)

    def keep_alive(self, t: torch.Tensor, event: CopyEvent) -> None:
        m = self.member_for(t)
        ev = _part(event, m)
        if ev is None:  # no copy of that member's yet: keep it for all of them
            ev = event
        m.keep_alive(t, ev)

    def close(self) -> None:
        for m in self.members:
            m.close()

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["devices"] = [m.describe() for m in self.members]
        return out
