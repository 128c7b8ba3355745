"""Rank functions for tests/dist/test_state.py: data order and RNG across world sizes."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader

import shardpoint as sp
from shardpoint.training.data import ResumableLoader, ResumableSampler
from shardpoint.training.rng import RNGState

N = 101  # not a multiple of any world size used: the tail pads
BATCH = 3  # per rank
SEED = 1234


def make_loader() -> ResumableLoader:
    ds = list(range(N))
    return ResumableLoader(DataLoader(ds, batch_size=BATCH, sampler=ResumableSampler(ds, seed=SEED)))


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def draws() -> dict:
    """The next few numbers of every generator (JSON round-trips floats exactly)."""
    return {
        "torch": torch.rand(4, dtype=torch.float64).tolist(),
        "python": [random.random() for _ in range(4)],
        "numpy": np.random.rand(4).tolist(),
    }


def take(it, steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        out += next(it).tolist()
    return out


def save_job(rank: int, world: int, path: str, steps: int) -> dict:
    """Consume ``steps`` batches, save data order and RNG, report the next draws."""
    seed_all(100 + rank)
    draws()  # move every stream away from its seed
    loader = make_loader()
    consumed = take(iter(loader), steps)
    sp.save(path, {"data": loader, "rng": RNGState(), "extra": {"steps": steps}})
    return {"consumed": consumed, "draws": draws(), "position": loader.sampler.position}


def resume_job(rank: int, world: int, src: str, dst: str = "", steps_before_save: int = 0) -> dict:
    """Load ``src``, report the first draws, consume the rest of the epoch (saving ``dst`` on the way)."""
    seed_all(999 + rank)  # scramble: the load must restore
    loader, rng = make_loader(), RNGState()
    state = {"data": loader, "rng": rng, "extra": {}}
    sp.load(src, state)
    out = {"draws": draws(), "restore": rng.last_restore, "start": loader.sampler.position}
    it = iter(loader)
    before = take(it, steps_before_save) if dst else []
    if dst:
        sp.save(dst, {"data": loader, "rng": RNGState(), "extra": {}})
        out["saved_draws"] = draws()
    rest = [i for b in it for i in b.tolist()]
    out.update(before=before, rest=rest, epoch=loader.epoch, position=loader.sampler.position)
    return out
