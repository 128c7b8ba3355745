"""What the optimizers of a state change only inside ``optimizer.step()``.

A lazy asynchronous save copies these tensors after the call returns and
orders the next step after the copy with a step pre-hook. The save
transaction asks this module instead of knowing about optimizers: which
objects of the state take a step pre-hook, which names they update, which
live tensors witness an in-place change, and in which order the step
touches them. Optimizer state tensors carry the same fact themselves
(:attr:`~shardpoint.items.SaveTensor.step_only`, set by the optimizer adapter).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .base import AdapterContext
from .optimizer import own_protocol

__all__ = ["StepUpdates", "step_updates"]


class StepUpdates:
    """The objects of a state that take a step pre-hook, and what their step updates.

    Example::

        updates = step_updates({"model": model, "optimizer": opt})
        handles = updates.add_pre_hooks(lambda opt, args, kwargs: None)
    """

    def __init__(self, state: Mapping[str, Any]):
        self.optimizers = [(k, o) for k, o in state.items() if isinstance(o, torch.optim.Optimizer)]

    def __bool__(self) -> bool:
        return bool(self.optimizers)

    def names(self, ctx: AdapterContext) -> set[str]:
        """The names of the parameters the optimizers update in ``step()``."""
        names: set[str] = set()
        for _key, opt in self.optimizers:
            for group in opt.param_groups:
                names.update(ctx.param_names[id(p)] for p in group["params"] if id(p) in ctx.param_names)
        return names

    def live(self, ctx: AdapterContext) -> list[tuple[str, torch.Tensor]]:
        """The live tensors a lazy save copies in the background: parameters, then their optimizer state.

        These are the objects in-place changes go through (a DTensor
        parameter, not its local shard), so their version counters witness
        every change.
        """
        out: list[tuple[str, torch.Tensor]] = []
        for key, opt in self.optimizers:
            lazy_state = not own_protocol(type(opt))
            for group in opt.param_groups:
                for p in group["params"]:
                    name = ctx.param_names.get(id(p))
                    if name is None:
                        continue
                    out.append((name, p))
                    if lazy_state:
                        out.extend((f"{key}.state.{name}.{k}", v) for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor))
        return out

    def order(self) -> list[torch.Tensor]:
        """Tensors in the order the optimizers update them: each parameter, then its state."""
        out: list[torch.Tensor] = []
        for _key, opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    out.append(p)
                    out.extend(v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
        return out

    def add_pre_hooks(self, hook: Callable[..., Any]) -> list[Any]:
        """Register ``hook`` as a step pre-hook of every optimizer; return the removable handles."""
        return [opt.register_step_pre_hook(hook) for _key, opt in self.optimizers]


def step_updates(state: Mapping[str, Any]) -> StepUpdates:
    """The :class:`StepUpdates` of ``state``.

    Example::

        step_updates({"model": model, "optimizer": opt}).names(ctx)  # {"model.weight", ...}
    """
    return StepUpdates(state)
