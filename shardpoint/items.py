"""What flows between the layers: tensors to save, tensors to fill, dtype names.

Adapters produce :class:`SaveTensor` items (local data plus where it sits in
the global tensor) and :class:`LoadTarget` items (local tensors to fill in
place); the engine writes and reads them. Both layers import them from here,
so the engine needs nothing from the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .geometry import Box

__all__ = ["SaveTensor", "LoadTarget", "dtype_name", "torch_dtype"]


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name (``"float32"`` -> ``torch.float32``)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


@dataclass
class SaveTensor:
    """One local shard to save.

    ``data`` holds the shard's elements: shaped like ``box`` when ``flat`` is
    ``None``, otherwise a 1-D tensor of elements ``[flat[0], flat[1])`` of the
    box's row-major order. ``replica_index``/``replica_count`` say which copy
    this is among ranks holding identical data; exactly one copy is written.
    ``cost`` is a rank-independent size estimate used to balance writers.
    ``replica_group`` names the group whose ranks all list the same replicated
    tensors (``""``: the whole process group); writers are balanced within
    each group separately, since ranks of different pipeline stages hold
    different tensors. ``grid`` describes the whole tensor's split over a mesh
    of ranks (format version 2 records it instead of every chunk); the save
    checks it against ``box`` and the copy index before trusting it.
    ``placement`` names how the tensor is spread over ranks (``"local"``,
    ``"replicated"``, ``"dtensor(Shard(dim=0),)"``...); the manifest records it.
    ``step_only`` is the adapter's declaration that the tensor changes only
    inside ``optimizer.step()`` (optimizer state), so a lazy save may copy it
    after the call returns.
    """

    fqn: str
    data: torch.Tensor
    shape: tuple[int, ...]
    box: Box
    flat: tuple[int, int] | None = None
    replica_index: int = 0
    replica_count: int = 1
    cost: float = 0.0
    placement: str = ""
    replica_group: str = ""
    grid: Any = None  # a shardpoint.geometry.grid.Grid in global ranks, when the placement has one (DTensors)
    step_only: bool = False  # changes only inside optimizer.step(): a lazy save may copy it in the background

    @property
    def nbytes(self) -> int:
        n = self.box.numel if self.flat is None else self.flat[1] - self.flat[0]
        return n * self.data.element_size()


@dataclass
class LoadTarget:
    """One local tensor to fill from the checkpoint, in place.

    ``dest`` is shaped like ``box`` (or 1-D over ``flat``), with the dtype and
    global ``shape`` the target expects.
    """

    fqn: str
    dest: torch.Tensor
    shape: tuple[int, ...]
    box: Box
    flat: tuple[int, int] | None = None
