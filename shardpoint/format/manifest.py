"""The manifest: the versioned, JSON-encoded description of one checkpoint.

The manifest is the commit record. Version 1 lists every saved chunk in it.
Version 2 (what :func:`shardpoint.save` writes) keeps it O(tensors + ranks):
a tensor records its *grid* (how it is split over a mesh of ranks, see
:mod:`shardpoint.grid`) or the ranks *holding* its chunks, and each rank's
chunk records live in that rank's binary index file
(:mod:`shardpoint.format.index`), whose digest the manifest records.
``TensorMeta.chunks`` of a parsed version-2 manifest is ``None`` until the
loader resolves the chunks it needs (:mod:`shardpoint.engine.indexes`).

``Manifest.from_json`` treats its input as untrusted: every name, size,
offset, box, mesh and rank is validated before any read is planned from it,
so a tampered manifest cannot point outside the checkpoint or make the loader
allocate absurd memory. See ``docs/format.md``.

Version 3 keeps version 2's layout and adds integrity of the metadata
itself: ``manifest.json`` ends with its own digest (``"digest"``, the
xxh3_128 of every byte before that member, see :func:`seal`), checked before
the JSON is parsed, and each index row's key binds the chunk to its tensor's
name *and* dtype (:func:`shardpoint.format.index.fqn_key`), so an edit that
renames or retypes one entry consistently finds no chunks. The JSON is parsed
strictly (:mod:`shardpoint.format.strict`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import xxhash

from ..errors import CorruptCheckpointError, FormatError
from ..geometry import Box
from ..grid import Grid
from .strict import Limits, strict_loads

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "RankFiles",
    "MANIFEST_NAME",
    "DTYPE_SIZES",
    "ChunkMeta",
    "TensorMeta",
    "Manifest",
    "check_file_name",
    "rank_runs",
    "MAX_ELEMENTS",
    "DIGEST_VERSION",
    "seal",
    "unseal",
]

FORMAT_NAME = "shardpoint"
FORMAT_VERSION = 3  # what save writes
READ_VERSIONS = (1, 2, 3)
# The first version whose manifest carries its own digest and whose index keys bind the dtype.
DIGEST_VERSION = 3
# The manifest's last member: ',"digest":"' + 32 hex digits + '"}' (45 bytes).
_SEAL_HEAD = b',"digest":"'
_SEAL_LEN = len(_SEAL_HEAD) + 32 + 2
_HEX32 = re.compile(rb"[0-9a-f]{32}")
MANIFEST_NAME = "manifest.json"
# Upper bound on any single logical tensor: 2**48 elements (256 TiB of bytes at fp8).
MAX_ELEMENTS = 1 << 48
MAX_NDIM = 16

DTYPE_SIZES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}){0,3}$")


def seal(body: bytes) -> bytes:
    """Append the digest member to a JSON object's text: the version-3 manifest bytes.

    ``body`` is a compact JSON object (``{...}``). The result replaces its
    closing brace with ``,"digest":"<xxh3_128 of everything before that
    comma>"}``, so the file stays one valid JSON object and the digest can be
    checked before parsing. Tools that edit a manifest on purpose re-seal it.

    Example::

        seal(b'{"a":1}')   # b'{"a":1,"digest":"..."}'
    """
    if not body.endswith(b"}") or len(body) < 3:
        raise ValueError("seal needs a non-empty JSON object")
    head = body[:-1]
    return head + _SEAL_HEAD + xxhash.xxh3_128_hexdigest(head).encode("ascii") + b'"}'


def unseal(data: bytes, where: str) -> bool:
    """Check the digest member of manifest bytes; return whether there was one.

    Raises :class:`CorruptCheckpointError` when the bytes end with a digest
    member that does not match what precedes it (damage, or an edit that did
    not re-seal). Returns False when there is none (versions 1 and 2).
    """
    if len(data) < _SEAL_LEN or not data.endswith(b'"}'):
        return False
    tail = data[-_SEAL_LEN:]
    if not tail.startswith(_SEAL_HEAD) or not _HEX32.fullmatch(tail[len(_SEAL_HEAD) : -2]):
        return False
    want = tail[len(_SEAL_HEAD) : -2].decode("ascii")
    if xxhash.xxh3_128_hexdigest(data[:-_SEAL_LEN]) != want:
        raise CorruptCheckpointError(
            f"{where}: manifest.json does not match its own digest: it was damaged or edited without "
            "re-sealing; restore it from a copy or load an earlier checkpoint"
        )
    return True


def check_file_name(name: str, where: str = "") -> str:
    """Reject file names that could escape the checkpoint (absolute, ``..``, odd characters)."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or any(p in (".", "..") for p in name.split("/")):
        prefix = f"{where}: " if where else ""
        raise FormatError(f"{prefix}unsafe or malformed data file name in manifest: {name!r}")
    return name


