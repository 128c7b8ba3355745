"""The hang watchdog: report checkpoint phases that stop making progress, with every thread's stack.

Manager collectives and background saves time out by themselves; the
watchdog backs up what cannot (a storage write stuck inside a synchronous
save or a restore). It judges progress, never the clock alone: a phase is
hung once *no* checkpoint work (no bytes moved, no phase entered, as counted
by :data:`shardpoint.runtime.progress.ACTIVITY`) has happened for ``timeout`` plus a
grace period. A phase that keeps moving bytes, however slowly, is never
reported. A hung phase is logged with the rank, the phase and all stacks, and
the ``on_hang`` action runs:

- ``"auto"`` (the default): ``"exit"`` under torchrun (``TORCHELASTIC_RUN_ID``
  or ``LOCAL_RANK`` set), whose agent restarts the group, and ``"raise"`` in
  a plain process (a notebook, a script);
- ``"exit"``: log the reason and end the process with :data:`HANG_EXIT_CODE`;
- ``"raise"``: the phase raises :class:`~shardpoint.CheckpointTimeoutError`
  when it returns, and the manager refuses further work;
- ``"log"``, or a callable taking the :class:`HangReport`.
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

from ..errors import CheckpointTimeoutError
from ..runtime.progress import ACTIVITY
from .folders import step_folder

__all__ = [
    "HANG_EXIT_CODE", "HangReport", "Watchdog", "all_stacks", "exit_on_hang", "hang_action", "under_torchrun",
    "raises_on_hang",
]

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
        """One line naming the rank, the phase, the step folder and how long it made no progress."""
        at = "" if self.step is None else f" of {step_folder(self.step)}"
        return (
            f"rank {self.rank}: checkpoint phase {self.phase!r}{at} made no progress (no bytes moved, no "
            f"phase entered) for {self.seconds:.1f}s (timeout {self.timeout:g}s)"
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


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another elastic agent that restarts it).

    Example::

        under_torchrun()  # True when TORCHELASTIC_RUN_ID or LOCAL_RANK is set
    """
    return bool(os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_RANK"))


def exit_on_hang(report: HangReport) -> None:
    """The ``"exit"`` action: log and print why, then end the process with :data:`HANG_EXIT_CODE`.

    Example::

        Watchdog(rank=0, timeout=600, grace=60, on_hang=exit_on_hang)
    """
    why = (
        f"{report.message()}; exiting with status {HANG_EXIT_CODE} so that the agent restarts the group "
        f"(on_hang='exit', or 'auto' under torchrun: TORCHELASTIC_RUN_ID={os.environ.get('TORCHELASTIC_RUN_ID')!r}, "
        f"LOCAL_RANK={os.environ.get('LOCAL_RANK')!r})"
    )
    log.critical("%s", why)
    sys.stderr.write(f"shardpoint: {why}\n")
    sys.stderr.flush()
    os._exit(HANG_EXIT_CODE)


def raises_on_hang(on_hang: str | Callable[[HangReport], None]) -> bool:
    """Whether a hung phase raises :class:`~shardpoint.CheckpointTimeoutError` once it returns.

    Example::

        raises_on_hang("auto")  # True outside torchrun
    """
    return on_hang == "raise" or (on_hang == "auto" and not under_torchrun())


def hang_action(on_hang: str | Callable[[HangReport], None]) -> Callable[[HangReport], None]:
    """The callable for an ``on_hang`` argument: ``"auto"``, ``"exit"``, ``"raise"``, ``"log"`` or a callable.

    ``"raise"`` (and ``"auto"`` outside torchrun) does nothing here: the
    watchdog logs, and the phase raises when it returns (:func:`raises_on_hang`).

    Example::

        hang_action("log")(report)  # does nothing more than the watchdog's own log line
    """
    if on_hang == "exit" or (on_hang == "auto" and under_torchrun()):
        return exit_on_hang
    if on_hang in ("log", "raise", "auto"):
        return lambda report: None
    return on_hang  # type: ignore[return-value]


class Watchdog:
    """One daemon thread that reports phases making no progress for ``timeout + grace`` seconds.

    The thread starts with the first :meth:`watch` and wakes a few times per
    timeout to compare :data:`~shardpoint.runtime.progress.ACTIVITY` with what it saw
    before; while checkpoint work moves, no phase is reported. With
    ``raises`` a reported phase raises :class:`~shardpoint.CheckpointTimeoutError`
    when it returns.

    Example::

        dog = Watchdog(rank=0, timeout=600, grace=60, on_hang=exit_on_hang)
        with dog.watch("restore:load", 300):
            ...
        dog.close(); dog.join()
    """

    def __init__(self, rank: int, timeout: float, grace: float, on_hang: Callable[[HangReport], None], raises: bool = False):
        self.rank, self.timeout, self.grace, self.on_hang, self.raises = rank, timeout, grace, on_hang, raises
        self._cv = threading.Condition()
        # token -> [phase, step, start, last progress]
        self._active: dict[int, list] = {}
        self._hung: dict[int, HangReport] = {}
        self._seen = ACTIVITY.snapshot()
        self._next = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def limit(self) -> float:
        """Seconds without progress after which a phase is hung."""
        return self.timeout + self.grace

    @contextmanager
    def watch(self, phase: str, step: int | None) -> Iterator[None]:
        """Report ``phase`` (of ``step``) if it makes no progress for ``timeout + grace`` seconds."""
        ACTIVITY.note()  # entering a phase is progress
        with self._cv:
            token = self._next
            self._next += 1
            start = time.monotonic()
            self._active[token] = [phase, step, start, start]
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="shardpoint-watchdog", daemon=True)
                self._thread.start()
            self._cv.notify()
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._cv:
                self._active.pop(token, None)
                report = self._hung.pop(token, None)
                self._cv.notify()
        if ok and report is not None and self.raises:
            raise CheckpointTimeoutError(
                f"{report.message()}; the phase has returned since, but the manager now refuses further work: "
                "restart the job (pass on_hang='log' to only log hangs)",
                report.rank, report.phase, report.step, report.seconds,
            )

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

    def _due(self) -> list[tuple[int, list]]:
        """Under the lock: the phases without progress for the limit; moves everyone's mark on progress."""
        now = time.monotonic()
        snap = ACTIVITY.snapshot()
        if snap != self._seen:
            self._seen = snap
            for v in self._active.values():
                v[3] = now
        due = [(t, v) for t, v in self._active.items() if now - v[3] >= self.limit and t not in self._hung]
        return due

    def _run(self) -> None:
        poll = max(0.01, min(30.0, self.limit / 8))
        while True:
            with self._cv:
                if self._closed:
                    return
                due = self._due()
                for t, (phase, step, start, last) in due:
                    self._hung[t] = HangReport(self.rank, phase, step, time.monotonic() - last, self.timeout, all_stacks())
                if not due:
                    self._cv.wait(poll)
                    continue
                reports = [self._hung[t] for t, _ in due]
            for report in reports:
                log.error("%s; thread stacks:\n%s", report.message(), report.stacks)
                try:
                    self.on_hang(report)
                except Exception:  # noqa: BLE001 - a failing callback must not kill the watchdog
                    log.exception("on_hang callback failed")
