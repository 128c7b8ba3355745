"""Retention: deleting old and torn step folders in the background, after a newer step has committed.

Rank 0 runs the deletions on one thread; a request made while a pass runs
leads to one more pass. A pass keeps the newest complete step, the last
``keep_last``, every ``keep_every``-th step and every step in use (being
restored, or being written by this manager), and removes folders left by
crashed saves older than the newest complete step, unless a live save of
another job holds them. A step is deleted manifest first, made durable,
then its data, so a crash in the middle leaves a folder that is never taken
for complete.

In an incremental run (:mod:`shardpoint.manager.incremental`) a deleted
step's data files that a kept step references stay, in its folder, which
then holds nothing else; each pass removes those no kept step references
any more, and shrinks those kept steps reference only in part to the
chunks they use (:mod:`shardpoint.manager.compact`). A pass reads the kept
steps' manifests before it deletes anything, and deletes no data when one
cannot be read.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, TypeVar

from ..engine.claim import claim_is_live
from ..format.manifest import MANIFEST_NAME
from ..storage import Storage
from .folders import LOCK_NAME, scan_steps, step_folder
from .compact import compact_run, holders, read_kept
from .steplock import StepLock

__all__ = ["StepsInUse", "Retention"]

log = logging.getLogger("shardpoint")

T = TypeVar("T")


class StepsInUse:
    """Steps that retention must not delete: being restored, or being written by this manager.

    Deletions run under the same lock as :meth:`protect`, so a step listed
    for a restore is never deleted between the listing and the load.

    Example::

        in_use = StepsInUse()
        candidates = in_use.protect(lambda: [300, 200])
        try:
            ...  # load one of them
        finally:
            in_use.release(candidates)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._protected: set[int] = set()
        self._writing: set[int] = set()
        self._started = 0  # saves started so far: a change tells a retention pass that a save began

    def protect(self, listing: Callable[[], Iterable[int]]) -> list[int]:
        """Run ``listing`` and protect the steps it returns, with no deletion in between; return them."""
        with self._lock:
            steps = list(listing())
            self._protected.update(steps)
            return steps

    def release(self, steps: Iterable[int]) -> None:
        """End the protection of ``steps``."""
        with self._lock:
            self._protected.difference_update(steps)

    def start_writing(self, step: int) -> None:
        """Mark ``step`` as being saved by this manager."""
        with self._lock:
            self._writing.add(step)
            self._started += 1

    def finish_writing(self, step: int) -> None:
        """The save of ``step`` committed or failed."""
        with self._lock:
            self._writing.discard(step)

    def writing(self) -> set[int]:
        """The steps being saved now (a copy)."""
        with self._lock:
            return set(self._writing)

    def busy(self) -> set[int]:
        """The steps being restored or saved now (a copy): a pass keeps what they reference.

        Example::

            in_use.busy()   # {300} while step 300 is restored
        """
        with self._lock:
            return self._protected | self._writing

    def quiet(self) -> int | None:
        """A token for :meth:`run_if_quiet` when no step is being restored or saved now, else ``None``.

        Example::

            token = in_use.quiet()   # None while a save or restore runs
        """
        with self._lock:
            return None if self._protected or self._writing else self._started

    def run_if_quiet(self, token: int, fn: Callable[[], T]) -> T | None:
        """Run ``fn`` and return its result if nothing was restored or saved since :meth:`quiet` gave ``token``; else ``None``.

        ``fn`` runs under the lock of :meth:`protect` and :meth:`start_writing`,
        so no restore or save starts while it runs: a retention pass switches
        manifests with it.

        Example::

            token = in_use.quiet()
            if token is not None:
                in_use.run_if_quiet(token, lambda: True)
        """
        with self._lock:
            if self._protected or self._writing or self._started != token:
                return None
            return fn()

    def delete_unless_used(self, step: int, delete: Callable[[int], None]) -> bool:
        """Call ``delete(step)`` unless ``step`` is protected or being written; ``True`` if it ran."""
        with self._lock:
            if step in self._protected or step in self._writing:
                return False
            delete(step)
            return True


