"""PyTorch Distributed Checkpoint (DCP) folders, both ways.

:func:`export_dcp` writes a DCP folder that ``torch.distributed.checkpoint.load``
reads, with or without a process group. It runs DCP's own writer
(``FileSystemWriter``) with a planner whose tensors are placeholders on the
``meta`` device: DCP asks for each tensor only when it writes it, and the
planner then reads that one tensor from the shardpoint checkpoint. Tensor names
are the checkpoint's names (``model.layers.0.w``), which is what DCP's
``flatten_state_dict`` makes of ``{"model": model.state_dict()}``, so
``dcp.load({"model": model.state_dict()}, checkpoint_id=OUT)`` works. An
optimizer is written the way ``get_optimizer_state_dict`` lays it out
(``optimizer.state.layers.0.w.exp_avg`` and ``optimizer.param_groups``, see
:mod:`shardpoint.dcp_names`), so ``dcp.load`` fills the dicts of
``get_model_state_dict`` and ``get_optimizer_state_dict``, and
``set_optimizer_state_dict`` restores the optimizer. Plain values
(``{"extra": {"step": 7}}``) are written as DCP objects too.

:func:`import_dcp` reads a DCP folder chunk by chunk through DCP's own reader
and keeps its sharding: each saved DCP chunk becomes one shardpoint chunk,
written by the rank whose file held it. DCP's ``.metadata`` file and its
non-tensor objects are pickles, and unpickling runs code chosen by whoever
wrote the file: importing therefore needs ``allow_pickle=True``
(``--allow-pickle``).

Example::

    export_dcp("ckpt/step_100", "dcp_out")
    import_dcp("dcp_ckpt", "ckpt/from_dcp", allow_pickle=True)
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Any, Sequence

import torch

from ..dcp_names import dcp_to_native, is_dcp_optimizer_doc, is_native_optimizer_doc, native_to_dcp, rename_refs
from ..errors import CheckpointError, ConversionError
from ..format.datafile import DEFAULT_BLOCK_SIZE
from ..format.values import decode_value
from ..geometry import Box
from ..items import torch_dtype
from .common import CheckpointReader, CheckpointWriter, encodable, encode_entries
from .options import NameMap, cast, parse_rename, pickle_allowed, prepare_output_dir, progress, top_key
from .hf import ImportResult

__all__ = ["export_dcp", "import_dcp", "DCPExportResult", "TRUST_PICKLE_HELP"]

TRUST_PICKLE_HELP = (
    "DCP stores its .metadata file and every non-tensor object as Python pickles, and "
    "unpickling runs whatever code the file's author put there. Import only DCP folders you "
    "trust, and say so with --allow-pickle (allow_pickle=True)."
)


class DCPExportResult(ImportResult):
    """What an export to DCP wrote (``path`` is the DCP folder)."""


def _quiet_dcp():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    return ctx


def export_dcp(
    path: str,
    out: str,
    *,
    prefix: str = "",
    rename: Sequence[str] = (),
    keys: Sequence[str] = (),
    exclude: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    values: bool = True,
    force: bool = False,
    quiet: bool = True,
    verify: bool = True,
) -> DCPExportResult:
    """Write the checkpoint ``path`` as a DCP folder ``out`` (consolidated tensors, one file).

    ``prefix``/``rename``/``keys`` select and rename tensors as for
    :func:`~shardpoint.convert.hf.export_hf` (by default every tensor keeps its
    name). With ``values`` and no selection, every entry's plain values
    (optimizer hyper-parameters, step counters) are written as DCP objects
    too, so that :func:`import_dcp` gives back an equivalent checkpoint.
    Peak memory stays near one tensor.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    reader = CheckpointReader(path, verify=verify)
    m = reader.manifest
    names = NameMap(prefix, parse_rename(rename), tuple(keys), tuple(exclude))
    state: dict[str, Any] = {}
    source: dict[int, str] = {}  # id(placeholder) -> checkpoint tensor name
    result = DCPExportResult(out)
    total = 0

    def placeholder(fqn: str) -> torch.Tensor:
        nonlocal total
        meta = reader.meta(fqn)
        dt = torch_dtype(meta.dtype)
        if dtype is not None and dt.is_floating_point:
            dt = dtype
        t = torch.empty(meta.shape, dtype=dt, device="meta")
        source[id(t)] = fqn
        total += t.numel() * t.element_size()
        return t

    in_trees: set[str] = set()
    if values and not prefix and not rename and not keys and not exclude:
        # Every entry's value document (optimizer hyper-parameters, step counters, a module's
        # extra state) becomes DCP objects; its tensor references become the tensors themselves.
        entries = m.layout.get("entries", {}) if isinstance(m.layout, dict) else {}
        for key, doc in m.values.items():
            if str(entries.get(key, "")).startswith("optimizer") and is_native_optimizer_doc(doc):
                # The layout of get_optimizer_state_dict: state by the model's parameter names.
                doc = native_to_dcp(doc, reader.where)
            tree = decode_value(doc, lambda f: (in_trees.add(f), placeholder(f))[1], False, reader.where)
            if tree is not None and tree != {}:
                state[key] = tree
    seen: dict[str, str] = {}
    for fqn in reader.names():
        if fqn in in_trees:
            continue
        out_name = names.export_name(fqn)
        if out_name is None:
            result.skipped.append(fqn)
            continue
        if out_name in seen:
            raise ConversionError(f"{reader.where}: tensors {seen[out_name]!r} and {fqn!r} both map to {out_name!r}")
        seen[out_name] = fqn
        top, _, rest = out_name.partition(".")
        if rest:
            node = state.setdefault(top, {})
            if not isinstance(node, dict) or rest in node:
                raise ConversionError(f"{reader.where}: tensor {out_name!r} collides with a value of entry {top!r}")
            node[rest] = placeholder(fqn)
        else:
            state[top] = placeholder(fqn)
    if not source:
        raise ConversionError(f"{reader.where}: no tensor selected for export")

    bar = progress(total, "export dcp", quiet)

    class _StreamingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            obj = self.lookup_object(write_item.index)
            fqn = source.get(id(obj)) if isinstance(obj, torch.Tensor) else None
            if fqn is None:
                return super().resolve_data(write_item)
            t = cast(reader.read(fqn), obj.dtype)
            bar.update(t.numel() * t.element_size())
            result.tensors += 1
            result.bytes += t.numel() * t.element_size()
            return t

    prepare_output_dir(out, force)
    ctx = _quiet_dcp()
    try:
        with bar, _dcp_errors(f"exporting {path} to {out}"):
            dcp.save(state, storage_writer=FileSystemWriter(out, thread_count=1), planner=_StreamingPlanner(), no_dist=True)
    finally:
        ctx.__exit__(None, None, None)
    return result


