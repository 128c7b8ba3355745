"""What differs between the torch releases shardpoint supports (2.6 and later), in one place.

Every check of which torch is installed lives here: the rest of the package
calls the helpers below and never reads ``torch.__version__`` itself (a test
in ``tests/unit`` enforces it). Each shim says which torch release made it
unnecessary, so that raising the floor (``torch>=`` in ``pyproject.toml``)
tells which shims to delete. Where a feature can be detected, it is detected
once (at import, or on first use where that would import a slow torch
module) rather than inferred from the version number.

A feature that cannot work on the installed torch raises
:class:`~shardpoint.errors.UnsupportedStateError` naming the release it
needs (:func:`require`), never an ``AttributeError`` from deep inside torch.

Example::

    from shardpoint.runtime import torchcompat

    torchcompat.TORCH_VERSION            # (2, 6) on torch 2.6.0+cu124
    torchcompat.root_mesh(mesh["tp"])     # the (dp, tp) mesh, on every supported torch
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import threading
import warnings
import weakref
from typing import Any, Sequence

import torch

from ..errors import UnsupportedStateError
from ..geometry.grid import DimPlacement

__all__ = [
    "MIN_TORCH",
    "TORCH_VERSION",
    "HAS_CPU_FSDP2",
    "require",
    "enable_cpu_fsdp2",
    "torch_places_uneven_strided_shards",
    "describe_placements",
    "local_shape_and_offset",
    "root_mesh",
    "compute_local_shape_and_global_offset",
    "dcp_save_local",
    "dcp_load_local",
    "torchtitan_runs",
    "mesh_grid",
    "per_mesh",
]


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``2.6.0+cu124`` or ``2.14.0a0+git1234``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:  # pragma: no cover - every torch release has one
        raise ValueError(f"cannot read the torch version {version!r}")
    return int(m.group(1)), int(m.group(2))


#: The oldest torch release shardpoint supports and tests (``make test-min``).
MIN_TORCH: tuple[int, int] = (2, 6)

#: The installed torch's ``(major, minor)``.
TORCH_VERSION: tuple[int, int] = _release(torch.__version__)


def require(feature: str, available: bool, since: str) -> None:
    """Raise :class:`UnsupportedStateError` when ``feature`` is not ``available`` on this torch.

    ``since`` is the torch release that brought the feature; the message names
    it and the installed one, and how to get it.

    Example::

        require("Saving this DTensor", torch_places_uneven_strided_shards(), "2.8")
    """
    if not available:
        raise UnsupportedStateError(
            f"{feature} needs torch {since} or later, and this is torch {torch.__version__}; "
            f"upgrade torch (pip install 'torch>={since}')"
        )


# --- FSDP2 on CPU ----------------------------------------------------------------------------------

# FSDP2 (fully_shard) on CPU over gloo, as shardpoint's multi-process tests run it. On torch 2.6 three
# things inside torch stop it, where torch 2.7 brought CPU support (its stream no-ops and version-counter
# fix) and 2.11 and later were measured training correctly: its CPU stream stub lacks record_event and
# wait_event ("'Stream' object has no attribute 'record_event'"); re-gathering a block's parameters in
# backward bumps their autograd version counter ("modified by an inplace operation"); and FSDP2 averages
# gradients with ReduceOp.AVG, which gloo lacks there: its all-reduce refuses it ("Cannot use
# ReduceOp.AVG with Gloo") and its reduce-scatter silently sums instead (measured: 1 and 2 "average" to 3).
def _cpu_stream_events() -> bool:
    return hasattr(torch.cpu.Stream, "record_event") and hasattr(torch.cpu.Stream, "wait_event")


#: Whether this torch's CPU stream stub has what FSDP2 calls (torch 2.7 and later); where it has not,
#: :func:`enable_cpu_fsdp2` adds it and the other two fixes.
HAS_CPU_FSDP2: bool = _cpu_stream_events()


def _record_event(self: Any, event: Any = None) -> Any:
    return event if event is not None else torch.cpu.Event()


def _wait_event(self: Any, event: Any) -> None:
    return None  # CPU work is synchronous: everything recorded has already happened


def _keeping_versions(copy_out: Any) -> Any:
    """torch 2.7's fix: the copy into the gathered parameters hides from autograd, as on accelerators."""

    def wrapped(all_gather_result: Any, fsdp_params: Any, group: Any) -> None:
        with contextlib.ExitStack() as keep:
            for p in fsdp_params:
                for t in p.all_gather_outputs:  # empty on the first gather: made inside, at version 0
                    keep.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
            copy_out(all_gather_result, fsdp_params, group)

    return wrapped


