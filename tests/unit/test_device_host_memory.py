"""Page-locked host memory: what the stand-in models, and that the engine gives it back and stays in budget.

The framework's host allocator rounds each block up to a power of two and
keeps a freed block cached until told to empty its cache, for every user of
the process. The stand-in models it (:class:`~shardpoint.device.HostCache`,
``sim.host``) and the library's own registered memory
(:class:`~shardpoint.device.OwnedHostMemory`, ``sim.pinned``), so these
tests see what the process really holds: a saver's ring within 1.25x of the
state, all of it back after ``close()``, after growth, after a synchronous
save and after a load, and other users' cached blocks left alone.
"""

from __future__ import annotations

import torch

import shardpoint as sp
from shardpoint.device import HostCache, OwnedHostMemory, SimulatedDevice
from shardpoint.engine.io import write_chunks
from shardpoint.engine.load import ReadTuning, execute_reads
from shardpoint.engine.staging import PINNED_SLACK, pinned_capacity
from shardpoint.geometry import Box
from shardpoint.items import LoadTarget, SaveTensor, torch_dtype
from shardpoint.storage import storage_for
from tests.unit.models import flat, reloaded, stack, step, stepped_adamw


def test_the_host_cache_rounds_keeps_and_reuses_blocks_until_emptied():
    cache = HostCache()
    a = cache.allocate(3000)
    assert a.numel() == 3000 and (cache.held, cache.in_use) == (4096, 4096)
    ptr = a.data_ptr()
    cache.free(a)
    del a
    assert (cache.held, cache.in_use) == (4096, 0)  # freed, but still held by the process
    b = cache.allocate(4000)  # the same block size: the cached block, with its old bytes
    assert b.data_ptr() == ptr and cache.held == 4096
    cache.free(b)
    assert cache.empty() == 4096 and cache.held == 0 and cache.peak_held == 4096


def test_a_copy_from_pageable_memory_runs_in_the_call():
    sim = SimulatedDevice(delay=0.05)
    src = torch.arange(32, dtype=torch.uint8)
    pageable = torch.zeros(32, dtype=torch.uint8)
    ev = sim.copy_to_host(pageable, src)
    assert ev.query() and torch.equal(pageable, src) and sim.pageable_copies == 1  # "non-blocking" was synchronous
    pinned = sim.host_buffer(32).zero_()
    ev = sim.copy_to_host(pinned, src)
    assert not ev.query()  # queued: the bytes come later
    ev.synchronize()
    assert torch.equal(pinned, src) and sim.pageable_copies == 1
    sim.close()


class _PowerOfTwo(SimulatedDevice):
    """A device whose buffers come from a cache that rounds to powers of two (an accelerator without registration)."""

    held_size = staticmethod(HostCache.block_size)


def test_the_automatic_ring_stays_within_slack_of_the_state_and_the_host_limit():
    mib = 1 << 20
    cached = _PowerOfTwo()
    assert pinned_capacity(int(3.5 * mib), cached, 1 << 40) == 4 * mib  # the whole block: 1.14x
    assert pinned_capacity(3 * mib, cached, 1 << 40) == 2 * mib  # a 4 MiB block would be 1.33x: streams through 2
    assert pinned_capacity(3 * mib, cached, 3 * mib) == 2 * mib and pinned_capacity(100 * mib, cached, 3 * mib) == 2 * mib
    sim = SimulatedDevice()  # registered memory in whole pages: the ring is the state
    assert pinned_capacity(3 * mib, sim, 1 << 40) == 3 * mib and pinned_capacity(100 * mib, sim, 3 * mib) == 3 * mib
    assert pinned_capacity(3 * mib + 1, sim, 1 << 40) == 3 * mib + 4096  # the next page: within the slack
    assert pinned_capacity(1000, sim, 1 << 40) == 1000 and sim.held_size(1000) == 4096  # a page is the least it takes
    for dev in (cached, sim):
        for need in (5000, 777777, 3 * mib + 1):
            assert dev.held_size(pinned_capacity(need, dev, 1 << 40)) <= PINNED_SLACK * need


