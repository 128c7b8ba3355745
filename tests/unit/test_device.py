"""The device package: the simulated asynchronous device punishes missing waits, and the engine waits.

The simulated device runs each copy later, on a thread of its own, the way
an accelerator's copy engine does. The first tests show that it does punish
the mistakes (a read before the event, a change before the copy ran, a
temporary dropped too early); the rest show that the engine's real code
paths come out bit-exact through it.
"""

from __future__ import annotations

import gc

import pytest
import torch

from shardpoint.device import (
    POISON, AcceleratorDevice, Completed, CpuDevice, SimulatedDevice, byte_view, device_for, device_of, host_copy, on_host,
)
from shardpoint.engine.staging import StagingRing, optimizer_order


@pytest.fixture
def sim():
    dev = SimulatedDevice(delay=0.01)
    yield dev
    dev.close()


def test_a_read_before_the_event_sees_stale_bytes(sim):
    src = torch.arange(16, dtype=torch.float32)
    raw, _ = byte_view(src)
    buf = sim.host_buffer(raw.numel()).zero_()  # page-locked: the copy is queued
    ev = sim.copy_to_host(buf, raw)
    assert not ev.query()
    assert torch.equal(buf, torch.zeros_like(buf))  # what a reader that skips the wait gets
    ev.synchronize()
    assert torch.equal(buf.view(torch.float32), src)


def test_a_change_before_the_copy_ran_lands_in_the_copy(sim):
    src = torch.arange(16, dtype=torch.float32)
    expect = src.clone()
    raw, _ = byte_view(src)
    buf = sim.host_buffer(raw.numel()).zero_()
    ev = sim.copy_to_host(buf, raw)
    src.mul_(2)  # a training step with no fence
    ev.synchronize()
    assert not torch.equal(buf.view(torch.float32), expect)
    assert torch.equal(buf.view(torch.float32), expect * 2)


def test_a_temporary_dropped_before_its_copy_reads_poison(sim):
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    raw, temporary = byte_view(strided)
    assert temporary
    buf = sim.host_buffer(raw.numel()).zero_()
    ev = sim.copy_to_host(buf, raw)
    del raw
    gc.collect()
    ev.synchronize()
    assert torch.equal(buf, torch.full_like(buf, POISON))


def test_a_temporary_kept_alive_arrives_whole(sim):
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    raw, _ = byte_view(strided)
    buf = sim.host_buffer(raw.numel()).zero_()
    ev = sim.copy_to_host(buf, raw)
    sim.keep_alive(raw, ev)
    del raw
    gc.collect()
    ev.synchronize()
    assert torch.equal(buf.view(torch.float32).view(6, 4), strided.contiguous())
    assert ev.held == []  # let go once the copy completed


def test_copies_complete_in_order_and_order_after_waits(sim):
    bufs = [sim.host_buffer(4).zero_() for _ in range(5)]
    srcs = [torch.full((4,), i, dtype=torch.uint8) for i in range(5)]
    evs = [sim.copy_to_host(b, s) for b, s in zip(bufs, srcs)]
    sim.order_after(evs[-1])
    assert all(e.query() for e in evs)
    assert [int(b[0]) for b in bufs] == [0, 1, 2, 3, 4]
    assert sim.copies == 5


def test_host_buffers_are_counted_while_held():
    sim = SimulatedDevice()
    cpu = CpuDevice()
    a = sim.host_buffer(1000)
    b = cpu.host_buffer(1000)
    assert (sim.pinned_bytes, cpu.pinned_bytes) == (4096, 0)  # held in whole pages of its own mapping
    assert (a.numel(), b.numel(), a.dtype) == (1000, 1000, torch.uint8)
    sim.free_host_buffer(a)
    assert sim.pinned_bytes == 0 and sim.host_allocations == 1


def test_the_cpu_device_is_synchronous():
    cpu = CpuDevice()
    src = torch.arange(8, dtype=torch.uint8)
    dst = torch.zeros(8, dtype=torch.uint8)
    ev = cpu.copy_to_host(dst, src, cpu.snapshot_point())
    assert isinstance(ev, Completed) and ev.query() and torch.equal(dst, src)
    assert not cpu.asynchronous and not cpu.pins


def test_which_device_serves_what():
    assert isinstance(device_for(None), CpuDevice) and isinstance(device_for("cpu"), CpuDevice)
    sim = SimulatedDevice()
    assert device_for(sim) is sim
    assert device_of([3, torch.zeros(1), torch.empty(2, device="meta")]) == torch.device("cpu")
    assert on_host(torch.zeros(1)) and host_copy(torch.ones(2)).device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError, AttributeError)):
            AcceleratorDevice("cuda")


def test_ring_buffer_comes_from_the_device_once(sim):
    ring = StagingRing(1 << 16, sim)
    for _ in range(3):
        ring.reopen()
        s = ring.acquire(1 << 15)
        ring.release(s)
    assert ring.allocations == 1 and sim.pinned_bytes == 1 << 16
    assert ring.try_acquire(1 << 17) is None
    ring.free()
    assert sim.pinned_bytes == 0


def test_try_acquire_never_waits(sim):
    ring = StagingRing(100, sim)
    a = ring.acquire(60)
    assert ring.try_acquire(60) is None
    ring.release(a)
    assert ring.try_acquire(60) is not None


class _Item:
    def __init__(self, t):
        self.data = t


def test_optimizer_order_puts_copies_in_update_order():
    p0, p1 = torch.zeros(2), torch.zeros(3)
    m0, m1 = torch.zeros(2), torch.zeros(3)
    other = torch.zeros(1)
    items = [_Item(m1), _Item(other), _Item(p1), _Item(m0), _Item(p0)]
    got = optimizer_order(items, [p0, m0, p1, m1])
    assert [it.data for it in got] == [p0, m0, p1, m1, other]


def test_accelerator_accounting_counts_what_the_host_memory_takes():
    # Only the size rules: no accelerator is needed to check them.
    class Cached:
        owned = None  # a device whose buffers come from the framework's cache: powers of two

    class Owned:
        owned = object()  # CUDA: the library's own registered mapping, whole pages

    rule = AcceleratorDevice.held_size
    assert [rule(Cached(), n) for n in (0, 1, 4096, 4097, 2_420_000_000)] == [0, 1, 4096, 8192, 1 << 32]
    assert [rule(Owned(), n) for n in (1, 4096, 4097, 2_420_000_000)] == [4096, 4096, 8192, 2_420_002_816]


def test_a_device_without_an_index_is_the_local_ranks_when_several_are_visible(monkeypatch):
    from shardpoint.device.accelerator import with_index

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert with_index(torch.device("cuda"), {"LOCAL_RANK": "2"}) == torch.device("cuda", 2)
    assert with_index(torch.device("cuda"), {"LOCAL_RANK": "6"}) == torch.device("cuda", 2)  # modulo the devices seen
    assert with_index(torch.device("cuda"), {}) == torch.device("cuda", 0)  # no launcher: the current device
    assert with_index(torch.device("cuda", 3), {"LOCAL_RANK": "2"}) == torch.device("cuda", 3)  # named: kept
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one visible device per process
    assert with_index(torch.device("cuda"), {"LOCAL_RANK": "5"}) == torch.device("cuda", 0)
