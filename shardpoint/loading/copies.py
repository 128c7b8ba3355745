"""Load-time copy rules: a rank reads the copy of a tensor that its own replica group saved.

A save whose declared groups held one name with different values stores one
copy per group, named ``<name>@ranks<r0>,<r1>,...``
(:func:`shardpoint.planning.replicas.copy_name`). On load, :func:`with_copies`
adds a :class:`CopyRule` that maps each such name to the copy whose ranks
include the loading rank, so the rest of the load sees ordinary names.

Example::

    layouts = with_copies(layouts, manifest.tensors)
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch.distributed as dist

from ..layouts import WholeRule
from ..planning.replicas import copies_of

__all__ = ["CopyRule", "copy_rule", "with_copies"]


class CopyRule(WholeRule):
    """A load rule that reads each name this rank's group saved as its own copy from that copy.

    Built by :func:`copy_rule`; ``names`` maps an ordinary name to the
    stored copy name. The geometry is the identity: only names change.

    Example::

        CopyRule({"model.experts.w": "model.experts.w@ranks2,3"})
    """

    def __init__(self, names: Mapping[str, str]):
        self.names = dict(names)
        self.pattern = ""
        self.dim = 0

    def param_match(self, fqn: str) -> tuple[str, str, str] | None:
        return ("", fqn, "") if fqn in self.names else None

    def logical_name(self, param: str, part: str) -> str:
        return self.names[param]


def copy_rule(names: Iterable[str], rank: int) -> CopyRule | None:
    """The :class:`CopyRule` for global ``rank`` over a checkpoint's tensor ``names``; ``None`` if it saved no copies.

    Example::

        rule = copy_rule(manifest.tensors, dist.get_rank())
    """
    picked = copies_of(names, rank)
    return CopyRule(picked) if picked else None


def with_copies(layouts: Sequence[Any], names: Iterable[str]) -> list[Any]:
    """``layouts`` plus the :class:`CopyRule` of the calling process's global rank, when the checkpoint saved copies.

    Example::

        rules = with_copies(layouts, manifest.tensors)
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    rule = copy_rule(names, rank)
    return list(layouts) if rule is None else [*layouts, rule]
