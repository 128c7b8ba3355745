"""The load's plan phase on one rank: each state entry's targets, and what is missing or unexpected.

Each entry's adapter turns the saved document and tensors into targets;
layout rules map the target's physical tensors to the checkpoint's logical
ones. What the objects need before that (an optimizer's naming views,
modules on the ``meta`` device) is asked of :mod:`shardpoint.adapters.loading`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..adapters import adapter_for, build_context, default_adapters
from ..adapters.loading import physical_shapes
from ..format.manifest import Manifest
from ..layouts import LayoutView, apply_load
from .names import entry_selected, name_selected
from .options import LoadOptions

__all__ = ["EntryPlan", "plan_entries"]


@dataclass
class EntryPlan:
    """Each loaded entry's :class:`~shardpoint.adapters.LoadPart`, and the names on one side only.

    Example::

        plan = plan_entries(state, manifest, LoadOptions(), rank=0, world=1, layouts=(), where="ckpt")
        targets = [t for p in plan.parts.values() for t in p.targets]
    """

    parts: dict = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def plan_entries(
    state: Mapping[str, Any], manifest: Manifest, options: LoadOptions, *, rank: int, world: int,
    layouts: Sequence[Any], where: str,
) -> EntryPlan:
    """Targets for every selected entry of ``state``, with the names missing from or unexpected in the checkpoint.

    ``options`` gives the selection, pickle permission and replica facts;
    ``layouts`` are every rule the load applies (the user's and the implied ones).

    Example::

        plan = plan_entries(state, manifest, LoadOptions(), rank=0, world=1, layouts=(), where="ckpt")
    """
    selected = options.selected
    ctx = build_context(state, rank, world, options.allow_pickle, options.replicated_over)
    adapters = default_adapters()
    view = LayoutView(manifest.tensors, layouts, physical_shapes(state)) if layouts else None
    plan = EntryPlan()
    consumed: set[str] = set()
    for key, obj in state.items():
        if selected is not None and not entry_selected(key, selected):
            continue
        prefix = key + "."
        if key not in manifest.values and not any(f == key or f.startswith(prefix) for f in manifest.tensors):
            plan.missing.append(key)
            continue
        adapter = adapter_for(obj, adapters)
        doc = adapter.read_value(key, obj, manifest.values.get(key), ctx, layouts, where)
        part = adapter.load(key, obj, doc, view if view is not None else manifest.tensors, ctx, where)
        if view is not None:
            part.targets = apply_load(part.targets, layouts)
            part.consumed = {n for f in part.consumed for n in view.logical_names(f)}
        plan.parts[key] = part
        plan.missing.extend(part.missing)
        plan.unexpected.extend(part.unexpected)
        consumed |= part.consumed
    plan.unexpected.extend(_left_over(state, manifest, set(plan.parts), consumed))
    if selected is not None:
        _keep_selected(plan, selected)
    return plan


def _left_over(state: Mapping[str, Any], manifest: Manifest, loaded: set[str], consumed: set[str]) -> list[str]:
    """Saved names no target reads: tensors of a loaded entry nobody consumed, values with no entry."""
    out = [f for f in manifest.tensors if f.split(".", 1)[0] in loaded and f not in consumed]
    return out + [key for key in manifest.values if key not in state]


def _keep_selected(plan: EntryPlan, selected: list[str]) -> None:
    """Only the selected names are loaded, and only they can be missing or unexpected."""
    plan.missing = [n for n in plan.missing if name_selected(n, selected)]
    plan.unexpected = [n for n in plan.unexpected if name_selected(n, selected)]
    for p in plan.parts.values():
        p.targets = [t for t in p.targets if name_selected(t.fqn, selected)]
