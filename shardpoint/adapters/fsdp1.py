"""FSDP1 (``FullyShardedDataParallel``) flat parameters, saved as they are.

Each FSDP1 unit concatenates its original parameters into one 1-D
``FlatParameter`` (with alignment padding under ``use_orig_params=True``) and
gives every rank one equal, padded slice of it. That slice cuts original
parameters at arbitrary element positions. Nothing is gathered: every piece
of an original parameter that lies in the local slice is saved as a flat
range of that parameter's row-major order, under the parameter's original,
unwrapped name. Loading fills the local slice in place through flat-range
targets, so a checkpoint from FSDP2, TP, DDP or one process loads into FSDP1
at any world size, and the other way round.

The piece arithmetic (:func:`shard_pieces`, :func:`piece_holders`) is pure
and mirrors ``FlatParamHandle.shard``: the padded flat parameter is split
``torch.chunk``-style into ``world`` equal slices. At save and load time it
is checked against FSDP's own ``_shard_param_infos``.

Example::

    model = FSDP(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW(model.parameters())
    sp.save("ckpt", {"model": model, "optimizer": opt})   # no all-gather
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..errors import UnsupportedStateError
from ..geometry import Box
from .base import Adapter, AdapterContext, ContextFacts, LoadPart, LoadTarget, ParamView, SavePart, SaveTensor
from .graph import submodules
from .tensors import load_target, save_tensor

__all__ = [
    "Piece1D",
    "shard_pieces",
    "piece_holders",
    "clean_name",
    "is_fsdp1",
    "fsdp1_units",
    "fsdp1_names_and_views",
    "FSDP1Adapter",
]

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """The unwrapped name: FSDP1, activation-checkpoint and compile prefixes removed."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    for p in _WRAPPER_PREFIXES:  # a wrapper that is the whole tail of a name
        if name.endswith(p[:-1]):
            name = name[: -len(p[:-1])].rstrip(".")
    return name


# ---------------------------------------------------------------- pure piece arithmetic
@dataclass(frozen=True)
class Piece1D:
    """Elements ``[start, stop)`` of original parameter ``index`` sit at ``offset`` of a rank's slice."""

    index: int
    offset: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _layout(numels_with_padding: Sequence[int], is_padding: Sequence[bool]) -> list[tuple[int, int]]:
    """[begin, end) of each non-padding entry in the unsharded flat parameter."""
    if len(numels_with_padding) != len(is_padding):
        raise ValueError("numels_with_padding and is_padding differ in length")
    out, pos = [], 0
    for n, pad in zip(numels_with_padding, is_padding):
        if n < 0:
            raise ValueError(f"negative numel {n}")
        if not pad:
            out.append((pos, pos + int(n)))
        pos += int(n)
    return out


