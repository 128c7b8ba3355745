"""The asynchronous save handle as a state machine: its transition table, each phase entered once,
waits that wake on the right phase and on failure, and a lazy save's commit held until its fence."""

from __future__ import annotations

import concurrent.futures as cf
import pathlib
import threading
import time

import pytest
import torch

import shardpoint as sp
from shardpoint.engine.snapshot_guard import SnapshotGuard
from shardpoint.errors import DistributedError, TornSnapshotError
from shardpoint.saving.handle import AsyncSaveHandle
from shardpoint.saving.phases import IllegalTransitionError, SavePhase as P, advance
from shardpoint.saving.steps import SaveResult
from tests.unit.models import loads_back, stepped_linear

LEGAL = {
    (P.COPYING, P.QUEUED), (P.COPYING, P.COPIED), (P.QUEUED, P.COPIED), (P.COPIED, P.FENCED),
    (P.COPYING, P.WRITTEN), (P.QUEUED, P.WRITTEN), (P.COPIED, P.WRITTEN), (P.FENCED, P.WRITTEN),
    (P.WRITTEN, P.COMMITTED), (P.WRITTEN, P.FAILED),
}
LATE = {(a, b) for a in (P.WRITTEN, P.COMMITTED, P.FAILED) for b in (P.QUEUED, P.COPIED)}


@pytest.mark.parametrize("to", list(P))
@pytest.mark.parametrize("frm", list(P))
def test_the_transition_table(frm, to):
    seen = {P.COPYING, frm}
    if (frm, to) in LEGAL:
        assert advance(frm, seen, to) is to
    elif (frm, to) in LATE:
        assert advance(frm, seen, to) is frm  # a copy report after the writer moved on changes nothing
    else:
        with pytest.raises(IllegalTransitionError, match=f"{to.name}.*{frm.name}|{frm.name}.*{to.name}") as e:
            advance(frm, seen, to, "mem://x")
        assert "mem://x" in str(e.value) and "bug" in str(e.value)


def test_a_phase_is_entered_once():
    with pytest.raises(IllegalTransitionError, match="phase COPIED reported twice"):
        advance(P.WRITTEN, {P.COPYING, P.COPIED, P.WRITTEN}, P.COPIED)
    assert advance(P.COPIED, {P.COPYING, P.COPIED}, P.FENCED) is P.FENCED
    assert [p.order for p in (P.COPYING, P.QUEUED, P.COPIED, P.FENCED, P.WRITTEN)] == [0, 1, 2, 3, 4]
    assert {p for p in P if p.terminal} == {P.COMMITTED, P.FAILED}


def _handle(device=None) -> AsyncSaveHandle:
    return AsyncSaveHandle("mem://x", SaveResult("mem://x", "id"), device=device)


def test_the_handle_refuses_illegal_and_repeated_reports():
    h = _handle()
    with pytest.raises(IllegalTransitionError, match="cannot enter COMMITTED from COPYING"):
        h.finish()
    h.mark_copied()
    with pytest.raises(IllegalTransitionError, match="COPIED reported twice"):
        h.mark_copied()
    with pytest.raises(IllegalTransitionError, match="cannot enter QUEUED from COPIED"):
        h.copies_queued(None)
    h.mark_written()
    with pytest.raises(IllegalTransitionError, match="WRITTEN reported twice"):
        h.mark_written()
    assert h.state is P.WRITTEN and not h.finished_event.is_set()
    h.finish()
    assert h.state is P.COMMITTED and h.finished_event.is_set() and h.phase == "done"
    with pytest.raises(IllegalTransitionError, match="COMMITTED reported twice"):
        h.finish()


def test_a_late_copy_report_after_a_failed_write_changes_nothing():
    h = _handle()
    h.mark_written()  # the writer failed before the copy ended
    assert h.phase == "commit"
    h.fence(timeout=0)  # the fence does not wait for a copy of a save that failed
    h.copies_queued(None)
    h.mark_copied()
    assert h.state is P.WRITTEN


def _blocked(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.05)
    return t, out


def test_fence_wakes_on_copied_not_on_queued():
    h = _handle()
    t, out = _blocked(h.fence)
    h.copies_queued(None)
    time.sleep(0.05)
    assert t.is_alive() and out == []
    h.mark_copied()
    t.join(5)
    assert out == [None] and h.state is P.COPIED


def test_fence_wakes_when_the_write_fails_first():
    h = _handle()
    t, out = _blocked(h.fence)
    assert t.is_alive()
    h.mark_written()
    t.join(5)
    assert out == [None]


def test_wait_raises_the_background_error_on_every_waiter():
    h = _handle()
    pool = cf.ThreadPoolExecutor(1)
    gate = threading.Event()
    err = sp.ConcurrentSaveError("mem://x: another save is writing it")

    def writer():
        gate.wait(5)
        h.mark_copied()
        h.mark_written()
        h.fail(err)
        h.finish()

    h.add_future(pool.submit(writer))
    t, out = _blocked(h.wait)
    assert t.is_alive() and h.phase == "snapshot"
    gate.set()
    with pytest.raises(sp.ConcurrentSaveError, match="another save is writing it"):
        h.wait(timeout=5)
    t.join(5)
    assert out == [err] and h.reported and h.state is P.FAILED
    pool.shutdown()


