"""The layout rule language: how one physical tensor maps onto logical tensors along one dim.

:class:`Fused` and :class:`Padded` cut a physical dim into :class:`Segment` s
of logical tensors; :class:`WholeRule` renames a tensor whole; :class:`Reduced`
saves a per-rank tensor as one reduced value. Applying rules to the tensors
of a save or load is :mod:`shardpoint.layouts.apply`; renaming optimizer state
by them is :mod:`shardpoint.layouts.naming`. Example::

    rules = [Fused("*.mlp.w13.weight", dim=0, parts=[("w1", 14336), ("w3", 14336)])]
    rule, match = find_rule(rules, "layers.0.mlp.w13.weight")
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import UnsupportedStateError

__all__ = ["Segment", "Rule", "WholeRule", "Fused", "Padded", "Reduced", "find_rule"]


@dataclass(frozen=True)
class Segment:
    """Physical ``[start, start + length)`` along the rule's dim holds ``name`` from ``logical_start``."""

    start: int
    length: int
    name: str | None  # None: padding, not stored
    logical_start: int


class Rule:
    """Base class of layout rules; see the module documentation."""

    pattern: str
    dim: int

    def segments(self, phys_len: int) -> list[Segment]:
        raise NotImplementedError

    def logical_len(self, name: str, phys_len: int) -> int:
        return sum(s.length for s in self.segments(phys_len) if s.name == name)

    def part_names(self) -> list[str]:
        raise NotImplementedError

    def physical_len(self, logical: Mapping[str, int]) -> int:
        raise NotImplementedError

    # Names -------------------------------------------------------------
    def param_match(self, fqn: str) -> tuple[str, str, str] | None:
        """Split ``fqn`` into (prefix, param name, suffix) if the rule applies to it."""
        if fnmatch.fnmatchcase(fqn, self.pattern) or fnmatch.fnmatchcase(fqn, "*." + self.pattern):
            return "", fqn, ""
        marker = ".state."
        i = fqn.find(marker)
        if i >= 0:
            rest = fqn[i + len(marker):]
            param, _, key = rest.rpartition(".")
            if param and (fnmatch.fnmatchcase(param, self.pattern) or fnmatch.fnmatchcase(param, "*." + self.pattern)):
                return fqn[: i + len(marker)], param, "." + key
        return None

    def logical_name(self, param: str, part: str) -> str:
        comps = param.split(".")
        if len(comps) < 2:
            return part if part else param
        comps[-2] = part
        return ".".join(comps)


class WholeRule(Rule):
    """A rule that renames a physical tensor to one logical tensor, element for element (no split, no padding).

    Example::

        class Renamed(WholeRule):
            def logical_name(self, param, part): return "new." + param
    """

    def segments(self, phys_len: int) -> list[Segment]:
        return [Segment(0, phys_len, "", 0)]

    def part_names(self) -> list[str]:
        return [""]

    def physical_len(self, logical: Mapping[str, int]) -> int:
        return logical[""]


@dataclass(frozen=True)
class Fused(Rule):
    """Several logical tensors concatenated (optionally group-interleaved) along ``dim``."""

    pattern: str
    dim: int
    parts: tuple[tuple[str, int], ...]
    groups: int = 1

    def __init__(self, pattern: str, dim: int, parts: Sequence[tuple[str, int]], groups: int = 1):
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "dim", int(dim))
        object.__setattr__(self, "parts", tuple((str(n), int(k)) for n, k in parts))
        object.__setattr__(self, "groups", int(groups))
        if self.groups < 1 or not self.parts or any(k <= 0 for _, k in self.parts):
            raise ValueError(f"bad Fused rule {pattern!r}: groups and part sizes must be positive")

    def segments(self, phys_len: int) -> list[Segment]:
        per = sum(k for _, k in self.parts)
        if per * self.groups != phys_len:
            raise UnsupportedStateError(
                f"layout rule {self.pattern!r}: dim {self.dim} has {phys_len} entries, the rule describes "
                f"{self.groups} x {per}"
            )
        out, pos = [], 0
        for g in range(self.groups):
            for name, k in self.parts:
                out.append(Segment(pos, k, name, g * k))
                pos += k
        return out

    def part_names(self) -> list[str]:
        return [n for n, _ in self.parts]

    def physical_len(self, logical: Mapping[str, int]) -> int:
        return sum(k for _, k in self.parts) * self.groups


@dataclass(frozen=True)
class Padded(Rule):
    """Only the first ``size`` entries along ``dim`` are real; the rest is padding."""

    pattern: str
    dim: int
    size: int

    def segments(self, phys_len: int) -> list[Segment]:
        if phys_len < self.size:
            raise UnsupportedStateError(f"layout rule {self.pattern!r}: {phys_len} entries, fewer than size {self.size}")
        segs = [Segment(0, self.size, "", 0)]
        if phys_len > self.size:
            segs.append(Segment(self.size, phys_len - self.size, None, 0))
        return segs

    def part_names(self) -> list[str]:
        return [""]

    def logical_name(self, param: str, part: str) -> str:
        return param

    def physical_len(self, logical: Mapping[str, int]) -> int:
        raise UnsupportedStateError(f"layout rule {self.pattern!r}: the padded size comes from the target")


@dataclass(frozen=True)
class Reduced:
    """A plain tensor that differs per rank and is saved as one reduced value.

    ``op`` is ``"mean"`` or ``"sum"``: at save time the copies of every rank in
    the group are reduced (a collective) and stored once; every rank loads the
    reduced value. Use it for running statistics kept per data-parallel rank.

    Example::

        sp.save(path, state, layouts=[sp.Reduced("extra.loss_ema", op="mean")])
    """

    pattern: str
    op: str = "mean"

    def __post_init__(self) -> None:
        if self.op not in ("mean", "sum"):
            raise ValueError(f"Reduced op must be 'mean' or 'sum', got {self.op!r}")

    def matches(self, fqn: str) -> bool:
        return fnmatch.fnmatchcase(fqn, self.pattern)


def find_rule(rules: Sequence[Rule], fqn: str) -> tuple[Rule, tuple[str, str, str]] | tuple[None, None]:
    """The first :class:`Rule` among ``rules`` that matches ``fqn``, with its match; ``(None, None)`` if none does.

    The match is ``(prefix, parameter, suffix)`` (:meth:`Rule.param_match`);
    entries that are not rules (a :class:`Reduced`) are skipped.

    Example::

        rule, (prefix, param, suffix) = find_rule([Fused("*.wqkv.weight", 0, [("wq", 4), ("wk", 2)])], "l0.wqkv.weight")
    """
    for r in rules:
        if not isinstance(r, Rule):
            continue
        m = r.param_match(fqn)
        if m is not None:
            return r, m
    return None, None


