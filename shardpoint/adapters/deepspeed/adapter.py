"""The DeepSpeed ZeRO adapter: saves and loads engines and ZeRO optimizers through their :class:`ZeroMap`."""

from __future__ import annotations

import math
import sys
from collections.abc import MutableMapping
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ...errors import UnsupportedStateError
from ...geometry import Box
from ..base import Adapter, AdapterContext, ContextFacts, LoadPart, LoadTarget, SavePart, SaveTensor
from .moe import deepspeed_expert_rules, expert_groups_made
from ..landing import live_storages, module_tensors, storage_of, unlanded
from ..optimizer import OptimizerAdapter
from ..tensors import load_target, save_tensor
from ..torch_steps import torch_step_pre_hook
from .detect import (
    is_deepspeed_engine, is_deepspeed_optimizer, is_zero3_param, is_zero_optimizer, live_group_keys, owner_of, unsupported,
    zero_stage,
)
from .zero_map import ZeroMap, ZeroSlot, engine_parts, zero_facts, zero_map

__all__ = ["scaler_doc", "DeepSpeedAdapter"]


class _GroupView(MutableMapping):
    """An inner param group whose ``params`` are the ZeRO flat partitions it steps."""

    def __init__(self, group: dict, params: list[torch.Tensor]):
        self._g, self._params = group, params

    def __getitem__(self, k):
        return self._params if k == "params" else self._g[k]

    def __setitem__(self, k, v):
        if k == "params":
            raise KeyError("params of a ZeRO group are not replaced on load")
        self._g[k] = v

    def __delitem__(self, k):
        del self._g[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._g)

    def __len__(self) -> int:
        return len(self._g)


class _InnerView:
    """The inner torch optimizer as the optimizer adapter expects it (params listed even under ZeRO-3)."""

    def __init__(self, inner: Any, params: list[list[torch.Tensor]]):
        self.state = inner.state
        self.param_groups = [_GroupView(g, ps) for g, ps in zip(inner.param_groups, params)]


