"""What a new user meets first: safe manager defaults, errors that name the fix, one name per concept,
numpy values, progress output, and the package basics."""

from __future__ import annotations

import io
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
import tomllib
import warnings

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.cli import build_parser, main
from shardpoint.manager import CheckpointManager, EveryTSeconds, OnDemand
from shardpoint.manager.pending import wait_judging_progress
from shardpoint.manager.watchdog import Watchdog, exit_on_hang, hang_action, raises_on_hang
from shardpoint.runtime.monitor import Recorder
from shardpoint.runtime.progress import ACTIVITY, LOAD_PHASES, Progress, progress_for

from .test_manager import FaultyLocal

REPO = pathlib.Path(__file__).resolve().parents[2]


def _model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(dtype)


# ------------------------------------------------------------------ manager defaults
def test_manager_without_a_policy_refuses_to_never_save(tmp_path):
    with pytest.raises(ValueError, match=r"interval=N") as ei:
        CheckpointManager(str(tmp_path))
    assert "never save" in str(ei.value) and "OnDemand()" in str(ei.value) and "EveryTSeconds" in str(ei.value)


@pytest.mark.parametrize("interval", [0, -3])
def test_manager_refuses_interval_zero(tmp_path, interval):
    with pytest.raises(ValueError, match=rf"interval must be a number of steps >= 1, got {interval}"):
        CheckpointManager(str(tmp_path), interval=interval)


def test_manager_with_on_demand_or_a_time_policy_is_fine(tmp_path):
    for policies in ([OnDemand()], [EveryTSeconds(60)]):
        mgr = CheckpointManager(str(tmp_path / str(len(policies))), policies=policies, mode=None)
        assert mgr.restore({"x": torch.zeros(1)}) is None
        mgr.close()


