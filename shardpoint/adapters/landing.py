"""Proving that a load landed: every tensor it wrote is live state, or reached it.

A load fills :class:`~shardpoint.adapters.base.LoadTarget` tensors. That is
only a restore if those tensors *are* the training state (a parameter, a
buffer, an optimizer state tensor filled in place) or if the object's own
``load_state_dict`` copied their values into it. The first is proved by
aliasing: the target's storage is the storage of a live tensor, which costs
one pointer lookup per tensor. The second is proved by taking the state dict
again after ``load_state_dict`` and comparing: the same storage again, or the
same bits.

Example::

    live = live_storages(module_tensors(model))
    assert not unlanded(part.targets, live)
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from .base import LoadTarget
from .tensors import is_dtensor, local_shard

__all__ = [
    "local_of",
    "storage_of",
    "alias_key",
    "module_tensors",
    "optimizer_tensors",
    "tree_tensors",
    "live_storages",
    "entry_tensors",
    "same_bits",
    "unlanded",
]

# Integer dtypes of each element size: floats are compared as bits, so NaN equals itself.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s data on this rank: a DTensor's local shard, else ``t``."""
    return local_shard(t) if is_dtensor(t) else t


def storage_of(t: torch.Tensor) -> int:
    """The address of the storage behind ``t`` (its local shard for a DTensor)."""
    return local_of(t).untyped_storage().data_ptr()


def alias_key(t: torch.Tensor) -> tuple:
    """What makes two tensors the very same memory: storage, offset, shape, strides, dtype, placements.

    Two tensors with equal keys read and write the same elements in the same
    order; for DTensors the placements must agree too, since they say which
    part of the global tensor the memory holds.
    """
    x = local_of(t)
    spec = (t.device_mesh, tuple(t.placements)) if x is not t else None
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, spec)


def module_tensors(m: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``m``, shared ones under each of their names."""
    for _, p in m.named_parameters(remove_duplicate=False):
        yield p
    for _, b in m.named_buffers(remove_duplicate=False):
        if b is not None:
            yield b


def optimizer_tensors(opt: Any) -> Iterator[torch.Tensor]:
    """Every tensor of an optimizer's per-parameter state and hyper-parameters."""
    for s in opt.state.values():
        yield from tree_tensors(s)
    for g in opt.param_groups:
        for k, v in g.items():
            if k != "params":
                yield from tree_tensors(v)


def tree_tensors(value: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and value.dtype.isnative:
        yield torch.from_numpy(value)  # a restored array shares the memory the load filled
    elif _depth < 64 and isinstance(value, Mapping):
        for v in value.values():
            yield from tree_tensors(v, _depth + 1)
    elif _depth < 64 and isinstance(value, (list, tuple)):
        for v in value:
            yield from tree_tensors(v, _depth + 1)


def entry_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The live tensors of a state entry after a load: a module's parameters and buffers, an
    optimizer's state, or the tensors inside a restored value."""
    if isinstance(value, nn.Module):
        return module_tensors(value)
    if isinstance(value, torch.optim.Optimizer):
        return optimizer_tensors(value)
    return tree_tensors(value)


def live_storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Storage addresses of ``tensors`` (local shards for DTensors)."""
    return {storage_of(t) for t in tensors}


def same_bits(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same values bit for bit (NaNs included).

    DTensors with the same mesh and placements compare their local shards
    (no communication); DTensors laid out differently compare full tensors,
    a collective over their mesh.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    da, db = is_dtensor(a), is_dtensor(b)
    if da and db and a.device_mesh == b.device_mesh and tuple(a.placements) == tuple(b.placements):
        a, b = local_shard(a), local_shard(b)
    elif da or db:
        a = a.full_tensor() if da else a
        b = b.full_tensor() if db else b
    a, b = a.detach(), b.detach()
    if a.device != b.device:
        b = b.to(a.device)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    bits = _BITS.get(a.element_size()) if a.is_floating_point() else None
    if bits is None:
        return torch.equal(a, b)
    return torch.equal(a.view(bits), b.view(bits))  # NaN equals itself, -0.0 differs from 0.0


def unlanded(targets: Iterable[LoadTarget], live: set[int], vouched: Mapping[int, bool] | None = None) -> list[str]:
    """Names of ``targets`` that did not land: not live memory, and not vouched for.

    ``vouched`` maps the storage of a tensor handed to an object's own
    ``load_state_dict`` to whether its values were found in the object's
    state afterwards. Empty targets wrote nothing and always land.
    """
    vouched = vouched or {}
    bad: list[str] = []
    for t in targets:
        if t.dest.numel() == 0:
            continue
        s = t.dest.untyped_storage().data_ptr()
        ok = vouched.get(s)
        if ok is None:
            ok = s in live
        if not ok:
            bad.append(t.fqn)
    return bad
