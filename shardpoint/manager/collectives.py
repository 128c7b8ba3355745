"""The manager's collectives: a private gloo group with a timeout, the watchdog and the fault hook.

Every collective phase of the manager runs through :meth:`Collectives.run`,
which turns a process-group timeout into :class:`CheckpointTimeoutError` and a
dead peer into :class:`DistributedError`, each naming the rank, phase and
step. After a timeout the group is unusable, so the manager refuses further
work (:attr:`Collectives.broken`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..dist import Comm, destroy_private_group, private_group
from ..errors import CheckpointError, CheckpointTimeoutError, DistributedError
from .faults import FaultHook
from .folders import step_folder
from .watchdog import HangReport, Watchdog, hang_action, raises_on_hang

__all__ = ["Collectives", "is_timeout", "is_comm_failure"]


def is_timeout(e: BaseException) -> bool:
    """Whether an error's message says it timed out."""
    s = str(e).lower()
    return "timed out" in s or "timeout" in s


def is_comm_failure(e: BaseException) -> bool:
    """Whether a RuntimeError comes from the process group (a dead or stuck peer)."""
    s = str(e).lower()
    return is_timeout(e) or any(w in s for w in ("gloo", "connection", "c10d", "nccl", "peer", "socket", "broken pipe"))


class Collectives:
    """The group, watchdog and fault hook of one manager; both are created on first use.

    Example::

        coll = Collectives(None, timeout=600, hang_grace=60, on_hang="auto", fault=None)
        with coll.watch("decide", 100):
            coll.run("decide", 100, lambda: coll.comm().broadcast(flag))
        coll.end()
    """

    def __init__(
        self,
        process_group: Any,
        timeout: float | None,
        hang_grace: float,
        on_hang: str | Callable[[HangReport], None],
        fault: FaultHook | None,
    ):
        self.process_group = process_group
        self.timeout = timeout
        self.hang_grace = hang_grace
        self.on_hang = on_hang
        self.fault = fault
        # The phase (and step) that timed out; the group is unusable after it.
        self.broken: str | None = None
        self._comm: Comm | None = None
        self._own = False
        self._watchdog: Watchdog | None = None

    @property
    def ready(self) -> bool:
        """Whether the private group exists (made on first use, or by pre-warming)."""
        return self._comm is not None

    def comm(self) -> Comm:
        """The manager's private group over ``process_group`` (created on first use)."""
        if self._comm is None:
            # A private gloo group: its timeout bounds every manager collective.
            base = Comm.resolve(self.process_group)
            self._comm = private_group(base, self.timeout)
            self._own = self._comm is not base
        return self._comm

    def group(self) -> Any:
        """The process group to hand to ``save``/``load``; ``None`` in a world of one."""
        c = self.comm()
        return c.group if c.active else None

    def hook(self, phase: str, step: int | None) -> None:
        """Call the fault hook, if any, as ``phase`` of ``step`` starts."""
        if self.fault is not None:
            self.fault(phase, step, self.comm().rank)

    @contextmanager
    def watch(self, phase: str, step: int | None) -> Iterator[None]:
        """Let the watchdog report ``phase`` if it makes no progress for ``timeout + hang_grace`` seconds.

        A phase reported under ``on_hang="raise"`` raises :class:`CheckpointTimeoutError`
        when it returns, and the manager is then unusable (:attr:`broken`).
        """
        if self.timeout is None:
            yield
            return
        if self._watchdog is None:
            self._watchdog = Watchdog(
                self.comm().rank, self.timeout, self.hang_grace, hang_action(self.on_hang), raises_on_hang(self.on_hang)
            )
        try:
            with self._watchdog.watch(phase, step):
                yield
        except CheckpointTimeoutError as e:
            if self.broken is None and e.phase == phase:
                self.broken = f"{phase}{'' if step is None else ' of ' + step_folder(step)}"
            raise

    def run(self, phase: str, step: int | None, fn: Callable[[], Any]) -> Any:
        """Run a collective; turn a process-group timeout or a dead peer into a typed error."""
        t0 = time.monotonic()
        try:
            return fn()
        except CheckpointError as e:
            if isinstance(e, DistributedError) and is_timeout(e):
                self._timed_out(phase, step, time.monotonic() - t0, e)
            raise
        except RuntimeError as e:
            if not is_comm_failure(e):
                raise
            rank = self.comm().rank
            if is_timeout(e):
                self._timed_out(phase, step, time.monotonic() - t0, e)
            raise DistributedError(
                f"rank {rank}: checkpoint phase {phase!r}"
                f"{'' if step is None else ' of ' + step_folder(step)} failed in a collective "
                f"(a peer rank died or left?): {e}",
                {rank: str(e)},
            ) from e

    def _timed_out(self, phase: str, step: int | None, seconds: float, cause: BaseException) -> None:
        rank = self.comm().rank
        at = "" if step is None else f" of {step_folder(step)}"
        msg = (
            f"rank {rank}: checkpoint phase {phase!r}{at} timed out after {seconds:.1f}s "
            f"(timeout {self.timeout}s); another rank is stuck or gone: {cause}"
        )
        self.broken = f"{phase}{at}"
        raise CheckpointTimeoutError(msg, rank, phase, step, seconds) from cause

    def stop_watchdog(self, join: bool = False) -> None:
        """Stop the watchdog thread, and with ``join`` wait for it to end."""
        if self._watchdog is not None:
            self._watchdog.close()
            if join:
                self._watchdog.join()

    def release_group(self) -> None:
        """Destroy the private group if this object created it (local; run before interpreter exit)."""
        comm, self._comm = self._comm, None
        if comm is not None and self._own:
            destroy_private_group(comm)
        self._own = False