def _summing_then_dividing(factors: Any) -> Any:
    """FSDP2 over gloo: sum the gradients, then divide, where torch 2.6 would ask gloo for an average."""

    def wrapped(reduce_scatter_group: Any, all_reduce_group: Any, reduce_dtype: Any) -> Any:
        pre, post = factors(reduce_scatter_group, all_reduce_group, reduce_dtype)
        import torch.distributed as dist

        if pre is None and dist.get_backend(reduce_scatter_group) == "gloo":
            size = reduce_scatter_group.size() * (all_reduce_group.size() if all_reduce_group is not None else 1)
            return 1.0, float(size)
        return pre, post

    return wrapped


def enable_cpu_fsdp2() -> bool:
    """Let FSDP2 train on CPU with torch 2.6, as it does from torch 2.7; returns whether it changed anything.

    Gives torch 2.6's CPU stream stub the no-op ``record_event`` and
    ``wait_event`` that FSDP2 calls, keeps the version counter of the
    gathered parameters across a re-gather, as torch 2.7 does, and has FSDP2
    over gloo sum and divide its gradients instead of averaging. A test aid
    (shardpoint's launcher calls it in every rank): on an accelerator FSDP2
    needs none of it, and where the CPU stream stub is complete (torch 2.7
    and later) this does nothing.

    Example::

        enable_cpu_fsdp2()
        fully_shard(block); fully_shard(model)   # now trains on CPU over gloo with torch 2.6 too
    """
    if _cpu_stream_events():
        return False
    torch.cpu.Stream.record_event = _record_event  # type: ignore[attr-defined]
    torch.cpu.Stream.wait_event = _wait_event  # type: ignore[attr-defined]
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

    wrapped = _keeping_versions(_fsdp_collectives.foreach_all_gather_copy_out)
    _fsdp_collectives.foreach_all_gather_copy_out = wrapped
    _fsdp_param_group.foreach_all_gather_copy_out = wrapped  # imported there by name
    _fsdp_collectives._get_gradient_divide_factors = _summing_then_dividing(_fsdp_collectives._get_gradient_divide_factors)
    return True


# --- DTensor geometry ------------------------------------------------------------------------------

# torch 2.6 and 2.7 compute a DTensor's local shape and global offset only for the calling rank (from
# its mesh); from 2.8 torch also takes a coordinate and a mesh shape.
# Looked up on first use: importing torch.distributed.tensor costs a second.
@functools.cache
def _at_coordinate() -> Any:
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    except ImportError:  # torch 2.6 and 2.7
        return None
    return _compute_local_shape_and_global_offset


class _MeshAt:
    """Just what torch 2.6's ``compute_local_shape_and_global_offset`` reads of a mesh, at a chosen coordinate."""

    def __init__(self, shape: Sequence[int], coordinate: Sequence[int]):
        self.shape, self.coordinate, self.ndim = tuple(shape), list(coordinate), len(shape)

    def size(self, mesh_dim: int) -> int:
        return self.shape[mesh_dim]

    def get_coordinate(self) -> list[int]:
        return self.coordinate


def _torch_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]):
    at = _at_coordinate()
    if at is not None:
        return at(tuple(global_shape), tuple(mesh_shape), list(coordinate), list(placements))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh: Any = _MeshAt(mesh_shape, coordinate)
    return compute_local_shape_and_global_offset(tuple(global_shape), mesh, list(placements))


# Torch 2.6 and 2.7 place the shards of a ``_StridedShard`` dim (2-D FSDP2 + TP) at ``local size x
# shard index``, wrong whenever the split is uneven: 52 rows on (dp=3, tp=2) put tp 1's first dp shard
# at row 27, where FSDP2 (which chunks the TP-local tensor) holds rows 26..34. Torch 2.8 rewrote it to
# split in FSDP2's order (26, measured on 2.11 and later), and reports an empty shard at the dim's
# size. Detected once, by asking torch that very case.
@functools.cache
def torch_places_uneven_strided_shards() -> bool:
    """Whether torch's own offsets of an unevenly split ``_StridedShard`` dim are FSDP2's (no on 2.6, 2.7).

    Example::

        if not torch_places_uneven_strided_shards():
            print("shard offsets of 2-D FSDP2 + TP tensors come from shardpoint's own split")
    """
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    return tuple(_torch_box((52,), (3, 2), (0, 1), (_StridedShard(0, split_factor=2), Shard(0)))[1]) == (26,)


