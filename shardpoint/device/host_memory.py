"""The caching allocator of page-locked host memory across PyTorch versions: give memory back, read its statistics.

PyTorch keeps every page-locked block it ever handed out in a cache until
told to empty it; freeing a buffer only returns it to that cache, and
emptying the cache gives back every user's cached blocks (a data loader's
too). The names of the calls that empty it and read its statistics changed
between releases; the differences live here.

The library's own staging memory does not come from that cache:
:class:`OwnedHostMemory` maps it itself and registers it with the device
driver (``cudaHostRegister``), so giving it back unregisters and unmaps
exactly those bytes and touches nobody else's.

Example::

    empty_host_cache()          # cached page-locked blocks go back to the system
    host_stats()                # {'held': ..., 'in_use': ...} or None where unknown
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Callable

import torch

__all__ = ["empty_host_cache", "host_stats", "host_budget", "HOST_SHARE", "OwnedHostMemory", "cuda_register", "cuda_unregister"]


def empty_host_cache() -> bool:
    """Give cached, unused page-locked host blocks back to the system; whether a call to do it was found.

    ``torch.accelerator.empty_host_cache`` where the installed PyTorch has
    it (2.13 does); before it, ``torch._C._host_emptyCache``, which older
    releases' CUDA graph code calls for the same purpose.

    Example::

        empty_host_cache()  # True on PyTorch 2.13
    """
    public = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if public is not None:
        public()
        return True
    private = getattr(torch._C, "_host_emptyCache", None)  # shim: unnecessary once torch.accelerator has the call
    if private is not None:
        private()
        return True
    return False


def host_stats() -> dict[str, int] | None:
    """``{"held": bytes of page-locked blocks the process holds, "in_use": bytes handed out}``, or None where unknown.

    Read from ``torch.cuda.memory.host_memory_stats`` where the installed
    PyTorch has it with these keys (2.13 does: ``allocated_bytes`` counts
    cached blocks too, ``active_bytes`` those handed out). None before the
    CUDA allocator is initialised, or where the statistics are missing.

    Example::

        host_stats()  # {'held': 536870912, 'in_use': 268435456}
    """
    stats_fn = getattr(getattr(torch.cuda, "memory", None), "host_memory_stats", None)
    if stats_fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = stats_fn()
    except (RuntimeError, AttributeError):
        return None
    if "allocated_bytes.current" not in stats:
        return None
    return {"held": int(stats["allocated_bytes.current"]), "in_use": int(stats.get("active_bytes.current", 0))}


HOST_SHARE = 0.5
"""The share of the host's available memory the page-locked staging of all local ranks may take together."""


def host_budget(share: float = HOST_SHARE) -> int:
    """The page-locked bytes one rank may stage through: available host memory / local ranks x ``share``.

    Local ranks are ``LOCAL_WORLD_SIZE`` as torchrun sets it (1 without
    it); available memory is what ``psutil`` reports now (memory the
    kernel can hand out without swapping). Page-locked memory cannot be
    swapped out, so a staging ring larger than this risks the host.

    Example::

        host_budget()  # e.g. 12 GiB on a host with 192 GiB free and 8 local ranks
    """
    import psutil

    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1 << 20, int(psutil.virtual_memory().available * share) // local)


def cuda_register(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for every CUDA device (``cudaHostRegisterPortable``).

    Example::

        cuda_register(t.data_ptr(), t.nbytes)
    """
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")


def cuda_unregister(ptr: int) -> None:
    """Undo :func:`cuda_register` for the memory at ``ptr``.

    Example::

        cuda_unregister(t.data_ptr())
    """
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {err}")


class OwnedHostMemory:
    """Page-locked host memory the library maps, registers and gives back itself, never through a shared cache.

    Each buffer is an anonymous mapping of whole pages (so no other
    allocation shares a page with it), registered with ``register(ptr,
    nbytes)``. :meth:`free` unregisters it at once; the pages go back to the
    system when the last tensor viewing them is dropped. ``held`` counts the
    bytes registered now, ``peak_held`` the most at once, ``registrations``
    the buffers ever registered.

    Example::

        owned = OwnedHostMemory(cuda_register, cuda_unregister)
        buf = owned.allocate(1 << 20)
        ...
        owned.free(buf); del buf
    """

    def __init__(self, register: Callable[[int, int], None], unregister: Callable[[int], None]):
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._out: dict[int, int] = {}  # data_ptr -> registered bytes, of buffers handed out
        self.held = 0
        self.peak_held = 0
        self.registrations = 0

    @staticmethod
    def block_size(nbytes: int) -> int:
        """The bytes a buffer of ``nbytes`` takes: whole pages, at least one."""
        page = mmap.PAGESIZE
        return max(1, -(-int(nbytes) // page)) * page

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A registered host byte buffer of ``nbytes`` (its pages mapped for it alone)."""
        size = self.block_size(nbytes)
        block = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # the tensor keeps the mapping alive
        self._register(block.data_ptr(), size)
        with self._lock:
            self._out[block.data_ptr()] = size
            self.held += size
            self.peak_held = max(self.peak_held, self.held)
            self.registrations += 1
        return block[: int(nbytes)]

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is a buffer handed out here and not yet freed."""
        with self._lock:
            return t.untyped_storage().data_ptr() in self._out

    def free(self, buf: torch.Tensor) -> bool:
        """Unregister ``buf`` (from :meth:`allocate`); whether it was one of these buffers. The caller drops it."""
        ptr = buf.untyped_storage().data_ptr()
        with self._lock:
            size = self._out.pop(ptr, None)
            if size is None:
                return False
            self.held -= size
        self._unregister(ptr)
        return True