def _slice_size(total: int, world: int) -> int:
    if world <= 0:
        raise ValueError("world must be positive")
    return -(-total // world) if total else 0


def shard_pieces(numels_with_padding: Sequence[int], is_padding: Sequence[bool], world: int, rank: int) -> list[Piece1D]:
    """The pieces of original parameters in ``rank``'s slice of a flat parameter.

    ``numels_with_padding`` and ``is_padding`` describe the unsharded flat
    parameter entry by entry (FSDP1's ``_numels_with_padding`` and
    ``_is_padding_mask``); ``index`` counts non-padding entries only, as
    FSDP1's ``_fqns`` and ``_shard_param_infos`` do. Each rank's slice is
    ``ceil(total / world)`` elements (the last ones padded), as FSDP1 shards.

    Example::

        >>> shard_pieces([6, 2, 4], [False, True, False], 2, 1)
        [Piece1D(index=1, offset=2, start=0, stop=4)]
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    spans = _layout(numels_with_padding, is_padding)
    total = sum(int(n) for n in numels_with_padding)
    size = _slice_size(total, world)
    lo, hi = min(rank * size, total), min((rank + 1) * size, total)
    out = []
    for i, (b, e) in enumerate(spans):
        s, t = max(b, lo), min(e, hi)
        if s < t:
            out.append(Piece1D(i, s - lo, s - b, t - b))
    return out


def piece_holders(numels_with_padding: Sequence[int], is_padding: Sequence[bool], world: int) -> list[list[int]]:
    """For each original parameter, the ranks whose slice holds some of it (ascending)."""
    spans = _layout(numels_with_padding, is_padding)
    total = sum(int(n) for n in numels_with_padding)
    size = _slice_size(total, world)
    out = []
    for b, e in spans:
        if e <= b or size == 0:
            out.append([])
            continue
        out.append(list(range(b // size, min(world - 1, (e - 1) // size) + 1)))
    return out


# ---------------------------------------------------------------- FSDP1 objects
def is_fsdp1(m: Any) -> bool:
    """True when ``m`` is or contains an FSDP1 ``FullyShardedDataParallel`` module."""
    if "torch.distributed.fsdp" not in sys.modules or not isinstance(m, nn.Module):
        return False  # nothing can be wrapped in FSDP1 before FSDP1 was imported
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(m, FSDP) or any(isinstance(x, FSDP) for x in submodules(m))


@dataclass
class _Unit:
    """One FSDP1 unit: its flat parameter and where each original parameter lies in it."""

    prefix: str  # unwrapped module prefix inside the root, "" or "layers.0."
    flat_param: torch.Tensor
    local: torch.Tensor  # this rank's padded slice (the tensor the optimizer steps)
    fqns: list[str]  # unwrapped names relative to the root
    shapes: list[tuple[int, ...]]
    pieces: dict[int, Piece1D]  # by original parameter index
    holders: list[list[int]]  # shard-group ranks holding pieces of each parameter
    shard_rank: int
    shard_world: int
    replica: tuple[int, int]  # copies of each piece (NO_SHARD, HYBRID_SHARD)
    orig_params: list[torch.Tensor] | None  # use_orig_params=True: the user-visible params
    shared: list[tuple[str, int]]  # (unwrapped name, index of the primary parameter)


def _replica_of(fsdp_module, handle) -> tuple[int, int]:
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy as S

    strat = handle._sharding_strategy
    if strat == S.NO_SHARD:
        return handle.rank, handle.world_size
    if strat in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2):
        pg = getattr(fsdp_module, "_inter_node_pg", None)
        if pg is not None:
            import torch.distributed as dist

            return dist.get_rank(pg), dist.get_world_size(pg)
    return 0, 1


def fsdp1_units(root: nn.Module, where: str = "") -> Iterator[_Unit]:
    """Every FSDP1 unit under ``root`` with its pieces on this rank (checked against FSDP1's own)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy as S

    for mname, m in root.named_modules():
        if not isinstance(m, FSDP):
            continue
        handle = getattr(m, "_handle", None)
        if handle is None:  # a unit that manages no parameters
            continue
        fp = handle.flat_param
        prefix = clean_name(mname + ".") if mname else ""
        if any(e is not None for e in getattr(fp, "_param_extensions", ())):
            raise UnsupportedStateError(
                f"{where}: FSDP1 unit {mname or '<root>'} flattens tensor-parallel DTensor parameters "
                "(FSDP1 + TP); their flat slices hold local TP shards, which this adapter does not "
                "place. Use FSDP2 (fully_shard) with TP"
            )
        if not all(getattr(fp, "_contiguities", [True])):
            bad = [f for f, c in zip(fp._fqns, fp._contiguities) if not c]
            raise UnsupportedStateError(
                f"{where}: FSDP1 flattened non-contiguous parameters {bad[:3]}; their flat order is not "
                "row-major. Make them contiguous before wrapping"
            )
        sharded = handle._sharding_strategy != S.NO_SHARD
        world = handle.world_size if sharded else 1
        srank = handle.rank if sharded else 0
        local = fp._local_shard if sharded and hasattr(fp, "_local_shard") else fp
        if sharded and fp.data_ptr() != local.data_ptr():
            raise UnsupportedStateError(
                f"{where}: FSDP1 unit {mname or '<root>'} is unsharded right now (inside forward or "
                "backward?); save and load between training steps"
            )
        local = local.detach()
        pieces = shard_pieces(fp._numels_with_padding, fp._is_padding_mask, world, srank)
        by_index = {p.index: p for p in pieces}
        # FSDP1's own view of this rank's slice must agree with the arithmetic above.
        for i, info in enumerate(fp._shard_param_infos):
            p = by_index.get(i)
            ours = (p.offset, p.numel, p.start) if p is not None else None
            theirs = (info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx) if info.in_shard else None
            if ours != theirs:
                raise UnsupportedStateError(
                    f"{where}: FSDP1 unit {mname or '<root>'}: unexpected shard layout for "
                    f"{fp._fqns[i]} (FSDP1 says {theirs}, expected {ours}); this FSDP1 version is not supported"
                )
        if local.numel() < max((p.offset + p.numel for p in pieces), default=0):
            raise UnsupportedStateError(f"{where}: FSDP1 unit {mname or '<root>'}: local shard is too small")
        fqns = [prefix + clean_name(f) for f in fp._fqns]
        index = {f: i for i, f in enumerate(fp._fqns)}
        shared = []
        for spi in getattr(fp, "_shared_param_infos", ()):
            prim = f"{spi.prim_module_name}.{spi.prim_param_name}" if spi.prim_module_name else spi.prim_param_name
            name = f"{spi.module_name}.{spi.param_name}" if spi.module_name else spi.param_name
            if prim in index:
                shared.append((prefix + clean_name(name), index[prim]))
        yield _Unit(
            prefix=prefix,
            flat_param=fp,
            local=local,
            fqns=fqns,
            shapes=[tuple(int(x) for x in s) for s in fp._shapes],
            pieces=by_index,
            holders=piece_holders(fp._numels_with_padding, fp._is_padding_mask, world),
            shard_rank=srank,
            shard_world=world,
            replica=_replica_of(m, handle),
            orig_params=list(fp._params) if handle._use_orig_params and getattr(fp, "_params", None) else None,
            shared=shared,
        )


def _view(unit: _Unit, i: int, key: str, local_offset_base: int = 0) -> ParamView:
    p = unit.pieces.get(i)
    hs = unit.holders[i]
    if p is not None and unit.shard_rank in hs:
        rep_i, rep_n = unit.replica
        holders = (hs.index(unit.shard_rank) * rep_n + rep_i, len(hs) * rep_n)
    else:
        holders = (0, max(1, len(hs)) * unit.replica[1])
    return ParamView(
        fqn=f"{key}.{unit.fqns[i]}",
        shape=unit.shapes[i],
        flat=(p.start, p.stop) if p is not None else None,
        local=(p.offset - local_offset_base, p.numel) if p is not None else (0, 0),
        replica=unit.replica,
        holders=holders,
    )


def fsdp1_names_and_views(key: str, root: nn.Module, where: str = "") -> tuple[dict[int, str], dict[int, tuple[ParamView, ...]]]:
    """Parameter names (unwrapped) and optimizer views for an FSDP1-wrapped module.

    With ``use_orig_params=False`` the optimizer holds each ``FlatParameter``
    (shard-shaped state): its view lists every original parameter. With
    ``use_orig_params=True`` it holds the original parameters as 1-D views of
    the local slice: each gets one view (with no flat range off its shard).
    """
    names: dict[int, str] = {}
    views: dict[int, tuple[ParamView, ...]] = {}
    covered: set[int] = set()
    for unit in fsdp1_units(root, where):
        covered.add(id(unit.flat_param))
        views[id(unit.flat_param)] = tuple(_view(unit, i, key) for i in range(len(unit.fqns)))
        names.setdefault(id(unit.flat_param), f"{key}.{unit.prefix}_flat_param")
        if unit.orig_params is not None:
            for i, p in enumerate(unit.orig_params):
                v = _view(unit, i, key)
                if v.flat is not None:
                    v = ParamView(v.fqn, v.shape, v.flat, (0, v.local[1]), v.replica, v.holders)
                views[id(p)] = (v,)
                names.setdefault(id(p), v.fqn)
                covered.add(id(p))
    for n, p in root.named_parameters():
        if id(p) not in covered:
            names.setdefault(id(p), f"{key}.{clean_name(n)}")
    return names, views


def _plain_items(root: nn.Module, skip: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters FSDP1 does not manage (ignored modules) and persistent buffers, unwrapped names."""
    seen: set[int] = set()
    for n, p in root.named_parameters(remove_duplicate=False):
        if id(p) in skip or getattr(p, "_is_flat_param", False):
            continue
        seen.add(id(p))
        yield clean_name(n), p
    for mname, mod in root.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b is None or bname in mod._non_persistent_buffers_set:
                continue
            yield clean_name(f"{mname}.{bname}" if mname else bname), b


def _check_extra_state(root: nn.Module, key: str) -> None:
    for mname, mod in root.named_modules():
        if type(mod).get_extra_state is not nn.Module.get_extra_state:
            raise UnsupportedStateError(
                f"state[{key!r}]: module {clean_name(mname) or '<root>'} has extra state, which the FSDP1 "
                "adapter does not save yet"
            )


class FSDP1Adapter(Adapter):
    """Modules wrapped in FSDP1: flat-parameter slices as flat ranges, no all-gather."""

    name = "fsdp1"

    def claims(self, obj: Any) -> bool:
        return is_fsdp1(obj)

    @staticmethod
    def _root(obj: nn.Module) -> nn.Module:
        from .module import unwrap_module

        return unwrap_module(obj)

    def context_facts(self, key: str, obj: Any, state: Mapping[str, Any]) -> ContextFacts | None:
        """Unwrapped parameter names, and the views of every flat parameter (:func:`fsdp1_names_and_views`)."""
        if not is_fsdp1(obj):
            return None
        names, views = fsdp1_names_and_views(key, self._root(obj), f"state[{key!r}]")
        return ContextFacts(names=names, views=views)

    def save(self, key: str, obj: nn.Module, ctx: AdapterContext) -> SavePart:
        root = self._root(obj)
        _check_extra_state(root, key)
        part = SavePart(framework="fsdp1")
        managed: set[int] = set()
        for unit in fsdp1_units(root, f"state[{key!r}]"):
            managed.add(id(unit.flat_param))
            managed.update(id(p) for p in unit.orig_params or ())
            names = [(unit.fqns[i], i) for i in range(len(unit.fqns))] + unit.shared
            for name, i in names:
                p = unit.pieces.get(i)
                if p is None:
                    continue
                shape = unit.shapes[i]
                data = unit.local[p.offset : p.offset + p.numel]
                part.tensors.append(
                    SaveTensor(
                        f"{key}.{name}", data, shape, Box.full(shape), (p.start, p.stop),
                        unit.replica[0], unit.replica[1], float(p.numel * data.element_size()), "fsdp1",
                    )
                )
        for name, t in _plain_items(root, managed):
            st = save_tensor(f"{key}.{name}", t, ctx)
            if st is not None:
                part.tensors.append(st)
        part.value = {}
        return part

    def load(self, key: str, obj: nn.Module, doc: Any, tensors: Mapping[str, Any], ctx: AdapterContext, where: str = "<checkpoint>") -> LoadPart:
        root = self._root(obj)
        part = LoadPart()
        managed: set[int] = set()

        def meta_for(fqn: str, shape: tuple[int, ...], dtype: torch.dtype):
            return part.expect(tensors, fqn, shape, dtype, where)

        for unit in fsdp1_units(root, where):
            managed.add(id(unit.flat_param))
            managed.update(id(p) for p in unit.orig_params or ())
            for i, name in enumerate(unit.fqns):
                fqn = f"{key}.{name}"
                shape = unit.shapes[i]
                if meta_for(fqn, shape, unit.local.dtype) is None:
                    continue
                p = unit.pieces.get(i)
                if p is not None:
                    dest = unit.local[p.offset : p.offset + p.numel]
                    part.targets.append(LoadTarget(fqn, dest, shape, Box.full(shape), (p.start, p.stop)))
            for name, i in unit.shared:  # tied names hold the primary's data: check, do not read twice
                meta_for(f"{key}.{name}", unit.shapes[i], unit.local.dtype)
        for name, t in _plain_items(root, managed):
            fqn = f"{key}.{name}"
            if meta_for(fqn, tuple(t.shape), t.dtype) is None:
                continue
            tgt = load_target(fqn, t)
            if tgt is not None:
                part.targets.append(tgt)
        part.finish = lambda: obj
        return part
