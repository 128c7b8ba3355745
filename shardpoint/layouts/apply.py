"""A declarative layout language: stored tensors as views of logical tensors.

Some tensors a framework keeps are not plain shards of one logical tensor: a
fused QKV projection (with grouped-query attention), a fused gate/up
projection, a vocabulary padded to a multiple of the TP size. A *rule* says how
such a physical tensor maps onto logical ones along one dimension; the
checkpoint then stores only logical tensors, and any layout (fused or not,
any TP degree, one process) loads them. Rules resolve at save and load time:
no offline conversion, no temporary tree.

The physical tensor is the framework's *global* tensor, whose shards the
DTensor placements describe. Along ``dim`` it is cut into segments, each a
contiguous range of one logical tensor; a shard box is split by intersecting
it with the segments, which is the same box arithmetic as resharding.

Rules:

- :class:`Fused`: ``parts`` are ``(name, rows per group)``; the physical dim
  repeats ``groups`` times ``[part0, part1, ...]``. ``groups=1`` is a plain
  concatenation (gate/up); Megatron-style GQA QKV is ``groups=num_kv_heads``
  with parts ``(("wq", q_per_group * head_dim), ("wk", head_dim), ("wv", head_dim))``.
- :class:`Padded`: only the first ``size`` entries along ``dim`` are real; the
  padding is not stored and is zero-filled on load.

Names: ``pattern`` is a glob over parameter names (``"*.attn.wqkv.weight"``).
A matched name's module component (``wqkv``) is replaced by each part's name
(``wq``, ``wk``, ``wv``); optimizer state of that parameter
(``<opt>.state.<param>.<key>``) follows the same rule.

Example (a Llama block whose QKV and gate/up are fused)::

    rules = [
        sp.Fused("*.attn.wqkv.weight", dim=0, groups=8,
                 parts=[("wq", 4 * 128), ("wk", 128), ("wv", 128)]),
        sp.Fused("*.mlp.w13.weight", dim=0, parts=[("w1", 14336), ("w3", 14336)]),
        sp.Padded("tok.weight", dim=0, size=128256),
    ]
    sp.save(path, state, layouts=rules)   # stores wq, wk, wv, w1, w3, tok (unpadded)
    sp.load(path, state, layouts=rules)   # or load into an unfused model with no rules
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import torch

from ..items import LoadTarget, SaveTensor
from ..errors import UnsupportedStateError
from ..format.manifest import TensorMeta
from ..geometry import Box

__all__ = [
    "WholeRule",
    "Fused",
    "Padded",
    "Reduced",
    "apply_reduce",
    "Rule",
    "Segment",
    "apply_save",
    "apply_load",
    "LayoutView",
    "optimizer_doc_to_logical",
    "optimizer_doc_to_physical",
]


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


def apply_reduce(tensors: list[SaveTensor], rules: Sequence, comm) -> list[SaveTensor]:
    """Reduce tensors matched by :class:`Reduced` rules across the group (same order on every rank)."""
    reds = [r for r in rules if isinstance(r, Reduced)]
    if not reds:
        return tensors

    out = []
    for t in tensors:
        rule = next((r for r in reds if r.matches(t.fqn)), None)
        if rule is None:
            out.append(t)
            continue
        if t.replica_count != comm.world or t.flat is not None:
            raise UnsupportedStateError(f"{t.fqn}: Reduced applies to plain tensors held by every rank")
        data = t.data.detach().clone()
        if comm.active and comm.world > 1:
            comm.all_reduce(data)
            if rule.op == "mean":
                data = data / comm.world if data.is_floating_point() else data // comm.world
        out.append(replace(t, data=data, placement=f"reduced:{rule.op}"))
    return out


def _find(rules: Sequence[Rule], fqn: str):
    for r in rules:
        if not isinstance(r, Rule):
            continue
        m = r.param_match(fqn)
        if m is not None:
            return r, m
    return None, None


def _pieces(rule: Rule, box: Box, phys_shape: tuple[int, ...]):
    """(segment, physical sub-box, logical box offset along dim) for each segment the box touches."""
    d = rule.dim
    lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
    for seg in rule.segments(phys_shape[d]):
        a, b = max(lo, seg.start), min(hi, seg.start + seg.length)
        if a >= b:
            continue
        yield seg, a, b


def _logical_shape(rule: Rule, phys_shape, name: str) -> tuple[int, ...]:
    shape = list(phys_shape)
    shape[rule.dim] = rule.logical_len(name, phys_shape[rule.dim])
    return tuple(shape)


def _split(rule: Rule, m, fqn: str, box: Box, shape: tuple[int, ...]):
    """Each segment a shard box touches: (segment, lo, hi, logical name, logical box, logical shape).

    Padding segments come back with ``None`` for the name, box and shape.
    """
    prefix, param, suffix = m
    d = rule.dim
    for seg, a, b in _pieces(rule, box, shape):
        if seg.name is None:
            yield seg, a, b, None, None, None
            continue
        offs, sizes = list(box.offsets), list(box.sizes)
        offs[d] = seg.logical_start + (a - seg.start)
        sizes[d] = b - a
        name = prefix + rule.logical_name(param, seg.name) + suffix
        yield seg, a, b, name, Box(tuple(offs), tuple(sizes)), _logical_shape(rule, shape, seg.name)


def _scalar_names(rule: Rule, m) -> list[str]:
    prefix, param, suffix = m
    return [prefix + rule.logical_name(param, n) + suffix for n in rule.part_names()]


def apply_save(tensors: Iterable[SaveTensor], rules: Sequence[Rule]) -> list[SaveTensor]:
    """Replace physical tensors matched by a rule with their logical pieces.

    Group-interleaved parts give one rank several boxes of one logical tensor:
    they become separate chunks.
    """
    out = []
    for t in tensors:
        rule, m = _find(rules, t.fqn)
        if rule is None:
            out.append(t)
            continue
        if t.flat is not None:
            if isinstance(rule, WholeRule):  # a rename: the flat range stays what it is
                out.append(replace(t, fqn=_scalar_names(rule, m)[0]))
                continue
            raise UnsupportedStateError(f"{t.fqn}: layout rules do not apply to flat-parameter shards yet")
        d = rule.dim
        if len(t.shape) <= d:
            # Per-parameter scalars (an optimizer's step) belong to every logical part.
            out.extend(replace(t, fqn=n) for n in _scalar_names(rule, m))
            continue
        for seg, a, b, name, box, shape in _split(rule, m, t.fqn, t.box, t.shape):
            if name is None:
                continue
            data = t.data.narrow(d, a - t.box.offsets[d], b - a)
            frac = (b - a) / max(1, t.box.sizes[d])
            out.append(replace(t, fqn=name, data=data, shape=shape, box=box, cost=t.cost * frac))
    return out


def apply_load(targets: Iterable[LoadTarget], rules: Sequence[Rule]) -> list[LoadTarget]:
    """Replace physical targets with logical ones; zero the padding they leave."""
    out = []
    for t in targets:
        rule, m = _find(rules, t.fqn)
        if rule is None:
            out.append(t)
            continue
        if t.flat is not None:
            if isinstance(rule, WholeRule):
                out.append(replace(t, fqn=_scalar_names(rule, m)[0]))
                continue
            raise UnsupportedStateError(f"{t.fqn}: layout rules do not apply to flat-parameter targets yet")
        d = rule.dim
        if len(t.shape) <= d:
            out.append(replace(t, fqn=_scalar_names(rule, m)[0]))
            continue
        dest = t.dest if t.dest.dim() == len(t.box.sizes) else t.dest.view(t.box.sizes)
        for seg, a, b, name, box, shape in _split(rule, m, t.fqn, t.box, t.shape):
            view = dest.narrow(d, a - t.box.offsets[d], b - a)
            if name is None:
                with torch.no_grad():
                    view.zero_()
                continue
            out.append(LoadTarget(name, view, shape, box))
    return out


class LayoutView(Mapping[str, TensorMeta]):
    """The manifest's tensors as the *target* model names them.

    Adapters look tensors up by physical names; for names a rule matches this
    answers with a synthetic entry (dtype of the logical parts, the physical
    shape) so that shape checks pass and targets are built; the api then maps
    the targets back to logical names with :func:`apply_load`.
    """

    def __init__(self, tensors: Mapping[str, TensorMeta], rules: Sequence[Rule], phys_shapes: Mapping[str, tuple]):
        self._t = tensors
        self._rules = rules
        self._phys = phys_shapes

    def __getitem__(self, fqn: str) -> TensorMeta:
        rule, m = _find(self._rules, fqn)
        if rule is None:
            return self._t[fqn]
        prefix, param, suffix = m
        metas = [self._t.get(prefix + rule.logical_name(param, n) + suffix) for n in rule.part_names()]
        if any(x is None for x in metas):
            raise KeyError(fqn)
        if len(metas[0].shape) <= rule.dim:
            return metas[0]
        shape = self._phys.get(param)
        if shape is None:
            shape = list(metas[0].shape)
            shape[rule.dim] = rule.physical_len({n: x.shape[rule.dim] for n, x in zip(rule.part_names(), metas)})
            shape = tuple(shape)
        return TensorMeta(metas[0].dtype, tuple(shape), ())

    def logical_names(self, fqn: str) -> list[str]:
        rule, m = _find(self._rules, fqn)
        if rule is None:
            return [fqn]
        prefix, param, suffix = m
        return [prefix + rule.logical_name(param, n) + suffix for n in rule.part_names()]

    def __iter__(self):
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def __contains__(self, fqn) -> bool:
        try:
            self[fqn]
            return True
        except KeyError:
            return False

    def get(self, fqn, default=None):
        try:
            return self[fqn]
        except KeyError:
            return default




def _rename_refs(doc, fn):
    """Copy a value document, renaming tensor references with ``fn``."""
    if isinstance(doc, dict):
        if doc.get("__sp__") == "tensor":
            return {"__sp__": "tensor", "key": fn(doc["key"])}
        return {k: _rename_refs(v, fn) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_rename_refs(v, fn) for v in doc]
    return doc


def optimizer_doc_to_logical(key: str, doc: dict, rules: Sequence[Rule]) -> dict:
    """Rewrite a saved optimizer document so per-parameter entries use logical names."""
    if not rules or not isinstance(doc, dict):
        return doc
    state, group_of = {}, {}
    for pname, gi in doc.get("group_of", {}).items():
        rule, m = _find(rules, pname)
        names = [pname] if rule is None else [rule.logical_name(pname, n) for n in rule.part_names()]
        for n in names:
            group_of[n] = gi
    for pname, sdoc in doc.get("state", {}).items():
        rule, m = _find(rules, pname)
        if rule is None:
            state[pname] = sdoc
            continue
        for n in rule.part_names():
            logical = rule.logical_name(pname, n)
            state[logical] = _rename_refs(sdoc, lambda f, p=pname, lg=logical: f.replace(f".state.{p}.", f".state.{lg}.", 1))
    return {**doc, "state": state, "group_of": group_of}


def optimizer_doc_to_physical(key: str, doc: dict, rules: Sequence[Rule], params: Iterable[str]) -> dict:
    """The inverse view for loading into a fused model: physical entries built from logical ones."""
    if not rules or not isinstance(doc, dict):
        return doc
    state = dict(doc.get("state", {}))
    group_of = dict(doc.get("group_of", {}))
    for pname in params:
        rule, m = _find(rules, pname)
        if rule is None:
            continue
        logical = [rule.logical_name(pname, n) for n in rule.part_names()]
        first = logical[0]
        if first in state:
            state[pname] = _rename_refs(state[first], lambda f, lg=first, p=pname: f.replace(f".state.{lg}.", f".state.{p}.", 1))
        if first in group_of:
            group_of[pname] = group_of[first]
        for n in logical:
            if n != pname:
                state.pop(n, None)
                group_of.pop(n, None)
    return {**doc, "state": state, "group_of": group_of}
