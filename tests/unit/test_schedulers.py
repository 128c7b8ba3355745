"""LR schedulers and gradient scalers through the generic Stateful path of sp.save/sp.load.

Their state dicts are plain data (numbers, lists, nested dicts, inf), which the
safe value codec stores in the manifest. They must come back bit-exact, with
the same Python types, and training must go on identically. State the codec
cannot store safely (a function inside a callable object) must fail with a
clear message unless ``allow_pickle=True``.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.optim import lr_scheduler as L

import shardpoint as sp
from shardpoint.errors import FormatError, UnsupportedStateError


def same(a, b, path="state"):
    """Deep equality that also checks types (1 vs 1.0 vs True) and treats NaN as equal.

    A ``Counter`` comes back as a plain ``dict`` (see ``test_counter_type_is_kept``).
    """
    if isinstance(b, Counter) and type(a) is dict:
        b = dict(b)
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def setup(make, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, make(opt)


def step(model, opt, sched, i):
    g = torch.Generator().manual_seed(i)
    loss = model(torch.randn(4, 3, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if isinstance(sched, L.ReduceLROnPlateau):
        sched.step(1.0)  # a plateau: bad epochs accumulate
    else:
        sched.step()


SCHEDULERS = {
    "StepLR": lambda o: L.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[2, 6], gamma=0.3),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=7, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=1.0, total_steps=20),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=1),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.2, total_iters=4),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=6, power=2.0),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, total_iters=2), L.StepLR(o, 2)], milestones=[2]),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.LinearLR(o, total_iters=3), L.ExponentialLR(o, 0.8)]),
    # A plain lambda is not part of LambdaLR's state dict (stored as None), so this saves safely.
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.95**e),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_round_trip(tmp_path, name):
    make = SCHEDULERS[name]
    model, opt, sched = setup(make)
    for i in range(5):
        step(model, opt, sched, i)
    sp.save(str(tmp_path / "c"), {"model": model, "optimizer": opt, "sched": sched})

    model2, opt2, sched2 = setup(make, seed=1)
    sp.load(str(tmp_path / "c"), {"model": model2, "optimizer": opt2, "sched": sched2})
    same(sched2.state_dict(), sched.state_dict())
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    for i in range(5, 8):  # and they go on identically
        step(model, opt, sched, i)
        step(model2, opt2, sched2, i)
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    same(sched2.state_dict(), sched.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_counter_type_is_kept(tmp_path):
    # MultiStepLR keeps its milestones in a Counter; after a load they are a plain dict. get_lr
    # still works (it only tests membership and indexes), but the deprecated step(epoch) path
    # calls milestones.elements(), which a dict lacks.
    model, opt, sched = setup(SCHEDULERS["MultiStepLR"])
    sp.save(str(tmp_path / "c"), {"sched": sched})
    _, _, sched2 = setup(SCHEDULERS["MultiStepLR"])
    sp.load(str(tmp_path / "c"), {"sched": sched2})
    assert type(sched2.milestones) is Counter


def test_grad_scaler_round_trip_on_cpu(tmp_path):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    assert scaler.is_enabled()
    for i in range(6):
        loss = model(torch.ones(2, 3)).sum() * (float("inf") if i == 4 else 1.0)  # one overflow: back off
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    sd = scaler.state_dict()
    assert (sd["scale"], sd["_growth_tracker"]) == (2048.0, 1)  # grew twice, backed off once
    sp.save(str(tmp_path / "c"), {"scaler": scaler, "extra": {"step": 5}})
    fresh = torch.amp.GradScaler("cpu")
    state = {"scaler": fresh, "extra": {}}
    sp.load(str(tmp_path / "c"), state)
    same(fresh.state_dict(), sd)
    assert fresh.get_scale() == scaler.get_scale() and state["extra"] == {"step": 5}


class Warmup:
    """A callable LR factor whose state holds a function: not plain data."""

    def __init__(self):
        self.curve = math.sqrt

    def __call__(self, epoch):
        return min(1.0, self.curve(epoch + 1) / 3)


def test_unencodable_scheduler_state_is_refused_clearly(tmp_path):
    model, opt, sched = setup(lambda o: L.LambdaLR(o, Warmup()))
    step(model, opt, sched, 0)
    # LambdaLR stores a callable object's __dict__: here it holds a builtin function.
    with pytest.raises(UnsupportedStateError) as e:
        sp.save(str(tmp_path / "c"), {"sched": sched})
    msg = str(e.value)
    assert "builtin_function_or_method" in msg and "'sched.lr_lambdas.0.curve'" in msg
    assert "allow_pickle=True" in msg
    assert not (tmp_path / "c" / "manifest.json").exists()

    # Opting in: saved pickled, and loading needs the same opt-in.
    sp.save(str(tmp_path / "c"), {"sched": sched}, allow_pickle=True)
    _, _, sched2 = setup(lambda o: L.LambdaLR(o, Warmup()))
    with pytest.raises(FormatError, match="allow_pickle=True"):
        sp.load(str(tmp_path / "c"), {"sched": sched2})
    sp.load(str(tmp_path / "c"), {"sched": sched2}, allow_pickle=True)
    assert sched2.last_epoch == sched.last_epoch and sched2.lr_lambdas[0].curve is math.sqrt
