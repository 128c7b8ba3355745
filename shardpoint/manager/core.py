"""CheckpointManager: the glue between the policies, the step lock, saves, retention, restore and the watchdog."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, MutableMapping, Sequence

import torch

from ..api import read_manifest, save as save_checkpoint
from ..saving.async_save import AsyncSaver
from ..dist import Comm, close_at_exit
from ..errors import CheckpointError, CheckpointTimeoutError, ConcurrentSaveError, StorageError
from ..peer import RestoreReport
from ..storage import Storage, storage_for
from .collectives import Collectives
from .faults import FaultHook, fault_from_env
from .folders import HINT_NAME, committed_steps, step_folder
from .incremental import base_keywords, check_incremental
from .options import UNSET, check_arguments, resolve_mode, save_policies
from .pending import DoneHandle, PendingSave, stalled_error, wait_judging_progress
from .policies import OnDemand, SavePolicy
from .restore import restore_newest
from .retention import Retention, StepsInUse
from .steplock import StepLock
from .watchdog import HangReport

__all__ = ["CheckpointManager"]

log = logging.getLogger("shardpoint")


class CheckpointManager:
    """Periodic, retained, resumable checkpoints of a training run under one root.

    Args:
        root: run folder: a path, a URL (``file://``, later ``s3://``) or a
            :class:`~shardpoint.storage.Storage` (a ``MemoryStorage`` instance works).
        interval: save every ``interval`` steps (shorthand for ``EveryNSteps``).
            A manager needs a save policy: with neither ``interval`` nor
            ``policies`` (or with ``interval=0``) it raises ``ValueError``;
            ``policies=[OnDemand()]`` saves only when asked.
        keep_last: keep this many newest complete checkpoints (``None``: keep all).
        keep_every: also keep every step that is a multiple of this forever.
        mode: ``"eager"`` (the default) or ``"lazy"`` for background saves
            (:class:`~shardpoint.AsyncSaver`, as ``sp.async_save(mode=...)``),
            ``None`` for blocking saves. ``async_mode=`` is its deprecated
            old name.
        policies: extra :class:`SavePolicy` objects (``EveryTSeconds``, ``OnDemand``...).
        timeout: seconds without progress after which a manager collective,
            a background save or a watched phase counts as hung (``None``:
            never). Progress is bytes moved or phases entered: a slow save
            that keeps writing is never a hang.
        on_hang: what the watchdog does with a :class:`HangReport`:
            ``"auto"`` (the default) is ``"exit"`` under torchrun
            (``TORCHELASTIC_RUN_ID`` or ``LOCAL_RANK`` set) and ``"raise"``
            otherwise; ``"exit"`` logs the reason and ends the process with
            :data:`HANG_EXIT_CODE` so the agent restarts the group;
            ``"raise"`` makes the phase raise :class:`CheckpointTimeoutError`
            once it returns, and the manager refuse further work; ``"log"``
            or a callable.
        hang_grace: extra seconds past ``timeout`` before the watchdog acts
            (default ``min(60, timeout)``), so timeouts that raise come first.
        staging_bytes: host staging budget of the asynchronous saver.
        process_group: the ranks taking part (default: the whole world).
        storage_options: passed to :func:`~shardpoint.storage.storage_for`.
        incremental: each save writes only what changed since the newest committed step, in every
            ``mode`` (see :mod:`~shardpoint.manager.incremental`).
        save_options / load_options: extra keyword arguments for every save
            (``block_size``, ``layouts``, ``trace_dir``...) and load (``strict``...).
        stale_lock_s: age after which a step lock whose owner cannot be checked
            (another host) is considered abandoned.
        write_hint: also write the ``latest`` hint file after each commit.
        memory: a :class:`~shardpoint.PeerMemory`: memory checkpoints at
            its interval, and ``restore`` from the newest step complete in this
            host's or peers' memory before the stored ones (see
            :mod:`shardpoint.peer`); ``last_restore`` reports the step and source.
        prewarm: make the private groups, the saver's worker threads and its
            staging buffer now (see :meth:`~shardpoint.AsyncSaver.prewarm`), so the
            first save stalls no longer than later ones. The constructor is then
            collective: every rank constructs the manager together.
        prewarm_state: the state that will be saved; with it the staging
            memory is also sized to it and touched, and its save plan cached.

    Example::

        mgr = sp.CheckpointManager("ckpt/run", interval=50, keep_last=2, keep_every=1000)
        start = mgr.restore(state) or 0
    """

    def __init__(
        self,
        root: str | Storage,
        interval: int | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        mode: str | None = UNSET,
        policies: Sequence[SavePolicy] = (),
        *,
        async_mode: str | None = UNSET,
        timeout: float | None = 1800.0,
        on_hang: str | Callable[[HangReport], None] = "auto",
        hang_grace: float | None = None,
        staging_bytes: int | None = None,
        process_group: Any = None,
        storage_options: dict | None = None,
        save_options: dict | None = None,
        load_options: dict | None = None,
        stale_lock_s: float = 3600.0,
        write_hint: bool = True,
        clock: Callable[[], float] = time.monotonic,
        fault_hook: FaultHook | None = None,
        memory: Any = None,
        prewarm: bool = True,
        prewarm_state: MutableMapping[str, Any] | None = None, incremental: bool = False,
    ):
        check_arguments(keep_last, keep_every, timeout, on_hang)
        self.mode = resolve_mode(mode, async_mode)
        self.policies: list[SavePolicy] = save_policies(interval, policies, memory)
        self.storage: Storage = storage_for(root, **(storage_options or {}))
        self.keep_last = None if keep_last is None else int(keep_last)
        self.keep_every = None if keep_every is None else int(keep_every)
        self.timeout = timeout
        self.hang_grace = hang_grace if hang_grace is not None else (min(60.0, timeout) if timeout else 0.0)
        self.stale_lock_s = stale_lock_s
        self.write_hint = write_hint
        self.save_options = dict(save_options or {})
        self.load_options = dict(load_options or {})
        self.memory = memory  # a PeerMemory, or None
        self.last_restore: Any = None  # the RestoreReport of the last restore
        self.stop_requested = False
        self._clock = clock
        self._pg_arg = process_group
        self._staging_bytes = staging_bytes
        self._coll = Collectives(process_group, timeout, self.hang_grace, on_hang, fault_hook or fault_from_env())
        self._locks = StepLock(owner=uuid.uuid4().hex, stale_lock_s=stale_lock_s)  # this instance, in lock files
        self._in_use = StepsInUse()  # steps being restored or saved: never deleted
        self._retention = Retention(self.storage, self.keep_last, self.keep_every, self._in_use, self._locks, self._coll.hook, check_incremental(incremental, self.mode))
        self.retention_errors: list[str] = self._retention.errors
        self._saver: AsyncSaver | None = None
        self._pending: PendingSave | None = None
        self._failed: BaseException | None = None  # a background save's error, not yet raised
        self._last_saved: int | None = None
        self._loaded: int | None = None
        self._closed = False
        close_at_exit(self._end_resources)  # threads and the private group end before the interpreter does
        for p in self.policies:
            if isinstance(p, OnDemand) and p.signals:
                p.install()
        if prewarm or prewarm_state is not None:  # collective: every rank constructs the manager together
            comm = self._comm()
            if self.mode is not None:
                self._get_saver().prewarm(prewarm_state)
            if memory is not None:
                memory.prewarm(comm, prewarm_state)

    # ------------------------------------------------------------ public
    @property
    def rank(self) -> int:
        """This process's rank in the manager's group."""
        return self._comm().rank

    def steps(self) -> list[int]:
        """Steps whose manifest is committed, oldest first (local listing, no collective).

        Example::

            mgr.steps()  # [300, 400, 500]
        """
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest step whose manifest exists *and parses*; ``None`` if there is none.

        Derived from the manifests only (the ``latest`` hint file is ignored).
        Local, no collective. Example::

            if mgr.latest_step() is None: init_weights()
        """
        for s in reversed(self.steps()):
            try:
                read_manifest(self.storage.child(step_folder(s)), chunks=False)
                return s
            except CheckpointError as e:
                log.warning("skipping %s: %s", step_folder(s), e)
        return None

    def path(self, step: int) -> Storage:
        """The storage of one step's folder (e.g. for ``sp.read_tensor``)."""
        return self.storage.child(step_folder(step))

    @property
    def async_mode(self) -> str | None:
        """Deprecated name of :attr:`mode`."""
        return self.mode

    def restore(
        self, state: MutableMapping[str, Any], step: int | None = None, *, progress: bool = False, **load_kwargs
    ) -> int | None:
        """Load the newest complete checkpoint (or ``step``) into ``state``; return its step.

        Returns ``None``, leaving ``state`` untouched, when there is no complete
        checkpoint. The load reshards to the current layout (it is
        :func:`shardpoint.load`). If the chosen checkpoint turns out torn or
        corrupt, the next older one is tried; the error is raised only when
        none loads. ``progress=True`` shows the bytes read on stderr (rank 0).
        Collective.

        Example::

            start = mgr.restore({"model": model, "optimizer": opt}, progress=True) or 0
        """
        self._usable()
        self._comm()
        self._settle()
        if self.memory is not None:  # Peer memory: the background replication
            self.memory.wait()
        return restore_newest(
            self.storage, state, step, coll=self._coll, in_use=self._in_use, memory=self.memory,
            load_kwargs={**self.load_options, **load_kwargs, **({"progress": True} if progress else {})},
            on_restored=self._restored,
        )

    def maybe_save(self, step: int, state: MutableMapping[str, Any]):
        """Save after ``step`` if a policy asks for it; return the save handle or ``None``.

        Also finishes a completed background save (releasing its lock and
        starting retention), and raises its error if it failed. Collective.

        Example::

            mgr.maybe_save(step, state)
        """
        self._usable()
        self._poll()
        comm = self._comm()
        # Peer memory: a memory checkpoint at its own interval
        if self.memory is not None and self.memory.wants(step):
            with self._coll.watch("memory", step):
                self._coll.run("memory", step, lambda: self.memory.save(step, state, comm))
        now = self._clock()
        want = any([p.wants(step, now, comm.rank) for p in self.policies])
        stop = any(p.stop_pending for p in self.policies)
        if any(p.collective for p in self.policies) and comm.world > 1:
            want, stop = self._agree(step, comm, want, stop)
        if not (want or stop):
            return None
        handle = self.save(step, state)
        if stop:
            self.stop_requested = True
        return handle

    def save(self, step: int, state: MutableMapping[str, Any]):
        """Save after ``step`` now, whatever the policies say; return the handle.

        Returns ``None`` when this manager already saved (or restored) this
        step. Collective. Example::

            mgr.save(total_steps, state); mgr.wait()
        """
        self._usable()
        if step == self._last_saved:
            return None
        self._comm()
        self._complete_pending()
        st = self.path(step)
        token = self._lock_step(step, st)
        self._in_use.start_writing(step)
        self._coll.hook("snapshot", step)
        t0 = time.monotonic()
        kw, lease = base_keywords(self.storage, step, self._retention.incremental, self._in_use)  # chosen at the write
        try:
            if self.mode is None:
                with self._coll.watch("save", step):
                    res = self._coll.run("save", step, lambda: save_checkpoint(st, state, process_group=self._coll.group(), **self.save_options, **kw))
                handle: Any = DoneHandle(res)
            else:
                with self._coll.watch("snapshot", step):
                    handle = self._get_saver().save(st, state, mode=self.mode, **self.save_options, **kw)
            self._pending = PendingSave(step, handle, t0, token, lease)
        except BaseException:
            self._pending = None
            self._abandon(st, token)
            PendingSave(step, None, t0, token, lease).end(self._in_use)
            raise
        self._last_saved = step
        now = self._clock()
        for p in self.policies:
            p.saved(step, now)
        self._coll.hook("write", step)
        if self.mode is None:
            self._complete_pending()
        return handle

    def request_save(self) -> None:
        """Ask every :class:`OnDemand` policy for a save at the next ``maybe_save``."""
        found = [p for p in self.policies if isinstance(p, OnDemand)]
        if not found:
            raise ValueError("request_save needs an OnDemand() policy (it makes the decision collective)")
        for p in found:
            p.request()

    def wait(self) -> None:
        """Wait for the pending save (raising its error) and the background deletions.

        Collective: when it returns, every rank sees the same committed steps.
        """
        self._usable(closing=True)
        self._complete_pending()
        self._retention.join()
        if self.memory is not None:  # Peer memory: the background replication
            self.memory.wait()
        comm = self._comm()
        if comm.world > 1:
            with self._coll.watch("wait", None):
                self._coll.run("wait", None, comm.barrier)

    def close(self) -> None:
        """Finish pending work and release signal handlers; idempotent. Collective."""
        if self._closed:
            return
        try:
            if self._coll.broken is None:
                self.wait()
        finally:
            self._closed = True
            for p in self.policies:
                if isinstance(p, OnDemand):
                    p.uninstall()
            self._coll.stop_watchdog()
            self._end_resources()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is None:
            self.close()
        else:
            try:
                self.close()
            except Exception as e:  # noqa: BLE001 - do not mask the original error
                log.warning("closing the checkpoint manager after an error: %s", e)

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.storage.url!r}, policies={self.policies}, keep_last={self.keep_last}, "
            f"keep_every={self.keep_every}, mode={self.mode!r})"
        )

    # ---------------------------------------------------------- internals
    def _end_resources(self) -> None:
        """Local cleanup, also run at interpreter exit: join this manager's threads, close its
        saver and destroy its private group before the interpreter shuts down."""
        self._coll.stop_watchdog(join=True)
        self._retention.join()
        saver, self._saver = self._saver, None
        if saver is not None:
            try:
                saver.close()
            except Exception as e:  # noqa: BLE001 - the save's own error was reported by wait()
                log.debug("closing the save workers: %s", e)
        if self.memory is not None:  # Peer memory: its staging memory and replication group
            try:
                self.memory.close()
            except Exception as e:  # noqa: BLE001 - reported by wait()
                log.debug("closing the peer memory: %s", e)
        self._coll.release_group()

    def _usable(self, closing: bool = False) -> None:
        if self._closed and not closing:
            raise CheckpointError(f"{self.storage.url}: the checkpoint manager is closed")
        if self._coll.broken is not None:
            raise CheckpointTimeoutError(
                f"{self.storage.url}: the checkpoint manager is unusable after an earlier hang "
                f"({self._coll.broken}); restart the job"
            )

    def _comm(self) -> Comm:
        return self._coll.comm()

    def _get_saver(self) -> AsyncSaver:
        if self._saver is None:
            kw = {} if self._staging_bytes is None else {"staging_bytes": self._staging_bytes}
            self._saver = AsyncSaver(process_group=self._pg_arg, **kw)
        return self._saver

    def _agree(self, step: int, comm: Comm, want: bool, stop: bool) -> tuple[bool, bool]:
        """Combine every rank's "save" and "stop" flags (MAX), so all ranks decide alike."""
        self._coll.hook("decide", step)
        flags = torch.tensor([int(want), int(stop)], dtype=torch.int64)

        def reduce():
            return comm.all_reduce(flags, op="max")

        with self._coll.watch("decide", step):
            self._coll.run("decide", step, reduce)
        return bool(flags[0]), bool(flags[1])

    def _lock_step(self, step: int, st: Storage) -> bytes | None:
        """Rank 0 takes the step lock; every rank learns the outcome. Returns rank 0's token."""
        comm = self._comm()
        token = None
        with self._coll.watch("lock", step):
            out: tuple[str, str] | None = None
            if comm.rank == 0:
                self._coll.hook("lock", step)
                try:
                    token = self._locks.acquire(st, step)
                    out = ("ok", "")
                except ConcurrentSaveError as e:
                    out = ("conflict", str(e))
                except Exception as e:  # noqa: BLE001 - every rank must learn of it
                    out = ("error", f"{type(e).__name__}: {e}")
            out = self._coll.run("lock", step, lambda: comm.broadcast(out))
        if out[0] == "conflict":
            raise ConcurrentSaveError(out[1], st.url)
        if out[0] == "error":
            raise StorageError(f"{self.storage.url}: could not lock {step_folder(step)}: {out[1]}")
        return token

    def _abandon(self, st: Storage, token: bytes | None) -> None:
        """After a failed save (rank 0): drop its partial files, keep any committed manifest."""
        if token is not None and self._comm().rank == 0:
            self._locks.abandon(st, token)

    def _restored(self, report: RestoreReport) -> None:
        now = self._clock()
        for p in self.policies:
            p.restored(report.step, now)
        self._loaded = self._last_saved = report.step
        self.last_restore = report

    # --- pending saves
    def _poll(self) -> None:
        """Finish a background save that is done, without blocking and without raising.

        Ranks see a save finish at different steps, so a failure found here is
        kept and raised at the next ``save``/``wait``/``close``, which every
        rank reaches together: no rank starts a new save while another raises.
        """
        p = self._pending
        if p is not None and p.handle.done():
            try:
                self._finish_pending()
            except Exception as e:  # noqa: BLE001 - raised later, on every rank at once
                self._failed = e

    def _complete_pending(self) -> None:
        self._finish_pending()
        e, self._failed = self._failed, None
        if e is not None:
            raise e

    def _finish_pending(self) -> None:
        p = self._pending
        if p is None:
            return
        comm = self._comm()
        if p.deadline is None and self.timeout is not None:
            p.deadline = p.start + self.timeout
        left = None if p.deadline is None else max(0.0, p.deadline - time.monotonic())
        try:
            with self._coll.watch("wait", p.step):
                wait_judging_progress(p.handle, left, self.timeout)
        except TimeoutError as e:
            err = stalled_error(comm.rank, p, time.monotonic() - p.start, self.timeout)
            p.deadline = time.monotonic() + (self.timeout or 0.0)  # a later wait() waits once more
            raise err from e
        except BaseException:
            self._pending = None
            if self._last_saved == p.step:
                self._last_saved = None
            self._abandon(self.path(p.step), p.lock)
            p.end(self._in_use)
            raise
        self._pending = None
        p.end(self._in_use)
        self._coll.hook("committed", p.step)
        if comm.rank == 0:
            self._locks.release(self.path(p.step), p.lock)
            if self.write_hint:
                try:
                    self.storage.put_atomic(HINT_NAME, (step_folder(p.step) + "\n").encode())
                except Exception as e:  # noqa: BLE001 - only a hint
                    log.debug("could not write the latest hint: %s", e)
            self._retention.schedule()

    def _settle(self) -> None:
        """Before a restore: finish the pending save (errors are logged) and wait for deletions."""
        if self._pending is not None:
            try:
                self._complete_pending()
            except CheckpointTimeoutError:
                raise
            except Exception as e:  # noqa: BLE001 - restoring is the recovery
                log.warning("pending save failed before restore: %s", e)
        self._retention.join()
