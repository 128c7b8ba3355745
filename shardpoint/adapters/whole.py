"""Whole entries: what a non-strict load into an empty dict fills in.

``sp.load(path, {}, strict=False)`` has no objects to restore into, so the
load seeds one :class:`WholeEntry` per top-level key of the checkpoint and
this adapter returns each entry as saved: its value document decoded (plain
values, lists, dicts, tuples), with every tensor it references, and every
other tensor under the key, read as a plain full tensor on the CPU. A module
entry becomes the dict of its tensors by state-dict name; an optimizer entry
its value document (``groups``, ``group_of``, ``state``) with its tensors in
place.

Example::

    everything = sp.load("ckpt/step_100", {}, strict=False)
    everything["model"]["layers.0.w"]   # a torch.Tensor
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import UnsupportedStateError
from ..geometry import Box
from .base import Adapter, LoadTarget, torch_dtype
from .tree import decode_tree

__all__ = ["WholeEntry", "WholeEntryAdapter"]


@dataclass(frozen=True)
class WholeEntry:
    """A placeholder for a checkpoint entry to be returned whole (only the load creates these)."""


class WholeEntryAdapter(Adapter):
    """Loads a :class:`WholeEntry` as the saved entry, tensors as full CPU tensors."""

    name = "whole"

    def claims(self, obj: Any) -> bool:
        return isinstance(obj, WholeEntry)

    def save(self, key: str, obj: Any, ctx) -> Any:
        raise UnsupportedStateError(f"state[{key!r}] is a load placeholder, not state to save")

    def load(self, key, obj, doc, tensors: Mapping[str, Any], ctx, where="<checkpoint>"):
        part, holder, settle = decode_tree(key, doc, None, tensors, ctx, where)
        prefix = key + "."
        rest: dict[str, torch.Tensor] = {}
        for fqn in tensors:
            if fqn.startswith(prefix) and fqn not in part.consumed:
                meta = tensors[fqn]
                shape = tuple(int(s) for s in meta.shape)
                dest = torch.empty(shape, dtype=torch_dtype(meta.dtype))
                part.targets.append(LoadTarget(fqn, dest, shape, Box.full(shape)))
                part.consumed.add(fqn)
                rest[fqn[len(prefix):]] = dest

        def finish() -> Any:
            settle(part.targets)
            value = holder[0]
            if not rest:
                return value
            if value is None or value == {}:
                return rest
            if isinstance(value, dict):
                return {**rest, **value}
            return {"value": value, **rest}

        part.finish = finish
        return part
