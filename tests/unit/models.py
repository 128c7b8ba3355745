"""Small models, optimizer steps and state snapshots shared by the unit tests of saves.

Example::

    m = stack(32, 64, 8)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    step(m, opt)
    before = flat(m, opt)
"""

from __future__ import annotations

import torch
from torch import nn

import shardpoint as sp
from shardpoint.adapters import Adapter


def stack(width: int, hidden: int, out: int, seed: int = 0) -> nn.Sequential:
    """Linear, LayerNorm, Linear, seeded: ``width`` inputs, ``out`` outputs."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, out))


def step(m: nn.Sequential, opt: torch.optim.Optimizer, batch: int = 4) -> None:
    """One optimizer step on a random batch (a squared-mean loss), gradients cleared after."""
    m(torch.randn(batch, m[0].in_features)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def flat(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of the model's state (``m.<name>``) and of the optimizer's tensors (``o.<param>.<name>``)."""
    out = {f"m.{k}": v.clone() for k, v in m.state_dict().items()}
    state = opt.state_dict()["state"]
    out.update({f"o.{k}.{n}": v.clone() for k, s in state.items() for n, v in s.items() if torch.is_tensor(v)})
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in any bit (the same names on both sides)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))]


def stepped_linear(n: int = 64) -> tuple[nn.Linear, torch.optim.SGD, dict[str, torch.Tensor]]:
    """A ``Linear(n, n)`` after one SGD step, its optimizer, and copies of the model's state to load back."""
    model = nn.Linear(n, n)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, n)).sum().backward()
    opt.step()
    return model, opt, {k: v.clone() for k, v in model.state_dict().items()}


def loads_back(path: str, want: dict[str, torch.Tensor], n: int = 64) -> bool:
    """Whether the model saved at ``path`` loads into a fresh ``Linear(n, n)`` as ``want``, bit for bit."""
    back = nn.Linear(n, n)
    sp.load(path, {"model": back}, strict=False)
    return all(torch.equal(v, want[k]) for k, v in back.state_dict().items())


def stepped_adamw(m: nn.Sequential, steps: int = 1) -> torch.optim.AdamW:
    """An AdamW (lr 1e-2) over ``m`` after ``steps`` steps: its moments exist."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(steps):
        step(m, opt)
    return opt


def reloaded(path: str, m: nn.Sequential) -> dict[str, torch.Tensor]:
    """:func:`flat` of ``m`` and an AdamW over it, stepped twice (other values), after loading ``path`` into both."""
    opt = stepped_adamw(m, steps=2)
    sp.load(path, {"model": m, "optimizer": opt})
    return flat(m, opt)


class ClaimsNothing(Adapter):
    """An adapter that claims no object: a base for tests of the abilities asked of every registered adapter.

    Example::

        class Tags(ClaimsNothing):
            name = "tags"

            def context_facts(self, key, obj, state):
                return None
    """

    name = "claims-nothing"

    def claims(self, obj):
        return False

    def save(self, key, obj, ctx):  # pragma: no cover - claims nothing
        raise NotImplementedError

    def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>"):  # pragma: no cover - claims nothing
        raise NotImplementedError
