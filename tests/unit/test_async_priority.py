"""The save workers run a fixed number of nice levels below the training thread, never more."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from torch import nn

import shardpoint as sp
from shardpoint.engine import pipeline, workers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice levels are Linux behaviour")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_fresh_thread(fn):
    """Run ``fn`` in a new thread, so that the nice levels this test sets die with it."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_worker_started_by_the_other_worker_is_not_lowered_twice():
    def run():
        base = _nice()
        saver = sp.AsyncSaver(background_nice=3)
        pool = saver._workers()
        # The first task starts the second worker itself, as the lazy copier starts the writer.
        first = pool.submit(lambda: (_nice(), pool.submit(_nice).result()))
        try:
            return base, first.result(timeout=30)
        finally:
            pool.shutdown()

    base, (first, second) = _in_fresh_thread(run)
    if base + 3 > 19:
        pytest.skip("this process already runs at the lowest priority")
    assert (first, second) == (base + 3, base + 3)


def test_zero_leaves_priorities_alone():
    def run():
        base = _nice()
        saver = sp.AsyncSaver(background_nice=0)
        pool = saver._workers()
        try:
            return base, pool.submit(lambda: (_nice(), pool.submit(_nice).result())).result(timeout=30)
        finally:
            pool.shutdown()

    base, got = _in_fresh_thread(run)
    assert got == (base, base)
    assert workers.nice_target(0) is None
    assert workers.nice_target(-2) is None


def test_lazy_save_writes_at_the_configured_level(tmp_path, monkeypatch):
    seen: list = []
    real = pipeline.StagedWrite.write

    def write(self):
        seen.append(_nice())
        return real(self)

    monkeypatch.setattr(pipeline.StagedWrite, "write", write)

    def run():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
        opt = torch.optim.AdamW(m.parameters())
        m(torch.randn(4, 64)).sum().backward()
        opt.step()
        base = _nice()
        saver = sp.AsyncSaver(background_nice=4)
        try:
            for i in range(2):
                saver.save(str(tmp_path / f"c{i}"), {"model": m, "optimizer": opt}, mode="lazy").wait()
        finally:
            saver.wait()
        m2 = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
        sp.load(str(tmp_path / "c1"), {"model": m2}, strict=False)
        for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
            assert torch.equal(a, b)
        return base

    base = _in_fresh_thread(run)
    if base + 4 > 19:
        pytest.skip("this process already runs at the lowest priority")
    assert seen == [base + 4, base + 4]
