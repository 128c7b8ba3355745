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
result of each slot is kept, so memory does not grow from save to save. Kept
results are frozen values (a :class:`~shardpoint.planning.save_plan.SavePlan`,
a writer choice, a description): nothing assigns to them after they are
kept, and a save that needs more makes a new value from them. The slots and
their fingerprints are:

- the context facts (``"facts"``, see
  :class:`~shardpoint.adapters.context.StateFacts`): the registry, the
  state's keys, objects (by identity), their types and claiming adapters,
  and the fingerprint of each entry whose adapter gave facts (made under
  the kept facts, so it holds exactly when those facts would be given
  again);
- an entry's part (``("part", key)``): the object itself, its adapter, the
  context's replica facts and the adapter's
  :meth:`~shardpoint.adapters.Adapter.fingerprint` (the object graph);
- the checked plan (``"checked"``): the very :class:`SaveTensor` objects
  that came out of the parts (by identity, :class:`SameItems`), so it holds
  exactly when every part was reused, plus whether the save is rank-local
  and declares groups;
- the writer choice (``"plan"``): the tensors' names, shapes, dtypes,
  geometry and replica facts (:func:`~shardpoint.planning.writers.plan_signature`);
- the tensors a reused plan's replica check compares (``"held"``): the
  plan's tensors (by identity);
- the description (``"described"``): the plan it describes (by identity)
  and the rank, world and group it is described on;
- an asynchronous save's copy order (``"copy order"``, see
  :mod:`shardpoint.saving.copy_order`), which holds the live tensors the
  steps update: the items this rank writes (by identity), the names it
  copies lazily, and the kept parts of the stepped entries (by identity: a
  part reused means the same parameters, names and state); where a stepped
  entry has no kept part, the live tensors themselves (by identity, in order).

A save's :attr:`~shardpoint.SaveResult.plan_cached` says one thing: its
writer choice was reused, from the checked plan or from the writer choice
slot, so no writers were chosen again.

Example::

    cache = SaveCache()
    choice = cache.reuse("plan", plan_signature(tensors), lambda: choose_writers(tensors))[0]
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Callable, Hashable, Iterable, TypeVar

__all__ = ["SaveCache", "Same", "SameItems"]

T = TypeVar("T")


class Same:
    """A fingerprint part equal only to one holding the very same object (compared by identity, never by value).

    It keeps the object alive, so no later object can take its identity.

    Example::

        assert Same(t) == Same(t) and Same(t) != Same(t2)
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class SameItems:
    """A fingerprint part equal only to one holding the very same objects, in the same order (by identity).

    One comparison for a whole sequence (a save's tensors), kept alive as :class:`Same` keeps its object.

    Example::

        assert SameItems([a, b]) == SameItems((a, b)) and SameItems([a, b]) != SameItems([b, a])
    """

    __slots__ = ("items",)

    def __init__(self, items: Iterable[Any]):
        self.items = tuple(items)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SameItems) or len(other.items) != len(self.items):
            return False
        return all(map(operator.is_, self.items, other.items))

    def __hash__(self) -> int:
        return hash(tuple(map(id, self.items)))


class SaveCache:
    """The results one saver keeps across its saves (one per process group), each with its fingerprint.

    ``reused`` counts the reuses per slot kind (``"part"``, ``"checked"``,
    ``"plan"``, ``"described"``), for tests and metrics.

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
        if self.holds(slot, fingerprint):
            return self._kept[slot][1], True
        value = make()
        self.keep(slot, fingerprint, value)
        return value, False

    def holds(self, slot: Hashable, fingerprint: Any) -> bool:
        """Whether ``slot`` keeps a result made under a fingerprint equal to ``fingerprint`` (counted as a reuse).

        Example::

            if cache.holds("facts", fp): facts = cache.kept("facts")
        """
        kept = self._kept.get(slot)
        if fingerprint is None or kept is None or not kept[0] == fingerprint:
            return False
        self.reused[slot[0] if isinstance(slot, tuple) else slot] += 1
        return True

    def kept(self, slot: Hashable) -> Any | None:
        """The result ``slot`` keeps, whatever its fingerprint (``None``: nothing kept).

        For a result whose fingerprint is made with the kept result's help:
        the caller makes it, then asks :meth:`holds`.

        Example::

            facts = cache.kept("facts")
        """
        kept = self._kept.get(slot)
        return None if kept is None else kept[1]

    def keep(self, slot: Hashable, fingerprint: Any, value: Any) -> None:
        """Keep ``value`` in ``slot`` under ``fingerprint``; a ``None`` fingerprint keeps nothing there.

        Example::

            cache.keep("facts", fp, facts)
        """
        if fingerprint is None:
            self._kept.pop(slot, None)
        else:
            self._kept[slot] = (fingerprint, value)

    def forget(self, slot: Hashable) -> None:
        """Drop what ``slot`` keeps: a result found to depend on more than its fingerprint is not kept.

        Example::

            cache.forget("checked")
        """
        self._kept.pop(slot, None)
