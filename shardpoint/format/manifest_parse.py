"""Reading a manifest document: validate every field of untrusted input, then build the records.

:meth:`shardpoint.format.manifest.Manifest.from_json` checks the digest and
parses the JSON strictly, then hands the document to :func:`manifest_fields`
and builds the :class:`~shardpoint.format.manifest.Manifest` from what it returns
(this module builds records, never the manifest class, so it does not import it).
Every name, size, offset, box, mesh and rank is checked here, before any read
is planned from it, so a tampered manifest cannot point outside the checkpoint
or make the loader allocate absurd memory. Errors are
:class:`~shardpoint.errors.FormatError` naming the checkpoint and the field.

Example::

    m = Manifest(**manifest_fields(strict_loads(data, where, limits, "manifest"), where))
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from ..errors import FormatError
from ..geometry import Box
from ..geometry.grid import Grid
from .blocks import block_count
from .refs import RefFiles, parse_refs
from .records import (
    DTYPE_SIZES,
    FORMAT_NAME,
    MAX_ELEMENTS,
    MAX_NDIM,
    READ_VERSIONS,
    ChunkMeta,
    RankFiles,
    TensorMeta,
    check_file_name,
)

__all__ = ["manifest_fields"]


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not (lo <= v <= hi):
        raise FormatError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def manifest_fields(doc: Any, where: str) -> dict[str, Any]:
    """Validate a parsed manifest document (any version this release reads): the fields of its :class:`Manifest`.

    Raises :class:`~shardpoint.errors.FormatError` naming what is off. Most
    callers want :meth:`Manifest.from_json`, which also checks the digest and
    bounds the JSON before calling this and builds the manifest from the fields.

    Example::

        m = Manifest(**manifest_fields(json.loads(data), "ckpt/step_100"))
    """
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
    refs: tuple[RefFiles, ...] = ()
    if version == 1:
        tensors = {fqn: _parse_tensor(fqn, t, files, block, world, where) for fqn, t in tdoc.items()}
    else:  # versions 2 to 4
        ranks = _parse_ranks(doc["ranks"], files, world, where)
        if version >= 4:
            refs = parse_refs(doc["refs"], files, world, where)
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
    stored = sum(files.values()) + sum(r.size for r in refs)
    for fqn, t in tensors.items():
        if t.nbytes > stored:
            raise FormatError(
                f"{where}: tensor {fqn!r} of shape {t.shape} and dtype {t.dtype} needs {t.nbytes} bytes, "
                f"more than the {stored} bytes of all the checkpoint's files"
            )
    return dict(
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
        refs=refs,
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
        nblocks = block_count(nbytes, block)
        if not isinstance(sums, list) or len(sums) != nblocks:
            raise FormatError(f"{what}: expected {nblocks} block checksums, got {len(sums) if isinstance(sums, list) else sums!r}")
        for s in sums:
            if not isinstance(s, str) or not re.fullmatch(r"[0-9a-f]{16}", s):
                raise FormatError(f"{what}: malformed checksum {s!r}")
        rank = _int(c.get("rank", 0), f"{what}: writer rank", 0, world - 1)
        chunks.append(ChunkMeta(box, name, offset, nbytes, tuple(sums), flat, rank))
    return TensorMeta(dtype, shape, tuple(chunks))
