"""Plain values, tensors, DTensors and ``Stateful`` objects, as one encoded tree."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import CheckpointError, FormatError, ShapeMismatchError
from ..format.values import decode_value, encode_value
from .base import AdapterContext, LoadPart, SavePart, dtype_name, torch_dtype
from .tensors import empty_like_target, is_dtensor, load_target, save_tensor

__all__ = ["TreeAdapter", "StatefulAdapter", "encode_tree", "decode_tree"]


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
) -> tuple[LoadPart, list]:
    """Targets for every tensor the saved tree references, and a holder for the decoded tree."""
    part = LoadPart()
    existing = _existing_tensors(key, current)

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
                raise ShapeMismatchError(
                    f"{where}: tensor {fqn!r}: checkpoint has {meta.dtype}{list(meta.shape)}, "
                    f"target has {dtype_name(like.dtype)}{list(like.shape)}"
                )
            dest = like
        else:
            dest = empty_like_target(None, tuple(meta.shape), dt, like.device if like is not None else None)
        tgt = load_target(fqn, dest)
        if tgt is not None:
            part.targets.append(tgt)
        return dest

    holder = [decode_value(doc, get_tensor, ctx.allow_pickle, where)]
    return part, holder


class TreeAdapter:
    """Fallback for tensors, DTensors and plain data (numbers, strings, lists, dicts)."""

    name = "values"

    def claims(self, obj: Any) -> bool:
        return True

    def save(self, key: str, obj: Any, ctx: AdapterContext) -> SavePart:
        return encode_tree(key, obj, ctx)

    def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>") -> LoadPart:
        part, holder = decode_tree(key, doc, obj, tensors, ctx, where)
        part.finish = lambda: holder[0]
        return part


class StatefulAdapter:
    """Any object with ``state_dict()`` and ``load_state_dict()`` (schedulers, samplers, ...)."""

    name = "stateful"

    def claims(self, obj: Any) -> bool:
        return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))

    def save(self, key: str, obj: Any, ctx: AdapterContext) -> SavePart:
        part = encode_tree(key, obj.state_dict(), ctx)
        part.framework = f"stateful:{type(obj).__qualname__}"
        return part

    def load(self, key, obj, doc, tensors, ctx, where="<checkpoint>") -> LoadPart:
        part, holder = decode_tree(key, doc, obj.state_dict(), tensors, ctx, where)

        def finish():
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
            return obj

        part.finish = finish
        return part