@contextlib.contextmanager
def _dcp_errors(what: str):
    """Turn DCP's ``CheckpointException`` (a ``BaseException`` holding each rank's error) into ours.

    A shardpoint error raised while DCP pulled tensors (a corrupt source) comes
    out as itself; anything else becomes a ``ConversionError`` naming it.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        causes = [pair[0] if isinstance(pair, tuple) else pair for pair in e.failures.values()]
        for c in causes:
            if isinstance(c, CheckpointError):
                raise c from None
        first = causes[0] if causes else e
        raise ConversionError(f"{what} failed: {type(first).__name__}: {first}") from None


_RANK_RE = re.compile(r"__(\d+)_")


def import_dcp(
    src: str,
    path: str,
    *,
    allow_pickle: bool = False,
    trust_pickle: bool | None = None,
    prefix: str = "",
    rename: Sequence[str] = (),
    keys: Sequence[str] = (),
    exclude: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    force: bool = False,
    quiet: bool = True,
) -> ImportResult:
    """Write the DCP folder ``src`` as a shardpoint checkpoint at ``path``, chunk by chunk.

    Needs ``allow_pickle=True`` (``trust_pickle`` is its deprecated old name) (see :data:`TRUST_PICKLE_HELP`). Each DCP key
    keeps its name (after ``rename``, with ``prefix`` in front); a DCP folder
    saved from ``{"model": sd, "optimizer": osd}`` therefore loads with
    ``sp.load(path, {"model": model, "optimizer": opt})`` (an optimizer keyed
    the way ``get_optimizer_state_dict`` keys it is matched to ``opt``'s
    parameters by name at load time), and one saved from a bare
    ``model.state_dict()`` needs ``prefix="model."``. Non-tensor objects that
    the manifest can store (numbers, strings, lists, dicts) become values;
    others are skipped and listed in the result.
    """
    pickle_allowed(allow_pickle, trust_pickle, src, TRUST_PICKLE_HELP)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isdir(src) or not os.path.exists(os.path.join(src, ".metadata")):
        raise ConversionError(f"{src} is not a DCP folder (no .metadata file)")
    top_key(prefix)  # validates the prefix
    names = NameMap(prefix, parse_rename(rename), tuple(keys), tuple(exclude))
    reader = FileSystemReader(src)
    md = reader.read_metadata()
    planner_paths = getattr(md, "planner_data", None) or {}
    result = ImportResult(path)

    def new_path(fqn: str, final: str) -> tuple:
        p = planner_paths.get(fqn)
        if final == fqn and isinstance(p, tuple) and p and isinstance(p[0], str) and "." not in p[0] \
                and all(isinstance(k, (str, int)) for k in p) and ".".join(map(str, p)) == fqn:
            return tuple(("l" if isinstance(k, int) else "d", k) for k in p)
        top, _, rest = final.partition(".")
        return (("d", top), ("d", rest)) if rest else (("d", top),)

    state: dict[str, Any] = {}
    finals: dict[str, str] = {}
    total = 0
    for fqn, meta in md.state_dict_metadata.items():
        final = names.import_name(fqn)
        if final is None:
            result.skipped.append(fqn)
            continue
        if final in finals.values():
            raise ConversionError(f"{src}: two DCP keys map to {final!r}")
        finals[fqn] = final
        if isinstance(meta, TensorStorageMetadata):
            state[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
            total += state[fqn].numel() * state[fqn].element_size()
        else:
            state[fqn] = None  # an object; DCP hands it to load_bytes
    if not state:
        raise ConversionError(f"{src}: no DCP key selected")
    # Optimizers keyed the way get_optimizer_state_dict keys them are stored in
    # shardpoint's own scheme when their model entry is unambiguous.
    owners = {} if (prefix or rename or keys or exclude) else _optimizer_owners(md.state_dict_metadata, planner_paths)
    renamed: dict[str, str] = {}  # DCP name -> stored name
    for fqn in finals:
        top, _, rest = fqn.partition(".")
        if top in owners and rest.startswith("state.") and isinstance(md.state_dict_metadata[fqn], TensorStorageMetadata):
            renamed[fqn] = finals[fqn] = f"{top}.state.{owners[top]}.{rest[len('state.'):]}"
    leaves: list[tuple[tuple, Any]] = []
    written: set[str] = set()
    if "://" not in path:
        prepare_output_dir(path, force)
    bar = progress(total, "import dcp", quiet)

    with CheckpointWriter(path, block_size=block_size, layout={"source": "dcp"}) as w:

        class _ChunkPlanner(DefaultLoadPlanner):
            def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
                # Keep the meta placeholders: the default would allocate every tensor here.
                self.original_state_dict = self.state_dict = state_dict
                self.mappings = {}
                self.metadata = metadata
                self.is_coordinator = is_coordinator

            def resolve_tensor(self, read_item):
                meta = md.state_dict_metadata[read_item.dest_index.fqn]
                return torch.empty(tuple(read_item.lengths), dtype=meta.properties.dtype)

            def commit_tensor(self, read_item, tensor):
                fqn = read_item.dest_index.fqn
                meta = md.state_dict_metadata[fqn]
                info = md.storage_data.get(read_item.storage_index)
                found = _RANK_RE.match(os.path.basename(info.relative_path)) if info is not None else None
                t = cast(tensor, dtype)
                w.add(finals[fqn], t, shape=tuple(meta.size), rank=int(found.group(1)) if found else 0,
                      box=Box(tuple(int(o) for o in read_item.dest_offsets), tuple(int(n) for n in read_item.lengths)), placement="dcp")
                if finals[fqn] not in written:
                    written.add(finals[fqn])
                    leaves.append((new_path(fqn, fqn if fqn in renamed else finals[fqn]), torch.empty(0, device="meta")))
                result.bytes += t.numel() * t.element_size()
                bar.update(tensor.numel() * tensor.element_size())

            def load_bytes(self, read_item, value):
                fqn = read_item.dest_index.fqn
                obj = torch.load(value, weights_only=False)  # trusted by the caller
                if encodable(obj):
                    leaves.append((new_path(fqn, finals[fqn]), obj))
                else:
                    result.skipped.append(f"{fqn} ({type(obj).__qualname__})")

        ctx = _quiet_dcp()
        try:
            with bar, _dcp_errors(f"importing {src}"):
                dcp.load(state, storage_reader=reader, planner=_ChunkPlanner(flatten_state_dict=False, allow_partial_load=True), no_dist=True)
        finally:
            ctx.__exit__(None, None, None)
        for top, doc in encode_entries(leaves, written | set(renamed), src).items():
            kind = "values"
            if top in owners and is_dcp_optimizer_doc(doc):
                params = [f"{owners[top]}.{n}" for g in doc["param_groups"] for n in g["params"]]
                doc = dcp_to_native(rename_refs(doc, lambda f: renamed.get(f, f)), params, src)
                kind = "optimizer:dcp"
            w.set_value(top, doc, kind=kind)
        w.commit()
    result.tensors = len(written)
    return result


def _optimizer_owners(metadata: dict, paths: dict) -> dict[str, str]:
    """DCP optimizer entries and the model entry owning their parameters: ``{opt key: model key}``.

    An optimizer entry is one with ``<key>.param_groups.<i>.params`` objects;
    its owner is the one other entry holding a tensor ``<owner>.<param>`` for
    every parameter named in its groups' and state's paths. Entries with no
    owner or several keep the DCP names (``sp.load`` maps them at load time).
    """
    params: dict[str, set[str]] = {}
    for fqn, path in paths.items():
        if isinstance(path, tuple) and len(path) == 4 and path[1] == "state" and isinstance(path[2], str):
            params.setdefault(str(path[0]), set()).add(path[2])
        elif isinstance(path, tuple) and len(path) == 4 and path[1] == "param_groups" and path[3] == "params":
            params.setdefault(str(path[0]), set())
    tops = {f.partition(".")[0] for f in metadata}
    owners = {}
    for key, names in params.items():
        if not names:
            continue
        found = [m for m in sorted(tops) if m != key and all(f"{m}.{n}" in metadata for n in names)]
        if len(found) == 1:
            owners[key] = found[0]
    return owners
