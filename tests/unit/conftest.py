"""Fixtures for process-free unit tests: a tiny trained model and optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def build_model(seed: int, hidden: int = 8, extra_layer: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.Linear(hidden, 2)]
    if extra_layer:
        layers.append(nn.Linear(2, 2))
    return nn.Sequential(*layers)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 123) -> None:
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x = torch.randn(6, 4, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture
def trained():
    """A factory: ``trained(seed)`` -> (model, AdamW) after two steps."""

    def make(seed: int = 0, steps: int = 2):
        m = build_model(seed)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
        train(m, opt, steps)
        return m, opt

    return make


@pytest.fixture
def fresh():
    """A factory: ``fresh(seed, **model_kwargs)`` -> (model, AdamW) that never stepped."""

    def make(seed: int = 99, **kw):
        m = build_model(seed, **kw)
        return m, torch.optim.AdamW(m.parameters(), lr=0.5)

    return make
