"""The save's copy path: small tensors staged together, strided ones in bounded blocks, blocking events.

The simulated device counts the completion events and copies it queued,
and hands out the temporaries strided tensors need from a pool whose sizes
a test can record.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardpoint as sp
from shardpoint.device import SimulatedDevice
from shardpoint.device.accelerator import AcceleratorDevice
from shardpoint.engine.io import write_chunks
from shardpoint.engine.pipeline import StagedWrite, adjacent_runs
from shardpoint.engine.staging import StagingRing
from shardpoint.geometry import Box
from shardpoint.items import SaveTensor
from shardpoint.storage import storage_for


def _items(tensors):
    return [SaveTensor(n, t, tuple(t.shape), Box.full(tuple(t.shape))) for n, t in tensors.items()]


def _staged_write(tmp_path, name, tensors, sim, piece=64 << 10, ring=1 << 20):
    st = storage_for(str(tmp_path / "w"))
    staged = StagedWrite(st, f"data/{name}-r00000.bin", _items(tensors), StagingRing(ring, sim), 0, 4096, piece)
    staged.after = sim.snapshot_point()
    staged.copy(0, len(tensors), last=True)
    staged.write(threaded=False)
    blob = open(tmp_path / "w" / "data" / f"{name}-r00000.bin", "rb").read()
    for (fqn, chunk), t in zip(staged.records, tensors.values()):
        got = torch.frombuffer(bytearray(blob[chunk.offset : chunk.offset + chunk.nbytes]), dtype=t.dtype).view(t.shape)
        assert fqn in tensors and torch.equal(got, t), fqn
    host, _ = write_chunks(st, f"data/{name}-host.bin", _items(tensors), 0, 4096)
    assert [c.checksums for _, c in host] == [c.checksums for _, c in staged.records]
    return staged


def test_small_tensors_share_one_event_per_batch(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"n{i}": torch.randn(256, generator=g) for i in range(300)}  # 1 KiB each, in storages of their own
    tensors["big"] = torch.randn(40000, generator=g)  # 160 KiB: more than a piece, three pieces of its own
    tensors["step"] = torch.tensor(7.0)
    sim = SimulatedDevice(delay=0.0)
    _staged_write(tmp_path, "s", tensors, sim)
    # 300 KiB of small tensors in batches of at most a 64 KiB piece, and the big one's pieces: 9 events, not 304.
    assert sim.events <= 10, sim.events
    assert sim.copies == 301 + 3  # separate storages: one copy each, recorded together
    sim.close()


def test_views_of_one_flat_buffer_are_one_copy(tmp_path):
    flat = torch.arange(64 * 100, dtype=torch.float32)
    tensors = {f"p{i}": flat[i * 100 : (i + 1) * 100].view(10, 10) for i in range(64)}  # as a flat-parameter wrapper
    sim = SimulatedDevice(delay=0.0)
    _staged_write(tmp_path, "f", tensors, sim)
    assert sim.copies == 1 and sim.events == 1
    sim.close()


def test_adjacent_runs_join_only_back_to_back_views_of_one_storage():
    a = torch.zeros(10, dtype=torch.uint8)
    other = torch.zeros(4, dtype=torch.uint8)
    assert adjacent_runs([a[:3], a[3:5], a[6:8], a[8:10], other, a[:0], a[:2]]) == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7)]


def test_a_strided_tensor_is_copied_through_temporaries_of_at_most_a_piece(tmp_path):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(96, 1000, generator=g).t()  # 375 KiB, strided: a transposed view
    odd = torch.randn(50, 7, 300, generator=g)[:, 2:5, ::3]  # strided in two dims
    sim = SimulatedDevice(delay=0.0)
    sizes = []
    temporary = sim.pool.temporary

    def recording(src):
        out = temporary(src)
        sizes.append(out.numel())
        return out

    sim.pool.temporary = recording
    _staged_write(tmp_path, "t", {"wide": wide, "odd": odd}, sim, piece=16 << 10)
    assert sizes and max(sizes) <= 16 << 10, max(sizes)  # before: one temporary of the whole tensor
    assert sum(sizes) == (wide.numel() + odd.numel()) * 4
    sim.close()


class _Many(nn.Module):
    """Many small parameters and one strided (transposed) one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(40))
        self.wide = nn.Parameter(torch.randn(96, 160).t())

    def forward(self, x):
        for layer in self.small:
            x = torch.tanh(layer(x))
        return (x.sum() * self.wide).square().mean()


def _step(m, opt):
    m(torch.randn(4, 8)).backward()
    opt.step()
    opt.zero_grad()


def _flat(m, opt):
    out = {f"m.{k}": v.clone() for k, v in m.state_dict().items()}
    out.update({f"o.{k}.{n}": v.clone() for k, s in opt.state_dict()["state"].items() for n, v in s.items()})
    return out


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_many_small_and_strided_tensors_save_exact(tmp_path, mode):
    sim = SimulatedDevice(delay=0.001)
    m = _Many()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _step(m, opt)
    assert not m.wide.is_contiguous() and not opt.state[m.wide]["exp_avg"].is_contiguous()
    saver = sp.AsyncSaver(staging_bytes=256 << 10, piece_bytes=8 << 10, device=sim)
    for k in range(2):
        want = _flat(m, opt)
        events = sim.events
        h = saver.save(str(tmp_path / f"{mode}{k}"), {"model": m, "optimizer": opt}, mode=mode)
        _step(m, opt)  # lazy: held back until the copies ran; eager: after the call returned
        h.wait()
        assert sim.events - events < 60  # 242 small tensors and two strided ones
        back = _Many()
        opt2 = torch.optim.AdamW(back.parameters(), lr=1e-2)
        _step(back, opt2)
        sp.load(str(tmp_path / f"{mode}{k}"), {"model": back, "optimizer": opt2})
        got = _flat(back, opt2)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    saver.close()


def test_accelerator_events_block_instead_of_spinning(monkeypatch):
    made = []

    class Event:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def record(self, stream=None):
            return None

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    dev = AcceleratorDevice(torch.device("cuda", 0))
    ev = dev.snapshot_point()
    assert made == [{"blocking": True}] and ev.blocking
