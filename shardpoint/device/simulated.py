"""A simulated asynchronous device, for tests on machines without an accelerator.

It behaves like a copy engine: a copy is queued and runs later, in order, on
a thread of its own, and signals an event when done. So the mistakes an
accelerator punishes show up on a CPU:

- reading a staged buffer before its event completes reads stale bytes;
- changing a tensor after the save returned but before its copy ran puts
  the changed values in the snapshot (a missing fence);
- a temporary dropped before its copy ran is reused: a temporary made by
  :meth:`SimulatedDevice.byte_view` comes from a pool that hands its block
  to the next temporary at once (the copy reads that one's bytes), and any
  other source that is gone is read as poison bytes. The simulation
  holds only a weak reference to a source unless :meth:`keep_alive` was
  called for it;
- a wait, query or allocation from any thread while another thread captures
  a graph in global mode (:meth:`SimulatedDevice.capture`) fails and
  invalidates the capture, unless it runs in the device's
  :meth:`~shardpoint.device.Device.capture_guard`
  (:class:`~shardpoint.device.sim_models.CaptureModel`);
- a copy to or from host memory that :meth:`host_buffer` did not hand out
  (pageable memory) runs at once, in the call, as a "non-blocking" copy
  from pageable memory does; :attr:`SimulatedDevice.pageable_copies` counts them.
  So does a copy from or to a strided view of page-locked memory: the
  framework packs it through a pageable temporary first;
- a copy into a strided tensor on the device (a transposed or column
  block view) goes through a contiguous device temporary of the copy's
  size, as the framework makes one; :attr:`SimulatedDevice.largest_temporary`
  is the largest such temporary, or one :meth:`byte_view` made;
- host buffers are the library's own registered memory
  (:attr:`SimulatedDevice.pinned`, an
  :class:`~shardpoint.device.host_memory.OwnedHostMemory` whose registration
  is counted instead of calling the driver), given back when freed;
  :attr:`SimulatedDevice.host` is the framework's process-wide caching
  allocator other users take page-locked blocks from, which keeps freed
  blocks until :meth:`empty_host_cache`
  (:class:`~shardpoint.device.sim_models.HostCache`): a test sees whether
  the engine empties other users' cached blocks;
- several devices in one process: a tensor given to :meth:`SimulatedDevice.place`
  lives on that device, and a copy of it through another device is a plain
  synchronous one, as an accelerator makes for another device's tensor
  (:attr:`SimulatedDevice.foreign_copies` counts them). A device made with
  ``sibling=`` is another device of the sibling's process: they share the
  registered host memory and know where each placed tensor lives;
- every host wait for the device (an event synchronize) is counted per
  thread, and a thread may refuse them (:attr:`SimulatedDevice.waits`,
  :class:`~shardpoint.device.sim_models.HostWaits`): a test proves that the
  training thread never waits where a real device would stall it. Ordering
  work after an event (:meth:`SimulatedDevice.order_after`) stands the host
  still but counts as no wait: on a device a stream waits there.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from typing import Any, Iterator

import torch

from .base import CopyEvent, Device, flat_bytes
from .host_memory import OwnedHostMemory
from .sim_models import CaptureModel, DevicePool, HostCache, HostWaits

__all__ = ["SimulatedDevice", "SimEvent", "POISON"]

POISON = 0xA5  # what a copy reads from memory freed before it ran


class SimEvent(CopyEvent):
    """Completion of one simulated copy (and of every copy queued before it).

    Example::

        ev = sim.copy_to_host(buf, src); ev.synchronize()
    """

    def __init__(self, device: "SimulatedDevice | None" = None, blocking: bool = True) -> None:
        self.blocking = blocking
        self._done = threading.Event()
        self.held: list[torch.Tensor] = []
        self.device = device

    def _unsafe(self, what: str) -> None:
        if self.device is not None:
            with self.device.capture_guard():
                self.device.captures.unsafe(what)

    def synchronize(self) -> None:
        self._unsafe("an event synchronize")
        if self.device is not None:
            self.device.waits.record("an event synchronize")
        self._done.wait()

    def stream_wait(self) -> None:
        """What a stream waiting on this event models: the host stands still until it completes, counted as no wait."""
        self._done.wait()

    def query(self) -> bool:
        self._unsafe("an event query")
        return self._done.is_set()

    def complete(self) -> None:
        """Mark done and let go of whatever was kept alive for the copy (called by the copy thread)."""
        self.held.clear()
        self._done.set()


def _source(t: torch.Tensor) -> tuple[Any, int, tuple, tuple, torch.dtype]:
    return weakref.ref(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def _resolve(src: tuple) -> torch.Tensor | None:
    ref, offset, shape, stride, dtype = src
    storage = ref()
    if storage is None:
        return None
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


class SimulatedDevice(Device):
    """Host tensors copied as if by an asynchronous copy engine; see the module docs.

    ``delay`` is how long each copy waits before it runs (seconds).
    ``copies`` counts the copies run, ``events`` the completion events of
    queued copies (one for several copies queued together). Buffers from :meth:`host_buffer`
    count as pinned, so budgets can be tested; ``pinned`` is the registered
    memory they come from (shared with its siblings), ``host`` the
    framework's caching allocator other users share, ``captures`` the graph
    captures running, ``waits`` the host's waits for the device per thread.
    ``placements`` maps each placed storage to the device it lives on, for
    this device and its siblings. ``largest_temporary`` is the most bytes
    one device temporary of a copy held.

    Example::

        sim = SimulatedDevice(delay=0.01)
        ev = sim.copy_to_host(buf, src)   # buf still holds old bytes here
        ev.synchronize()                  # now it holds src's
        sim.close()
    """

    type = "cpu"
    asynchronous = True
    pins = True

    def __init__(self, delay: float = 0.002, sibling: "SimulatedDevice | None" = None):
        super().__init__()
        self.delay = float(delay)
        self.copies = 0
        self._q: "queue.Queue" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self.captures = CaptureModel()
        self.host = HostCache()
        self.pool = DevicePool()
        self.pageable_copies = 0
        self.largest_temporary = 0  # bytes of the largest device temporary a copy made
        self.events = 0  # completion events of queued copies
        self._queued: SimEvent | None = None  # the last copy queued
        self.foreign_copies = 0
        self.waits = HostWaits()
        self.registered = 0  # registrations made through this device
        if sibling is None:
            self.pinned = OwnedHostMemory(self._register, self._unregister)
            self.placements: "weakref.WeakValueDictionary[int, SimulatedDevice]" = weakref.WeakValueDictionary()
        else:  # another device of the same process: page-locked memory is the process's, for every device
            self.pinned, self.placements = sibling.pinned, sibling.placements
        self._places: set[int] = set()

    def _register(self, ptr: int, nbytes: int) -> None:
        with self.capture_guard():
            self.captures.unsafe("a host memory registration")
        self.registered += 1

    def _unregister(self, ptr: int) -> None:
        with self.capture_guard():
            self.captures.unsafe("a host memory unregistration")

    def place(self, *tensors: torch.Tensor) -> None:
        """Have ``tensors`` (their storages) live on this device, as if on one accelerator of several.

        Example::

            gpu0 = SimulatedDevice(); gpu1 = SimulatedDevice(sibling=gpu0)
            gpu1.place(*model[1].parameters())
        """
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            self.placements[ptr] = self
            self._places.add(ptr)

    def owns(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        where = self.placements.get(t.untyped_storage().data_ptr())
        return where is None or where is self

    # --- what the stand-in models beyond the copy engine -----------------------------------------

    def capture(self, mode: str = "global") -> contextlib.AbstractContextManager:
        """Capture a graph on the calling thread for the body (see :class:`CaptureModel`).

        Example::

            with sim.capture():
                loss = step()   # a worker's unguarded wait now fails this capture
        """
        return self.captures.capture(mode)

    def capture_guard(self) -> contextlib.AbstractContextManager:
        return self.captures.thread_local()

    def capturing(self) -> bool:
        return self.captures.capturing()

    def held_size(self, nbytes: int) -> int:
        return OwnedHostMemory.block_size(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        with self.capture_guard():
            self.captures.unsafe("a page-locked allocation")
        return self.pinned.allocate(nbytes)

    def free_host_buffer(self, buf: torch.Tensor) -> None:
        super().free_host_buffer(buf)
        self.pinned.free(buf)

    def empty_host_cache(self) -> None:
        with self.capture_guard():
            self.captures.unsafe("emptying the host cache")
        self.host.empty()

    def host_memory(self) -> dict[str, int]:
        return {"held": self.pinned.held, "in_use": self.pinned.held}

    def byte_view(self, t: torch.Tensor, after: CopyEvent | None = None) -> tuple[torch.Tensor, bool]:
        if t.is_contiguous():
            return flat_bytes(t)
        with self.capture_guard():  # a temporary is an allocation on the copy queue
            self.captures.unsafe("a device allocation")
        out = self.pool.temporary(t.detach())
        self.largest_temporary = max(self.largest_temporary, out.numel())
        if self._places:
            self.place(out)  # made on this device, as the tensor it copies
        return out, True

    # --- the copy engine ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold every queued copy until the body ends, as a busy device would, whatever the delay.

        Example::

            with sim.held():
                ev = sim.copy_to_host(buf, src)   # not run yet, however slow the caller is
            ev.synchronize()
        """
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()

    def _submit(self, dst: torch.Tensor, src: torch.Tensor, host_side: torch.Tensor, device_side: torch.Tensor) -> SimEvent:
        pinned = self._pinned(host_side)
        if not pinned or not self.owns(device_side):
            # Pageable memory (a strided view of page-locked memory is packed through a pageable temporary), or
            # another device's tensor: it runs now, in the call, after the copies queued before it (the stream
            # is synchronized first, as on the device).
            if self._queued is not None:
                self._queued.stream_wait()
            dst.copy_(src)
            if pinned:
                self.foreign_copies += 1
            else:
                self.pageable_copies += 1
            ev = SimEvent(self)
            ev.complete()
            return ev
        return self._enqueue([(dst, _source(src))])

    def _enqueue(self, copies: list) -> SimEvent:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardpoint-simulated-copy", daemon=True)
                self._thread.start()
            self.events += 1
        ev = SimEvent(self)
        self._queued = ev
        self._q.put((copies, None, ev))
        return ev

    def _pinned(self, host_side: torch.Tensor) -> bool:
        return (self.pinned.owns(host_side) or self.host.owns(host_side)) and host_side.is_contiguous()

    def copy_many_to_host(self, pairs: Any, after: CopyEvent | None = None) -> CopyEvent:
        if not all(self._pinned(d) and self.owns(s) for d, s in pairs):
            return super().copy_many_to_host(pairs, after)
        return self._enqueue([(d, _source(s)) for d, s in pairs])

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            dst, src, ev = job
            self._running.wait()
            time.sleep(self.delay)
            if callable(src):  # queued work (queue_to_host): its result lands in dst
                out = src()
                dst.resize_(out.shape).copy_(out)
                del out
            else:
                for d, s in dst:  # copies recorded with one event
                    view = _resolve(s)
                    if view is None:
                        d.view(torch.uint8).fill_(POISON)
                    else:
                        d.copy_(view)
                    del view
                    self.copies += 1
            del job, dst, src
            ev.complete()

    def queue_to_host(self, compute: Any, after: CopyEvent | None = None) -> tuple[torch.Tensor, CopyEvent]:
        # Computed later on the copy thread, as the device would: a reader that skips the wait finds it empty.
        host = torch.empty(0, dtype=torch.int64)
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardpoint-simulated-copy", daemon=True)
                self._thread.start()
        ev = SimEvent(self)
        self._queued = ev
        self._q.put((host, compute, ev))
        return host, ev

    def snapshot_point(self) -> CopyEvent:
        ev = SimEvent(self)
        ev.complete()
        return ev

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        return self._submit(dst, src, dst, src)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        if not dst.is_contiguous() and self.owns(dst):  # the framework copies into a contiguous temporary, then scatters
            self.largest_temporary = max(self.largest_temporary, dst.numel() * dst.element_size())
        return self._submit(dst, src, src, dst)

    def order_after(self, event: CopyEvent) -> None:
        # No streams to order: the host stands still, as the training stream would wait on a device.
        if isinstance(event, SimEvent):
            event.stream_wait()
        else:
            event.synchronize()

    def keep_alive(self, t: torch.Tensor, event: CopyEvent) -> None:
        if isinstance(event, SimEvent) and not event.query():
            event.held.append(t)

    def close(self) -> None:
        for ptr in self._places:
            if self.placements.get(ptr) is self:
                self.placements.pop(ptr, None)
        self._places.clear()
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(None)
            thread.join()
