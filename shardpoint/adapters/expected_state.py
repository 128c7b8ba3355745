"""The optimizer state a save will hold once the optimizers have stepped, estimated before they have.

Pre-warming a saver usually happens before the first step, when an
optimizer such as AdamW has no state yet: a ring sized for the parameters
alone would be regrown, about threefold, inside the first save. This module
estimates, for each optimizer of the state, the state each parameter will
get at its first step, from what ``torch.optim`` makes:

======================================  ==========================================  ==============
optimizer                               tensors shaped like the parameter           scalars
======================================  ==========================================  ==============
Adam, AdamW                             exp_avg, exp_avg_sq (+ max_exp_avg_sq)      step
NAdam                                   exp_avg, exp_avg_sq                         step, mu_product
RAdam, Adamax, Adadelta, Rprop,         two                                         step
SparseAdam
RMSprop                                 square_avg (+ momentum_buffer, grad_avg)    step
SGD                                     momentum_buffer where momentum is not 0     none
ASGD                                    ax                                          step, eta, mu
Adagrad                                 sum (made by its constructor)               step
other                                   two (Adam-like; pass ``expect_bytes``)      one
======================================  ==========================================  ==============

Only parameters that require a gradient and have no state yet count, and
each counts as the share of it this rank writes: its local bytes (a shard
under FSDP or TP), divided among the ranks holding copies of it (DDP), plus,
where copies are balanced over ranks, one state tensor of headroom.

The save asks through :meth:`~shardpoint.adapters.stepped.StepUpdates.state_to_come`,
for the stepped objects of its state.

Example::

    extra = expected_state_bytes(opt, plan.tensors)
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from .optimizer import own_protocol

__all__ = ["expected_state_bytes", "state_per_parameter"]

log = logging.getLogger("shardpoint")

_SCALAR_BYTES = 8  # a step counter is a 0-d float32 (float64 under a float64 default): never under-counted


def state_per_parameter(opt: torch.optim.Optimizer, group: dict) -> tuple[int, int, bool]:
    """``(tensors shaped like the parameter, scalar tensors, known)`` each parameter of ``group`` gets at its first step.

    ``known`` is False for an optimizer this table does not know (its
    answer is then Adam's: two moments and a step).

    Example::

        state_per_parameter(opt, opt.param_groups[0])  # (2, 1, True) for AdamW
    """
    o = torch.optim
    if isinstance(opt, (o.Adam, o.AdamW)):
        return 2 + bool(group.get("amsgrad")), 1, True
    if isinstance(opt, o.NAdam):
        return 2, 2, True
    if isinstance(opt, (o.RAdam, o.Adamax, o.Adadelta, o.Rprop, o.SparseAdam)):
        return 2, 1, True
    if isinstance(opt, o.RMSprop):
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered")), 1, True
    if isinstance(opt, o.SGD):
        return int(bool(group.get("momentum", 0))), 0, True
    if isinstance(opt, o.ASGD):
        return 1, 3, True
    if isinstance(opt, o.Adagrad):
        return 1, 1, True
    return 2, 1, False


def _local(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)  # a DTensor: its local shard is what this rank holds
    return to_local() if callable(to_local) else p


def _storage(t: torch.Tensor) -> int | None:
    try:
        return _local(t).untyped_storage().data_ptr()
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _held(tensors: Sequence[Any]) -> dict[int, tuple[float, bool]]:
    """Per storage: the bytes of it this rank writes, on average over its copies, and whether it has copies."""
    out: dict[int, tuple[float, bool]] = {}
    for t in tensors:
        key = _storage(t.data)
        if key is None:
            continue
        share, copied = out.get(key, (0.0, False))
        count = max(1, int(getattr(t, "replica_count", 1)))
        out[key] = (share + t.nbytes / count, copied or count > 1)
    return out


def expected_state_bytes(opt: Any, tensors: Sequence[Any]) -> int:
    """The bytes of ``opt``'s state this rank will save that ``opt`` has not made yet (0 for anything but an optimizer).

    ``tensors`` are the tensors this rank holds (the save plan's
    ``tensors``, each with ``.data``, ``.nbytes`` and ``.replica_count``):
    a parameter none of them holds is not this rank's to save.

    Example::

        expected_state_bytes(torch.optim.AdamW(m.parameters()), plan.tensors)  # two moments and a step per parameter
    """
    if not isinstance(opt, torch.optim.Optimizer) or own_protocol(type(opt)):
        return 0  # an optimizer container: its inner optimizers make the state, and are not seen here
    held = _held(tensors)
    total, headroom = 0.0, 0
    for group in opt.param_groups:
        like, scalars, known = state_per_parameter(opt, group)
        if not known:
            log.info("pre-warming assumes %s keeps two moments per parameter, like Adam; pass expect_bytes= "
                     "to size the staging memory exactly", type(opt).__name__)
        for p in group["params"]:
            if not p.requires_grad or opt.state.get(p):
                continue  # no state at its step, or state that the plan already counted
            found = held.get(_storage(p))
            if found is None:
                continue  # not held here: another rank's to save
            share, copied = found
            local = _local(p).nbytes
            total += like * min(share, local) + scalars * _SCALAR_BYTES  # min: views sharing one storage
            if copied:  # writers of copies are balanced over ranks: one tensor more, at most
                headroom = max(headroom, local)
    return int(total) + headroom
