"""The manager's save in flight: its handle, lock token and deadline, and what to say when it stalls."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointTimeoutError
from ..runtime.progress import ACTIVITY
from .folders import step_folder

__all__ = ["PendingSave", "DoneHandle", "stalled_error", "wait_judging_progress"]

# What a rank is doing in each phase of a background save, for the stall message.
_PHASE_WORDS = {
    "snapshot": "copying the state into staging memory",
    "write": "this rank is still writing its data to storage",
    "commit": "this rank's data is written; waiting for other ranks' writes or the manifest",
}


@dataclass
class PendingSave:
    """A save the manager started and has not yet seen commit.

    ``lock`` is the step lock's token (rank 0 only); ``base``: an
    incremental save's :class:`~shardpoint.manager.incremental.BaseLease`;
    ``deadline`` is set at the first wait and pushed back after each stall
    so that a later wait waits once more.
    """

    step: int
    handle: Any
    start: float
    lock: bytes | None
    base: Any = None
    deadline: float | None = None

    def end(self, in_use: Any) -> None:
        """The save committed or failed: retention may delete its step's folder, and its base, again.

        Example::

            pending.end(in_use)
        """
        in_use.finish_writing(self.step)
        if self.base is not None:
            self.base.release()


class DoneHandle:
    """A synchronous save's result, shaped like an :class:`~shardpoint.AsyncSaveHandle`.

    Example::

        handle = DoneHandle(sp.save(path, state))
        handle.wait().bytes_written
    """

    phase = "done"

    def __init__(self, result):
        self.result = result
        self.path = getattr(result, "path", "")

    def done(self) -> bool:
        """Always true: the save returned."""
        return True

    def fence(self, timeout: float | None = None) -> None:
        """Nothing to wait for: the snapshot is long over."""
        return None

    def wait(self, timeout: float | None = None):
        """The save's result."""
        return self.result


def stalled_error(rank: int, pending: PendingSave, seconds: float, timeout: float | None) -> CheckpointTimeoutError:
    """The error for a background save not committed ``seconds`` after it started, naming the phase it is in."""
    phase = pending.handle.phase
    what = _PHASE_WORDS.get(phase, phase)
    return CheckpointTimeoutError(
        f"rank {rank}: save of {step_folder(pending.step)} stalled in phase {phase!r} ({what}): not "
        f"committed {seconds:.1f}s after it started (timeout {timeout}s). wait() again to keep "
        "waiting, or restart the job",
        rank, phase, pending.step, seconds,
    )


def wait_judging_progress(handle: Any, left: float | None, timeout: float | None) -> Any:
    """``handle.wait()``, raising ``TimeoutError`` only once ``left`` seconds have passed *and* no
    checkpoint work moved (no bytes, no phase) for ``timeout`` seconds: a slow save that keeps
    writing is waited for.

    Example::

        wait_judging_progress(handle, left=600.0, timeout=600.0)
    """
    if left is None:
        return handle.wait()
    start = time.monotonic()
    deadline, quiet = start + left, float(timeout or 0.0)
    poll = max(0.05, min(5.0, (quiet or left or 1.0) / 10))
    seen, moved = ACTIVITY.snapshot(), start
    while True:
        now = time.monotonic()
        end = max(deadline, moved + quiet)
        if now >= end:
            raise TimeoutError(f"save to {handle.path} made no progress for {now - moved:.1f}s")
        try:
            return handle.wait(timeout=min(poll, end - now))
        except TimeoutError:
            snap = ACTIVITY.snapshot()
            if snap != seen:
                seen, moved = snap, time.monotonic()
