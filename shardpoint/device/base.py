"""What the engine needs from a device, declared once: host buffers, copies, events.

Every ability the save and load engines use is declared on :class:`Device`
with its contract; the engine never asks what kind of device it holds. The
contract follows an asynchronous accelerator, where a copy is queued and
completes later:

- :meth:`Device.host_buffer` gives host memory the device copies to and from
  at full speed (page-locked for an accelerator), counted in
  :attr:`Device.pinned_bytes` until :meth:`Device.free_host_buffer`.
- :meth:`Device.snapshot_point` marks "everything the caller's thread has
  queued so far"; a copy given that mark reads the values as of then.
- :meth:`Device.copy_to_host` and :meth:`Device.copy_to_device` queue a
  copy and return a :class:`CopyEvent`. The bytes are there only once the
  event completes: the host blocks with :meth:`CopyEvent.synchronize`, and
  work queued later by the caller's thread waits without blocking the host
  with :meth:`Device.order_after`.
- :meth:`Device.copy_many_to_host` queues several copies with one
  completion event (small tensors staged together wait on one event).
- Events block the host thread that waits on them (the thread sleeps, it
  does not spin): :attr:`CopyEvent.blocking`.
- :meth:`Device.keep_alive` ties a temporary's memory to a copy: a tensor
  made only to be copied (a contiguous version of a strided one) must not be
  reused before its copy has read it.
- Every call a device object makes that waits, queries or allocates runs
  in its :meth:`Device.capture_guard`, so that it stays legal from any
  thread while the training thread captures a graph; :meth:`Device.capturing`
  tells whether the calling thread is capturing one.
- :meth:`Device.free_host_buffer` gives back exactly that buffer's memory
  once the caller drops it (:meth:`Device.reclaim_host_memory` after that,
  where the device's memory comes from a cache); nothing else's.
  :meth:`Device.empty_host_cache` empties the framework's process-wide
  cache, other users' blocks included, and the engine never calls it;
  :meth:`Device.host_memory` reports what is held and what is in use.
- :meth:`Device.member_for` names the device object that queues the work
  of one tensor: the object itself, or, for a set of devices
  (:class:`~shardpoint.device.routed.DeviceSet`), the member it lives on.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from typing import Any, Callable, Sequence

import torch

__all__ = ["CopyEvent", "Completed", "Device", "flat_bytes"]


def flat_bytes(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t``'s bytes as a flat uint8 tensor on ``t``'s device, and whether it is a temporary.

    A strided tensor is made contiguous first: that copy is a temporary the
    caller must keep alive until any copy reading it completes
    (:meth:`Device.keep_alive`).

    Example::

        raw, temporary = flat_bytes(torch.ones(2, 3).t())  # temporary is True
    """
    t = t.detach()
    temporary = not t.is_contiguous()
    if temporary:
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8), temporary


class CopyEvent(abc.ABC):
    """The completion of queued copies.

    Example::

        ev = device.copy_to_host(buf, src, device.snapshot_point())
        ev.synchronize()  # the bytes are in buf now

    ``blocking``: a host wait on this event sleeps until it completes
    instead of spinning a core (a CUDA event made with ``blocking=True``).
    """

    blocking: bool = True

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the copies before this event are complete."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once the copies are complete (never blocks)."""