def _as_newer_torch(global_shape: Sequence[int], box: Any, placements: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An older torch's answer in the newer convention: an empty shard of a sharded dim sits at the dim's size."""
    sizes, offsets = tuple(int(x) for x in box[0]), list(int(x) for x in box[1])
    sharded = {int(p.dim) % len(sizes) for p in placements if p.is_shard()} if sizes else set()
    for d in sharded:
        if sizes[d] == 0:
            offsets[d] = int(global_shape[d])
    return sizes, tuple(offsets)


def _uneven(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any]) -> bool:
    """Whether some sharded dim does not divide evenly over all the mesh dims that split it."""
    import math

    dims = [int(p.dim) % len(global_shape) if p.is_shard() else None for p in placements]
    for d in set(dims) - {None}:
        if global_shape[d] % math.prod(k for k, e in zip(mesh_shape, dims) if e == d):
            return True
    return False


def _strided_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]):
    """A strided DTensor's shard on torch 2.6 and 2.7: FSDP2's own split (torch.chunk of the TP-local rows).

    Torch there is wrong for every dim of such a tensor once one split is
    uneven, and refuses some even ones; the nested grid is FSDP2's layout.
    """
    import math

    from ..geometry.grid import grid_of_placements

    grid = grid_of_placements(
        tuple(mesh_shape), range(math.prod(mesh_shape)), describe_placements(placements), len(global_shape)
    )
    if grid is not None:
        box = grid.box(tuple(int(x) for x in global_shape), tuple(int(c) for c in coordinate))
        return box.sizes, box.offsets
    # A split factor FSDP2 does not make: only torch's arithmetic knows it, right only when even.
    feature = f"Saving a DTensor placed {tuple(placements)} on a {tuple(mesh_shape)} mesh"
    require(feature + ", unevenly split,", not _uneven(global_shape, mesh_shape, placements), "2.8")
    try:
        return _torch_box(global_shape, mesh_shape, coordinate, placements)
    except NotImplementedError:
        require(feature, False, "2.8")
        raise  # pragma: no cover - require raised


def local_shape_and_offset(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (local shape, global offset) of a DTensor's shard at a mesh ``coordinate``.

    Torch's own answer, computed without a process group, on every supported
    torch; on a torch whose strided-shard offsets are wrong (2.6, 2.7), those
    of a tensor with a ``_StridedShard`` come from FSDP2's nested split
    instead, and an empty shard is reported at the dim's size as later
    releases do.

    Example::

        local_shape_and_offset((8, 4), (2,), [1], [Shard(0)])   # ((4, 4), (4, 0))
    """
    if torch_places_uneven_strided_shards():
        return _torch_box(global_shape, mesh_shape, coordinate, placements)
    if any(type(p).__name__ == "_StridedShard" for p in placements):
        box = _strided_box(global_shape, mesh_shape, coordinate, placements)
    else:
        box = _torch_box(global_shape, mesh_shape, coordinate, placements)
    return _as_newer_torch(global_shape, box, placements)


def compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh: Any, placements: Sequence[Any]):
    """``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, right on every supported torch.

    The calling rank's (local shape, global offset) of a DTensor on ``mesh``;
    on torch 2.6 and 2.7 a ``_StridedShard`` dim's come from FSDP2's nested
    split (see :func:`local_shape_and_offset`).

    Example::

        shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as torchs

    coordinate = mesh.get_coordinate()
    if coordinate is None or torch_places_uneven_strided_shards():
        return torchs(global_shape, mesh, placements)
    return local_shape_and_offset(global_shape, tuple(mesh.shape), coordinate, placements)


# --- device meshes ---------------------------------------------------------------------------------


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (itself when it is a root), on every supported torch.

    Torch 2.10 made this a mesh method (``_get_root_mesh``); before, torch's
    mesh registry (``_mesh_resources``) answered it.

    Example::

        root_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]).shape   # (2, 2)
    """
    getter = getattr(mesh, "_get_root_mesh", None)
    if getter is not None:
        return getter()
    from torch.distributed.device_mesh import _mesh_resources  # torch 2.6 to 2.9

    return _mesh_resources.get_root_mesh(mesh)


# A mesh's ranks, read once per mesh while it lives: torch 2.14 rebuilds ``DeviceMesh.mesh`` from its layout
# on every access (about 0.2 ms), and a save or load asks it for every DTensor. A mesh never changes.
_mesh_grids: dict[int, tuple] = {}
_mesh_grids_lock = threading.Lock()


