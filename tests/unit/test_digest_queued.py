"""Replica digests of accelerator tensors: queued on the device, read at the commit, equal to the direct ones.

A recorded stand-in device shows what the training thread does in the call:
it queues the work and orders its own later work after it, and never waits;
the digests are read only by ``result()``. The sum over all elements is
added up in pieces, so no temporary is larger than a piece, and it equals
the whole-tensor sum bit for bit.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardpoint.device import CopyEvent, CpuDevice, SimulatedDevice
from shardpoint.saving import digest as digest_mod
from shardpoint.saving.digest import DEVICE, digest_all, digest_queued


class _GateEvent(CopyEvent):
    def __init__(self, gate):
        self.gate = gate

    def synchronize(self):
        self.gate.wait()

    def query(self):
        return self.gate.is_set()


class _Recorded(CpuDevice):
    """An accelerator as the training thread sees it: work is queued, completes when the gate opens."""

    asynchronous = True

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.calls = []

    def queue_to_host(self, compute, after=None):
        self.calls.append("queue")
        return compute(), _GateEvent(self.gate)

    def order_after(self, event):
        self.calls.append("order_after")  # the device queue waits; the host does not


def test_the_call_queues_and_orders_but_never_waits_and_the_commit_reads(monkeypatch):
    rec = _Recorded()
    monkeypatch.setattr(digest_mod, "device_for", lambda where: rec)
    tensors = [torch.randn(300, 7), torch.arange(5000, dtype=torch.int32), torch.randn(64, 33).t().to(torch.bfloat16)]
    t0 = time.monotonic()
    pending = digest_queued(tensors, host=False)  # the gate is closed: any wait here would hang
    assert time.monotonic() - t0 < 5 and rec.calls == ["queue", "order_after"]
    threading.Timer(0.05, rec.gate.set).start()
    got = pending.result()
    assert rec.gate.is_set() and got == digest_all(tensors, host=False) and all(d[0] == DEVICE for d in got)
    assert pending.result() == got  # read once


def test_host_tensors_are_hashed_in_the_call_as_before():
    tensors = [torch.randn(10), torch.randn(100_000)]
    assert digest_queued(tensors).result() == digest_all(tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float64])
def test_the_sum_in_pieces_equals_the_whole_sum(monkeypatch, dtype):
    torch.manual_seed(0)
    a = (torch.randn(301, 67) * 1e4).to(dtype)
    whole = digest_all([a, a.t(), a[::2]], host=False)
    monkeypatch.setattr(digest_mod, "SUM_PIECE", 1000)  # many pieces, a last short one, and row pieces of a view
    assert digest_all([a, a.t(), a[::2]], host=False) == whole
    big = torch.full((5000,), 2**62, dtype=torch.int64)  # wraps around: still exact and the same
    assert digest_all([big], host=False)[0][3] == int((big.sum()).item())


def test_the_simulated_device_computes_queued_work_later():
    sim = SimulatedDevice(delay=0.05)
    src = torch.arange(10, dtype=torch.int64)
    host, ev = sim.queue_to_host(lambda: src.sum().reshape(1))
    assert not ev.query() and host.numel() == 0  # a reader that skips the wait finds nothing yet
    ev.synchronize()
    assert host.tolist() == [45]
    sim.close()