@dataclass(frozen=True)
class ChunkMeta:
    """One saved chunk of a logical tensor.

    ``box`` is where the chunk lies in the global tensor. ``flat``, when set,
    says the chunk holds only elements ``[flat[0], flat[1])`` of the box's
    row-major order (an FSDP1/ZeRO flat-parameter slice). The stored bytes are
    ``nbytes`` at ``offset`` in ``file``; ``checksums`` has one xxh3_64 digest
    per ``block_size`` bytes of them. ``rank`` is the writer, for information.
    """

    box: Box
    file: str
    offset: int
    nbytes: int
    checksums: tuple[str, ...]
    flat: tuple[int, int] | None = None
    rank: int = 0

    @property
    def numel(self) -> int:
        return self.box.numel if self.flat is None else self.flat[1] - self.flat[0]

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "offsets": list(self.box.offsets),
            "sizes": list(self.box.sizes),
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "checksums": list(self.checksums),
            "rank": self.rank,
        }
        if self.flat is not None:
            d["flat"] = list(self.flat)
        return d


@dataclass(frozen=True)
class TensorMeta:
    """A logical tensor: dtype name, global shape, and its saved chunks.

    Version 2 adds where the chunks are, without listing them: ``grid`` (the
    split over a mesh; rank ``grid.writer(coord, copy)`` wrote each shard) or
    ``holders`` (``[start, stop)`` runs of the ranks whose index files hold
    its chunks). ``chunks`` is then
    ``None`` until resolved, or the resolved subset a load needs.
    """

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...] | None
    grid: Grid | None = None
    copy: int = 0
    holders: tuple[tuple[int, int], ...] | None = None

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_json(self) -> dict:
        """The version-1 entry (chunks listed)."""
        if self.chunks is None:
            raise ValueError("chunks are not resolved; a version-1 entry needs them")
        return {"dtype": self.dtype, "shape": list(self.shape), "chunks": [c.to_json() for c in self.chunks]}


@dataclass(frozen=True)
class RankFiles:
    """Version 2: one rank's data file and index file, and the index's xxh3_128 digest."""

    data: str
    index: str
    digest: str


@dataclass(frozen=True)
class Manifest:
    """The whole checkpoint description. Frozen: derive variants with ``dataclasses.replace``.

    ``ranks`` (version 2) has one entry per saving rank: its files, or
    ``None`` for a rank that wrote nothing.
    """

    save_id: str
    world_size: int
    block_size: int
    tensors: Mapping[str, TensorMeta]
    values: Mapping[str, Any]
    files: Mapping[str, int]
    layout: Mapping[str, Any] = field(default_factory=dict)
    created: float = 0.0
    checksum_algorithm: str = "xxh3_64"
    format_version: int = 1
    ranks: tuple[RankFiles | None, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def resolved(self) -> bool:
        """Whether every tensor's chunks are listed (always, in version 1)."""
        return all(t.chunks is not None for t in self.tensors.values())

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "checksum_algorithm": self.checksum_algorithm,
            "block_size": self.block_size,
            "files": dict(sorted(self.files.items())),
        }
        if self.format_version == 1:
            doc["tensors"] = {k: v.to_json() for k, v in sorted(self.tensors.items())}
        else:
            doc["ranks"] = [None if r is None else [r.data, r.index, r.digest] for r in self.ranks]
            doc["meshes"], doc["tensors"] = _tensors_v2(self.tensors)
        doc["values"] = dict(self.values)
        doc["layout"] = dict(self.layout)
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
        return seal(body) if self.format_version >= DIGEST_VERSION else body

    @staticmethod
    def from_json(data: bytes, where: str = "<checkpoint>", limits: Limits | None = None) -> "Manifest":
        """Parse and validate untrusted manifest bytes; raise ``FormatError`` on anything off.

        The digest (version 3) is checked before parsing, and a mismatch
        raises :class:`CorruptCheckpointError`; the JSON is parsed strictly
        (:func:`shardpoint.format.strict.strict_loads`).
        """
        limits = limits or Limits.from_env()
        if len(data) > limits.manifest_bytes:
            raise FormatError(
                f"{where}: manifest.json is {len(data)} bytes, over the limit of {limits.manifest_bytes} "
                "(raise SHARDPOINT_MAX_MANIFEST_BYTES if the checkpoint is trusted)"
            )
        sealed = unseal(bytes(data), where)
        doc = strict_loads(data, where, limits, "manifest")
        try:
            m = _parse(doc, where)
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError) as e:
            raise FormatError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
        if m.format_version >= DIGEST_VERSION and not sealed:
            raise CorruptCheckpointError(
                f"{where}: manifest.json of format version {m.format_version} lacks its digest member; "
                "it was damaged or edited"
            )
        return m