def test_async_mode_is_a_deprecated_spelling_of_mode(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"async_mode=.*deprecated; use mode="):
        mgr = CheckpointManager(str(tmp_path), interval=1, async_mode=None)
    assert mgr.mode is None and mgr.async_mode is None
    mgr.save(1, {"x": torch.ones(2)})  # blocking: committed on return
    assert mgr.steps() == [1]
    mgr.close()
    with pytest.raises(ValueError, match="give mode= only"):
        CheckpointManager(str(tmp_path), interval=1, mode="lazy", async_mode="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        CheckpointManager(str(tmp_path), interval=1, mode="lazy", prewarm=False).close()


# ------------------------------------------------------------------ hang detection
def test_on_hang_auto_exits_only_under_torchrun(monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert raises_on_hang("auto") and hang_action("auto") is not exit_on_hang
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not raises_on_hang("auto") and hang_action("auto") is exit_on_hang
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert hang_action("auto") is exit_on_hang
    assert raises_on_hang("raise") and hang_action("exit") is exit_on_hang and not raises_on_hang("log")


def test_watchdog_never_reports_a_phase_that_keeps_moving_bytes():
    reports = []
    dog = Watchdog(rank=0, timeout=0.2, grace=0.1, on_hang=reports.append, raises=True)
    rec = Recorder("save", "x")
    with dog.watch("save", 5):
        for _ in range(12):  # 1.2 s in all, four times the limit, but bytes move every 0.1 s
            time.sleep(0.1)
            rec.add("write", 0.0, 0.0, 4096)
    dog.close()
    dog.join()
    assert reports == []


def test_watchdog_reports_a_phase_without_progress_and_raises_when_it_returns():
    reports = []
    dog = Watchdog(rank=3, timeout=0.2, grace=0.1, on_hang=reports.append, raises=True)
    with pytest.raises(sp.CheckpointTimeoutError, match=r"rank 3: checkpoint phase 'restore:load' of step_00000007 made no progress") as ei:
        with dog.watch("restore:load", 7):
            time.sleep(0.8)
    dog.close()
    dog.join()
    assert [(r.rank, r.phase, r.step) for r in reports] == [(3, "restore:load", 7)]
    assert reports[0].seconds >= 0.3
    assert (ei.value.rank, ei.value.phase, ei.value.step) == (3, "restore:load", 7)


class _Slow:
    """A save handle whose wait() times out until ``until`` (monotonic)."""

    path = "slow"

    def __init__(self, until: float, moving: bool):
        self.until, self.moving = until, moving

    def wait(self, timeout=None):
        left = self.until - time.monotonic()
        if timeout is not None and left > timeout:
            time.sleep(timeout)
            if self.moving:
                ACTIVITY.note(1024)  # the background writer moved bytes meanwhile
            raise TimeoutError("still running")
        time.sleep(max(0.0, left))
        return "done"


def test_background_wait_judges_progress_not_the_clock():
    assert wait_judging_progress(_Slow(time.monotonic() + 1.0, moving=True), left=0.2, timeout=0.2) == "done"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="made no progress"):
        wait_judging_progress(_Slow(time.monotonic() + 5.0, moving=False), left=0.2, timeout=0.2)
    assert time.monotonic() - t0 < 2.0


def test_manager_raises_on_a_hung_save_outside_torchrun(tmp_path, monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    storage = FaultyLocal(str(tmp_path / "run"))
    mgr = CheckpointManager(storage, policies=[OnDemand()], mode=None, timeout=0.2, hang_grace=0.1)
    storage.faults["sleep"] = 0.8  # each data write blocks past the limit: no bytes move
    with pytest.raises(sp.CheckpointTimeoutError, match=r"phase 'save' of step_00000001 made no progress"):
        mgr.save(1, {"x": torch.ones(4)})
    with pytest.raises(sp.CheckpointTimeoutError, match="unusable after an earlier hang"):
        mgr.save(2, {"x": torch.ones(4)})
    mgr.close()


# ------------------------------------------------------------------ one name per concept
def test_checkpoint_conflict_error_is_a_deprecated_base_of_concurrent_save_error():
    with pytest.warns(DeprecationWarning, match="catch shardpoint.ConcurrentSaveError"):
        old = sp.CheckpointConflictError
    with pytest.warns(DeprecationWarning):
        from shardpoint.manager import CheckpointConflictError
    with pytest.warns(DeprecationWarning):
        from shardpoint.errors import CheckpointConflictError as from_errors
    assert old is CheckpointConflictError is from_errors
    assert issubclass(sp.ConcurrentSaveError, old) and issubclass(old, sp.CheckpointError)
    assert "CheckpointConflictError" not in sp.__all__ and "ConcurrentSaveError" in sp.__all__
    with pytest.raises(AttributeError):
        sp.NoSuchError  # noqa: B018


def test_a_step_lock_conflict_is_caught_by_the_old_and_the_new_name(tmp_path):
    a = CheckpointManager(str(tmp_path), policies=[OnDemand()], mode=None)
    b = CheckpointManager(str(tmp_path), policies=[OnDemand()], mode=None)
    a._locks.acquire(a.path(4), 4)  # noqa: SLF001 - a save of step 4 holds its lock
    with pytest.raises(sp.ConcurrentSaveError, match=r"two saves raced to step_00000004") as ei:
        b.save(4, {"x": torch.ones(2)})
    assert ei.value.path.endswith("step_00000004")
    with pytest.warns(DeprecationWarning):
        old = sp.CheckpointConflictError
    try:
        b.save(4, {"x": torch.ones(2)})
    except old as e:  # an existing ``except CheckpointConflictError`` clause still catches it
        assert type(e) is sp.ConcurrentSaveError
    a.close()
    b.close()


def test_dtype_mismatch_has_its_own_error(tmp_path):
    sp.save(str(tmp_path / "ck"), {"model": _model()})
    with pytest.raises(sp.DtypeMismatchError, match=r"'model.0.weight': checkpoint has float32\[8, 8\], target has bfloat16\[8, 8\]; loading does not cast"):
        sp.load(str(tmp_path / "ck"), {"model": _model(dtype=torch.bfloat16)})
    assert issubclass(sp.DtypeMismatchError, sp.ShapeMismatchError) and "DtypeMismatchError" in sp.__all__
    wide = torch.nn.Sequential(torch.nn.Linear(8, 9), torch.nn.Linear(9, 4))
    with pytest.raises(sp.ShapeMismatchError) as ei:
        sp.load(str(tmp_path / "ck"), {"model": wide})
    assert type(ei.value) is sp.ShapeMismatchError and "target has float32[9, 8]" in str(ei.value)


def test_load_returns_its_statistics_and_the_out_parameter_is_deprecated(tmp_path):
    m = _model()
    sp.save(str(tmp_path / "ck"), {"model": m})
    state = {"model": _model(1)}
    res = sp.load(str(tmp_path / "ck"), state, return_result=True)
    assert isinstance(res, sp.LoadResult) and res.state is state
    assert res.bytes_read >= res.bytes_needed == sum(p.numel() * 4 for p in m.parameters())
    assert res.timings["read"] > 0 and res.missing == [] and res.unexpected == []
    assert sp.load(str(tmp_path / "ck"), state) is state  # the default return is unchanged
    old = sp.LoadResult()
    with pytest.warns(DeprecationWarning, match=r"report=.*deprecated; use .*return_result=True"):
        sp.load(str(tmp_path / "ck"), state, report=old)
    assert old.bytes_needed == res.bytes_needed and old.state is state


@pytest.mark.parametrize("fn", ["import_dcp", "import_torch", "import_deepspeed"])
def test_trust_pickle_is_a_deprecated_spelling_of_allow_pickle(tmp_path, fn):
    import shardpoint.convert as convert
    from shardpoint.convert.deepspeed_native import import_deepspeed
    from shardpoint.errors import ConversionError

    f = import_deepspeed if fn == "import_deepspeed" else getattr(convert, fn)
    with pytest.raises(ConversionError, match=r"without allow_pickle=True \(--allow-pickle\)"):
        f(str(tmp_path / "in"), str(tmp_path / "out"))
    with pytest.warns(DeprecationWarning, match="trust_pickle= is deprecated; use allow_pickle="):
        with pytest.raises(Exception) as ei:  # past the opt-in: the missing input is what fails now
            f(str(tmp_path / "in"), str(tmp_path / "out"), trust_pickle=True)
    assert "allow_pickle" not in str(ei.value)


def test_cli_pickle_flag_is_allow_pickle_and_the_old_one_still_works(tmp_path, capsys):
    torch.save({"w": torch.arange(4.0)}, tmp_path / "m.pt")
    help_text = build_parser()._subparsers._group_actions[0].choices["import"].format_help()  # noqa: SLF001
    assert "--allow-pickle" in help_text and "--trust-pickle" not in help_text
    assert main(["import", "torch", str(tmp_path / "m.pt"), str(tmp_path / "a"), "--allow-pickle", "-q"]) == 0
    assert main(["import", "torch", str(tmp_path / "m.pt"), str(tmp_path / "b"), "--trust-pickle", "-q"]) == 0
    assert "--trust-pickle is deprecated" in capsys.readouterr().err
    assert torch.equal(sp.read_tensor(str(tmp_path / "b"), "model.w"), torch.arange(4.0))


# ------------------------------------------------------------------ errors that point to the fix
@pytest.mark.parametrize("call", ["save", "load", "async_save"])
def test_dcp_argument_order_says_the_path_comes_first(tmp_path, call):
    state = {"model": _model()}
    with pytest.raises(sp.UnsupportedStateError, match=rf"^sp\.{call}\(path, state\): the path comes first"):
        getattr(sp, call)(state, str(tmp_path / "ck"))
    with pytest.raises(sp.UnsupportedStateError, match="the path comes first"):
        getattr(sp, call)(state, tmp_path / "ck")  # a pathlib.Path too
    assert not (tmp_path / "ck").exists()


def test_typos_get_the_close_names(tmp_path):
    path = str(tmp_path / "ck")
    sp.save(path, {"model": _model(), "extra": {"step": 1}})
    with pytest.raises(sp.KeyMismatchError, match=r"no tensor 'model.0.wieght' in the checkpoint; did you mean 'model\.0\.weight', "):
        sp.read_tensor(path, "model.0.wieght")
    with pytest.raises(sp.KeyMismatchError, match=r"did you mean 'model\.1\.\*' for 'model\.l\.\*'\?"):
        sp.load(path, {"model": _model(1)}, keys=["model.l.*"])
    with pytest.raises(sp.KeyMismatchError, match=r"did you mean 'model' for 'modle'\?"):
        sp.load(path, {"modle": _model(1), "extra": {}})
    state = {"model": _model(1)}
    sp.load(path, state, keys=["model.l.*", "model.1.*"], strict=False)  # the other pattern still loads
    assert torch.equal(state["model"][1].weight, sp.read_tensor(path, "model.1.weight"))


def test_a_run_folder_is_diagnosed_and_its_steps_listed(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), interval=2, mode=None)
    for step in range(1, 7):
        mgr.maybe_save(step, {"x": torch.full((2,), float(step))})
    mgr.close()
    with pytest.raises(sp.CheckpointNotFoundError) as ei:
        sp.load(str(tmp_path / "run"), {"x": torch.zeros(2)})
    msg = str(ei.value)
    assert "is a CheckpointManager run folder, not one checkpoint: it holds steps 2, 4, 6 (newest 6)" in msg
    assert f"sp.load('{tmp_path / 'run'}/step_00000006', state)" in msg and "interrupted" not in msg
    assert not isinstance(ei.value, sp.IncompleteCheckpointError)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".ckpt", ".bin"])
