"""Which rank writes which replicated chunk: deterministic, balanced, no communication.

Every rank holding a copy computes the same assignment from rank-independent
facts (name, copy count, global cost), so replicated tensors are written
exactly once with no gather of plans. Greedy largest-first onto the least
loaded copy index balances the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["ReplicaItem", "assign_writers"]


@dataclass(frozen=True)
class ReplicaItem:
    """A chunk held by ``count`` ranks; ``cost`` must be the same on all of them."""

    fqn: str
    count: int
    cost: float


def assign_writers(items: Iterable[ReplicaItem]) -> dict[str, int]:
    """Map each name to the copy index (``0 <= i < count``) that writes it.

    Example::

        >>> assign_writers([ReplicaItem("a", 2, 10), ReplicaItem("b", 2, 10)])
        {'a': 0, 'b': 1}
    """
    ordered = sorted(items, key=lambda it: (-it.cost, it.fqn))
    width = max((it.count for it in ordered), default=1)
    load = [0.0] * width
    out: dict[str, int] = {}
    for it in ordered:
        if it.count <= 1:
            out[it.fqn] = 0
            continue
        best = min(range(it.count), key=lambda i: (load[i], i))
        load[best] += it.cost
        out[it.fqn] = best
    return out
