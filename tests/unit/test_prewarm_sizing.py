"""Pre-warming before the first optimizer step sizes the staging memory for the state the optimizer will have.

A saver is pre-warmed before training starts, when AdamW has no moments
yet. Sized for the parameters alone, its ring would be regrown, about
threefold, inside the first save. Here every kind of ``torch.optim``
optimizer is pre-warmed before its first step; the first save's call then
allocates no host memory (and no device temporary), and the ring stays
within 1.25x of the state.
"""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.device import SimulatedDevice
from shardpoint.engine.staging import PINNED_SLACK
from shardpoint.adapters.expected_state import state_per_parameter
from tests.unit.models import flat, reloaded, stack, step


def _state_bytes(m, opt) -> int:
    model = sum(t.nbytes for t in m.state_dict().values())
    return model + sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-3),
    "rmsprop-centered-momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-3),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-3),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-3),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_prewarming_before_the_first_step_leaves_nothing_to_allocate_in_the_first_save(tmp_path, kind):
    sim = SimulatedDevice(delay=0.0)
    m = stack(200, 300, 30)
    m[1].weight.requires_grad_(False)  # frozen: it gets no optimizer state
    opt = OPTIMIZERS[kind](m.parameters())
    state = {"model": m, "optimizer": opt}
    saver = sp.AsyncSaver(piece_bytes=64 << 10, device=sim, prewarm_state=state)  # before the first step
    try:
        allocated, temporaries = sim.host_allocations, sim.pool.reused
        step(m, opt)
        need = _state_bytes(m, opt)
        assert saver.prewarmed.state_bytes >= need  # sized for the state the step made
        expect = {k: v for k, v in flat(m, opt).items()}
        h = saver.save(str(tmp_path / "ck"), state)  # the first save's call
        assert sim.host_allocations == allocated and sim.pool.reused == temporaries == 0  # nothing allocated in it
        h.wait()
        assert sim.host_allocations == allocated and sim.pinned.registrations == 1
        assert need <= saver.staging_bytes <= PINNED_SLACK * need and sim.pinned.peak_held <= PINNED_SLACK * need
        if kind == "adamw":
            got = reloaded(str(tmp_path / "ck"), stack(200, 300, 30))
            assert all(torch.equal(got[k], expect[k]) for k in expect if k.startswith("m."))
    finally:
        saver.close()
    assert sim.pinned.held == 0


def test_the_table_knows_what_each_optimizer_makes_at_its_first_step():
    p = torch.nn.Parameter(torch.randn(7, 3))
    for kind, make in OPTIMIZERS.items():
        opt = make([p])
        like, scalars, known = state_per_parameter(opt, opt.param_groups[0])
        p.grad = torch.randn(7, 3)
        opt.step()
        made = [v for v in opt.state[p].values() if torch.is_tensor(v)]
        assert known and sum(v.shape == p.shape for v in made) == like, kind
        assert sum(v.dim() == 0 for v in made) == scalars, kind


class _Lion(torch.optim.Optimizer):
    """An optimizer the estimate does not know: one moment per parameter."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf.sign(), alpha=-g["lr"])


def test_an_unknown_optimizer_is_sized_like_adam_unless_expect_bytes_says(tmp_path):
    sim = SimulatedDevice(delay=0.0)
    m = stack(200, 300, 30)
    opt = _Lion(m.parameters())
    params = sum(p.nbytes for p in m.parameters())
    saver = sp.AsyncSaver(piece_bytes=64 << 10, device=sim, prewarm=False)
    try:
        guessed = saver.prewarm({"model": m, "optimizer": opt})
        assert guessed.expected_bytes >= 2 * params  # two moments assumed
        exact = saver.prewarm({"model": m, "optimizer": opt}, expect_bytes=2 * params)
        assert exact.state_bytes == 2 * params and exact.expected_bytes == params
        step(m, opt)
        allocated = sim.host_allocations
        saver.save(str(tmp_path / "ck"), {"model": m, "optimizer": opt}).wait()
        assert sim.host_allocations == allocated  # the larger ring made first is kept
    finally:
        saver.close()
