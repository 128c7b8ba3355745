"""The save transaction of an asynchronous save, with its phases split between threads.

:class:`BackgroundSave` is a :class:`~shardpoint.saving.transaction.SaveTransaction`
whose ``snapshot`` copies this rank's tensors into the saver's staging ring
(all of them before the call returns in eager mode; in lazy mode the
optimizers' parameters and state on a worker, fenced by a step pre-hook),
and whose ``claim``, ``write`` and ``commit`` run on a worker
(:meth:`BackgroundSave.finish`). The saver schedules these bound methods;
the handle is told what happens through its methods.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, MutableMapping

from ..adapters.stepped import StepUpdates, step_updates
from .handle import AsyncSaveHandle
from ..dist import run_guarded
from ..engine.pipeline import StagedWrite
from ..engine.snapshot_guard import SnapshotGuard, Watch
from ..engine.staging import SaverStaging, StagingRing
from ..errors import CheckpointError, GraphCaptureError
from ..planning.describe import RankReport
from .agree import AgreedFailure, unwrap
from .copy_order import CopyOrder, copy_order
from .reuse import Same, SameItems, SaveCache
from .incremental import open_base, resolve_base
from .staged_base import StagedReuse
from ..items import dtype_name
from ..runtime.monitor import mark_phase
from .steps import data_file_name
from .transaction import SaveOptions, SaveTransaction

__all__ = ["BackgroundSave", "Staging"]

log = logging.getLogger("shardpoint")


@dataclass(frozen=True)
class Staging:
    """What the stage phase made for one asynchronous save on one rank.

    ``write``: the staged data file (``None``: nothing of this rank's to
    write, or its preparation failed); its items ``[0, split)`` are copied
    before the call returns, the rest lazily. ``deferred``: replica digests
    left for the lazy worker. ``watch``: the tensors the steps update, which
    a lazy save's guard watches (none for an eager save), and the positions
    among them it samples.

    Example::

        Staging(handle, ring).lazy  # False: nothing left for after the call
    """

    handle: AsyncSaveHandle
    ring: StagingRing
    write: StagedWrite | None = None
    split: int = 0
    deferred: bool = False
    watch: Watch = Watch()
    eager_nbytes: int = 0

    @property
    def lazy(self) -> bool:
        """Whether part of the snapshot is copied, or digested, after the call returns (the save is then fenced)."""
        return self.deferred or (self.write is not None and self.split < len(self.write.items))

    @property
    def streams(self) -> bool:
        """Whether the eager part is larger than the ring, so that it streams through it."""
        return self.split > 0 and self.write is not None and self.eager_nbytes > self.ring.capacity


class BackgroundSave(SaveTransaction):
    """One asynchronous save on one rank: ``mode`` is ``"eager"`` or ``"lazy"`` (see :mod:`shardpoint.saving.async_save`).

    Example::

        tx = BackgroundSave("ckpt/step_200", state, SaveOptions(), "lazy")
    """

    background = True

    def __init__(self, path: Any, state: MutableMapping[str, Any], options: SaveOptions, mode: str = "eager"):
        if mode not in ("eager", "lazy"):
            raise ValueError(f"mode must be 'eager' or 'lazy', got {mode!r}")
        super().__init__(path, state, options, "async_save")
        self.mode = mode
        self.staging: Staging | None = None  # made by the stage phase
        self.snapshot_started = 0.0
        self._lazy_lock = threading.Lock()  # one thread queues lazy copies at a time: the copier or the step's hook
        self._lazy_next = 0  # the next lazy item to queue

    # --- prepare ----------------------------------------------------------------------------------

    def prepare_guarded(self, cache: SaveCache) -> None:
        """The prepare phase; a failure waits for the commit (so no rank hangs) unless this rank saves alone.

        A failure every rank learned in the agreement is raised now, on every rank: nothing was started.
        """
        self.prepared = run_guarded(functools.partial(self.prepare, cache))
        if not self.prepared.ok and (self.comm.world == 1 or isinstance(self.prepared.exc, AgreedFailure)):
            raise unwrap(self.prepared.exc)

    def stage(self, staging: SaverStaging, piece_bytes: int) -> AsyncSaveHandle:
        """Size the staging ring for this save, order what it copies, and make the handle."""
        order = CopyOrder((), 0)
        if self.prepared.ok:
            ordered = run_guarded(self._copy_order)
            if ordered.ok:
                order = ordered.value
                ordered = run_guarded(functools.partial(self._refuse_capture, staging.serve(order.devices)))
            if not ordered.ok:  # as a failed preparation: the other ranks still meet this one at the commit
                if self.comm.world == 1:
                    raise ordered.exc
                self.prepared, order = ordered, CopyOrder((), 0)
        ring = staging.ring_for(order.nbytes)
        ring.reopen()
        handle = AsyncSaveHandle(self.where, self.result, device=ring.device)
        handle.attach_storage(self.storage)
        if not self.prepared.ok:
            self.staging = Staging(handle, ring)
            return handle
        deferred = False
        replicas = self.plan.replicas
        if replicas is not None:
            # Digests of the state at the call: alongside the copies; a lazy save's on its worker, guarded to the fence.
            replicas.start(order.lazy if not ring.device.asynchronous else frozenset())
            deferred = bool(replicas.later)
        write = None
        if order.items:
            name = data_file_name(self.save_id, self.comm.rank)
            write = StagedWrite(self.storage, name, list(order.items), ring, self.comm.rank, self.options.block_size, piece_bytes,
                                recorder=self.result.recorder)
            write.after = ring.device.snapshot_point()  # here, on the training thread: copies read the state as of the call
        self.staging = Staging(handle, ring, write, order.split, deferred, order.watch, order.eager_nbytes)
        return handle

    def _copy_order(self) -> CopyOrder:
        """What to copy in which order, with the live tensors the steps update (none unless part of the save is lazy).

        The order is kept by the saver while the plan's items are the same
        objects and so are the stepped entries' kept parts (or, without
        them, the live tensors).
        """
        mine = self.plan.mine
        lazy = self.plan.lazy_ok if self.mode == "lazy" and not self._graph_stepped() else frozenset()
        cache = self.cache if self.cache is not None else SaveCache()
        parts = self._stepped_parts(cache) if lazy else ()
        if parts is not None:  # the same parts: every live tensor keeps its storage, shape and strides
            fingerprint = (Same(mine), lazy, SameItems(parts))
            return cache.reuse("copy order", fingerprint, lambda: copy_order(mine, lazy, self._live(lazy), steady=True))[0]
        live = self._live(lazy)
        fingerprint = (Same(mine), lazy, SameItems(t for _, t in live))
        return cache.reuse("copy order", fingerprint, lambda: copy_order(mine, lazy, live))[0]

    def _live(self, lazy: frozenset[str]) -> tuple:
        return tuple(self.updates.live(self.plan.context)) if lazy else ()

    def _stepped_parts(self, cache: SaveCache) -> tuple | None:
        """The parts this save kept for its stepped entries; ``None`` if one has none (it is made at every save)."""
        parts = tuple(cache.kept(("part", key)) for key, _obj, _adapter in self.updates.stepped)
        return None if any(p is None for p in parts) else parts

    @functools.cached_property
    def updates(self) -> StepUpdates:
        """The stepped objects of this save's state, found once: the copy order, the graph check, the guard and the hooks read it."""
        return step_updates(self.state)

    def _graph_stepped(self) -> bool:
        """Whether an optimizer of the state may step inside a captured graph: then this save is taken eagerly.

        A replayed graph runs no step pre-hook and bumps no version counter,
        so neither the lazy fence nor its guard would see the step; a
        ``capturable`` optimizer is one made to be captured.
        """
        found = self.updates.in_graphs()
        if found:
            log.warning(
                "the lazy save to %s is taken eagerly: optimizer %s is capturable, and a step replayed from a "
                "captured graph runs no step hook, so a lazy snapshot could not be fenced before it; "
                "save with mode='eager' to silence this", self.where, ", ".join(repr(k) for k in found),
            )
        return bool(found)

    def _refuse_capture(self, device: Any) -> None:
        if device.capturing():
            raise GraphCaptureError(
                f"async_save to {self.where} was called while the calling thread captures a graph: the save's copies "
                f"and waits cannot be recorded into a graph. Call it outside the captured region, for example "
                f"between two replays of the graph."
            )

    # --- snapshot ---------------------------------------------------------------------------------

    def streams(self) -> bool:
        """Whether the eager part is larger than the ring, so that it streams through it (the writer starts first).

        One that fits is copied before the writer wakes, which would compete with the copy for the CPU.
        """
        return self.staging.streams

    @property
    def lazy(self) -> bool:
        """Whether part of the snapshot is copied, or digested, after the call returns (the save is then fenced)."""
        return self.staging.lazy

    @property
    def split(self) -> int:
        """How many staged items are copied before the call returns; the rest are copied lazily."""
        return self.staging.split

    def snapshot(self) -> None:
        """The snapshot phase on the training thread: the eager copies, then the lazy part's guard and hooks."""
        st = self.staging
        write, handle = st.write, st.handle
        self.snapshot_started = time.monotonic()
        self._lazy_next = st.split  # the lazy items follow the ones copied here
        if write is not None:
            try:
                write.copy(0, st.split, last=(st.split == len(write.items)))
                write.wait_copied()  # a snapshot counts once its copies are complete, not queued
            except BaseException as e:  # noqa: BLE001 - the writer reports it via wait()
                log.debug("snapshot copy failed: %s", e)  # copied all the same: below, or by the lazy copier
        if self.prepared.ok and self.plan.replicas is not None:
            self.plan.replicas.join()  # the state may change once the call returns
        mark_phase(self.result, "snapshot", self.snapshot_started)
        if not st.lazy:
            handle.mark_copied()
            return
        watch = st.watch if st.watch.tensors else Watch.of(self.updates.live(self.plan.context))
        handle.guard(SnapshotGuard.take(watch, st.ring.device))
        if write is not None and st.split < len(write.items):
            handle.queue_copies_with(self.queue_lazy)
        for hook in self.updates.add_pre_hooks(handle.step_pre_hook):
            handle.add_hook(hook)

    def copy_lazy(self) -> None:
        """The lazy part of the snapshot, on a worker; the optimizer's step is ordered after it."""
        st = self.staging
        write, handle = st.write, st.handle
        copies = write is not None and st.split < len(write.items)
        try:
            while copies and self._queue_next():  # one item at a time: the step's hook may take over between two
                pass
        except BaseException as e:  # noqa: BLE001
            log.debug("lazy snapshot copy failed: %s", e)
        finally:
            if st.deferred:
                self.plan.replicas.digest_later()  # before the step may change them; the guard covers the rest
            handle.copies_queued(write.last_event if copies else None)  # the step may now be ordered after them
            try:
                if copies:
                    write.wait_copied()
            finally:
                mark_phase(self.result, "lazy_copy", self.snapshot_started)
                handle.mark_copied()

    def queue_lazy(self) -> Any:
        """Queue every lazy copy not queued yet, on the calling thread (the step pre-hook's); the event completing all.

        A failed copy fails the save at ``wait()``, never the step that called this.
        """
        try:
            while self._queue_next():
                pass
        except BaseException as e:  # noqa: BLE001 - the writer reports it via wait()
            log.debug("lazy snapshot copy failed: %s", e)
        return self.staging.write.last_event

    def _queue_next(self) -> bool:
        """Queue the next lazy item's copies (with its small neighbours: one batch); False once none is left.

        An item that fails is not retried.
        """
        write = self.staging.write
        with self._lazy_lock:
            i, n = self._lazy_next, len(write.items)
            if i >= n:
                return False
            j = write.batch_end(i, n)
            self._lazy_next = j
            write.copy(i, j, last=(j == n))
            return True

    def copy_then_finish(self, pool: cf.Executor) -> None:
        """One hand-off from the training thread: this worker starts the writer, then copies the lazy part.

        Once the interpreter has begun to exit, the pool takes no new work:
        this worker then copies and writes itself, so the save still commits.
        """
        try:
            writer = pool.submit(self.finish)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            self.copy_lazy()
            writer = cf.Future()
            try:
                self.finish()
            finally:
                writer.set_result(None)
                self.staging.handle.writer_started(writer)
            return
        self.staging.handle.writer_started(writer)
        self.copy_lazy()

    # --- claim, write, commit ---------------------------------------------------------------------

    def write_staged(self, started: float) -> tuple[list, dict, float]:
        """Claim the path and write the staged data file; return what the summary needs."""
        write = self.staging.write
        try:
            self.claim_path()
            reuse = self.open_base(write)
        except BaseException:
            if write is not None:
                write.abandon()
            raise
        records, files = [], {}
        if write is not None:
            write.write()
            records = write.records
            if records or reuse is None or not reuse.reused:
                files[write.file] = write.size
            else:  # every chunk of this rank is referenced: no data file
                self.storage.delete(write.file)
            self.result.bytes_written = write.size
        if reuse is not None and reuse.reused:
            dtypes = {it.fqn: dtype_name(it.data.dtype) for it in self.plan.mine}
            self.refs = reuse.finish(self.storage, self.save_id, dtypes, self.where)
            self.result.bytes_referenced = sum(r.chunk.nbytes for r in reuse.reused)
        return records, files, started

    def open_base(self, write: StagedWrite | None) -> StagedReuse | None:
        """On the writer, for a save with ``base=``: open the base and let ``write`` compare each chunk with it first.

        ``None`` without a base, with nothing of this rank's to write, or when
        the base chosen now is none (see :class:`~shardpoint.saving.incremental.ChosenBase`).
        """
        if self.options.base is None or write is None:
            return None
        prev = resolve_base(self.options.base)
        if prev is None:
            return None
        base = open_base(prev, self.storage, self.where)
        return StagedReuse(base, self.options.block_size, self.comm.rank).attach(write)

    def summarize_fenced(self, written: tuple[list, dict, float], torn: CheckpointError | None) -> RankReport:
        """After the fence: the guard's verdict, then the summary of what was written."""
        if torn is not None:
            raise torn
        return self.summarize(*written)

    def finish(self) -> None:
        """The writer's phases: the ranks' entry, claim and write (guarded), then, once past the fence, summary, commit and report.

        A lazy save commits only what held until its fence: the commit waits
        for it with the handle, holding no worker. ``wait()`` raises a failure.
        Ranks that did not all enter this save fail it without a commit: the
        same error reaches every rank from the entry itself, and their
        commit exchanges would meet another call's.
        """
        try:
            self.call.entry.wait()
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self.abandon(e)
            return
        out = self.prepared
        if out.ok:
            out = run_guarded(functools.partial(self.write_staged, time.monotonic()))
        if out.ok:
            self.staging.handle.commit_after_fence(functools.partial(self.complete, out.value))
        else:
            self.commit_and_report(out)

    def abandon(self, error: BaseException) -> None:
        """End this save as failed with ``error``, writing and committing nothing."""
        if self.staging.write is not None:
            self.staging.write.abandon()
        handle = self.staging.handle
        handle.mark_written()
        handle.fail(error)
        handle.finish()

    def complete(self, written: tuple[list, dict, float], torn: CheckpointError | None) -> None:
        """The writer's phases after the fence: on its own worker if the fence had passed, else where the fence sends it."""
        self.commit_and_report(run_guarded(functools.partial(self.summarize_fenced, written, torn)))

    def commit_and_report(self, out: Any) -> None:
        """Commit this rank's outcome and report; the handle ends COMMITTED or FAILED."""
        handle = self.staging.handle
        handle.mark_written()
        try:
            self.commit(out)
            self.report()
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            handle.fail(e)
        finally:
            handle.finish()