def rank_runs(ranks) -> tuple[tuple[int, int], ...]:
    """Ranks as sorted ``[start, stop)`` runs: holders are usually contiguous.

    Example::

        >>> rank_runs([0, 1, 2, 5])
        ((0, 3), (5, 6))
    """
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return tuple((a, b) for a, b in out)


def _tensors_v2(tensors: Mapping[str, TensorMeta]) -> tuple[list, dict]:
    meshes: list[dict] = []
    mesh_ids: dict[tuple, int] = {}
    by_id: dict[tuple, tuple[int, tuple]] = {}  # (id(ranks), shape) -> (mesh index, ranks): hash each rank tuple once
    out: dict[str, dict] = {}
    for fqn, t in sorted(tensors.items()):
        e: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
        if t.grid is not None:
            hit = by_id.get((id(t.grid.ranks), t.grid.mesh_shape))
            if hit is None:
                key = (t.grid.mesh_shape, t.grid.ranks)
                i = mesh_ids.get(key)
                if i is None:
                    i = mesh_ids[key] = len(meshes)
                    meshes.append({"shape": list(t.grid.mesh_shape), "ranks": list(t.grid.ranks)})
                hit = by_id[(id(t.grid.ranks), t.grid.mesh_shape)] = (i, t.grid.ranks)
            i = hit[0]
            e["grid"] = {"mesh": i, "splits": [list(s) for s in t.grid.splits], "copy": t.copy}
        elif t.holders is not None:
            e["holders"] = [list(r) for r in t.holders]
        else:
            raise ValueError(f"tensor {fqn!r} has neither a grid nor holders")
        out[fqn] = e
    return meshes, out


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not (lo <= v <= hi):
        raise FormatError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _parse(doc: Any, where: str) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a shardpoint manifest")
    version = doc.get("format_version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise FormatError(
            f"{where}: format_version {version!r} is not supported by this shardpoint "
            f"(reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade shardpoint to read it"
        )
    algo = doc.get("checksum_algorithm")
    if algo != "xxh3_64":
        raise FormatError(f"{where}: unknown checksum algorithm {algo!r}")
    block = _int(doc["block_size"], f"{where}: block_size", 16, 1 << 40)
    if block % 16:
        raise FormatError(f"{where}: block_size {block} is not a multiple of 16")
    world = _int(doc["world_size"], f"{where}: world_size", 1, 1 << 24)
    files_doc = doc["files"]
    if not isinstance(files_doc, dict):
        raise FormatError(f"{where}: 'files' must be an object")
    files = {check_file_name(k, where): _int(v, f"{where}: size of {k}") for k, v in files_doc.items()}
    tdoc = doc["tensors"]
    if not isinstance(tdoc, dict):
        raise FormatError(f"{where}: 'tensors' must be an object")
    ranks: tuple[RankFiles | None, ...] = ()
    if version == 1:
        tensors = {fqn: _parse_tensor(fqn, t, files, block, world, where) for fqn, t in tdoc.items()}
    else:  # versions 2 and 3
        ranks = _parse_ranks(doc["ranks"], files, world, where)
        grids = _GridParser(doc["meshes"], world, where)
        tensors = {fqn: _parse_tensor_v2(fqn, t, grids, world, where) for fqn, t in tdoc.items()}
    values = doc.get("values", {})
    layout = doc.get("layout", {})
    if not isinstance(values, dict) or not isinstance(layout, dict):
        raise FormatError(f"{where}: 'values' and 'layout' must be objects")
    save_id = doc["save_id"]
    if not isinstance(save_id, str) or not re.fullmatch(r"[0-9a-f]{8,64}", save_id):
        raise FormatError(f"{where}: malformed save_id {save_id!r}")
    created = doc.get("created", 0.0)
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not 0 <= created < 1e13:
        raise FormatError(f"{where}: malformed 'created' (seconds since the epoch): {created!r}")
    stored = sum(files.values())
    for fqn, t in tensors.items():
        if t.nbytes > stored:
            raise FormatError(
                f"{where}: tensor {fqn!r} of shape {t.shape} and dtype {t.dtype} needs {t.nbytes} bytes, "
                f"more than the {stored} bytes of all the checkpoint's files"
            )
    return Manifest(
        save_id=save_id,
        world_size=world,
        block_size=block,
        tensors=tensors,
        values=values,
        files=files,
        layout=layout,
        created=float(created),
        checksum_algorithm=algo,
        format_version=version,
        ranks=ranks,
    )


