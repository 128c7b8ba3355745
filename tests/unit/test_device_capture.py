"""Graph capture on the training thread while a save is in flight, through the simulated device.

The stand-in models CUDA's capture rules: during a capture in global mode,
a wait, query or allocation from any other thread fails and invalidates the
capture, unless that thread is in thread-local mode. The first tests show
the stand-in enforces the rules; the rest show that an eager or lazy save
in flight lets a capture on the training thread succeed, and still commits
bit-exact, while the same save with its device calls unguarded breaks it.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

import shardpoint as sp
from shardpoint.device import CaptureModel, SimulatedCaptureError, SimulatedDevice, ThreadLocalCapture
from tests.unit.models import flat, reloaded, stack, step, stepped_adamw


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_an_unsafe_call_from_another_thread_breaks_a_global_capture():
    model = CaptureModel()
    with pytest.raises(SimulatedCaptureError, match="invalidated by an event query on thread"):
        with model.capture("global"):
            out = _in_thread(lambda: model.unsafe("an event query"))
            assert isinstance(out["error"], SimulatedCaptureError)
            assert "not permitted when stream is capturing" in str(out["error"])
    assert model.violations == 1 and not model.active()


def test_a_thread_in_thread_local_mode_does_not_break_a_capture_elsewhere():
    model = CaptureModel()

    def guarded():
        with model.thread_local():
            model.unsafe("an event synchronize")
            return model.mode()

    with model.capture("global"):
        assert _in_thread(guarded) == {"value": "thread_local"}
    assert model.violations == 0 and model.mode() == "global"


def test_a_thread_local_capture_ignores_other_threads_but_not_its_own():
    model = CaptureModel()
    with pytest.raises(SimulatedCaptureError, match="invalidated by an event synchronize"):
        with model.capture("thread_local"):
            assert _in_thread(lambda: model.unsafe("an allocation")) == {"value": None}
            with pytest.raises(SimulatedCaptureError, match="not permitted"):
                with model.thread_local():  # the capturing thread itself may never wait
                    model.unsafe("an event synchronize")
    assert model.violations == 1


def test_a_relaxed_capture_allows_everything():
    model = CaptureModel()
    with model.capture("relaxed"):
        model.unsafe("an allocation")
        assert _in_thread(lambda: model.unsafe("an event query")) == {"value": None}
    assert model.violations == 0


def test_the_sim_events_and_allocations_are_guarded_and_fail_unguarded():
    sim = SimulatedDevice(delay=0.0)
    src = torch.arange(64, dtype=torch.uint8)
    with sim.capture():
        buf = _in_thread(lambda: sim.host_buffer(64))["value"]  # the device's guard makes it legal
        ev = sim.copy_to_host(buf, src)
        assert _in_thread(lambda: ev.synchronize()) == {"value": None}
    assert sim.captures.violations == 0 and torch.equal(buf, src)
    sim.capture_guard = contextlib.nullcontext  # what a device without the guard would do
    with pytest.raises(SimulatedCaptureError):
        with sim.capture():
            assert isinstance(_in_thread(lambda: ev.query())["error"], SimulatedCaptureError)
    sim.close()


def test_the_cuda_switch_restores_each_threads_previous_mode():
    modes = {}  # thread -> mode, as the driver keeps it

    def exchange(mode):
        me = threading.get_ident()
        prev = modes.get(me, 0)
        modes[me] = mode
        return prev

    guard = ThreadLocalCapture(exchange)
    with guard:
        assert modes[threading.get_ident()] == 1
        with guard:
            assert modes[threading.get_ident()] == 1
        assert modes[threading.get_ident()] == 1
    assert modes[threading.get_ident()] == 0 and guard.available
    assert not ThreadLocalCapture(None).available


def _model():
    return stack(256, 512, 16)


def _capture_while_in_flight(sim, handle):
    """Capture on this thread until the save has committed; what the capture raised, or None."""
    try:
        with sim.capture("global"):
            deadline = time.monotonic() + 20
            while not handle.finished_event.is_set() and time.monotonic() < deadline:
                time.sleep(0.002)  # the "captured kernels": nothing that waits on the device
    except SimulatedCaptureError as e:
        return e
    return None


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("guarded", [True, False])
def test_a_capture_during_an_in_flight_save_succeeds_and_the_save_is_exact(tmp_path, mode, guarded):
    sim = SimulatedDevice(delay=0.003)
    if not guarded:
        sim.capture_guard = contextlib.nullcontext  # the engine's calls as they would be without the device's guard
    m = _model()
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(staging_bytes=4 << 20, piece_bytes=16 << 10, device=sim)  # all of it: the writer starts after the call
    expect = flat(m, opt)
    h = saver.save(str(tmp_path / "c"), {"model": m, "optimizer": opt}, mode=mode)
    broken = _capture_while_in_flight(sim, h)
    if not guarded:
        assert isinstance(broken, SimulatedCaptureError)  # the stand-in catches an unguarded worker call
        with pytest.raises(Exception):
            h.wait()
        saver.close()
        return
    assert broken is None and sim.captures.violations == 0
    h.wait()
    got = reloaded(str(tmp_path / "c"), _model())
    assert got.keys() == expect.keys()
    for k in expect:
        assert torch.equal(got[k], expect[k]), k
    saver.close()


def _replay_step(m, opt):
    """What replaying a captured optimizer step does: new values in place, with no hook and no version bump."""
    for p in m.parameters():
        p.detach().numpy()[...] += 0.5  # numpy writes bypass the version counter, as a graph's kernels do
        for v in opt.state[p].values():
            if v.dim() > 0:
                v.numpy()[...] *= 3.0


@pytest.mark.parametrize("delay", [0.003, 0.0])
def test_a_capturable_optimizer_makes_a_lazy_save_eager_and_exact(tmp_path, delay, caplog):
    sim = SimulatedDevice(delay=delay)
    m = _model()
    opt = stepped_adamw(m)
    for g in opt.param_groups:
        g["capturable"] = True  # its step is captured in a graph and replayed
    saver = sp.AsyncSaver(staging_bytes=4 << 20, piece_bytes=16 << 10, device=sim)
    expect = flat(m, opt)
    with caplog.at_level("WARNING", logger="shardpoint"):
        h = saver.save(str(tmp_path / "g"), {"model": m, "optimizer": opt}, mode="lazy")
    _replay_step(m, opt)  # right after the call: a replay calls no step pre-hook
    h.wait()
    assert "taken eagerly" in caplog.text and "'optimizer' is capturable" in caplog.text
    for g in opt.param_groups:
        g["capturable"] = False
    got = reloaded(str(tmp_path / "g"), _model())
    for k in expect:
        assert torch.equal(got[k], expect[k]), k
    saver.close()


def test_a_save_called_inside_a_capture_is_refused_with_a_typed_error(tmp_path):
    sim = SimulatedDevice(delay=0.0)
    m = _model()
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(staging_bytes=4 << 20, piece_bytes=16 << 10, device=sim)
    with sim.capture():
        with pytest.raises(sp.GraphCaptureError, match="while the calling thread captures a graph.*outside the captured region"):
            saver.save(str(tmp_path / "x"), {"model": m, "optimizer": opt})
    assert sim.captures.violations == 0  # the refusal itself allocated and waited on nothing
    assert not (tmp_path / "x").exists()  # refused before the path was claimed
    expect = flat(m, opt)
    saver.save(str(tmp_path / "y"), {"model": m, "optimizer": opt}).wait()  # outside the capture: fine
    m2 = _model()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    step(m2, opt2)
    sp.load(str(tmp_path / "y"), {"model": m2, "optimizer": opt2})
    assert all(torch.equal(flat(m2, opt2)[k], expect[k]) for k in expect)
    saver.close()