def _plain_items(module: nn.Module, managed: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters ZeRO does not hold (frozen, under ZeRO-1/2) and persistent buffers."""
    for n, p in module.named_parameters():
        if id(p) not in managed:
            if is_zero3_param(p):  # pragma: no cover - every ZeRO-3 parameter is covered by a slot
                raise UnsupportedStateError(f"{n}: partitioned parameter outside any ZeRO slot")
            yield n, p
    for mname, mod in module.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b is None or bname in mod._non_persistent_buffers_set:
                continue
            yield (f"{mname}.{bname}" if mname else bname), b


def _check_extra_state(module: nn.Module, where: str) -> None:
    for mname, mod in module.named_modules():
        if type(mod).get_extra_state is not nn.Module.get_extra_state:
            raise unsupported(where, f"module {mname or '<root>'} has extra state, which the DeepSpeed adapter does not save")


_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
# fp16 dynamic loss scaling: the state that decides which of the next steps are skipped.
_SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def scaler_doc(ls: Any) -> dict:
    """The numeric state of a DeepSpeed loss scaler (``zopt.loss_scaler``), JSON-safe."""
    out = {}
    for k in _SCALER:
        v = getattr(ls, k, None)
        if torch.is_tensor(v) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
    return out


def _restore_scaler(zopt: Any, doc: Mapping[str, Any]) -> None:
    ls = getattr(zopt, "loss_scaler", None)
    if ls is None:
        return
    for k, v in doc.items():
        if k in _SCALER and hasattr(ls, k) and isinstance(v, (int, float)):
            cur = getattr(ls, k)
            setattr(ls, k, torch.tensor(v, dtype=cur.dtype, device=cur.device) if torch.is_tensor(cur) else type(cur)(v))


class DeepSpeedAdapter(Adapter):
    """DeepSpeed engines, their modules and ZeRO optimizers: fp32 partitions as flat ranges."""

    name = "deepspeed"

    def claims(self, obj: Any) -> bool:
        if "deepspeed" not in sys.modules:
            return False
        if is_deepspeed_engine(obj) or is_deepspeed_optimizer(obj):
            return True
        if not isinstance(obj, nn.Module):
            return False
        if owner_of(obj) is not None:
            return True
        # engine.module without its optimizer: ZeRO-3 parameters, or ZeRO-1/2 ones (DeepSpeed
        # links them to their fp32 fragments): refuse below rather than save stale copies.
        for p in obj.parameters():
            return is_zero3_param(p) or hasattr(p, "_hp_mapping")
        return False

    def context_facts(self, key: str, obj: Any, state: Mapping[str, Any]) -> ContextFacts | None:
        """Engines and ZeRO-managed modules: the module's names and the ZeRO views; optimizers: live group keys.

        Also answers for a torch optimizer over DeepSpeed MoE param groups,
        whose ``name`` and ``moe`` keys describe the live engine
        (:func:`~shardpoint.adapters.deepspeed.detect.live_group_keys`).
        """
        if "deepspeed" not in sys.modules:
            return None
        found, live = zero_facts(key, obj, state), live_group_keys(obj)
        if found is None and not live:
            return None
        names, views = found or ({}, {})
        return ContextFacts(names=names, views=views, live_group_keys=live)

    def may_imply_rules(self, state: Mapping[str, Any]) -> bool:
        """A state holding a module once DeepSpeed made expert-parallel groups (every rank answers alike)."""
        return "deepspeed" in sys.modules and expert_groups_made() and any(isinstance(obj, nn.Module) for obj in state.values())

    def implied_rules(self, state: Mapping[str, Any]) -> list[Any]:
        """An :class:`~shardpoint.layouts.Experts` rule per DeepSpeed MoE expert list (stored at global indices)."""
        return deepspeed_expert_rules(state) if "deepspeed" in sys.modules else []

    def is_stepped(self, obj: Any) -> bool:
        """A ZeRO optimizer: its state changes only inside the step of the torch optimizer it wraps."""
        return is_zero_optimizer(obj)

    def step_updates(self, key: str, zopt: Any, ctx: AdapterContext) -> list[tuple[str, torch.Tensor]]:
        """The inner optimizer's state tensors of each fp32 partition, named after its first parameter.

        The partitions themselves are saved with the module, copied in the call.
        """
        lay = self._optimizer_map(key, zopt, ctx)
        out: list[tuple[str, torch.Tensor]] = []
        for s in lay.slots:
            views = ctx.views.get(id(s.local), ())
            label = views[0].fqn if views else f"partition.{s.group}"
            state = zopt.optimizer.state.get(s.local, {})
            out.extend((f"{key}.state.{label}.{k}", v) for k, v in state.items() if isinstance(v, torch.Tensor))
        return out

    def add_step_pre_hook(self, zopt: Any, hook: Callable[[], None]) -> Any:
        """A step pre-hook of the wrapped torch optimizer, which ZeRO's step calls before it changes the state."""
        return torch_step_pre_hook(zopt.optimizer, hook)

    # ------------------------------------------------------------ resolving objects
    def _module_and_zero(self, key: str, obj: Any) -> tuple[nn.Module, Any]:
        where = f"state[{key!r}]"
        if is_deepspeed_engine(obj):
            return engine_parts(obj, where)
        zopt = owner_of(obj)
        if zopt is None:
            for p in obj.parameters():
                zopt = getattr(p, "_z3_optimizer", None)
                break
        if zopt is None:
            raise unsupported(
                where,
                "this module's parameters are managed by a DeepSpeed ZeRO optimizer that is not in the state; "
                "pass the engine itself ({'model': engine, 'optimizer': engine.optimizer}) so that its fp32 "
                "master weights are saved and restored",
            )
        return obj, zopt

    # ------------------------------------------------------------ save
    def save(self, key: str, obj: Any, ctx: AdapterContext) -> SavePart:
        if is_deepspeed_optimizer(obj):
            return self._save_optimizer(key, obj, ctx)
        module, zopt = self._module_and_zero(key, obj)
        if zopt is None:  # stage 0: a plain module
            from ..module import ModuleAdapter

            part = ModuleAdapter().save(key, module, ctx)
            part.framework = "deepspeed_zero0"
            part.value = dict(part.value or {}, **self._counters(obj))
            return part
        where = f"state[{key!r}]"
        _check_extra_state(module, where)
        lay = zero_map(key, module, zopt, where)
        part = SavePart(framework=f"deepspeed_zero{lay.stage}")
        for s in lay.slots:
            for e in s.entries:
                pc = e.piece
                if pc is None:
                    continue
                data = s.local[pc.offset : pc.offset + pc.numel]
                for name in e.names:
                    part.tensors.append(
                        SaveTensor(name, data, e.shape, Box.full(e.shape), (pc.start, pc.stop), 0, 1,
                                   float(pc.numel * data.element_size()), f"zero{lay.stage}")
                    )
        for name, t in _plain_items(module, lay.managed):
            st = save_tensor(f"{key}.{name}", t, ctx)
            if st is not None:
                part.tensors.append(st)
        part.value = self._counters(obj)
        return part

    @staticmethod
    def _counters(obj: Any) -> dict:
        if not is_deepspeed_engine(obj):
            return {}
        return {"deepspeed": {k: int(getattr(obj, k)) for k in _COUNTERS if isinstance(getattr(obj, k, None), int)}}

    def _save_optimizer(self, key: str, zopt: Any, ctx: AdapterContext) -> SavePart:
        lay = self._optimizer_map(key, zopt, ctx)
        part = OptimizerAdapter().save(key, _InnerView(zopt.optimizer, lay.inner_params()), ctx)
        part.framework = f"deepspeed_zero{lay.stage}:{type(zopt.optimizer).__name__}"
        scaler = scaler_doc(getattr(zopt, "loss_scaler", None))
        if scaler and getattr(zopt, "dynamic_loss_scale", False):
            part.value = dict(part.value, deepspeed={"loss_scaler": scaler})
        return part

    def _optimizer_map(self, key: str, zopt: Any, ctx: AdapterContext) -> ZeroMap:
        where = f"state[{key!r}]"
        if not is_zero_optimizer(zopt):
            raise unsupported(
                where,
                f"DeepSpeed optimizer {type(zopt).__name__} (fp16/bf16 without ZeRO) is not supported; use ZeRO "
                "stage 1, 2 or 3, or pass the torch optimizer of a stage-0 engine",
            )
        flats = (zopt.single_partition_of_fp32_groups if zero_stage(zopt) < 3 else zopt.fp32_partitioned_groups_flat)
        if not all(id(f) in ctx.views for f in flats):
            raise unsupported(
                where,
                "a ZeRO optimizer needs its model in the same state (the engine, or engine.module), so that its "
                "flat partitions can be split by parameter name",
            )
        # The map's key only names the views, which the context already holds.
        lay = ZeroMap("", zero_stage(zopt), getattr(zopt, "module", None), zopt)
        inner = zopt.optimizer
        if lay.stage < 3:
            lay.slots = [ZeroSlot(f, f, i, [], 0, 1) for i, f in enumerate(flats)]
        else:
            lay.slots = [ZeroSlot(f, f, int(zopt.sub_group_to_group_id[j]), [], 0, 1) for j, f in enumerate(flats)]
        if any(not 0 <= s.group < len(inner.param_groups) for s in lay.slots):
            raise unsupported(where, "ZeRO partitions map to unknown inner param groups")
        return lay

    def logical_value(self, key: str, value: Any, rules) -> Any:
        """A ZeRO optimizer's document under the layout rules' names (experts: their global names)."""
        if isinstance(value, dict) and {"groups", "group_of", "state"} <= set(value):
            return OptimizerAdapter().logical_value(key, value, rules)
        return value

    def read_value(self, key: str, obj: Any, doc: Any, ctx: AdapterContext, rules, where: str) -> Any:
        """A ZeRO optimizer's document in this rank's parameter names (the inverse of :meth:`logical_value`)."""
        if is_deepspeed_optimizer(obj) and rules:
            return OptimizerAdapter().read_value(key, obj, doc, ctx, rules, where)
        return doc

    # ------------------------------------------------------------ load
    def load(self, key: str, obj: Any, doc: Any, tensors: Mapping[str, Any], ctx: AdapterContext, where: str = "<checkpoint>") -> LoadPart:
        if is_deepspeed_optimizer(obj):
            return self._load_optimizer(key, obj, doc, tensors, ctx, where)
        module, zopt = self._module_and_zero(key, obj)
        counters = (doc or {}).get("deepspeed", {}) if isinstance(doc, dict) else {}
        if zopt is None:
            from ..module import ModuleAdapter

            part = ModuleAdapter().load(key, module, doc, tensors, ctx, where)
            inner_finish = part.finish

            def finish0():
                inner_finish()
                self._restore_counters(obj, counters)
                return obj

            part.finish = finish0
            return part
        _check_extra_state(module, where)
        lay = zero_map(key, module, zopt, where)
        part = LoadPart()
        casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []

        def meta_for(fqn: str, shape: tuple[int, ...], dtype: torch.dtype):
            return part.expect(tensors, fqn, shape, dtype, where)

        for s in lay.slots:
            for e in s.entries:
                if meta_for(e.fqn, e.shape, s.local.dtype) is None:
                    continue
                for alias in e.names[1:]:  # tied names hold the primary's data: check, do not read twice
                    meta_for(alias, e.shape, s.local.dtype)
                pc, p = e.piece, e.param
                if pc is not None:
                    dest = s.local[pc.offset : pc.offset + pc.numel]
                    part.targets.append(LoadTarget(e.fqn, dest, e.shape, Box.full(e.shape), (pc.start, pc.stop)))
                    if lay.stage == 3 and s.opt_param is not None:
                        copies.append((p.ds_tensor.view(-1)[: pc.numel], dest))
                # The low-precision copy DeepSpeed computes with, where this rank holds it whole
                # (always under ZeRO-1/2; gathered persistent parameters under ZeRO-3).
                if (lay.stage < 3 or s.opt_param is not None) and p.numel() == math.prod(e.shape) and p.numel() > 0:
                    full = p.data
                    if full.dtype != s.local.dtype:
                        tmp = torch.empty(e.shape, dtype=s.local.dtype, device=full.device)
                        casts.append((full, tmp))
                        full = tmp
                    part.targets.append(LoadTarget(e.fqn, full, e.shape, Box.full(e.shape)))
        for name, t in _plain_items(module, lay.managed):
            fqn = f"{key}.{name}"
            if meta_for(fqn, tuple(t.shape), t.dtype) is None:
                continue
            tgt = load_target(fqn, t)
            if tgt is not None:
                part.targets.append(tgt)

        copied: dict[int, bool] = {}

        def finish():
            with torch.no_grad():
                for dst, src in copies:  # ZeRO-3: fp32 master -> this rank's bit16 partition
                    if dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)
                for dst, src in casts:
                    dst.copy_(src)
                    copied[storage_of(src)] = True  # reached the live low-precision copy
            casts.clear()
            self._restore_counters(obj, counters)
            return obj

        def landed(targets):
            # The fp32 partitions the ZeRO optimizer steps are live state, as are the module's tensors.
            live = live_storages(module_tensors(module)) | {storage_of(s.local) for s in lay.slots}
            return unlanded(targets, live, copied)

        part.finish = finish
        part.landed = landed
        return part

    @staticmethod
    def _restore_counters(obj: Any, counters: Mapping[str, Any]) -> None:
        if is_deepspeed_engine(obj):
            for k in _COUNTERS:
                if isinstance(counters.get(k), int):
                    setattr(obj, k, counters[k])

    def _load_optimizer(self, key, zopt, doc, tensors, ctx, where) -> LoadPart:
        lay = self._optimizer_map(key, zopt, ctx)
        view = _InnerView(zopt.optimizer, lay.inner_params())
        # The view's groups are the ZeRO optimizer's: they keep the live keys declared for it (a MoE
        # group's name is its expert-parallel group, which describes this engine, not a hyper-parameter).
        live = {**ctx.live_group_keys, id(view): ctx.live_group_keys.get(id(zopt), frozenset())}
        part = OptimizerAdapter().load(key, view, doc, tensors, replace(ctx, live_group_keys=live), where)
        inner_finish = part.finish

        scaler = ((doc or {}).get("deepspeed") or {}).get("loss_scaler") if isinstance(doc, dict) else None

        def finish():
            inner_finish()
            if scaler and getattr(zopt, "dynamic_loss_scale", False):
                _restore_scaler(zopt, scaler)
            # ZeRO-1/2 keep per-parameter views of the state (for safe_get_full_optimizer_state and
            # universal checkpoints): point them at the new state tensors (local, no collective).
            if hasattr(zopt, "_hp_optimizer_states_linked"):
                _relink_state_views(zopt)
            return zopt

        part.finish = finish
        return part


def _relink_state_views(zopt: Any) -> None:
    """Point a ZeRO-1/2 optimizer's per-parameter state views at its (new) state tensors.

    Uses DeepSpeed's public linkage function, as its own lazy linking does,
    so that no private flag of the optimizer is written from here.
    """
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    state = zopt.optimizer.state
    if not all(state.get(f) for f in zopt.single_partition_of_fp32_groups):
        return
    for i, _ in enumerate(zopt.optimizer.param_groups):
        lazy_init_hp_params_optimizer_state(zopt.bit16_groups[i], zopt.single_partition_of_fp32_groups[i], state)