def test_wait_reports_a_worker_that_ended_without_a_result():
    h = _handle()
    h.mark_copied()
    f: cf.Future = cf.Future()
    h.add_future(f)
    with pytest.raises(TimeoutError, match="still running after 0.05s"):
        h.wait(timeout=0.05)
    f.set_exception(RuntimeError("the worker died"))
    with pytest.raises(DistributedError, match="ended without a result"):
        h.wait(timeout=5)


def test_wait_waits_for_an_announced_writer():
    h = _handle()
    h.mark_copied()
    h.expect_writer()
    with pytest.raises(TimeoutError, match="still running"):
        h.wait(timeout=0.05)
    f: cf.Future = cf.Future()
    h.writer_started(f)
    h.mark_written()
    h.finish()
    with pytest.raises(TimeoutError, match="still running"):
        h.wait(timeout=0.05)  # its future still runs
    f.set_result(None)
    assert h.wait(timeout=5).path == "mem://x"


def commit_via(h, commits, torn):
    commits.append(torn)
    h.mark_written()
    if torn is not None:
        h.fail(torn)
    h.finish()


def _guarded(t: torch.Tensor, device=None) -> tuple[AsyncSaveHandle, list, cf.ThreadPoolExecutor]:
    h = _handle(device)
    pool = cf.ThreadPoolExecutor(1)
    h.use_pool(pool)
    h.guard(SnapshotGuard.record([("w", t)]))
    commits: list = []
    return h, commits, pool


def test_the_commit_waits_for_the_fence_holding_no_thread():
    t = torch.zeros(64)
    h, commits, pool = _guarded(t)
    h.mark_copied()
    h.commit_after_fence(commits.append)
    assert commits == [] and h.state is P.COPIED and not h.fenced
    h.fence()
    pool.shutdown(wait=True)
    assert commits == [None] and h.state is P.FENCED and h.fenced


def test_a_change_before_the_fence_reaches_wait():
    t = torch.zeros(64)
    h, commits, pool = _guarded(t)
    h.commit_after_fence(lambda torn: commit_via(h, commits, torn))
    t.add_(1)  # before the fence: the save must fail
    h.mark_copied()
    assert h.phase == "write" and commits == []
    with pytest.raises(TornSnapshotError, match="'w'"):
        h.wait(timeout=10)
    assert h.state is P.FAILED and isinstance(commits[0], TornSnapshotError)
    pool.shutdown()


def test_a_commit_after_a_passed_fence_runs_at_once():
    t = torch.zeros(64)
    h, commits, pool = _guarded(t)
    h.mark_copied()
    assert not h.done() and h.state is P.FENCED  # polling after the copy is the fence
    h.commit_after_fence(lambda torn: commit_via(h, commits, torn))
    assert commits == [None] and h.state is P.COMMITTED and h.done()
    assert h.wait(timeout=5).path == "mem://x"
    pool.shutdown()


class _AsyncDevice:
    asynchronous = True

    def __init__(self):
        self.ordered: list = []

    def order_after(self, event):
        self.ordered.append(event)


def test_an_asynchronous_step_takes_the_verdict_when_queued_and_fences_once_copied():
    t = torch.zeros(64)
    dev = _AsyncDevice()
    h, commits, pool = _guarded(t, dev)
    h.commit_after_fence(lambda torn: commit_via(h, commits, torn))
    stepper, out = _blocked(h.before_step)
    assert stepper.is_alive()  # the step waits until every copy is queued
    h.copies_queued("copy-event")
    stepper.join(5)
    assert out == [None] and dev.ordered == ["copy-event"] and h.fenced
    assert h.state is P.QUEUED and commits == []  # the copies still run: no commit yet
    t.add_(1)  # the step ran: the verdict was taken before it
    h.mark_copied()
    assert h.wait(timeout=10).path == "mem://x"
    assert commits == [None]
    pool.shutdown()


def test_a_closed_pool_runs_the_commit_on_the_fencing_thread():
    t = torch.zeros(64)
    h, commits, pool = _guarded(t)
    pool.shutdown()  # takes no new work, as at interpreter exit
    h.mark_copied()
    h.commit_after_fence(lambda torn: commit_via(h, commits, torn))
    h.fence()
    assert commits == [None] and h.state is P.COMMITTED


def test_the_handle_uses_no_private_threading_call():
    src = pathlib.Path(sp.saving.handle.__file__).read_text()
    assert "threading._" not in src and "_register_atexit" not in src
    assert src.count("threading.Event(") == 1 and src.count("threading.Condition(") == 1


def test_a_lazy_save_waiting_for_its_fence_holds_no_worker(tmp_path):
    model, opt, want = stepped_linear()
    saver = sp.AsyncSaver()
    try:
        h = saver.save(str(tmp_path / "ckpt"), {"model": model, "optim": opt}, mode="lazy")
        deadline = time.monotonic() + 30
        while h.state is not P.COPIED and time.monotonic() < deadline:
            time.sleep(0.005)
        assert h.state is P.COPIED and not h.fenced
        both = threading.Barrier(2)  # passes only if both workers are free at once
        pool = saver._workers()
        assert [f.result(timeout=30) for f in [pool.submit(both.wait, 30) for _ in range(2)]] in ([0, 1], [1, 0])
        assert h.state is P.COPIED  # the writer returned: its commit waits with the handle
        opt.step()  # the step pre-hook is the fence: the commit runs on a worker now
        assert h.wait(timeout=30).path == str(tmp_path / "ckpt") and h.state is P.COMMITTED
    finally:
        saver.close()
    assert loads_back(str(tmp_path / "ckpt"), want)
