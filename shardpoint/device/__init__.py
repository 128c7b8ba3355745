"""Internal: everything that knows about accelerators: host buffers, copy streams, events.

The save and load engines stage bytes between device and host through one
:class:`Device` object and never ask what kind it is:

- :class:`CpuDevice`: host tensors; copies are synchronous.
- :class:`AcceleratorDevice`: CUDA, or any device ``torch.accelerator``
  drives; page-locked buffers, one copy stream made once, events.
- :class:`SimulatedDevice`: host tensors copied later on a thread, like a
  copy engine, so that tests on a CPU see what a missing wait would do.
- :class:`DeviceSet`: several of these in one process, each tensor copied
  through its own.

Example::

    from shardpoint.device import device_for, byte_view
    dev = device_for(param.device)
    raw, _ = byte_view(param)
    buf = dev.host_buffer(raw.numel())
    dev.copy_to_host(buf, raw, dev.snapshot_point()).synchronize()
"""

from .accelerator import AcceleratorDevice, StreamEvent
from .base import Completed, CopyEvent, Device
from .cpu import CpuDevice
from .capture import ThreadLocalCapture
from .host_memory import HOST_SHARE, OwnedHostMemory, empty_host_cache, host_budget, host_stats
from .routed import DeviceSet, EventSet
from .sim_models import CaptureModel, HostCache, HostWaits, SimulatedCaptureError, SimulatedHostWaitError
from .simulated import POISON, SimEvent, SimulatedDevice
from .tensors import byte_view, device_for, device_of, devices_of, host_copy, on_host

__all__ = [
    "Device", "CopyEvent", "Completed", "CpuDevice", "AcceleratorDevice", "StreamEvent", "SimulatedDevice",
    "SimEvent", "POISON", "byte_view", "host_copy", "on_host", "device_of", "device_for",
    "ThreadLocalCapture", "CaptureModel", "HostCache", "SimulatedCaptureError", "empty_host_cache", "host_stats",
    "host_budget", "HOST_SHARE", "HostWaits", "SimulatedHostWaitError", "OwnedHostMemory", "DeviceSet", "EventSet",
    "devices_of",
]
