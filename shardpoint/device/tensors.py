"""Tensors as bytes, and which device object serves a tensor or a state."""

from __future__ import annotations

import threading
from typing import Any, Iterable, Sequence

import torch

from .accelerator import AcceleratorDevice, with_index
from .base import Device, flat_bytes
from .cpu import CpuDevice
from .routed import DeviceSet

__all__ = ["byte_view", "host_copy", "on_host", "device_of", "devices_of", "device_for"]


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


def devices_of(tensors: Iterable[Any]) -> tuple[torch.device, ...]:
    """Every device of ``tensors`` not in host memory, in the order they first appear (empty: all on the host).

    Example::

        devices_of([w0, w1, torch.zeros(1)])  # (device(type='cuda', index=0), device(type='cuda', index=1))
    """
    seen: dict[torch.device, None] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            seen.setdefault(t.device, None)
    return tuple(seen)


# One AcceleratorDevice, and so one copy stream, per accelerator for the whole process: savers,
# synchronous saves and loads share it, as PyTorch shares its own streams; made on first use.
# Process-wide on purpose: a device's streams and pinned pool belong to the process, not to a save.
_accelerators: dict[torch.device, AcceleratorDevice] = {}
_accelerators_lock = threading.Lock()


def device_for(where: "torch.device | str | Device | Sequence[Any] | None") -> Device:
    """The :class:`Device` serving ``where``: a device object as is, the host for None or ``"cpu"``.

    An accelerator gets the process's one :class:`AcceleratorDevice` for it
    (made, with its copy stream, on the first call, on the calling thread).
    A sequence of devices (or device objects) gets a
    :class:`~shardpoint.device.routed.DeviceSet` that copies each tensor
    through its own; one of them, that one; none, the host.

    Example::

        device_for("cpu")                    # CpuDevice
        device_for(torch.device("cuda", 0))  # AcceleratorDevice, the same object on every call
        device_for(["cuda:0", "cuda:1"])     # DeviceSet of both
    """
    if isinstance(where, Device):
        return where
    if isinstance(where, (list, tuple)):
        members = list(dict.fromkeys(device_for(w) for w in where))
        members = [m for m in members if not isinstance(m, CpuDevice)] or [CpuDevice()]
        return members[0] if len(members) == 1 else DeviceSet(members)
    if where is None:
        return CpuDevice()
    dev = torch.device(where)
    if dev.type == "cpu":
        return CpuDevice()
    dev = with_index(dev)
    with _accelerators_lock:
        found = _accelerators.get(dev)
        if found is None:
            found = _accelerators[dev] = AcceleratorDevice(dev)
        return found
