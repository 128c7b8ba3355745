"""DeepSpeed's own ZeRO checkpoint folders (``engine.save_checkpoint``) as shardpoint checkpoints.

A DeepSpeed ZeRO checkpoint folder (``<dir>/<tag>/``, the tag named in
``<dir>/latest``) holds one ``*_optim_states.pt`` per data-parallel rank with
that rank's slice of the flat fp32 master weights and optimizer moments, and
``*_model_states.pt`` with the parameter names and shapes, the buffers and
the step counters. DeepSpeed's Universal Checkpointing converts such a folder
offline (``ds_to_universal.py``) into a temporary tree of per-parameter
files, gathering each parameter whole first.

:func:`import_deepspeed` instead writes the slices as they are: each rank's
slice of each parameter becomes chunks of that parameter, under the model's
own names (``model.layers.0.attn.wq.weight``,
``optimizer.state.model.layers.0.attn.wq.weight.exp_avg``), with the same
flat-range arithmetic the live adapter uses
(:mod:`shardpoint.adapters.deepspeed`). Nothing is gathered and no temporary
tree is written: one rank's files are read at a time, memory-mapped, so the
peak memory is about one rank's slice. The result loads into any layout with
:func:`shardpoint.load`: FSDP2, TP, DDP, one process, or DeepSpeed ZeRO at
another world size and stage.

Reading these files unpickles them: they hold DeepSpeed objects (stage enums,
loss scalers, fragment addresses), so ``torch.load(weights_only=True)``
cannot read them, and unpickling runs whatever code the file's author put
there. :func:`import_deepspeed` therefore refuses unless called with
``allow_pickle=True`` (see :data:`DEEPSPEED_TRUST_HELP`).

Supported: ZeRO stages 1, 2 and 3 without model parallelism (``mp_rank_00``
only), non-elastic optimizer state, fp32 master weights in memory (not
swapped to NVMe). Learning-rate scheduler and client state are listed in
``skipped``.

Example::

    from shardpoint.convert.deepspeed_native import import_deepspeed
    import_deepspeed("ds_ckpt", "ckpt/from_ds", allow_pickle=True)   # reads ds_ckpt/latest
    sp.load("ckpt/from_ds", {"model": fsdp2_model, "optimizer": opt})
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Sequence

import torch

from ..adapters.deepspeed import scaler_doc, zero3_pieces, zero12_pieces
from ..errors import ConversionError
from ..format.datafile import DEFAULT_BLOCK_SIZE
from ..format.values import encode_value
from ..geometry import Box, flat_range_pieces
from .common import CheckpointWriter
from .options import pickle_allowed, prepare_output_dir
from .hf import ImportResult

__all__ = ["import_deepspeed", "deepspeed_files", "DEEPSPEED_TRUST_HELP"]

DEEPSPEED_TRUST_HELP = (
    "DeepSpeed checkpoint files (*_model_states.pt, *_optim_states.pt) are Python pickles written by "
    "torch.save that hold DeepSpeed's own objects, so they can only be read with "
    "torch.load(weights_only=False), which runs whatever code the files' author put there. Import only "
    "folders you trust, and say so with allow_pickle=True."
)

_OPTIM = re.compile(r"^(?:[a-z0-9]+_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^(?:[a-z0-9]+_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def deepspeed_files(path: str, tag: str | None = None) -> tuple[str, list[str], list[str]]:
    """(folder, optimizer files by rank, model-state files) of a DeepSpeed checkpoint.

    ``path`` is the folder given to ``engine.save_checkpoint`` (the tag is
    read from its ``latest`` file unless ``tag`` is given) or the tag folder
    itself. Needs no unpickling.
    """
    if tag is None and os.path.isfile(os.path.join(path, "latest")):
        with open(os.path.join(path, "latest")) as f:
            tag = f.read().strip()
    folder = os.path.join(path, tag) if tag else path
    if not os.path.isdir(folder):
        raise ConversionError(f"{folder}: no such DeepSpeed checkpoint folder")
    optim: dict[int, str] = {}
    for f in sorted(os.listdir(folder)):
        m = _OPTIM.match(f)
        if not m:
            continue
        if int(m.group(2)) != 0:
            raise ConversionError(
                f"{folder}: {f} belongs to model-parallel rank {m.group(2)}; only checkpoints without DeepSpeed "
                "tensor or pipeline parallelism (mp_rank_00 only) are supported"
            )
        optim[int(m.group(1))] = os.path.join(folder, f)
    if not optim:
        raise ConversionError(f"{folder}: no *_optim_states.pt files; is this a DeepSpeed ZeRO checkpoint?")
    if sorted(optim) != list(range(len(optim))):
        raise ConversionError(f"{folder}: optimizer files for ranks {sorted(optim)}; some ranks' files are missing")
    models: dict[int, str] = {}
    for f in sorted(os.listdir(folder)):
        m = _MODEL3.match(f)
        if m and int(m.group(2)) == 0:
            models[int(m.group(1))] = os.path.join(folder, f)
    if models:
        model_files = [models[r] for r in sorted(models)]
    elif os.path.isfile(os.path.join(folder, "mp_rank_00_model_states.pt")):
        model_files = [os.path.join(folder, "mp_rank_00_model_states.pt")]
    else:
        raise ConversionError(f"{folder}: no *_model_states.pt file")
    return folder, [optim[r] for r in sorted(optim)], model_files


def _load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=False)


def _add_flat(w: CheckpointWriter, fqn: str, data: torch.Tensor, shape: tuple[int, ...], start: int, stop: int, rank: int) -> None:
    """Write elements ``[start, stop)`` of ``fqn``'s row-major order (``data``, 1-D) as box chunks."""
    data = data.reshape(-1)
    if data.numel() != stop - start:
        raise ConversionError(f"{fqn}: a slice of {data.numel()} elements for the flat range [{start}, {stop})")
    for pc in flat_range_pieces(Box.full(shape), start, stop):
        part = data[pc.start : pc.start + pc.box.numel].reshape(pc.box.sizes)
        w.add(fqn, part, shape=shape, box=pc.box, rank=rank, placement="zero")