def _model():
    return stack(200, 300, 30)


def _state_bytes(m, opt):
    return sum(t.nbytes for t in m.state_dict().values()) + sum(
        v.nbytes for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )


def _check_loads(path, expect):
    got = reloaded(path, _model())
    assert got.keys() == expect.keys() and all(torch.equal(got[k], expect[k]) for k in expect)


def test_saving_pins_at_most_slack_times_the_state_and_close_gives_it_all_back(tmp_path):
    sim = SimulatedDevice(delay=0.0)
    m = _model()
    opt = stepped_adamw(m)
    need = _state_bytes(m, opt)
    saver = sp.AsyncSaver(piece_bytes=64 << 10, device=sim)  # automatic budget
    for k, mode in enumerate(["eager", "lazy", "eager"]):
        expect = flat(m, opt)
        saver.save(str(tmp_path / f"s{k}"), {"model": m, "optimizer": opt}, mode=mode).wait()
        _check_loads(str(tmp_path / f"s{k}"), expect)
        step(m, opt)
    assert 0 < sim.pinned.peak_held <= PINNED_SLACK * need
    assert sim.host_allocations == 1  # one ring for the three saves
    saver.close()
    assert sim.host_memory() == {"held": 0, "in_use": 0} and sim.pinned_bytes == 0


def test_a_state_larger_than_the_host_limit_streams_through_it(tmp_path):
    sim = SimulatedDevice(delay=0.0)
    m = _model()
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(piece_bytes=16 << 10, device=sim, prewarm=False)
    saver.staging.host_limit = 200 << 10  # this rank's share of the host: less than the state
    expect = flat(m, opt)
    saver.save(str(tmp_path / "big"), {"model": m, "optimizer": opt}).wait()
    _check_loads(str(tmp_path / "big"), expect)
    assert sim.pinned.peak_held == 200 << 10 and saver.staging_bytes == 200 << 10  # the limit: whole pages
    saver.close()


def test_growing_the_ring_gives_the_old_block_back(tmp_path):
    sim = SimulatedDevice(delay=0.0)
    saver = sp.AsyncSaver(piece_bytes=16 << 10, device=sim, prewarm=False)
    small = {"w": torch.randn(1000)}
    saver.save(str(tmp_path / "a"), {"extra": small}).wait()
    held_small = sim.pinned.held
    big = {"w": torch.randn(100_000)}
    saver.save(str(tmp_path / "b"), {"extra": big}).wait()
    assert sim.pinned.held == saver.staging_bytes > held_small  # only the new ring: the old block went back
    saver.close()
    assert sim.pinned.held == 0


def test_a_synchronous_save_and_a_load_give_their_rings_back(tmp_path):
    sim = SimulatedDevice(delay=0.0)
    tensors = {"a": torch.randn(300, 70), "b": torch.randn(64, 33).t()}
    items = [SaveTensor(n, t, tuple(t.shape), Box.full(tuple(t.shape))) for n, t in tensors.items()]
    path = tmp_path / "w"
    write_chunks(storage_for(str(path)), "data/z-r00000.bin", items, 0, 4096, device=sim)
    assert sim.pinned.peak_held > 0 and sim.host_memory() == {"held": 0, "in_use": 0}
    ck = str(tmp_path / "ck")
    sp.save(ck, {"extra": {f"t{i}": torch.randn(1031, 97) for i in range(4)}})
    manifest = sp.read_manifest(ck)
    st = storage_for(ck)
    targets = [
        LoadTarget(n, torch.zeros(tuple(m.shape), dtype=torch_dtype(m.dtype)), tuple(m.shape), Box.full(tuple(m.shape)))
        for n, m in manifest.tensors.items()
    ]
    held_before = sim.pinned.peak_held
    execute_reads(st, manifest, targets, st.url, True, tuning=ReadTuning(window=1 << 20, threads=2, device=sim))
    assert sim.pinned.peak_held > held_before and sim.pinned.held == 0  # the bounce ring went back to the system
    sim.close()


