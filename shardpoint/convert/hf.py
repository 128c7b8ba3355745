"""Hugging Face safetensors, both ways.

:func:`export_hf` writes the consolidated weights of a checkpoint as
safetensors files plus ``model.safetensors.index.json``, the layout
``from_pretrained`` reads. It streams: the header of each output file is
computed from the manifest alone, then tensors are read (checksums verified),
cast and written one at a time, so peak memory stays near the largest single
tensor whatever the model size.

:func:`import_hf` reads a ``.safetensors`` file, or a folder of them (with or
without an index), one tensor at a time into a new shardpoint checkpoint, so a
pretrained model can start a sharded run: ``sp.load(path, {"model": model})``
fills an FSDP2 or TP model directly.

Names: by default checkpoint names ``model.<hf name>`` map to ``<hf name>``
(``sp.save(path, {"model": hf_model})`` stores them so). ``rename`` rules
(regex substitutions) map other naming schemes.

Example::

    export_hf("ckpt/step_100", "hf_out", dtype=torch.bfloat16, shard_size="5GB", config="config.json")
    import_hf("hf_model_dir", "ckpt/pretrained")
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..adapters.base import torch_dtype
from ..engine.io import DEFAULT_BLOCK_SIZE, tensor_bytes
from .common import (
    CheckpointReader,
    CheckpointWriter,
    ConversionError,
    NameMap,
    cast,
    parse_rename,
    parse_size,
    prepare_output_dir,
    progress,
)

__all__ = ["export_hf", "import_hf", "HFExportResult", "ImportResult", "SAFETENSORS_DTYPES", "flat_value_docs"]

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
INDEX_NAME = "model.safetensors.index.json"
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


@dataclass
class HFExportResult:
    """What an export wrote: files, tensor count and bytes, and the name map."""

    out: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    names: dict[str, str] = field(default_factory=dict)  # checkpoint name -> HF name


@dataclass
class ImportResult:
    """What an import wrote: the checkpoint path, tensors, bytes, and skipped entries."""

    path: str
    tensors: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _plan(reader: CheckpointReader, names: NameMap, dtype, where: str) -> list[tuple[str, str, torch.dtype, tuple, int]]:
    """(checkpoint name, HF name, output dtype, shape, bytes) for every exported tensor."""
    plan, seen = [], {}
    for fqn in reader.names():
        out = names.export_name(fqn)
        if out is None:
            continue
        if out in seen:
            raise ConversionError(f"{where}: tensors {seen[out]!r} and {fqn!r} both map to {out!r}; adjust --prefix/--rename")
        seen[out] = fqn
        meta = reader.meta(fqn)
        dt = torch_dtype(meta.dtype)
        if dtype is not None and dt.is_floating_point:
            dt = dtype
        if dt not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{where}: tensor {fqn!r} has dtype {dt}, which safetensors cannot store; pass --dtype")
        plan.append((fqn, out, dt, tuple(meta.shape), meta.numel * torch.empty((), dtype=dt).element_size()))
    if not plan:
        raise ConversionError(
            f"{where}: no tensor matches prefix {names.prefix!r}"
            + (f" and keys {list(names.keys)}" if names.keys else "")
            + f"; checkpoint tensors start with {sorted({f.split('.', 1)[0] + '.' for f in reader.names()})}"
        )
    plan.sort(key=lambda p: _natural(p[1]))
    return plan


def _header(items, metadata: dict) -> bytes:
    doc: dict = {"__metadata__": metadata}
    pos = 0
    for _, out, dt, shape, nbytes in items:
        doc[out] = {"dtype": SAFETENSORS_DTYPES[dt], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def export_hf(
    path: str,
    out: str,
    *,
    dtype: torch.dtype | None = None,
    shard_size: int | str = "5GB",
    prefix: str = "model.",
    rename: Sequence[str] = (),
    keys: Sequence[str] = (),
    exclude: Sequence[str] = (),
    config: str | None = None,
    force: bool = False,
    quiet: bool = True,
    verify: bool = True,
) -> HFExportResult:
    """Write the tensors of ``path`` under ``prefix`` as Hugging Face safetensors in ``out``.

    ``dtype`` casts floating-point tensors; ``shard_size`` caps each file
    (``"5GB"``; a tensor larger than the cap gets a file of its own);
    ``rename`` holds ``REGEX=REPLACEMENT`` rules applied after stripping
    ``prefix``; ``keys`` are globs over checkpoint names; ``config`` is a
    ``config.json`` copied into ``out`` so that
    ``AutoModelForCausalLM.from_pretrained(out)`` works directly. One file is
    named ``model.safetensors``, several ``model-0000i-of-0000n.safetensors``;
    ``model.safetensors.index.json`` is written in both cases.
    """
    reader = CheckpointReader(path, verify=verify)
    names = NameMap(prefix, parse_rename(rename), tuple(keys), tuple(exclude))
    cap = parse_size(shard_size)
    plan = _plan(reader, names, dtype, reader.where)
    shards: list[list] = [[]]
    size = 0
    for item in plan:
        if shards[-1] and size + item[4] > cap:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[4]
    prepare_output_dir(out, force)
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    result = HFExportResult(out)
    total = sum(p[4] for p in plan)
    weight_map = {}
    with progress(total, "export hf", quiet) as bar:
        for fname, items in zip(files, shards):
            tmp = os.path.join(out, fname + ".tmp")
            with open(tmp, "wb") as f:
                f.write(_header(items, {"format": "pt"}))
                for fqn, hf_name, dt, shape, nbytes in items:
                    t = cast(reader.read(fqn), dt)
                    mv = tensor_bytes(t)
                    assert len(mv) == nbytes, (fqn, len(mv), nbytes)
                    f.write(mv)
                    del t, mv
                    weight_map[hf_name] = fname
                    result.names[fqn] = hf_name
                    bar.update(nbytes)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(out, fname))
            result.files.append(fname)
    index = {"metadata": {"total_size": total, "source": "shardpoint"}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2)
    if config:
        shutil.copyfile(config, os.path.join(out, "config.json"))
    result.tensors, result.bytes = len(plan), total
    return result


def _source_files(src: str) -> list[str]:
    if os.path.isfile(src):
        if src.endswith(".json"):
            with open(src) as f:
                wm = json.load(f).get("weight_map", {})
            base = os.path.dirname(src)
            return [os.path.join(base, x) for x in sorted(set(wm.values()))]
        return [src]
    if not os.path.isdir(src):
        raise ConversionError(f"{src}: no such file or folder")
    idx = os.path.join(src, INDEX_NAME)
    if os.path.exists(idx):
        return _source_files(idx)
    found = sorted(os.path.join(src, x) for x in os.listdir(src) if x.endswith(".safetensors"))
    if not found:
        raise ConversionError(f"{src}: holds no .safetensors file and no {INDEX_NAME}")
    return found


def flat_value_docs(fqns: Sequence[str]) -> dict[str, dict]:
    """Value documents for tensors stored under dotted names: ``{top: {rest: ref}}``.

    With them a checkpoint loads into a module (``{"model": model}``) as well
    as into a plain dict (``{"model": {}}`` gives back ``{rest: tensor}``).
    """
    docs: dict[str, dict] = {}
    for fqn in fqns:
        top, _, rest = fqn.partition(".")
        if not rest:
            raise ConversionError(f"tensor name {fqn!r} has no state key; pass --prefix model. (or another key)")
        docs.setdefault(top, {})[rest] = {"__sp__": "tensor", "key": fqn}
    return docs


def import_hf(
    src: str,
    path: str,
    *,
    prefix: str = "model.",
    rename: Sequence[str] = (),
    keys: Sequence[str] = (),
    exclude: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    force: bool = False,
    quiet: bool = True,
) -> ImportResult:
    """Write the tensors of safetensors file(s) ``src`` into a new checkpoint at ``path``.

    ``src`` is a ``.safetensors`` file, an index json, or a folder holding
    either. Tensor ``name`` becomes ``prefix + name`` (after ``rename``);
    ``keys`` are globs over the source names; ``dtype`` casts floating-point
    tensors. The result loads with ``sp.load(path, {"model": model})``.
    """
    from safetensors import safe_open

    files = _source_files(src)
    names = NameMap(prefix, parse_rename(rename), tuple(keys), tuple(exclude))
    if prefix and not prefix.endswith("."):
        raise ConversionError(f"prefix {prefix!r} must end with '.', like 'model.'")
    if "://" not in path:
        prepare_output_dir(path, force)
    result = ImportResult(path)
    written: dict[str, str] = {}
    total = 0
    for fn in files:
        with safe_open(fn, framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                total += math.prod(sl.get_shape()) * _ITEMSIZE.get(sl.get_dtype(), 1)
    with CheckpointWriter(path, block_size=block_size, layout={"source": "hf"}) as w, progress(total, "import hf", quiet) as bar:
        for fn in files:
            with safe_open(fn, framework="pt") as f:
                for k in f.keys():
                    fqn = names.import_name(k)
                    if fqn is None:
                        result.skipped.append(k)
                        continue
                    if fqn in written:
                        raise ConversionError(f"{src}: tensors {written[fqn]!r} and {k!r} both map to {fqn!r}")
                    written[fqn] = k
                    t = cast(f.get_tensor(k), dtype)
                    w.add(fqn, t)
                    result.bytes += t.numel() * t.element_size()
                    bar.update(t.numel() * t.element_size())
                    del t
        for top, doc in flat_value_docs(sorted(written)).items():
            w.set_value(top, doc, kind="module")
        w.commit()
    result.tensors = len(written)
    return result
