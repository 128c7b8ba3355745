"""Asynchronous saving: a short snapshot, then background write and commit.

Two phases. The *snapshot* copies this rank's tensors into a bounded host
staging ring; the *background* phase checksums, writes, fsyncs and commits.

Modes:

- ``"eager"``: ``async_save`` returns once every tensor is staged (or, when the
  state is larger than the staging budget, once the tail of it is staged while
  the head is already on storage).
- ``"lazy"`` (DataStates-style): parameters and optimizer state are copied in
  the background while forward and backward run, because they only change
  inside ``optimizer.step()``. A step pre-hook on every optimizer in the state
  orders the step after the copy: on an accelerator the step's work waits for
  the copy's event on the device and the host goes on; on the CPU the hook
  waits for the copy. Custom loops call :meth:`AsyncSaveHandle.fence` before
  mutating. Buffers and other tensors are still copied before ``async_save``
  returns. Only the parameters of the optimizers in the state, and those
  optimizers' state, are copied lazily, in the optimizer's parameter order,
  so what the step updates first arrives first. The rule: between
  ``async_save`` and the fence (``handle.fence()``, the next
  ``optimizer.step()``, ``handle.done()`` after the copy, or
  ``handle.wait()``), nothing may change them in place. A change there (an
  EMA, a clamp, manual weight decay, an optimizer moment touched) fails the
  save at ``wait()`` with :class:`~shardpoint.errors.TornSnapshotError`,
  commits nothing and leaves the previous checkpoint intact, even when the
  copy happened to finish first. The commit waits for the fence.

Device: the saver stages through one :class:`~shardpoint.device.Device`,
given as ``device=`` or learned from the devices of the state's tensors (a
state on several devices of the process gets a
:class:`~shardpoint.device.DeviceSet`: each tensor is copied by its own).
Its staging ring is host memory those devices copy into at full speed,
allocated once and reused by every save.

Coordination (the save id, the gather of chunk records, the commit) runs on a
dedicated gloo process group owned by the :class:`AsyncSaver`, so background
collectives never interleave with the training loop's own collectives.

Pre-warming: by default an :class:`AsyncSaver` starts its worker threads and
allocates its staging buffer when it is constructed, with no collective, so
a saver may still be made on one rank for rank-local saves. ``prewarm_state=``
(given on every rank of the group, which makes the constructor collective)
also makes the private group, caches the save plan and touches the staging
memory that state will fill. The first save then stalls the loop no longer
than later ones.

Example::

    saver = sp.AsyncSaver(staging_bytes=1 << 30, prewarm_state=state)
    h = saver.save("ckpt/step_200", state, mode="lazy")
    ...  # forward, backward; the step pre-hook waits for the copy if needed
    h.wait()
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, MutableMapping

from .handle import AsyncSaveHandle
from .reuse import SaveCache
from ..runtime.handshake import Ticket
from ..runtime.monitor import mark_phase
from .steps import SaveResult
from . import SaveOptions, SaveTransaction, check_state
from .options import save_options, take_keywords
from .agree import AgreedFailure
from .background import BackgroundSave
from ..adapters.stepped import step_updates
from ..engine.inflight import track_save
from ..dist import Comm, close_at_exit, destroy_private_group, private_group
from ..engine.staging import SaverStaging, StagingRing
from ..engine.workers import start_workers
from ..errors import CheckpointError
from ..device import Device

__all__ = ["AsyncSaver", "AsyncSaveHandle", "Prewarmed", "async_save", "default_saver"]

log = logging.getLogger("shardpoint")


@dataclass(frozen=True)
class Prewarmed:
    """What :meth:`AsyncSaver.prewarm` made ready on this rank.

    ``group``: the private coordination group exists (``False`` with no
    process group or a world of one, which need none); ``workers``: worker
    threads running; ``staged_bytes``: staging bytes already touched (0
    without a state); ``state_bytes``: this rank's bytes of the given state,
    as it will be saved (with the optimizer state the optimizers will make
    at their first step); ``seconds``: how long pre-warming took;
    ``expected_bytes``: the part of ``state_bytes`` that does not exist
    yet (optimizer state estimated, or ``expect_bytes`` beyond the plan).
    """

    group: bool
    workers: int
    staged_bytes: int
    state_bytes: int
    seconds: float
    expected_bytes: int = 0


class AsyncSaver:
    """Owns what asynchronous saves reuse: the staging ring and a coordination group.

    Only one save is in flight per saver: :meth:`save` first waits for the
    previous one (and raises its error, if it failed). ``timeout`` bounds the
    background coordination collectives (a dead or stuck peer then raises
    instead of blocking for the process group's default timeout).
    ``background_nice`` lowers the scheduling priority of the two worker
    threads by that many nice levels (Linux; 0 leaves it alone), so that
    when cores are oversubscribed the training threads, and other ranks
    still inside their save call, run first.

    ``staging_bytes``: the host staging budget (None: 2 GiB, or this rank's
    state when larger). ``device``: what the state is copied from, one
    device or a list (default: the devices of its tensors; see
    :mod:`shardpoint.device`).

    ``prewarm`` (default) starts the worker threads and allocates the
    staging buffer now, locally: constructing the saver is not a collective,
    so it may be made on one rank only (for ``process_group=sp.LOCAL``
    saves). ``prewarm_state`` (this rank's state, as it will be saved; pass
    it on every rank of the group, as the constructor then runs
    :meth:`prewarm`, a collective) also makes the private group, caches the
    save plan and sizes and touches the staging memory, so the first save
    stalls no longer than later ones. ``prewarm=False`` makes everything on
    first use, inside the first save.

    :meth:`close` waits for the in-flight save, stops the two worker threads
    and destroys the private group; it also runs at interpreter exit for a
    saver still open then, so that no gloo thread outlives the interpreter
    (an abort at exit otherwise).

    Every argument after ``timeout`` is keyword-only.

    Example::

        saver = sp.AsyncSaver(staging_bytes=1 << 30, prewarm_state=state, background_nice=0)
    """

    def __init__(
        self,
        staging_bytes: int | None = None,
        piece_bytes: int = 64 << 20,
        process_group: Any = None,
        timeout: float | None = None,
        *,
        prewarm_state: MutableMapping[str, Any] | None = None,
        device: Any = None,
        **more: Any,
    ):
        more = take_keywords("AsyncSaver", more, {"background_nice": 5, "prewarm": True})
        prewarm = more["prewarm"]
        self.timeout = timeout
        self.background_nice = int(more["background_nice"])
        self.staging = SaverStaging(staging_bytes, piece_bytes, device)  # see SaverStaging for the budget
        self._pg_arg = process_group
        self._comms: dict[Any, Comm] = {}  # the user's group -> its private coordination group
        self._inflight: AsyncSaveHandle | None = None
        self._plan_cache = SaveCache()
        self._plan_caches: dict[Any, SaveCache] = {}
        # Two long-lived workers (writer and lazy copier): a thread start per save
        # waits for the new thread to take the GIL, which costs the loop milliseconds.
        self._pool: cf.ThreadPoolExecutor | None = None
        self._owned: list[Comm] = []  # private groups this saver made, destroyed by close()
        self.prewarmed: Prewarmed | None = None
        close_at_exit(self.close)
        if prewarm_state is not None:
            self.prewarm(prewarm_state)
        elif prewarm:
            self._workers()  # local only: threads and staging memory, no group (see the class docs)
            ring = self.staging.ring_for()
            if not (self.staging.auto and ring.device.pins):  # an automatic budget on an accelerator waits for the state's size
                ring.warm(0)

    def prewarm(self, state: MutableMapping[str, Any] | None = None, process_group: Any = None, *,
                expect_bytes: int | None = None) -> Prewarmed:
        """Make now what the first save would make; return what is ready (also kept as ``self.prewarmed``).

        Makes the private coordination group for ``process_group`` (default:
        the saver's), starts the worker threads and allocates the staging
        buffer. With ``state`` it also plans the save of ``state`` (the plan
        is cached for the saves that follow) and sizes and touches the
        staging memory for this rank's part of it (at most
        ``staging_bytes``), so the first save allocates nothing and its copy
        takes no page faults. An optimizer that has not stepped yet counts
        with the state it will make at its first step
        (:mod:`~shardpoint.adapters.expected_state`: AdamW's two moments, SGD's
        momentum buffer...). ``expect_bytes`` gives this rank's bytes to
        save instead, where the estimate cannot know them (an optimizer of
        another kind). Collective when a process group is active: every
        rank of the group calls it, in the same order relative to other
        group creations. Calling it again is cheap.

        Example::

            saver = sp.AsyncSaver(prewarm=False)
            saver.prewarm({"model": model, "optimizer": torch.optim.AdamW(model.parameters())})
        """
        t0 = time.monotonic()
        base = Comm.resolve(self._pg_arg if process_group is None else process_group)
        comm = self._coordination(base)
        self._workers()
        need, expected = 0, 0
        if state is not None:
            check_state(state)
            try:
                plan = SaveTransaction("prewarm", state, SaveOptions()).rehearse(base, comm, self._cache(base, process_group))
                need = sum(t.nbytes for t in plan.mine)
                expected = step_updates(state).state_to_come(plan.tensors)
                self.staging.adopt(plan.mine)
            except (CheckpointError, AgreedFailure) as e:  # the save itself will raise it, with its path
                log.debug("pre-warming could not plan the state: %s", e)  # an agreed failure: on every rank alike
        if expect_bytes is not None:
            expected = max(0, int(expect_bytes) - need)
        need += expected
        ring = self.staging.ring_for(need)
        ring.warm(need)
        self.prewarmed = Prewarmed(comm is not base, 2, ring.warm_bytes, need, time.monotonic() - t0, expected)
        log.debug("rank %s pre-warmed its saver in %.3fs: %s", comm.rank, self.prewarmed.seconds, self.prewarmed)
        return self.prewarmed

    def close(self) -> None:
        """Wait for the in-flight save, then stop the worker threads and destroy the private group.

        Local (no collective) and idempotent; the saver can be used again
        afterwards (it starts new workers and a new group on demand). The
        in-flight save's error, if any, is raised after the cleanup.

        Example::

            saver.save(path, state).wait(); saver.close()
        """
        try:
            self.wait()
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)
            owned, self._owned = self._owned, []
            self._comms.clear()
            self.prewarmed = None
            for comm in owned:
                destroy_private_group(comm)
            self.staging.close()  # staging memory goes back now, not when the saver is collected

    def _workers(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = start_workers(2, self.background_nice)
        return self._pool

    @property
    def staging_bytes(self) -> int:
        """The staging budget in bytes (grown to a state's size when it was left automatic)."""
        return self.staging.budget

    @property
    def piece_bytes(self) -> int:
        """The most bytes copied in one piece."""
        return self.staging.piece

    @property
    def device(self) -> Device | None:
        """The :class:`~shardpoint.device.Device` the saver stages through (None before it knows)."""
        return self.staging.device

    @property
    def _ring(self) -> StagingRing | None:
        return self.staging.ring

    def _cache(self, base: Comm, process_group: Any) -> SaveCache:
        # Plans depend on the ranks: one cache for the saver's own group, one per other group.
        return self._plan_cache if process_group is None else self._plan_caches.setdefault(_group_key(base), SaveCache())

    def _coordination(self, base: Comm, entry: Ticket | None = None) -> Comm:
        """The private coordination group for the saves of ``base``'s ranks (one per group).

        Background collectives run on a private gloo group, so they cannot
        interleave with the training loop's collectives. For a subset of the
        world only its members create it (see :func:`~shardpoint.dist.private_group`),
        after every rank entered the save (``entry``): making it is a collective.
        """
        key = _group_key(base)
        comm = self._comms.get(key)
        if comm is None:
            if entry is not None:
                entry.wait()
            comm = self._comms[key] = private_group(base, self.timeout)
            if comm is not base:
                self._owned.append(comm)
        return comm

    def wait(self) -> SaveResult | None:
        """Wait for the in-flight save, if any, and return its result."""
        h, self._inflight = self._inflight, None
        if h is None or (h.reported and h.done()):
            return None  # its failure was already raised to the caller once
        return h.wait()

    def save(
        self, path, state: MutableMapping[str, Any], *, mode: str = "eager", process_group: Any = None, **options: Any,
    ) -> AsyncSaveHandle:
        """Start saving ``state`` to ``path``; see the module docs for ``mode``.

        The keyword options (``allow_pickle``, ``block_size``, ``trace_dir``,
        ``on_metrics``, ``layouts``, ``replicated_over``,
        ``collective_timeout``, ``commit``, ``base``; see
        :class:`~shardpoint.saving.options.SaveOptions`) and
        ``process_group`` mean what they mean for :func:`shardpoint.save`;
        ``process_group`` defaults to the saver's. With
        :data:`~shardpoint.LOCAL` the calling rank saves alone, and nothing
        in the background is a collective. The path is claimed in the
        background, before the first data byte is written; a save to a path
        that another save is writing fails in ``wait()`` with
        :class:`~shardpoint.errors.ConcurrentSaveError`. ``base=prev`` makes
        the save incremental: the writer opens ``prev`` in the background
        and references each chunk whose staged bytes equal ``prev``'s at the
        same place (:mod:`shardpoint.saving.staged_base`); a ``prev`` that
        cannot be opened fails the save at ``wait()``.

        Example::

            h = saver.save("ckpt/step_300", state, mode="lazy", base="ckpt/step_200")
            h.wait().bytes_referenced
        """
        options = save_options("AsyncSaver.save", options)
        tx = BackgroundSave(path, state, options, mode)
        tx.check()
        self.wait()
        base = tx.enter(self._pg_arg if process_group is None else process_group, self._coordination).base
        tx.prepare_guarded(self._cache(base, process_group))
        handle = tx.stage(self.staging, self.piece_bytes)
        pool = self._workers()
        handle.use_pool(pool)  # where a lazy save's commit runs once its fence passes
        early = tx.streams()
        if early:
            handle.add_future(pool.submit(tx.finish))
        tx.snapshot()
        self._inflight = handle
        track_save(handle.path, handle.finished_event)  # a load of this path in this process waits for the commit
        mark_phase(tx.result, "blocked", tx.t0)
        # Workers are woken last: once running they compete for the GIL, and
        # nothing of the training thread's own work should be left by then.
        if tx.lazy and tx.split == 0:
            handle.expect_writer()
            handle.add_future(pool.submit(tx.copy_then_finish, pool))
        else:
            if tx.lazy:
                handle.add_future(pool.submit(tx.copy_lazy))
            if not early:
                handle.add_future(pool.submit(tx.finish))
        # A failure of this rank alone before the write surfaces at wait(), with the other ranks' (at the commit):
        # raised here, it would leave this rank out of step with ranks that still wait for this save.
        return handle


def _group_key(comm: Comm) -> Any:
    """A dict key for the ranks of ``comm``: its group, the default group, or "this rank alone"."""
    return ("local",) if comm.local else ("group", comm.group) if comm.active else ("none",)


_default: AsyncSaver | None = None
_default_lock = threading.Lock()


def default_saver(prewarm_state: MutableMapping[str, Any] | None = None) -> AsyncSaver:
    """The process's default :class:`AsyncSaver`, created on first use.

    This is the one piece of process-wide state in shardpoint: ``async_save``
    must reuse staging memory and know the previous in-flight save across
    calls. Create your own ``AsyncSaver`` for explicit control.

    Made by the first ``async_save``, it is not pre-warmed (its private group
    is made inside that save, after every rank entered it). Call
    ``default_saver(prewarm_state=state)`` once on every rank before the loop
    to pre-warm it (collective, see :meth:`AsyncSaver.prewarm`): the first
    ``async_save`` then stalls no longer than later ones.

    Example::

        sp.default_saver(prewarm_state={"model": model, "optimizer": opt})
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = AsyncSaver(prewarm=False)
        saver = _default
    if prewarm_state is not None:
        saver.prewarm(prewarm_state)
    return saver


def async_save(path, state: MutableMapping[str, Any], *, mode: str = "eager", **kwargs) -> AsyncSaveHandle:
    """Save asynchronously with the default saver; returns once the snapshot is safe.

    Example::

        h = sp.async_save("ckpt/step_200", state)
        ...  # keep training
        h.wait()
    """
    return default_saver().save(path, state, mode=mode, **kwargs)
