"""Save policies: when the manager saves (every n steps, every t seconds, on request or a signal).

A policy whose answer can differ between ranks (a clock, a signal) is
*collective*: the manager combines every rank's answer with one all-reduce, so
all ranks agree. A policy that depends on the step alone costs no
communication.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Sequence

__all__ = ["SavePolicy", "EveryNSteps", "EveryTSeconds", "OnDemand"]

log = logging.getLogger("shardpoint")


class SavePolicy:
    """When to save. Subclass and implement :meth:`wants`.

    A policy whose decision can differ between ranks (a clock, a signal) sets
    ``collective = True``; the manager then combines every rank's answer with
    one all-reduce (MAX), so all ranks agree. Deterministic policies (a
    function of the step only) leave it ``False`` and cost no communication.
    A policy that also asks the training loop to stop after the save sets
    ``stop_pending`` (see :class:`OnDemand`).

    Example::

        class AtSteps(SavePolicy):
            def __init__(self, steps):
                self.steps = set(steps)

            def wants(self, step, now, rank):
                return step in self.steps
    """

    collective: bool = False
    # Whether the manager should set ``stop_requested`` once the next save has started.
    stop_pending: bool = False

    def wants(self, step: int, now: float, rank: int) -> bool:
        """Whether to save after ``step`` (``now``: the manager's clock)."""
        raise NotImplementedError

    def saved(self, step: int, now: float) -> None:
        """Called on every rank after a save of ``step`` started."""

    def restored(self, step: int, now: float) -> None:
        """Called on every rank after ``restore`` loaded ``step``."""


class EveryNSteps(SavePolicy):
    """Save when ``step % n == 0``.

    Example::

        CheckpointManager(root, policies=[EveryNSteps(500)])   # same as interval=500
    """

    def __init__(self, n: int):
        if int(n) < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = int(n)

    def wants(self, step: int, now: float, rank: int) -> bool:
        return step % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryTSeconds(SavePolicy):
    """Save when ``seconds`` have passed since the last save (or restore, or start).

    Only rank 0's clock counts: its answer is shared with the others, so ranks
    never disagree even when their clocks or step times differ.

    Example::

        CheckpointManager(root, policies=[EveryTSeconds(1800)])
    """

    collective = True

    def __init__(self, seconds: float):
        if seconds <= 0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        self.seconds = float(seconds)
        self._last: float | None = None

    def wants(self, step: int, now: float, rank: int) -> bool:
        if self._last is None:
            self._last = now
        return rank == 0 and now - self._last >= self.seconds

    def saved(self, step: int, now: float) -> None:
        self._last = now

    def restored(self, step: int, now: float) -> None:
        self._last = now

    def __repr__(self) -> str:
        return f"EveryTSeconds({self.seconds:g})"


class OnDemand(SavePolicy):
    """Save at the next ``maybe_save`` after :meth:`request` (on any rank) or a signal.

    With ``signals`` (e.g. ``[signal.SIGTERM]``) a handler is installed on
    the main thread when the manager starts. The first signal requests a save
    and, with ``stop=True``, sets the manager's ``stop_requested`` once that
    save has started, so the loop can exit while the agent's grace period
    runs. A second identical signal gets the previous handler (by default the
    process ends).

    Example::

        mgr = CheckpointManager(root, interval=1000, policies=[OnDemand(signals=[signal.SIGTERM])])
        ...
        mgr.maybe_save(step, state)
        if mgr.stop_requested:
            break
    """

    collective = True

    def __init__(self, signals: Sequence[int] = (), stop: bool = True):
        self.signals = tuple(signals)
        self.stop = stop
        self._requested = False
        self._stop_pending = False
        self._previous: dict[int, Any] = {}

    def request(self, stop: bool = False) -> None:
        """Ask for a save at the next ``maybe_save`` (safe from a signal handler)."""
        self._requested = True
        self._stop_pending = self._stop_pending or stop

    @property
    def stop_pending(self) -> bool:  # type: ignore[override]
        """Whether a request asked the loop to stop once the save has started."""
        return self._stop_pending

    def wants(self, step: int, now: float, rank: int) -> bool:
        return self._requested

    def saved(self, step: int, now: float) -> None:
        self._requested = False
        self._stop_pending = False

    def install(self) -> None:
        """Install the signal handlers (main thread only; idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("OnDemand: signal handlers can only be installed from the main thread")
            return
        for sig in self.signals:
            if sig in self._previous:
                continue
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Put the previous signal handlers back."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self._requested:  # second signal: let the previous handler act
            prev = self._previous.pop(signum, signal.SIG_DFL)
            signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
            if callable(prev):
                prev(signum, frame)
            else:
                os.kill(os.getpid(), signum)
            return
        self.request(stop=self.stop)

    def __repr__(self) -> str:
        return f"OnDemand(signals={list(self.signals)}, stop={self.stop})"
