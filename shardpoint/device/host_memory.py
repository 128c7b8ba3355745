"""The caching allocator of page-locked host memory across PyTorch versions: give memory back, read its statistics.

PyTorch keeps every page-locked block it ever handed out in a cache until
told to empty it; freeing a buffer only returns it to that cache. The names
of the calls that empty it and read its statistics changed between
releases; the differences live here.

Example::

    empty_host_cache()          # cached page-locked blocks go back to the system
    host_stats()                # {'held': ..., 'in_use': ...} or None where unknown
"""

from __future__ import annotations

import os

import torch

__all__ = ["empty_host_cache", "host_stats", "host_budget", "HOST_SHARE"]


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
