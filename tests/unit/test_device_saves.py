"""Saves and loads through the simulated asynchronous device come out bit-exact.

The simulated device runs every copy later, on its own thread; with it the
tests below would see torn snapshots if the engine counted a copy as done
when it was only queued, let a training step run before the lazy copy, or
reused a bounce buffer before its copy to the device ran.
"""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.device import SimulatedDevice
from shardpoint.engine.load import ReadTuning, execute_reads
from shardpoint.engine.io import write_chunks
from shardpoint.engine.pipeline import StagedWrite
from shardpoint.engine.staging import StagingRing
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget, SaveTensor, torch_dtype
from shardpoint.storage import storage_for
from tests.unit.models import stack, step, stepped_adamw


def _model():
    return stack(32, 64, 8)


def _snapshot(m, opt):
    return {k: v.clone() for k, v in m.state_dict().items()}, {
        (k, n): v.clone() for k, s in opt.state_dict()["state"].items() for n, v in s.items()
    }


def _loaded(path):
    m2 = _model()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    step(m2, opt2)  # state entries exist, with other values
    sp.load(path, {"model": m2, "optimizer": opt2})
    return _snapshot(m2, opt2)


def _same(a, b):
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]), "model differs"
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1]), "optimizer differs"


def test_eager_save_returns_only_when_the_copies_completed(tmp_path):
    sim = SimulatedDevice(delay=0.005)
    m = _model()
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(staging_bytes=1 << 20, piece_bytes=4 << 10, device=sim)
    expect = _snapshot(m, opt)
    h = saver.save(str(tmp_path / "a"), {"model": m, "optimizer": opt})
    with torch.no_grad():  # changed in place at once, outside any step: eager allows it
        for p in m.parameters():
            p.add_(1.0)
    h.wait()
    _same(_loaded(str(tmp_path / "a")), expect)
    assert sim.copies > 10  # every piece went through the simulated copy engine
    saver.close()


@pytest.mark.parametrize("staging", [1 << 20, 12 << 10])  # the second is smaller than the state: the copier waits for the writer
def test_lazy_save_orders_the_step_after_the_copy(tmp_path, staging):
    sim = SimulatedDevice(delay=0.005)
    m = _model()
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(staging_bytes=staging, piece_bytes=4 << 10, device=sim)
    for k in range(2):
        expect = _snapshot(m, opt)
        h = saver.save(str(tmp_path / f"l{k}"), {"model": m, "optimizer": opt}, mode="lazy")
        step(m, opt)  # right away: the step pre-hook must hold the updates back until the copy ran
        h.wait()
        _same(_loaded(str(tmp_path / f"l{k}")), expect)
    saver.close()


def test_pinned_bytes_stay_the_same_from_save_to_save(tmp_path):
    sim = SimulatedDevice(delay=0.0)
    m = _model()
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(piece_bytes=8 << 10, device=sim, prewarm=False)
    held = []
    for k in range(4):
        saver.save(str(tmp_path / f"s{k}"), {"model": m, "optimizer": opt}, mode="eager" if k % 2 else "lazy").wait()
        held.append(sim.pinned_bytes)
    assert held[0] == saver.staging_bytes > 0 and held == [held[0]] * 4
    assert saver._ring.allocations == 1 and sim.host_allocations == 1
    saver.close()
    assert sim.pinned_bytes == 0


def test_the_ring_grows_to_hold_a_large_state_when_left_automatic():
    sim = SimulatedDevice(delay=0.0)
    saver = sp.AsyncSaver(device=sim, prewarm=False)
    saver.staging.host_limit = 64 << 30
    ring = saver.staging.ring_for(int(3.5 * (1 << 30)))  # more than the default budget: the state, in whole pages
    assert ring.capacity == saver.staging_bytes == int(3.5 * (1 << 30)) and ring.allocations == 0  # not touched yet
    small = saver.staging.ring_for(int(3.5 * (1 << 20)))  # never allocated: sized again for the smaller state
    small.warm(0)
    assert small.capacity == int(3.5 * (1 << 20)) and saver.staging.ring_for(1 << 20) is small  # allocated: kept
    fixed = sp.AsyncSaver(staging_bytes=1 << 20, device=sim, prewarm=False)
    assert fixed.staging.ring_for(3 << 30).capacity == 1 << 20  # a given budget is kept
    saver.close()
    fixed.close()


def _items(tensors):
    return [SaveTensor(n, t, tuple(t.shape), Box.full(tuple(t.shape))) for n, t in tensors.items()]


def test_the_writer_waits_for_each_copy_but_a_change_before_the_wait_tears(tmp_path):
    sim = SimulatedDevice(delay=0.01)
    t = torch.arange(4096, dtype=torch.float32)
    expect = t.clone()
    st = storage_for(str(tmp_path / "raw"))
    ring = StagingRing(1 << 16, sim)
    staged = StagedWrite(st, "data/x-r00000.bin", _items({"t": t}), ring, 0, 1 << 12, 1 << 12)
    staged.copy(0, 1, last=True)
    t.add_(1)  # no wait_copied(): the queued copies read the changed tensor
    staged.write()
    data = torch.frombuffer(bytearray(open(tmp_path / "raw" / "data/x-r00000.bin", "rb").read()), dtype=torch.float32)
    assert not torch.equal(data[:4096], expect)  # what the engine's wait prevents
    t.sub_(1)
    staged = StagedWrite(st, "data/y-r00000.bin", _items({"t": t}), StagingRing(1 << 16, sim), 0, 1 << 12, 1 << 12)
    staged.copy(0, 1, last=True)
    staged.wait_copied()
    t.add_(1)
    staged.write()
    data = torch.frombuffer(bytearray(open(tmp_path / "raw" / "data/y-r00000.bin", "rb").read()), dtype=torch.float32)
    assert torch.equal(data[:4096], expect)
    sim.close()


