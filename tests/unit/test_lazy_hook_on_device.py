"""The lazy step pre-hook on an asynchronous device orders the step after the copies with events only.

The copier is a low-priority worker that may not have run when the step
comes. The hook must not wait for it: it queues the copies still unqueued
itself (queuing costs microseconds), and the step waits on the device for
the last copy's event. Here the copier is held back until after the step
and the device's copy queue is held while the hook queues: the training
thread makes no host wait, the step is ordered after the copies, and the
checkpoint holds the state as of the call, bit for bit, although the step
overwrites every parameter right after the hook.
"""

from __future__ import annotations

import threading

import torch

import shardpoint as sp
from shardpoint.device import SimulatedDevice
from shardpoint.saving.background import BackgroundSave
from tests.unit.models import differing, flat, reloaded, stack, step, stepped_adamw


def _held_for(sim: SimulatedDevice, seconds: float) -> threading.Thread:
    """Hold the device's copy queue from now for ``seconds``, on a thread of its own."""
    holding = threading.Event()

    def hold() -> None:
        with sim.held():
            holding.set()
            threading.Event().wait(seconds)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    holding.wait()
    return t


def test_the_step_hook_queues_the_copies_itself_and_the_host_never_waits(tmp_path, monkeypatch):
    gate = threading.Event()  # the copier runs only once this is set: after the step
    copier = BackgroundSave.copy_lazy

    def late_copier(self):
        gate.wait(30)
        copier(self)

    monkeypatch.setattr(BackgroundSave, "copy_lazy", late_copier)
    sim = SimulatedDevice(delay=0.0)
    m = stack(32, 64, 8)
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(staging_bytes=1 << 20, piece_bytes=4 << 10, device=sim, prewarm=False)
    out: dict = {}
    try:
        at_call = flat(m, opt)
        h = saver.save(str(tmp_path / "ck"), {"model": m, "optimizer": opt}, mode="lazy")
        copies_before = sim.copies
        holder = _held_for(sim, 0.3)

        def train_step() -> None:
            try:
                with sim.waits.refused():  # any host wait for the device on this thread raises
                    step(m, opt)  # the pre-hook, then the step overwrites every parameter and moment
                out["copier_ran"] = gate.is_set()
                out["copied"] = sim.copies - copies_before
            except BaseException as e:  # noqa: BLE001 - asserted below
                out["error"] = e

        stepper = threading.Thread(target=train_step)
        stepper.start()
        stepper.join(10)
        hung = stepper.is_alive()
        gate.set()  # let the copier go (it finds nothing left to queue)
        stepper.join(30)
        holder.join(5)
        assert not hung, "the step pre-hook waited for the copier thread"
        assert "error" not in out, out.get("error")
        assert out["copier_ran"] is False and out["copied"] > 0  # the hook queued them; the step waited for them
        assert sim.waits.count(stepper) == 0 and h.fenced
        assert any(not torch.equal(v, at_call[k]) for k, v in flat(m, opt).items())  # the step changed the state
        h.wait(timeout=30)
        assert differing(reloaded(str(tmp_path / "ck"), stack(32, 64, 8)), at_call) == []  # as of the call, bit-exact
    finally:
        gate.set()
        saver.close()
        sim.close()


def test_on_a_synchronous_device_the_hook_still_waits_for_complete_copies(tmp_path):
    m = stack(32, 64, 8)
    opt = stepped_adamw(m)
    saver = sp.AsyncSaver(staging_bytes=1 << 20, piece_bytes=4 << 10, prewarm=False)  # host tensors: CpuDevice
    try:
        at_call = flat(m, opt)
        h = saver.save(str(tmp_path / "ck"), {"model": m, "optimizer": opt}, mode="lazy")
        step(m, opt)  # the hook is the fence: the copies are complete before the step
        assert h.fenced
        h.wait(timeout=30)
        assert differing(reloaded(str(tmp_path / "ck"), stack(32, 64, 8)), at_call) == []
    finally:
        saver.close()
