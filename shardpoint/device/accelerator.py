"""The accelerator path: page-locked host buffers, one copy stream, events for completion.

Written against the device-generic API of PyTorch (``torch.accelerator``,
``torch.Stream``, ``torch.Event``), with ``torch.cuda``'s own classes for a
CUDA device, whose stream context and events every supported PyTorch has.

Rules this module keeps:

- The copy stream is made once, when the device object is made (on the
  thread that makes the saver or the load), never per save and never in a
  worker thread.
- A copy waits for the work the caller queued before its snapshot point
  (``wait_event``), so it reads the values as of the call, not older ones.
- Completion is an event recorded on the copy stream after the copy: the
  host blocks on it (``synchronize``), training work waits on it by stream
  (``current_stream().wait_event``), and the host goes on.
- Events are made with blocking synchronization: a thread waiting on one
  sleeps instead of spinning a core beside the training loop.
- A temporary made for a copy is tied to the copy stream
  (``record_stream``), so the caching allocator does not hand its memory to
  another tensor before the copy has read it.
- Every call that waits, queries or allocates runs in thread-local graph
  capture mode (:mod:`.capture`): the save's worker threads then never
  invalidate a graph the training thread is capturing.
- The staging memory of a CUDA device is the library's own: mapped and
  registered (``cudaHostRegister``, portable to every device of the
  process) by :class:`~shardpoint.device.host_memory.OwnedHostMemory`,
  unregistered and unmapped when freed. PyTorch's page-locked cache, which
  other users share (a data loader's pinned batches), is never emptied by
  the engine. Other accelerators, which have no registration call, take
  PyTorch's page-locked memory and empty its cache when a buffer is freed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, Mapping

import torch

from .base import Completed, CopyEvent, Device, flat_bytes
from .capture import ThreadLocalCapture
from .host_memory import OwnedHostMemory, cuda_register, cuda_unregister, empty_host_cache, host_stats

__all__ = ["AcceleratorDevice", "StreamEvent", "with_index"]


def with_index(dev: torch.device, environ: Mapping[str, str] | None = None) -> torch.device:
    """``dev`` with its index: this rank's device when it names none.

    A launcher such as torchrun starts one process per device and sets
    ``LOCAL_RANK``; with several devices visible, that is the rank's device
    (modulo their number), whether or not the training script made it the
    current one. Otherwise the current device.

    Example::

        with_index(torch.device("cuda"), {"LOCAL_RANK": "3"})  # device(type='cuda', index=3) on an 8-GPU host
    """
    if dev.index is not None:
        return dev
    env = os.environ if environ is None else environ
    module = torch.cuda if dev.type == "cuda" else getattr(torch, dev.type, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else 0
    local = env.get("LOCAL_RANK", "")
    if count > 1 and local.isdigit():
        return torch.device(dev.type, int(local) % count)
    if dev.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(dev.type, torch.accelerator.current_device_index())


class StreamEvent(CopyEvent):
    """An event recorded on a stream; ``raw`` is the framework's event object.

    Example::

        ev = device.copy_to_host(buf, src); ev.synchronize()
    """

    def __init__(self, raw: Any, guard: Any = None, blocking: bool = True):
        self.raw = raw
        self.guard = guard if guard is not None else contextlib.nullcontext()
        self.blocking = blocking

    def synchronize(self) -> None:
        with self.guard:  # legal from a worker while the training thread captures a graph
            self.raw.synchronize()

    def query(self) -> bool:
        with self.guard:
            return bool(self.raw.query())


class AcceleratorDevice(Device):
    """A CUDA device, or any device ``torch.accelerator`` drives.

    Example::

        dev = AcceleratorDevice(torch.device("cuda", 0))
        buf = dev.host_buffer(t.nbytes)   # pinned
        ev = dev.copy_to_host(buf, t.reshape(-1).view(torch.uint8), dev.snapshot_point())
        dev.order_after(ev)               # the training stream waits; the host does not
    """

    asynchronous = True
    pins = True

    def __init__(self, device: torch.device | str):
        super().__init__()
        dev = with_index(torch.device(device))
        self._cuda = dev.type == "cuda"
        self.device = dev
        self.type = dev.type
        # Made here, on the constructing thread, once for the life of this object.
        self.stream = torch.cuda.Stream(device=dev) if self._cuda else torch.Stream(device=dev)
        self._held: list[tuple[CopyEvent, torch.Tensor]] = []
        self._held_lock = threading.Lock()
        self._capture = ThreadLocalCapture.for_cuda() if self._cuda else ThreadLocalCapture(None)
        self.owned = OwnedHostMemory(self._register, cuda_unregister) if self._cuda else None

    def capture_guard(self) -> ThreadLocalCapture:
        return self._capture

    def capturing(self) -> bool:
        if self._cuda:
            return bool(torch.cuda.is_current_stream_capturing())
        return False

    def _register(self, ptr: int, nbytes: int) -> None:
        with self._capture:  # legal while the training thread captures a graph
            cuda_register(ptr, nbytes)

    def empty_host_cache(self) -> None:
        with self._capture:
            empty_host_cache()

    def reclaim_host_memory(self) -> None:
        if self.owned is None:  # buffers from PyTorch's cache: only emptying it gives them back
            self.empty_host_cache()

    def free_host_buffer(self, buf: torch.Tensor) -> None:
        super().free_host_buffer(buf)
        if self.owned is not None:
            with self._capture:
                self.owned.free(buf)

    def host_memory(self) -> dict[str, int]:
        """The library's registered staging memory on CUDA; elsewhere PyTorch's page-locked statistics."""
        if self.owned is not None:
            return {"held": self.owned.held, "in_use": self.owned.held}
        return host_stats() or super().host_memory()

    def serves(self, where: torch.device) -> bool:
        where = torch.device(where)
        return where.type == self.type and (where.index is None or where.index == self.device.index)

    def held_size(self, nbytes: int) -> int:
        if self.owned is not None:
            return OwnedHostMemory.block_size(nbytes)  # whole pages
        # PyTorch's pinned allocator hands out blocks rounded up to a power of two.
        return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.owned is not None:
            return self.owned.allocate(nbytes)
        with self._capture:  # the pinned allocator allocates and queries events
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _current_stream(self) -> Any:
        if self._cuda:
            return torch.cuda.current_stream(self.device)
        return torch.accelerator.current_stream(self.device)

    def _event(self) -> Any:
        # Blocking: a worker waiting on the copies sleeps instead of spinning a core.
        return torch.cuda.Event(blocking=True) if self._cuda else torch.Event(device=self.device, blocking=True)

    def snapshot_point(self) -> CopyEvent:
        ev = self._event()
        ev.record(self._current_stream())
        return StreamEvent(ev, self._capture)

    @contextlib.contextmanager
    def _on_copy_stream(self, after: CopyEvent | None) -> Iterator[None]:
        """Work queued inside runs on the copy stream, after ``after``; the caller's stream is restored after."""
        if isinstance(after, StreamEvent):
            self.stream.wait_event(after.raw)
        if self._cuda:
            with self._capture, torch.cuda.stream(self.stream):  # its allocations are legal during a capture
                yield
            return
        prev_index = torch.accelerator.current_device_index()
        prev = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(self.stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(prev)
            torch.accelerator.set_device_index(prev_index)

    def _on_stream(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None) -> CopyEvent:
        ev = self._event()
        with self._on_copy_stream(after):
            dst.copy_(src, non_blocking=True)
            ev.record(self.stream)
        return StreamEvent(ev, self._capture)

    def copy_many_to_host(self, pairs: Any, after: CopyEvent | None = None) -> CopyEvent:
        mine = [(dst, src) for dst, src in pairs if self.owns(src)]
        for dst, src in pairs:
            if not self.owns(src):
                dst.copy_(src)  # a host tensor in a device state: plain and synchronous, as in copy_to_host
        if not mine:
            return Completed()
        ev = self._event()
        with self._on_copy_stream(after):
            for dst, src in mine:
                dst.copy_(src, non_blocking=True)
            ev.record(self.stream)  # one event for the batch
        return StreamEvent(ev, self._capture)

    def byte_view(self, t: torch.Tensor, after: CopyEvent | None = None) -> tuple[torch.Tensor, bool]:
        if t.is_contiguous() or not self.owns(t):
            return flat_bytes(t)
        # The contiguous copy runs on the copy stream after the snapshot point: it then holds the
        # values as of the call even when made from a worker thread, whose current stream is another.
        with self._on_copy_stream(after):
            raw, _ = flat_bytes(t)
        return raw, True

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        if not self.owns(src):
            # A host tensor in a device state (a step counter), or one on another device: a plain,
            # synchronous copy (this device's stream and events do not order another device's work).
            dst.copy_(src)
            return Completed()
        return self._on_stream(dst, src, after)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        if not self.owns(dst):
            dst.copy_(src)
            return Completed()
        return self._on_stream(dst, src, after)

    def queue_to_host(self, compute: Any, after: CopyEvent | None = None) -> tuple[torch.Tensor, CopyEvent]:
        ev = self._event()
        with self._on_copy_stream(after):  # in the capture guard: its allocations are legal during a capture
            out = compute()
            if not self.owns(out):
                return out.to("cpu"), Completed()
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            ev.record(self.stream)
        return host, StreamEvent(ev, self._capture)

    def order_after(self, event: CopyEvent) -> None:
        if isinstance(event, StreamEvent):
            self._current_stream().wait_event(event.raw)
        else:
            event.synchronize()

    def keep_alive(self, t: torch.Tensor, event: CopyEvent) -> None:
        if self.owns(t):
            # The allocator keeps the block from reuse until the copy stream's queued work is done.
            t.record_stream(self.stream)
            return
        with self._held_lock:  # host memory: hold a reference until the copy completes
            self._held = [(e, h) for e, h in self._held if not e.query()]
            self._held.append((event, t))

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["device"] = str(self.device)
        return out
