"""Geometry of one tensor: plain tensors and DTensors (FSDP2, TP, HSDP, 2-D).

A DTensor's local shard is located with PyTorch's own
``compute_local_shape_and_global_offset``, which also understands the
``_StridedShard`` placements that 2-D FSDP2 + TP produces. Replicated mesh
dimensions make copies; the copy index is the rank's coordinate along them.
The grid arithmetic (:mod:`shardpoint.geometry.grid`) never sees torch's
placement types: :func:`describe_placements` hands it plain data.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsupportedStateError
from ..geometry import Box
from ..geometry.grid import grid_of_placements
from ..runtime.torchcompat import compute_local_shape_and_global_offset, describe_placements, mesh_grid, per_mesh, root_mesh
from .base import AdapterContext, LoadTarget, SaveTensor, global_cost

__all__ = ["is_dtensor", "local_shard", "describe_placements", "save_tensor", "load_target", "empty_like_target"]


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _replication_outside(mesh, allowed: frozenset[int] | None = None) -> tuple[int, int, int]:
    """(index, count, root size) of copies made by root-mesh dims this mesh does not span.

    A DTensor on a sub-mesh (say the ``dp`` slice of a ``(dp, tp)`` mesh) is
    held identically by every sibling slice: those ranks are replicas too.
    Only siblings inside ``allowed`` count: a pipeline-parallel dim of the
    root mesh holds other stages, whose tensors differ.
    """
    import torch.distributed as dist

    root = root_mesh(mesh)
    if root is mesh:
        return 0, 1, mesh.size()
    me = dist.get_rank()
    grid = mesh_grid(root)
    where = (grid == me).nonzero()
    if where.numel() == 0:
        return 0, 1, mesh.size()
    coord = [int(c) for c in where[0]]
    mine = set(int(r) for r in mesh_grid(mesh).flatten().tolist())
    index, count = 0, 1
    for d, size in enumerate(grid.shape):
        if size == 1:
            continue
        probe = list(coord)
        probe[d] = (coord[d] + 1) % size
        sibling = int(grid[tuple(probe)])
        if allowed is not None and sibling not in allowed:
            continue
        if sibling not in mine:  # dim d is not spanned: a sibling holds a copy
            index = index * size + coord[d]
            count *= size
    return index, count, root.size()


# Each live mesh's shard geometries, weakly held by the mesh: a geometry is a pure function of the mesh (which
# never changes), the placements, the global shape and the replica ranks, and torch's mesh arithmetic costs about
# 0.3 ms a tensor (torch 2.14), so a model's many tensors of one shape share one computation.
_geometries: dict[int, tuple] = {}
_geometries_lock = threading.Lock()


def _dtensor_geometry(dt, allowed: frozenset[int] | None = None) -> tuple | None:
    """(box, replica index, replica count, root mesh size, grid or None) of this rank's shard."""
    mesh = dt.device_mesh
    key = (tuple(dt.placements), tuple(int(x) for x in dt.shape), allowed)
    with _geometries_lock:
        known = per_mesh(_geometries, mesh)  # by identity: equal meshes may be sliced from different roots
        if key in known:
            return known[key]
    geo = _compute_dtensor_geometry(dt, mesh, allowed)
    with _geometries_lock:
        known[key] = geo
    return geo


def _compute_dtensor_geometry(dt, mesh, allowed: frozenset[int] | None) -> tuple | None:
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    for p in dt.placements:
        if p.is_partial():
            raise UnsupportedStateError(
                f"DTensor with a Partial placement {dt.placements} cannot be saved; reduce it first"
            )
    shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    index, count, root_size = _replication_outside(mesh, allowed)
    # Copies outside the mesh cannot be located from the mesh alone: no grid then.
    grid = _grid(mesh, dt.placements, tuple(int(x) for x in dt.shape)) if count == 1 else None
    for d, p in enumerate(dt.placements):
        if p.is_replicate():
            index = index * mesh.size(d) + coord[d]
            count *= mesh.size(d)
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape)), index, count, root_size, grid


