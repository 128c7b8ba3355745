"""Shared pieces of the converters: a streaming reader, a single-process writer, name maps.

:class:`CheckpointReader` reads one tensor (or one box of it) at a time from a
committed checkpoint, with the manifest parsed once; it runs the same read
engine as :func:`shardpoint.read_tensor`, so every byte read is verified.

:class:`CheckpointWriter` builds a shardpoint checkpoint from a stream of
tensors without a process group. Each "writer rank" gets one data file,
``data/<save_id>-r<rank>.bin``, laid out by
:class:`shardpoint.format.datafile.DataFileWriter` like every data file
(64-byte aligned chunks, xxh3_64 block checksums); :meth:`CheckpointWriter.commit`
writes ``manifest.json`` last and atomically, like :func:`shardpoint.save`.
Any chunking is allowed as long as the chunks of a tensor cover it exactly, so
the same writer serves imports (one chunk per tensor, or the source's own
chunks) and offline resharding (one chunk per target rank).

The option parsers and name maps the converters share live in
:mod:`shardpoint.convert.options` and are importable from here too.

Example::

    with CheckpointWriter("ckpt/imported") as w:
        w.add("model.weight", torch.randn(4, 4))
        w.set_value("model", {})
        w.commit()
"""

from __future__ import annotations

import fnmatch
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from ..engine.claim import CommitPolicy, SaveClaim
from ..engine.commit import commit_manifest
from ..engine.io import tensor_bytes
from ..engine.load import ReadTuning, execute_reads
from ..engine.references import open_references
from ..errors import ConversionError, KeyMismatchError, ShapeMismatchError, UnsupportedStateError
from ..format.datafile import DEFAULT_BLOCK_SIZE, DataFileWriter
from ..format.index import encode_index, fqn_key, index_digest
from ..format.manifest import DTYPE_SIZES, FORMAT_VERSION, ChunkMeta, Manifest, RankFiles, TensorMeta, rank_runs
from ..geometry import Box
from ..items import LoadTarget, dtype_name, torch_dtype
from ..storage import Storage, storage_for
from .options import NameMap, cast, parse_dtype, parse_rename, parse_size, prepare_output_dir, progress, top_key

__all__ = [
    "ConversionError",
    "CheckpointReader",
    "CheckpointWriter",
    "NameMap",
    "parse_dtype",
    "parse_size",
    "parse_rename",
    "progress",
    "prepare_output_dir",
    "cast",
    "top_key",
    "walk",
    "build",
    "path_name",
    "encodable",
    "encode_entries",
]


