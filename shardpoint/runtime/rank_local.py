"""Rank-local saves (``process_group=sp.LOCAL``): the state must be complete on the saving rank.

A collective save records where each rank's shard sits among the ranks. A
rank-local save has one writer, so every tensor it saves must be whole on
that rank: a plain tensor, or a DTensor replicated over its mesh (its local
tensor is the full tensor). Such tensors are saved as one full chunk, with
no grid and no replicas. A shard of a tensor held across ranks (a sharded
DTensor, an FSDP1 or ZeRO flat piece) cannot be saved completely from one
rank: :func:`rank_local_tensors` raises a typed error naming it, before
anything is written.

Example::

    tensors = rank_local_tensors(prep_tensors, "file:///ckpt/step_100")
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..items import SaveTensor
from ..errors import UnsupportedStateError
from ..geometry import Box

__all__ = ["rank_local_tensors"]


def rank_local_tensors(tensors: Sequence[SaveTensor], where: str) -> list[SaveTensor]:
    """``tensors`` as one rank's complete copy, or :class:`UnsupportedStateError` naming a partial one.

    Pure: no process group is consulted; only each tensor's recorded geometry.
    """
    out: list[SaveTensor] = []
    for t in tensors:
        full = Box.full(t.shape)
        if t.flat is not None or t.box != full:
            piece = f"flat range {t.flat} of box {t.box}" if t.flat is not None else f"box {t.box.offsets}+{t.box.sizes}"
            raise UnsupportedStateError(
                f"{where}: tensor {t.fqn!r} of shape {tuple(t.shape)} is sharded across ranks ({t.placement or 'sharded'}); "
                f"this rank holds only its {piece}, so a rank-local save (process_group=sp.LOCAL) cannot save it "
                "completely. Save collectively over the ranks that hold it, or save a full copy "
                "(DTensor.full_tensor(), or get_model_state_dict(..., full_state_dict=True))"
            )
        out.append(replace(t, replica_index=0, replica_count=1, replica_group="", grid=None))
    return out
