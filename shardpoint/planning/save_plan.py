"""The plan of one rank's save: the one frozen value carried from the prepare phase to the write and the commit.

A :class:`SavePlan` holds what this rank saves (its checked tensors, as
references to the live data), which of them it writes (the writer choice),
which may be copied lazily, and the plain facts its description needs. It
is made once by the prepare phase and never changed afterwards: a repeated
save whose tensors are unchanged reuses the kept plan and makes a new value
for its own entries' documents with :meth:`SavePlan.for_save`. What a later
step computes from it, such as the description, is a pure function of it
(:func:`describe_plan`). No collective and no I/O happen here.

Example::

    plan = SavePlan.make(tensors, choice, lazy_ok, replica_ranks={})
    plan = plan.for_save(values, frameworks); len(plan.mine)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ..geometry.grid import Grid
from ..items import SaveTensor
from .describe import CandidateGrids, Description, describe
from .writers import WriterChoice

__all__ = ["SavePlan", "describe_plan"]


@dataclass(frozen=True)
class SavePlan:
    """What one rank saves and writes, checked and planned; frozen once made.

    ``tensors``: every tensor this rank holds, checked (and agreed on, where
    groups or rules are declared); ``choice``: the writer choice
    (:func:`~shardpoint.planning.writers.choose_writers`); ``mine``: the
    tensors this rank writes; ``lazy_ok``: the names a lazy save may copy
    after the call returns; ``replica_ranks``: the global ranks holding
    copies of a plain tensor, by name (names not listed: every rank), as
    the adapters declared them. ``values`` and ``frameworks`` are the
    entries' documents of the save this plan was made for (see
    :meth:`for_save`). ``replicas`` is the rank's pending replica table of
    this save and ``context`` its adapter context: references the write and
    a lazy fence use, never compared.

    Example::

        plan = SavePlan.make(tensors, choice, frozenset(), replica_ranks={}); plan.mine
    """

    tensors: tuple[SaveTensor, ...]
    choice: WriterChoice
    mine: tuple[SaveTensor, ...]
    lazy_ok: frozenset[str] = frozenset()
    replica_ranks: Mapping[str, frozenset[int]] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict)
    frameworks: Mapping[str, Any] = field(default_factory=dict)
    replicas: Any = field(default=None, compare=False, repr=False)
    context: Any = field(default=None, compare=False, repr=False)

    @staticmethod
    def make(
        tensors: Sequence[SaveTensor], choice: WriterChoice, lazy_ok: frozenset[str] = frozenset(), *,
        replica_ranks: Mapping[str, frozenset[int]],
    ) -> "SavePlan":
        """The plan of ``tensors`` written as ``choice`` says, with no entry documents yet.

        Example::

            plan = SavePlan.make(tensors, choose_writers(tensors), replica_ranks={})
        """
        tensors = tuple(tensors)
        return SavePlan(tensors, choice, tuple(tensors[i] for i in choice.picked), frozenset(lazy_ok),
                        dict(replica_ranks))

    def for_save(self, values: Mapping[str, Any], frameworks: Mapping[str, Any], *, replicas: Any = None,
                 context: Any = None) -> "SavePlan":
        """A new plan for one save: these tensors and writers, with that save's documents and references.

        Example::

            plan = kept.for_save({"step": 3}, {"step": "value"})
        """
        return replace(self, values=values, frameworks=frameworks, replicas=replicas, context=context)


def describe_plan(plan: SavePlan, rank: int, world: int, to_group: Callable[[Grid], Grid | None] | None = None) -> Description:
    """``plan``'s description on ``rank`` of ``world`` ranks (``to_group``: global grids to group ranks).

    Depends only on the plan's tensors, writers and replica facts, so a
    repeated save of an unchanged plan may reuse it.

    Example::

        d = describe_plan(plan, comm.rank, comm.world); d.digest
    """
    ranks = plan.replica_ranks
    grids = CandidateGrids(world, ranks.get, to_group)
    return describe(plan.tensors, plan.mine, plan.choice, rank, grids)
