"""CheckpointManager: when to save, what to keep, where to resume, and hang detection.

One folder per step under a run root (``step_00000100``); a step is complete
exactly when its ``manifest.json`` is committed. "Latest" is always derived
from the committed manifests themselves: the optional ``latest`` file the
manager writes is a hint for people and tools, never read back.

::

    mgr = CheckpointManager("ckpt/run42", interval=100, keep_last=3, async_mode="lazy")
    step = mgr.restore(state) or 0            # newest complete checkpoint, resharded; None if none
    while step < total:
        step += 1
        train_step(step)
        mgr.maybe_save(step, state)           # saves when a policy says so
        if mgr.stop_requested:                # e.g. SIGTERM before a preemption
            break
    mgr.close()                               # waits for the pending save and deletions

``step`` counts *completed* training steps, so the state saved at step ``s``
is the one from which step ``s + 1`` runs; ``restore`` returns that ``s``.
Every rank must call ``restore``, ``maybe_save``, ``save`` and ``close`` with
the same arguments, in the same order (they are collectives).

Guarantees:

- **Never resume from a torn checkpoint.** ``restore`` only considers folders
  whose manifest exists, and if the newest one fails to load (corrupt or
  vanished data), it falls back to the next older one.
- **Retention after commit, in the background.** Old checkpoints are deleted
  by a thread on rank 0, only after a newer one has committed. The manifest is
  deleted first (and made durable), then the data, so a half-deleted folder is
  never "complete". The newest complete checkpoint, the last ``keep_last``,
  every ``keep_every``-th step and any checkpoint being restored are kept.
  Folders left by crashed saves are removed once a newer step has committed.
- **Racing saves are rejected.** Before writing, rank 0 takes ``step_x/.lock``
  with an exclusive create (``O_EXCL`` on a filesystem, an atomic insert in
  memory, a conditional PUT with ``If-None-Match: *`` on S3, or
  ``put_if_absent`` where a backend offers it). A second
  save to the same step finds the lock and raises
  :class:`CheckpointConflictError` instead of interleaving its files. A lock
  left by a crashed save is broken when its owner process is gone (same host)
  or the lock is older than ``stale_lock_s``. Object stores without a
  conditional put only get a best-effort check-then-put: there, two jobs
  writing the same run root are not reliably detected.
- **Hangs are reported, not waited on forever.** Manager collectives run on a
  private gloo group whose timeout is ``timeout``; a background save is waited
  on for at most ``timeout`` seconds from its start. Either raises
  :class:`CheckpointTimeoutError` naming the rank, step and phase. A watchdog
  thread backs this up for calls that cannot time out by themselves (a stuck
  storage write inside a synchronous save or a restore): once a phase has run
  ``timeout`` plus a grace period, it logs the rank, the phase and every
  thread's stack and runs ``on_hang`` (by default it exits the process with
  :data:`HANG_EXIT_CODE` so that torchrun's agent restarts the group).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, MutableMapping, Sequence

import torch
import torch.distributed as dist

from .api import load as _sp_load
from .api import read_manifest
from .api import save as _sp_save
from .async_save import AsyncSaver
from .dist import Comm, close_at_exit, destroy_private_group, private_group
from .errors import (
    CheckpointConflictError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    DistributedError,
    FormatError,
    IncompleteCheckpointError,
    StorageError,
)
from .engine.claim import claim_is_live
from .format.manifest import MANIFEST_NAME
from .storage import LocalStorage, Storage, storage_for

__all__ = [
    "CheckpointManager",
    "SavePolicy",
    "EveryNSteps",
    "EveryTSeconds",
    "OnDemand",
    "HangReport",
    "CheckpointTimeoutError",
    "CheckpointConflictError",
    "step_folder",
    "LOCK_NAME",
    "HINT_NAME",
    "HANG_EXIT_CODE",
    "FAULT_ENV",
    "init_distributed",
]

log = logging.getLogger("shardpoint")

LOCK_NAME = ".lock"
"""Exclusive per-step lock object, held from the start of a save until it commits."""
HINT_NAME = "latest"
"""A human-readable hint naming the newest step folder; never trusted by the manager."""
HANG_EXIT_CODE = 124
"""Exit status of a process that the watchdog ends after a hang (``on_hang="exit"``)."""
FAULT_ENV = "SHARDPOINT_FAULT"
"""Test-only fault injection, a JSON object or list of them: see :func:`_fault_from_env`."""

_STEP_RE = re.compile(r"^step_(\d{8,})$")
_LOAD_FALLBACK = (CorruptCheckpointError, IncompleteCheckpointError, FormatError, CheckpointNotFoundError)


def step_folder(step: int) -> str:
    """The folder name of ``step``: ``step_`` and at least 8 digits (sorts by name and number).

    Example::

        step_folder(100)  # 'step_00000100'
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