class Completed(CopyEvent):
    """An event that is complete when made: what a synchronous copy returns.

    Example::

        Completed().synchronize()  # returns at once
    """

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class Device(abc.ABC):
    """One device the engine copies from and to, and the host memory it stages through.

    ``asynchronous`` is True where copies complete after the call that
    queued them (an accelerator, the simulated device): the engine then
    waits on events before it reads a staged byte, and the lazy save orders
    the training work after the copies instead of blocking the host.
    ``pinned_bytes`` counts the page-locked host bytes this object handed
    out and has not yet freed.

    Example::

        dev = device_for(tensor)
        buf = dev.host_buffer(1 << 20)
        ev = dev.copy_to_host(buf[: t.nbytes], raw_bytes(t), dev.snapshot_point())
        ev.synchronize()
    """

    type: str = "cpu"
    asynchronous: bool = False
    pins: bool = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pinned_bytes = 0
        self.host_allocations = 0

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer of ``nbytes``, page-locked where this device pins (counted in ``pinned_bytes``)."""
        buf = self._allocate(int(nbytes))
        with self._lock:
            self.host_allocations += 1
            if self.pins:
                self.pinned_bytes += self.held_size(int(nbytes))
        return buf

    def free_host_buffer(self, buf: torch.Tensor) -> None:
        """Give back a buffer from :meth:`host_buffer` (its bytes leave ``pinned_bytes``); the caller drops it.

        The memory may stay cached for the next buffer: the caller drops its
        references, then calls :meth:`empty_host_cache` to give it back.
        """
        if self.pins:
            with self._lock:
                self.pinned_bytes -= self.held_size(buf.numel())

    def empty_host_cache(self) -> None:
        """Give the cached host memory no buffer uses back to the system (nothing to do for plain host memory).

        Process-wide where the framework caches page-locked memory: other
        users' cached blocks go too. The engine calls
        :meth:`reclaim_host_memory` instead.
        """
        return None

    def reclaim_host_memory(self) -> None:
        """After a buffer from :meth:`free_host_buffer` was dropped: make sure its memory left the process.

        Nothing to do where the device maps and registers its own buffers
        (they go back when dropped); a device whose buffers come from the
        framework's cache empties it here, as nothing else would give them back.

        Example::

            device.free_host_buffer(buf); del buf; device.reclaim_host_memory()
        """
        return None

    def member_for(self, t: torch.Tensor) -> "Device":
        """The device object that queues copies of ``t``: this one (a set of devices answers its member).

        Example::

            device.member_for(param).order_after(event)
        """
        return self

    def host_memory(self) -> dict[str, int]:
        """``{"held": bytes the process holds, "in_use": bytes handed out}`` of this device's host memory.

        An accelerator reads its allocator's own statistics where the
        framework has them (all of the process's page-locked memory, not only
        this object's); otherwise both are :attr:`pinned_bytes`.

        Example::

            device.host_memory()  # {'held': 268435456, 'in_use': 0} after a save on an accelerator
        """
        return {"held": self.pinned_bytes, "in_use": self.pinned_bytes}

    def queue_to_host(self, compute: Callable[[], torch.Tensor], after: CopyEvent | None = None) -> tuple[torch.Tensor, CopyEvent]:
        """Run ``compute`` where this device queues its copies, after ``after``; its result in host memory, and when.

        An accelerator queues the work on its copy stream and the copy of
        the (small) result into page-locked memory without waiting: read the
        host tensor only once the event completed. Here it runs at once.

        Example::

            host, ev = device.queue_to_host(lambda: t.sum().reshape(1), device.snapshot_point())
            ...; ev.synchronize(); host.tolist()
        """
        out = compute()
        return (out if out.device.type == "cpu" else out.to("cpu")), Completed()

    def capture_guard(self) -> contextlib.AbstractContextManager:
        """A context in which the calling thread's device calls ignore graph captures on other threads.

        Example::

            with device.capture_guard():
                event.synchronize()
        """
        return contextlib.nullcontext()

    def capturing(self) -> bool:
        """Whether the calling thread is capturing a graph on this device (nothing may wait or allocate then)."""
        return False

    def held_size(self, nbytes: int) -> int:
        """The host bytes a buffer of ``nbytes`` really takes (an allocator may round it up)."""
        return int(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on this device (so a copy to or from it goes through this object)."""
        return self.serves(t.device)

    def serves(self, where: torch.device) -> bool:
        """Whether tensors on ``where`` are this device's."""
        return torch.device(where).type == self.type

    def byte_view(self, t: torch.Tensor, after: CopyEvent | None = None) -> tuple[torch.Tensor, bool]:
        """``t``'s bytes, flat, and whether they are a temporary (see :func:`~shardpoint.device.byte_view`).

        A temporary is made where the copy that reads it will run, after
        ``after``, so that it holds the values as of the snapshot point.
        """
        return flat_bytes(t)

    @abc.abstractmethod
    def snapshot_point(self) -> CopyEvent:
        """Mark the work the calling thread has queued so far; copies given it read values as of now."""

    @abc.abstractmethod
    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        """Queue a copy of ``src`` (this device) into host ``dst`` after ``after``; its completion event.

        ``src`` must stay alive until the event completes: pass temporaries
        to :meth:`keep_alive`.
        """

    def copy_many_to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: CopyEvent | None = None) -> CopyEvent:
        """Queue a copy of each ``(host dst, src)`` pair after ``after``; one event for all of them.

        An accelerator records one event after the last copy; here each is
        queued by :meth:`copy_to_host`, and copies complete in order, so the
        last one's event stands for all.

        Example::

            ev = device.copy_many_to_host([(buf[:4], a_bytes), (buf[4:12], b_bytes)], device.snapshot_point())
        """
        ev: CopyEvent = Completed()
        for dst, src in pairs:
            got = self.copy_to_host(dst, src, after)
            if not isinstance(got, Completed):
                ev = got
        return ev

    @abc.abstractmethod
    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        """Queue a copy of host ``src`` into ``dst`` (this device) after ``after``; its completion event.

        ``src`` (a buffer from :meth:`host_buffer`) must not be reused before the event completes.
        """

    @abc.abstractmethod
    def order_after(self, event: CopyEvent) -> None:
        """Make the work the calling thread queues from now on run after ``event``.

        An accelerator makes the caller's current stream wait on the event
        (the host goes on at once); a synchronous device blocks until it completes.
        """

    @abc.abstractmethod
    def keep_alive(self, t: torch.Tensor, event: CopyEvent) -> None:
        """Keep ``t``'s memory from reuse until ``event`` completes (a temporary being copied)."""

    def close(self) -> None:
        """Stop what this device started (the simulated device's copy thread); idempotent."""
        return None

    def describe(self) -> dict[str, Any]:
        """A summary for logs and benchmarks: the type, whether asynchronous, pinned bytes held, host memory."""
        host = self.host_memory()
        return {
            "type": self.type, "asynchronous": self.asynchronous, "pinned_bytes": self.pinned_bytes,
            "host_held": host["held"], "host_in_use": host["in_use"],
        }
