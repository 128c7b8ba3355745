"""The handle of one in-flight asynchronous save (see :mod:`shardpoint.saving.async_save`).

The handle is a state machine: one :class:`~shardpoint.saving.phases.SavePhase`
held under one :class:`threading.Condition`, moved forward by one method per
transition (:meth:`~AsyncSaveHandle.copies_queued`,
:meth:`~AsyncSaveHandle.mark_copied`, the fence, :meth:`~AsyncSaveHandle.mark_written`,
:meth:`~AsyncSaveHandle.finish`), each checked against the table in
:mod:`~shardpoint.saving.phases`. Every wait is a ``wait_for`` on that
condition. The training loop waits on the handle, fences on it before
mutating the state, or polls it.

The *fence* is the first of ``fence()``, an optimizer step pre-hook,
``done()`` once the copy is complete, and ``wait()``. A lazy save's guard
(:class:`~shardpoint.engine.snapshot_guard.SnapshotGuard`) gives its
verdict there, and the writer's commit runs only after it: a tensor changed
before the fence fails the save with :class:`~shardpoint.errors.TornSnapshotError`.
On an asynchronous device the verdict's sampled comparisons are queued on
the device at the fence and read by the thread that commits, just before
the commit, so the training thread never waits for the device at the fence.
The writer does not wait for the fence on a worker: it leaves its commit
with the handle (:meth:`~AsyncSaveHandle.commit_after_fence`), which hands
it to the saver's pool when the fence passes. A save left waiting for a
fence when the interpreter exits is fenced by the exit hook below and
commits then, on the exiting thread.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import os
import threading
import time
from typing import Any, Callable

from .phases import SavePhase, advance
from .steps import SaveResult
from ..engine.snapshot_guard import SnapshotGuard, Verdict
from ..errors import DistributedError, TornSnapshotError
from ..runtime.progress import follow

__all__ = ["AsyncSaveHandle", "SavePhase"]

log = logging.getLogger("shardpoint")

# Process-wide by necessity: saves whose commit waits for a fence, which the
# exit hook must find once the training loop can no longer bring it.
_awaiting: set["AsyncSaveHandle"] = set()
_awaiting_lock = threading.Lock()


def _fence_at_exit() -> None:
    # At exit the loop can change nothing more: the fence passes now and the commit runs.
    # atexit hooks run after the thread pools joined their workers; a save waiting for
    # its fence holds none (its commit waits here), so the exit never hangs on it.
    with _awaiting_lock:
        handles = list(_awaiting)
    for h in handles:
        try:
            h.fence()
        except Exception as e:  # noqa: BLE001 - exiting anyway; never turn an exit into a crash
            log.warning("shardpoint: a save waiting for its fence failed at exit: %s", e)


atexit.register(_fence_at_exit)
# A forked child does not own its parent's saves (their workers are not in it).
os.register_at_fork(after_in_child=_awaiting.clear)


class AsyncSaveHandle:
    """One in-flight asynchronous save.

    ``wait()`` returns the :class:`SaveResult` once the checkpoint is durable
    and committed, or raises the background error (the same typed error on
    every rank). ``done()`` never blocks. ``fence()`` waits only for the
    snapshot copy, after which the state may be mutated. ``state`` is the
    :class:`~shardpoint.saving.phases.SavePhase` this rank's save is in.

    Example::

        h = saver.save("ckpt/step_200", state, mode="lazy")
        h.fence()  # the state may change now
        h.wait()
    """

    def __init__(self, path: str, result: SaveResult, device: Any = None):
        self.path = path
        self.result = result
        self._device = device  # the saver's Device: how a step is ordered after the copy
        self._pool: Any = None  # unguarded, these four: set before the workers start, or by the waiting thread
        self._hooks: list[Any] = []
        self._reported = False
        self._storage: Any = None
        self._cond = threading.Condition()  # guards every field below; notified on every change
        self._phase = SavePhase.COPYING
        self._seen = {SavePhase.COPYING}
        self._finished = threading.Event()  # finished_event: set by finish() alone
        self._error: BaseException | None = None
        self._jobs = 0  # background work that may still report: running futures, an announced writer, a waiting commit
        self._copy_event: Any = None  # completes every lazy copy (on an asynchronous device)
        self._guard: SnapshotGuard | None = None  # judged at the fence; None once judged
        self._guarded = False
        self._verdict: Verdict | None = None  # the guard's verdict, taken at the fence; read by the commit
        self._rest: Callable[[TornSnapshotError | None], None] | None = None  # the commit waiting for the fence
        self._queue_rest: Callable[[], Any] | None = None  # queues the lazy copies not queued yet; their last event

    # --- what the save transaction tells the handle -----------------------------------------------

    def attach_storage(self, storage: Any) -> None:
        """Remember the storage written, for ``wait(tier=...)``.

        Example::

            handle.attach_storage(storage_for("ckpt/step_100"))
        """
        self._storage = storage

    def use_pool(self, pool: cf.Executor) -> None:
        """The saver's workers: a commit left waiting for the fence runs there once it passes.

        Example::

            handle.use_pool(pool)
        """
        self._pool = pool

    def add_future(self, future: cf.Future) -> None:
        """A worker's job that :meth:`wait` waits for (submitted from the training thread).

        Example::

            handle.add_future(pool.submit(job))
        """
        with self._cond:
            self._jobs += 1
        future.add_done_callback(self._job_done)

    def expect_writer(self) -> None:
        """The writer will be submitted by another worker; :meth:`wait` waits until it is, and for it.

        Example::

            handle.expect_writer(); handle.add_future(pool.submit(copier))
        """
        with self._cond:
            self._jobs += 1

    def writer_started(self, future: cf.Future) -> None:
        """The writer announced by :meth:`expect_writer` was submitted, as ``future``.

        Example::

            handle.writer_started(pool.submit(writer))
        """
        self.add_future(future)
        self._job_done()

    def add_hook(self, hook: Any) -> None:
        """A removable hook (a step pre-hook) that :meth:`wait` removes.

        Example::

            handle.add_hook(opt.register_step_pre_hook(handle.step_pre_hook))
        """
        self._hooks.append(hook)

    def queue_copies_with(self, queue_rest: Callable[[], Any]) -> None:
        """How the step pre-hook queues, itself, the lazy copies the copier has not queued yet.

        ``queue_rest()`` queues them on the calling thread and returns the event
        completing every lazy copy (None: none); set before the hook is added.

        Example::

            handle.queue_copies_with(lambda: write.last_event)
        """
        self._queue_rest = queue_rest

    def guard(self, guard: SnapshotGuard | None) -> None:
        """Check ``guard`` at the fence, and hold the commit until then (the saver calls this).

        Example::

            handle.guard(SnapshotGuard.record([("model.weight", model.weight)]))
        """
        if guard is None or not len(guard):
            return
        with self._cond:
            self._guard, self._guarded = guard, True

    # --- transitions: one method each -------------------------------------------------------------

    def copies_queued(self, event: Any) -> None:
        """Every lazy snapshot copy is queued, and ``event`` completes them all: QUEUED.

        Example::

            handle.copies_queued(staged.last_event)
        """
        with self._cond:
            self._copy_event = event
            self._move(SavePhase.QUEUED)

    def mark_copied(self) -> None:
        """Every snapshot copy is complete (or failed): COPIED, and the fence may pass.

        Example::

            handle.mark_copied()
        """
        with self._cond:
            self._move(SavePhase.COPIED)
            rest = self._enter_fenced()  # the guard's verdict may already be in (asynchronous device)
        self._resume(rest)

    def _enter_fenced(self) -> Callable[[], None] | None:
        """FENCED, once the copies are complete and the guard's verdict is taken; returns the commit to run.

        Called with the condition held, by whichever of the two came last.
        The verdict may still be computed on the device: the commit reads it.
        """
        if not (self._guarded and self._verdict is not None and self._phase is SavePhase.COPIED):
            return None
        self._move(SavePhase.FENCED)
        return self._take_rest()

    def mark_written(self) -> None:
        """This rank's write phase ended (its data is written, or it failed): WRITTEN; the commit runs next.

        Example::

            handle.mark_written()
        """
        with self._cond:
            self._move(SavePhase.WRITTEN)

    def fail(self, error: BaseException) -> None:
        """The save failed with ``error``: :meth:`finish` ends it FAILED and :meth:`wait` raises it.

        Example::

            handle.fail(DistributedError("rank 1 failed", {}))
        """
        with self._cond:
            self._error = error

    def finish(self) -> None:
        """The commit is over: COMMITTED, or FAILED after :meth:`fail`; nothing more happens in the background.

        Example::

            handle.finish()
        """
        with self._cond:
            self._move(SavePhase.FAILED if self._error is not None else SavePhase.COMMITTED)
            self._finished.set()

    def _move(self, to: SavePhase) -> None:
        # Every phase change goes through here, with the condition held.
        self._phase = advance(self._phase, self._seen, to, self.path)
        self._seen.add(to)
        self._cond.notify_all()

    # --- the fence ----------------------------------------------------------------------------------

    def commit_after_fence(self, commit: Callable[[TornSnapshotError | None], None]) -> None:
        """Run ``commit(torn)`` once the fence has passed (``torn``: the guard's verdict, read); the writer calls this.

        Runs it now, on the calling thread, when the save has no fence or it
        has passed; otherwise the thread that passes the fence hands it to
        the pool of :meth:`use_pool` (or runs it, once the pool takes no more
        work: the interpreter is exiting). No worker waits for the fence.
        The verdict is read right before ``commit``, on the thread that runs
        it: there the wait for a comparison queued on the device happens,
        never on the thread that passed the fence.

        Example::

            handle.commit_after_fence(lambda torn: commit(torn))
        """
        with self._cond:
            if self._guarded and self._phase.order < SavePhase.FENCED.order:
                self._rest = commit
                self._jobs += 1
                with _awaiting_lock:
                    _awaiting.add(self)
                return
            verdict = self._verdict
        commit(_read(verdict))

    def _take_rest(self) -> Callable[[], None] | None:
        rest, self._rest = self._rest, None
        if rest is None:
            return None
        with _awaiting_lock:
            _awaiting.discard(self)
        verdict = self._verdict

        def run() -> None:
            try:
                rest(_read(verdict))
            finally:
                self._job_done()

        return run

    def _resume(self, run: Callable[[], None] | None) -> None:
        if run is None:
            return
        if self._pool is not None:
            try:
                self._pool.submit(run)
                return
            except RuntimeError:  # "cannot schedule new futures after interpreter shutdown": run it here
                pass
        run()

    def _check_fence(self) -> None:
        """The fence: take the guard's verdict (once) and, if the copies are complete, enter FENCED.

        The verdict is taken, not read: on an asynchronous device its sampled
        comparisons are queued there, and the thread passing the fence never
        waits for the device (see :meth:`SnapshotGuard.judge`).
        """
        with self._cond:
            guard, self._guard = self._guard, None
            if guard is None:
                return
            try:
                self._verdict = guard.judge(self.path)
            except Exception as e:  # noqa: BLE001 - the save fails at its commit; the loop goes on
                self._verdict = Verdict(self.path, failure=e)
            rest = self._enter_fenced()
        self._resume(rest)

    def _copies_over(self) -> bool:
        return self._phase.order >= SavePhase.COPIED.order

    @property
    def fenced(self) -> bool:
        """True once the fence has been passed (always true for an eager save)."""
        with self._cond:
            return self._guard is None

    def fence(self, timeout: float | None = None) -> None:
        """Block until the snapshot copy is complete; the state may then change.

        A lazy save checks here that nothing it copies changed since the call;
        if something did, the save fails in :meth:`wait` with
        :class:`~shardpoint.errors.TornSnapshotError` and commits nothing.
        """
        with self._cond:
            if not self._cond.wait_for(self._copies_over, timeout):
                raise TimeoutError(f"snapshot of {self.path} not finished within {timeout}s")
        self._check_fence()

    def step_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer step pre-hook of a lazy save: :meth:`before_step`.

        Example::

            opt.register_step_pre_hook(handle.step_pre_hook)
        """
        self.before_step()

    def before_step(self) -> None:
        """The lazy save's optimizer step pre-hook: the step's updates run only after the snapshot copy.

        On an asynchronous device the order is expressed with events only:
        copies the copier has not queued yet are queued here, on the calling
        thread (queuing a copy costs microseconds; the copier, a lower
        priority thread, may not have run), the step's work waits for the
        last copy's event on the device, and the host goes on. The guard's
        verdict is taken there without waiting for the device (its
        comparisons are queued on it and read by the writer before the
        commit); the save is FENCED once the copies complete. The host waits
        only where the state is larger than the staging ring, for the space
        the writer frees. Elsewhere this is :meth:`fence`: the copies are
        complete before the step.

        Example::

            opt.register_step_pre_hook(lambda *a, **k: handle.before_step())
        """
        dev = self._device
        if dev is None or not dev.asynchronous:
            return self.fence()
        with self._cond:
            queued, event = self._phase.order >= SavePhase.QUEUED.order, self._copy_event
        if not queued and self._queue_rest is not None:
            event = self._queue_rest()
        elif not queued:  # no way to queue them here: wait until the copier has
            with self._cond:
                self._cond.wait_for(lambda: self._phase.order >= SavePhase.QUEUED.order)
                event = self._copy_event
        if event is None:
            return self.fence()
        dev.order_after(event)
        self._check_fence()  # the step has not run yet: the state is still the call's, or the save fails

    # --- what the training loop sees --------------------------------------------------------------

    @property
    def state(self) -> SavePhase:
        """The :class:`~shardpoint.saving.phases.SavePhase` this rank's save is in (non-blocking).

        Example::

            if handle.state is sp.saving.handle.SavePhase.FENCED: print("committing")
        """
        with self._cond:
            return self._phase

    @property
    def phase(self) -> str:
        """Where this rank's save is: ``snapshot``, ``write``, ``commit`` or ``done``."""
        return _PHASE_NAMES[self.state]

    @property
    def reported(self) -> bool:
        """True once :meth:`wait` raised this save's error to the caller."""
        return self._reported

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
        with self._cond:
            phase, pending = self._phase, self._guard is not None
        if pending and phase.order >= SavePhase.COPIED.order:
            self._check_fence()
            phase = self.state
        return phase.terminal

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
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with self._cond:  # every worker has returned (the ring is free again), and the commit ran
            if not self._cond.wait_for(lambda: self._jobs == 0, left):
                raise TimeoutError(f"save to {self.path} still running after {timeout}s")
            phase, error = self._phase, self._error
        self._remove_hooks()
        if not phase.terminal:
            # Every worker exited but none reported: a worker died without a trace.
            raise DistributedError(f"background save to {self.path} ended without a result", {})
        if error is not None:
            self._reported = True
            raise error
        if tier is not None:
            if self._storage is None or not self._storage.tiered:
                raise ValueError(f"{self.path} is not tiered storage; wait(tier=...) needs a TieredStorage")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._storage.wait(tier, left)
        return self.result

    def _job_done(self, _future: Any = None) -> None:
        with self._cond:
            self._jobs -= 1
            self._cond.notify_all()

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _read(verdict: Verdict | None) -> TornSnapshotError | None:
    # On the committing thread: waits for comparisons still on the device, and never raises.
    return None if verdict is None else verdict.error()


_PHASE_NAMES = {
    SavePhase.COPYING: "snapshot", SavePhase.QUEUED: "snapshot",
    SavePhase.COPIED: "write", SavePhase.FENCED: "write",
    SavePhase.WRITTEN: "commit", SavePhase.COMMITTED: "done", SavePhase.FAILED: "done",
}