def test_a_torch_file_says_to_import_it(tmp_path, suffix):
    f = tmp_path / f"model{suffix}"
    torch.save({"w": torch.ones(2)}, f)
    with pytest.raises(sp.CheckpointNotFoundError, match=rf"{re.escape(str(f))} is a file, not a shardpoint checkpoint: convert it first: shardpoint import torch") as ei:
        sp.load(str(f), {"model": _model()})
    assert "interrupted" not in str(ei.value)


def test_only_a_shardpoint_save_is_called_interrupted(tmp_path):
    other = tmp_path / "dcp"
    other.mkdir()
    (other / ".metadata").write_bytes(b"x")
    (other / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(sp.CheckpointNotFoundError, match=r"is not a shardpoint checkpoint.*shardpoint import dcp") as ei:
        sp.load(str(other), {})
    assert "interrupted" not in str(ei.value)
    torn = tmp_path / "torn"
    sp.save(str(torn), {"x": torch.ones(2)})
    os.remove(torn / "manifest.json")  # data files of a save, no manifest: a save that did not commit
    with pytest.raises(sp.IncompleteCheckpointError, match="interrupted or is still running"):
        sp.load(str(torn), {"x": torch.zeros(2)})


# ------------------------------------------------------------------ numpy values
def test_numpy_arrays_in_extra_round_trip_bit_exact(tmp_path):
    arrays = {
        "weights": np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32),
        "counts": np.arange(6, dtype=np.int64).reshape(2, 3),
        "scalar": np.array(2.5, dtype=np.float64),
        "names": np.array(["a", "bc"]),
        "big_endian": np.arange(3, dtype=">i4"),
    }
    sp.save(str(tmp_path / "ck"), {"model": _model(), "extra": {"rng": arrays, "step": 3}})
    state = {"model": _model(1), "extra": {}}
    sp.load(str(tmp_path / "ck"), state)
    back = state["extra"]["rng"]
    assert state["extra"]["step"] == 3
    for k, a in arrays.items():
        assert type(back[k]) is np.ndarray, k
        assert back[k].dtype == a.dtype and back[k].shape == a.shape and back[k].tobytes() == a.tobytes(), k
    everything = sp.load(str(tmp_path / "ck"), {}, strict=False)
    assert np.array_equal(everything["extra"]["rng"]["counts"], arrays["counts"])


