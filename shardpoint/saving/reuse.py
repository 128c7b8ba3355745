"""What a saver reuses from one save to the next, under one rule.

A saver that checkpoints the same training state again and again (an
:class:`~shardpoint.AsyncSaver`, peer memory, pre-warming) keeps what the
previous save made: each entry's adapter part, the writer choice, and the
checked and described tensors. One rule says when a kept result may be used:

    A result is kept with the fingerprint of everything it was made from. It
    is reused only when the fingerprint made now is equal; otherwise it is
    made again and replaces the kept one. A result without a fingerprint
    (``None``) is made every time and never kept.

Each kind of result is a *slot* of one :class:`SaveCache`, and only the last
result of each slot is kept, so memory does not grow from save to save. The
fingerprints are:

- an entry's part (``("part", key)``): the object itself, its adapter, the
  context's replica facts and the adapter's
  :meth:`~shardpoint.adapters.Adapter.fingerprint` (the object graph);
- the checked save (``"checked"``): the very :class:`SaveTensor` objects
  that came out of the parts, so it holds exactly when every part was reused;
- the writer choice (``"plan"``): the tensors' names, shapes, dtypes,
  geometry and replica facts (:func:`~shardpoint.planning.writers.plan_signature`).

Example::

    cache = SaveCache()
    choice = cache.reuse("plan", plan_signature(tensors), lambda: choose_writers(tensors))[0]
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Hashable, TypeVar

__all__ = ["SaveCache"]

T = TypeVar("T")


class SaveCache:
    """The results one saver keeps across its saves (one per process group), each with its fingerprint.

    ``reused`` counts the reuses per slot kind (``"part"``, ``"checked"``,
    ``"plan"``), for tests and metrics.

    Example::

        part, hit = cache.reuse(("part", "model"), fp, lambda: adapter.save("model", model, ctx))
    """

    def __init__(self) -> None:
        self._kept: dict[Hashable, tuple[Any, Any]] = {}
        self.reused: Counter[str] = Counter()

    def reuse(self, slot: Hashable, fingerprint: Any, make: Callable[[], T]) -> tuple[T, bool]:
        """The result kept in ``slot`` if its fingerprint equals ``fingerprint``, else ``make()`` (kept).

        Returns the result and whether it was reused. Fingerprints are
        compared with ``==`` (objects in them by identity first), never hashed.
        """
        kept = self._kept.get(slot)
        if fingerprint is not None and kept is not None and kept[0] == fingerprint:
            self.reused[slot[0] if isinstance(slot, tuple) else slot] += 1
            return kept[1], True
        value = make()
        if fingerprint is None:
            self._kept.pop(slot, None)
        else:
            self._kept[slot] = (fingerprint, value)
        return value, False

    def forget(self, slot: Hashable) -> None:
        """Drop what ``slot`` keeps (a result found stale after it was reused).

        Example::

            cache.forget("checked")
        """
        self._kept.pop(slot, None)
