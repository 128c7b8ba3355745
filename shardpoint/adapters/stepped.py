"""What the stepped objects of a state (optimizers) change only inside their step.

A lazy asynchronous save copies these tensors after the call returns and
orders the next step after the copy with a step pre-hook. The save
transaction asks this module instead of knowing about optimizers: which
objects of the state take a step pre-hook, which names they update, which
live tensors witness an in-place change, and in which order the step
touches them. Each object's adapter says so through its abilities
(:meth:`~shardpoint.adapters.Adapter.is_stepped`,
:meth:`~shardpoint.adapters.Adapter.step_updates` and
:meth:`~shardpoint.adapters.Adapter.add_step_pre_hook`), so a registered
adapter for an optimizer of any kind takes part. Optimizer state tensors
also carry the fact themselves (:attr:`~shardpoint.items.SaveTensor.step_only`,
set by the optimizer adapter).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch

from .base import Adapter, AdapterContext
from .expected_state import expected_state_bytes
from .registry import adapter_for, default_adapters

__all__ = ["StepUpdates", "step_updates"]


class StepUpdates:
    """The objects of a state that take a step pre-hook, and what their step updates.

    ``stepped`` lists ``(key, object, adapter)`` for every entry whose
    adapter (the one that claims it) declares it stepped.

    Example::

        updates = step_updates({"model": model, "optimizer": opt})
        handles = updates.add_pre_hooks(lambda opt, args, kwargs: None)
    """

    def __init__(self, state: Mapping[str, Any]):
        adapters = default_adapters()
        self.stepped: list[tuple[str, Any, Adapter]] = []
        for key, obj in state.items():
            # ``is_stepped`` is cheap and asked first: claims may walk a whole model.
            said = [a for a in adapters if a.is_stepped(obj)]
            adapter = adapter_for(obj, adapters) if said else None
            if any(a is adapter for a in said):
                self.stepped.append((key, obj, adapter))

    def __bool__(self) -> bool:
        return bool(self.stepped)

    def names(self, ctx: AdapterContext) -> set[str]:
        """The names of the tensors the steps update (parameters and state), as the save stores them."""
        return {name for name, _ in self.live(ctx)}

    def live(self, ctx: AdapterContext) -> list[tuple[str, torch.Tensor]]:
        """The live tensors a lazy save copies in the background: what each step updates, in its order.

        These are the objects in-place changes go through (a DTensor
        parameter, not its local shard), so their version counters witness
        every change.
        """
        out: list[tuple[str, torch.Tensor]] = []
        for key, obj, adapter in self.stepped:
            out.extend(adapter.step_updates(key, obj, ctx))
        return out

    def order(self, ctx: AdapterContext) -> list[torch.Tensor]:
        """Tensors in the order the steps update them (for an optimizer: each parameter, then its state)."""
        return [t for _, t in self.live(ctx)]

    def in_graphs(self) -> list[str]:
        """The keys of stepped objects whose step may run inside a captured graph (:meth:`Adapter.steps_in_graph`)."""
        return [key for key, obj, adapter in self.stepped if adapter.steps_in_graph(obj)]

    def state_to_come(self, tensors: Sequence[Any]) -> int:
        """The bytes of state the stepped objects will make at their first step, of the ``tensors`` this rank holds.

        What pre-warming sizes the staging memory for before an optimizer
        has stepped (:func:`~shardpoint.adapters.expected_state.expected_state_bytes`).

        Example::

            step_updates({"model": m, "optimizer": torch.optim.AdamW(m.parameters())}).state_to_come(plan.tensors)
        """
        return sum(expected_state_bytes(obj, tensors) for _key, obj, _adapter in self.stepped)

    def add_pre_hooks(self, hook: Callable[..., Any]) -> list[Any]:
        """Have every stepped object call ``hook(obj, (), {})`` before its step; return the removable handles."""
        return [adapter.add_step_pre_hook(obj, functools.partial(hook, obj, (), {})) for _key, obj, adapter in self.stepped]


def step_updates(state: Mapping[str, Any]) -> StepUpdates:
    """The :class:`StepUpdates` of ``state``.

    Example::

        step_updates({"model": model, "optimizer": opt}).names(ctx)  # {"model.weight", ...}
    """
    return StepUpdates(state)
