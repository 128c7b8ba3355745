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
:mod:`shardpoint.adapters.dcp_names`), so ``dcp.load`` fills the dicts of
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

from ..adapters.dcp_names import dcp_to_native, is_dcp_optimizer_doc, is_native_optimizer_doc, native_to_dcp, rename_refs
from ..errors import CheckpointError, ConversionError
from ..format.datafile import DEFAULT_BLOCK_SIZE
from ..format.values import decode_value
from ..geometry import Box
from ..items import torch_dtype
from ..runtime.torchcompat import dcp_load_local, dcp_save_local
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
    from torch.distributed.checkpoint import FileSystemWriter

    reader = CheckpointReader(path, verify=verify)
    names = NameMap(prefix, parse_rename(rename), tuple(keys), tuple(exclude))
    result = DCPExportResult(out)
    tree = _ExportTree(reader, dtype)
    if values and not prefix and not rename and not keys and not exclude:
        tree.add_values()
    tree.add_tensors(names, result)
    if not tree.source:
        raise ConversionError(f"{reader.where}: no tensor selected for export")
    bar = progress(tree.total, "export dcp", quiet)
    planner = _streaming_planner(tree, bar, result)
    prepare_output_dir(out, force)
    ctx = _quiet_dcp()
    try:
        with bar, _dcp_errors(f"exporting {path} to {out}"):
            dcp_save_local(tree.state, FileSystemWriter(out, thread_count=1), planner)
    finally:
        ctx.__exit__(None, None, None)
    return result


class _ExportTree:
    """The state an export hands DCP: placeholders on ``meta``, each remembering the tensor it stands for."""

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype | None) -> None:
        self.reader, self.dtype = reader, dtype
        self.state: dict[str, Any] = {}
        self.source: dict[int, str] = {}  # id(placeholder) -> checkpoint tensor name
        self.in_trees: set[str] = set()  # tensors that a value document already places
        self.total = 0

    def placeholder(self, fqn: str) -> torch.Tensor:
        """A ``meta`` tensor shaped like ``fqn`` (in the export dtype), counted in the total."""
        meta = self.reader.meta(fqn)
        dt = torch_dtype(meta.dtype)
        if self.dtype is not None and dt.is_floating_point:
            dt = self.dtype
        t = torch.empty(meta.shape, dtype=dt, device="meta")
        self.source[id(t)] = fqn
        self.total += t.numel() * t.element_size()
        return t

    def in_tree(self, fqn: str) -> torch.Tensor:
        self.in_trees.add(fqn)
        return self.placeholder(fqn)

    def add_values(self) -> None:
        """Every entry's value document becomes DCP objects; its tensor references the tensors themselves.

        That covers optimizer hyper-parameters, step counters and a module's extra state.
        """
        m, where = self.reader.manifest, self.reader.where
        entries = m.layout.get("entries", {}) if isinstance(m.layout, dict) else {}
        for key, doc in m.values.items():
            if str(entries.get(key, "")).startswith("optimizer") and is_native_optimizer_doc(doc):
                # The layout of get_optimizer_state_dict: state by the model's parameter names.
                doc = native_to_dcp(doc, where)
            tree = decode_value(doc, self.in_tree, False, where)
            if tree is not None and tree != {}:
                self.state[key] = tree

    def add_tensors(self, names: NameMap, result: DCPExportResult) -> None:
        """Every selected tensor no value document placed, under its exported name."""
        where, state = self.reader.where, self.state
        seen: dict[str, str] = {}
        for fqn in self.reader.names():
            if fqn in self.in_trees:
                continue
            out_name = names.export_name(fqn)
            if out_name is None:
                result.skipped.append(fqn)
                continue
            if out_name in seen:
                raise ConversionError(f"{where}: tensors {seen[out_name]!r} and {fqn!r} both map to {out_name!r}")
            seen[out_name] = fqn
            top, _, rest = out_name.partition(".")
            if rest:
                node = state.setdefault(top, {})
                if not isinstance(node, dict) or rest in node:
                    raise ConversionError(f"{where}: tensor {out_name!r} collides with a value of entry {top!r}")
                node[rest] = self.placeholder(fqn)
            else:
                state[top] = self.placeholder(fqn)