# ------------------------------------------------------------------ progress
def test_load_with_progress_prints_bytes_and_rate(tmp_path, capsys):
    path = str(tmp_path / "ck")
    sp.save(path, {"model": _model()})
    capsys.readouterr()
    sp.load(path, {"model": _model(1)}, progress=True)
    err = capsys.readouterr().err
    assert re.search(rf"shardpoint: load {re.escape(path)}: 432 B of 432 B \(100%\) done in [0-9.]+s, [0-9.]+ [KMG]?i?B/s", err), err
    sp.load(path, {"model": _model(1)})
    assert capsys.readouterr().err == ""  # off by default


def test_save_wait_and_restore_show_progress(tmp_path, capsys):
    sp.save(str(tmp_path / "a"), {"model": _model()}, progress=True)
    assert re.search(r"shardpoint: save .*a: 432 B of 432 B \(100%\) done", capsys.readouterr().err)
    sp.async_save(str(tmp_path / "b"), {"model": _model()}).wait(progress=True)
    assert re.search(r"shardpoint: save .*b: 432 B done", capsys.readouterr().err)
    mgr = CheckpointManager(str(tmp_path / "run"), interval=1, mode=None)
    mgr.maybe_save(1, {"model": _model()})
    capsys.readouterr()
    assert mgr.restore({"model": _model(1)}, progress=True) == 1
    assert re.search(r"shardpoint: load .*step_00000001: 432 B of 432 B \(100%\) done", capsys.readouterr().err)
    mgr.close()


