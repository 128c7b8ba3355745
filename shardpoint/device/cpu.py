"""The plain path: tensors already in host memory, copies done when the call returns."""

from __future__ import annotations

import torch

from .base import Completed, CopyEvent, Device

__all__ = ["CpuDevice"]


class CpuDevice(Device):
    """Host tensors: every copy is a synchronous ``copy_``, every event already complete.

    Nothing is pinned and nothing needs keeping alive; ``order_after`` has
    nothing to wait for.

    Example::

        dev = CpuDevice()
        buf = dev.host_buffer(t.nbytes)
        dev.copy_to_host(buf, t.reshape(-1).view(torch.uint8))
    """

    type = "cpu"
    asynchronous = False
    pins = False

    def snapshot_point(self) -> CopyEvent:
        return Completed()

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        dst.copy_(src)
        return Completed()

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, after: CopyEvent | None = None) -> CopyEvent:
        dst.copy_(src)
        return Completed()

    def order_after(self, event: CopyEvent) -> None:
        event.synchronize()

    def keep_alive(self, t: torch.Tensor, event: CopyEvent) -> None:
        return None