class _Param:
    def __init__(self, name: str, shape: tuple[int, ...], group: int):
        self.name, self.shape, self.group = name, shape, group
        self.numel = math.prod(shape)


def _stage_and_world(osd: dict, files: Sequence[str], folder: str) -> tuple[int, int]:
    if "zero_stage" not in osd:
        raise ConversionError(f"{files[0]}: not a ZeRO checkpoint (no zero_stage; fp16/bf16 optimizers without ZeRO are not supported)")
    stage = int(osd["zero_stage"])
    counts = osd.get("partition_count", len(files))
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
    if any(int(c) != len(files) for c in counts):
        raise ConversionError(
            f"{folder}: partition counts {counts} but {len(files)} optimizer files (expert parallelism, or files "
            "of another save mixed in?)"
        )
    if stage not in (1, 2, 3):
        raise ConversionError(f"{folder}: unknown ZeRO stage {stage}")
    return stage, len(files)


def _inner_state(osd: dict, stage: int, where: str) -> dict:
    key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    base = osd.get(key)
    if not isinstance(base, dict) or "state" not in base or "param_groups" not in base:
        raise ConversionError(
            f"{where}: optimizer state saved with elastic_checkpoint (or without a torch state dict) is not "
            "supported; save with elastic_checkpoint off"
        )
    return base


def _flat_index(param_groups: list) -> list[tuple[int, int]]:
    """(state index, param group) of every flat tensor, in the order the optimizer lists them."""
    return [(int(i), g) for g, pg in enumerate(param_groups) for i in pg["params"]]