def test_progress_lines_come_periodically_and_only_on_rank_zero(monkeypatch):
    assert progress_for(True, 1, "load x", LOAD_PHASES) is None and progress_for(False, 0, "x", ()) is None
    monkeypatch.setenv("SHARDPOINT_PROGRESS_INTERVAL", "0.05")
    out = io.StringIO()
    bar = Progress("load x", LOAD_PHASES, total=3 << 20, stream=out)
    rec = Recorder("load", "x")
    rec.listen(bar.on_span)
    for _ in range(3):
        time.sleep(0.06)
        rec.add("read", 0.0, 0.0, 1 << 20)
        rec.add("copy", 0.0, 0.0, 1 << 20)  # not a byte of progress: copies follow reads
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("shardpoint: load x: 1.0 MiB of 3.0 MiB (33%) so far")
    assert lines[-1].startswith("shardpoint: load x: 3.0 MiB of 3.0 MiB (100%) done") and len(lines) == 4


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_tqdm_bar():
    pytest.importorskip("tqdm")
    out = _Tty()
    with Progress("save x", {"write"}, total=2 << 20, stream=out) as bar:
        bar.on_span("write", 2 << 20)
    text = out.getvalue()
    assert "save x" in text and "100%" in text and "2.00M" in text and "B/s" in text


# ------------------------------------------------------------------ package basics
def test_python_dash_m_shardpoint_help_is_plain_text():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "shardpoint", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: shardpoint")
    texts = [run.stdout] + [p.format_help() for p in build_parser()._subparsers._group_actions[0].choices.values()]  # noqa: SLF001
    for text in texts:
        assert not re.search(r"``|:(class|func|mod|meth|data|attr):`", text), text


def test_license_typing_marker_and_one_version():
    lic = (REPO / "LICENSE").read_text()
    assert "Apache License" in lic and "Version 2.0, January 2004" in lic and "END OF TERMS AND CONDITIONS" in lic
    assert len(lic.splitlines()) > 150
    assert (REPO / "shardpoint" / "py.typed").exists()
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "shardpoint.__version__"}
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["shardpoint"]
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", sp.__version__)
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and "### Deprecated" in changelog


def test_progress_bar_thread_safety():
    out = io.StringIO()
    bar = Progress("load x", LOAD_PHASES, total=400 * 1000, stream=out)
    threads = [threading.Thread(target=lambda: [bar.on_span("read", 1000) for _ in range(100)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    assert bar.done == 400 * 1000
