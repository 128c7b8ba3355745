"""RNGState in one process: exact packing, sp.save/sp.load round trips, resize policies, CUDA logic.

The multi-rank behaviour (each rank its own row; 4 -> 4 exact, 4 -> 2, 2 -> 3)
is in tests/dist/test_state.py. There is no GPU here: the CUDA path runs
against a stand-in for the few ``torch.cuda`` functions it calls.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.training import rng as R
from shardpoint.training.rng import RNGState, capture_rows, derive_seed, pick_row, restore_rows


@pytest.fixture(autouse=True)
def keep_global_rng():
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    yield
    torch.set_rng_state(saved[0])
    random.setstate(saved[1])
    np.random.set_state(saved[2])


def draws():
    return (torch.rand(3, dtype=torch.float64).tolist(), [random.random() for _ in range(3)],
            np.random.rand(3).tolist(), random.gauss(0, 1), float(np.random.randn()))


def stir():
    torch.rand(7), random.random(), np.random.rand(5)


def test_packing_is_exact_including_cached_gaussians():
    random.seed(5)
    random.gauss(0, 1)  # leaves a cached second gaussian in the state
    np.random.seed(6)
    np.random.randn()  # leaves has_gauss=1 and a cached value
    py, npy = random.getstate(), np.random.get_state()
    assert py[2] is not None and npy[3] == 1
    assert R._unpack_python(bytes(R._pack_python(py).numpy())) == py
    got = R._unpack_numpy(bytes(R._pack_numpy(npy).numpy()))
    assert got[0] == npy[0] and np.array_equal(got[1], npy[1]) and got[2:] == tuple(npy[2:])
    rows = capture_rows()
    assert {k: v.dtype for k, v in rows.items()} == {"torch": torch.uint8, "python": torch.uint8, "numpy": torch.uint8}
    assert rows["torch"].numel() == 5056


def test_state_dict_round_trip_is_bit_exact():
    stir()
    random.gauss(0, 1)
    rng = RNGState()
    sd = rng.state_dict()
    want = draws()
    stir()
    rng.load_state_dict(sd)
    assert draws() == want
    assert rng.last_restore == {"row": 0, "exact": True, "saved_world": 1, "world": 1, "generators": ["numpy", "python", "torch"]}


@pytest.mark.parametrize("target", ["dir", "memory"])
def test_sp_save_load_round_trip(tmp_path, target):
    path = str(tmp_path / "c") if target == "dir" else sp.MemoryStorage()
    stir()
    sp.save(path, {"rng": RNGState(), "extra": {"step": 3}})
    want = draws()
    m = sp.read_manifest(path)
    assert set(m.tensors) == {"rng.rows_w1.torch", "rng.rows_w1.python", "rng.rows_w1.numpy"}
    assert m.values["rng"]["world_size"] == 1
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    state = {"rng": RNGState(), "extra": {}}
    sp.load(path, state)
    assert draws() == want


def test_generator_subset_leaves_others_alone():
    rng = RNGState(("python",))
    sd = rng.state_dict()
    assert list(sd["rows_w1"]) == ["python"]
    x = random.random()
    t = torch.rand(1)
    rng.load_state_dict(sd)
    assert random.random() == x and not torch.equal(torch.rand(1), t)


def test_pick_row_policies():
    assert pick_row("derive", 3, 4, 4) == (3, True)
    assert pick_row("error", 3, 4, 4) == (3, True)  # same world never consults the policy
    assert [pick_row("derive", r, 2, 4) for r in range(2)] == [(0, True), (1, True)]  # shrink: continue
    assert [pick_row("derive", r, 3, 2) for r in range(3)] == [(0, True), (1, True), (0, False)]  # grow: derive
    assert [pick_row("wrap", r, 3, 2) for r in range(3)] == [(0, True), (1, True), (0, True)]
    with pytest.raises(ValueError, match="saved by 4 rank"):
        pick_row("error", 0, 2, 4)
    with pytest.raises(ValueError, match="on_resize"):
        pick_row("bogus", 0, 2, 4)
    with pytest.raises(ValueError, match="bad layout"):
        pick_row("derive", 2, 2, 4)


def test_derived_seeds_are_deterministic_and_distinct():
    row = bytes(range(64))
    seeds = {derive_seed(row, r, n) for r in range(16) for n in ("torch", "python", "numpy")}
    assert len(seeds) == 48
    assert derive_seed(row, 5, "torch") == derive_seed(row, 5, "torch")
    assert derive_seed(row, 5, "torch") != derive_seed(row[:-1] + b"\xff", 5, "torch")
    assert all(0 <= s < 2**64 for s in seeds)


def saved_by(world: int) -> dict:
    """A state as ``world`` ranks would save it (loaded whole, since this world differs)."""
    rows = {}
    for r in range(world):
        random.seed(r), np.random.seed(r), torch.manual_seed(r)
        for k, v in capture_rows(("torch", "python", "numpy")).items():
            rows.setdefault(k, []).append(v)
    return {"version": 1, "world_size": world, "generators": sorted(rows),
            f"rows_w{world}": {k: torch.stack(v) for k, v in rows.items()}}


def test_load_from_larger_world_restores_own_row():
    sd = saved_by(4)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    want = draws()
    stir()
    rng = RNGState()  # this process: rank 0 of 1
    rng.load_state_dict(sd)
    assert rng.last_restore["exact"] and rng.last_restore["row"] == 0
    assert draws() == want
    with pytest.raises(ValueError, match="saved by 4 rank"):
        RNGState(on_resize="error").load_state_dict(sd)


def test_derived_streams_match_seeding_from_derive_seed():
    sd = {"python": bytes(R._pack_python(random.getstate()).numpy())}
    R.seed_generators(sd, 7, "current")
    a = random.random()
    random.seed(derive_seed(sd["python"], 7, "python"))
    assert random.random() == a


def test_malformed_states():
    with pytest.raises(ValueError, match="version"):
        RNGState().load_state_dict({"version": 9})
    with pytest.raises(ValueError, match="malformed"):
        RNGState().load_state_dict({"version": 1, "world_size": 2})
    with pytest.raises(ValueError, match=r"shape \(2, n\)"):
        RNGState().load_state_dict({"version": 1, "world_size": 2, "rows_w2": {"torch": torch.zeros(5056, dtype=torch.uint8)}})
    with pytest.raises(ValueError, match="uint8"):
        RNGState().load_state_dict({"version": 1, "world_size": 1, "rows_w1": {"torch": torch.zeros(1, 4)}})
    with pytest.raises(ValueError, match="unknown generator"):
        RNGState(("torch", "jax"))
    with pytest.raises(ValueError, match="on_resize"):
        RNGState(on_resize="maybe")


# ---------------------------------------------------------------- CUDA, without a GPU


class FakeCuda:
    """The torch.cuda functions RNGState uses, over two fake devices of 16-byte states."""

    def __init__(self):
        self.states = {0: torch.arange(16, dtype=torch.uint8), 1: torch.arange(100, 116, dtype=torch.uint8)}
        self.current = 1
        self.default_generators = [self.Gen(self, 0), self.Gen(self, 1)]

    class Gen:
        def __init__(self, cuda, d):
            self.cuda, self.d = cuda, d

        def manual_seed(self, seed):
            g = torch.Generator().manual_seed(seed)
            self.cuda.states[self.d] = torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g)

    def is_available(self):
        return True

    def device_count(self):
        return 2

    def current_device(self):
        return self.current

    def get_rng_state(self, device=0):
        return self.states[device].clone()

    def set_rng_state(self, state, device=0):
        self.states[device] = state.clone()


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("is_available", "device_count", "current_device", "get_rng_state", "set_rng_state", "default_generators"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_cuda_current_device_round_trip(fake_cuda):
    rng = RNGState()
    sd = rng.state_dict()
    assert sd["generators"] == ["cuda", "numpy", "python", "torch"]
    assert torch.equal(sd["rows_w1"]["cuda"][0], torch.arange(100, 116, dtype=torch.uint8))  # device 1 only
    fake_cuda.states[1] = torch.zeros(16, dtype=torch.uint8)
    rng.load_state_dict(sd)
    assert torch.equal(fake_cuda.states[1], torch.arange(100, 116, dtype=torch.uint8))
    assert torch.equal(fake_cuda.states[0], torch.arange(16, dtype=torch.uint8))


def test_cuda_all_devices_and_derive(fake_cuda):
    rng = RNGState(cuda="all")
    rows = capture_rows(("cuda",), "all")
    assert rows["cuda"].numel() == 32
    sd = rng.state_dict()
    fake_cuda.states = {0: torch.zeros(16, dtype=torch.uint8), 1: torch.zeros(16, dtype=torch.uint8)}
    rng.load_state_dict(sd)
    assert torch.equal(torch.cat([fake_cuda.states[0], fake_cuda.states[1]]), rows["cuda"])
    R.seed_generators({"cuda": bytes(rows["cuda"].numpy())}, 3, "all")
    assert not torch.equal(fake_cuda.states[0], fake_cuda.states[1])


def test_cuda_rows_skipped_without_cuda():
    sd = {"version": 1, "world_size": 1, "generators": ["cuda"],
          "rows_w1": {"cuda": torch.zeros(1, 16, dtype=torch.uint8)}}
    with pytest.warns(UserWarning, match="CUDA is not available"):
        RNGState().load_state_dict(sd)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        restore_rows({"cuda": torch.zeros(16, dtype=torch.uint8)})


def test_docstring_examples():
    import doctest

    assert doctest.testmod(R).failed == 0
