"""The manager's incremental saves: the base of each save, and the data its kept steps reference.

With ``CheckpointManager(..., incremental=True)`` every save, blocking or in
the background, uses the newest committed step of the run as its base, so
it writes only what changed. The base is chosen when the save opens it (a
background save: on its writer; the manager starts a save only after the
previous one committed) and protected from retention in the same move,
until the save ends (:class:`BaseLease`): a retention pass never deletes
an in-flight save's base, nor, as that base stays kept, the data it
references. A base removed by hand before then is simply not chosen (the
newest step left is, or none: the save is written in full). Retention then deletes a step's manifest and index files
as always, but of its data files only those that no kept step references
(:func:`referenced_by`): a referenced data file stays in the folder of the
step that wrote it (references always name that folder) until the last kept
step referring to it is deleted, and the next pass removes it then. A
file kept steps reference only in part shrinks to the chunks they use
(:mod:`shardpoint.manager.compact`).

Example::

    base = newest_base(run, 300)            # the storage of step 200, or None
    spare = referenced_by(run, [200, 300])  # {"step_00000100": {"data/ab-r00000.bin"}}
"""

from __future__ import annotations

import logging
import posixpath
import threading
from typing import Any, Iterable

from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.strict import Limits
from ..saving.incremental import ChosenBase
from ..storage import Storage
from .folders import committed_steps, step_folder

__all__ = ["newest_base", "referenced_by", "check_incremental", "base_keywords", "BaseLease"]

log = logging.getLogger("shardpoint")


def newest_base(storage: Storage, step: int) -> Storage | None:
    """The storage of the newest committed step before ``step`` under the run root ``storage``, or ``None``.

    Example::

        base = newest_base(run, 300)
    """
    before = [s for s in committed_steps(storage) if s < step]
    return storage.child(step_folder(before[-1])) if before else None


def referenced_by(storage: Storage, steps: Iterable[int]) -> dict[str, set[str]] | None:
    """The data files of other step folders that the manifests of ``steps`` reference, by folder name.

    ``None`` when a manifest cannot be read or parsed: the caller then
    deletes no data (it cannot know what is referenced).

    Example::

        referenced_by(run, [200, 300])  # {"step_00000100": {"data/ab-r00000.bin"}}
    """
    out: dict[str, set[str]] = {}
    limit = Limits.from_env().manifest_bytes
    for s in steps:
        folder = step_folder(s)
        try:
            m = Manifest.from_json(storage.child(folder).get_limited(MANIFEST_NAME, limit), f"{storage.url}/{folder}")
        except Exception as e:  # noqa: BLE001 - unreadable: nothing is deleted this pass
            log.warning("%s: cannot read the manifest of %s (%s); no data deleted this pass", storage.url, folder, e)
            return None
        for ref in m.refs:
            holder = posixpath.normpath(posixpath.join(folder, ref.base))
            if "/" not in holder and not holder.startswith(".."):  # a step folder of this run
                out.setdefault(holder, set()).add(ref.data)
    return out


def check_incremental(incremental: bool, mode: str | None) -> bool:
    """Whether the manager's saves are incremental; every save mode takes them (``mode`` is checked elsewhere).

    Example::

        check_incremental(True, "lazy")   # True
    """
    return bool(incremental)


class BaseLease:
    """The base of one incremental manager save, chosen when the save opens it and protected until it ends.

    :meth:`choose` (called by the save: a background one on its writer,
    after the previous save committed) lists the run, takes the newest
    committed step before ``step`` and protects it from retention in the
    same move (:meth:`StepsInUse.protect <shardpoint.manager.retention.StepsInUse.protect>`),
    so no retention pass deletes it, nor the data its own references keep,
    between the choice and the commit. :meth:`release` (the manager, once
    the save committed or failed) ends the protection; a choice made after
    it protects nothing and writes in full.

    Example::

        lease = BaseLease(run, 300, in_use)
        lease.choose()    # the storage of step 200, now protected
        lease.release()
    """

    def __init__(self, storage: Storage, step: int, in_use: Any):
        self.storage = storage
        self.step = step
        self.in_use = in_use
        self._lock = threading.Lock()
        self._held: list[int] = []
        self._ended = False

    def choose(self) -> Storage | None:
        """The newest committed step before this save's, protected from retention; ``None`` when there is none."""
        with self._lock:
            if self._ended:
                return None
            self._held = self.in_use.protect(lambda: [s for s in committed_steps(self.storage) if s < self.step][-1:])
            return self.storage.child(step_folder(self._held[0])) if self._held else None

    def release(self) -> None:
        """The save committed or failed: its base may be deleted by retention again."""
        with self._lock:
            self._ended = True
            held, self._held = self._held, []
        self.in_use.release(held)


def base_keywords(storage: Storage, step: int, incremental: bool, in_use: Any) -> tuple[dict, BaseLease | None]:
    """The save keywords of ``step``'s save under the run root ``storage`` (``{"base": ...}`` or none) and its lease.

    ``in_use``: the manager's :class:`~shardpoint.manager.retention.StepsInUse`,
    which protects the base until :meth:`BaseLease.release`.

    Example::

        kw, lease = base_keywords(run, 300, True, in_use)
        sp.save(run.child(step_folder(300)), state, **kw); lease.release()
    """
    if not incremental:
        return {}, None
    lease = BaseLease(storage, step, in_use)
    return {"base": ChosenBase(lease.choose)}, lease
