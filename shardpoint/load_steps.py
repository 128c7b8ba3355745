"""Helpers of :func:`shardpoint.load` and :func:`shardpoint.read_tensor`: key selection, targets, checks."""

from __future__ import annotations

import fnmatch
from typing import Any, MutableMapping

import torch
from torch import nn

from .adapters import AdapterContext, unwrap_module
from .adapters.megatron import is_megatron, megatron_global_shapes
from .errors import CorruptCheckpointError
from .format.manifest import Manifest, TensorMeta
from .geometry import Box
from .storage import Storage

__all__ = ["entry_selected", "name_selected", "entry_keys", "param_names", "physical_shapes", "materialize_meta", "check_provided"]


def entry_selected(key: str, patterns: list[str]) -> bool:
    """Whether ``keys=`` patterns select anything under the top-level entry ``key``."""
    return any(fnmatch.fnmatchcase(key, p) or p.startswith(key + ".") or fnmatch.fnmatchcase(key + ".x", p) for p in patterns)


def name_selected(name: str, patterns: list[str]) -> bool:
    """Whether ``keys=`` patterns select the tensor or entry ``name``."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def entry_keys(manifest: Manifest) -> list[str]:
    """Every top-level key of the checkpoint: entries with values, and the tops of tensor names."""
    keys = dict.fromkeys(manifest.values)
    keys.update(dict.fromkeys(f.split(".", 1)[0] for f in manifest.tensors))
    return list(keys)


def param_names(opt: torch.optim.Optimizer, ctx: AdapterContext) -> list[str]:
    """The state names of ``opt``'s parameters (those a module in the state owns)."""
    names = (ctx.param_names.get(id(p)) for g in opt.param_groups for p in g["params"])
    return [n for n in names if n is not None]


def physical_shapes(state) -> dict[str, tuple]:
    """Global shapes of the modules' tensors by name, as layout rules see the target."""
    shapes = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            if is_megatron(unwrap_module(obj)):  # local TP shards and stage-local layer names
                shapes.update(megatron_global_shapes(key, unwrap_module(obj)))
                continue
            for n, t in unwrap_module(obj).state_dict().items():
                if isinstance(t, torch.Tensor):
                    shapes[f"{key}.{n}"] = tuple(t.shape)
    return shapes


def materialize_meta(state: MutableMapping[str, Any]) -> None:
    """Give modules on the ``meta`` device real (uninitialised) CPU storage to load into."""
    for obj in state.values():
        if isinstance(obj, nn.Module):
            m = unwrap_module(obj)
            if any(t.is_meta for t in m.parameters()) or any(t.is_meta for t in m.buffers()):
                m.to_empty(device=torch.device("cpu"))


def check_provided(storage: Storage, meta: TensorMeta, name: str, box: Box) -> None:
    """Before allocating: the chunks must hold ``numel x itemsize`` bytes of ``box``, in files that big.

    A crafted shape or file size then fails here as a typed error instead of
    in ``torch.empty`` or a short read.
    """
    chunks = meta.chunks or ()
    have = 0
    for c in chunks:
        inter = c.box.intersect(box) if c.flat is None else None
        have += inter.numel if inter is not None else 0
    need = box.numel
    flat = any(c.flat is not None for c in chunks)
    if not flat and have < need:
        raise CorruptCheckpointError(
            f"{storage.url}: tensor {name!r}: its chunks provide {have} of the {need} elements "
            f"({need * meta.itemsize} bytes) of the box {box.offsets}+{box.sizes}; the checkpoint is corrupt"
        )
    sizes: dict[str, int] = {}
    for c in chunks:
        if c.file not in sizes:
            try:
                sizes[c.file] = storage.size(c.file)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{storage.url}: data file {c.file} of tensor {name!r} is missing") from None
        if c.offset + c.nbytes > sizes[c.file]:
            raise CorruptCheckpointError(
                f"{storage.url}: data file {c.file} of tensor {name!r} is shorter than the manifest says "
                f"(truncated?): its chunk bytes [{c.offset}, {c.offset + c.nbytes}) run past its {sizes[c.file]} bytes"
            )
