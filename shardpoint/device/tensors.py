"""Tensors as bytes, and which device object serves a tensor or a state."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .accelerator import AcceleratorDevice
from .base import Device, flat_bytes
from .cpu import CpuDevice

__all__ = ["byte_view", "host_copy", "on_host", "device_of", "device_for"]


def byte_view(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t``'s bytes as a flat uint8 tensor on ``t``'s device, and whether it is a temporary.

    A strided tensor is made contiguous first: that copy is a temporary the
    caller must keep alive until any copy reading it completes
    (:meth:`Device.keep_alive`). An accelerator makes it on its copy queue
    instead (:meth:`Device.byte_view`).

    Example::

        raw, temporary = byte_view(torch.ones(2, 3).t())  # temporary is True
    """
    return flat_bytes(t)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (``t`` itself when it is there already), copied synchronously.

    Example::

        host_copy(torch.zeros(3)).device.type  # 'cpu'
    """
    return t if t.device.type == "cpu" else t.to("cpu")


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in host memory (a read can land in it directly).

    Example::

        on_host(torch.zeros(1))  # True
    """
    return t.device.type == "cpu"


def device_of(tensors: Iterable[Any]) -> torch.device:
    """The device of the first tensor in ``tensors`` that is not in host memory, else the host.

    Example::

        device_of([torch.zeros(1)])  # device(type='cpu')
    """
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device
    return torch.device("cpu")


def device_for(where: "torch.device | str | Device | None") -> Device:
    """The :class:`Device` serving ``where``: a device object as is, the host for None or ``"cpu"``.

    Example::

        device_for("cpu")           # CpuDevice
        device_for(torch.device("cuda", 0))  # AcceleratorDevice, its copy stream made now
    """
    if isinstance(where, Device):
        return where
    if where is None:
        return CpuDevice()
    dev = torch.device(where)
    if dev.type == "cpu":
        return CpuDevice()
    return AcceleratorDevice(dev)
