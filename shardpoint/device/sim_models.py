"""What the simulated device models of an accelerator beyond its copy engine: graph capture and cached host memory.

- :class:`CaptureModel`: a thread may capture a graph (``capture()``); while
  a capture in *global* mode runs, an unsafe call (an event wait or query,
  an allocation) from any thread not in thread-local mode fails and
  invalidates that capture, which then fails when it ends, as CUDA does.
- :class:`DevicePool`: the device's caching allocator for temporaries: a
  block freed (its last reference dropped) goes to the next temporary at
  once, so a copy still queued from a dropped temporary reads another
  tensor's bytes, unless the temporary was kept alive for it;
- :class:`HostWaits`: the host's waits for the device (an event
  synchronize), counted per thread, and refused on a thread that must never
  wait, such as the training thread at a lazy save's fence;
- :class:`HostCache`: a caching allocator of page-locked host memory that
  rounds each block up to a power of two, hands a freed block to the next
  allocation of its size, and gives memory back only when emptied, as
  PyTorch's does. ``held`` is what the process holds, ``in_use`` what is
  handed out.

Example::

    model = CaptureModel()
    with model.capture():
        ...               # a worker's unsafe call here fails unless in thread-local mode
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["CaptureModel", "SimulatedCaptureError", "HostCache", "DevicePool", "HostWaits", "SimulatedHostWaitError"]


class SimulatedCaptureError(RuntimeError):
    """What CUDA raises for an unsafe call during a capture, and at the end of a capture it invalidated.

    Example::

        with pytest.raises(SimulatedCaptureError): model.unsafe("event synchronize")
    """


class SimulatedHostWaitError(RuntimeError):
    """A thread waited for the simulated device inside :meth:`HostWaits.refused`.

    Example::

        with sim.waits.refused():
            event.synchronize()   # raises
    """


class HostWaits:
    """How often each thread made the host wait for the device, and the threads that may not.

    A wait is an event's ``synchronize`` (reading a value the device
    computes needs one). Ordering later work after an event
    (:meth:`~shardpoint.device.Device.order_after`) is no host wait: a
    stream waits there on a real device, and the simulation only stands the
    host still for it.

    Example::

        waits = HostWaits()
        waits.record("an event synchronize")
        waits.count()   # 1, on the calling thread
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._refused: set[int] = set()

    def record(self, what: str) -> None:
        """Count a host wait on the calling thread; raise :class:`SimulatedHostWaitError` where it is refused."""
        me = threading.get_ident()
        with self._lock:
            self._counts[me] = self._counts.get(me, 0) + 1
            refused = me in self._refused
        if refused:
            raise SimulatedHostWaitError(
                f"{what} on thread {threading.current_thread().name!r} made the host wait for the device "
                f"where it must not (the thread is in HostWaits.refused)")

    def count(self, thread: threading.Thread | None = None) -> int:
        """The host waits made on ``thread`` (default: the calling thread)."""
        ident = threading.get_ident() if thread is None else thread.ident
        with self._lock:
            return self._counts.get(ident, 0)

    @property
    def total(self) -> int:
        """The host waits made on every thread."""
        with self._lock:
            return sum(self._counts.values())

    @contextlib.contextmanager
    def refused(self) -> Iterator[None]:
        """Refuse host waits on the calling thread for the body (they raise :class:`SimulatedHostWaitError`)."""
        me = threading.get_ident()
        with self._lock:
            nested = me in self._refused
            self._refused.add(me)
        try:
            yield
        finally:
            if not nested:
                with self._lock:
                    self._refused.discard(me)


@dataclass
class _Capture:
    mode: str
    thread: str
    invalidated_by: list[str] = field(default_factory=list)


