"""Asynchronous saves under in-place changes: the checkpoint holds the state at the call, or the save fails.

Each loop below changes the state the way real training loops do, right after
``async_save`` returns. Every case must either commit exactly the state at the
call, or raise ``TornSnapshotError`` at ``wait()`` with the previous checkpoint
at the path intact.
"""

from __future__ import annotations

import time

import pytest
import torch

import shardpoint as sp
from shardpoint.engine.snapshot_guard import FINGERPRINTED, SAMPLE_ELEMENTS, SAMPLE_RUNS, SnapshotGuard
from tests.unit.models import differing, loads_back, stepped_linear


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(160, 160), torch.nn.BatchNorm1d(160), torch.nn.Linear(160, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _step(model, opt)
    return model, opt


def _step(model, opt):
    x = torch.randn(32, 160)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, (p, st) in enumerate(opt.state.items()):
        for k, v in st.items():
            out[f"o.{i}.{k}"] = v.detach().clone()
    return out


def _loaded(path) -> dict[str, torch.Tensor]:
    model, opt = _setup(seed=123)  # different values everywhere, moments included
    sp.load(path, {"model": model, "optimizer": opt})
    return _snapshot(model, opt)


def _ema(model, opt):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9).add_(torch.ones_like(p), alpha=0.1)


def _clamp_data(model, opt):
    for p in model.parameters():  # WGAN-style clipping through .data: no version counter sees it
        p.data.clamp_(-0.01, 0.01)


def _manual_decay(model, opt):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 - 1e-2 * 0.1)


def _moments(model, opt):
    for st in opt.state.values():
        st["exp_avg"].mul_(0.5)


def _fence_then_change(model, opt, handle):
    handle.fence()
    _ema(model, opt)


def _steps(model, opt):
    for _ in range(3):
        _step(model, opt)


def _bn_forward(model, opt):
    model.train()
    with torch.no_grad():
        model(torch.randn(16, 160))


def _done_then_change(model, opt, handle):
    while handle.phase == "snapshot":
        time.sleep(0.001)
    handle.done()  # the copy is complete: polling is the fence
    _ema(model, opt)


CHANGES = {
    "ema": (_ema, True),
    "clamp_data": (_clamp_data, True),
    "manual_decay": (_manual_decay, True),
    "moments": (_moments, True),
    "fence_then_change": (_fence_then_change, False),
    "steps": (_steps, False),
    "bn_forward": (_bn_forward, False),
    "done_then_change": (_done_then_change, False),
}


def _change(name, model, opt, handle):
    fn, _ = CHANGES[name]
    if fn in (_fence_then_change, _done_then_change):
        fn(model, opt, handle)
    else:
        fn(model, opt)


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("name", sorted(CHANGES))
def test_in_place_change_commits_call_state_or_fails(tmp_path, mode, name):
    model, opt = _setup()
    path = str(tmp_path / "ckpt")
    saver = sp.AsyncSaver(staging_bytes=8 << 20, prewarm=False)
    try:
        before = _snapshot(model, opt)
        saver.save(path, {"model": model, "optimizer": opt}).wait()
        _step(model, opt)
        at_call = _snapshot(model, opt)
        handle = saver.save(path, {"model": model, "optimizer": opt}, mode=mode)
        _change(name, model, opt, handle)
        torn = CHANGES[name][1] and mode == "lazy"
        if torn:
            with pytest.raises(sp.TornSnapshotError) as e:
                handle.wait()
            assert "changed in place" in str(e.value) and "handle.fence()" in str(e.value)
            assert "mode='eager'" in str(e.value)
            assert e.value.tensors and all(isinstance(n, str) for n in e.value.tensors)
            assert differing(_loaded(path), before) == []  # the previous checkpoint, bit for bit
        else:
            handle.wait()
            assert differing(_loaded(path), at_call) == []
    finally:
        saver.close()


def test_change_after_copy_finished_still_fails(tmp_path):
    """Deterministic: a change before the fence fails even when the copy was long complete."""
    model, opt = _setup()
    saver = sp.AsyncSaver(staging_bytes=8 << 20, prewarm=False)
    try:
        handle = saver.save(str(tmp_path / "a"), {"model": model, "optimizer": opt}, mode="lazy")
        deadline = time.monotonic() + 30
        while handle.phase == "snapshot" and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.05)
        assert handle.phase == "write" and not handle.fenced  # copied, written: the commit waits for the fence
        _manual_decay(model, opt)
        with pytest.raises(sp.TornSnapshotError, match=r"'model\.0\.weight'"):
            handle.wait()
        with pytest.raises(sp.CheckpointError):
            sp.read_manifest(str(tmp_path / "a"))
        # The saver is usable again and the next save commits.
        handle = saver.save(str(tmp_path / "b"), {"model": model, "optimizer": opt}, mode="lazy")
        at_call = _snapshot(model, opt)
        _step(model, opt)  # the step pre-hook is the fence
        handle.wait()
        assert differing(_loaded(str(tmp_path / "b")), at_call) == []
    finally:
        saver.close()


def test_torn_save_commits_nothing(tmp_path):
    model, opt = _setup()
    saver = sp.AsyncSaver(staging_bytes=8 << 20, prewarm=False)
    try:
        handle = saver.save(str(tmp_path / "new"), {"model": model, "optimizer": opt}, mode="lazy")
        _moments(model, opt)
        with pytest.raises(sp.TornSnapshotError):
            handle.wait()
        with pytest.raises(sp.CheckpointError):
            sp.load(str(tmp_path / "new"), {"model": model})
    finally:
        saver.close()


