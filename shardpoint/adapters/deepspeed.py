"""DeepSpeed ZeRO (stages 1, 2 and 3): flat fp32 partitions saved as they are.

ZeRO keeps the fp32 master weights, and the optimizer moments, in one flat
1-D buffer per parameter group and gives every data-parallel rank one slice
of it. That slice cuts original parameters at arbitrary element positions:

* **ZeRO-1/2** (``DeepSpeedZeroOptimizer``): the group's parameters are
  concatenated (``round_robin_bit16_groups`` at ``round_robin_bit16_offsets``,
  padded to a multiple of the world size) and split into ``world`` slices;
  rank ``r`` holds ``single_partition_of_fp32_groups[i]``, elements
  ``[r * P, (r + 1) * P)`` of the group.
* **ZeRO-3** (``DeepSpeedZeroOptimizer_Stage3``): every parameter is split on
  its own into ``ceil(numel / world)``-element slices (``param.ds_tensor``);
  a rank's fp32 master ``fp32_partitioned_groups_flat[j]`` concatenates its
  slices of the parameters of sub-group ``j``.

Nothing is gathered. Each piece of an original parameter in the local slice
is saved as a flat range of that parameter's row-major order, under the
model's own names (``model.layers.0.attn.wq.weight``), and the optimizer
moments of the same slice likewise (``optimizer.state.<param>.exp_avg``, see
:mod:`shardpoint.adapters.optimizer`, whose per-parameter *views* do the
splitting). So a ZeRO checkpoint is the same checkpoint an FSDP2, TP, DDP or
single-process run of the same model writes, and loads into any of them; a
checkpoint of any of them loads into ZeRO at any world size and stage.

Loading fills the local fp32 partition in place (targets with flat ranges).
The low-precision copies DeepSpeed trains with are refreshed without a
collective: under ZeRO-1/2 every rank holds every parameter whole, so each
one is read whole (the target needs it); under ZeRO-3 each rank copies its
fp32 slices into its ``ds_tensor`` partitions, and reads whole only the
parameters it holds gathered right now (persistent small parameters).

Pass the engine and its optimizer, exactly as for any other layout::

    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()),
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}})
    sp.save("ckpt/step_100", {"model": engine, "optimizer": optimizer})   # no all-gather
    sp.load("ckpt/step_100", {"model": engine, "optimizer": optimizer})   # from any layout

``engine.module`` may stand in for ``engine`` when the optimizer is in the
same state. With ``engine`` the model entry also records DeepSpeed's step
counters (``global_steps``, ``global_samples``, ``skipped_steps``) and
restores them when present. Supported: one data-parallel group spanning the
whole process group (no DeepSpeed tensor/pipeline/expert parallelism, no
ZeRO++ hpZ or MiCS), optimizer states in memory (no NVMe swapping), fp32 or
bf16 training. ZeRO stage 0 engines with a plain torch optimizer work as plain
modules.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..errors import UnsupportedStateError
from ..geometry import Box
from .base import (
    AdapterContext,
    LoadPart,
    LoadTarget,
    ParamView,
    SavePart,
    SaveTensor,
)
from .fsdp1 import Piece1D
from .landing import live_storages, module_tensors, storage_of, unlanded
from .optimizer import OptimizerAdapter
from .tensors import load_target, save_tensor

__all__ = [
    "zero12_partitions",
    "zero12_pieces",
    "zero12_holders",
    "zero3_pieces",
    "zero3_holders",
    "is_deepspeed_engine",
    "is_deepspeed_optimizer",
    "is_zero_optimizer",
    "zero_stage",
    "ZeroLayout",
    "zero_layout",
    "deepspeed_names_and_views",
    "scaler_doc",
    "DeepSpeedAdapter",
]


# ---------------------------------------------------------------- pure piece arithmetic
def zero12_partitions(total: int, world: int) -> list[tuple[int, int]]:
    """(start, size) of each rank's slice of a ZeRO-1/2 flat group of ``total`` elements.

    Mirrors ``DeepSpeedZeroOptimizer.get_data_parallel_partitions``: ``total
    // world`` elements each, the first ``total % world`` ranks one more (the
    group is padded to a multiple of ``2 * world``, so in practice all equal).

    Example::

        >>> zero12_partitions(10, 3)
        [(0, 4), (4, 3), (7, 3)]
    """
    if world <= 0:
        raise ValueError("world must be positive")
    base, rem = divmod(int(total), world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < rem else 0)
        out.append((start, size))
        start += size
    return out


def _check_spans(numels: Sequence[int], offsets: Sequence[int], total: int) -> None:
    if len(numels) != len(offsets):
        raise ValueError("numels and offsets differ in length")
    end = 0
    for n, off in zip(numels, offsets):
        if n < 0 or off < end:
            raise ValueError(f"parameters overlap or are out of order: numels {list(numels)}, offsets {list(offsets)}")
        end = off + n
    if end > total:
        raise ValueError(f"parameters end at {end}, past the group's {total} elements")


def zero12_pieces(numels: Sequence[int], offsets: Sequence[int], total: int, world: int, rank: int) -> list[Piece1D]:
    """The pieces of a ZeRO-1/2 group's parameters in ``rank``'s slice.

    Parameter ``i`` of ``numels[i]`` elements sits at ``offsets[i]`` of the
    flat group of ``total`` elements (padding between and after them). A
    piece's ``offset`` is its position in the rank's fp32 partition.

    Example::

        >>> zero12_pieces([6, 5], [0, 6], 12, 2, 1)
        [Piece1D(index=1, offset=0, start=0, stop=5)]
        >>> zero12_pieces([7, 3], [0, 8], 12, 2, 1)
        [Piece1D(index=0, offset=0, start=6, stop=7), Piece1D(index=1, offset=2, start=0, stop=3)]
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    _check_spans(numels, offsets, total)
    lo, size = zero12_partitions(total, world)[rank]
    hi = lo + size
    out = []
    for i, (n, off) in enumerate(zip(numels, offsets)):
        s, t = max(off, lo), min(off + n, hi)
        if s < t:
            out.append(Piece1D(i, s - lo, s - off, t - off))
    return out


