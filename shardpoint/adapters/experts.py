"""Expert-parallel local experts stored as global experts, at their global index.

Under expert parallelism (EP) each rank holds ``num_experts / ep`` *local*
experts, numbered from 0 on every rank; local expert ``i`` of EP rank ``r``
is global expert ``r * num_experts / ep + i``. shardpoint stores each expert
under its global name (``...experts.local_experts.5.linear_fc1.weight``), so
a checkpoint saved at one EP degree loads at any other that divides the
number of experts (EP 4 into EP 2, 1 or 8): each global expert is a whole
tensor that any rank can read. Optimizer state is keyed by parameter name,
so each expert's moments follow it.

Megatron-Core's MoE layers tell their global indices
(``local_expert_indices``); :func:`megatron_expert_prefixes` reads them and
:mod:`shardpoint.adapters.megatron` renames the local experts of its
``SequentialMLP``; a ``GroupedMLP``'s two weights (:func:`megatron_grouped_experts`)
are stored as 3-D tensors indexed by global expert. DeepSpeed MoE layers are
found by :func:`shardpoint.adapters.deepspeed.moe.deepspeed_expert_rules`, in plain modules and in ZeRO-1/2
engines alike (flat ZeRO pieces are renamed, their ranges unchanged). A plain module holding a per-rank list of local experts is
declared with one layout rule, :class:`Experts`::

    sp.save(path, state, layouts=[sp.Experts("model.experts", num_experts=8, group=ep_group)])
    sp.load(path, state, layouts=[sp.Experts("model.experts", num_experts=8, group=ep_group)])

Names under ``<prefix>.<i>.`` become ``<prefix>.<offset + i>.``; the geometry
is the identity. The ranks holding the same global expert (the same EP rank
in every EP group) are found at save, so those copies are written once and
checked against each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from torch import nn

from ..errors import ExpertLayoutError, UnsupportedStateError
from ..items import SaveTensor
from ..layouts import WholeRule

__all__ = ["Experts", "GroupedWeight", "megatron_expert_prefixes", "megatron_grouped_experts", "rename_prefix", "expert_keys", "apply_placement", "check_divides"]


def check_divides(num_experts: int, ep: int, where: str) -> int:
    """The number of local experts per EP rank; :class:`ExpertLayoutError` naming both numbers if ``ep`` does not divide.

    Example::

        check_divides(8, 4, "model.experts")  # 2
    """
    if ep < 1 or num_experts < 1 or num_experts % ep:
        raise ExpertLayoutError(
            f"{where}: {num_experts} experts cannot be split evenly over an expert-parallel degree of {ep}; "
            f"choose an EP degree that divides {num_experts}"
        )
    return num_experts // ep


def rename_prefix(name: str, prefixes: Mapping[str, str]) -> str:
    """``name`` with the longest matching key of ``prefixes`` replaced by its value.

    Example::

        rename_prefix("experts.local_experts.1.w", {"experts.local_experts.1.": "experts.local_experts.3."})
    """
    best = ""
    for old in prefixes:
        if name.startswith(old) and len(old) > len(best):
            best = old
    return prefixes[best] + name[len(best):] if best else name


def megatron_expert_prefixes(m: nn.Module) -> dict[str, str]:
    """Local -> global name prefixes of every Megatron ``SequentialMLP`` local expert in ``m``.

    A MoE layer names its experts' global indices in ``local_expert_indices``.
    Other expert modules (``GroupedMLP``, ``TEGroupedMLP``) get no entry.

    Example::

        megatron_expert_prefixes(moe_layer)  # EP rank 1 of 2, 4 experts:
        # {"experts.local_experts.0.": "experts.local_experts.2.", "experts.local_experts.1.": "experts.local_experts.3."}
    """
    out: dict[str, str] = {}
    for name, mod in m.named_modules():
        idx = getattr(mod, "local_expert_indices", None)
        local = getattr(getattr(mod, "experts", None), "local_experts", None)
        if idx is None or not isinstance(local, nn.ModuleList):
            continue
        base = f"{name}.experts.local_experts." if name else "experts.local_experts."
        if len(local) != len(idx):
            raise UnsupportedStateError(
                f"{base[:-1]}: {len(local)} local experts but local_expert_indices lists {len(idx)}"
            )
        for i, g in enumerate(idx):
            out[f"{base}{i}."] = f"{base}{int(g)}."
    return out


@dataclass(frozen=True)
class GroupedWeight:
    """What a Megatron ``GroupedMLP`` weight holds: ``fc1`` (``weight1``) or ``fc2`` (``weight2``) of its local experts.

    ``experts`` is the number of local experts, ``hidden`` the hidden size
    and ``glu`` whether ``fc1`` holds a gate and an up projection per expert
    (``gated_linear_unit=True``).

    Example::

        GroupedWeight("fc1", experts=2, hidden=1024, glu=True)
    """

    kind: str
    experts: int
    hidden: int
    glu: bool = False


def megatron_grouped_experts(m: nn.Module) -> dict[str, GroupedWeight]:
    """Local names of Megatron ``GroupedMLP`` weights -> what they hold (:class:`GroupedWeight`).

    ``weight1`` is ``[hidden, local experts x ffn]`` and ``weight2``
    ``[local experts x ffn, hidden]``, but the grouped GEMM reads their
    memory as ``[experts, hidden, ffn]`` and ``[experts, ffn, hidden]``: the
    local experts are consecutive blocks of memory, not column blocks.

    Example::

        megatron_grouped_experts(moe_layer)  # {"experts.weight1": GroupedWeight("fc1", 2, 8), ...}
    """
    out: dict[str, GroupedWeight] = {}
    for name, mod in m.named_modules():
        if type(mod).__name__ != "GroupedMLP" or not type(mod).__module__.startswith("megatron."):
            continue
        base = f"{name}." if name else ""
        n, cfg = int(mod.num_local_experts), mod.config
        out[f"{base}weight1"] = GroupedWeight("fc1", n, int(cfg.hidden_size), bool(cfg.gated_linear_unit))
        out[f"{base}weight2"] = GroupedWeight("fc2", n, int(cfg.hidden_size))
    return out


class Experts(WholeRule):
    """A plain module's per-rank list of local experts, stored as global experts at their global index.

    ``prefix`` names the list (``"model.experts"``: parameters
    ``model.experts.<i>.<...>``), ``num_experts`` the number of global
    experts and ``group`` the expert-parallel group (a process group, or its
    global ranks in EP-rank order); EP rank ``r`` holds experts
    ``r * n / ep .. (r + 1) * n / ep - 1``. Pass it in ``layouts=`` to save
    and to load; the EP degree may differ between the two.

    Example::

        rule = sp.Experts("model.experts", num_experts=8, group=ep_group)
        sp.save(path, {"model": model, "optimizer": opt}, layouts=[rule])
    """

    dim = 0

    def __init__(self, prefix: str, num_experts: int, group: Any = None):
        self.prefix = prefix.rstrip(".")
        self.pattern = self.prefix + ".*"
        self.num_experts = int(num_experts)
        self.group = group
        self._re = re.compile(re.escape(self.prefix) + r"\.(\d+)(\..*|)$")

    def __repr__(self) -> str:
        return f"Experts({self.prefix!r}, num_experts={self.num_experts})"

    def ep(self) -> tuple[int, int, tuple[int, ...]]:
        """(EP rank, EP degree, the group's global ranks) of the calling process."""
        import torch.distributed as dist

        if self.group is None or not (dist.is_available() and dist.is_initialized()):
            return 0, 1, (0,)
        if isinstance(self.group, (list, tuple, range)):
            ranks = tuple(int(r) for r in self.group)
        else:
            ranks = tuple(dist.get_process_group_ranks(self.group))
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"Experts({self.prefix!r}): rank {me} is not in the expert-parallel group {list(ranks)}")
        return ranks.index(me), len(ranks), ranks

    def offset(self) -> int:
        """The global index of this rank's local expert 0 (checks that the EP degree divides the experts)."""
        r, ep, _ = self.ep()
        return r * check_divides(self.num_experts, ep, self.prefix)

    def param_match(self, fqn: str) -> tuple[str, str, str] | None:
        if self._re.match(fqn):
            return "", fqn, ""
        i = fqn.find(".state.")
        if i >= 0:
            param, _, key = fqn[i + len(".state."):].rpartition(".")
            if param and self._re.match(param):
                return fqn[: i + len(".state.")], param, "." + key
        return None

    def logical_name(self, param: str, part: str) -> str:
        m = self._re.match(param)
        local = int(m.group(1))
        n_local = check_divides(self.num_experts, self.ep()[1], self.prefix)
        if local >= n_local:
            raise ExpertLayoutError(
                f"{param}: local expert {local} on a rank that holds {n_local} of {self.num_experts} experts"
            )
        return f"{self.prefix}.{self.offset() + local}{m.group(2)}"



