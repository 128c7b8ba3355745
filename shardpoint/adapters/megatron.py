"""Megatron-Core tensor-parallel modules: each local shard saved as boxes of the global tensor.

Megatron's ``ColumnParallelLinear``, ``RowParallelLinear`` and
``VocabParallelEmbedding`` keep plain local tensors tagged with
``tensor_model_parallel=True``, ``partition_dim`` and ``partition_stride``.
With stride ``s`` the global tensor is cut along ``partition_dim`` into
``s * tp`` equal chunks and TP rank ``r`` holds chunks ``r, r + tp, ...``
(stride 1: one contiguous box; a SwiGLU ``linear_fc1`` has stride 2, its
global tensor being ``[gate; up]``). Tensor-parallel rank and size come from
``megatron.core.parallel_state``. Each local shard is recorded as its box(es)
of the global tensor, replicated over the data-parallel group (with context
parallelism); tensors without the tag are replicated over the tensor- and
data-parallel group of the stage. Nothing is gathered.

Pipeline stages number their layers locally (``decoder.layers.0`` on every
stage); names are rewritten with each ``TransformerLayer``'s global
``layer_number`` so that PP=2 loads into no PP and back.

Optimizer state shaped like a parameter follows the parameter's boxes (see
:class:`MegatronShard`). Use with layout rules to store logical tensors::

    rules = [
        sp.Fused("*.linear_qkv.weight", dim=0, groups=num_query_groups,
                 parts=[("linear_q", heads_per_group * hd), ("linear_k", hd), ("linear_v", hd)]),
        sp.Fused("*.linear_fc1.weight", dim=0, parts=[("linear_gate", ffn), ("linear_up", ffn)]),
    ]
    sp.save("ckpt", {"model": gpt, "optimizer": adamw}, layouts=rules)

MoE layers: the local experts of a ``SequentialMLP`` are stored as global
experts at their global index (the layer's ``local_expert_indices``; see
:mod:`shardpoint.adapters.experts`), split over the expert tensor-parallel
group and replicated over the expert data-parallel group, so a checkpoint
saved at one EP degree loads at another. Router weights and expert-bias
buffers are replicated like any dense tensor. A ``GroupedMLP``'s
``weight1`` (``[hidden, local experts x ffn]``) and ``weight2`` are read
as the grouped GEMM reads their memory, ``[experts, hidden, ffn]`` and
``[experts, ffn, hidden]``, and stored as 3-D tensors holding every global
expert at its index along dim 0: EP rank ``r`` holds the boxes of its
experts, expert TP rank ``t`` its ffn columns (with gated linear units, its
columns of the gate half and of the up half, as Megatron's own
``sharded_state_dict`` splits them). So GroupedMLP checkpoints reshard
across EP and expert TP degrees. Other expert-parallel parameters
(``allreduce=False`` outside such experts, e.g. ``TEGroupedMLP``) and tied
embeddings across pipeline stages are refused with
:class:`~shardpoint.errors.UnsupportedStateError`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import UnsupportedStateError
from ..geometry import Box
from .base import Adapter, AdapterContext, ContextFacts, LoadPart, LoadTarget, ParamShard, SavePart, SaveTensor
from .experts import GroupedWeight, megatron_expert_prefixes, megatron_grouped_experts, rename_prefix
from .graph import submodules
from .module import unwrap_module

__all__ = ["MegatronAdapter", "MegatronShard", "is_megatron", "megatron_names", "megatron_shards", "megatron_global_shapes"]


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def is_megatron(m: Any) -> bool:
    """Whether ``m`` is a module holding Megatron tensor-parallel parameters or layers.

    Example::

        is_megatron(gpt_model)  # True for a megatron.core GPTModel
    """
    if not isinstance(m, nn.Module) or "megatron.core" not in sys.modules:  # no Megatron object without it
        return False
    m = unwrap_module(m)
    if any(getattr(p, "tensor_model_parallel", False) for p in m.parameters()):
        return True
    return any(type(x).__module__.startswith("megatron.core") for x in submodules(m))


@dataclass(frozen=True)
class MegatronShard(ParamShard):
    """Where a local Megatron tensor lies in its global tensor (the optimizer state of a parameter follows it).

    ``pieces`` are ``(local offset, global box)`` along ``dim``: the local
    rows ``[local, local + box.sizes[dim])`` are the global ``box``.
    ``replica`` is (index, count) among ranks holding the same pieces and
    ``group`` names those ranks (for balancing writers). ``view``, when set,
    is the shape the local tensor's memory is read in before it is cut (a
    ``GroupedMLP`` weight: ``[experts, hidden, ffn]``).

    Example: TP rank 1 of 2 holding rows 4..8 of an ``[8, 3]`` weight::

        MegatronShard((8, 3), 0, ((0, Box((4, 0), (4, 3))),), (0, 1), "1")
    """

    shape: tuple[int, ...]
    dim: int
    pieces: tuple[tuple[int, Box], ...]
    replica: tuple[int, int]
    group: str
    holders: tuple[int, int] = (0, 1)
    holders_group: str = ""
    view: tuple[int, ...] | None = None  # the local tensor's memory read in this shape first (GroupedMLP)

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.view) if self.view is not None else t

    def save(self, fqn: str, t: torch.Tensor) -> list[SaveTensor]:
        """:class:`SaveTensor` items for ``t`` (the local tensor or state shaped like it)."""
        t = self._local(t.detach())
        out = []
        for lo, box in self.pieces:
            data = t.narrow(self.dim, lo, box.sizes[self.dim]) if len(self.pieces) > 1 else t
            out.append(SaveTensor(
                fqn, data, self.shape, box, None, self.replica[0], self.replica[1],
                float(box.numel * t.element_size()), "megatron_tp", replica_group=self.group,
            ))
        return out

    def save_whole(self, fqn: str, t: torch.Tensor) -> list[SaveTensor]:
        """A tensor held whole, identical on every rank holding a piece of the parameter (``step``)."""
        t = t.detach()
        shape = tuple(int(x) for x in t.shape)
        return [SaveTensor(
            fqn, t, shape, Box.full(shape), None, self.holders[0], self.holders[1],
            float(t.numel() * t.element_size()), "replicated", replica_group=self.holders_group,
        )]

    def targets(self, fqn: str, dest: torch.Tensor) -> list[LoadTarget]:
        """:class:`LoadTarget` items that fill ``dest`` (shaped like the local tensor) in place."""
        dest = self._local(dest)
        return [
            LoadTarget(fqn, dest.narrow(self.dim, lo, box.sizes[self.dim]), self.shape, box)
            for lo, box in self.pieces
        ]


def _group_name(group) -> str:
    import torch.distributed as dist

    return ",".join(str(r) for r in sorted(dist.get_process_group_ranks(group)))


def _expert_holders(ps) -> tuple[tuple[int, int], str]:
    """(index, count) and name of the ranks holding a piece of this rank's experts (same EP rank and stage).

    Megatron numbers ranks linearly in each coordinate, so they are the sums
    of the expert tensor-parallel and expert data-parallel peers, less this rank.
    """
    import torch.distributed as dist

    me = dist.get_rank()
    etp = dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group())
    edp = dist.get_process_group_ranks(ps.get_expert_data_parallel_group())
    ranks = sorted({a + b - me for a in etp for b in edp})
    if me not in ranks or len(ranks) != len(etp) * len(edp):
        raise UnsupportedStateError(f"Megatron expert groups {etp} x {edp} do not form a grid around rank {me}")
    return (ranks.index(me), len(ranks)), ",".join(str(r) for r in ranks)


def _grouped_shard(name: str, p: torch.Tensor, w: GroupedWeight) -> MegatronShard:
    """A ``GroupedMLP`` weight as boxes of ``[experts, hidden, ffn]`` (fc1) or ``[experts, ffn, hidden]`` (fc2).

    The grouped GEMM reads the local weight's memory as one block per local
    expert; EP rank ``r`` holds experts ``r * n .. (r + 1) * n - 1`` (dim 0)
    and expert TP rank ``t`` of ``tp`` the ffn columns ``t`` of ``tp`` (fc1 with
    gated linear units: ``t`` of the gate and ``t`` of the up half, as
    Megatron's own ``sharded_state_dict`` splits them).
    """
    import torch.distributed as dist

    ps = _ps()
    shape = tuple(int(s) for s in p.shape)
    n, h = w.experts, w.hidden
    if n < 1 or h < 1 or p.numel() % (n * h):
        raise UnsupportedStateError(f"{name}: GroupedMLP weight of shape {shape} does not hold {n} experts of hidden size {h}")
    ffn = p.numel() // (n * h)  # local ffn columns per expert (gate and up together with GLU)
    stride = 2 if w.kind == "fc1" and w.glu else 1
    if ffn % stride:
        raise UnsupportedStateError(f"{name}: {ffn} local fc1 columns per expert cannot hold a gate and an up half")
    view, dim = ((n, h, ffn), 2) if w.kind == "fc1" else ((n, ffn, h), 1)
    if ps.model_parallel_is_initialized():
        ep, er = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        tp, tr = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        dpg = ps.get_expert_data_parallel_group()
        hg = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)  # every EP rank holds a box of it
        holders, hname = (dist.get_rank(hg), dist.get_world_size(hg)), _group_name(hg)
        replica, rname = (dist.get_rank(dpg), dist.get_world_size(dpg)), _group_name(dpg)
    else:
        ep, er, tp, tr = 1, 0, 1, 0
        holders, hname, replica, rname = (0, 1), "", (0, 1), ""
    k = ffn // stride  # columns per half on this rank
    gshape = list(view)
    gshape[0], gshape[dim] = n * ep, ffn * tp
    pieces = []
    for j in range(stride):
        offs, sizes = [0] * 3, list(view)
        offs[0], offs[dim], sizes[dim] = er * n, (j * tp + tr) * k, k
        pieces.append((j * k, Box(tuple(offs), tuple(sizes))))
    return MegatronShard(tuple(gshape), dim, tuple(pieces), replica, rname, holders, hname, view)


def _shard_for(name: str, local: str, p: torch.Tensor, experts: Mapping[str, str], grouped: Mapping[str, GroupedWeight]) -> MegatronShard:
    if local in grouped:
        return _grouped_shard(name, p, grouped[local])
    return _shard_of(name, p, _is_expert(local, experts))


def _shard_of(name: str, p: torch.Tensor, expert: bool = False) -> MegatronShard:
    import torch.distributed as dist

    ps = _ps()
    shape = tuple(int(s) for s in p.shape)
    if not getattr(p, "allreduce", True) and not expert:
        raise UnsupportedStateError(
            f"{name}: a Megatron expert-parallel parameter (allreduce=False) outside the local experts of a "
            "MoE layer's SequentialMLP or GroupedMLP is not supported yet (TEGroupedMLP: use moe_grouped_gemm=False)"
        )
    if not ps.model_parallel_is_initialized():
        if getattr(p, "tensor_model_parallel", False):
            raise UnsupportedStateError(f"{name}: Megatron parallel_state is not initialized")
        return MegatronShard(shape, 0, ((0, Box.full(shape)),), (0, 1), "")
    if expert:  # split over the expert TP group, copies over the expert DP group
        holders, hname = _expert_holders(ps)
        tp, r = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        dpg = ps.get_expert_data_parallel_group()
    else:
        # Ranks of this pipeline stage: all hold a piece of every parameter of the stage.
        hg = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        holders, hname = (dist.get_rank(hg), dist.get_world_size(hg)), _group_name(hg)
        tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        dpg = ps.get_data_parallel_group(with_context_parallel=True)
    if not getattr(p, "tensor_model_parallel", False):
        return MegatronShard(shape, 0, ((0, Box.full(shape)),), holders, hname, holders, hname)
    dim = int(getattr(p, "partition_dim", 0))
    stride = int(getattr(p, "partition_stride", 1))
    if stride < 1 or shape[dim] % stride:
        raise UnsupportedStateError(f"{name}: local size {shape[dim]} on dim {dim} is not a multiple of partition_stride {stride}")
    n = shape[dim] // stride  # rows per chunk
    gshape = list(shape)
    gshape[dim] = shape[dim] * tp
    pieces = []
    for j in range(stride):
        offs = [0] * len(shape)
        offs[dim] = (j * tp + r) * n
        sizes = list(shape)
        sizes[dim] = n
        pieces.append((j * n, Box(tuple(offs), tuple(sizes))))
    replica = (dist.get_rank(dpg), dist.get_world_size(dpg))
    return MegatronShard(tuple(gshape), dim, tuple(pieces), replica, _group_name(dpg), holders, hname)


_LAYER = re.compile(r"^(.*?layers\.)(\d+)(\..*|)$")


def megatron_names(m: nn.Module) -> dict[str, str]:
    """Local state-dict names -> global names (layer indices from ``layer_number``, experts from ``local_expert_indices``).

    Example: on pipeline stage 1 of 2 of a 4-layer GPT,
    ``decoder.layers.0.mlp.linear_fc1.weight`` -> ``decoder.layers.2.mlp.linear_fc1.weight``;
    on EP rank 1 of 2 with 4 experts, ``...experts.local_experts.0.`` -> ``...experts.local_experts.2.``.
    """
    m = unwrap_module(m)
    prefixes: dict[str, str] = {}
    for name, mod in m.named_modules():
        ln = getattr(mod, "layer_number", None)
        mm = _LAYER.match(name)
        if isinstance(ln, int) and mm and not mm.group(3) and type(mod).__name__.endswith("TransformerLayer"):
            prefixes[name + "."] = f"{mm.group(1)}{ln - 1}."
    experts = megatron_expert_prefixes(m)
    out = {}
    for k in m.state_dict():
        new = rename_prefix(k, experts)  # expert first: the layer prefix is a prefix of it
        for old, glob in prefixes.items():
            if new.startswith(old):
                new = glob + new[len(old):]
                break
        out[k] = new
    return out


def _is_expert(name: str, experts: Mapping[str, str]) -> bool:
    return any(name.startswith(p) for p in experts)


def _check_tied(m: nn.Module) -> None:
    if getattr(m, "share_embeddings_and_output_weights", False):
        ps = _ps()
        if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
            raise UnsupportedStateError(
                "Megatron tied embeddings across pipeline stages (share_embeddings_and_output_weights) "
                "are not supported yet; untie them"
            )


def megatron_shards(key: str, m: nn.Module) -> tuple[dict[int, str], dict[int, MegatronShard]]:
    """Per ``id(param)``: the global name (``<key>.<name>``) and its :class:`MegatronShard`."""
    m = unwrap_module(m)
    _check_tied(m)
    glob = megatron_names(m)
    experts, grouped = megatron_expert_prefixes(m), megatron_grouped_experts(m)
    names, shards = {}, {}
    for n, p in m.named_parameters():
        g = f"{key}.{glob.get(n, n)}"
        names[id(p)] = g
        shards[id(p)] = _shard_for(g, n, p, experts, grouped)
    return names, shards


def megatron_global_shapes(key: str, m: nn.Module) -> dict[str, tuple[int, ...]]:
    """``<key>.<global name>`` -> global shape of every tensor of ``m`` (what layout rules cut)."""
    items, _ = MegatronAdapter()._tensors(key, m)
    return {fqn: shard.shape for fqn, _, _, shard in items}


class MegatronAdapter(Adapter):
    """Saves and loads a Megatron-Core module (any TP/PP/DP layout), storing global tensors.

    Example::

        sp.save(path, {"model": gpt, "optimizer": opt}, layouts=rules)
        sp.load(path, {"model": plain_fsdp2_model, "optimizer": opt2})
    """

    name = "megatron"

    def claims(self, obj: Any) -> bool:
        return is_megatron(obj)

    def context_facts(self, key: str, obj: Any, state: Mapping[str, Any]) -> ContextFacts | None:
        """Global parameter names (pipeline layers renumbered) and each parameter's :class:`MegatronShard`."""
        if not is_megatron(obj):
            return None
        names, shards = megatron_shards(key, obj)
        return ContextFacts(names=names, shards=shards)

    def _tensors(self, key: str, m: nn.Module):
        """(global fqn, tensor, shard) for every tensor of ``m.state_dict()``."""
        m = unwrap_module(m)
        _check_tied(m)
        glob = megatron_names(m)
        experts, grouped = megatron_expert_prefixes(m), megatron_grouped_experts(m)
        params = dict(m.named_parameters())
        out, extra = [], {}
        for n, t in m.state_dict(keep_vars=True).items():
            fqn = f"{key}.{glob.get(n, n)}"
            if not isinstance(t, torch.Tensor):
                extra[n] = t
                continue
            src = params.get(n, t)
            out.append((fqn, n, t, _shard_for(fqn, n, src, experts, grouped)))
        return out, extra

    def save(self, key: str, obj: nn.Module, ctx: AdapterContext) -> SavePart:
        part = SavePart(framework="megatron")
        items, extra = self._tensors(key, obj)
        if any(v is not None for v in extra.values()):
            raise UnsupportedStateError(f"state[{key!r}]: Megatron extra_state entries {sorted(extra)} are not supported yet")
        for fqn, _, t, shard in items:
            part.tensors.extend(shard.save(fqn, t))
        part.value = {}
        return part

    def load(self, key, obj, doc, tensors: Mapping[str, Any], ctx, where="<checkpoint>") -> LoadPart:
        part = LoadPart()
        items, _ = self._tensors(key, obj)
        for fqn, _, t, shard in items:
            if part.expect(tensors, fqn, tuple(shard.shape), t.dtype, where) is None:
                continue
            part.targets.extend(shard.targets(fqn, t.detach()))
        part.finish = lambda: obj
        return part

