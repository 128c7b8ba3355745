"""CheckpointManager: when to save, what to keep, where to resume, and hang detection.

One folder per step under a run root (``step_00000100``); a step is complete
exactly when its ``manifest.json`` is committed. "Latest" is always derived
from the committed manifests themselves: the optional ``latest`` file the
manager writes is a hint for people and tools, never read back.

::

    mgr = CheckpointManager("ckpt/run42", interval=100, keep_last=3, mode="lazy")
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
  with the storage's exclusive create (a hard link on a filesystem, an atomic
  insert in memory, a conditional PUT with ``If-None-Match: *`` on S3). A
  second save to the same step finds the lock and raises
  :class:`~shardpoint.ConcurrentSaveError` instead of interleaving its files. A lock
  left by a crashed save is broken when its owner process is gone (same host)
  or the lock is older than ``stale_lock_s``. Object stores without a
  conditional put only get a best-effort check-then-put: there, two jobs
  writing the same run root are not reliably detected.
- **Hangs are reported, not waited on forever; progress is never a hang.**
  Manager collectives run on a private gloo group whose timeout is
  ``timeout``; a background save is waited on until it has made no progress
  (no bytes moved, no phase entered) for ``timeout`` seconds. Either raises
  :class:`CheckpointTimeoutError` naming the rank, step and phase. A watchdog
  thread backs this up for calls that cannot time out by themselves (a stuck
  storage write inside a synchronous save or a restore): once a phase has
  made no progress for ``timeout`` plus a grace period, it logs the rank, the
  phase and every thread's stack and runs ``on_hang``. The default,
  ``"auto"``, exits the process with :data:`HANG_EXIT_CODE` under torchrun
  (so that its agent restarts the group, the reason logged) and otherwise
  makes the phase raise :class:`CheckpointTimeoutError`.

The package has one module per concern: ``policies`` (when to save),
``folders`` (step folders and their listing), ``steplock``, ``retention``,
``restore``, ``watchdog``, ``collectives`` (the private group and typed
timeouts), ``pending`` (the save in flight), ``faults`` (test-only fault
injection), ``bootstrap`` (``init_distributed``), ``options`` (the
constructor's checks) and ``core`` (the manager).
"""

from ..errors import CheckpointTimeoutError, ConcurrentSaveError, deprecated_error
from .bootstrap import init_distributed
from .core import CheckpointManager
from .faults import FAULT_ENV, fault_from_env
from .folders import HINT_NAME, LOCK_NAME, step_folder
from .policies import EveryNSteps, EveryTSeconds, OnDemand, SavePolicy
from .watchdog import HANG_EXIT_CODE, HangReport

__all__ = [
    "CheckpointManager",
    "SavePolicy",
    "EveryNSteps",
    "EveryTSeconds",
    "OnDemand",
    "HangReport",
    "CheckpointTimeoutError",
    "ConcurrentSaveError",
    "step_folder",
    "LOCK_NAME",
    "HINT_NAME",
    "HANG_EXIT_CODE",
    "FAULT_ENV",
    "fault_from_env",
    "init_distributed",
]


def __getattr__(name: str):
    # Deprecated names (CheckpointConflictError) still import, with a DeprecationWarning.
    try:
        return deprecated_error(name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