def _grid(mesh, placements, shape: tuple[int, ...]):
    """The DTensor's grid, or ``None`` where torch's offsets may not follow it.

    With a ``_StridedShard`` on a dim the mesh does not split evenly, torch
    reports rows that differ from the nested split, sometimes on ranks whose
    own box still looks right; such tensors keep listed chunks.
    """
    grid_ranks = mesh_grid(mesh)
    mesh_shape = tuple(int(s) for s in grid_ranks.shape)
    ranks = tuple(int(r) for r in grid_ranks.flatten().tolist())
    dims = [getattr(p, "dim", None) for p in placements]
    dims = [d + len(shape) if isinstance(d, int) and d < 0 else d for d in dims]
    for p, d in zip(placements, dims):
        if type(p).__name__ == "_StridedShard" and 0 <= d < len(shape):
            parts = math.prod(mesh_shape[m] for m, e in enumerate(dims) if e == d)
            if shape[d] % parts:
                return None
    return grid_of_placements(mesh_shape, ranks, describe_placements(placements), len(shape))


def save_tensor(fqn: str, t: torch.Tensor, ctx: AdapterContext) -> SaveTensor | None:
    """A :class:`SaveTensor` for a plain tensor or DTensor, or ``None`` if this rank holds none."""
    if is_dtensor(t):
        geo = _dtensor_geometry(t, ctx.replica_ranks(fqn))
        if geo is None:
            return None
        box, index, count, mesh_size, grid = geo
        local = _local_view(t)
        if tuple(local.shape) != box.sizes:
            raise UnsupportedStateError(
                f"{fqn}: local shard shape {tuple(local.shape)} differs from its placement box {box.sizes}"
            )
        shape = tuple(int(s) for s in t.shape)
        return SaveTensor(
            fqn, local, shape, box, None, index, count,
            global_cost(shape, local.element_size(), count, mesh_size), f"dtensor{tuple(t.placements)}",
            ctx.replica_group(fqn), grid,
        )
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedStateError(f"{fqn}: only dense strided tensors can be saved, got {t.layout}")
    shape = tuple(int(s) for s in t.shape)
    index, count = ctx.plain_replica(fqn)
    return SaveTensor(
        fqn, t, shape, Box.full(shape), None, index, count,
        float(math.prod(shape) * t.element_size()), "replicated" if count > 1 else "local",
        ctx.replica_group(fqn),
    )


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s data on this rank: a DTensor's local shard, else ``t`` itself.

    A DTensor's shard is the attribute ``to_local()`` returns, read without
    its autograd Function (about 60 us a call); a tensor subclass that only
    offers ``to_local()`` is asked under ``no_grad``. The shard shares the
    data, so in-place writes and ``.data`` writes land in it.

    Example::

        local_shard(torch.ones(2)).shape  # torch.Size([2])
    """
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    with torch.no_grad():
        return to_local()


def _local_view(dt) -> torch.Tensor:
    """The DTensor's local shard, detached, sharing its storage (a detach of the plain shard is cheap)."""
    return local_shard(dt).detach()


def load_target(fqn: str, t: torch.Tensor) -> LoadTarget | None:
    """A :class:`LoadTarget` that fills ``t`` (plain or DTensor) in place."""
    shape = tuple(int(s) for s in t.shape)
    if is_dtensor(t):
        # The local shard without DTensor's detach and to_local (dispatch and an autograd
        # Function, about 0.1 ms per tensor; a load has one target per tensor).
        geo = _dtensor_geometry(t)
        if geo is None:
            return None
        return LoadTarget(fqn, _local_view(t), shape, geo[0])
    return LoadTarget(fqn, t.detach(), shape, Box.full(shape))


def empty_like_target(like: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device=None):
    """A fresh tensor to load into: sharded like ``like`` when shapes agree, else whole.

    Uninitialised: the load's coverage check guarantees every element is
    written, and zero-filling optimizer state first costs a full extra pass.
    """
    if like is not None and tuple(like.shape) == tuple(shape):
        return torch.empty_like(like.detach(), dtype=dtype)
    dev = device if device is not None else (like.device if like is not None and not is_dtensor(like) else "cpu")
    try:
        return torch.empty(shape, dtype=dtype, device=dev)
    except (RuntimeError, MemoryError) as e:  # a checkpoint's shape that no memory can hold
        raise CorruptCheckpointError(
            f"cannot allocate a {dtype} tensor of shape {tuple(shape)} to load into ({str(e)[:120]}); "
            "the checkpoint's shape is not plausible"
        ) from None
