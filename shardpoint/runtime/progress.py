"""Progress of long saves, loads and restores, and the activity that hang detection judges.

Two consumers read the same stream of events, the spans every
:class:`~shardpoint.runtime.monitor.Recorder` collects (a phase entered, bytes moved):

- :class:`Progress` shows one operation's bytes on rank 0: a tqdm bar on
  stderr when it is a terminal and tqdm is installed (``pip install
  'shardpoint[cli]'``), else a plain line on stderr every
  ``SHARDPOINT_PROGRESS_INTERVAL`` seconds (default 10) and one at the end;
- :data:`ACTIVITY` counts every span of the process, so that the manager's
  hang watchdog can tell a slow phase that moves bytes from a stuck one.

Example::

    sp.load("ckpt/step_100", state, progress=True)
    # shardpoint: load ckpt/step_100: 1.2 GiB of 1.2 GiB (100%) in 3.1s, 396.8 MiB/s
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Iterable, Iterator, TextIO

__all__ = ["Activity", "ACTIVITY", "Progress", "progress_for", "follow", "human_bytes", "LOAD_PHASES", "SAVE_PHASES"]

SAVE_PHASES = frozenset({"write"})
"""Recorder phases whose bytes count as a save's progress (bytes written to storage)."""

LOAD_PHASES = frozenset({"read", "communicate"})
"""Recorder phases whose bytes count as a load's progress (bytes read, or received from a peer rank)."""


class Activity:
    """Process-wide counters of checkpoint work: spans recorded and bytes they moved.

    Updated without a lock (a lost increment under a thread race changes
    nothing for a reader that only asks whether the counters moved).

    Example::

        before = ACTIVITY.snapshot(); ...; moved = ACTIVITY.snapshot() != before
    """

    def __init__(self) -> None:
        self.events = 0
        self.nbytes = 0

    def note(self, nbytes: int = 0) -> None:
        """Count one event (a span recorded, a phase entered) that moved ``nbytes``."""
        self.events += 1
        self.nbytes += nbytes

    def snapshot(self) -> tuple[int, int]:
        """The counters now, ``(events, bytes)``; compare two to see whether work went on between them."""
        return self.events, self.nbytes


ACTIVITY = Activity()
"""The one :class:`Activity` of this process; every recorder span feeds it."""


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, one decimal.

    Example::

        human_bytes(3 << 20)  # '3.0 MiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("SHARDPOINT_PROGRESS_INTERVAL", "10")))
    except ValueError:
        return 10.0


class Progress:
    """One operation's bytes on stderr: a tqdm bar on a terminal, plain lines elsewhere.

    Feed it with :meth:`on_span` (a :class:`~shardpoint.runtime.monitor.Recorder`
    listener): the bytes of the spans in ``phases`` count. ``total`` may be
    set once it is known (:meth:`set_total`). Thread-safe.

    Example::

        with Progress("load ckpt/step_100", LOAD_PHASES) as bar:
            recorder.listen(bar.on_span); bar.set_total(need)
    """

    def __init__(self, desc: str, phases: Iterable[str], total: int | None = None, stream: TextIO | None = None):
        self.desc, self.phases = desc, frozenset(phases)
        self.total, self.done = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()
        self._t0 = self._last = time.monotonic()
        self._every = _interval()
        self._bar: Any = self._make_bar()
        self._closed = False

    def _make_bar(self) -> Any:
        isatty = getattr(self.stream, "isatty", None)
        if not (isatty and isatty()):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=self.total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024,
                    file=self.stream, leave=True, dynamic_ncols=True)

    def set_total(self, total: int) -> None:
        """The bytes the operation will move, once known."""
        with self._lock:
            self.total = int(total)
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()

    def on_span(self, phase: str, nbytes: int) -> None:
        """Recorder listener: count ``nbytes`` when ``phase`` is one of this operation's."""
        if nbytes and phase in self.phases:
            self.update(nbytes)

    def update(self, nbytes: int) -> None:
        """Count ``nbytes`` more (shown up to the total)."""
        with self._lock:
            if self._closed:
                return
            step = nbytes if self.total is None else max(0, min(nbytes, self.total - self.done))
            self.done += step
            if self._bar is not None:
                self._bar.update(step)
                return
            now = time.monotonic()
            if self._every and now - self._last >= self._every:
                self._last = now
                self._line(now, final=False)

    def _line(self, now: float, final: bool) -> None:
        secs = max(now - self._t0, 1e-9)
        of = "" if self.total is None else f" of {human_bytes(self.total)}"
        pct = f" ({100.0 * self.done / self.total:.0f}%)" if self.total else ""
        verb = "done" if final else "so far"
        self.stream.write(
            f"shardpoint: {self.desc}: {human_bytes(self.done)}{of}{pct} {verb} in {secs:.1f}s, "
            f"{human_bytes(self.done / secs)}/s\n"
        )
        self.stream.flush()

    def close(self, ok: bool = True) -> None:
        """Finish the report: the bar is closed (completed when ``ok``), or a last line says what was done."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if ok and self.total is not None and self.done < self.total:
                rest = self.total - self.done  # reads served without a byte-counting span (a direct view)
                self.done = self.total
                if self._bar is not None:
                    self._bar.update(rest)
            if self._bar is not None:
                self._bar.close()
            elif ok:
                self._line(time.monotonic(), final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, et, ev, tb) -> None:
        self.close(ok=et is None)


def progress_for(progress: bool, rank: int, desc: str, phases: Iterable[str], recorder: Any = None) -> Progress | None:
    """A :class:`Progress` fed by ``recorder`` when ``progress`` is true on rank 0; ``None`` otherwise.

    Example::

        bar = progress_for(True, comm.rank, f"save {where}", SAVE_PHASES, result.recorder)
    """
    if not progress or rank != 0:
        return None
    bar = Progress(desc, phases)
    if recorder is not None:
        recorder.listen(bar.on_span)
    return bar


@contextlib.contextmanager
def follow(progress: bool, recorder: Any, desc: str, phases: Iterable[str] = SAVE_PHASES) -> Iterator[Progress | None]:
    """While the block runs, show the bytes ``recorder`` records (rank 0, when ``progress``).

    For work already under way (a background save): the bar starts from the
    bytes recorded so far.

    Example::

        with follow(True, handle.result.recorder, f"save {handle.path}"):
            handle.wait()
    """
    bar = progress_for(progress, getattr(recorder, "rank", 0), desc, phases) if recorder is not None else None
    if bar is not None:
        done = recorder.bytes()
        bar.update(sum(done.get(p, 0) for p in bar.phases))
        recorder.listen(bar.on_span)
    ok = False
    try:
        yield bar
        ok = True
    finally:
        if bar is not None:
            recorder.listeners.remove(bar.on_span)
            bar.close(ok=ok)