def test_sync_write_through_the_device_is_exact_with_temporaries(tmp_path):
    sim = SimulatedDevice(delay=0.001)
    tensors = {"a": torch.randn(300, 70), "b": torch.randn(64, 33).t(), "c": torch.arange(10, dtype=torch.int64)}
    st = storage_for(str(tmp_path / "w"))
    records, size = write_chunks(st, "data/z-r00000.bin", _items(tensors), 0, 4096, device=sim)
    blob = open(tmp_path / "w" / "data/z-r00000.bin", "rb").read()
    assert len(blob) == size
    for (name, chunk), t in zip(records, tensors.values()):
        got = torch.frombuffer(bytearray(blob[chunk.offset : chunk.offset + chunk.nbytes]), dtype=t.dtype).view(t.shape)
        assert torch.equal(got, t), name
    host_records, _ = write_chunks(st, "data/h-r00000.bin", _items(tensors), 0, 4096)
    assert [c.checksums for _, c in host_records] == [c.checksums for _, c in records]
    sim.close()


def test_load_through_bounce_buffers_is_exact(tmp_path):
    torch.manual_seed(1)
    # Spans above the small-span batching size (256 KiB) are bounced; the small ones are copied directly.
    state = {f"t{i}": torch.randn(1031, 97 + i) for i in range(8)}
    state["t3"] = torch.randn(1031, 131).to(torch.bfloat16)  # an odd number of 2-byte elements: the next slot must still align
    state["t5"] = state["t5"].double()
    state["ints"] = torch.arange(1000, dtype=torch.int32)
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": state})
    manifest = sp.read_manifest(path)
    st = storage_for(path)
    targets = []
    for name, meta in manifest.tensors.items():
        dest = torch.full(tuple(meta.shape), 7, dtype=torch_dtype(meta.dtype))
        targets.append(LoadTarget(name, dest, tuple(meta.shape), Box.full(tuple(meta.shape))))
    sim = SimulatedDevice(delay=0.002)
    # A window of a few spans: bounce slots are reused many times over, only after their copies ran.
    execute_reads(st, manifest, targets, st.url, True, tuning=ReadTuning(window=3 * 1031 * 105 * 4, threads=2, device=sim))
    got = {t.fqn.split(".")[-1]: t.dest for t in targets}
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert sim.copies == 9 and sim.pinned_bytes == 0 and sim.host_allocations == 1  # the bounce ring went back
    sim.close()


def test_parallel_positional_writes_make_the_same_file(tmp_path):
    from shardpoint.engine.pipeline import SinkThread

    st = storage_for(str(tmp_path / "p"))
    g = torch.Generator().manual_seed(3)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (9 << 20, 1, 5 << 20, 4097, 13 << 20)]
    released = []
    w = st.open_writer("data/p.bin")
    assert w.positional
    sink = SinkThread(w, threads=4)
    for i, p in enumerate(pieces):
        sink.write(memoryview(p.numpy()))
        sink.then(lambda i=i: released.append(i))
    sink.close()
    w.close()
    blob = open(tmp_path / "p" / "data" / "p.bin", "rb").read()
    assert blob == b"".join(bytes(p.numpy()) for p in pieces)
    assert released == [0, 1, 2, 3, 4] and sink.pos == len(blob)


def test_a_failed_parallel_write_is_raised_and_unblocks(tmp_path):
    from shardpoint.engine.pipeline import SinkThread

    class Broken:
        positional = True

        def write_at(self, offset, data):
            if offset > 0:
                raise OSError(28, "No space left on device")

    called = []
    sink = SinkThread(Broken(), on_error=lambda: called.append(1), threads=3)
    sink.write(b"x" * (16 << 20))
    with pytest.raises(OSError, match="No space left"):
        sink.close()
    assert called == [1]


def test_sync_save_with_parallel_writes_loads_back_exact(tmp_path, monkeypatch):
    from shardpoint.engine import pipeline

    monkeypatch.setattr(pipeline, "WRITE_THREADS", 4)
    monkeypatch.setattr(pipeline, "SPLIT_BYTES", 4 << 10)  # the layers (32 KiB) split in parts
    m = _model()
    opt = stepped_adamw(m)
    expect = _snapshot(m, opt)
    sp.save(str(tmp_path / "par"), {"model": m, "optimizer": opt})
    _same(_loaded(str(tmp_path / "par")), expect)
    from shardpoint.convert.verify import verify_checkpoint

    n, bad = verify_checkpoint(str(tmp_path / "par"))
    assert bad == [] and n > 0


def test_async_save_with_parallel_writes_loads_back_exact(tmp_path, monkeypatch):
    from shardpoint.engine import pipeline

    monkeypatch.setattr(pipeline, "WRITE_THREADS", 3)
    monkeypatch.setattr(pipeline, "SPLIT_BYTES", 4 << 10)
    m = _model()
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(staging_bytes=64 << 10, piece_bytes=16 << 10)  # smaller than the state: the ring wraps
    for mode in ("eager", "lazy"):
        expect = _snapshot(m, opt)
        saver.save(str(tmp_path / mode), {"model": m, "optimizer": opt}, mode=mode).wait()
        _same(_loaded(str(tmp_path / mode)), expect)
        step(m, opt)
    saver.close()
