"""The hang watchdog: report checkpoint phases that run past their deadline, with every thread's stack.

Manager collectives and background saves time out by themselves; the
watchdog backs up what cannot (a storage write stuck inside a synchronous
save or a restore). Once a watched phase has run ``timeout`` plus a grace
period, it logs the rank, the phase and all stacks, and runs the ``on_hang``
action: by default it ends the process with :data:`HANG_EXIT_CODE`, so that
torchrun's agent restarts the group.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .layout import step_folder

__all__ = ["HANG_EXIT_CODE", "HangReport", "Watchdog", "all_stacks", "exit_on_hang", "hang_action"]

log = logging.getLogger("shardpoint")

HANG_EXIT_CODE = 124
"""Exit status of a process that the watchdog ends after a hang (``on_hang="exit"``)."""


@dataclass(frozen=True)
class HangReport:
    """What the watchdog saw: which rank is stuck, in which phase, for how long."""

    rank: int
    phase: str
    step: int | None
    seconds: float
    timeout: float
    stacks: str = field(default="", repr=False)

    def message(self) -> str:
        """One line naming the rank, the phase, the step folder and how long it has run."""
        at = "" if self.step is None else f" of {step_folder(self.step)}"
        return (
            f"rank {self.rank}: checkpoint phase {self.phase!r}{at} has not finished after "
            f"{self.seconds:.1f}s (timeout {self.timeout:g}s)"
        )


def all_stacks() -> str:
    """Every thread's current stack, each under its thread's name.

    Example::

        log.error("stuck; thread stacks:\\n%s", all_stacks())
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def exit_on_hang(report: HangReport) -> None:
    """The default ``on_hang`` action: say why on stderr, then end the process with :data:`HANG_EXIT_CODE`."""
    sys.stderr.write(f"shardpoint: {report.message()}; exiting with status {HANG_EXIT_CODE} so the agent can restart\n")
    sys.stderr.flush()
    os._exit(HANG_EXIT_CODE)


def hang_action(on_hang: str | Callable[[HangReport], None]) -> Callable[[HangReport], None]:
    """The callable for an ``on_hang`` argument: ``"exit"``, ``"log"`` (the watchdog logs anyway) or a callable.

    Example::

        hang_action("log")(report)  # does nothing more than the watchdog's own log line
    """
    if on_hang == "exit":
        return exit_on_hang
    if on_hang == "log":
        return lambda report: None
    return on_hang  # type: ignore[return-value]


class Watchdog:
    """One daemon thread that reports phases running past their deadline.

    The thread starts with the first :meth:`watch` and sleeps until the
    nearest deadline; a phase that finishes in time costs two lock
    acquisitions.

    Example::

        dog = Watchdog(rank=0, timeout=600, grace=60, on_hang=exit_on_hang)
        with dog.watch("restore:load", 300):
            ...
        dog.close(); dog.join()
    """

    def __init__(self, rank: int, timeout: float, grace: float, on_hang: Callable[[HangReport], None]):
        self.rank, self.timeout, self.grace, self.on_hang = rank, timeout, grace, on_hang
        self._cv = threading.Condition()
        self._active: dict[int, tuple[str, int | None, float, float]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def watch(self, phase: str, step: int | None) -> Iterator[None]:
        """Report ``phase`` (of ``step``) if it is still running ``timeout + grace`` seconds from now."""
        with self._cv:
            token = self._next
            self._next += 1
            start = time.monotonic()
            self._active[token] = (phase, step, start, start + self.timeout + self.grace)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="shardpoint-watchdog", daemon=True)
                self._thread.start()
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._active.pop(token, None)
                self._cv.notify()

    def close(self) -> None:
        """Stop the thread (it wakes at once); phases watched later are no longer reported."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def join(self) -> None:
        """Wait for the thread to notice :meth:`close` (it wakes at once)."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                due = [(t, v) for t, v in self._active.items() if v[3] <= now]
                for t, _ in due:
                    self._active.pop(t, None)
                if not due:
                    wait = min((v[3] for v in self._active.values()), default=now + 3600) - now
                    self._cv.wait(max(0.01, wait))
                    continue
            for _, (phase, step, start, _) in due:
                report = HangReport(self.rank, phase, step, time.monotonic() - start, self.timeout, all_stacks())
                log.error("%s; thread stacks:\n%s", report.message(), report.stacks)
                try:
                    self.on_hang(report)
                except Exception:  # noqa: BLE001 - a failing callback must not kill the watchdog
                    log.exception("on_hang callback failed")
