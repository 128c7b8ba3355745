"""CheckpointManager in one process: layout, latest, retention, locks, policies, failures, hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import shardpoint as sp
from shardpoint.manager import (
    HINT_NAME,
    LOCK_NAME,
    ConcurrentSaveError,
    CheckpointManager,
    CheckpointTimeoutError,
    EveryNSteps,
    EveryTSeconds,
    OnDemand,
    step_folder,
)
from shardpoint.format.folders import committed_in, steps_in
from shardpoint.manager.folders import committed_steps
from shardpoint.manager.steplock import StepLock
from shardpoint.storage import LocalStorage, MemoryStorage

from .conftest import build_model, train


# ----------------------------------------------------------------- helpers
class FaultyLocal(LocalStorage):
    """Local storage whose data writes can fail (ENOSPC) or stall; children inherit the faults."""

    def __init__(self, root: str, faults: dict | None = None):
        super().__init__(root)
        self.faults = faults if faults is not None else {"enospc": False, "sleep": 0.0}

    def child(self, sub: str) -> "FaultyLocal":
        c = FaultyLocal(os.path.join(self.root, sub), self.faults)
        c.stats = self.stats
        return c

    def readinto(self, name, offset, buf):
        if self.faults.get("read_sleep"):
            time.sleep(self.faults["read_sleep"])
        return super().readinto(name, offset, buf)

    def open_writer(self, name):
        w = super().open_writer(name)
        inner, faults = w.write, self.faults

        def write(data):
            if faults["sleep"]:
                time.sleep(faults["sleep"])
            if faults["enospc"]:
                raise OSError(28, "No space left on device (injected)")
            inner(data)

        w.write = write
        return w


def make(seed: int = 0, steps: int = 0):
    m = build_model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    if steps:
        train(m, opt, steps, seed=seed)
    return m, opt


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, (p, s) in enumerate(opt.state.items()):
        for k, v in s.items():
            out[f"o.{i}.{k}"] = v.detach().clone()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(mgr, model, opt, steps, start: int = 0, refs: dict | None = None):
    """Train and let the manager save; ``refs[step]`` gets the state each save took."""
    state = {"model": model, "optimizer": opt}
    for step in range(start + 1, start + steps + 1):
        train(model, opt, 1, seed=step)
        if refs is not None:
            refs[step] = snapshot(model, opt)
        mgr.maybe_save(step, state)
    return state


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    return str(tmp_path / "run") if request.param == "local" else MemoryStorage()


def listing(root) -> list[str]:
    st = root if isinstance(root, MemoryStorage) else LocalStorage(root)
    return st.list("")


# ------------------------------------------------------------------ layout
@pytest.mark.parametrize("mode", ["eager", "lazy", None])
def test_save_restore_round_trip(root, mode):
    model, opt = make()
    refs: dict = {}
    mgr = CheckpointManager(root, interval=3, keep_last=None, mode=mode)
    assert mgr.restore({"model": model, "optimizer": opt}) is None
    run(mgr, model, opt, 10, refs=refs)
    mgr.close()
    assert mgr.steps() == [3, 6, 9] and mgr.latest_step() == 9
    assert {n.split("/")[0] for n in listing(root)} == {step_folder(s) for s in (3, 6, 9)} | {HINT_NAME}
    assert not [n for n in listing(root) if n.endswith(LOCK_NAME)], "locks are released after commit"

    m2, o2 = make(seed=7)
    mgr2 = CheckpointManager(root, interval=3)
    assert mgr2.restore({"model": m2, "optimizer": o2}) == 9
    assert same(snapshot(m2, o2), refs[9])
    assert mgr2.restore({"model": m2, "optimizer": o2}, step=3) == 3
    assert same(snapshot(m2, o2), refs[3])
    with pytest.raises(sp.CheckpointNotFoundError):
        mgr2.restore({"model": m2, "optimizer": o2}, step=4)
    mgr2.close()


def test_step_folder_names():
    assert step_folder(0) == "step_00000000"
    assert step_folder(123456789) == "step_123456789"
    with pytest.raises(ValueError):
        step_folder(-1)


def test_step_folders_are_read_from_one_listing():
    names = [
        "step_00000200/manifest.json", "step_00000200/data/a.bin", "step_00000300/.lock", "step_00000300/data/b.bin",
        "step_00000100/manifest.json", "step_00000100/.lock", "latest", "step_12/manifest.json", "notes/step_00000400",
    ]
    steps = steps_in(names)
    assert {s: (f.name, f.committed, f.locked) for s, f in steps.items()} == {
        100: ("step_00000100", True, True), 200: ("step_00000200", True, False), 300: ("step_00000300", False, True),
    }
    assert committed_in(names) == [100, 200]
    store = MemoryStorage()
    for n in names:
        store.put_atomic(n, b"x")
    assert committed_steps(store) == [100, 200]


def test_restore_without_checkpoint_leaves_optimizer_untouched(tmp_path):
    model, opt = make()
    before = snapshot(model, opt)
    mgr = CheckpointManager(str(tmp_path / "nothing"), interval=1)
    assert mgr.restore({"model": model, "optimizer": opt}) is None
    assert not opt.state and same(snapshot(model, opt), before)
    assert mgr.latest_step() is None and mgr.steps() == []
    mgr.close()


def test_bad_arguments(tmp_path):
    for kw in ({"keep_last": 0}, {"keep_every": 0}, {"mode": "fast"}, {"timeout": 0}, {"on_hang": "panic"}):
        with pytest.raises(ValueError):
            CheckpointManager(str(tmp_path), **kw, policies=[OnDemand()])
    with pytest.raises(ValueError):
        EveryNSteps(0)
    with pytest.raises(ValueError):
        EveryTSeconds(0)


def test_closed_manager_refuses_work(tmp_path):
    mgr = CheckpointManager(str(tmp_path), interval=1)
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(sp.CheckpointError, match="closed"):
        mgr.save(1, {"x": torch.ones(1)})


def test_same_step_is_saved_once(tmp_path):
    mgr = CheckpointManager(str(tmp_path), interval=1, mode=None)
    state = {"x": torch.ones(3)}
    assert mgr.save(5, state) is not None
    assert mgr.save(5, state) is None  # already saved by this manager
    assert mgr.maybe_save(5, state) is None
    mgr.close()


# ------------------------------------------------------------------ latest
def test_latest_comes_from_manifests_not_the_hint(tmp_path):
    root = str(tmp_path / "run")
    model, opt = make()
    refs: dict = {}
    mgr = CheckpointManager(root, interval=2, keep_last=None, mode=None)
    run(mgr, model, opt, 4, refs=refs)
    mgr.close()
    st = LocalStorage(root)
    # A torn newer save (data, lock, no manifest), a hint pointing at it, and garbage folders.
    st.child(step_folder(6)).put_atomic("data/abc-r00000.bin", b"torn")
    st.child(step_folder(6)).put_atomic(LOCK_NAME, b"{}")
    st.put_atomic(HINT_NAME, step_folder(6).encode())
    st.put_atomic("step_7/manifest.json", b"{}")  # not a step folder name
    st.put_atomic("notes.txt", b"hello")
    assert mgr.steps() == [2, 4] and mgr.latest_step() == 4
    # A committed-looking manifest that does not parse is skipped, and restore falls back.
    st.child(step_folder(8)).put_atomic("manifest.json", b"{not json")
    mgr2 = CheckpointManager(root, interval=2, mode=None)
    assert mgr2.steps() == [2, 4, 8] and mgr2.latest_step() == 4
    m2, o2 = make(seed=3)
    assert mgr2.restore({"model": m2, "optimizer": o2}) == 4
    assert same(snapshot(m2, o2), refs[4])
    mgr2.close()


def test_restore_falls_back_when_newest_is_corrupt(tmp_path):
    root = str(tmp_path / "run")
    model, opt = make()
    refs: dict = {}
    mgr = CheckpointManager(root, interval=2, keep_last=None, mode="eager")
    run(mgr, model, opt, 6, refs=refs)
    mgr.close()
    data = [n for n in LocalStorage(root).list(step_folder(6)) if "/data/" in n]
    path = os.path.join(root, data[0])
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x40
    open(path, "wb").write(bytes(raw))
    m2, o2 = make(seed=3)
    mgr2 = CheckpointManager(root, interval=2)
    assert mgr2.restore({"model": m2, "optimizer": o2}) == 4
    assert same(snapshot(m2, o2), refs[4])
    # When every candidate fails, the error is raised (never a silent fresh start).
    with pytest.raises(sp.CorruptCheckpointError):
        mgr2.restore({"model": m2, "optimizer": o2}, step=6)
    mgr2.close()


# --------------------------------------------------------------- retention
def test_retention_keep_last_and_keep_every(root):
    model, opt = make()
    mgr = CheckpointManager(root, interval=2, keep_last=2, keep_every=8, mode="eager")
    refs: dict = {}
    run(mgr, model, opt, 20, refs=refs)
    mgr.close()
    assert mgr.steps() == [8, 16, 18, 20]
    assert mgr.retention_errors == []
    assert {n.split("/")[0] for n in listing(root)} == {step_folder(s) for s in (8, 16, 18, 20)} | {HINT_NAME}
    m2, o2 = make(seed=1)
    assert CheckpointManager(root, policies=[OnDemand()]).restore({"model": m2, "optimizer": o2}, step=8) == 8
    assert same(snapshot(m2, o2), refs[8])


def test_keep_last_none_keeps_everything(tmp_path):
    model, opt = make()
    mgr = CheckpointManager(str(tmp_path), interval=1, keep_last=None, mode=None)
    run(mgr, model, opt, 5)
    mgr.close()
    assert mgr.steps() == [1, 2, 3, 4, 5]


def test_deletion_is_crash_safe(tmp_path):
    """A deletion interrupted after the manifest went leaves an incomplete folder, cleaned later."""
    root = str(tmp_path / "run")
    calls: list[int] = []

    def hook(phase, step, rank):
        if phase == "retention":
            calls.append(step)
            if len(calls) == 2:  # manifest of the first doomed step is gone, its data is not
                raise RuntimeError("crash in the middle of a deletion")

    model, opt = make()
    mgr = CheckpointManager(root, interval=1, keep_last=2, mode=None, fault_hook=hook)
    run(mgr, model, opt, 3)
    mgr.wait()
    assert mgr.retention_errors and "crash in the middle" in mgr.retention_errors[0]
    half = LocalStorage(root).child(step_folder(1))
    assert half.list("") and not half.exists("manifest.json")
    assert mgr.steps() == [2, 3] and mgr.latest_step() == 3
    run(mgr, model, opt, 1, start=3)
    mgr.close()
    assert not os.path.exists(os.path.join(root, step_folder(1))), "the torn folder is cleaned up"
    assert mgr.steps() == [3, 4]


def test_crashed_save_garbage_is_removed_but_live_saves_are_not(tmp_path):
    root = str(tmp_path / "run")
    st = LocalStorage(root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # Left by a crashed save of a process that is gone: garbage once a newer step commits.
    st.child(step_folder(1)).put_atomic("data/x-r00000.bin", b"partial")
    st.child(step_folder(1)).put_atomic(LOCK_NAME, json.dumps({"owner": "old", "host": os.uname().nodename, "pid": dead.pid, "created": time.time()}).encode())
    # Held by a live process (this one, another manager): not ours to remove.
    st.child(step_folder(2)).put_atomic(LOCK_NAME, json.dumps({"owner": "other", "host": os.uname().nodename, "pid": os.getpid(), "created": time.time()}).encode())
    mgr = CheckpointManager(root, interval=5, keep_last=1, mode=None)
    run(mgr, *make(), 5)
    mgr.close()
    assert not os.path.exists(os.path.join(root, step_folder(1)))
    assert st.child(step_folder(2)).exists(LOCK_NAME)


def test_retention_never_deletes_a_checkpoint_being_restored(tmp_path):
    root = str(tmp_path / "run")
    model, opt = make()
    mgr = CheckpointManager(root, interval=1, keep_last=None, mode=None)
    run(mgr, model, opt, 3)
    mgr.close()
    mgr2 = CheckpointManager(root, interval=1, keep_last=1, mode=None)
    mgr2._in_use.protect(lambda: [1])  # as restore() does while it loads
    run(mgr2, model, opt, 1, start=3)
    mgr2.wait()
    assert mgr2.steps() == [1, 4]
    mgr2._in_use.release([1])
    run(mgr2, model, opt, 1, start=4)
    mgr2.close()
    assert mgr2.steps() == [5]


# --------------------------------------------------------------- policies
def test_every_t_seconds_uses_the_clock():
    now = [100.0]
    mgr = CheckpointManager(MemoryStorage(), policies=[EveryTSeconds(10)], mode=None, clock=lambda: now[0])
    state = {"x": torch.zeros(2)}
    saved = []
    for step in range(1, 30):
        now[0] += 1.5
        if mgr.maybe_save(step, state) is not None:
            saved.append(step)
    mgr.close()
    assert saved == [8, 15, 22, 29]  # 10 s of the clock after the first call, then after each save


def test_policy_on_rank_other_than_zero_never_fires_time_saves():
    p = EveryTSeconds(1)
    assert p.wants(1, 0.0, 1) is False and p.wants(2, 100.0, 1) is False
    assert p.wants(3, 100.0, 0) is True


def test_on_demand_request_and_sigterm(tmp_path):
    demand = OnDemand(signals=[signal.SIGTERM])
    previous = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(str(tmp_path), interval=100, policies=[demand], mode=None)
    state = {"x": torch.zeros(2)}
    try:
        assert mgr.maybe_save(1, state) is None
        mgr.request_save()
        assert mgr.maybe_save(2, state) is not None and not mgr.stop_requested
        assert mgr.maybe_save(3, state) is None
        os.kill(os.getpid(), signal.SIGTERM)  # preemption notice: save, then stop
        time.sleep(0.01)
        assert mgr.maybe_save(4, state) is not None and mgr.stop_requested
        assert mgr.steps() == [2, 4]
    finally:
        mgr.close()
    assert signal.getsignal(signal.SIGTERM) == previous
    with pytest.raises(ValueError, match="OnDemand"):
        CheckpointManager(str(tmp_path), interval=5).request_save()


# ---------------------------------------------------------------- failures
@pytest.mark.parametrize("mode", ["eager", None])
def test_disk_full_fails_cleanly_and_keeps_older(tmp_path, mode):
    root = FaultyLocal(str(tmp_path / "run"))
    model, opt = make()
    refs: dict = {}
    mgr = CheckpointManager(root, interval=2, keep_last=2, mode=mode)
    run(mgr, model, opt, 4, refs=refs)
    mgr.wait()
    root.faults["enospc"] = True
    state = {"model": model, "optimizer": opt}
    train(model, opt, 1, seed=99)
    with pytest.raises((sp.CheckpointError, OSError), match="No space left"):
        mgr.save(5, state)
        mgr.wait()
    assert mgr.steps() == [2, 4]
    assert not os.path.exists(os.path.join(root.root, step_folder(5))) or not root.child(step_folder(5)).list("")
    root.faults["enospc"] = False  # space freed: the next save works, retention resumes
    mgr.save(6, state)
    mgr.close()
    assert mgr.steps() == [4, 6]
    m2, o2 = make(seed=3)
    assert CheckpointManager(root, policies=[OnDemand()]).restore({"model": m2, "optimizer": o2}, step=4) == 4
    assert same(snapshot(m2, o2), refs[4])


def test_racing_saves_to_one_step_are_rejected(tmp_path):
    root = str(tmp_path / "run")
    settled = threading.Event()  # one of the racing saves has finished (committed or refused)

    def hold_lock(phase, step, rank):
        # Whichever save takes the lock of step 7 holds it until the other has tried: a real overlap,
        # even on a machine so loaded that one thread could finish before the other starts.
        if phase == "write" and step == 7:
            settled.wait(30)

    a = CheckpointManager(root, interval=1, mode=None, fault_hook=hold_lock)
    b = CheckpointManager(root, interval=1, mode=None, fault_hook=hold_lock)
    # Another save holds the lock of step 5 (it is running); b's save of step 5 is refused.
    other = StepLock(owner="other", stale_lock_s=3600)
    token = other.acquire(a.path(5), 5)
    with pytest.raises(ConcurrentSaveError, match="raced"):
        b.save(5, {"x": torch.ones(2)})
    assert a.path(5).list("") == [LOCK_NAME], "the loser wrote nothing"
    other.release(a.path(5), token)
    # Two threads racing for real: exactly one commits, the other is rejected.
    results: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def go(name, mgr, value):
        barrier.wait()
        try:
            mgr.save(7, {"x": torch.full((1000,), value)})
            results[name] = "ok"
        except ConcurrentSaveError:
            results[name] = "conflict"
        finally:
            settled.set()

    ts = [threading.Thread(target=go, args=("a", a, 1.0)), threading.Thread(target=go, args=("b", b, 2.0))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(results.values()) == ["conflict", "ok"], results
    got = sp.read_tensor(a.path(7), "x")
    assert torch.equal(got, torch.full((1000,), 1.0 if results["a"] == "ok" else 2.0))
    a.close()
    b.close()


def test_racing_saves_in_memory_storage():
    mem = MemoryStorage()
    a, b = CheckpointManager(mem, mode=None, policies=[OnDemand()]), CheckpointManager(mem, mode=None, policies=[OnDemand()])
    StepLock(owner="other", stale_lock_s=3600).acquire(a.path(3), 3)
    with pytest.raises(ConcurrentSaveError):
        b.save(3, {"x": torch.ones(1)})


def test_stale_lock_of_a_dead_process_is_broken(tmp_path):
    root = str(tmp_path / "run")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    body = {"owner": "crashed", "host": os.uname().nodename, "pid": dead.pid, "created": time.time()}
    LocalStorage(root).child(step_folder(4)).put_atomic(LOCK_NAME, json.dumps(body).encode())
    LocalStorage(root).child(step_folder(4)).put_atomic("data/old-r00000.bin", b"partial")
    mgr = CheckpointManager(root, mode=None, policies=[OnDemand()])
    mgr.save(4, {"x": torch.ones(2)})
    mgr.close()
    assert mgr.steps() == [4] and LocalStorage(root).child(step_folder(4)).list("data/") != ["data/old-r00000.bin"]
    # Another host's lock is trusted until it is older than stale_lock_s.
    other = {"owner": "x", "host": "elsewhere", "pid": 1, "created": time.time() - 10}
    LocalStorage(root).child(step_folder(8)).put_atomic(LOCK_NAME, json.dumps(other).encode())
    with pytest.raises(ConcurrentSaveError):
        CheckpointManager(root, mode=None, stale_lock_s=60, policies=[OnDemand()]).save(8, {"x": torch.ones(2)})
    CheckpointManager(root, mode=None, stale_lock_s=5, policies=[OnDemand()]).save(8, {"x": torch.ones(2)})


# ------------------------------------------------------------------- hangs
def test_watchdog_reports_a_stalled_synchronous_save(tmp_path):
    root = FaultyLocal(str(tmp_path / "run"))
    root.faults["sleep"] = 0.4
    reports = []
    mgr = CheckpointManager(root, mode=None, timeout=0.2, hang_grace=0.1, on_hang=reports.append, policies=[OnDemand()])
    mgr.save(3, {"x": torch.ones(4), "y": torch.ones(4)})
    mgr.close()
    assert reports, "the watchdog fired"
    r = reports[0]
    assert (r.rank, r.phase, r.step) == (0, "save", 3) and r.seconds >= 0.3
    assert "rank 0" in r.message() and "'save'" in r.message() and "step_00000003" in r.message()
    assert "shardpoint" in r.stacks or "write" in r.stacks


def test_watchdog_reports_a_stalled_restore(tmp_path):
    root = FaultyLocal(str(tmp_path / "run"))
    CheckpointManager(root, mode=None, policies=[OnDemand()]).save(2, {"x": torch.ones(4)})
    root.faults["read_sleep"] = 0.5
    reports = []
    mgr = CheckpointManager(root, timeout=0.2, hang_grace=0.1, on_hang=reports.append, policies=[OnDemand()])
    state = {"x": torch.zeros(4)}
    assert mgr.restore(state) == 2 and torch.equal(state["x"], torch.ones(4))
    assert [(r.rank, r.phase, r.step) for r in reports][:1] == [(0, "restore:load", 2)]


def test_stalled_background_save_raises_timeout_with_phase(tmp_path):
    root = FaultyLocal(str(tmp_path / "run"))
    mgr = CheckpointManager(root, mode="eager", timeout=0.3, on_hang="log", policies=[OnDemand()])
    mgr.save(1, {"x": torch.ones(4)})
    mgr.wait()
    root.faults["sleep"] = 1.0
    mgr.save(2, {"x": torch.ones(4)})
    with pytest.raises(CheckpointTimeoutError) as ei:
        mgr.wait()
    e = ei.value
    assert (e.rank, e.step, e.phase) == (0, 2, "write"), (e.rank, e.step, e.phase)
    assert "rank 0" in str(e) and "step_00000002" in str(e) and "'write'" in str(e)
    root.faults["sleep"] = 0.0
    deadline = time.monotonic() + 10
    while True:  # keep waiting: the stall ends and the save commits
        try:
            mgr.wait()
            break
        except CheckpointTimeoutError:
            assert time.monotonic() < deadline
    mgr.close()
    assert mgr.steps() == [1, 2]


def test_fault_env_hook(monkeypatch):
    from shardpoint.manager import FAULT_ENV, fault_from_env

    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert fault_from_env() is None
    monkeypatch.setenv(FAULT_ENV, json.dumps([{"phase": "lock", "rank": 0, "step": 2, "action": "stall", "seconds": 0.2, "nth": 2}]))
    hook = fault_from_env()
    t = time.monotonic()
    hook("lock", 2, 1)
    hook("lock", 3, 0)
    hook("lock", 2, 0)
    assert time.monotonic() - t < 0.1  # first match: not yet
    hook("lock", 2, 0)
    assert time.monotonic() - t >= 0.2


def test_background_failure_surfaces_at_the_next_save_not_in_between(tmp_path):
    """Ranks notice a finished save at different steps, so its error waits for the next save."""
    root = FaultyLocal(str(tmp_path / "run"))
    model, opt = make()
    state = {"model": model, "optimizer": opt}
    mgr = CheckpointManager(root, interval=3, mode="eager")
    root.faults["enospc"] = True
    mgr.maybe_save(3, state)
    deadline = time.monotonic() + 10
    while not mgr._pending.handle.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert mgr.maybe_save(4, state) is None  # noticed, kept, not raised here
    assert mgr._pending is None and mgr._failed is not None
    root.faults["enospc"] = False
    with pytest.raises(sp.CheckpointError, match="No space left"):
        mgr.maybe_save(6, state)
    assert mgr.maybe_save(6, state) is not None  # raised once; the next save works
    mgr.close()
    assert mgr.steps() == [6]


def test_manager_on_s3():
    """Retention, restore and the step lock (a conditional PUT) on S3, served by moto on loopback."""
    pytest.importorskip("moto")
    from shardpoint.storage import S3Storage
    from tests.storage.s3_helpers import make_bucket, moto_server, s3_options

    with moto_server() as endpoint:
        root = S3Storage(f"s3://{make_bucket(endpoint)}/run", s3_options(endpoint))
        model, opt = make()
        refs: dict = {}
        mgr = CheckpointManager(root, interval=2, keep_last=2, mode="eager")
        run(mgr, model, opt, 8, refs=refs)
        mgr.close()
        assert mgr.steps() == [6, 8] and mgr.latest_step() == 8
        assert not [n for n in root.list("") if n.startswith(("step_00000002", "step_00000004"))]
        m2, o2 = make(seed=4)
        assert CheckpointManager(root, policies=[OnDemand()]).restore({"model": m2, "optimizer": o2}) == 8
        assert same(snapshot(m2, o2), refs[8])
        a, b = CheckpointManager(root, mode=None, policies=[OnDemand()]), CheckpointManager(root, mode=None, policies=[OnDemand()])
        StepLock(owner="other", stale_lock_s=3600).acquire(a.path(10), 10)
        with pytest.raises(ConcurrentSaveError):
            b.save(10, {"model": model, "optimizer": opt})
