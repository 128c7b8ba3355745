"""Every copy of a load onto the device reads the bounce ring's page-locked memory, and strided destinations stay bounded.

Batches of small spans (norms, biases, counters read with one request) land
in one bounce slot instead of a pageable buffer; a contiguous source copied
into a strided device destination goes in blocks of at most
``DEVICE_BLOCK``, so the device temporary each block needs stays that
small. Counts come from the simulated device (``largest_temporary``) and
from :func:`~tests.unit.device_copies.pageable_copies_into`.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import shardpoint as sp
from shardpoint.device import SimulatedDevice
from shardpoint.engine import bounce as bounce_mod
from shardpoint.engine.bounce import aligned
from shardpoint.engine.load import ReadTuning, execute_reads, read_targets
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget
from shardpoint.planning.reads import batch_reads, plan_chunk_reads
from shardpoint.format.datafile import ALIGN
from shardpoint.storage import storage_for
from tests.unit.device_copies import pageable_copies_into, save_small


def _load(path, targets, window=8 << 20, verify=True):
    st_ = storage_for(path)
    sim = SimulatedDevice(delay=0.0005)
    try:
        with pageable_copies_into(sim, [t.dest for t in targets]) as count:
            execute_reads(st_, sp.read_manifest(path), targets, st_.url, verify, tuning=ReadTuning(window=window, threads=2, device=sim))
    finally:
        sim.close()
    return sim, count.n


def _full(name, t, transposed=False):
    dest = torch.full(t.shape[::-1], 7, dtype=t.dtype).t() if transposed else torch.full(t.shape, 7, dtype=t.dtype)
    return LoadTarget(name, dest, tuple(t.shape), Box.full(tuple(t.shape)))


def test_a_batch_of_small_spans_lands_from_the_bounce_ring(tmp_path):
    path = str(tmp_path / "ck")
    saved = save_small(path, 24, seed=3)
    targets = [_full(f"extra.{k}", v, transposed=i % 3 == 0) for i, (k, v) in enumerate(saved.items())]
    manifest = sp.read_manifest(path)
    groups = batch_reads(plan_chunk_reads(manifest, read_targets(targets), path, True), ALIGN)
    assert max(len(g) for g in groups) > 1  # the case at hand: spans read in batches
    for verify in (True, False):
        for t in targets:
            t.dest.fill_(7)
        sim, pageable = _load(path, targets, verify=verify)
        for t, v in zip(targets, saved.values()):
            assert torch.equal(t.dest, v)
        assert pageable == 0 and sim.pageable_copies == 0  # before: one pageable copy per small tensor (24)
        assert sim.copies >= len(targets)


def test_small_column_blocks_in_a_batch_are_packed_in_the_ring(tmp_path):
    torch.manual_seed(4)
    ws = {f"w{i}": torch.randn(16, 12 + i).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(6)}
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": ws})
    targets = [LoadTarget(f"extra.{k}", torch.zeros(16, 5, dtype=w.dtype), tuple(w.shape), Box((0, 3), (16, 5))) for k, w in ws.items()]
    sim, pageable = _load(path, targets)
    for t, w in zip(targets, ws.values()):
        assert torch.equal(t.dest, w[:, 3:8])
    assert pageable == 0 and sim.pageable_copies == 0  # before: 6


def test_a_strided_device_destination_is_filled_in_bounded_blocks(tmp_path):
    torch.manual_seed(5)
    w = torch.randn(1024, 1536)  # 6 MiB, above DEVICE_BLOCK
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": {"w": w}})
    t = _full("extra.w", w, transposed=True)
    sim, pageable = _load(path, [t], window=16 << 20)
    assert torch.equal(t.dest, w)
    assert pageable == 0
    # Before: one temporary of the whole region (6 MiB).
    assert 0 < sim.largest_temporary <= bounce_mod.DEVICE_BLOCK
    assert sim.copies >= -(-w.numel() * 4 // bounce_mod.DEVICE_BLOCK)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(2, 12), seed=st.integers(0, 1 << 16))
def test_any_batch_of_small_sub_boxes_loads_exact_from_the_ring(tmp_path_factory, data, n, seed):
    path = str(tmp_path_factory.mktemp("ck") / "ck")
    saved = save_small(path, n, seed)
    targets = []
    for k, v in saved.items():
        offs, sizes = [], []
        for s in v.shape:
            lo = data.draw(st.integers(0, s - 1))
            offs.append(lo)
            sizes.append(data.draw(st.integers(1, s - lo)))
        dest = torch.full(sizes[::-1], 7, dtype=v.dtype).t() if data.draw(st.booleans()) else torch.full(sizes, 7, dtype=v.dtype)
        targets.append(LoadTarget(f"extra.{k}", dest, tuple(v.shape), Box(tuple(offs), tuple(sizes))))
    # A ring from barely the largest batch and its packing area up: slots wait for earlier copies.
    least = 2 * sum(aligned(v.numel() * v.element_size()) for v in saved.values()) + 256 * n
    sim, pageable = _load(path, targets, window=data.draw(st.integers(least, least + (64 << 10))), verify=data.draw(st.booleans()))
    for t, v in zip(targets, saved.values()):
        (r0, c0), (nr, nc) = t.box.offsets, t.box.sizes
        assert torch.equal(t.dest, v[r0 : r0 + nr, c0 : c0 + nc])
    assert pageable == 0 and sim.pageable_copies == 0


def test_a_tensor_larger_than_the_ring_streams_through_it(tmp_path):
    torch.manual_seed(6)
    w = torch.randn(6144, 1024)  # 24 MiB through a ring of 16 MiB: cut into spans of about 4 MiB
    v = torch.randn(6 << 20)  # 1-D, 24 MiB
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": {"w": w, "v": v}})
    for verify in (True, False):
        whole, flat = _full("extra.w", w), _full("extra.v", v)
        cols = LoadTarget("extra.w", torch.zeros(6144, 384), (6144, 1024), Box((0, 512), (6144, 384)))
        sim, pageable = _load(path, [whole, cols, flat], window=16 << 20, verify=verify)
        assert torch.equal(whole.dest, w) and torch.equal(cols.dest, w[:, 512:896]) and torch.equal(flat.dest, v)
        assert pageable == 0 and sim.pageable_copies == 0  # before: 2, both spans from pageable memory


def test_a_damaged_block_of_a_streamed_span_is_named(tmp_path):
    from shardpoint.testing import flip_byte

    torch.manual_seed(7)
    w = torch.randn(6144, 1024)  # 24 MiB through a ring of 16 MiB
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": {"w": w}})
    chunk = sp.read_manifest(path).tensors["extra.w"].chunks[0]
    flip_byte(os.path.join(path, chunk.file), chunk.offset + 13 * (1 << 20) + 17)
    t = _full("extra.w", w)
    with pytest.raises(sp.CorruptCheckpointError, match="extra.w"):
        _load(path, [t], window=16 << 20)
