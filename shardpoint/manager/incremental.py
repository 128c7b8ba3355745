"""The manager's incremental saves: the base of each save, and the data its kept steps reference.

With ``CheckpointManager(..., incremental=True)`` every save uses the newest
committed step of the run as its base (:func:`newest_base`), so it writes
only what changed. Retention then deletes a step's manifest and index files
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
from typing import Iterable

from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.strict import Limits
from ..storage import Storage
from .folders import committed_steps, step_folder

__all__ = ["newest_base", "referenced_by", "check_incremental", "base_keywords"]

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
    """Refuse ``incremental=True`` with background saves (it takes blocking ones: ``mode=None``).

    Example::

        check_incremental(True, None)   # True
    """
    if incremental and mode is not None:
        raise ValueError(
            f"CheckpointManager(incremental=True) saves with mode=None (blocking saves); got mode={mode!r}. "
            "Give mode=None, or incremental=False for background saves"
        )
    return bool(incremental)


def base_keywords(storage: Storage, step: int, incremental: bool) -> dict:
    """The save keywords of ``step``'s save under the run root ``storage``: ``{"base": newest step}`` or none.

    Example::

        sp.save(run.child(step_folder(300)), state, **base_keywords(run, 300, True))
    """
    base = newest_base(storage, step) if incremental else None
    return {} if base is None else {"base": base}
