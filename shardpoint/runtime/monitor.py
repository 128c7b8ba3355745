"""Phase timings for every save and load, as a summary, a log line, a trace and metrics.

Each operation records spans (phase name, start, end, bytes) on a monotonic
clock, anchored to the wall clock once so that ranks line up on one timeline.
A :class:`Recorder` gives:

- ``summary()``: seconds and bytes per phase (on ``SaveResult``/``LoadResult``);
- ``write_trace(dir)``: one JSON file per rank in the Chrome trace event
  format; :func:`merge_traces` joins every rank's file into one timeline that
  Perfetto or ``chrome://tracing`` opens, and ``shardpoint trace DIR`` prints
  the slowest phases and ranks;
- an optional ``on_metrics(dict)`` callback for Prometheus, TensorBoard, etc.

Example::

    sp.save("ckpt/step_100", state, trace_dir="traces/step_100",
            on_metrics=lambda m: writer.add_scalars("ckpt", m["seconds"], step))
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .progress import ACTIVITY

__all__ = ["Span", "Recorder", "mark_phase", "merge_traces", "slowest", "trace_report", "format_summary", "PHASES"]

PHASES = (
    "plan", "snapshot", "serialize", "checksum", "write", "commit",
    "manifest", "read", "verify", "copy", "communicate", "finish", "total",
)


@dataclass(frozen=True)
class Span:
    """One timed phase on one rank (seconds on the monotonic clock)."""

    phase: str
    start: float
    end: float
    nbytes: int = 0
    thread: str = "main"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Recorder:
    """Collects spans for one save or load on one rank (thread-safe)."""

    op: str
    path: str
    rank: int = 0
    spans: list[Span] = field(default_factory=list)
    listeners: list[Callable[[str, int], None]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _mono0: float = field(default_factory=time.monotonic, repr=False)
    _wall0: float = field(default_factory=time.time, repr=False)

    @contextmanager
    def phase(self, name: str, nbytes: int = 0) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.add(name, t, time.monotonic(), nbytes)

    def add(self, name: str, start: float, end: float, nbytes: int = 0) -> None:
        with self._lock:
            self.spans.append(Span(name, start, end, nbytes, threading.current_thread().name))
        ACTIVITY.note(nbytes)  # what the hang watchdog judges progress by
        for fn in self.listeners:
            fn(name, nbytes)

    def listen(self, fn: Callable[[str, int], None]) -> None:
        """Call ``fn(phase, nbytes)`` for every span recorded from now on (a progress bar, say)."""
        self.listeners.append(fn)

    def summary(self) -> dict[str, float]:
        """Total seconds per phase (spans of the same phase add up)."""
        out: dict[str, float] = {}
        with self._lock:
            for s in self.spans:
                out[s.phase] = out.get(s.phase, 0.0) + s.seconds
        return out

    def bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for s in self.spans:
                if s.nbytes:
                    out[s.phase] = out.get(s.phase, 0) + s.nbytes
        return out

    def metrics(self) -> dict[str, Any]:
        return {"op": self.op, "path": self.path, "rank": self.rank, "seconds": self.summary(), "bytes": self.bytes()}

    def chrome_events(self) -> list[dict]:
        """Chrome trace "complete" events, timestamps in microseconds of wall-clock time."""
        base = self._wall0 - self._mono0
        tids: dict[str, int] = {}
        events = []
        with self._lock:
            for s in self.spans:
                tid = tids.setdefault(s.thread, len(tids))
                events.append({
                    "name": s.phase, "cat": self.op, "ph": "X", "pid": self.rank, "tid": tid,
                    "ts": (base + s.start) * 1e6, "dur": max(0.0, s.seconds) * 1e6,
                    "args": {"bytes": s.nbytes, "path": self.path},
                })
        for name, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}})
        events.append({"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}})
        return events

    def write_trace(self, directory: str) -> str:
        """Write this rank's events to ``directory/<op>-rank<r>.trace.json``; returns the file."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.op}-rank{self.rank:05d}.trace.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": self.chrome_events(), "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
        return path

    def emit(self, trace_dir: str | None, on_metrics: Callable[[dict], None] | None) -> None:
        if trace_dir:
            self.write_trace(trace_dir)
        if on_metrics is not None:
            on_metrics(self.metrics())


def mark_phase(result, phase: str, start: float, nbytes: int = 0) -> None:
    """Record a phase that began at ``start`` (monotonic seconds) and ends now.

    Shared by :func:`~shardpoint.save`, :func:`~shardpoint.load` and the
    asynchronous saver so all report phases the same way. ``result`` is any
    object with a ``timings`` dict and a ``recorder`` (a :class:`Recorder` or
    ``None``), such as :class:`~shardpoint.SaveResult` or :class:`~shardpoint.LoadResult`.

    Example::

        t0 = time.monotonic(); ...; mark_phase(result, "prepare", t0)
    """
    end = time.monotonic()
    result.timings[phase] = result.timings.get(phase, 0.0) + (end - start)
    if result.recorder is not None:
        result.recorder.add(phase, start, end, nbytes)


def format_summary(timings: dict[str, float]) -> str:
    """``"plan 1.2ms, write 340.0ms, ..."`` in phase order, for log lines."""
    order = {p: i for i, p in enumerate(PHASES)}
    items = sorted(timings.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))
    return ", ".join(f"{k} {v * 1e3:.1f}ms" for k, v in items)


def merge_traces(directory: str, out: str | None = None) -> dict:
    """Join every ``*.trace.json`` in ``directory`` into one Chrome trace (optionally written to ``out``)."""
    events: list[dict] = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".trace.json"):
            with open(os.path.join(directory, name)) as f:
                events.extend(json.load(f).get("traceEvents", []))
    doc = {"traceEvents": events, "displayTimeUnit": "ms"}
    if out:
        with open(out, "w") as f:
            json.dump(doc, f)
    return doc


def slowest(doc: dict, top: int = 10) -> tuple[list[tuple[str, int, float]], list[tuple[int, float]]]:
    """The slowest (phase, rank, seconds) spans and the ranks by total busy seconds."""
    spans = [(e["name"], int(e["pid"]), e["dur"] / 1e6) for e in doc["traceEvents"] if e.get("ph") == "X"]
    spans.sort(key=lambda s: -s[2])
    per_rank: dict[int, float] = {}
    for name, rank, sec in spans:
        if name == "total":
            per_rank[rank] = per_rank.get(rank, 0.0) + sec
    ranks = sorted(per_rank.items(), key=lambda kv: -kv[1])
    return [s for s in spans if s[0] != "total"][:top], ranks


def trace_report(directory: str, top: int = 10) -> str:
    """A short text report of the slowest phases and ranks in a trace folder."""
    doc = merge_traces(directory)
    spans, ranks = slowest(doc, top)
    lines = [f"{len(doc['traceEvents'])} events from {len({e['pid'] for e in doc['traceEvents']})} rank(s)"]
    lines.append("slowest phases:")
    lines += [f"  {sec * 1e3:10.2f} ms  rank {rank:<5} {name}" for name, rank, sec in spans]
    if ranks:
        lines.append("ranks by total time:")
        lines += [f"  {sec * 1e3:10.2f} ms  rank {rank}" for rank, sec in ranks[:top]]
    return "\n".join(lines)
