"""What the ranks compare of their :class:`~shardpoint.Reduced` tensors before reducing them.

A reduction pairs the tensors of the ranks element by element, so it is
only defined when every rank of the save holds each reduced tensor with
the same shape and dtype, under the same operation. The save's agreement
(:mod:`shardpoint.saving.agree`) sends one row per reduced tensor with its
first exchange (:func:`fact_rows`: a key of the name and a key of the
facts) and reduces only when every rank sent the same rows. Otherwise the
ranks, who all see the same tables, gather the facts by name once
(:func:`mismatch_error`) and every rank raises the same
:class:`~shardpoint.errors.UnsupportedStateError`, naming the tensor, the
ranks and what each holds, with nothing written.

Example::

    facts = [ReducedFact("extra.ema", (3,), "float32", "mean")]
    rows = fact_rows(facts)  # int64 [1, 6], sent with the first exchange
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import xxhash

from ..errors import UnsupportedStateError
from ..items import SaveTensor, dtype_name
from ..layouts import Reduced

__all__ = ["MARK", "ReducedFact", "facts_of", "fact_rows", "fact_keys", "mismatch_error"]

MARK = -(1 << 63) + 1  # the first column of a Reduced tensor's row (the failed marker is -(1 << 63))


@dataclass(frozen=True)
class ReducedFact:
    """One reduced tensor as this rank holds it: its name, shape, dtype and the rule's operation.

    Example::

        ReducedFact("extra.ema", (3,), "float32", "mean").held  # 'float32[3] (mean)'
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    op: str

    @property
    def held(self) -> str:
        """How a message names what a rank holds."""
        return f"{self.dtype}[{', '.join(map(str, self.shape))}] ({self.op})"

    def row(self) -> list[int]:
        """This fact as an int64 row: the marker, a key of the name, a key of shape, dtype and operation."""
        return [MARK, _key(self.fqn), _key((self.shape, self.dtype, self.op)), 0, 0, 0]


def _key(value: object) -> int:
    return xxhash.xxh3_64_intdigest(repr(value).encode()) >> 1  # non-negative: never a marker


def facts_of(tensors: Sequence[SaveTensor], reduced: Mapping[int, Reduced]) -> list[ReducedFact]:
    """The facts of the tensors at the positions of ``reduced``, by name.

    Example::

        facts_of(tensors, {3: Reduced("extra.ema")})
    """
    facts = [ReducedFact(tensors[i].fqn, tuple(tensors[i].data.shape), dtype_name(tensors[i].data.dtype), rule.op)
             for i, rule in reduced.items()]
    return sorted(facts, key=lambda f: f.fqn)


def fact_rows(facts: Sequence[ReducedFact]) -> torch.Tensor:
    """``facts`` as an int64 ``[n, 6]`` table, one row each.

    Example::

        fact_rows([ReducedFact("extra.ema", (3,), "float32", "mean")]).shape  # (1, 6)
    """
    return torch.tensor([f.row() for f in facts], dtype=torch.int64).reshape(len(facts), 6)


def fact_keys(table: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A received table without its Reduced rows, and those rows' keys (name, facts), sorted.

    Example::

        rows, keys = fact_keys(table)
    """
    mine = table[:, 0] == MARK
    keys = sorted((int(a), int(b)) for a, b in table[mine][:, 1:3].tolist())
    return table[~mine], keys


def mismatch_error(where: str, held: Sequence[Sequence[ReducedFact]]) -> UnsupportedStateError:
    """The error for ranks whose Reduced tensors differ; ``held[r]`` is rank ``r``'s facts.

    Names the first tensor (by name) whose facts differ, which ranks hold
    what (or nothing), and the fix. Every rank makes the same message from
    the same facts.

    Example::

        mismatch_error("ckpt", [[ReducedFact("e", (3,), "float32", "mean")], [ReducedFact("e", (4,), "float32", "mean")]])
    """
    by_rank = [{f.fqn: f for f in facts} for facts in held]
    names = sorted({n for facts in by_rank for n in facts})
    fqn = next(n for n in names if len({facts.get(n) for facts in by_rank}) > 1)
    groups: dict[str, list[int]] = {}
    for rank, facts in enumerate(by_rank):
        f = facts.get(fqn)
        groups.setdefault(f.held if f is not None else "no tensor of that name", []).append(rank)
    sides = ", ".join(f"rank(s) {ranks} hold {what}" for what, ranks in sorted(groups.items(), key=lambda kv: kv[1]))
    return UnsupportedStateError(
        f"{where}: Reduced tensor {fqn!r} differs between ranks: {sides}. A Reduced tensor is reduced element by "
        f"element across the ranks, so it needs the same shape and dtype on every rank (and the same rule): give "
        f"{fqn!r} one shape and dtype everywhere, or leave it out of the Reduced rule and save it per rank under "
        f"a per-rank name; nothing was written"
    )