def _streaming_planner(tree: _ExportTree, bar, result: DCPExportResult):
    """A DCP save planner that reads each placeholder's tensor only when DCP writes it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _StreamingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            obj = self.lookup_object(write_item.index)
            fqn = tree.source.get(id(obj)) if isinstance(obj, torch.Tensor) else None
            if fqn is None:
                return super().resolve_data(write_item)
            t = cast(tree.reader.read(fqn), obj.dtype)
            bar.update(t.numel() * t.element_size())
            result.tensors += 1
            result.bytes += t.numel() * t.element_size()
            return t

    return _StreamingPlanner()


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
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(src) or not os.path.exists(os.path.join(src, ".metadata")):
        raise ConversionError(f"{src} is not a DCP folder (no .metadata file)")
    top_key(prefix)  # validates the prefix
    names = NameMap(prefix, parse_rename(rename), tuple(keys), tuple(exclude))
    reader = FileSystemReader(src)
    imp = _DcpImport(src, reader.read_metadata(), ImportResult(path), dtype)
    state = imp.select(names)
    # Optimizers keyed the way get_optimizer_state_dict keys them are stored in
    # shardpoint's own scheme when their model entry is unambiguous.
    imp.rename_optimizer_state(selecting=bool(prefix or rename or keys or exclude))
    if "://" not in path:
        prepare_output_dir(path, force)
    imp.bar = progress(imp.total, "import dcp", quiet)
    with CheckpointWriter(path, block_size=block_size, layout={"source": "dcp"}) as w:
        imp.writer = w
        ctx = _quiet_dcp()
        try:
            with imp.bar, _dcp_errors(f"importing {src}"):
                dcp_load_local(state, reader, _chunk_planner(imp))
        finally:
            ctx.__exit__(None, None, None)
        imp.write_values()
        w.commit()
    imp.result.tensors = len(imp.written)
    return imp.result


class _DcpImport:
    """One import of a DCP folder: the names chosen for each DCP key, and what DCP has handed over so far."""

    def __init__(self, src: str, md: Any, result: ImportResult, dtype: torch.dtype | None) -> None:
        self.src, self.md, self.result, self.dtype = src, md, result, dtype
        self.planner_paths = getattr(md, "planner_data", None) or {}
        self.finals: dict[str, str] = {}  # DCP name -> stored name
        self.renamed: dict[str, str] = {}  # DCP name -> stored name, for optimizer state moved to shardpoint's scheme
        self.owners: dict[str, str] = {}
        self.leaves: list[tuple[tuple, Any]] = []
        self.written: set[str] = set()
        self.total = 0
        self.bar: Any = None
        self.writer: Any = None

    def new_path(self, fqn: str, final: str) -> tuple:
        """Where the value of ``fqn`` (stored as ``final``) sits in its entry's document."""
        p = self.planner_paths.get(fqn)
        if final == fqn and isinstance(p, tuple) and p and isinstance(p[0], str) and "." not in p[0] \
                and all(isinstance(k, (str, int)) for k in p) and ".".join(map(str, p)) == fqn:
            return tuple(("l" if isinstance(k, int) else "d", k) for k in p)
        top, _, rest = final.partition(".")
        return (("d", top), ("d", rest)) if rest else (("d", top),)

    def select(self, names: NameMap) -> dict[str, Any]:
        """The state DCP loads into: a ``meta`` placeholder per selected tensor, ``None`` per object."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        state: dict[str, Any] = {}
        for fqn, meta in self.md.state_dict_metadata.items():
            final = names.import_name(fqn)
            if final is None:
                self.result.skipped.append(fqn)
                continue
            if final in self.finals.values():
                raise ConversionError(f"{self.src}: two DCP keys map to {final!r}")
            self.finals[fqn] = final
            if isinstance(meta, TensorStorageMetadata):
                state[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
                self.total += state[fqn].numel() * state[fqn].element_size()
            else:
                state[fqn] = None  # an object; DCP hands it to load_bytes
        if not state:
            raise ConversionError(f"{self.src}: no DCP key selected")
        return state

    def rename_optimizer_state(self, selecting: bool) -> None:
        """Optimizer state keyed by the owning model's names moves to ``<key>.state.<owner>.<param>...``."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = self.md.state_dict_metadata
        self.owners = {} if selecting else _optimizer_owners(metadata, self.planner_paths)
        for fqn in self.finals:
            top, _, rest = fqn.partition(".")
            if top in self.owners and rest.startswith("state.") and isinstance(metadata[fqn], TensorStorageMetadata):
                self.renamed[fqn] = self.finals[fqn] = f"{top}.state.{self.owners[top]}.{rest[len('state.'):]}"

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        """One DCP chunk becomes one shardpoint chunk, written by the rank whose file held it."""
        fqn = read_item.dest_index.fqn
        meta = self.md.state_dict_metadata[fqn]
        info = self.md.storage_data.get(read_item.storage_index)
        found = _RANK_RE.match(os.path.basename(info.relative_path)) if info is not None else None
        t = cast(tensor, self.dtype)
        final = self.finals[fqn]
        self.writer.add(final, t, shape=tuple(meta.size), rank=int(found.group(1)) if found else 0,
                        box=Box(tuple(int(o) for o in read_item.dest_offsets), tuple(int(n) for n in read_item.lengths)), placement="dcp")
        if final not in self.written:
            self.written.add(final)
            self.leaves.append((self.new_path(fqn, fqn if fqn in self.renamed else final), torch.empty(0, device="meta")))
        self.result.bytes += t.numel() * t.element_size()
        self.bar.update(tensor.numel() * tensor.element_size())

    def load_bytes(self, read_item: Any, value: Any) -> None:
        """A DCP object becomes a value when the manifest can store it; otherwise it is listed as skipped."""
        fqn = read_item.dest_index.fqn
        obj = torch.load(value, weights_only=False)  # trusted by the caller
        if encodable(obj):
            self.leaves.append((self.new_path(fqn, self.finals[fqn]), obj))
        else:
            self.result.skipped.append(f"{fqn} ({type(obj).__qualname__})")

    def write_values(self) -> None:
        """Each entry's value document; an owned optimizer's in shardpoint's own naming."""
        renamed, owners = self.renamed, self.owners
        for top, doc in encode_entries(self.leaves, self.written | set(renamed), self.src).items():
            kind = "values"
            if top in owners and is_dcp_optimizer_doc(doc):
                params = [f"{owners[top]}.{n}" for g in doc["param_groups"] for n in g["params"]]
                doc = dcp_to_native(rename_refs(doc, lambda f: renamed.get(f, f)), params, self.src)
                kind = "optimizer:dcp"
            self.writer.set_value(top, doc, kind=kind)


def _chunk_planner(imp: _DcpImport):
    """A DCP load planner that hands each chunk to ``imp`` instead of allocating whole tensors."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _ChunkPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # Keep the meta placeholders: the default would allocate every tensor here.
            self.original_state_dict = self.state_dict = state_dict
            self.mappings = {}
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def resolve_tensor(self, read_item):
            meta = imp.md.state_dict_metadata[read_item.dest_index.fqn]
            return torch.empty(tuple(read_item.lengths), dtype=meta.properties.dtype)

        def commit_tensor(self, read_item, tensor):
            imp.commit_tensor(read_item, tensor)

        def load_bytes(self, read_item, value):
            imp.load_bytes(read_item, value)

    return _ChunkPlanner(flatten_state_dict=False, allow_partial_load=True)


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