def import_deepspeed(
    src: str,
    path: str,
    *,
    allow_pickle: bool = False,
    trust_pickle: bool | None = None,
    tag: str | None = None,
    model_key: str = "model",
    optimizer_key: str | None = "optimizer",
    block_size: int = DEFAULT_BLOCK_SIZE,
    force: bool = False,
) -> ImportResult:
    """Write the DeepSpeed ZeRO checkpoint folder ``src`` as the shardpoint checkpoint ``path``.

    Refuses unless ``allow_pickle`` (``trust_pickle`` is its deprecated old name) (see :data:`DEEPSPEED_TRUST_HELP`).
    Parameters and buffers go under ``model_key`` and the optimizer under
    ``optimizer_key`` (``None`` skips it), keyed by parameter name exactly as
    :func:`shardpoint.save` writes them for FSDP2 or DeepSpeed, so
    ``sp.load(path, {"model": model, "optimizer": opt})`` restores both
    under any layout. Each source rank's slices go to their own data file;
    nothing is gathered.

    Example::

        import_deepspeed("runs/ds/ckpt", "runs/sp/step_2", allow_pickle=True)
    """
    pickle_allowed(allow_pickle, trust_pickle, src, DEEPSPEED_TRUST_HELP)
    folder, optim_files, model_files = deepspeed_files(src, tag)
    prepare_output_dir(path, force)
    result = ImportResult(path)
    msd, params, aliases = _model_states(model_files[0], result)
    first = _load(optim_files[0])
    osd0 = first["optimizer_state_dict"]
    stage, world = _stage_and_world(osd0, optim_files, folder)
    scaler = scaler_doc(osd0.get("loss_scaler")) if osd0.get("dynamic_loss_scale") else {}
    del first
    layout = {"source": "deepspeed", "zero_stage": stage, "source_world_size": world, "ds_version": msd.get("ds_version")}

    with CheckpointWriter(path, block_size=block_size, world_size=world, layout=layout) as w:
        imp = _DsImport(w, model_key, optimizer_key, aliases)
        imp.add_optimizer_files(optim_files, stage, world, params)
        imp.add_frozen_and_buffers(msd, model_files, stage, world)
        imp.set_values(msd, stage, scaler)
        manifest = w.commit()
    result.tensors = len(manifest.tensors)
    result.bytes = w.bytes_written
    return result


def _model_states(file: str, result: ImportResult) -> tuple[dict, list[list[_Param]], dict[str, list[str]]]:
    """Rank 0's model-states file, its parameters by group, and each shared parameter's aliases.

    Entries the import does not carry over are listed as skipped in ``result``.
    """
    msd = _load(file)
    if "param_shapes" not in msd or "module" not in msd:
        raise ConversionError(f"{file}: not a DeepSpeed model-states file")
    for k in ("lr_scheduler", "data_sampler", "random_ltd"):
        if msd.get(k) is not None:
            result.skipped.append(k)
    result.skipped.extend(sorted(k for k in msd if k not in _KNOWN_MODEL_KEYS))
    groups_shapes = msd["param_shapes"]
    if isinstance(groups_shapes, dict):
        groups_shapes = [groups_shapes]
    params: list[list[_Param]] = [
        [_Param(n, tuple(int(x) for x in s), g) for n, s in shapes.items()] for g, shapes in enumerate(groups_shapes)
    ]
    aliases: dict[str, list[str]] = {}
    for alias, primary in (msd.get("shared_params") or {}).items():
        aliases.setdefault(primary, []).append(alias)
    return msd, params, aliases


