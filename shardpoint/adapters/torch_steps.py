"""What a ``torch.optim.Optimizer``'s ``step()`` updates, and how a hook runs before it.

The optimizer adapters declare their objects stepped
(:meth:`~shardpoint.adapters.Adapter.is_stepped`) through these: a lazy
asynchronous save copies what the step updates after the call returns and
fences the save in a step pre-hook.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import AdapterContext

__all__ = ["torch_step_updates", "torch_step_pre_hook", "torch_capturable"]


def torch_step_updates(key: str, opt: Any, ctx: AdapterContext, with_state: bool) -> list[tuple[str, torch.Tensor]]:
    """What a torch optimizer's ``step()`` updates, in its order: each named parameter, then (``with_state``) its state.

    State tensors are named as :class:`~shardpoint.adapters.optimizer.OptimizerAdapter` saves them
    (``<key>.state.<param>.<name>``); parameters no module of the state owns
    are left out, as they are not saved under a name.

    Example::

        torch_step_updates("optimizer", opt, ctx, True)  # [("model.w", w), ("optimizer.state.model.w.exp_avg", m), ...]
    """
    out: list[tuple[str, torch.Tensor]] = []
    for group in opt.param_groups:
        for p in group["params"]:
            name = ctx.param_names.get(id(p))
            if name is None:
                continue
            out.append((name, p))
            if with_state:
                out.extend((f"{key}.state.{name}.{k}", v) for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor))
    return out


def torch_step_pre_hook(opt: Any, hook: Callable[[], None]) -> Any:
    """Register ``hook()`` to run before each ``opt.step()`` (a torch step pre-hook); returns the removable handle.

    Example::

        handle = torch_step_pre_hook(opt, fence); ...; handle.remove()
    """
    return opt.register_step_pre_hook(lambda _opt, _args, _kwargs: hook())


def torch_capturable(opt: Any) -> bool:
    """Whether any param group of a torch optimizer is ``capturable`` (made to step inside a captured graph).

    Example::

        torch_capturable(torch.optim.AdamW(params, capturable=True))  # True
    """
    return any(group.get("capturable") for group in opt.param_groups)