def zero12_holders(numels: Sequence[int], offsets: Sequence[int], total: int, world: int) -> list[list[int]]:
    """For each parameter of a ZeRO-1/2 group, the ranks whose slice holds some of it."""
    _check_spans(numels, offsets, total)
    parts = zero12_partitions(total, world)
    return [
        [r for r, (lo, size) in enumerate(parts) if max(off, lo) < min(off + n, lo + size)]
        for n, off in zip(numels, offsets)
    ]


def _z3_size(numel: int, world: int) -> int:
    return -(-int(numel) // world) if numel else 0


def zero3_pieces(numels: Sequence[int], world: int, rank: int) -> list[Piece1D]:
    """The pieces of a ZeRO-3 sub-group's parameters in ``rank``'s fp32 partition.

    Each parameter is split on its own into ``ceil(numel / world)``-element
    slices (the last one padded); the rank's partition concatenates its
    padded slices, in sub-group order.

    Example::

        >>> zero3_pieces([5, 4], 2, 1)
        [Piece1D(index=0, offset=0, start=3, stop=5), Piece1D(index=1, offset=3, start=2, stop=4)]
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    out, pos = [], 0
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"negative numel {n}")
        ps = _z3_size(n, world)
        s, t = rank * ps, min(rank * ps + ps, n)
        if s < t:
            out.append(Piece1D(i, pos, s, t))
        pos += ps
    return out


def zero3_holders(numels: Sequence[int], world: int) -> list[list[int]]:
    """For each ZeRO-3 parameter, the ranks whose slice holds some of it."""
    return [[r for r in range(world) if r * _z3_size(n, world) < n] for n in numels]


# ---------------------------------------------------------------- DeepSpeed objects
def _class(module: str, name: str):
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def is_deepspeed_engine(obj: Any) -> bool:
    """True for a ``deepspeed.DeepSpeedEngine`` (never imports DeepSpeed)."""
    cls = _class("deepspeed.runtime.engine", "DeepSpeedEngine")
    return cls is not None and isinstance(obj, cls)


def is_deepspeed_optimizer(obj: Any) -> bool:
    """True for any of DeepSpeed's optimizer wrappers (ZeRO, fp16, bf16)."""
    cls = _class("deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer")
    return cls is not None and isinstance(obj, cls)


def zero_stage(opt: Any) -> int:
    """1 or 2 for ``DeepSpeedZeroOptimizer``, 3 for the stage-3 optimizer, 0 for anything else."""
    s3 = _class("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3")
    if s3 is not None and isinstance(opt, s3):
        return 3
    s12 = _class("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")
    if s12 is not None and isinstance(opt, s12):
        return 2 if getattr(opt, "partition_gradients", False) else 1
    return 0


def is_zero_optimizer(obj: Any) -> bool:
    return zero_stage(obj) > 0


def _is_z3_param(p: Any) -> bool:
    return hasattr(p, "ds_tensor") and hasattr(p, "ds_numel")


# Modules that appeared next to their ZeRO optimizer in a state (``engine.module`` used
# instead of the engine): filled when the context is built, read when adapters claim.
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def _world_and_rank(group=None) -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@dataclass
class _Entry:
    """One original parameter of a slot, and the piece of it this rank holds."""

    param: torch.Tensor  # the model's parameter (bit16; an empty placeholder under ZeRO-3)
    names: list[str]  # with the state key; the first is the primary, the rest tied aliases
    shape: tuple[int, ...]
    piece: Piece1D | None
    holders: list[int]

    @property
    def fqn(self) -> str:
        return self.names[0]


@dataclass
class _Slot:
    """A 1-D local tensor holding pieces of several parameters (an fp32 partition)."""

    local: torch.Tensor
    opt_param: torch.Tensor | None  # the tensor the inner optimizer steps (state key)
    group: int | None  # its inner optimizer param group
    entries: list[_Entry]
    rank: int
    world: int

    def views(self) -> tuple[ParamView, ...]:
        out = []
        for e in self.entries:
            p, hs = e.piece, e.holders
            if p is not None:
                out.append(ParamView(e.fqn, e.shape, (p.start, p.stop), (p.offset, p.numel), (0, 1), (hs.index(self.rank), len(hs))))
            else:
                out.append(ParamView(e.fqn, e.shape, None, (0, 0), (0, 1), (0, max(1, len(hs)))))
        return tuple(out)


@dataclass
class ZeroLayout:
    """Where every parameter of a DeepSpeed-managed module lies on this rank."""

    key: str
    stage: int
    module: nn.Module
    optimizer: Any
    slots: list[_Slot] = field(default_factory=list)
    managed: set[int] = field(default_factory=set)  # ids of parameters the slots cover

    def views(self) -> dict[int, tuple[ParamView, ...]]:
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


def _unsupported(where: str, what: str) -> UnsupportedStateError:
    return UnsupportedStateError(f"{where}: {what}")


def _check_world(where: str, world: int) -> None:
    full, _ = _world_and_rank()
    if world != full:
        raise _unsupported(
            where,
            f"the ZeRO data-parallel group has {world} of {full} ranks (DeepSpeed tensor, pipeline or "
            "expert parallelism, or MiCS); only ZeRO over the whole process group is supported",
        )


def _zero12_slots(zopt: Any, names: dict[int, list[str]], where: str) -> list[_Slot]:
    slots = []
    for i, fp32 in enumerate(zopt.single_partition_of_fp32_groups):
        world, rank = _world_and_rank(zopt.real_dp_process_group[i])
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
            raise _unsupported(where, f"ZeRO group {i}: fp32 partition of {fp32.numel()} elements, expected "
                               f"{zero12_partitions(total, world)[rank][1]}; this DeepSpeed version is not supported")
        entries = []
        rr = bool(getattr(zopt, "round_robin_gradients", False))
        for k, p in enumerate(params):
            if id(p) not in names:
                raise _unsupported(where, f"ZeRO group {i} holds a parameter of shape {shapes[k]} that the module does not own")
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
                    raise _unsupported(where, f"{names[id(p)][0]}: unexpected ZeRO layout (DeepSpeed says {theirs}, "
                                       f"expected {ours}); this DeepSpeed version is not supported")
            if numels[k] and p.data.numel() == numels[k] and p.data.data_ptr() != flat.data_ptr() + offsets[k] * flat.element_size():
                raise _unsupported(where, f"{names[id(p)][0]}: the parameter is not a view of ZeRO's flat buffer "
                                   "at the expected offset; this DeepSpeed version is not supported")
            entries.append(_Entry(p, names[id(p)], shapes[k], pc, holders[k]))
        slots.append(_Slot(fp32.detach(), fp32, i, entries, rank, world))
    return slots


def _zero3_slots(zopt: Any, module: nn.Module, names: dict[int, list[str]], where: str) -> list[_Slot]:
    if type(zopt).__name__ != "DeepSpeedZeroOptimizer_Stage3":
        raise _unsupported(where, f"{type(zopt).__name__} (MiCS and other ZeRO-3 variants) is not supported")
    if int(getattr(zopt, "zero_hpz_partition_size", 1) or 1) > 1:
        raise _unsupported(where, "ZeRO++ hierarchical partitioning (zero_hpz_partition_size > 1) is not supported")
    slots, covered = [], set()
    positions = getattr(zopt, "grad_position", {})
    for j, params in enumerate(zopt.fp16_groups):
        fp32 = zopt.fp32_partitioned_groups_flat[j]
        group = zopt._get_sub_group_process_group(j) if hasattr(zopt, "_get_sub_group_process_group") else None
        world, rank = _world_and_rank(group)
        _check_world(where, world)
        numels = [int(p.ds_numel) for p in params]
        pieces = {p.index: p for p in zero3_pieces(numels, world, rank)}
        holders = zero3_holders(numels, world)
        expect = sum(_z3_size(n, world) for n in numels)
        if fp32.numel() != expect:
            raise _unsupported(where, f"ZeRO-3 sub-group {j}: fp32 partition of {fp32.numel()} elements, expected {expect} "
                               "(optimizer state swapped to NVMe is not supported)")
        entries, pos = [], 0
        for k, p in enumerate(params):
            if id(p) not in names:
                raise _unsupported(where, f"ZeRO-3 sub-group {j} holds a parameter the module does not own")
            ps = _z3_size(numels[k], world)
            if int(p.ds_tensor.ds_numel) != ps:
                raise _unsupported(where, f"{names[id(p)][0]}: ZeRO-3 partition of {p.ds_tensor.ds_numel} elements, "
                                   f"expected {ps}; this DeepSpeed version is not supported")
            got = positions.get(zopt.get_param_id(p)) if positions else None
            if got is not None and [int(x) for x in got] != [j, pos, ps]:
                raise _unsupported(where, f"{names[id(p)][0]}: DeepSpeed places it at {list(got)}, expected {[j, pos, ps]}")
            pos += ps
            entries.append(_Entry(p, names[id(p)], tuple(int(x) for x in p.ds_shape), pieces.get(k), holders[k]))
            covered.add(id(p))
        slots.append(_Slot(fp32.detach(), fp32, int(zopt.sub_group_to_group_id[j]), entries, rank, world))
    # Partitioned parameters the optimizer does not step (frozen): their ds_tensor is all there is.
    seen = set()
    for n, p in module.named_parameters():
        if id(p) in covered or id(p) in seen or not _is_z3_param(p):
            continue
        seen.add(id(p))
        world, rank = _world_and_rank()
        numel = int(p.ds_numel)
        pc = zero3_pieces([numel], world, rank)
        slots.append(_Slot(p.ds_tensor.detach().view(-1), None, None,
                           [_Entry(p, names[id(p)], tuple(int(x) for x in p.ds_shape), pc[0] if pc else None,
                                   zero3_holders([numel], world)[0])], rank, world))
    return slots


def zero_layout(key: str, module: nn.Module, zopt: Any, where: str = "") -> ZeroLayout:
    """The pieces of every parameter of ``module`` (state key ``key``) held by ZeRO optimizer ``zopt``."""
    stage = zero_stage(zopt)
    if stage == 0:
        raise _unsupported(where, f"{type(zopt).__name__} is not a ZeRO optimizer")
    names = _names(key, module)
    lay = ZeroLayout(key, stage, module, zopt)
    lay.slots = _zero3_slots(zopt, module, names, where) if stage == 3 else _zero12_slots(zopt, names, where)
    lay.managed = {id(e.param) for s in lay.slots for e in s.entries}
    inner = zopt.optimizer
    for s in lay.slots:
        if s.opt_param is None:
            continue
        if s.group is None or not 0 <= s.group < len(inner.param_groups):
            raise _unsupported(where, f"ZeRO flat partition maps to inner param group {s.group}")
        if stage < 3 and not any(q is s.opt_param for q in inner.param_groups[s.group]["params"]):
            raise _unsupported(where, f"inner optimizer group {s.group} does not step its ZeRO fp32 partition")
    return lay


def _engine_parts(engine: Any, where: str) -> tuple[nn.Module, Any]:
    """(module, ZeRO optimizer or None) of an engine; None for stage 0 with a torch optimizer."""
    opt = getattr(engine, "optimizer", None)
    if type(engine).__name__ == "PipelineEngine":
        raise _unsupported(where, "DeepSpeed pipeline engines are not supported")
    if opt is None or is_zero_optimizer(opt):
        return engine.module, opt
    if isinstance(opt, torch.optim.Optimizer):
        return engine.module, None
    raise _unsupported(
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


def deepspeed_names_and_views(state: Mapping[str, Any]) -> tuple[dict[int, str], dict[int, tuple[ParamView, ...]]]:
    """Parameter names and optimizer views for the DeepSpeed objects in ``state``.

    Names are the module's own (``model.tok.weight``, not the engine's
    ``model.module.tok.weight``); views split each ZeRO fp32 partition
    (what the inner optimizer steps) into per-parameter pieces. Also
    remembers which module belongs to which ZeRO optimizer, so that
    ``engine.module`` can stand in for the engine.
    """
    names: dict[int, str] = {}
    views: dict[int, tuple[ParamView, ...]] = {}
    if "deepspeed" not in sys.modules:
        return names, views
    opts = [o for o in state.values() if is_zero_optimizer(o)]
    pairs = []
    for key, obj in state.items():
        if is_deepspeed_engine(obj):
            module, zopt = _engine_parts(obj, f"state[{key!r}]")
            pairs.append((key, module, zopt))
        elif isinstance(obj, nn.Module):
            zopt = _owner_in_state(obj, opts)
            if zopt is None:
                continue
            _OWNERS[obj] = zopt
            pairs.append((key, obj, zopt))
    for key, module, zopt in pairs:
        for i, ns in _names(key, module).items():
            names[i] = ns[0]
        if zopt is not None:
            lay = zero_layout(key, module, zopt, f"state[{key!r}]")
            views.update(lay.views())
    return names, views


# ---------------------------------------------------------------- the adapter
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
            if _is_z3_param(p):  # pragma: no cover - every ZeRO-3 parameter is covered by a slot
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
            raise _unsupported(where, f"module {mname or '<root>'} has extra state, which the DeepSpeed adapter does not save")


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


class DeepSpeedAdapter:
    """DeepSpeed engines, their modules and ZeRO optimizers: fp32 partitions as flat ranges."""

    name = "deepspeed"

    def claims(self, obj: Any) -> bool:
        if "deepspeed" not in sys.modules:
            return False
        if is_deepspeed_engine(obj) or is_deepspeed_optimizer(obj):
            return True
        if not isinstance(obj, nn.Module):
            return False
        if obj in _OWNERS:
            return True
        # engine.module without its optimizer: ZeRO-3 parameters, or ZeRO-1/2 ones (DeepSpeed
        # links them to their fp32 fragments): refuse below rather than save stale copies.
        for p in obj.parameters():
            return _is_z3_param(p) or hasattr(p, "_hp_mapping")
        return False

    # ------------------------------------------------------------ resolving objects
    def _module_and_zero(self, key: str, obj: Any) -> tuple[nn.Module, Any]:
        where = f"state[{key!r}]"
        if is_deepspeed_engine(obj):
            return _engine_parts(obj, where)
        zopt = _OWNERS.get(obj)
        if zopt is None:
            for p in obj.parameters():
                zopt = getattr(p, "_z3_optimizer", None)
                break
        if zopt is None:
            raise _unsupported(
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
            from .module import ModuleAdapter

            part = ModuleAdapter().save(key, module, ctx)
            part.framework = "deepspeed_zero0"
            part.value = dict(part.value or {}, **self._counters(obj))
            return part
        where = f"state[{key!r}]"
        _check_extra_state(module, where)
        lay = zero_layout(key, module, zopt, where)
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
        lay = self._optimizer_layout(key, zopt, ctx)
        part = OptimizerAdapter().save(key, _InnerView(zopt.optimizer, lay.inner_params()), ctx)
        part.framework = f"deepspeed_zero{lay.stage}:{type(zopt.optimizer).__name__}"
        scaler = scaler_doc(getattr(zopt, "loss_scaler", None))
        if scaler and getattr(zopt, "dynamic_loss_scale", False):
            part.value = dict(part.value, deepspeed={"loss_scaler": scaler})
        return part

    def _optimizer_layout(self, key: str, zopt: Any, ctx: AdapterContext) -> ZeroLayout:
        where = f"state[{key!r}]"
        if not is_zero_optimizer(zopt):
            raise _unsupported(
                where,
                f"DeepSpeed optimizer {type(zopt).__name__} (fp16/bf16 without ZeRO) is not supported; use ZeRO "
                "stage 1, 2 or 3, or pass the torch optimizer of a stage-0 engine",
            )
        flats = (zopt.single_partition_of_fp32_groups if zero_stage(zopt) < 3 else zopt.fp32_partitioned_groups_flat)
        if not all(id(f) in ctx.views for f in flats):
            raise _unsupported(
                where,
                "a ZeRO optimizer needs its model in the same state (the engine, or engine.module), so that its "
                "flat partitions can be split by parameter name",
            )
        # The layout's key only names the views, which the context already holds.
        lay = ZeroLayout("", zero_stage(zopt), getattr(zopt, "module", None), zopt)
        inner = zopt.optimizer
        if lay.stage < 3:
            lay.slots = [_Slot(f, f, i, [], 0, 1) for i, f in enumerate(flats)]
        else:
            lay.slots = [_Slot(f, f, int(zopt.sub_group_to_group_id[j]), [], 0, 1) for j, f in enumerate(flats)]
        if any(not 0 <= s.group < len(inner.param_groups) for s in lay.slots):
            raise _unsupported(where, "ZeRO partitions map to unknown inner param groups")
        return lay

    # ------------------------------------------------------------ load
    def load(self, key: str, obj: Any, doc: Any, tensors: Mapping[str, Any], ctx: AdapterContext, where: str = "<checkpoint>") -> LoadPart:
        if is_deepspeed_optimizer(obj):
            return self._load_optimizer(key, obj, doc, tensors, ctx, where)
        module, zopt = self._module_and_zero(key, obj)
        counters = (doc or {}).get("deepspeed", {}) if isinstance(doc, dict) else {}
        if zopt is None:
            from .module import ModuleAdapter

            part = ModuleAdapter().load(key, module, doc, tensors, ctx, where)
            inner_finish = part.finish

            def finish0():
                inner_finish()
                self._restore_counters(obj, counters)
                return obj

            part.finish = finish0
            return part
        _check_extra_state(module, where)
        lay = zero_layout(key, module, zopt, where)
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
        lay = self._optimizer_layout(key, zopt, ctx)
        part = OptimizerAdapter().load(key, _InnerView(zopt.optimizer, lay.inner_params()), doc, tensors, ctx, where)
        inner_finish = part.finish

        scaler = ((doc or {}).get("deepspeed") or {}).get("loss_scaler") if isinstance(doc, dict) else None

        def finish():
            inner_finish()
            if scaler and getattr(zopt, "dynamic_loss_scale", False):
                _restore_scaler(zopt, scaler)
            # ZeRO-1/2 keep per-parameter views of the state (for safe_get_full_optimizer_state and
            # universal checkpoints): point them at the new state tensors (local, no collective).
            if hasattr(zopt, "_hp_optimizer_states_linked"):
                zopt._hp_optimizer_states_linked = False
                relink = getattr(zopt, "_lazy_init_hp_params_optimizer_state", None)
                if relink is not None and all(zopt.optimizer.state.get(f) for f in zopt.single_partition_of_fp32_groups):
                    relink()
            return zopt

        part.finish = finish
        return part
