"""Plain values, tensors, DTensors and ``Stateful`` objects, as one encoded tree."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from ..errors import CheckpointError, FormatError, IncompleteStateError, UnsupportedStateError, mismatch_error
from ..format.values import decode_value, encode_value
from .base import Adapter, AdapterContext, LoadPart, SavePart, dtype_name, torch_dtype
from .torch_steps import torch_capturable, torch_step_pre_hook, torch_step_updates
from .landing import alias_key, live_storages, local_of, same_bits, storage_of, tree_tensors, unlanded
from .tensors import empty_like_target, is_dtensor, load_target, save_tensor

__all__ = ["TreeAdapter", "StatefulAdapter", "encode_tree", "decode_tree"]

log = logging.getLogger("shardpoint")


def encode_tree(key: str, obj: Any, ctx: AdapterContext) -> SavePart:
    part = SavePart(framework="values")

    def on_tensor(fqn: str, t: torch.Tensor) -> None:
        st = save_tensor(fqn, t, ctx)
        if st is not None:
            part.tensors.append(st)

    part.value = encode_value(obj, key, on_tensor, ctx.allow_pickle)
    return part


def _existing_tensors(key: str, obj: Any) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    try:
        encode_value(obj, key, lambda fqn, t: found.__setitem__(fqn, t), allow_pickle=True)
    except Exception:  # noqa: BLE001 - the current object is only a hint for in-place targets
        pass
    return found


def decode_tree(
    key: str, doc: Any, current: Any, tensors: Mapping[str, Any], ctx: AdapterContext, where: str
) -> tuple[LoadPart, list, Callable[[list], None]]:
    """Targets for every tensor the saved tree references, a holder for the decoded tree, and ``settle``.

    ``settle(targets)`` runs before the tree is used: a fresh tensor whose
    target the load dropped (``keys=`` left it out) would hold uninitialised
    memory, so it takes the object's current value instead, or the load
    refuses when there is none.
    """
    part = LoadPart()
    existing = _existing_tensors(key, current)
    fresh: list[tuple[str, torch.Tensor]] = []

    def settle(targets: list) -> None:
        if not fresh:
            return
        read = {storage_of(t.dest) for t in targets}
        for fqn, dest in fresh:
            if local_of(dest).numel() == 0 or storage_of(dest) in read:
                continue
            like = existing.get(fqn)
            if like is None or is_dtensor(like) or tuple(like.shape) != tuple(dest.shape):
                raise UnsupportedStateError(
                    f"{where}: {fqn!r} is not selected by keys=, but state[{key!r}] is restored as a whole and "
                    "holds no current value for it; select it too"
                )
            with torch.no_grad():
                dest.copy_(like.detach())

    def get_tensor(fqn: str):
        meta = tensors.get(fqn)
        if meta is None:
            part.missing.append(fqn)
            return None
        part.consumed.add(fqn)
        like = existing.get(fqn)
        dt = torch_dtype(meta.dtype)
        if like is not None and is_dtensor(like):
            if tuple(like.shape) != tuple(meta.shape) or like.dtype != dt:
                raise mismatch_error(where, fqn, (meta.dtype, meta.shape), (dtype_name(like.dtype), like.shape))
            dest = like
        else:
            dest = empty_like_target(None, tuple(meta.shape), dt, like.device if like is not None else None)
            fresh.append((fqn, dest))
        tgt = load_target(fqn, dest)
        if tgt is not None:
            part.targets.append(tgt)
        return dest

    holder = [decode_value(doc, get_tensor, ctx.allow_pickle, where)]
    return part, holder, settle


class TreeAdapter(Adapter):
    """Fallback for tensors, DTensors and plain data (numbers, strings, lists, dicts)."""

    name = "values"

    def claims(self, obj: Any) -> bool:
        return True

    def save(self, key: str, obj: Any, ctx: AdapterContext) -> SavePart:
        return encode_tree(key, obj, ctx)

    def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>") -> LoadPart:
        part, holder, settle = decode_tree(key, doc, obj, tensors, ctx, where)

        def finish():
            settle(part.targets)
            return holder[0]

        part.finish = finish
        # The decoded tree replaces the entry: its tensors are the live state.
        part.landed = lambda targets: unlanded(targets, live_storages(tree_tensors(holder[0])))
        return part


class StatefulAdapter(Adapter):
    """Any object with ``state_dict()`` and ``load_state_dict()``: its own protocol, tensors resharded.

    The state dict is saved as a tree whose tensors keep their geometry
    (DTensors reshard on load). A load takes the object's current state dict
    as the template (its DTensors are filled in place, so they come back
    sharded as the object holds them now), then hands the filled tree to
    ``load_state_dict``. For an optimizer that declares its own protocol (an
    optimizer container) torch's contract says that ``state_dict()`` returns
    what ``load_state_dict`` installed, so the state dict is taken again and
    every loaded tensor must be found there, as the same memory or the same
    bits. Other objects (schedulers, samplers, generators) have no such
    contract: what their ``load_state_dict`` accepted counts as landed.
    """

    name = "stateful"

    def claims(self, obj: Any) -> bool:
        return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))

    def is_stepped(self, obj: Any) -> bool:
        """A torch optimizer with its own state protocol: its step still updates only the parameters."""
        return isinstance(obj, torch.optim.Optimizer)

    def step_updates(self, key: str, obj: Any, ctx: AdapterContext) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's named parameters (its state is saved as ``state_dict()`` copies, in the call)."""
        return torch_step_updates(key, obj, ctx, with_state=False)

    def steps_in_graph(self, obj: Any) -> bool:
        """Yes when a param group is ``capturable`` (:func:`torch_capturable`)."""
        return torch_capturable(obj)

    def add_step_pre_hook(self, obj: Any, hook: Callable[[], None]) -> Any:
        """A torch step pre-hook."""
        return torch_step_pre_hook(obj, hook)

    def save(self, key: str, obj: Any, ctx: AdapterContext) -> SavePart:
        sd = obj.state_dict()
        part = encode_tree(key, sd, ctx)
        part.framework = f"stateful:{type(obj).__qualname__}"
        trained = isinstance(obj, torch.optim.Optimizer) and any(
            p.requires_grad for g in obj.param_groups for p in g["params"]
        )
        if trained:  # (a placeholder optimizer over a frozen dummy tensor is fine)
            if isinstance(sd, Mapping) and not sd:
                raise IncompleteStateError(
                    f"state[{key!r}]: optimizer {type(obj).__qualname__} has parameters but its state_dict() is "
                    "empty, so the checkpoint would restore nothing; make state_dict() return the state of the "
                    "optimizers it holds, or put each of them in the state as its own entry"
                )
            grads = any(p.grad is not None for g in obj.param_groups for p in g["params"])
            if grads and not part.tensors:
                log.warning(
                    "state[%r]: optimizer %s has parameters with gradients but its state_dict() holds no tensors; "
                    "check that it returns the state of the optimizers it holds", key, type(obj).__qualname__,
                )
        return part

    def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>") -> LoadPart:
        current = obj.state_dict()
        part, holder, settle = decode_tree(key, doc, current, tensors, ctx, where)
        verify = isinstance(obj, torch.optim.Optimizer)
        if verify:
            # State the optimizer holds now but the checkpoint has no value for would keep its
            # current (freshly initialised) value: that is missing, not loaded.
            referenced = part.consumed | set(part.missing)
            part.missing.extend(f for f in _existing_tensors(key, current) if f not in referenced)
        vouched: dict[int, bool] = {}

        def finish():
            settle(part.targets)
            try:
                obj.load_state_dict(holder[0])
            except CheckpointError:
                raise
            except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
                # The state came from the checkpoint: a document the object refuses is bad input.
                raise FormatError(
                    f"{where}: entry {key!r}: the saved state does not fit {type(obj).__qualname__}.load_state_dict "
                    f"({type(e).__name__}: {str(e)[:300]})"
                ) from e
            given = {}
            for fqn, t in _existing_tensors(key, holder[0]).items():
                if local_of(t).numel() > 0:
                    given[fqn] = t
            if verify:
                after = _existing_tensors(key, obj.state_dict())
                for fqn, t in given.items():
                    now = after.get(fqn)
                    vouched[storage_of(t)] = isinstance(now, torch.Tensor) and (
                        alias_key(now) == alias_key(t) or same_bits(now, t)
                    )
            else:
                for t in given.values():
                    vouched[storage_of(t)] = True
            return obj

        part.finish = finish
        part.landed = lambda targets: unlanded(targets, set(), vouched)
        return part
