"""Strided load regions (a column block, as tensor parallelism's ``Shard(1)`` reads) reach the device from page-locked memory.

A region that is strided in its span would be packed by the framework into
a pageable temporary and copied synchronously; the bounce ring packs it in
page-locked memory instead. The simulated device runs a copy from a
strided or pageable host view in the call and counts it.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import shardpoint as sp
from shardpoint.device import SimulatedDevice
from shardpoint.engine.blocks import row_blocks
from shardpoint.engine.load import ReadTuning, execute_reads
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget
from shardpoint.storage import storage_for


def _load(path, targets, window, verify=True):
    st_ = storage_for(path)
    manifest = sp.read_manifest(path)
    sim = SimulatedDevice(delay=0.0005)
    try:
        execute_reads(st_, manifest, targets, st_.url, verify, tuning=ReadTuning(window=window, threads=2, device=sim))
    finally:
        sim.close()
    return sim


def _column_targets(name, full, parts):
    rows, cols = full.shape
    w = -(-cols // parts)
    out = []
    for c in range(0, cols, w):
        n = min(w, cols - c)
        out.append(LoadTarget(name, torch.full((rows, n), 7, dtype=full.dtype), tuple(full.shape), Box((0, c), (rows, n))))
    return out


def test_a_column_block_is_copied_from_page_locked_memory(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(1024, 384)
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": {"w": w}})
    targets = _column_targets("extra.w", w, 4)  # a rank of Shard(1) over 4 ranks reads 96 of 384 columns per row
    sim = _load(path, targets, window=8 << 20)
    for t in targets:
        c = t.box.offsets[1]
        assert torch.equal(t.dest, w[:, c : c + t.box.sizes[1]])
    assert sim.pageable_copies == 0  # before, each column block went through a pageable temporary
    assert sim.copies >= len(targets) and sim.pinned_bytes == 0


def test_a_packing_area_smaller_than_the_region_is_reused_block_by_block(tmp_path):
    torch.manual_seed(1)
    w = torch.randn(2048, 96).to(torch.bfloat16)
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": {"w": w}})
    span = w.numel() * 2
    targets = [LoadTarget("extra.w", torch.zeros(2048, 40, dtype=torch.bfloat16), (2048, 96), Box((0, 50), (2048, 40)))]
    sim = _load(path, targets, window=span + (20 << 10))  # room for a 20 KiB packing area beside the span
    assert torch.equal(targets[0].dest, w[:, 50:90])
    assert sim.pageable_copies == 0 and sim.copies >= 8  # 160 KiB packed through 20 KiB


def test_strided_destinations_and_sources_load_exact(tmp_path):
    torch.manual_seed(2)
    a = torch.randn(600, 200)  # spans above the small-span batching size (256 KiB): bounced
    b = torch.arange(6 * 150 * 100, dtype=torch.int32).view(6, 150, 100)
    path = str(tmp_path / "ck")
    sp.save(path, {"extra": {"a": a, "b": b}})
    dest_t = torch.zeros(200, 600).t()  # a transposed destination: strided on the device side
    mid = torch.zeros(6, 20, 100, dtype=torch.int32)
    cols = torch.zeros(600, 64)
    targets = [
        LoadTarget("extra.a", dest_t, (600, 200), Box.full((600, 200))),
        LoadTarget("extra.b", mid, (6, 150, 100), Box((0, 15, 0), (6, 20, 100))),
        LoadTarget("extra.a", cols, (600, 200), Box((0, 130), (600, 64))),
    ]
    for verify in (True, False):  # unverified: the strided runs are read with one vectored call
        for t in targets:
            t.dest.fill_(7)
        sim = _load(path, targets, window=4 << 20, verify=verify)
        assert torch.equal(dest_t, a) and torch.equal(mid, b[:, 15:35]) and torch.equal(cols, a[:, 130:194])
        assert sim.pageable_copies == 0 and sim.copies >= 3


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=4), itemsize=st.sampled_from([1, 2, 4, 8]),
       limit=st.integers(1, 400), data=st.data())
def test_row_blocks_cover_a_strided_view_in_order(shape, itemsize, limit, data):
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    base = torch.arange(max(1, 2 * torch.Size(shape).numel()), dtype=torch.int64).to(dtype)
    full = base[: torch.Size(shape).numel()].view(shape) if shape else base[0]
    # A strided view of the same shape: every other element of a larger tensor, or a transpose.
    if shape and data.draw(st.booleans()):
        full = base[: 2 * torch.Size(shape).numel()].view(*shape[:-1], 2 * shape[-1])[..., ::2] if shape[-1] else full
    blocks = row_blocks(full.shape, itemsize, limit)
    parts = [full[idx] for idx in blocks]
    assert all(p.numel() * itemsize <= max(limit, itemsize) for p in parts)
    assert torch.equal(torch.cat([p.reshape(-1) for p in parts]) if parts else torch.empty(0, dtype=dtype), full.reshape(-1))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), data=st.data(), transposed=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]))
def test_any_sub_box_loads_exact_into_any_destination_layout(tmp_path_factory, shape, data, transposed, dtype):
    offsets, sizes = [], []
    for s in shape:
        lo = data.draw(st.integers(0, s - 1))
        offsets.append(lo)
        sizes.append(data.draw(st.integers(1, s - lo)))
    numel = torch.Size(shape).numel()
    w = (torch.arange(numel, dtype=torch.int64) * 2654435761 % 251).to(dtype).view(shape)
    path = str(tmp_path_factory.mktemp("ck") / "ck")
    sp.save(path, {"extra": {"w": w}})
    # A destination laid out in reverse dim order (strided on the device side), or contiguous.
    dest = torch.zeros(sizes[::-1], dtype=dtype).permute(*reversed(range(len(sizes)))) if transposed else torch.zeros(sizes, dtype=dtype)
    t = LoadTarget("extra.w", dest, tuple(shape), Box(tuple(offsets), tuple(sizes)))
    # The ring holds the span and a packing area of 64 bytes up to 64 KiB: small areas are reused block by block.
    window = numel * w.element_size() + 64 + data.draw(st.integers(0, 64 << 10))
    sim = _load(path, [t], window=window, verify=data.draw(st.booleans()))
    assert torch.equal(dest, w[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
    assert sim.pageable_copies == 0
