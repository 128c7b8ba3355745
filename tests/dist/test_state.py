"""The rest of the training state on gloo ranks: data order across DP sizes, per-rank RNG."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.training.data import epoch_permutation
from shardpoint.training.rng import seed_generators
from shardpoint.testing import launch

from . import state_cases as C

pytestmark = pytest.mark.dist

STEPS = 4  # batches per rank before the first save


def expected_epoch(tail_world: int, tail_start: int) -> Counter:
    """Every sample once, plus the padding repeats of the last segment (P[0], P[1], ...)."""
    perm = epoch_permutation(C.N, C.SEED, 0).tolist()
    pad = (-(C.N - tail_start)) % tail_world
    return Counter(perm + perm[:pad])


@pytest.mark.slow
def test_data_and_rng_across_world_sizes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = launch(4, "tests.dist.state_cases:save_job", {"path": a, "steps": STEPS})
    pos_a = 4 * STEPS * C.BATCH
    assert [r["position"] for r in saved] == [pos_a] * 4
    first = [i for r in saved for i in r["consumed"]]
    perm = epoch_permutation(C.N, C.SEED, 0).tolist()
    assert sorted(first) == sorted(perm[:pos_a])  # lockstep: a prefix of the permutation

    m = sp.read_manifest(a)
    assert m.values["data"]["position"] == pos_a and m.values["data"]["epoch"] == 0  # a plain value
    assert m.tensors["rng.rows_w4.torch"].shape == (4, 5056)
    rows = sp.read_tensor(a, "rng.rows_w4.torch")
    assert len({bytes(r.numpy()) for r in rows}) == 4  # each rank wrote its own row

    # Same layout: every rank continues bit-exactly; data exactly once over the epoch.
    same = launch(4, "tests.dist.state_cases:resume_job", {"src": a})
    for r, (s, g) in enumerate(zip(saved, same)):
        assert g["draws"] == s["draws"], f"rank {r}: RNG not restored bit-exactly"
        assert g["restore"] == {"row": r, "exact": True, "saved_world": 4, "world": 4, "generators": ["numpy", "python", "torch"]}
        assert g["start"] == pos_a and g["epoch"] == 1 and g["position"] == 0
    assert Counter(first + [i for g in same for i in g["rest"]]) == expected_epoch(4, pos_a)

    # DP 4 -> 2: same global position; ranks 0 and 1 continue their own streams.
    two = launch(2, "tests.dist.state_cases:resume_job", {"src": a, "dst": b, "steps_before_save": 2})
    for r, g in enumerate(two):
        assert g["draws"] == saved[r]["draws"]
        assert g["restore"]["exact"] and g["restore"]["row"] == r and g["restore"]["saved_world"] == 4
    assert Counter(first + [i for g in two for i in g["before"] + g["rest"]]) == expected_epoch(2, pos_a)

    # DP 4 -> 2 -> 3, the second hop from mid-epoch: rank 2 is new and derives its streams.
    pos_b = pos_a + 2 * 2 * C.BATCH
    three = launch(3, "tests.dist.state_cases:resume_job", {"src": b})
    assert [g["start"] for g in three] == [pos_b] * 3
    for r in (0, 1):
        assert three[r]["draws"] == two[r]["saved_draws"] and three[r]["restore"]["exact"]
    assert three[2]["restore"] == {"row": 0, "exact": False, "saved_world": 2, "world": 3, "generators": ["numpy", "python", "torch"]}
    new = three[2]["draws"]
    assert all(new["torch"] != g["draws"]["torch"] for g in three[:2])
    chain = first + [i for g in two for i in g["before"]] + [i for g in three for i in g["rest"]]
    assert Counter(chain) == expected_epoch(3, pos_b)

    # The derived streams are a pure function of (saved row 0, rank 2): recompute them here.
    rows_b = {n: bytes(sp.read_tensor(b, f"rng.rows_w2.{n}")[0].numpy()) for n in ("torch", "python", "numpy")}
    keep = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        seed_generators(rows_b, 2, "current")
        assert C.draws() == new
    finally:
        torch.set_rng_state(keep[0]); random.setstate(keep[1]); np.random.set_state(keep[2])
