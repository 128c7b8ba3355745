"""Applying layout rules: a save's tensors and a load's targets as logical pieces, and the manifest as the target names it.

:func:`apply_save` replaces each physical tensor a rule matches with its
logical pieces (shard boxes intersected with the rule's segments);
:func:`apply_load` does the same for load targets and zeroes the padding they
leave; :class:`LayoutView` answers lookups by physical names from a manifest
that stores logical ones. Example::

    tensors = apply_save(tensors, [Fused("*.w13.weight", dim=0, parts=[("w1", 64), ("w3", 64)])])
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping, Sequence

import torch

from ..items import LoadTarget, SaveTensor
from ..errors import UnsupportedStateError
from ..format.manifest import TensorMeta
from ..geometry import Box
from .rules import Rule, WholeRule, find_rule

__all__ = ["apply_save", "apply_load", "LayoutView"]


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
        rule, m = find_rule(rules, t.fqn)
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
        rule, m = find_rule(rules, t.fqn)
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
        rule, m = find_rule(self._rules, fqn)
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
        rule, m = find_rule(self._rules, fqn)
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