# ------------------------------------------------------------------ reading
class CheckpointReader:
    """Read tensors of a committed checkpoint one at a time, with the manifest parsed once.

    Example::

        r = CheckpointReader("ckpt/step_100")
        for name in r.names():
            t = r.read(name)          # the whole logical tensor, checksums verified
        rows = r.read("model.tok.weight", Box((0, 0), (10, 32)))
    """

    def __init__(self, path: str | Storage, verify: bool = True):
        from ..api import read_manifest

        self.storage = storage_for(path)
        self.manifest: Manifest = read_manifest(self.storage)
        self.where = self.storage.url
        self.storage = open_references(self.storage, self.manifest, self.where)  # an incremental checkpoint's bases
        self.verify = verify

    def names(self, patterns: Sequence[str] = ()) -> list[str]:
        """Tensor names, sorted, optionally filtered by glob patterns."""
        names = sorted(self.manifest.tensors)
        if patterns:
            names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        return names

    def meta(self, name: str) -> TensorMeta:
        meta = self.manifest.tensors.get(name)
        if meta is None:
            raise KeyMismatchError(f"{self.where}: no tensor {name!r} in the checkpoint", [name], [])
        return meta

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """The tensor ``name`` (or the part of it inside ``box``), as a fresh CPU tensor."""
        meta = self.meta(name)
        box = box or Box.full(meta.shape)
        dest = torch.empty(box.sizes, dtype=torch_dtype(meta.dtype))
        if box.numel:
            execute_reads(self.storage, self.manifest, [LoadTarget(name, dest, tuple(meta.shape), box)], self.where, self.verify, tuning=ReadTuning(threads=1))
        return dest

    def row_blocks(self, name: str, max_bytes: int = 64 << 20) -> Iterable[tuple[Box, torch.Tensor]]:
        """The tensor in pieces of whole dim-0 rows, each at most about ``max_bytes``."""
        meta = self.meta(name)
        if not meta.shape or meta.shape[0] <= 1:
            yield Box.full(meta.shape), self.read(name)
            return
        row = max(1, meta.nbytes // meta.shape[0])
        step = max(1, max_bytes // row)
        for lo in range(0, meta.shape[0], step):
            n = min(step, meta.shape[0] - lo)
            box = Box((lo,) + (0,) * (len(meta.shape) - 1), (n,) + tuple(meta.shape[1:]))
            yield box, self.read(name, box)


# ------------------------------------------------------------------ writing
@dataclass
class _File:
    name: str
    writer: Any
    packing: DataFileWriter  # where each chunk lands in the data file

    @property
    def pos(self) -> int:
        return self.packing.pos


@dataclass
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkMeta] = field(default_factory=list)


class CheckpointWriter:
    """Write a shardpoint checkpoint from a stream of tensors, in one process.

    ``add(name, tensor)`` stores a whole tensor; ``add(name, piece, shape=...,
    box=..., rank=r)`` stores one chunk of a larger tensor in writer ``r``'s
    data file. ``set_value(key, doc)`` sets the (already encoded) value
    document of a top-level entry; ``set_entry(key, kind)`` records the entry's
    save-time framework (``"module"``, ``"values"``, ...). ``commit()`` checks
    that every tensor is covered exactly once, writes the manifest atomically
    and removes data files that no committed manifest lists (after
    ``policy.cleanup_grace_s``). The path is claimed from construction until
    ``commit()`` or ``abort()``, as :func:`shardpoint.save` claims it: a
    writer to a path another save is writing raises
    :class:`~shardpoint.errors.ConcurrentSaveError`. As a context manager,
    an exception aborts every open data file and commits nothing.
    """

    def __init__(self, path: str | Storage, *, block_size: int = DEFAULT_BLOCK_SIZE, world_size: int = 1, layout: dict | None = None,
                 policy: CommitPolicy | None = None):
        if block_size < 16 or block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
        self.storage = storage_for(path)
        self.where = self.storage.url
        self.policy = policy or CommitPolicy()
        self._claim = SaveClaim.acquire(self.storage.primary, self.policy, self.where)
        self.block_size = block_size
        self.world_size = world_size
        self.save_id = uuid.uuid4().hex
        self.values: dict[str, Any] = {}
        self.entries: dict[str, str] = {}
        self.placements: dict[str, str] = {}
        self.extra_layout = dict(layout or {})
        self.bytes_written = 0
        self._files: dict[int, _File] = {}
        self._tensors: dict[str, _Tensor] = {}
        self._done = False

    def _file(self, rank: int) -> _File:
        f = self._files.get(rank)
        if f is None:
            name = f"data/{self.save_id}-r{rank:05d}.bin"
            writer = self.storage.open_writer(name)
            f = self._files[rank] = _File(name, writer, DataFileWriter(writer, name, self.block_size, rank))
        return f

    def add(self, fqn: str, data: torch.Tensor, *, shape: Sequence[int] | None = None, box: Box | None = None, rank: int = 0, placement: str = "local") -> None:
        """Store ``data`` as the chunk ``box`` (default: all) of the tensor ``fqn`` of global ``shape``."""
        if self._done:
            raise ConversionError(f"{self.where}: writer already committed")
        if not isinstance(fqn, str) or not fqn:
            raise ConversionError(f"tensor names must be non-empty strings, got {fqn!r}")
        data = data.detach()
        dt = dtype_name(data.dtype)
        if dt not in DTYPE_SIZES:
            raise UnsupportedStateError(
                f"{self.where}: tensor {fqn!r} has dtype {data.dtype}, which shardpoint cannot store "
                f"(supported: {', '.join(sorted(DTYPE_SIZES))}); pass --dtype to cast it"
            )
        shape = tuple(int(s) for s in (shape if shape is not None else data.shape))
        box = box or Box.full(shape)
        if not box.within(shape) or data.numel() != box.numel:
            raise ShapeMismatchError(f"{fqn}: chunk {box} of {data.numel()} elements does not fit shape {shape}")
        t = self._tensors.setdefault(fqn, _Tensor(dt, shape))
        if (t.dtype, t.shape) != (dt, shape):
            raise ShapeMismatchError(f"{fqn}: chunks disagree: {t.dtype}{list(t.shape)} vs {dt}{list(shape)}")
        if rank < 0:
            raise ConversionError(f"writer rank must be >= 0, got {rank}")
        f = self._file(rank)
        mv = tensor_bytes(data)
        t.chunks.append(f.packing.add(mv, box))
        self.bytes_written += len(mv)
        self.placements.setdefault(fqn, placement)

    def set_value(self, key: str, doc: Any, kind: str = "values") -> None:
        """The encoded value document of the top-level entry ``key`` (see :mod:`shardpoint.format.values`)."""
        if not key or "." in key:
            raise ConversionError(f"top-level keys must be non-empty and without '.', got {key!r}")
        self.values[key] = doc
        self.entries.setdefault(key, kind)

    def commit(self) -> Manifest:
        """Make the data durable, check coverage, and write ``manifest.json`` last."""
        for f in self._files.values():
            f.writer.close()
        files = {f.name: f.pos for f in self._files.values()}
        tensors = {}
        keys: dict[int, str] = {}
        per_rank: dict[int, list[tuple[str, ChunkMeta]]] = {}
        for fqn, t in self._tensors.items():
            covered = sum(c.numel for c in t.chunks)
            if covered != math.prod(t.shape):
                raise ConversionError(f"{self.where}: chunks of {fqn!r} cover {covered} of {math.prod(t.shape)} elements")
            other = keys.setdefault(fqn_key(fqn, t.dtype), fqn)
            if other != fqn:
                raise ConversionError(f"{self.where}: tensor names {other!r} and {fqn!r} share a 64-bit key; rename one")
            cs = sorted(t.chunks, key=lambda c: c.box.offsets)
            for c in cs:
                per_rank.setdefault(c.rank, []).append((fqn, c))
            # Format version 3: chunk records live in the writers' index files; the manifest names the holders.
            tensors[fqn] = TensorMeta(t.dtype, t.shape, tuple(cs), holders=rank_runs(c.rank for c in cs))
        world = max([self.world_size] + [r + 1 for r in self._files])
        ranks: list[RankFiles | None] = [None] * world
        for r, f in sorted(self._files.items()):
            recs = per_rank.get(r, [])
            blob = encode_index(recs, {fqn: self._tensors[fqn].dtype for fqn, _ in recs})
            index = f.name[: -len(".bin")] + ".idx"
            with self.storage.open_writer(index) as w:
                w.write(blob)
            files[index] = len(blob)
            ranks[r] = RankFiles(f.name, index, index_digest(blob))
        defaults: dict[str, Any] = {}
        for fqn in sorted(tensors):
            top, _, rest = fqn.partition(".")
            if top in self.values:
                continue
            # Entries without a document get references to their tensors: they load into a
            # module ({"model": model}) as well as into a plain dict or tensor.
            if not rest:
                defaults[top] = {"__sp__": "tensor", "key": fqn}
                self.entries.setdefault(top, "values")
            elif isinstance(defaults.setdefault(top, {}), dict) and "__sp__" not in defaults[top]:
                defaults[top][rest] = {"__sp__": "tensor", "key": fqn}
                self.entries.setdefault(top, "module")
        self.values.update(defaults)
        manifest = Manifest(
            save_id=self.save_id,
            world_size=world,
            block_size=self.block_size,
            tensors=tensors,
            values=self.values,
            files=files,
            layout={"world_size": world, "entries": self.entries, "placements": self.placements, **self.extra_layout},
            created=time.time(),
            format_version=FORMAT_VERSION,
            ranks=tuple(ranks),
        )
        data = manifest.to_json()  # sealed with its digest
        Manifest.from_json(data, self.where)  # the reader's validation, before the commit
        commit_manifest(self.storage, data, files, self._claim, self.policy.cleanup_grace_s, self.where)  # as save() commits
        self._done = True
        self._claim.release()
        return manifest

    def abort(self) -> None:
        """Discard every data file written so far and give up the path's claim."""
        for f in self._files.values():
            f.writer.abort()
        self._files.clear()
        self._claim.release()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is not None and not self._done:
            self.abort()
        self._claim.release()


# ------------------------------------------------------------------ trees of values
# A path is a tuple of (kind, key) steps: ("d", key) into a dict, ("l", index) into a list.
Path = tuple


def path_name(path: Path) -> str:
    """The dotted name of a path, as :func:`shardpoint.format.values.encode_value` and DCP spell it."""
    return ".".join(str(k) for _, k in path)


def walk(obj: Any, path: Path = ()) -> Iterable[tuple[Path, Any]]:
    """Every leaf of nested dicts, lists and tuples, with its path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk(v, path + (("d", k),))
    elif isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        for i, v in enumerate(obj):
            yield from walk(v, path + (("l", i),))
    else:
        yield path, obj


def build(pairs: Iterable[tuple[Path, Any]]) -> dict:
    """The nested dict/list tree whose leaves are ``pairs`` (the inverse of :func:`walk`)."""
    root: dict = {}
    for path, leaf in pairs:
        node: Any = root
        for i, (kind, key) in enumerate(path):
            last = i == len(path) - 1
            if isinstance(node, list):
                while len(node) <= key:
                    node.append(None)
            if last:
                node[key] = leaf
            elif (node[key] is None) if isinstance(node, list) else (key not in node):
                node[key] = {} if path[i + 1][0] == "d" else []
            node = node[key]
    return root


def encodable(value: Any) -> bool:
    """Whether a non-tensor leaf can be stored in the manifest without pickle."""
    from ..format.values import encode_value

    def no_tensor(fqn, t):
        raise UnsupportedStateError("tensor")

    try:
        encode_value(value, "x", no_tensor, allow_pickle=False)
        return True
    except (UnsupportedStateError, TypeError, ValueError):
        return False


def encode_entries(pairs: Sequence[tuple[Path, Any]], written: set[str], where: str) -> dict[str, Any]:
    """Encode a tree of leaves (tensors already written under their path names) into value docs per top key.

    Returns ``{top key: document}``. A tensor leaf becomes a reference to the
    tensor of the same dotted name, which must be in ``written``.
    """
    from ..format.values import encode_value

    tree = build(pairs)
    docs = {}
    refs: list[str] = []
    for top, sub in tree.items():
        if not isinstance(top, str) or not top or "." in top:
            raise ConversionError(f"{where}: top-level key {top!r} cannot be a state key (needs a non-empty name without '.'); pass --prefix model.")
        docs[top] = encode_value(sub, top, lambda fqn, t: refs.append(fqn), allow_pickle=False)
    stray = sorted(set(refs) - written)
    if stray:  # pragma: no cover - the writer and the encoder spell names the same way
        raise ConversionError(f"{where}: internal naming error: value refs {stray[:5]} name no written tensor")
    return docs