class _DsImport:
    """One import's writer and the optimizer documents it builds while the rank files stream through."""

    def __init__(self, w: CheckpointWriter, model_key: str, optimizer_key: str | None, aliases: dict[str, list[str]]) -> None:
        self.w, self.mk, self.optimizer_key, self.aliases = w, model_key, optimizer_key, aliases
        self.state_docs: dict[str, dict] = {}
        self.group_of: dict[str, int] = {}
        self.hyper: dict[int, dict] = {}
        self.written_steps: set[str] = set()

    def emit(self, name: str, data: torch.Tensor, shape, start: int, stop: int, rank: int) -> None:
        """A flat slice of parameter ``name``, under its name and every alias."""
        for n in [name] + self.aliases.get(name, []):
            _add_flat(self.w, f"{self.mk}.{n}", data, shape, start, stop, rank)

    def emit_state(self, p: _Param, st: dict, rank: int, pieces_of_state) -> None:
        """Optimizer state of ``p``: per-element tensors as pieces, the rest once."""
        # Optimizer state lives under the primary name only, as the optimizer adapter keys it.
        if self.optimizer_key is None:
            return
        fqn = f"{self.mk}.{p.name}"
        self.group_of.setdefault(fqn, p.group)
        if not st:
            return
        doc = self.state_docs.setdefault(fqn, {})
        base = f"{self.optimizer_key}.state.{fqn}"
        for k, v in st.items():
            sub = pieces_of_state(k, v)
            if sub is not None:  # a slice of a flat state tensor
                data, start, stop = sub
                _add_flat(self.w, f"{base}.{k}", data, p.shape, start, stop, rank)
                doc[k] = {"__sp__": "tensor", "key": f"{base}.{k}"}
            elif k not in doc:  # scalar state (step): one value per parameter, written once
                doc[k] = encode_value(v, f"{base}.{k}", self.put_step)

    def put_step(self, name: str, t: torch.Tensor) -> None:
        if name not in self.written_steps:
            self.written_steps.add(name)
            self.w.add(name, t.detach().clone(), rank=0, placement="replicated")

    def add_optimizer_files(self, optim_files: Sequence[str], stage: int, world: int, params: list[list[_Param]]) -> None:
        """Each source rank's optimizer file: its parameter and state slices go to that rank's data file."""
        for rank, f in enumerate(optim_files):
            sd = _load(f)
            osd = sd["optimizer_state_dict"]
            if int(osd.get("zero_stage", -1)) != stage:
                raise ConversionError(f"{f}: ZeRO stage {osd.get('zero_stage')} differs from rank 0's {stage}")
            inner = _inner_state(osd, stage, f) if self.optimizer_key is not None else None
            if stage < 3:
                rr = bool(((sd.get("ds_config") or {}).get("zero_optimization") or {}).get("round_robin_gradients"))
                _rank_zero12(f, osd, inner, rank, world, params, self.emit, self.emit_state, self.hyper, check_mappings=not rr)
            else:
                _rank_zero3(f, osd, inner, rank, world, params, self.emit, self.emit_state, self.hyper)
            del sd, osd, inner

    def add_frozen_and_buffers(self, msd: dict, model_files: Sequence[str], stage: int, world: int) -> None:
        """Frozen parameters (whole under ZeRO 1-2, per-rank pieces under ZeRO 3) and buffers."""
        w, mk, aliases = self.w, self.mk, self.aliases
        frozen = msd.get("frozen_param_shapes") or {}
        if frozen:
            if stage < 3:
                frags = msd.get("frozen_param_fragments") or {}
                for n in frozen:
                    for a in [n] + aliases.get(n, []):
                        w.add(f"{mk}.{a}", frags[n].detach().reshape(tuple(frozen[n])), rank=0)
            else:
                for rank, mf in enumerate(model_files):
                    frags = (msd if rank == 0 else _load(mf)).get("frozen_param_fragments") or {}
                    for n, s in frozen.items():
                        shape = tuple(int(x) for x in s)
                        for pc in zero3_pieces([math.prod(shape)], world, rank):
                            self.emit(n, frags[n].reshape(-1)[: pc.numel], shape, pc.start, pc.stop, rank)
        for n in msd.get("buffer_names") or []:
            t = msd["module"].get(n)
            if isinstance(t, torch.Tensor):
                w.add(f"{mk}.{n}", t.detach(), rank=0, placement="replicated")

    def put_replicated(self, fq: str, t: torch.Tensor) -> None:
        self.w.add(fq, t.detach().clone(), rank=0, placement="replicated")

    def set_values(self, msd: dict, stage: int, scaler: dict) -> None:
        """The model's step counters and the optimizer's document (groups, state, loss scaler)."""
        w, mk, optimizer_key = self.w, self.mk, self.optimizer_key
        counters = {k: int(msd[k]) for k in ("global_steps", "global_samples", "skipped_steps") if isinstance(msd.get(k), int)}
        w.set_value(mk, {"deepspeed": counters}, f"deepspeed_zero{stage}")
        if optimizer_key is None:
            return
        groups = [
            encode_value(self.hyper.get(g, {}), f"{optimizer_key}.groups.{g}", self.put_replicated)
            for g in range(max(self.hyper, default=-1) + 1)
        ]
        doc = {"groups": groups, "group_of": self.group_of, "state": self.state_docs}
        if scaler:  # fp16 dynamic loss scaling, restored into a DeepSpeed engine
            doc["deepspeed"] = {"loss_scaler": scaler}
        w.set_value(optimizer_key, doc, f"deepspeed_zero{stage}")


_KNOWN_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version",
}


def _hyper(pg: dict) -> dict:
    return {k: v for k, v in pg.items() if k != "params"}