def per_mesh(store: dict, mesh: Any) -> dict:
    """The dict ``store`` keeps for this very mesh object (by identity; a mesh equal to it has its own), while it lives.

    Meshes compare equal by their ranks, whatever they were sliced from, so
    facts are kept per object, not per value. Call it with the store's lock held.

    Example::

        facts = per_mesh(store, mesh); facts.setdefault("grid", mesh.mesh)
    """
    key = id(mesh)
    entry = store.get(key)
    if entry is None or entry[0]() is not mesh:
        try:
            ref = weakref.ref(mesh, lambda _dead, k=key: store.pop(k, None))
        except TypeError:  # a mesh that cannot be weakly referenced: nothing kept
            return {}
        entry = store[key] = (ref, {})
    return entry[1]


def mesh_grid(mesh: Any) -> torch.Tensor:
    """``mesh.mesh`` (the ranks of ``mesh`` in its shape), read once per mesh; do not modify it.

    Before torch 2.14 the attribute was a stored tensor; from 2.14 it is
    rebuilt at every access.

    Example::

        mesh_grid(init_device_mesh("cpu", (2, 2))).tolist()   # [[0, 1], [2, 3]]
    """
    with _mesh_grids_lock:
        facts = per_mesh(_mesh_grids, mesh)
        grid = facts.get("grid")
    if grid is None:
        grid = mesh.mesh
        with _mesh_grids_lock:
            facts["grid"] = grid
    return grid


# --- single-process DCP -----------------------------------------------------------------------------

# dcp.save and dcp.load take no_dist from torch 2.7; torch 2.6 infers it from whether a process group is
# up, so a one-process export inside a distributed job would turn into a collective. There the older
# save_state_dict/load_state_dict, which still take no_dist, say it explicitly. Detected on first use
# (importing torch.distributed.checkpoint costs a second).
@functools.cache
def _dcp_takes_no_dist() -> bool:
    import torch.distributed.checkpoint as dcp

    return "no_dist" in inspect.signature(dcp.save).parameters


def dcp_save_local(state: dict, writer: Any, planner: Any = None) -> Any:
    """``dcp.save`` in this process alone, whether or not a process group is up.

    Example::

        dcp_save_local({"w": t}, FileSystemWriter(out))
    """
    import torch.distributed.checkpoint as dcp

    if _dcp_takes_no_dist():
        return dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # save_state_dict is deprecated, still the way on 2.6
        return dcp.save_state_dict(state, storage_writer=writer, planner=planner, no_dist=True)


def dcp_load_local(state: dict, reader: Any, planner: Any = None) -> None:
    """``dcp.load`` in this process alone, whether or not a process group is up.

    Example::

        dcp_load_local(state, FileSystemReader(src))
    """
    import torch.distributed.checkpoint as dcp

    if _dcp_takes_no_dist():
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)


# --- torchtitan -------------------------------------------------------------------------------------

# torchtitan 0.3.0, which shardpoint.integrations.torchtitan is written for, imports torch's local tensors
# and DCP's Hugging Face storage writer, which torch 2.6 lacks ("cannot import name
# 'HuggingFaceStorageWriter'"); through its torch_checkpointing requirement it asks for torch 2.11. No
# earlier torchtitan has the checkpointer interface the integration uses.
def torchtitan_runs() -> bool:
    """Whether this torch has what torchtitan 0.3.0 imports (torch 2.11 and later, as its requirements ask).

    Example::

        require("torchtitan 0.3.0", torchtitan_runs(), "2.11")
    """
    import importlib.util

    import torch.distributed.checkpoint as dcp

    local_tensors = importlib.util.find_spec("torch.distributed._local_tensor") is not None
    return local_tensors and hasattr(dcp, "HuggingFaceStorageWriter")


def describe_placements(placements: Any) -> tuple[DimPlacement, ...]:
    """A DTensor's placements, one per mesh dim, as the plain :class:`DimPlacement` the grid reads.

    Types are matched exactly: a subclass could change the split (as
    ``_StridedShard`` does of ``Shard``), so an unknown one is ``"other"``,
    like ``Partial``. A split factor torch holds symbolically is ``None``.

    Example::

        describe_placements((Shard(0), Replicate()))  # (DimPlacement('shard', 0), DimPlacement('replicate'))
    """
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    out = []
    for p in placements:
        if type(p) is Replicate:
            out.append(DimPlacement("replicate"))
        elif type(p) is Shard:
            out.append(DimPlacement("shard", int(p.dim)))
        elif type(p) is _StridedShard:
            try:
                sf: int | None = int(p.split_factor)
            except (TypeError, ValueError):  # symbolic
                sf = None
            out.append(DimPlacement("strided", int(p.dim), sf))
        else:
            out.append(DimPlacement("other"))
    return tuple(out)
