"""The handle of one in-flight asynchronous save (see :mod:`shardpoint.saving.async_save`).

The save transaction tells it what happens through its methods
(:meth:`~AsyncSaveHandle.attach_storage`, :meth:`~AsyncSaveHandle.add_future`,
:meth:`~AsyncSaveHandle.mark_copied`, :meth:`~AsyncSaveHandle.fail`...); the
training loop waits on it, fences on it before mutating the state, or polls it.

The *fence* is the first of ``fence()``, an optimizer step pre-hook,
``done()`` once the copy is complete, and ``wait()``. A lazy save's guard
(:class:`~shardpoint.engine.snapshot_guard.SnapshotGuard`) is checked there,
and the background writer commits only after it: a tensor changed before the
fence fails the save with :class:`~shardpoint.errors.TornSnapshotError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import weakref
from typing import Any

from .steps import SaveResult
from ..engine.snapshot_guard import SnapshotGuard
from ..errors import DistributedError, TornSnapshotError
from ..runtime.progress import follow

__all__ = ["AsyncSaveHandle"]

_exiting = threading.Event()
_waiting: weakref.WeakSet = weakref.WeakSet()  # handles whose writer waits for the fence
_waiting_lock = threading.Lock()


def _at_exit() -> None:
    # At exit the loop can change nothing more: writers still waiting for a fence check it now.
    _exiting.set()
    with _waiting_lock:
        handles = list(_waiting)
    for h in handles:
        h.wake_at_exit()


# Threading's exit hooks run before the executors join their threads, so a writer
# waiting for a fence wakes up instead of hanging the exit.
getattr(threading, "_register_atexit", lambda fn: None)(_at_exit)


class AsyncSaveHandle:
    """One in-flight asynchronous save.

    ``wait()`` returns the :class:`SaveResult` once the checkpoint is durable
    and committed, or raises the background error (the same typed error on
    every rank). ``done()`` never blocks. ``fence()`` waits only for the
    snapshot copy, after which the state may be mutated.
    """

    def __init__(self, path: str, result: SaveResult, device: Any = None):
        self.path = path
        self.result = result
        self._device = device  # the saver's Device: how a step is ordered after the copy
        self._queued = threading.Event()  # every lazy copy is queued; _copy_event completes them
        self._copy_event: Any = None
        self._copied = threading.Event()
        self._written = threading.Event()
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._copy_error: BaseException | None = None
        self._futures: list[cf.Future] = []
        self._later: list[cf.Future] = []  # the writer, when another worker submits it
        self._later_ready = threading.Event()
        self._later_ready.set()
        self._hooks: list[Any] = []
        self._reported = False
        self._storage: Any = None
        self._guard: SnapshotGuard | None = None
        self._fenced = threading.Event()
        self._fenced.set()
        self._wake = threading.Event()  # the fence passed, or the interpreter is exiting
        self._fence_lock = threading.Lock()
        self._torn: TornSnapshotError | None = None

    def attach_storage(self, storage: Any) -> None:
        """Remember the storage written, for ``wait(tier=...)``.

        Example::

            handle.attach_storage(storage_for("ckpt/step_100"))
        """
        self._storage = storage

    def add_future(self, future: cf.Future) -> None:
        """A worker's job that :meth:`wait` waits for (submitted from the training thread).

        Example::

            handle.add_future(pool.submit(job))
        """
        self._futures.append(future)

    def expect_writer(self) -> None:
        """The writer will be submitted by another worker; :meth:`wait` waits until it is.

        Example::

            handle.expect_writer(); handle.add_future(pool.submit(copier))
        """
        self._later_ready.clear()

    def writer_started(self, future: cf.Future) -> None:
        """The writer announced by :meth:`expect_writer` was submitted, as ``future``.

        Example::

            handle.writer_started(pool.submit(writer))
        """
        self._later.append(future)
        self._later_ready.set()

    def add_hook(self, hook: Any) -> None:
        """A removable hook (a step pre-hook) that :meth:`wait` removes.

        Example::

            handle.add_hook(opt.register_step_pre_hook(handle.step_pre_hook))
        """
        self._hooks.append(hook)

    def mark_copied(self) -> None:
        """Every snapshot copy is complete (or failed): the fence may pass.

        Example::

            handle.mark_copied()
        """
        self._copied.set()

    def mark_written(self) -> None:
        """This rank's data is written; the commit runs next.

        Example::

            handle.mark_written()
        """
        self._written.set()

    def fail(self, error: BaseException) -> None:
        """The save failed with ``error``; :meth:`wait` raises it.

        Example::

            handle.fail(DistributedError("rank 1 failed", {}))
        """
        self._error = error

    def finish(self) -> None:
        """The save committed or failed: nothing more happens in the background.

        Example::

            handle.finish()
        """
        self._copied.set()
        self._finished.set()

    @property
    def reported(self) -> bool:
        """True once :meth:`wait` raised this save's error to the caller."""
        return self._reported

    def guard(self, guard: SnapshotGuard | None) -> None:
        """Check ``guard`` at the fence, and hold the commit until then (the saver calls this).

        Example::

            handle.guard(SnapshotGuard.record([("model.weight", model.weight)]))
        """
        if guard is None or not len(guard):
            return
        self._guard = guard
        self._fenced.clear()

    def _check_fence(self) -> None:
        with self._fence_lock:
            if self._fenced.is_set():
                return
            guard, self._guard = self._guard, None
            self._torn = guard.check(self.path) if guard is not None else None
            self._fenced.set()
            self._wake.set()

    def wait_for_fence(self) -> TornSnapshotError | None:
        """Block until the fence (the saver's writer calls this before committing); return the guard's verdict.

        At interpreter exit the loop can change nothing more, so the guard is
        checked then instead of waiting for a fence that will never come.

        Example::

            err = handle.wait_for_fence()
        """
        if not self._fenced.is_set():
            with _waiting_lock:
                _waiting.add(self)
            try:
                if not _exiting.is_set():  # else the exit hook already ran: no wake-up will come
                    self._wake.wait()
            finally:
                with _waiting_lock:
                    _waiting.discard(self)
        if not self._fenced.is_set():  # woken by the exit
            self._copied.wait()
            self._check_fence()
        return self._torn

    def wake_at_exit(self) -> None:
        """The interpreter is exiting: a writer waiting for the fence stops waiting and checks it.

        Example::

            handle.wake_at_exit()
        """
        self._wake.set()

    @property
    def fenced(self) -> bool:
        """True once the fence has been passed (always true for an eager save)."""
        return self._fenced.is_set()

    @property
    def finished_event(self) -> threading.Event:
        """An event set once the save has committed or failed (for waiting on it from elsewhere).

        Example::

            handle.finished_event.wait(10.0)
        """
        return self._finished

    def done(self) -> bool:
        """True once the save has committed or failed (non-blocking).

        Once the snapshot copy is complete, the first call is also the fence:
        a lazy save's state may change after it.
        """
        if not self._fenced.is_set() and self._copied.is_set():
            self._check_fence()
        return self._finished.is_set()

    @property
    def phase(self) -> str:
        """Where this rank's save is: ``snapshot``, ``write``, ``commit`` or ``done``."""
        if self._finished.is_set():
            return "done"
        if not self._copied.is_set():
            return "snapshot"
        return "commit" if self._written.is_set() else "write"

    def fence(self, timeout: float | None = None) -> None:
        """Block until the snapshot copy is complete; the state may then change.

        A lazy save checks here that nothing it copies changed since the call;
        if something did, the save fails in :meth:`wait` with
        :class:`~shardpoint.errors.TornSnapshotError` and commits nothing.
        """
        if not self._copied.wait(timeout):
            raise TimeoutError(f"snapshot of {self.path} not finished within {timeout}s")
        self._check_fence()

    def copies_queued(self, event: Any) -> None:
        """Told by the saver: every snapshot copy is queued, and ``event`` completes them all.

        Example::

            handle.copies_queued(staged.last_event)
        """
        self._copy_event = event
        self._queued.set()

    def step_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer step pre-hook of a lazy save: :meth:`before_step`.

        Example::

            opt.register_step_pre_hook(handle.step_pre_hook)
        """
        self.before_step()

    def before_step(self) -> None:
        """The lazy save's optimizer step pre-hook: the step's updates run only after the snapshot copy.

        On an asynchronous device the step's work waits for the copy's event
        on the device: the host waits only until every copy is queued (not
        run), then goes on. Elsewhere this is :meth:`fence`.

        Example::

            opt.register_step_pre_hook(lambda *a, **k: handle.before_step())
        """
        dev = self._device
        if dev is None or not dev.asynchronous:
            return self.fence()
        self._queued.wait()
        if self._copy_event is None:
            return self.fence()
        dev.order_after(self._copy_event)
        self._check_fence()  # the step has not run yet: the state is still the call's, or the save fails

    def wait(self, timeout: float | None = None, tier: str | int | None = None, progress: bool = False) -> SaveResult:
        """Block until durable and committed; raise the background failure if any.

        With a :class:`~shardpoint.storage.tiers.TieredStorage`, ``tier`` also
        waits until the checkpoint is committed on that (slower) tier.
        ``progress=True`` shows the bytes written while it waits (rank 0).
        """
        with follow(progress, self.result.recorder, f"save {self.path}"):
            return self._wait(timeout, tier)

    def _wait(self, timeout: float | None, tier: str | int | None) -> SaveResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.fence(timeout)
        if not self._later_ready.wait(timeout):  # the writer, submitted by the copier's thread
            raise TimeoutError(f"save to {self.path} still running after {timeout}s")
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        _, pending = cf.wait(self._futures + self._later, left)
        if pending:
            raise TimeoutError(f"save to {self.path} still running after {timeout}s")
        self._remove_hooks()
        if not self._finished.is_set():
            # Every worker exited but none reported: a worker died without a trace.
            raise DistributedError(f"background save to {self.path} ended without a result", {})
        if self._error is not None:
            self._reported = True
            raise self._error
        if tier is not None:
            if self._storage is None or not self._storage.tiered:
                raise ValueError(f"{self.path} is not tiered storage; wait(tier=...) needs a TieredStorage")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._storage.wait(tier, left)
        return self.result

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
