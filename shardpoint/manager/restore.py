"""Restoring a run: the newest complete step (or a given one), from peer memory or storage.

Rank 0 lists the committed steps, protects them from retention and
broadcasts the list; every rank then loads the newest, falling back to older
ones while a load fails with a checkpoint's own error (corrupt, incomplete,
unreadable, vanished), the same typed error on every rank. With peer memory,
a memory step at least as new as the newest stored one is tried first.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, MutableMapping

from ..api import load as load_checkpoint
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, FormatError, IncompleteCheckpointError, MissingBaseError
from ..peer import RestoreReport
from ..storage import Storage
from .collectives import Collectives
from .folders import committed_steps, step_folder
from .retention import StepsInUse

__all__ = ["LOAD_FALLBACK", "restore_newest"]

log = logging.getLogger("shardpoint")

LOAD_FALLBACK = (CorruptCheckpointError, IncompleteCheckpointError, FormatError, CheckpointNotFoundError, MissingBaseError)
"""Errors of a step's own checkpoint after which ``restore`` tries the next older step."""


def restore_newest(
    storage: Storage,
    state: MutableMapping[str, Any],
    step: int | None,
    *,
    coll: Collectives,
    in_use: StepsInUse,
    memory: Any,
    load_kwargs: dict,
    on_restored: Callable[[RestoreReport], None],
) -> int | None:
    """Load the newest complete step (or ``step``) under ``storage`` into ``state``; return its step.

    ``None`` when there is nothing to restore (``state`` untouched). The last
    fallback error is raised when no candidate loads. ``on_restored`` gets the
    report of the restore that succeeded before anything else runs.
    Collective over ``coll``'s group.

    Example::

        restore_newest(run, state, None, coll=coll, in_use=StepsInUse(), memory=None,
                       load_kwargs={}, on_restored=print)
    """
    comm = coll.comm()
    with coll.watch("restore:list", step):
        cands = None
        if comm.rank == 0:
            cands = in_use.protect(lambda: [s for s in reversed(committed_steps(storage)) if step is None or s == step])
        coll.hook("restore", step)
        cands = coll.run("restore:list", step, lambda: comm.broadcast(cands))
    try:
        if not cands and (memory is None or step is not None):
            if step is not None:
                raise CheckpointNotFoundError(f"{storage.url}: no complete checkpoint at step {step}")
            log.info("rank %s: no checkpoint under %s; starting fresh", comm.rank, storage.url)
            return None
        # Peer memory: a memory step at least as new as the newest stored one wins
        t_restore = time.monotonic()
        if memory is not None and step is None:
            newest = cands[0] if cands else None
            with coll.watch("restore:memory", step):
                rep = coll.run(
                    "restore:memory", step, lambda: memory.restore(state, comm, newer_than=newest, **load_kwargs)
                )
            if rep is not None:
                on_restored(rep)
                log.info("rank %s: restored %s from %s memory", comm.rank, step_folder(rep.step), rep.source)
                return rep.step
        last: BaseException | None = None
        for s in cands:
            try:
                with coll.watch("restore:load", s):
                    coll.run(
                        "restore:load", s,
                        lambda: load_checkpoint(storage.child(step_folder(s)), state, process_group=coll.group(), **load_kwargs),
                    )
            except LOAD_FALLBACK as e:  # the same typed error on every rank
                log.warning("rank %s: %s does not load (%s); trying an older checkpoint", comm.rank, step_folder(s), e)
                last = e
                continue
            # Peer memory: report the source of every restore
            on_restored(RestoreReport(s, "storage", {"total": time.monotonic() - t_restore}, rank_source="storage"))
            if memory is not None:
                memory.forget_newer(s, comm)
            log.info("rank %s: restored %s from %s", comm.rank, step_folder(s), storage.url)
            return s
        if last is None:  # peer memory held nothing and storage is empty
            log.info("rank %s: no checkpoint in memory or under %s; starting fresh", comm.rank, storage.url)
            return None
        raise last
    finally:
        if comm.rank == 0:
            in_use.release(cands or ())