# ------------------------------------------------------------------ errors
# ---------------------------------------------------------------- policies
class SavePolicy:
    """When to save. Subclass and implement :meth:`wants`.

    A policy whose decision can differ between ranks (a clock, a signal) sets
    ``collective = True``; the manager then combines every rank's answer with
    one all-reduce (MAX), so all ranks agree. Deterministic policies (a
    function of the step only) leave it ``False`` and cost no communication.
    """

    collective: bool = False

    def wants(self, step: int, now: float, rank: int) -> bool:
        """Whether to save after ``step`` (``now``: the manager's clock)."""
        raise NotImplementedError

    def saved(self, step: int, now: float) -> None:
        """Called on every rank after a save of ``step`` started."""

    def restored(self, step: int, now: float) -> None:
        """Called on every rank after ``restore`` loaded ``step``."""


class EveryNSteps(SavePolicy):
    """Save when ``step % n == 0``.

    Example::

        CheckpointManager(root, policies=[EveryNSteps(500)])   # same as interval=500
    """

    def __init__(self, n: int):
        if int(n) < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = int(n)

    def wants(self, step: int, now: float, rank: int) -> bool:
        return step % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryTSeconds(SavePolicy):
    """Save when ``seconds`` have passed since the last save (or restore, or start).

    Only rank 0's clock counts: its answer is shared with the others, so ranks
    never disagree even when their clocks or step times differ.

    Example::

        CheckpointManager(root, policies=[EveryTSeconds(1800)])
    """

    collective = True

    def __init__(self, seconds: float):
        if seconds <= 0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        self.seconds = float(seconds)
        self._last: float | None = None

    def wants(self, step: int, now: float, rank: int) -> bool:
        if self._last is None:
            self._last = now
        return rank == 0 and now - self._last >= self.seconds

    def saved(self, step: int, now: float) -> None:
        self._last = now

    def restored(self, step: int, now: float) -> None:
        self._last = now

    def __repr__(self) -> str:
        return f"EveryTSeconds({self.seconds:g})"


