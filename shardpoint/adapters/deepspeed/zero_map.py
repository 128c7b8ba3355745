"""Reading a live ZeRO optimizer: where every parameter of a DeepSpeed-managed module lies on this rank."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..base import ParamView
from ..fsdp1 import Piece1D
from .moe import deepspeed_expert_rules
from .detect import is_deepspeed_engine, is_zero3_param, is_zero_optimizer, remember_owner, unsupported, world_and_rank, zero_stage
from .partition import zero3_holders, zero3_partition_size, zero3_pieces, zero12_holders, zero12_partitions, zero12_pieces

__all__ = ["ZeroEntry", "ZeroSlot", "ZeroMap", "zero_map", "engine_parts", "zero_facts"]


@dataclass
class ZeroEntry:
    """One original parameter of a slot, and the piece of it this rank holds."""

    param: torch.Tensor  # the model's parameter (bit16; an empty placeholder under ZeRO-3)
    names: list[str]  # with the state key; the first is the primary, the rest tied aliases
    shape: tuple[int, ...]
    piece: Piece1D | None
    holders: list[int]

    @property
    def fqn(self) -> str:
        """The primary name of the parameter (tied aliases follow it in ``names``)."""
        return self.names[0]


@dataclass
class ZeroSlot:
    """A 1-D local tensor holding pieces of several parameters (an fp32 partition)."""

    local: torch.Tensor
    opt_param: torch.Tensor | None  # the tensor the inner optimizer steps (state key)
    group: int | None  # its inner optimizer param group
    entries: list[ZeroEntry]
    rank: int
    world: int

    def views(self) -> tuple[ParamView, ...]:
        """What of each parameter this slot holds, as the optimizer adapter splits state by it."""
        out = []
        for e in self.entries:
            p, hs = e.piece, e.holders
            if p is not None:
                out.append(ParamView(e.fqn, e.shape, (p.start, p.stop), (p.offset, p.numel), (0, 1), (hs.index(self.rank), len(hs))))
            else:
                out.append(ParamView(e.fqn, e.shape, None, (0, 0), (0, 1), (0, max(1, len(hs)))))
        return tuple(out)


@dataclass
class ZeroMap:
    """Where every parameter of a DeepSpeed-managed module lies on this rank."""

    key: str
    stage: int
    module: nn.Module
    optimizer: Any
    slots: list[ZeroSlot] = field(default_factory=list)
    managed: set[int] = field(default_factory=set)  # ids of parameters the slots cover

    def views(self) -> dict[int, tuple[ParamView, ...]]:
        """Per stepped fp32 tensor (by id), the parameter views its optimizer state covers."""
        return {id(s.opt_param): s.views() for s in self.slots if s.opt_param is not None}

    def inner_params(self) -> list[list[torch.Tensor]]:
        """Per inner optimizer param group, the flat tensors it steps (ZeRO-3 lists none at rest)."""
        inner = self.optimizer.optimizer
        out: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
        for s in self.slots:
            if s.opt_param is not None:
                out[s.group].append(s.opt_param)
        return out


def _names(key: str, module: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(f"{key}.{n}")
    return out


def _check_world(where: str, world: int) -> None:
    full, _ = world_and_rank()
    if world != full:
        raise unsupported(
            where,
            f"the ZeRO data-parallel group has {world} of {full} ranks (DeepSpeed tensor, pipeline or "
            "expert parallelism, or MiCS); only ZeRO over the whole process group is supported",
        )


def _is_moe_group(zopt: Any, i: int) -> bool:
    flags = getattr(zopt, "is_moe_param_group", None)
    return bool(flags and i < len(flags) and flags[i])


def _check_expert_group(where: str, world: int, params: Sequence[torch.Tensor], names: dict[int, list[str]], rules) -> None:
    """A ZeRO-1/2 MoE group: partitioned over the expert data-parallel group, every parameter a detected expert.

    Its pieces are saved under the experts' global names (the
    :class:`~shardpoint.adapters.experts.Experts` rules), so each parameter
    must be one of a DeepSpeed MoE layer's local experts, and the expert
    data-parallel degree times the EP degree must make up the process group.
    """
    full, _ = world_and_rank()
    for p in params:
        name = names.get(id(p), ["<unnamed>"])[0]
        rule = next((r for r in rules if r.param_match(name) is not None), None)
        if rule is None:
            raise unsupported(
                where,
                f"{name}: a parameter of a DeepSpeed MoE optimizer group that is not a local expert of a "
                "deepspeed.moe.layer.MoE layer (deepspeed_moe.experts.deepspeed_experts) is not supported; keep "
                "expert-parallel parameters inside MoE layers, or train it without expert parallelism",
            )
        ep = rule.ep()[1]
        if world * ep != full:
            raise unsupported(
                where,
                f"{name}: ZeRO partitions it over {world} ranks and DeepSpeed's expert-parallel group has {ep}, "
                f"which do not make up the {full} ranks (DeepSpeed tensor or pipeline parallelism with experts); "
                "only expert x expert-data parallelism over the whole process group is supported",
            )


def _zero12_slots(zopt: Any, names: dict[int, list[str]], where: str, rules=()) -> list[ZeroSlot]:
    slots = []
    for i, fp32 in enumerate(zopt.single_partition_of_fp32_groups):
        world, rank = world_and_rank(zopt.real_dp_process_group[i])
        if _is_moe_group(zopt, i):  # experts: partitioned over the expert data-parallel group
            _check_expert_group(where, world, zopt.round_robin_bit16_groups[i], names, rules)
        else:
            _check_world(where, world)
        params = list(zopt.round_robin_bit16_groups[i])
        metas = getattr(zopt, "round_robin_bit16_meta", None)
        shapes = [tuple(int(x) for x in (metas[i][k].shape if metas else p.shape)) for k, p in enumerate(params)]
        numels = [math.prod(s) for s in shapes]
        offsets = getattr(zopt, "round_robin_bit16_offsets", None)
        offsets = list(offsets[i]) if offsets else [sum(numels[:k]) for k in range(len(numels))]
        flat = zopt.bit16_groups_flat[i]
        total = flat.numel()
        pieces = {p.index: p for p in zero12_pieces(numels, offsets, total, world, rank)}
        holders = zero12_holders(numels, offsets, total, world)
        if fp32.numel() != zero12_partitions(total, world)[rank][1]:
            raise unsupported(where, f"ZeRO group {i}: fp32 partition of {fp32.numel()} elements, expected "
                               f"{zero12_partitions(total, world)[rank][1]}; this DeepSpeed version is not supported")
        entries = []
        rr = bool(getattr(zopt, "round_robin_gradients", False))
        for k, p in enumerate(params):
            if id(p) not in names:
                raise unsupported(where, f"ZeRO group {i} holds a parameter of shape {shapes[k]} that the module does not own")
            pc = pieces.get(k)
            # DeepSpeed's own per-parameter mapping (used by its universal checkpoints) must agree.
            # With round_robin_gradients, DeepSpeed 0.19.8 builds that mapping in the original
            # parameter order while the flat buffer is in round-robin order (its safe_get_full_*
            # helpers then return other parameters' elements); the buffer check below still holds.
            hp = getattr(p, "_hp_mapping", None)
            if (hp is not None or pc is not None) and not (rr and world > 1):
                ours = (pc.start, pc.numel, pc.offset) if pc is not None else None
                theirs = (hp.lp_fragment_address.start, hp.lp_fragment_address.numel, hp.hp_fragment_address.start) if hp is not None else None
                if hasattr(p, "_hp_mapping") and ours != theirs:
                    raise unsupported(where, f"{names[id(p)][0]}: unexpected ZeRO partitioning (DeepSpeed says {theirs}, "
                                       f"expected {ours}); this DeepSpeed version is not supported")
            if numels[k] and p.data.numel() == numels[k] and p.data.data_ptr() != flat.data_ptr() + offsets[k] * flat.element_size():
                raise unsupported(where, f"{names[id(p)][0]}: the parameter is not a view of ZeRO's flat buffer "
                                   "at the expected offset; this DeepSpeed version is not supported")
            entries.append(ZeroEntry(p, names[id(p)], shapes[k], pc, holders[k]))
        slots.append(ZeroSlot(fp32.detach(), fp32, i, entries, rank, world))
    return slots


def _zero3_slots(zopt: Any, module: nn.Module, names: dict[int, list[str]], where: str) -> list[ZeroSlot]:
    if type(zopt).__name__ != "DeepSpeedZeroOptimizer_Stage3":
        raise unsupported(where, f"{type(zopt).__name__} (MiCS and other ZeRO-3 variants) is not supported")
    if int(getattr(zopt, "zero_hpz_partition_size", 1) or 1) > 1:
        raise unsupported(where, "ZeRO++ hierarchical partitioning (zero_hpz_partition_size > 1) is not supported")
    slots, covered = [], set()
    positions = getattr(zopt, "grad_position", {})
    for j, params in enumerate(zopt.fp16_groups):
        fp32 = zopt.fp32_partitioned_groups_flat[j]
        group = zopt._get_sub_group_process_group(j) if hasattr(zopt, "_get_sub_group_process_group") else None
        world, rank = world_and_rank(group)
        _check_world(where, world)
        numels = [int(p.ds_numel) for p in params]
        pieces = {p.index: p for p in zero3_pieces(numels, world, rank)}
        holders = zero3_holders(numels, world)
        expect = sum(zero3_partition_size(n, world) for n in numels)
        if fp32.numel() != expect:
            raise unsupported(where, f"ZeRO-3 sub-group {j}: fp32 partition of {fp32.numel()} elements, expected {expect} "
                               "(optimizer state swapped to NVMe is not supported)")
        entries, pos = [], 0
        for k, p in enumerate(params):
            if id(p) not in names:
                raise unsupported(where, f"ZeRO-3 sub-group {j} holds a parameter the module does not own")
            ps = zero3_partition_size(numels[k], world)
            if int(p.ds_tensor.ds_numel) != ps:
                raise unsupported(where, f"{names[id(p)][0]}: ZeRO-3 partition of {p.ds_tensor.ds_numel} elements, "
                                   f"expected {ps}; this DeepSpeed version is not supported")
            got = positions.get(zopt.get_param_id(p)) if positions else None
            if got is not None and [int(x) for x in got] != [j, pos, ps]:
                raise unsupported(where, f"{names[id(p)][0]}: DeepSpeed places it at {list(got)}, expected {[j, pos, ps]}")
            pos += ps
            entries.append(ZeroEntry(p, names[id(p)], tuple(int(x) for x in p.ds_shape), pieces.get(k), holders[k]))
            covered.add(id(p))
        slots.append(ZeroSlot(fp32.detach(), fp32, int(zopt.sub_group_to_group_id[j]), entries, rank, world))
    # Partitioned parameters the optimizer does not step (frozen): their ds_tensor is all there is.
    seen = set()
    for n, p in module.named_parameters():
        if id(p) in covered or id(p) in seen or not is_zero3_param(p):
            continue
        seen.add(id(p))
        world, rank = world_and_rank()
        numel = int(p.ds_numel)
        pc = zero3_pieces([numel], world, rank)
        slots.append(ZeroSlot(p.ds_tensor.detach().view(-1), None, None,
                           [ZeroEntry(p, names[id(p)], tuple(int(x) for x in p.ds_shape), pc[0] if pc else None,
                                   zero3_holders([numel], world)[0])], rank, world))
    return slots


def zero_map(key: str, module: nn.Module, zopt: Any, where: str = "") -> ZeroMap:
    """The pieces of every parameter of ``module`` (state key ``key``) held by ZeRO optimizer ``zopt``."""
    stage = zero_stage(zopt)
    if stage == 0:
        raise unsupported(where, f"{type(zopt).__name__} is not a ZeRO optimizer")
    names = _names(key, module)
    lay = ZeroMap(key, stage, module, zopt)
    if stage == 3:
        lay.slots = _zero3_slots(zopt, module, names, where)
    else:
        lay.slots = _zero12_slots(zopt, names, where, deepspeed_expert_rules({key: module}))
    lay.managed = {id(e.param) for s in lay.slots for e in s.entries}
    inner = zopt.optimizer
    for s in lay.slots:
        if s.opt_param is None:
            continue
        if s.group is None or not 0 <= s.group < len(inner.param_groups):
            raise unsupported(where, f"ZeRO flat partition maps to inner param group {s.group}")
        if stage < 3 and not any(q is s.opt_param for q in inner.param_groups[s.group]["params"]):
            raise unsupported(where, f"inner optimizer group {s.group} does not step its ZeRO fp32 partition")
    return lay


def engine_parts(engine: Any, where: str) -> tuple[nn.Module, Any]:
    """(module, ZeRO optimizer or None) of an engine; None for stage 0 with a torch optimizer.

    Example::

        module, zopt = engine_parts(engine, "state['model']")
    """
    opt = getattr(engine, "optimizer", None)
    if type(engine).__name__ == "PipelineEngine":
        raise unsupported(where, "DeepSpeed pipeline engines are not supported")
    if opt is None or is_zero_optimizer(opt):
        return engine.module, opt
    if isinstance(opt, torch.optim.Optimizer):
        return engine.module, None
    raise unsupported(
        where,
        f"DeepSpeed optimizer {type(opt).__name__} (fp16/bf16 without ZeRO) keeps fp32 master weights "
        "shardpoint does not place; use ZeRO stage 1, 2 or 3",
    )


def _owner_in_state(module: nn.Module, opts: Sequence[Any]) -> Any:
    params = {id(p) for p in module.parameters()}
    for o in opts:
        if zero_stage(o) == 3:
            if getattr(o, "module", None) is module or any(id(p) in params for g in o.fp16_groups for p in g):
                return o
        elif any(id(p) in params for g in o.bit16_groups for p in g):
            return o
    return None


def zero_facts(key: str, obj: Any, state: Mapping[str, Any]) -> tuple[dict[int, str], dict[int, tuple[ParamView, ...]]] | None:
    """Parameter names and optimizer views of entry ``state[key] = obj`` when DeepSpeed manages it, else ``None``.

    An engine, or a module whose ZeRO optimizer is in the state (remembered,
    so that ``engine.module`` can stand in for the engine). Names are the
    module's own (``model.tok.weight``, not the engine's
    ``model.module.tok.weight``); views split each ZeRO fp32 partition (what
    the inner optimizer steps) into per-parameter pieces.

    Example::

        names, views = zero_facts("model", engine, {"model": engine, "optimizer": engine.optimizer})
    """
    if "deepspeed" not in sys.modules:
        return None
    where = f"state[{key!r}]"
    if is_deepspeed_engine(obj):
        module, zopt = engine_parts(obj, where)
    elif isinstance(obj, nn.Module):
        opts = [o for o in state.values() if is_zero_optimizer(o)]
        zopt = _owner_in_state(obj, opts) if opts else None
        if zopt is None:
            return None
        remember_owner(obj, zopt)
        module = obj
    else:
        return None
    names = {i: ns[0] for i, ns in _names(key, module).items()}
    views = zero_map(key, module, zopt, where).views() if zopt is not None else {}
    return names, views