def _rank_zero12(f, osd, inner, rank, world, params, emit, emit_state, hyper, check_mappings=True) -> None:
    fp32s = osd["single_partition_of_fp32_groups"]
    paddings = osd.get("group_paddings") or [0] * len(fp32s)
    align = osd.get("param_alignment_paddings")
    # DeepSpeed's per-parameter addresses (for its universal checkpoints), a cross-check. With
    # round_robin_gradients, DeepSpeed 0.19.8 computes them in the original parameter order while
    # the flat group (and param_shapes) follow the round-robin order: they are wrong, skip them.
    mappings = osd.get("param_slice_mappings") if check_mappings else None
    if len(fp32s) != len(params):
        raise ConversionError(f"{f}: {len(fp32s)} fp32 groups for {len(params)} parameter groups")
    index = _flat_index(inner["param_groups"]) if inner is not None else []
    for g, fp32 in enumerate(fp32s):
        ps = params[g]
        numels = [p.numel for p in ps]
        pads = list(align[g]) if align is not None else [0] * len(ps)
        offsets, pos = [], 0
        for n, pad in zip(numels, pads):
            offsets.append(pos)
            pos += n + int(pad)
        local_n = fp32.numel()
        size = local_n + int(paddings[g])  # every rank's partition, padding included
        pieces = zero12_pieces(numels, offsets, size * world, world, rank)
        st = {}
        if inner is not None:
            hyper.setdefault(g, _hyper(inner["param_groups"][g]))
            idx = [i for i, gg in index if gg == g]
            if len(idx) != 1:
                raise ConversionError(f"{f}: parameter group {g} lists {len(idx)} flat tensors, expected 1")
            st = inner["state"].get(idx[0], {})
        for pc in pieces:
            p = ps[pc.index]
            if pc.offset + pc.numel > fp32.numel():
                raise ConversionError(f"{f}: {p.name} lies in the group padding; the file does not match its shapes")
            if mappings is not None and p.name in mappings[g]:
                fa = mappings[g][p.name]
                if (int(fa.start), int(fa.numel)) != (pc.offset, pc.numel):
                    raise ConversionError(
                        f"{f}: DeepSpeed places {p.name} at {(fa.start, fa.numel)} of rank {rank}'s partition, "
                        f"expected {(pc.offset, pc.numel)}; this checkpoint layout is not supported"
                    )
            emit(p.name, fp32[pc.offset : pc.offset + pc.numel], p.shape, pc.start, pc.stop, rank)

            def piece(k, v, pc=pc, n=local_n, size=size):
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() in (n, size):
                    return v.reshape(-1)[pc.offset : pc.offset + pc.numel], pc.start, pc.stop
                return None

            if st:
                emit_state(p, st, rank, piece)
        if st or inner is not None:
            # Parameters with no piece on this rank still belong to the group.
            for p in ps:
                emit_state(p, {}, rank, lambda k, v: None)


def _rank_zero3(f, osd, inner, rank, world, params, emit, emit_state, hyper) -> None:
    flats = osd["fp32_flat_groups"]
    if len(flats) != len(params):
        raise ConversionError(f"{f}: {len(flats)} fp32 sub-groups for {len(params)} sub-groups of parameter shapes")
    index = _flat_index(inner["param_groups"]) if inner is not None else []
    if inner is not None and len(index) != len(flats):
        raise ConversionError(f"{f}: the optimizer lists {len(index)} flat tensors for {len(flats)} sub-groups")
    for j, fp32 in enumerate(flats):
        ps = params[j]
        pieces = zero3_pieces([p.numel for p in ps], world, rank)
        expect = sum(-(-p.numel // world) for p in ps)
        local_n = fp32.numel()
        if local_n != expect:
            raise ConversionError(f"{f}: sub-group {j} holds {fp32.numel()} elements, expected {expect}")
        st = {}
        if inner is not None:
            sidx, g = index[j]
            for p in ps:
                p.group = g
            hyper.setdefault(g, _hyper(inner["param_groups"][g]))
            st = inner["state"].get(sidx, {})
        for pc in pieces:
            p = ps[pc.index]
            emit(p.name, fp32[pc.offset : pc.offset + pc.numel], p.shape, pc.start, pc.stop, rank)

            def piece(k, v, pc=pc, n=local_n):
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() == n:
                    return v.reshape(-1)[pc.offset : pc.offset + pc.numel], pc.start, pc.stop
                return None

            if st:
                emit_state(p, st, rank, piece)
        if inner is not None:
            for p in ps:
                emit_state(p, {}, rank, lambda k, v: None)