class OnDemand(SavePolicy):
    """Save at the next ``maybe_save`` after :meth:`request` (on any rank) or a signal.

    With ``signals`` (e.g. ``[signal.SIGTERM]``) a handler is installed on
    the main thread when the manager starts. The first signal requests a save
    and, with ``stop=True``, sets the manager's ``stop_requested`` once that
    save has started, so the loop can exit while the agent's grace period
    runs. A second identical signal gets the previous handler (by default the
    process ends).

    Example::

        mgr = CheckpointManager(root, interval=1000, policies=[OnDemand(signals=[signal.SIGTERM])])
        ...
        mgr.maybe_save(step, state)
        if mgr.stop_requested:
            break
    """

    collective = True

    def __init__(self, signals: Sequence[int] = (), stop: bool = True):
        self.signals = tuple(signals)
        self.stop = stop
        self._requested = False
        self._stop_pending = False
        self._previous: dict[int, Any] = {}

    def request(self, stop: bool = False) -> None:
        """Ask for a save at the next ``maybe_save`` (safe from a signal handler)."""
        self._requested = True
        self._stop_pending = self._stop_pending or stop

    @property
    def stop_pending(self) -> bool:
        return self._stop_pending

    def wants(self, step: int, now: float, rank: int) -> bool:
        return self._requested

    def saved(self, step: int, now: float) -> None:
        self._requested = False
        self._stop_pending = False

    def install(self) -> None:
        """Install the signal handlers (main thread only; idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("OnDemand: signal handlers can only be installed from the main thread")
            return
        for sig in self.signals:
            if sig in self._previous:
                continue
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Put the previous signal handlers back."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self._requested:  # second signal: let the previous handler act
            prev = self._previous.pop(signum, signal.SIG_DFL)
            signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
            if callable(prev):
                prev(signum, frame)
            else:
                os.kill(os.getpid(), signum)
            return
        self.request(stop=self.stop)

    def __repr__(self) -> str:
        return f"OnDemand(signals={list(self.signals)}, stop={self.stop})"


# ----------------------------------------------------------------- hangs
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
        at = "" if self.step is None else f" of {step_folder(self.step)}"
        return (
            f"rank {self.rank}: checkpoint phase {self.phase!r}{at} has not finished after "
            f"{self.seconds:.1f}s (timeout {self.timeout:g}s)"
        )


def _all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


class _Watchdog:
    """One daemon thread that reports phases running past their deadline."""

    def __init__(self, rank: int, timeout: float, grace: float, on_hang: Callable[[HangReport], None]):
        self.rank, self.timeout, self.grace, self.on_hang = rank, timeout, grace, on_hang
        self._cv = threading.Condition()
        self._active: dict[int, tuple[str, int | None, float, float]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def watch(self, phase: str, step: int | None) -> Iterator[None]:
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
                report = HangReport(self.rank, phase, step, time.monotonic() - start, self.timeout, _all_stacks())
                log.error("%s; thread stacks:\n%s", report.message(), report.stacks)
                try:
                    self.on_hang(report)
                except Exception:  # noqa: BLE001 - a failing callback must not kill the watchdog
                    log.exception("on_hang callback failed")


def _exit_on_hang(report: HangReport) -> None:
    sys.stderr.write(f"shardpoint: {report.message()}; exiting with status {HANG_EXIT_CODE} so the agent can restart\n")
    sys.stderr.flush()
    os._exit(HANG_EXIT_CODE)


# ------------------------------------------------------- fault injection
def _fault_from_env() -> Callable[[str, int | None, int], None] | None:
    """Test-only: build a fault hook from ``SHARDPOINT_FAULT``.

    The variable holds a JSON object (or a list of them) with keys ``phase``
    (one of the manager's phases: ``decide``, ``lock``, ``snapshot``,
    ``write``, ``committed``, ``retention``, ``restore``), optional ``rank``,
    ``step`` (``null``/absent: any), ``delay`` (seconds; the action runs on a
    timer thread, landing at a random point of the work that follows),
    ``action`` (``"kill"``: SIGKILL this process, the default; ``"stall"``:
    sleep ``seconds`` in place), and ``nth`` (act on the n-th match, from 1).
    """
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    specs = json.loads(raw)
    specs = specs if isinstance(specs, list) else [specs]
    counts = [0] * len(specs)

    def hook(phase: str, step: int | None, rank: int) -> None:
        for i, s in enumerate(specs):
            if s.get("phase") != phase:
                continue
            if s.get("rank") is not None and int(s["rank"]) != rank:
                continue
            if s.get("step") is not None and step != int(s["step"]):
                continue
            counts[i] += 1
            if counts[i] != int(s.get("nth", 1)):
                continue
            action = s.get("action", "kill")
            delay = float(s.get("delay", 0))
            if action == "stall":
                time.sleep(float(s.get("seconds", 3600)))
            elif action == "kill":
                def kill() -> None:
                    os.kill(os.getpid(), signal.SIGKILL)

                if delay > 0:
                    threading.Timer(delay, kill).start()
                else:
                    kill()

    return hook


# --------------------------------------------------------------- startup
def init_distributed(backend: str = "gloo", timeout: float | None = None, **kwargs) -> None:
    """``init_process_group`` from torchrun's environment, safe across elastic restarts.

    torchrun's agent keeps one TCPStore for the whole job and hands it to
    every restart attempt without a per-attempt namespace. A process group
    created after a restart (``dist.new_group``, DeviceMesh sub-groups, the
    manager's and the async saver's private groups) can then read the address
    of a dead worker from the previous attempt and fail with "Gloo
    connectFullMesh failed ... Connection refused". This wraps the store in a
    prefix per attempt (``TORCHELASTIC_RESTART_COUNT``). Outside torchrun it
    is a plain ``init_process_group(backend)``.

    Example::

        from shardpoint.manager import init_distributed
        init_distributed("gloo")          # instead of dist.init_process_group("gloo")
    """
    kw = dict(kwargs)
    if timeout is not None:
        kw["timeout"] = timedelta(seconds=timeout)
    env = os.environ
    if "TORCHELASTIC_RESTART_COUNT" not in env or "MASTER_ADDR" not in env:
        dist.init_process_group(backend, **kw)
        return
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
        is_master=(not agent_store and rank == 0), multi_tenant=not agent_store,
        timeout=kw.get("timeout", timedelta(minutes=30)),
    )
    prefix = f"shardpoint/attempt_{env['TORCHELASTIC_RESTART_COUNT']}"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, **kw)


# ------------------------------------------------------------- helpers
@dataclass
class _Folder:
    step: int
    name: str
    committed: bool = False
    locked: bool = False


@dataclass
class _Pending:
    step: int
    handle: Any
    start: float
    lock: bytes | None
    deadline: float | None = None


class _DoneHandle:
    """A synchronous save's result, shaped like an :class:`AsyncSaveHandle`."""

    def __init__(self, result):
        self.result = result
        self.path = getattr(result, "path", "")

    def done(self) -> bool:
        return True

    def fence(self, timeout: float | None = None) -> None:
        return None

    def wait(self, timeout: float | None = None):
        return self.result


def _proc_start(pid: int) -> float | None:
    try:
        import psutil

        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except Exception:  # noqa: BLE001 - gone, or no permission to look
        return None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_timeout(e: BaseException) -> bool:
    s = str(e).lower()
    return "timed out" in s or "timeout" in s


def _is_comm_failure(e: BaseException) -> bool:
    """Whether a RuntimeError comes from the process group (a dead or stuck peer)."""
    s = str(e).lower()
    return _is_timeout(e) or any(w in s for w in ("gloo", "connection", "c10d", "nccl", "peer", "socket", "broken pipe"))