def test_tensors_outside_any_optimizer_are_copied_eagerly(tmp_path):
    """A module no optimizer of the state updates (an EMA copy) is snapshotted in the call."""
    model, opt = _setup()
    ema = torch.nn.Linear(160, 160)
    saver = sp.AsyncSaver(staging_bytes=8 << 20, prewarm=False)
    try:
        ref = {k: v.clone() for k, v in ema.state_dict().items()}
        handle = saver.save(str(tmp_path / "c"), {"model": model, "ema": ema, "optimizer": opt}, mode="lazy")
        with torch.no_grad():
            ema.weight.mul_(0.5)
        handle.fence()
        handle.wait()
        fresh = torch.nn.Linear(160, 160)
        sp.load(str(tmp_path / "c"), {"ema": fresh}, strict=False)
        assert torch.equal(fresh.weight, ref["weight"]) and torch.equal(fresh.bias, ref["bias"])
    finally:
        saver.close()


def test_guard_sees_version_and_data_writes():
    big = torch.randn(1 << 16)
    small = torch.randn(8)
    nan = torch.full((1 << 12,), float("nan"))
    guard = SnapshotGuard.record([("big", big), ("small", small), ("nan", nan)])
    assert guard.changed() == [] and guard.check("p") is None
    big.data.mul_(2)  # invisible to the version counter; the fingerprint sees it
    small.add_(1)
    assert guard.changed() == ["big", "small"]
    err = guard.check("ckpt/x")
    assert isinstance(err, sp.TornSnapshotError) and err.tensors == ["big", "small"]
    assert "ckpt/x" in str(err) and "'big', 'small'" in str(err)


def test_guard_names_at_most_five():
    ts = [(f"t{i}", torch.zeros(2)) for i in range(8)]
    guard = SnapshotGuard.record(ts)
    for _, t in ts:
        t.add_(1)
    msg = str(guard.check("p"))
    assert "'t4'" in msg and "'t5'" not in msg and "and 3 more" in msg


def test_guard_samples_only_the_largest():
    ts = [(f"t{i}", torch.randn(100 + i)) for i in range(FINGERPRINTED + 3)]
    guard = SnapshotGuard.record(ts)
    sampled = {g.fqn for g in guard.watched if g.fingerprint is not None}
    assert sampled == {f"t{i}" for i in range(3, FINGERPRINTED + 3)}
    ts[0][1].data.add_(1)  # unsampled, through .data: invisible to both witnesses
    ts[-1][1].data.add_(1)  # sampled: seen
    assert guard.changed() == [f"t{FINGERPRINTED + 2}"]


def test_guard_samples_runs_spread_over_the_tensor():
    n = 100_003  # not a multiple of the runs: the last run starts before the end
    t = torch.arange(n, dtype=torch.float64)
    guard = SnapshotGuard.record([("t", t)])
    (fp,) = (g.fingerprint for g in guard.watched)
    step, run = n // SAMPLE_RUNS, SAMPLE_ELEMENTS // SAMPLE_RUNS
    want = torch.cat([torch.arange(k * step, k * step + run, dtype=torch.float64) for k in range(SAMPLE_RUNS)])
    assert torch.equal(fp.view(torch.float64).reshape(-1), want)  # the bytes of exactly these elements
    t.data[run] += 1  # just after the first run: unsampled
    assert guard.changed() == []
    t.data[(SAMPLE_RUNS - 1) * step + run - 1] += 1  # the last element of the last run
    assert guard.changed() == ["t"]


def test_guard_samples_a_small_tensor_whole():
    t = torch.zeros(SAMPLE_ELEMENTS)
    guard = SnapshotGuard.record([("t", t)])
    t.data[SAMPLE_ELEMENTS - 1] = -0.0  # the same value, other bytes
    assert guard.changed() == ["t"]


_EXIT_SCRIPT = """
import sys, torch, shardpoint as sp
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(4, 64)).sum().backward(); opt.step()
sp.async_save(sys.argv[1], {"model": model, "optim": opt}, mode="lazy")
torch.save(model.state_dict(), sys.argv[2])
# no fence, no wait: the writer waits for a fence that only the exit brings
"""


def test_lazy_save_left_waiting_commits_at_exit(tmp_path):
    import subprocess
    import sys

    ckpt, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, ckpt, ref], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert time.monotonic() - t0 < 60  # the exit woke the writer instead of hanging
    model = torch.nn.Linear(64, 64)
    sp.load(ckpt, {"model": model}, strict=False)
    want = torch.load(ref)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_lazy_save_whose_pool_closed_for_exit_still_commits(tmp_path, monkeypatch):
    # The interpreter began to exit before the lazy worker handed the write on: the pool refuses new work.
    from shardpoint.saving.background import BackgroundSave

    class Closed:
        def submit(self, *args, **kwargs):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    real = BackgroundSave.copy_then_finish
    monkeypatch.setattr(BackgroundSave, "copy_then_finish", lambda self, pool: real(self, Closed()))
    model, opt, want = stepped_linear()
    saver = sp.AsyncSaver()
    saver.save(str(tmp_path / "ckpt"), {"model": model, "optim": opt}, mode="lazy").wait(timeout=30)  # TimeoutError if lost
    saver.close()
    assert loads_back(str(tmp_path / "ckpt"), want)
