"""Phase timings, traces and metrics of saves and loads (single process)."""

from __future__ import annotations

import json
import os

import torch

import shardpoint as sp
from shardpoint.runtime.monitor import merge_traces, slowest, trace_report


def test_save_and_load_record_phases(tmp_path):
    m = torch.nn.Linear(64, 64)
    metrics = []
    res = sp.save(str(tmp_path / "ck"), {"model": m}, trace_dir=str(tmp_path / "tr"), on_metrics=metrics.append)
    for phase in ("plan", "checksum", "write", "commit", "total"):
        assert res.timings[phase] >= 0, phase
    assert metrics[0]["op"] == "save" and metrics[0]["bytes"]["write"] == 64 * 64 * 4 + 64 * 4
    rep = sp.load(str(tmp_path / "ck"), {"model": torch.nn.Linear(64, 64)}, return_result=True, trace_dir=str(tmp_path / "tr"))
    for phase in ("manifest", "read", "verify", "total"):
        assert phase in rep.timings, (phase, rep.timings)
    assert rep.recorder.bytes()["read"] == rep.bytes_read
    files = sorted(os.listdir(tmp_path / "tr"))
    assert files == ["load-rank00000.trace.json", "save-rank00000.trace.json"]
    doc = merge_traces(str(tmp_path / "tr"), str(tmp_path / "all.json"))
    with open(tmp_path / "all.json") as f:
        assert json.load(f) == doc
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"write", "read", "commit"} <= names
    spans, ranks = slowest(doc, top=3)
    assert len(spans) == 3 and spans[0][2] >= spans[-1][2]
    assert ranks and ranks[0][0] == 0
    text = trace_report(str(tmp_path / "tr"))
    assert "slowest phases" in text and "rank 0" in text


def test_async_save_records_copy_and_snapshot(tmp_path):
    m = torch.nn.Linear(32, 32)
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    got = []
    res = saver.save(str(tmp_path / "ck"), {"model": m}, on_metrics=got.append).wait()
    assert {"snapshot", "blocked", "copy", "write", "commit", "total"} <= set(res.recorder.summary())
    assert got[0]["bytes"]["copy"] == 32 * 32 * 4 + 32 * 4


def test_async_plan_cache_is_keyed_by_shapes(tmp_path):
    saver = sp.AsyncSaver(staging_bytes=1 << 20)
    m = torch.nn.Linear(8, 8)
    r1 = saver.save(str(tmp_path / "a"), {"model": m}).wait()
    r2 = saver.save(str(tmp_path / "b"), {"model": m}).wait()
    assert not r1.plan_cached and r2.plan_cached
    m3 = torch.nn.Linear(8, 9)  # same names, new shapes: must plan again
    r3 = saver.save(str(tmp_path / "c"), {"model": m3}).wait()
    assert not r3.plan_cached
    out = sp.load(str(tmp_path / "c"), {"model": torch.nn.Linear(8, 9)})
    assert torch.equal(out["model"].weight, m3.weight)
    assert r3.save_id == sp.read_manifest(str(tmp_path / "c")).save_id


def test_phase_summary_is_logged(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="shardpoint"):
        sp.save(str(tmp_path / "ck"), {"model": torch.nn.Linear(4, 4)})
        sp.load(str(tmp_path / "ck"), {"model": torch.nn.Linear(4, 4)})
    text = caplog.text
    assert "rank 0 saved" in text and "plan " in text and "commit " in text and "total " in text
    assert "rank 0 read" in text and "manifest " in text