# ------------------------------------------------------------- manager
class CheckpointManager:
    """Periodic, retained, resumable checkpoints of a training run under one root.

    Args:
        root: run folder: a path, a URL (``file://``, later ``s3://``) or a
            :class:`~shardpoint.storage.Storage` (a ``MemoryStorage`` instance works).
        interval: save every ``interval`` steps (shorthand for ``EveryNSteps``).
        keep_last: keep this many newest complete checkpoints (``None``: keep all).
        keep_every: also keep every step that is a multiple of this forever.
        async_mode: ``"eager"`` or ``"lazy"`` for background saves
            (:class:`~shardpoint.AsyncSaver`), ``None`` for blocking saves.
        policies: extra :class:`SavePolicy` objects (``EveryTSeconds``, ``OnDemand``...).
        timeout: seconds after which a manager collective, a background save
            or a watched phase counts as hung (``None``: never).
        on_hang: what the watchdog does with a :class:`HangReport`: ``"exit"``
            (log, then end the process with :data:`HANG_EXIT_CODE`), ``"log"``,
            or a callable.
        hang_grace: extra seconds past ``timeout`` before the watchdog acts
            (default ``min(60, timeout)``), so timeouts that raise come first.
        staging_bytes: host staging budget of the asynchronous saver.
        process_group: the ranks taking part (default: the whole world).
        storage_options: passed to :func:`~shardpoint.storage.storage_for`.
        save_options / load_options: extra keyword arguments for every save
            (``block_size``, ``layouts``, ``trace_dir``...) and load (``strict``...).
        stale_lock_s: age after which a step lock whose owner cannot be checked
            (another host) is considered abandoned.
        write_hint: also write the ``latest`` hint file after each commit.
        memory: a :class:`~shardpoint.PeerMemory` tier: memory checkpoints at
            its interval, and ``restore`` from the newest step complete in this
            host's or peers' memory before the stored ones (see
            :mod:`shardpoint.peer`); ``last_restore`` reports the step and source.

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
        async_mode: str | None = "eager",
        policies: Sequence[SavePolicy] = (),
        *,
        timeout: float | None = 1800.0,
        on_hang: str | Callable[[HangReport], None] = "exit",
        hang_grace: float | None = None,
        staging_bytes: int | None = None,
        process_group: Any = None,
        storage_options: dict | None = None,
        save_options: dict | None = None,
        load_options: dict | None = None,
        stale_lock_s: float = 3600.0,
        write_hint: bool = True,
        clock: Callable[[], float] = time.monotonic,
        fault_hook: Callable[[str, int | None, int], None] | None = None,
        memory: Any = None,
    ):
        if keep_last is not None and int(keep_last) < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if keep_every is not None and int(keep_every) < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        if async_mode not in ("eager", "lazy", None):
            raise ValueError(f"async_mode must be 'eager', 'lazy' or None, got {async_mode!r}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 or None, got {timeout}")
        if isinstance(on_hang, str) and on_hang not in ("exit", "log"):
            raise ValueError(f"on_hang must be 'exit', 'log' or a callable, got {on_hang!r}")
        self.storage: Storage = storage_for(root, **(storage_options or {}))
        self.keep_last = None if keep_last is None else int(keep_last)
        self.keep_every = None if keep_every is None else int(keep_every)
        self.async_mode = async_mode
        self.policies: list[SavePolicy] = ([EveryNSteps(interval)] if interval else []) + list(policies)
        self.timeout = timeout
        self.hang_grace = hang_grace if hang_grace is not None else (min(60.0, timeout) if timeout else 0.0)
        self.stale_lock_s = stale_lock_s
        self.write_hint = write_hint
        self.save_options = dict(save_options or {})
        self.load_options = dict(load_options or {})
        self._clock = clock
        self._fault = fault_hook or _fault_from_env()
        self._on_hang = on_hang
        self._pg_arg = process_group
        self._staging_bytes = staging_bytes
        self._comm_obj: Comm | None = None
        self._own_comm = False
        self._saver: AsyncSaver | None = None
        self._watchdog: _Watchdog | None = None
        self._pending: _Pending | None = None
        self._last_saved: int | None = None
        self._loaded: int | None = None
        self._owner = uuid.uuid4().hex  # this manager instance, in lock files
        self._guard = threading.Lock()  # protects _protected against the retention thread
        self._protected: set[int] = set()  # steps being restored: never deleted
        self._writing: set[int] = set()  # steps this manager is saving: never cleaned up
        self._ret_lock = threading.Lock()
        self._ret_thread: threading.Thread | None = None
        self._ret_requested = False
        self.retention_errors: list[str] = []
        self.stop_requested = False
        self._closed = False
        self._broken: str | None = None
        self._failed: BaseException | None = None  # a background save's error, not yet raised
        close_at_exit(self._end_resources)  # threads and the private group end before the interpreter does
        for p in self.policies:
            if isinstance(p, OnDemand) and p.signals:
                p.install()
        # Peer memory: a PeerMemory tier and the report of the last restore
        self.memory = memory
        self.last_restore: Any = None

    # ------------------------------------------------------------ public
    @property
    def rank(self) -> int:
        return self._comm().rank

    def steps(self) -> list[int]:
        """Steps whose manifest is committed, oldest first (local listing, no collective).

        Example::

            mgr.steps()  # [300, 400, 500]
        """
        return sorted(s for s, f in self._scan().items() if f.committed)

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

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, **load_kwargs) -> int | None:
        """Load the newest complete checkpoint (or ``step``) into ``state``; return its step.

        Returns ``None``, leaving ``state`` untouched, when there is no complete
        checkpoint. The load reshards to the current layout (it is
        :func:`shardpoint.load`). If the chosen checkpoint turns out torn or
        corrupt, the next older one is tried; the error is raised only when
        none loads. Collective.

        Example::

            start = mgr.restore({"model": model, "optimizer": opt}) or 0
        """
        self._usable()
        comm = self._comm()
        self._settle()
        if self.memory is not None:  # Peer memory: the background replication
            self.memory.wait()
        with self._watch("restore:list", step):
            cands = None
            if comm.rank == 0:
                with self._guard:
                    cands = [s for s in reversed(self.steps()) if step is None or s == step]
                    self._protected.update(cands)
            self._hook("restore", step)
            cands = self._collective("restore:list", step, lambda: comm.broadcast(cands))
        try:
            if not cands and (self.memory is None or step is not None):
                if step is not None:
                    raise CheckpointNotFoundError(f"{self.storage.url}: no complete checkpoint at step {step}")
                log.info("rank %s: no checkpoint under %s; starting fresh", comm.rank, self.storage.url)
                return None
            kwargs = {**self.load_options, **load_kwargs}
            # Peer memory: a memory step at least as new as the newest stored one wins
            t_restore = time.monotonic()
            if self.memory is not None and step is None:
                newest = cands[0] if cands else None
                with self._watch("restore:memory", step):
                    rep = self._collective(
                        "restore:memory", step, lambda: self.memory.restore(state, comm, newer_than=newest, **kwargs)
                    )
                if rep is not None:
                    for p in self.policies:
                        p.restored(rep.step, self._clock())
                    self._loaded = self._last_saved = rep.step
                    self.last_restore = rep
                    log.info("rank %s: restored %s from %s memory", comm.rank, step_folder(rep.step), rep.source)
                    return rep.step
            last: BaseException | None = None
            for s in cands:
                try:
                    with self._watch("restore:load", s):
                        self._collective(
                            "restore:load", s,
                            lambda: _sp_load(self.path(s), state, process_group=self._group(), **kwargs),
                        )
                except _LOAD_FALLBACK as e:  # the same typed error on every rank
                    log.warning("rank %s: %s does not load (%s); trying an older checkpoint", comm.rank, step_folder(s), e)
                    last = e
                    continue
                now = self._clock()
                for p in self.policies:
                    p.restored(s, now)
                self._loaded = self._last_saved = s
                # Peer memory: report the source of every restore
                from .peer import RestoreReport

                self.last_restore = RestoreReport(s, "storage", {"total": time.monotonic() - t_restore}, rank_source="storage")
                if self.memory is not None:
                    self.memory.forget_newer(s, comm)
                log.info("rank %s: restored %s from %s", comm.rank, step_folder(s), self.storage.url)
                return s
            if last is None:  # peer memory held nothing and storage is empty
                log.info("rank %s: no checkpoint in memory or under %s; starting fresh", comm.rank, self.storage.url)
                return None
            raise last
        finally:
            if comm.rank == 0:
                with self._guard:
                    self._protected.difference_update(cands or ())

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
            with self._watch("memory", step):
                self._collective("memory", step, lambda: self.memory.save(step, state, comm))
        now = self._clock()
        want = any([p.wants(step, now, comm.rank) for p in self.policies])
        stop = any(getattr(p, "stop_pending", False) for p in self.policies)
        if any(p.collective for p in self.policies) and comm.world > 1:
            self._hook("decide", step)
            flags = torch.tensor([int(want), int(stop)], dtype=torch.int64)

            def reduce():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=comm.group)
                return flags

            with self._watch("decide", step):
                self._collective("decide", step, reduce)
            want, stop = bool(flags[0]), bool(flags[1])
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
        comm = self._comm()
        self._complete_pending()
        folder = step_folder(step)
        st = self.path(step)
        token = None
        with self._watch("lock", step):
            out: tuple[str, str] | None = None
            if comm.rank == 0:
                self._hook("lock", step)
                try:
                    token = self._acquire(st, step)
                    out = ("ok", "")
                except CheckpointConflictError as e:
                    out = ("conflict", str(e))
                except Exception as e:  # noqa: BLE001 - every rank must learn of it
                    out = ("error", f"{type(e).__name__}: {e}")
            out = self._collective("lock", step, lambda: comm.broadcast(out))
        if out[0] == "conflict":
            raise CheckpointConflictError(out[1])
        if out[0] == "error":
            raise StorageError(f"{self.storage.url}: could not lock {folder}: {out[1]}")
        with self._guard:
            self._writing.add(step)
        self._hook("snapshot", step)
        t0 = time.monotonic()
        try:
            if self.async_mode is None:
                with self._watch("save", step):
                    res = self._collective(
                        "save", step, lambda: _sp_save(st, state, process_group=self._group(), **self.save_options)
                    )
                handle: Any = _DoneHandle(res)
                self._pending = _Pending(step, handle, t0, token)
            else:
                with self._watch("snapshot", step):
                    handle = self._get_saver().save(st, state, mode=self.async_mode, **self.save_options)
                self._pending = _Pending(step, handle, t0, token)
        except BaseException:
            self._pending = None
            self._abandon(st, token)
            with self._guard:
                self._writing.discard(step)
            raise
        self._last_saved = step
        now = self._clock()
        for p in self.policies:
            p.saved(step, now)
        self._hook("write", step)
        if self.async_mode is None:
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
        self._join_retention()
        if self.memory is not None:  # Peer memory: the background replication
            self.memory.wait()
        comm = self._comm()
        if comm.world > 1:
            with self._watch("wait", None):
                self._collective("wait", None, comm.barrier)

    def close(self) -> None:
        """Finish pending work and release signal handlers; idempotent. Collective."""
        if self._closed:
            return
        try:
            if self._broken is None:
                self.wait()
        finally:
            self._closed = True
            for p in self.policies:
                if isinstance(p, OnDemand):
                    p.uninstall()
            if self._watchdog is not None:
                self._watchdog.close()
            self._end_resources()

    def _end_resources(self) -> None:
        """Local cleanup, also run at interpreter exit: join this manager's threads, close its
        saver and destroy its private group before the interpreter shuts down."""
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog.join()
        self._join_retention()
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
        comm, self._comm_obj = self._comm_obj, None
        if comm is not None and self._own_comm:
            destroy_private_group(comm)
        self._own_comm = False

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
            f"keep_every={self.keep_every}, async_mode={self.async_mode!r})"
        )

    # ---------------------------------------------------------- internals
    def _usable(self, closing: bool = False) -> None:
        if self._closed and not closing:
            raise CheckpointError(f"{self.storage.url}: the checkpoint manager is closed")
        if self._broken is not None:
            raise CheckpointTimeoutError(
                f"{self.storage.url}: the checkpoint manager is unusable after an earlier hang "
                f"({self._broken}); restart the job"
            )

    def _comm(self) -> Comm:
        if self._comm_obj is None:
            # A private gloo group: its timeout bounds every manager collective.
            base = Comm.resolve(self._pg_arg)
            self._comm_obj = private_group(base, self.timeout)
            self._own_comm = self._comm_obj is not base
        return self._comm_obj

    def _group(self) -> Any:
        c = self._comm()
        return c.group if c.active else None

    def _get_saver(self) -> AsyncSaver:
        if self._saver is None:
            kw = {} if self._staging_bytes is None else {"staging_bytes": self._staging_bytes}
            self._saver = AsyncSaver(process_group=self._pg_arg, **kw)
        return self._saver

    def _hook(self, phase: str, step: int | None) -> None:
        if self._fault is not None:
            self._fault(phase, step, self._comm().rank)

    @contextmanager
    def _watch(self, phase: str, step: int | None) -> Iterator[None]:
        if self.timeout is None:
            yield
            return
        if self._watchdog is None:
            act = self._on_hang
            cb = _exit_on_hang if act == "exit" else (lambda r: None) if act == "log" else act
            self._watchdog = _Watchdog(self._comm().rank, self.timeout, self.hang_grace, cb)
        with self._watchdog.watch(phase, step):
            yield

    def _collective(self, phase: str, step: int | None, fn: Callable[[], Any]) -> Any:
        """Run a collective; turn a process-group timeout or a dead peer into a typed error."""
        t0 = time.monotonic()
        try:
            return fn()
        except CheckpointError as e:
            if isinstance(e, DistributedError) and _is_timeout(e):
                self._timed_out(phase, step, time.monotonic() - t0, e)
            raise
        except RuntimeError as e:
            if not _is_comm_failure(e):
                raise
            rank = self._comm().rank
            if _is_timeout(e):
                self._timed_out(phase, step, time.monotonic() - t0, e)
            raise DistributedError(
                f"rank {rank}: checkpoint phase {phase!r}"
                f"{'' if step is None else ' of ' + step_folder(step)} failed in a collective "
                f"(a peer rank died or left?): {e}",
                {rank: str(e)},
            ) from e

    def _timed_out(self, phase: str, step: int | None, seconds: float, cause: BaseException) -> None:
        rank = self._comm().rank
        at = "" if step is None else f" of {step_folder(step)}"
        msg = (
            f"rank {rank}: checkpoint phase {phase!r}{at} timed out after {seconds:.1f}s "
            f"(timeout {self.timeout}s); another rank is stuck or gone: {cause}"
        )
        self._broken = f"{phase}{at}"
        raise CheckpointTimeoutError(msg, rank, phase, step, seconds) from cause

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

    def _raise_failed(self) -> None:
        e, self._failed = self._failed, None
        if e is not None:
            raise e

    def _complete_pending(self) -> None:
        self._finish_pending()
        self._raise_failed()

    def _finish_pending(self) -> None:
        p = self._pending
        if p is None:
            return
        comm = self._comm()
        if p.deadline is None and self.timeout is not None:
            p.deadline = p.start + self.timeout
        left = None if p.deadline is None else max(0.0, p.deadline - time.monotonic())
        try:
            with self._watch("wait", p.step):
                p.handle.wait(timeout=left)
        except TimeoutError as e:
            phase = self._save_phase(p.handle)
            secs = time.monotonic() - p.start
            p.deadline = time.monotonic() + (self.timeout or 0.0)  # a later wait() waits once more
            what = {
                "snapshot": "copying the state into staging memory",
                "write": "this rank is still writing its data to storage",
                "commit": "this rank's data is written; waiting for other ranks' writes or the manifest",
            }.get(phase, phase)
            raise CheckpointTimeoutError(
                f"rank {comm.rank}: save of {step_folder(p.step)} stalled in phase {phase!r} ({what}): not "
                f"committed {secs:.1f}s after it started (timeout {self.timeout}s). wait() again to keep "
                "waiting, or restart the job",
                comm.rank, phase, p.step, secs,
            ) from e
        except BaseException:
            self._pending = None
            if self._last_saved == p.step:
                self._last_saved = None
            self._abandon(self.path(p.step), p.lock)
            with self._guard:
                self._writing.discard(p.step)
            raise
        self._pending = None
        with self._guard:
            self._writing.discard(p.step)
        self._hook("committed", p.step)
        if comm.rank == 0:
            self._release(self.path(p.step), p.lock)
            if self.write_hint:
                try:
                    self.storage.put_atomic(HINT_NAME, (step_folder(p.step) + "\n").encode())
                except Exception as e:  # noqa: BLE001 - only a hint
                    log.debug("could not write the latest hint: %s", e)
            self._schedule_retention()

    @staticmethod
    def _save_phase(handle: Any) -> str:
        """Where a background save is: ``snapshot``, ``write`` (this rank's data) or ``commit``."""
        phase = getattr(handle, "phase", None)  # a handle that reports its own phase wins
        if isinstance(phase, str):
            return phase
        copied = getattr(handle, "_copied", None)
        if copied is not None and not copied.is_set():
            return "snapshot"
        result = getattr(handle, "result", None)
        spans = getattr(getattr(result, "recorder", None), "spans", [])
        # Per-piece write spans carry bytes; the span closing this rank's whole write has none.
        if getattr(result, "bytes_written", 0) or any(s.phase == "write" and not s.nbytes for s in spans):
            return "commit"
        return "write"

    # --- locks
    def _lock_body(self, step: int) -> bytes:
        pid = os.getpid()
        return json.dumps({
            "owner": self._owner, "host": socket.gethostname(), "pid": pid,
            "pid_start": _proc_start(pid), "created": time.time(), "step": step,
        }).encode()

    def _acquire(self, st: Storage, step: int) -> bytes:
        body = self._lock_body(step)
        if self._create_exclusive(st, body):
            return body
        try:
            info = json.loads(st.get(LOCK_NAME))
        except (FileNotFoundError, ValueError):
            info = {}
        why = self._stale(info)
        if why is None:
            raise CheckpointConflictError(
                f"{st.url}: another save holds {LOCK_NAME} (owner pid {info.get('pid')} on "
                f"{info.get('host')!r}, since {time.ctime(info.get('created', 0))}): two saves raced to "
                f"{step_folder(step)}. Give each job its own run root; delete the lock only if no other job "
                "is writing there"
            )
        log.warning("%s: breaking the lock of %s (%s)", st.url, step_folder(step), why)
        st.delete(LOCK_NAME)
        if self._create_exclusive(st, body):
            return body
        raise CheckpointConflictError(f"{st.url}: lost a race for {LOCK_NAME} of {step_folder(step)}")

    def _stale(self, info: dict) -> str | None:
        """Why the lock described by ``info`` is abandoned, or ``None`` if it may be live."""
        if not info:
            return "unreadable lock"
        if info.get("owner") == self._owner:
            return "left by this manager's own failed save"
        if info.get("host") == socket.gethostname():
            start = _proc_start(int(info.get("pid", -1)))
            if start is None:
                return f"owner pid {info.get('pid')} is gone"
            if info.get("pid_start") is not None and abs(start - float(info["pid_start"])) > 1.0:
                return f"owner pid {info.get('pid')} was reused"
            return None
        age = time.time() - float(info.get("created", 0))
        if age > self.stale_lock_s:
            return f"lock is {age:.0f}s old (stale_lock_s={self.stale_lock_s:g})"
        return None

    @staticmethod
    def _create_exclusive(st: Storage, body: bytes) -> bool:
        """Create the lock object only if absent; ``True`` when this call created it."""
        if not st.atomic_create:
            log.warning("%s: no exclusive create on this storage; the step lock is best effort", st.url)
        return st.create_exclusive(LOCK_NAME, body)

    def _release(self, st: Storage, token: bytes | None) -> None:
        if token is None:
            return
        try:
            if st.get(LOCK_NAME) == token:
                st.delete(LOCK_NAME)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - a leftover lock on a committed step is harmless
            log.warning("could not release %s/%s: %s", st.url, LOCK_NAME, e)

    def _abandon(self, st: Storage, token: bytes | None) -> None:
        """After a failed save (rank 0): drop its partial files, keep any committed manifest."""
        if token is None or self._comm().rank != 0:
            return
        try:
            names = st.list("")
            if claim_is_live(st):
                log.warning("%s: another save is writing here; its files are left alone", st.url)
            elif MANIFEST_NAME not in names:
                for n in names:
                    if n != LOCK_NAME:
                        st.delete(n)
            self._release(st, token)
        except Exception as e:  # noqa: BLE001
            log.warning("could not clean up the failed save in %s: %s", st.url, e)

    # --- listing and retention
    def _scan(self) -> dict[int, _Folder]:
        out: dict[int, _Folder] = {}
        for name in self.storage.list(""):
            top, _, rest = name.partition("/")
            m = _STEP_RE.match(top)
            if not m or not rest:
                continue
            f = out.setdefault(int(m.group(1)), _Folder(int(m.group(1)), top))
            if rest == MANIFEST_NAME:
                f.committed = True
            elif rest == LOCK_NAME:
                f.locked = True
        return out

    def _schedule_retention(self) -> None:
        if self.keep_last is None:
            return
        with self._ret_lock:
            self._ret_requested = True
            if self._ret_thread is None:
                self._ret_thread = threading.Thread(target=self._retention_loop, name="shardpoint-retention", daemon=True)
                self._ret_thread.start()

    def _retention_loop(self) -> None:
        while True:
            with self._ret_lock:
                if not self._ret_requested:
                    self._ret_thread = None
                    return
                self._ret_requested = False
            try:
                self._retention_pass()
            except Exception as e:  # noqa: BLE001 - deletions never stop training
                log.warning("retention under %s failed: %s", self.storage.url, e)
                self.retention_errors.append(f"{type(e).__name__}: {e}")

    def _join_retention(self) -> None:
        while True:
            with self._ret_lock:
                t = self._ret_thread
            if t is None:
                return
            t.join()

    def _retention_pass(self) -> None:
        folders = self._scan()
        complete = sorted(s for s, f in folders.items() if f.committed)
        if not complete:
            return
        newest = complete[-1]
        keep = set(complete if self.keep_last is None else complete[-self.keep_last:])
        if self.keep_every:
            keep.update(s for s in complete if s % self.keep_every == 0)
        keep.add(newest)
        doomed = [s for s in complete if s not in keep]
        with self._guard:
            writing = set(self._writing)
        for s, f in sorted(folders.items()):
            if f.committed or s >= newest or s in writing:
                continue
            if claim_is_live(self.path(s)):
                continue  # a save (not this manager's) is writing there
            if f.locked:
                try:
                    info = json.loads(self.path(s).get(LOCK_NAME))
                except (FileNotFoundError, ValueError):
                    info = {}
                if self._stale(info) is None:
                    continue  # a live save of another job: not ours to remove
            doomed.append(s)
        for s in sorted(doomed):
            with self._guard:
                if s in self._protected or s in self._writing:
                    continue
                self._delete_step(s)

    def _delete_step(self, step: int) -> None:
        """Delete one step folder, manifest first, so it is never seen half-deleted as complete."""
        st = self.path(step)
        names = st.list("")
        if MANIFEST_NAME in names:
            self._hook("retention", step)
            st.delete(MANIFEST_NAME)
            if isinstance(st, LocalStorage):
                _fsync_dir(st.root)
        for n in names:
            if n not in (MANIFEST_NAME, LOCK_NAME):
                self._hook("retention", step)
                st.delete(n)
        st.delete(LOCK_NAME)
        if isinstance(st, LocalStorage):
            for dirpath, _dirs, _files in sorted(os.walk(st.root), key=lambda x: -len(x[0])):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass
        log.info("deleted %s", st.url)

    def _settle(self) -> None:
        """Before a restore: finish the pending save (errors are logged) and wait for deletions."""
        if self._pending is not None:
            try:
                self._complete_pending()
            except CheckpointTimeoutError:
                raise
            except Exception as e:  # noqa: BLE001 - restoring is the recovery
                log.warning("pending save failed before restore: %s", e)
        self._join_retention()
