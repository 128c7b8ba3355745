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

A ``config.json`` lands beside the weights, so ``from_pretrained(out)``
opens the folder directly, when one is given (``config=`` a file or a dict)
or when the checkpoint carries one: a dict saved as the value
``extra.hf_config`` (``{"extra": {"hf_config": model.config.to_dict()}}``),
or under another dotted name passed as ``config_key``.

Names: by default checkpoint names ``model.<hf name>`` map to ``<hf name>``
(``sp.save(path, {"model": hf_model})`` stores them so). ``rename`` rules
(regex substitutions) map other naming schemes.

Example::

    sp.save("ckpt/step_100", {"model": model, "extra": {"hf_config": model.config.to_dict()}})
    export_hf("ckpt/step_100", "hf_out", dtype=torch.bfloat16, shard_size="5GB")  # writes config.json too
    export_hf("ckpt/other", "hf_out2", config="config.json")  # or give the config
    import_hf("hf_model_dir", "ckpt/pretrained")
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..engine.io import tensor_bytes
from ..errors import ConversionError
from ..runtime.extras import require
from ..format.datafile import DEFAULT_BLOCK_SIZE
from ..format.values import decode_value
from ..items import torch_dtype
from .common import CheckpointReader, CheckpointWriter
from .options import NameMap, cast, parse_rename, parse_size, prepare_output_dir, progress

__all__ = [
    "export_hf",
    "import_hf",
    "carried_config",
    "HFExportResult",
    "ImportResult",
    "SAFETENSORS_DTYPES",
    "HF_CONFIG_KEY",
    "flat_value_docs",
]

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
HF_CONFIG_KEY = "extra.hf_config"
"""Where a checkpoint carries a Hugging Face model config by default: ``state["extra"]["hf_config"]``."""
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


@dataclass
class HFExportResult:
    """What an export wrote: files, tensor count and bytes, and the name map."""

    out: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    names: dict[str, str] = field(default_factory=dict)  # checkpoint name -> HF name
    config: str | None = None  # where config.json came from: a file, "argument" or "value <key>"; None if not written


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
    config: str | Mapping[str, Any] | None = None,
    config_key: str = HF_CONFIG_KEY,
    force: bool = False,
    quiet: bool = True,
    verify: bool = True,
) -> HFExportResult:
    """Write the tensors of ``path`` under ``prefix`` as Hugging Face safetensors in ``out``.

    ``dtype`` casts floating-point tensors; ``shard_size`` caps each file
    (``"5GB"``; a tensor larger than the cap gets a file of its own);
    ``rename`` holds ``REGEX=REPLACEMENT`` rules applied after stripping
    ``prefix``; ``keys`` are globs over checkpoint names. ``config.json`` is
    written into ``out``, so that ``AutoModelForCausalLM.from_pretrained(out)``
    works directly, from ``config`` (a path to a ``config.json`` or a dict such
    as ``model.config.to_dict()``) or, when ``config`` is None, from the dict
    the checkpoint carries as the value ``config_key`` (see
    :func:`carried_config`); with neither, no ``config.json`` is written and
    ``result.config`` is None. One file is
    named ``model.safetensors``, several ``model-0000i-of-0000n.safetensors``;
    ``model.safetensors.index.json`` is written in both cases.
    """
    reader = CheckpointReader(path, verify=verify)
    config_doc, config_from = _config_doc(reader, config, config_key)
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
    if config_doc is not None:
        tmp = os.path.join(out, "config.json.tmp")
        with open(tmp, "w") as f:
            f.write(config_doc)
        os.replace(tmp, os.path.join(out, "config.json"))
        result.config = config_from
    result.tensors, result.bytes = len(plan), total
    return result


def carried_config(path, key: str = HF_CONFIG_KEY) -> dict | None:
    """The model config dict a checkpoint carries as the value ``key``, or None if it carries none.

    A run that wants its checkpoints to export as complete Hugging Face
    folders saves its config beside the weights, as a plain value (JSON in the
    manifest, no pickle); ``export_hf`` then writes it as ``config.json``.
    ``path`` is a checkpoint path, a :class:`~shardpoint.storage.Storage` or
    a :class:`~shardpoint.convert.common.CheckpointReader`.

    Example::

        sp.save("ckpt/step_100", {"model": model, "extra": {"hf_config": model.config.to_dict()}})
        carried_config("ckpt/step_100")["model_type"]   # 'llama'
    """
    reader = path if isinstance(path, CheckpointReader) else CheckpointReader(path)
    doc: Any = reader.manifest.values
    for part in key.split("."):
        if not isinstance(doc, dict) or part not in doc or doc.get("__sp__") is not None:
            return None
        doc = doc[part]

    def no_tensor(fqn: str):
        raise ConversionError(f"{reader.where}: value {key!r} holds tensor {fqn!r}; a model config holds plain values")

    value = decode_value(doc, no_tensor, where=reader.where)
    if not isinstance(value, dict):
        raise ConversionError(f"{reader.where}: value {key!r} is a {type(value).__name__}, not a config dict")
    return value


def _config_doc(reader: CheckpointReader, config, key: str) -> tuple[str | None, str | None]:
    """The text of config.json and where it came from, checked before any weight is written."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                value = json.load(f)
        except (OSError, ValueError) as e:
            raise ConversionError(f"cannot read the config {config}: {e}") from None
        source = os.fspath(config)
    elif config is not None:
        value, source = dict(config), "argument"
    else:
        value, source = carried_config(reader, key), f"value {key}"
        if value is None:
            return None, None
    if not isinstance(value, dict):
        raise ConversionError(f"the config from {source} is a {type(value).__name__}, not a JSON object")

    def plain(v):
        if isinstance(v, torch.dtype):  # HF writes dtypes as their names: "bfloat16"
            return str(v).removeprefix("torch.")
        raise ConversionError(f"the config from {source} holds a {type(v).__name__}, which config.json cannot store")

    try:
        return json.dumps(value, indent=2, sort_keys=True, default=plain) + "\n", source
    except (TypeError, ValueError) as e:
        raise ConversionError(f"the config from {source} cannot be written as JSON: {e}") from None


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
    safe_open = require("safetensors", "hf", "importing safetensors files").safe_open

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