class Retention:
    """Background deletion of the step folders a run no longer keeps (rank 0 only).

    ``keep_last=None`` keeps everything (nothing is ever scheduled). Errors are
    logged and appended to :attr:`errors`; they never reach the training loop.

    Example::

        ret = Retention(run, keep_last=3, keep_every=1000, in_use=StepsInUse(), locks=locks)
        ret.schedule()   # after a commit
        ret.join()       # before reading the run root's listing
    """

    def __init__(
        self,
        storage: Storage,
        keep_last: int | None,
        keep_every: int | None,
        in_use: StepsInUse,
        locks: StepLock,
        hook: Callable[[str, int | None], None] = lambda phase, step: None,
        incremental: bool = False,
    ):
        self.storage = storage
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.in_use = in_use
        self.locks = locks
        self.hook = hook  # called with ("retention", step) before each deletion (fault injection)
        self.incremental = incremental  # kept steps may reference data in the folders of deleted ones
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._requested = False

    def schedule(self) -> None:
        """Ask for a pass; starts the thread if none is running."""
        if self.keep_last is None:
            return
        with self._lock:
            self._requested = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shardpoint-retention", daemon=True)
                self._thread.start()

    def join(self) -> None:
        """Wait until no pass is running or requested."""
        while True:
            with self._lock:
                t = self._thread
            if t is None:
                return
            t.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._requested:
                    self._thread = None
                    return
                self._requested = False
            try:
                self.run_pass()
            except Exception as e:  # noqa: BLE001 - deletions never stop training
                log.warning("retention under %s failed: %s", self.storage.url, e)
                self.errors.append(f"{type(e).__name__}: {e}")

    def doomed(self) -> list[int]:
        """The steps a pass would delete now, before the in-use check."""
        folders = scan_steps(self.storage)
        complete = sorted(s for s, f in folders.items() if f.committed)
        if not complete:
            return []
        newest = complete[-1]
        keep = set(complete if self.keep_last is None else complete[-self.keep_last:])
        if self.keep_every:
            keep.update(s for s in complete if s % self.keep_every == 0)
        keep.add(newest)
        doomed = [s for s in complete if s not in keep]
        writing = self.in_use.writing()
        for s, f in sorted(folders.items()):
            if f.committed or s >= newest or s in writing:
                continue
            st = self.storage.child(step_folder(s))
            if claim_is_live(st):
                continue  # a save (not this manager's) is writing there
            if f.locked and self.locks.stale(self.locks.read(st)) is None:
                continue  # a live save of another job: not ours to remove
            doomed.append(s)
        return sorted(doomed)

    def run_pass(self) -> None:
        """One pass, in the calling thread: delete every doomed step that is not in use, then compact (incremental runs)."""
        token = self.in_use.quiet()  # before listing: a save that starts later makes the listing stale
        doomed = self.doomed()
        spare: dict[str, set[str]] = {}
        kept = None
        if self.incremental and doomed:
            busy = self.in_use.busy()  # a doomed step in use stays this pass, and so does what it references
            kept = read_kept(self.storage, [s for s, f in scan_steps(self.storage).items() if f.committed and (s not in doomed or s in busy)])
            if kept is None:
                return  # what the kept steps reference is unknown: delete nothing
            for folder, data in holders(kept):
                spare.setdefault(folder, set()).add(data)
        for s in doomed:
            keep = spare.get(step_folder(s), set())
            self.in_use.delete_unless_used(s, lambda step: self.delete_step(step, keep))
        if kept and token is not None and not self.storage.tiered:  # tiered: slower tiers would keep old manifests
            compact_run(self.storage, kept, lambda fn: self.in_use.run_if_quiet(token, fn), self.hook)

    def delete_step(self, step: int, spare: set[str] | frozenset[str] = frozenset()) -> None:
        """Delete one step folder, manifest first, so it is never seen half-deleted as complete.

        ``spare``: data files that kept steps reference; they stay (the
        folder then holds only them, and never counts as a step).
        """
        st = self.storage.child(step_folder(step))
        names = [n for n in st.list("") if n not in spare]
        if MANIFEST_NAME in names:
            self.hook("retention", step)
            st.delete(MANIFEST_NAME)
            st.sync_deletes()
        for n in names:
            if n not in (MANIFEST_NAME, LOCK_NAME):
                self.hook("retention", step)
                st.delete(n)
        st.delete(LOCK_NAME)
        st.remove_empty_folders()
        log.info("deleted %s%s", st.url, f" (kept {len(spare)} data file(s) that kept steps reference)" if spare else "")