class CaptureModel:
    """Graph captures running on threads, and the capture mode of each thread (see the module docs).

    Example::

        with model.capture("global"):
            with model.thread_local():
                model.unsafe("event query")   # legal: this thread ignores other threads' captures
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._captures: dict[int, _Capture] = {}
        self._modes = threading.local()
        self.violations = 0

    def mode(self) -> str:
        """The calling thread's capture mode: ``"global"`` (the default), ``"thread_local"`` or ``"relaxed"``."""
        return getattr(self._modes, "mode", "global")

    @contextlib.contextmanager
    def thread_local(self) -> Iterator[None]:
        """Run the body in thread-local capture mode (the previous mode comes back after)."""
        previous = self.mode()
        self._modes.mode = "thread_local" if previous == "global" else previous
        try:
            yield
        finally:
            self._modes.mode = previous

    @contextlib.contextmanager
    def capture(self, mode: str = "global") -> Iterator[None]:
        """Capture a graph on the calling thread for the body; raises at the end if something invalidated it."""
        if mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture mode must be 'global', 'thread_local' or 'relaxed', got {mode!r}")
        me = threading.get_ident()
        cap = _Capture(mode, threading.current_thread().name)
        with self._lock:
            if me in self._captures:
                raise SimulatedCaptureError("a capture is already running on this thread")
            self._captures[me] = cap
        try:
            yield
        finally:
            with self._lock:
                del self._captures[me]
        if cap.invalidated_by:
            raise SimulatedCaptureError(
                f"operation failed due to a previous error during capture: the capture was invalidated by "
                f"{cap.invalidated_by[0]}"
            )

    def capturing(self) -> bool:
        """Whether the calling thread is capturing."""
        with self._lock:
            return threading.get_ident() in self._captures

    def active(self) -> bool:
        """Whether any thread is capturing."""
        with self._lock:
            return bool(self._captures)

    def unsafe(self, what: str) -> None:
        """Check a potentially unsafe call from the calling thread; raise (and invalidate) where CUDA would."""
        me = threading.get_ident()
        mode = self.mode()
        with self._lock:
            hit = [c for t, c in self._captures.items() if (t == me and c.mode != "relaxed") or (t != me and c.mode == "global" and mode == "global")]
            if not hit:
                return
            who = f"{what} on thread {threading.current_thread().name!r}"
            for c in hit:
                c.invalidated_by.append(who)
            self.violations += 1
        raise SimulatedCaptureError(f"operation not permitted when stream is capturing: {who}")


class HostCache:
    """A caching allocator of page-locked host memory (see the module docs).

    Example::

        cache = HostCache()
        buf = cache.allocate(3 << 20)    # holds 4 MiB
        cache.free(buf); cache.held      # still 4 MiB until empty()
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._out: dict[int, tuple[int, torch.Tensor]] = {}  # data_ptr -> (block size, block), of blocks handed out
        self.held = 0
        self.in_use = 0
        self.peak_held = 0

    @staticmethod
    def block_size(nbytes: int) -> int:
        """The block a request of ``nbytes`` takes: the next power of two."""
        return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of a cached block of the right size, else of a new one."""
        size = self.block_size(nbytes)
        with self._lock:
            blocks = self._free.get(size)
            block = blocks.pop() if blocks else None
            if block is None:
                block = torch.empty(max(size, 1), dtype=torch.uint8)
                self.held += size
                self.peak_held = max(self.peak_held, self.held)
            self._out[block.data_ptr()] = (size, block)
            self.in_use += size
        return block[:nbytes]

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory lies in a block handed out by this cache."""
        with self._lock:
            return t.untyped_storage().data_ptr() in self._out

    def free(self, buf: torch.Tensor) -> None:
        """Take a block back into the cache (its memory stays held)."""
        ptr = buf.untyped_storage().data_ptr()
        with self._lock:
            found = self._out.pop(ptr, None)
            if found is None:
                return
            size, block = found
            self.in_use -= size
            self._free.setdefault(size, []).append(block)

    def empty(self) -> int:
        """Give every cached, unused block back; the bytes given back."""
        with self._lock:
            dropped = sum(len(b) * s for s, b in self._free.items())
            self._free.clear()
            self.held -= dropped
        return dropped


class DevicePool:
    """Blocks for temporaries, each handed to the next temporary as soon as its last reference is dropped.

    Example::

        pool = DevicePool()
        a = pool.temporary(x.t())      # x.t()'s bytes, contiguous, in a pooled block
        del a                          # the block is free now...
        b = pool.temporary(y.t())      # ...and holds y's bytes: a queued copy of a reads them
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self.reused = 0

    def _release(self, block: torch.Tensor) -> None:
        with self._lock:
            self._free.append(block)

    def temporary(self, src: torch.Tensor) -> torch.Tensor:
        """``src``'s bytes, row-major, as a flat uint8 tensor in a pooled block."""
        n = src.numel() * src.element_size()
        with self._lock:
            fit = [i for i, b in enumerate(self._free) if b.numel() >= n]
            block = self._free.pop(fit[-1]) if fit else None
            if block is not None:
                self.reused += 1
        if block is None:
            block = torch.empty(max(n, 1), dtype=torch.uint8)
        out = block[:n]
        if n:
            out.view(src.dtype).view(src.shape).copy_(src)
        weakref.finalize(out, self._release, block)
        return out
