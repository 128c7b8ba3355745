"""Tensors on several devices of one process: each is copied through its own device, into one ring.

Two simulated devices stand for two GPUs of one process: a tensor given to
``SimulatedDevice.place`` lives on that device, and a copy of it through the
other device is a plain synchronous one (``foreign_copies``), as an
accelerator makes for another device's tensor.
"""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.device import CpuDevice, DeviceSet, EventSet, SimulatedDevice, device_for
from shardpoint.device import tensors as tensors_module
from shardpoint.engine.staging import SaverStaging
from tests.unit.models import differing, flat, reloaded, stack, step, stepped_adamw


def _split_model():
    """A model and its AdamW, the first layer (with its moments) on one device, the rest on another."""
    gpu0 = SimulatedDevice(delay=0.001)
    gpu1 = SimulatedDevice(delay=0.001, sibling=gpu0)  # page-locked host memory serves every device
    m = stack(32, 64, 8)
    opt = stepped_adamw(m)
    for i, p in enumerate(m.parameters()):
        dev = gpu0 if i < 2 else gpu1
        dev.place(p, *[v for v in opt.state[p].values() if v.dim() > 0])
    return gpu0, gpu1, m, opt


def test_one_device_for_a_state_on_two_copies_the_other_devices_tensors_synchronously(tmp_path):
    gpu0, gpu1, m, opt = _split_model()
    saver = sp.AsyncSaver(staging_bytes=1 << 20, piece_bytes=4 << 10, device=gpu0, prewarm=False)
    saver.save(str(tmp_path / "ck"), {"model": m, "optimizer": opt}).wait()
    assert gpu0.foreign_copies > 0 and gpu1.copies == 0  # what a ring on the first tensor's device alone does
    saver.close()
    gpu1.close()


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_each_tensor_is_copied_through_its_own_device(tmp_path, mode):
    gpu0, gpu1, m, opt = _split_model()
    saver = sp.AsyncSaver(staging_bytes=1 << 20, piece_bytes=4 << 10, device=[gpu0, gpu1], prewarm=False)
    assert isinstance(saver.device, DeviceSet) and saver.device.members == (gpu0, gpu1)
    try:
        for k in range(2):
            at_call = flat(m, opt)
            h = saver.save(str(tmp_path / f"s{k}"), {"model": m, "optimizer": opt}, mode=mode)
            with gpu0.waits.refused(), gpu1.waits.refused():
                step(m, opt)  # lazy: the hook orders the step after both devices' copies, with no host wait
            h.wait(timeout=30)
            assert differing(reloaded(str(tmp_path / f"s{k}"), stack(32, 64, 8)), at_call) == []
        assert gpu0.foreign_copies == gpu1.foreign_copies == 0 and gpu0.pageable_copies == gpu1.pageable_copies == 0
        assert gpu0.copies > 0 and gpu1.copies > 0
        assert gpu0.pinned.registrations == 1  # one ring for both devices, from the first one's host memory
    finally:
        saver.close()
    assert gpu0.pinned.held == 0


def test_an_event_of_a_set_completes_every_copy_queued_before_it_on_any_member():
    gpu0 = SimulatedDevice(delay=0.0)
    gpu1 = SimulatedDevice(delay=0.0, sibling=gpu0)
    a, b = torch.arange(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8).flip(0)
    gpu1.place(b)
    devices = DeviceSet([gpu0, gpu1])
    buf = devices.host_buffer(128).zero_()
    with gpu0.held(), gpu1.held():
        devices.copy_to_host(buf[:64], a, devices.snapshot_point())
        ev = devices.copy_to_host(buf[64:], b)
        assert isinstance(ev, EventSet) and set(ev.parts) == {id(gpu0), id(gpu1)} and not ev.query()
    ev.synchronize()
    assert torch.equal(buf[:64], a) and torch.equal(buf[64:], b) and (gpu0.copies, gpu1.copies) == (1, 1)
    assert devices.member_for(b) is gpu1 and devices.member_for(a) is gpu0 and devices.pinned_bytes == 4096
    devices.free_host_buffer(buf)
    assert devices.pinned_bytes == 0 and gpu0.pinned.held == 0
    devices.close()


class _FakeGpu(SimulatedDevice):
    """What device_for makes for an accelerator, here a simulated one serving exactly its device."""

    def __init__(self, device):
        super().__init__(delay=0.0)
        self.device = torch.device(device)
        self.type = self.device.type

    def serves(self, where):
        return torch.device(where) == self.device


def test_a_saver_learns_every_device_of_the_state(monkeypatch):
    monkeypatch.setattr(tensors_module, "AcceleratorDevice", _FakeGpu)
    monkeypatch.setattr(tensors_module, "_accelerators", {})
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    both = device_for([cuda0, cuda1])
    assert isinstance(both, DeviceSet) and [m.device for m in both.members] == [cuda0, cuda1]
    assert device_for([cuda1]) is both.members[1] and isinstance(device_for([]), CpuDevice)
    staging = SaverStaging(None, 1 << 20)
    learned = staging.serve((cuda0, cuda1))
    assert isinstance(learned, DeviceSet) and [m.device for m in learned.members] == [cuda0, cuda1]
    assert staging.serve((cuda1,)) is learned  # a state on fewer of its devices: kept, with its ring
    assert isinstance(staging.serve(()), CpuDevice)  # moved to the host


def test_a_load_into_two_devices_copies_each_target_through_its_own(tmp_path):
    from shardpoint.engine.load import ReadTuning, execute_reads
    from shardpoint.geometry import Box
    from shardpoint.items import LoadTarget, torch_dtype
    from shardpoint.storage import storage_for

    ck = str(tmp_path / "ck")
    sp.save(ck, {"extra": {f"t{i}": torch.randn(700, 513) for i in range(4)}})
    manifest = sp.read_manifest(ck)
    gpu0 = SimulatedDevice(delay=0.0)
    gpu1 = SimulatedDevice(delay=0.0, sibling=gpu0)
    targets = []
    for i, (name, meta) in enumerate(sorted(manifest.tensors.items())):
        dest = torch.zeros(tuple(meta.shape), dtype=torch_dtype(meta.dtype))
        (gpu0 if i % 2 == 0 else gpu1).place(dest)
        targets.append(LoadTarget(name, dest, tuple(meta.shape), Box.full(tuple(meta.shape))))
    st = storage_for(ck)
    devices = DeviceSet([gpu0, gpu1])
    execute_reads(st, manifest, targets, st.url, True, tuning=ReadTuning(window=4 << 20, threads=2, device=devices))
    expect = sp.load(ck, {"extra": {f"t{i}": torch.zeros(700, 513) for i in range(4)}})
    got = {t.fqn: t.dest for t in targets}
    assert all(torch.equal(got[f"extra.t{i}"], expect["extra"][f"t{i}"]) for i in range(4))
    assert gpu0.copies > 0 and gpu1.copies > 0 and gpu0.foreign_copies == gpu1.foreign_copies == 0
    assert gpu0.pinned.held == 0  # the bounce ring went back
    devices.close()
