"""Counting the host-to-device copies a load makes from pageable memory, on the simulated device.

A copy into a target from memory the device did not hand out (or from a
strided view of it) is synchronous on an accelerator: the framework goes
through a pageable staging copy. The simulated device counts such copies
when they go through it (``pageable_copies``); a plain ``dst.copy_(src)``
into a target bypasses it, so :func:`pageable_copies_into` counts every
copy into the targets' memory whatever thread makes it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch

import shardpoint as sp
from shardpoint.device import SimulatedDevice


class Count:
    """How many copies into the watched tensors came from pageable (or strided) host memory."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()


@contextlib.contextmanager
def pageable_copies_into(sim: SimulatedDevice, dests: Sequence[torch.Tensor]) -> Iterator[Count]:
    """Count the copies into ``dests``' memory whose source is not contiguous memory of ``sim``'s host buffers."""
    ptrs = {d.untyped_storage().data_ptr() for d in dests}
    count = Count()
    orig = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if self.untyped_storage().data_ptr() in ptrs and not (sim.pinned.owns(src) and src.is_contiguous()):
            with count.lock:
                count.n += 1
        return orig(self, src, non_blocking)

    torch.Tensor.copy_ = copy_
    try:
        yield count
    finally:
        torch.Tensor.copy_ = orig


def save_small(path: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    """Save ``n`` small tensors of mixed dtypes and shapes (norms, biases, counters), read back in batches."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16, torch.int32]
    out = {}
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        shape = (int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 13, (1,), generator=g)))
        out[f"t{i}"] = (torch.randint(0, 250, shape, generator=g)).to(dt)
    sp.save(path, {"extra": out})
    return out