_DIGEST_RE = re.compile(r"[0-9a-f]{32}")


def _parse_ranks(doc: Any, files: Mapping[str, int], world: int, where: str) -> tuple[RankFiles | None, ...]:
    if not isinstance(doc, list) or len(doc) != world:
        raise FormatError(f"{where}: 'ranks' must list one entry per rank ({world})")
    out: list[RankFiles | None] = []
    for r, e in enumerate(doc):
        if e is None:
            out.append(None)
            continue
        if not isinstance(e, list) or len(e) != 3:
            raise FormatError(f"{where}: rank {r}'s entry must be [data file, index file, digest]")
        data, index = check_file_name(e[0], where), check_file_name(e[1], where)
        for name in (data, index):
            if name not in files:
                raise FormatError(f"{where}: rank {r} names unlisted file {name!r}")
        if not isinstance(e[2], str) or not _DIGEST_RE.fullmatch(e[2]):
            raise FormatError(f"{where}: rank {r}'s index digest {e[2]!r} is malformed")
        out.append(RankFiles(data, index, e[2]))
    return tuple(out)


class _GridParser:
    """Meshes are validated once; tensors on the same mesh and splits share one ``Grid``."""

    def __init__(self, doc: Any, world: int, where: str):
        if not isinstance(doc, list) or len(doc) > world * 4 + 64:
            raise FormatError(f"{where}: 'meshes' must be a list of at most {world * 4 + 64} meshes")
        self.meshes = doc
        self.world, self.where = world, where
        self.total = 0
        self._grids: dict[tuple[int, tuple], Grid] = {}
        self._checked: set[int] = set()

    def grid(self, mesh: Any, splits: Any, ndim: int, what: str) -> Grid:
        i = _int(mesh, f"{what}: grid mesh", 0, len(self.meshes) - 1)
        if not isinstance(splits, list) or len(splits) != ndim:
            raise FormatError(f"{what}: grid splits must list one entry per dimension ({ndim})")
        if not all(isinstance(s, list) and len(s) <= MAX_NDIM for s in splits):
            raise FormatError(f"{what}: malformed grid splits {splits!r}")
        key = (i, tuple(tuple(s) for s in splits))
        g = self._grids.get(key)
        if g is None:
            m = self.meshes[i]
            if not isinstance(m, dict):
                raise FormatError(f"{what}: mesh {i} must be an object")
            if i not in self._checked:
                self.total += len(m.get("ranks", ())) if isinstance(m.get("ranks"), list) else 0
                if self.total > self.world * 64:  # bounds the work a tampered manifest can cause
                    raise FormatError(f"{self.where}: meshes list more than {self.world * 64} ranks in all")
                self._checked.add(i)
            g = self._grids[key] = Grid.from_json(
                {"shape": m.get("shape"), "ranks": m.get("ranks"), "splits": splits}, self.world, ndim, what
            )
        return g


def _parse_shape(t: Any, what: str) -> tuple[str, tuple[int, ...]]:
    if not isinstance(t, dict):
        raise FormatError(f"{what}: entry must be an object")
    dtype = t["dtype"]
    if dtype not in DTYPE_SIZES:
        raise FormatError(f"{what}: unknown dtype {dtype!r}")
    shape_doc = t["shape"]
    if not isinstance(shape_doc, list) or len(shape_doc) > MAX_NDIM:
        raise FormatError(f"{what}: shape must be a list of at most {MAX_NDIM} ints")
    shape = tuple(_int(s, f"{what}: shape") for s in shape_doc)
    if math.prod(shape) > MAX_ELEMENTS:
        raise FormatError(f"{what}: shape {shape} exceeds {MAX_ELEMENTS} elements")
    return dtype, shape


