"""Graph capture and the library's threads: calls that stay legal while the training thread captures.

A CUDA graph captured in the default *global* mode forbids "potentially
unsafe" calls (an event query or synchronize, a pinned or device
allocation) on **every** thread of the process while it runs: one such call
from a save's worker thread fails and invalidates the training thread's
capture (the failure PyTorch's NCCL watchdog once had). A thread in
*thread-local* capture mode ignores captures on other threads, so every
device call the library makes from its own threads runs inside
:class:`ThreadLocalCapture`, which switches the calling thread's mode for
the call and restores it after, the way ``CUDAStreamCaptureModeGuard`` does
inside PyTorch.

PyTorch exposes no Python call for the mode, so the switch is the CUDA
driver's ``cuThreadExchangeStreamCaptureMode``: through the ``cuda.bindings``
package where installed, else straight from the driver library every CUDA
process has loaded. Where neither is found (not CUDA) the switch does nothing.

Example::

    guard = ThreadLocalCapture.for_cuda()
    with guard:
        event.synchronize()   # legal while another thread captures in global mode
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any, Callable

__all__ = ["ThreadLocalCapture", "GLOBAL", "THREAD_LOCAL", "RELAXED"]

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2  # CUstreamCaptureMode values


def _bindings_exchange() -> Callable[[int], int] | None:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        return None

    def exchange(mode: int) -> int:
        err, previous = driver.cuThreadExchangeStreamCaptureMode(driver.CUstreamCaptureMode(mode))
        if int(err) != 0:
            raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed: {err}")
        return int(previous)

    return exchange


def _driver_exchange() -> Callable[[int], int] | None:
    fn = None
    for find in (lambda: "libcuda.so.1", lambda: ctypes.util.find_library("cuda")):  # the first is loaded already
        name = find()
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).cuThreadExchangeStreamCaptureMode
            break
        except (OSError, AttributeError):
            continue
    if fn is None:
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int

    def exchange(mode: int) -> int:
        box = ctypes.c_int(mode)
        err = fn(ctypes.byref(box))
        if err != 0:
            raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed with CUresult {err}")
        return int(box.value)

    return exchange


class ThreadLocalCapture:
    """A reentrant context that puts the calling thread in thread-local capture mode for its body.

    ``exchange(mode) -> previous`` sets the calling thread's mode (None: no
    switch, the body runs as is). One object serves every thread: the
    previous mode is kept per thread.

    Example::

        guard = ThreadLocalCapture.for_cuda()
        with guard:
            ev.query()
    """

    def __init__(self, exchange: Callable[[int], int] | None):
        self.exchange = exchange
        self._saved = threading.local()

    @classmethod
    def for_cuda(cls) -> "ThreadLocalCapture":
        """The switch through ``cuda.bindings`` or the driver library; a no-op where neither loads."""
        return cls(_bindings_exchange() or _driver_exchange())

    @property
    def available(self) -> bool:
        """Whether the mode is really switched (False: no driver found, the body runs as is)."""
        return self.exchange is not None

    def __enter__(self) -> "ThreadLocalCapture":
        if self.exchange is not None:
            stack = getattr(self._saved, "stack", None)
            if stack is None:
                stack = self._saved.stack = []
            stack.append(self.exchange(THREAD_LOCAL))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.exchange is not None:
            self.exchange(self._saved.stack.pop())
