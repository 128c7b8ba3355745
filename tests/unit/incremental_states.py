"""A small state with a frozen part and an adapter, and the data bytes of a checkpoint folder: shared by the
incremental-save unit tests (blocking and background)."""

from __future__ import annotations

import os

import torch


def lora_pair(seed: int = 0) -> dict:
    """A frozen tensor (64 KiB), an adapter and a step count."""
    g = torch.Generator().manual_seed(seed)
    return {"model": {"frozen": torch.randn(256, 64, generator=g), "adapter": torch.randn(8, 8, generator=g)}, "step": 1}


def data_bytes(folder: str) -> int:
    """Bytes of the data files (``data/*.bin``) of the checkpoint at ``folder``."""
    d = os.path.join(folder, "data")
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".bin"))