def _parse_tensor_v2(fqn: str, t: Any, grids: _GridParser, world: int, where: str) -> TensorMeta:
    what = f"{where}: tensor {fqn!r}"
    dtype, shape = _parse_shape(t, what)
    if "grid" in t:
        g = t["grid"]
        if not isinstance(g, dict):
            raise FormatError(f"{what}: 'grid' must be an object")
        grid = grids.grid(g["mesh"], g["splits"], len(shape), what)
        copy = _int(g.get("copy", 0), f"{what}: grid copy", 0, grid.copies - 1)
        return TensorMeta(dtype, shape, None, grid, copy)
    runs = t["holders"]
    if not isinstance(runs, list) or len(runs) > world:
        raise FormatError(f"{what}: 'holders' must be a list of at most {world} [start, stop) runs")
    holders: list[tuple[int, int]] = []
    last = 0
    for run in runs:
        if not isinstance(run, list) or len(run) != 2:
            raise FormatError(f"{what}: malformed holders run {run!r}")
        a = _int(run[0], f"{what}: holders start", last, world - 1)
        b = _int(run[1], f"{what}: holders stop", a + 1, world)
        holders.append((a, b))
        last = b
    return TensorMeta(dtype, shape, None, None, 0, tuple(holders))


def _parse_tensor(fqn: str, t: Any, files: Mapping[str, int], block: int, world: int, where: str) -> TensorMeta:
    what = f"{where}: tensor {fqn!r}"
    dtype, shape = _parse_shape(t, what)
    itemsize = DTYPE_SIZES[dtype]
    chunks = []
    for c in t["chunks"]:
        offs = tuple(_int(o, f"{what}: chunk offset") for o in c["offsets"])
        sizes = tuple(_int(s, f"{what}: chunk size") for s in c["sizes"])
        if len(offs) != len(shape) or len(sizes) != len(shape):
            raise FormatError(f"{what}: chunk rank differs from shape {shape}")
        box = Box(offs, sizes)
        if not box.within(shape):
            raise FormatError(f"{what}: chunk {offs}+{sizes} lies outside shape {shape}")
        flat = None
        if "flat" in c:
            f = c["flat"]
            if not isinstance(f, list) or len(f) != 2:
                raise FormatError(f"{what}: malformed flat range {f!r}")
            a, b = _int(f[0], f"{what}: flat start"), _int(f[1], f"{what}: flat stop")
            if not a <= b <= box.numel:
                raise FormatError(f"{what}: flat range [{a}, {b}) outside its box of {box.numel} elements")
            flat = (a, b)
        name = check_file_name(c["file"], what)
        if name not in files:
            raise FormatError(f"{what}: chunk refers to unlisted file {name!r}")
        offset = _int(c["offset"], f"{what}: chunk byte offset")
        nbytes = _int(c["nbytes"], f"{what}: chunk nbytes")
        numel = box.numel if flat is None else flat[1] - flat[0]
        if nbytes != numel * itemsize:
            raise FormatError(f"{what}: chunk nbytes {nbytes} != {numel} elements x {itemsize} bytes")
        if offset + nbytes > files[name]:
            raise FormatError(f"{what}: chunk bytes [{offset}, {offset + nbytes}) run past the end of {name}")
        sums = c["checksums"]
        nblocks = max(1, -(-nbytes // block))
        if not isinstance(sums, list) or len(sums) != nblocks:
            raise FormatError(f"{what}: expected {nblocks} block checksums, got {len(sums) if isinstance(sums, list) else sums!r}")
        for s in sums:
            if not isinstance(s, str) or not re.fullmatch(r"[0-9a-f]{16}", s):
                raise FormatError(f"{what}: malformed checksum {s!r}")
        rank = _int(c.get("rank", 0), f"{what}: writer rank", 0, world - 1)
        chunks.append(ChunkMeta(box, name, offset, nbytes, tuple(sums), flat, rank))
    return TensorMeta(dtype, shape, tuple(chunks))