def test_a_dropped_temporary_hands_its_block_to_the_next_one_and_a_queued_copy_reads_that():
    import gc

    sim = SimulatedDevice()
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    y = -torch.arange(24, dtype=torch.float32).reshape(4, 6)
    raw, temporary = sim.byte_view(x.t())
    assert temporary and torch.equal(raw.view(torch.float32), x.t().contiguous().reshape(-1))
    buf = sim.host_buffer(raw.numel()).zero_()
    with sim.held():  # the copy runs only after the block changed hands, however slow this process is
        ev = sim.copy_to_host(buf, raw)
        del raw  # dropped before its copy ran, and not kept alive
        gc.collect()
        other, _ = sim.byte_view(y.t())  # the caching allocator hands it the freed block
    ev.synchronize()
    assert sim.pool.reused == 1 and torch.equal(buf.view(torch.float32), y.t().contiguous().reshape(-1))
    with sim.held():
        kept, _ = sim.byte_view(x.t())
        ev = sim.copy_to_host(buf, kept)
        sim.keep_alive(kept, ev)  # what the engine does: the block stays the temporary's until the copy ran
        del kept
        gc.collect()
        sim.byte_view(y.t())
    ev.synchronize()
    assert torch.equal(buf.view(torch.float32), x.t().contiguous().reshape(-1))
    del other
    sim.close()


def test_owned_host_memory_maps_whole_pages_registers_them_and_unregisters_exactly_those():
    import mmap

    calls: list = []
    owned = OwnedHostMemory(lambda ptr, n: calls.append(("register", ptr, n)), lambda ptr: calls.append(("unregister", ptr)))
    a = owned.allocate(5000)
    b = owned.allocate(10)
    assert (a.numel(), b.numel()) == (5000, 10) and a.data_ptr() % mmap.PAGESIZE == 0 == b.data_ptr() % mmap.PAGESIZE
    assert calls == [("register", a.data_ptr(), 2 * mmap.PAGESIZE), ("register", b.data_ptr(), mmap.PAGESIZE)]
    assert owned.held == 3 * mmap.PAGESIZE and owned.owns(a) and owned.owns(b[3:])
    a.fill_(7)
    assert owned.free(a) and not owned.owns(a) and calls[-1] == ("unregister", a.data_ptr())
    assert not owned.free(torch.zeros(4, dtype=torch.uint8))  # not one of its buffers: nothing unregistered
    assert owned.held == mmap.PAGESIZE and owned.peak_held == 3 * mmap.PAGESIZE and len(calls) == 3


def test_closing_a_saver_leaves_other_users_cached_pinned_blocks_alone(tmp_path):
    sim = SimulatedDevice(delay=0.0)
    batch = sim.host.allocate(1 << 20)  # a data loader's pinned batch, from the framework's shared cache
    ptr = batch.data_ptr()
    sim.host.free(batch)  # back in the cache, for the next batch
    del batch
    m = _model()
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(piece_bytes=64 << 10, device=sim)
    expect = flat(m, opt)
    saver.save(str(tmp_path / "s"), {"model": m, "optimizer": opt}).wait()
    _check_loads(str(tmp_path / "s"), expect)
    assert sim.pinned.peak_held >= _state_bytes(m, opt) and sim.registered == 1  # the ring: the library's own memory
    saver.close()
    assert sim.pinned.held == 0 and sim.host_memory() == {"held": 0, "in_use": 0}  # the ring went back...
    assert sim.host.held == 1 << 20  # ...and the other user's cached block is still there,
    again = sim.host.allocate(1 << 20)
    assert again.data_ptr() == ptr  # handed to its next batch without a new page-locked allocation
    sim.close()
