"""The lazy fence on an asynchronous device: the training thread never waits for the device there.

The simulated device counts every host wait per thread and can refuse them
on one (``sim.waits``). At the fence the guard compares version counters on
the host and queues the comparison of the sampled fingerprints on the
device; the thread that commits reads that verdict, before the commit, on
every path: the normal one, a fence passed before the copies completed, and
a fence passed at interpreter exit.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest
import torch

import shardpoint as sp
from shardpoint.device import SimulatedDevice, SimulatedHostWaitError
from shardpoint.engine.snapshot_guard import SnapshotGuard
from shardpoint.errors import TornSnapshotError
from shardpoint.saving.handle import AsyncSaveHandle
from shardpoint.saving.phases import SavePhase as P
from shardpoint.saving.steps import SaveResult
from tests.unit.models import differing, flat, reloaded, stack, step, stepped_adamw


def _model():
    return stack(32, 64, 8)


def _saver(sim):
    return sp.AsyncSaver(staging_bytes=1 << 20, piece_bytes=4 << 10, device=sim, prewarm=False)


def test_the_simulated_device_counts_and_refuses_host_waits():
    sim = SimulatedDevice(delay=0.0)
    guard = SnapshotGuard.record([("w", torch.arange(4096.0))], sim)
    assert guard.check("mem://x") is None  # the synchronous check reads the device's comparison: a host wait
    assert sim.waits.count() == 1 and sim.waits.count(threading.main_thread()) == 1
    with sim.waits.refused():
        err = guard.check("mem://x")  # the refused wait: the check cannot be read, so the save would fail
        verdict = guard.judge("mem://x")  # the fence's form: queued, no wait
    assert isinstance(err, TornSnapshotError) and SimulatedHostWaitError.__name__ in str(err)
    assert "made the host wait" in str(err) and isinstance(err.__cause__, SimulatedHostWaitError)
    assert verdict.pending and sim.waits.count() == 2  # the refused wait was counted too
    assert verdict.error() is None and sim.waits.count() == 3
    sim.close()


def test_a_lazy_fence_makes_no_host_wait_on_the_training_thread(tmp_path):
    sim = SimulatedDevice(delay=0.003)
    m = _model()
    opt = stepped_adamw(m)
    saver = _saver(sim)
    try:
        for k in range(3):
            at_call = flat(m, opt)
            h = saver.save(str(tmp_path / f"s{k}"), {"model": m, "optimizer": opt}, mode="lazy")
            before = sim.waits.count()
            with sim.waits.refused():  # the step pre-hook is the fence: a host wait there raises
                step(m, opt)
            assert sim.waits.count() == before and h.fenced
            h.wait()
            assert differing(reloaded(str(tmp_path / f"s{k}"), _model()), at_call) == []  # untouched: bit-exact
    finally:
        saver.close()


def test_a_data_write_before_the_fence_fails_the_save_without_a_host_wait(tmp_path):
    sim = SimulatedDevice(delay=0.003)
    m = _model()
    opt = stepped_adamw(m)
    saver = _saver(sim)
    try:
        saver.save(str(tmp_path / "ck"), {"model": m, "optimizer": opt}).wait()
        kept = flat(m, opt)
        step(m, opt)
        h = saver.save(str(tmp_path / "ck"), {"model": m, "optimizer": opt}, mode="lazy")
        version = m[0].weight._version
        m[0].weight.data.add_(1.0)  # through .data: no version counter sees it, only the sampled fingerprint
        assert m[0].weight._version == version
        with sim.waits.refused():
            step(m, opt)
        with pytest.raises(TornSnapshotError, match="changed in place after async_save") as e:
            h.wait()
        assert e.value.tensors == ["model.0.weight"] and "'model.0.weight'" in str(e.value)
        assert differing(reloaded(str(tmp_path / "ck"), _model()), kept) == []  # the previous checkpoint is intact
        other = saver.save(str(tmp_path / "new"), {"model": m, "optimizer": opt}, mode="lazy")
        m[0].weight.data.mul_(2.0)
        with pytest.raises(TornSnapshotError):
            other.wait()
        with pytest.raises(sp.CheckpointError):
            sp.read_manifest(str(tmp_path / "new"))  # nothing committed
    finally:
        saver.close()


def _handle(sim, t, pool=None) -> tuple[AsyncSaveHandle, list, cf.ThreadPoolExecutor]:
    h = AsyncSaveHandle("mem://x", SaveResult("mem://x", "id"), device=sim)
    pool = pool or cf.ThreadPoolExecutor(1)
    h.use_pool(pool)
    h.guard(SnapshotGuard.record([("w", t)], sim))
    commits: list = []

    def commit(torn):
        commits.append((torn, threading.current_thread().name))
        h.mark_written()
        if torn is not None:
            h.fail(torn)
        h.finish()

    h.commit_after_fence(commit)
    return h, commits, pool


@pytest.mark.parametrize("changed", [False, True])
def test_the_commit_waits_for_the_verdict_queued_at_the_fence(changed):
    sim = SimulatedDevice(delay=0.0)
    t = torch.arange(4096.0)
    h, commits, pool = _handle(sim, t)
    if changed:
        t.data.mul_(3.0)
    with sim.held():  # the device has not compared yet
        h.copies_queued(sim.snapshot_point())
        with sim.waits.refused():
            h.before_step()  # the fence passes before the copies are reported complete
        t.data.add_(5.0)  # the step, after the fence: the sample was taken before it
        h.mark_copied()
        assert h.state is P.FENCED and commits == []
        done = h.finished_event.wait(0.1)
        assert not done and commits == []  # the commit waits on its worker for the device's verdict
    if changed:
        with pytest.raises(TornSnapshotError, match="'w' changed in place"):
            h.wait(timeout=10)
    else:
        assert h.wait(timeout=10).path == "mem://x"
    assert len(commits) == 1 and (commits[0][0] is not None) is changed
    assert commits[0][1] != threading.current_thread().name  # read on the pool's worker
    pool.shutdown()
    sim.close()


def test_a_fence_at_exit_reads_the_verdict_before_its_commit():
    sim = SimulatedDevice(delay=0.002)
    t = torch.arange(4096.0)
    pool = cf.ThreadPoolExecutor(1)
    pool.shutdown()  # takes no new work, as at interpreter exit: the fencing thread commits
    h, commits, _ = _handle(sim, t, pool)
    t.data.add_(1.0)
    h.mark_copied()
    h.fence()  # what the exit hook calls
    assert h.state is P.FAILED and isinstance(commits[0][0], TornSnapshotError)
    assert commits[0][0].tensors == ["w"]
    with pytest.raises(TornSnapshotError):
        h.wait(timeout=5)
    sim.close()


def test_a_check_that_fails_fails_the_save():
    class Broken(SnapshotGuard):
        def judge(self, path):
            raise RuntimeError("device lost")

    sim = SimulatedDevice(delay=0.0)
    h = AsyncSaveHandle("mem://x", SaveResult("mem://x", "id"), device=sim)
    h.guard(Broken(["w"], [torch.zeros(4)], [0], {}, sim))
    commits: list = []
    h.mark_copied()
    h.fence()  # the loop goes on; the save cannot be proven
    h.commit_after_fence(commits.append)
    assert isinstance(commits[0], TornSnapshotError) and "could not be checked" in str(commits[0])
    assert "RuntimeError: device lost" in str(commits[0]) and h.state is P.FENCED
    sim.close()