def expert_keys(tensors: Sequence[SaveTensor], rules: Sequence[Experts]) -> tuple[list[int], list[int]]:
    """The positions of the tensors of :class:`Experts` lists, and a key of each one's name and box.

    The ranks holding a piece of a global expert are those that list the
    same key; the save's agreement (:mod:`shardpoint.saving.agree`)
    exchanges the keys and :func:`apply_placement` applies what it found.

    Example::

        picked, keys = expert_keys(tensors, [sp.Experts("model.experts", 8, ep_group)])
    """
    import xxhash

    picked = [i for i, t in enumerate(tensors) if any(r.param_match(t.fqn) is not None for r in rules)]
    keys = [xxhash.xxh3_64_intdigest(repr((t.fqn, tuple(t.box.offsets), tuple(t.box.sizes), t.flat)).encode()) >> 1
            for t in (tensors[i] for i in picked)]
    return picked, keys


def apply_placement(
    tensors: Sequence[SaveTensor], picked: Sequence[int], keys: Sequence[int], holders: Mapping[int, Sequence[int]], me: int,
) -> list[SaveTensor]:
    """Give the tensors at ``picked`` the replica placement of their global experts.

    ``holders`` maps each key of :func:`expert_keys` to the global ranks
    listing it, ``me`` is this rank's global rank. Pure: for plain tensors
    and for experts sharded as DTensors alike.

    Example::

        tensors = apply_placement(tensors, [4], [key], {key: [0, 2]}, 2)
    """
    out = list(tensors)
    for i, k in zip(picked, keys):
        t, ranks = tensors[i], sorted(holders[k])
        plain = t.placement in ("replicated", "local")
        out[i] = replace(
            t, replica_index=ranks.index(me), replica_count=len(ranks), replica_group=",".join(str(r) for r in ranks),
            grid=None, placement=("replicated" if len(ranks) > 1 else "local") if plain else t.placement,
        )
    return out
