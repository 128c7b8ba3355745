"""Save and load an Accelerate ``Accelerator``'s state with shardpoint.

:func:`save_state` and :func:`load_state` are the shardpoint counterparts of
``Accelerator.save_state`` / ``Accelerator.load_state``. They cover what the
accelerator tracks: every prepared model, optimizer and scheduler, the
objects registered with ``register_for_checkpointing``, the gradient scaler,
the gradient-accumulation ``step`` and each process's random generators
(:class:`shardpoint.RNGState`). Every process calls them (they are
collectives, as Accelerate's own are); each process writes only its share
of the tensors, and checksums are verified on load.

What is not included: the position in the dataloaders (use
``accelerator.skip_first_batches`` or a :class:`shardpoint.ResumableLoader`
and add it to the state with ``extra``). DeepSpeed and Megatron-LM
accelerators keep their state in their own engines and are refused.

Example::

    from accelerate import Accelerator
    from shardpoint.integrations.accelerate import load_state, save_state

    accelerator = Accelerator()
    model, opt, sched = accelerator.prepare(model, opt, sched)
    save_state(accelerator, "ckpt/step_100")
    ...
    load_state(accelerator, "ckpt/step_100")
"""

from __future__ import annotations

from typing import Any, Mapping

from ..api import LoadResult, SaveResult, load, save
from ..errors import UnsupportedStateError
from ..rng import RNGState
from ..extras import require

require("accelerate", "accelerate", "shardpoint.integrations.accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["accelerator_state", "save_state", "load_state"]

_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


class _Step:
    """The accelerator's gradient-accumulation step counter, as a ``Stateful``."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


def accelerator_state(accelerator: Accelerator, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The shardpoint state for everything ``accelerator`` tracks, plus ``extra``.

    Keys: ``model_<i>``, ``optimizer_<i>``, ``scheduler_<i>`` and ``custom_<i>``
    in the order Accelerate holds them (the order of ``prepare`` and
    ``register_for_checkpointing`` calls), ``scaler`` when mixed precision
    uses one, ``step`` and ``rng``. Pass the same ``extra`` keys to save and
    load.

    Example::

        state = accelerator_state(accelerator, extra={"data": loader})
        sp.save("ckpt/step_100", state)
    """
    if accelerator.distributed_type in _UNSUPPORTED:
        raise UnsupportedStateError(
            f"shardpoint.integrations.accelerate does not handle {accelerator.distributed_type.value}: "
            "its engine owns the model and optimizer state; use accelerator.save_state instead"
        )
    state: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        state[f"model_{i}"] = model
    for i, opt in enumerate(accelerator._optimizers):
        # AcceleratedOptimizer is an Optimizer only by inheritance; the real one is inside.
        state[f"optimizer_{i}"] = getattr(opt, "optimizer", opt)
    for i, sched in enumerate(accelerator._schedulers):
        state[f"scheduler_{i}"] = sched
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["step"] = _Step(accelerator)
    state["rng"] = RNGState()
    for k, v in (extra or {}).items():
        if k in state:
            raise ValueError(f"extra key {k!r} collides with the accelerator's own state key")
        state[k] = v
    return state


def save_state(accelerator: Accelerator, path: str, *, extra: Mapping[str, Any] | None = None, **kwargs: Any) -> SaveResult:
    """Save ``accelerator``'s state to ``path``; call it on every process.

    Keyword arguments go to :func:`shardpoint.save`.

    Example::

        save_state(accelerator, "ckpt/step_100")
    """
    return save(path, accelerator_state(accelerator, extra), **kwargs)


def load_state(accelerator: Accelerator, path: str, *, extra: Mapping[str, Any] | None = None, **kwargs: Any) -> LoadResult:
    """Restore ``accelerator``'s state from ``path`` in place; call it on every process.

    Prepare the same models, optimizers and schedulers (and register the same
    objects) first. Keyword arguments go to :func:`shardpoint.load`; with the
    default ``strict=True`` anything missing on either side raises
    :class:`~shardpoint.errors.KeyMismatchError`. The returned
    :class:`~shardpoint.LoadResult` carries timings and bytes read.

    Example::

        model, opt, sched = accelerator.prepare(model, opt, sched)
        load_state(accelerator, "ckpt/step_100")
    """
    kwargs.pop("return_result", None)
    return load(path, accelerator_state(accelerator, extra), return_result=True, **kwargs)
