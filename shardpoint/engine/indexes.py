"""Resolve a version-2 manifest's chunks from the ranks' index files.

A version-2 manifest says *where* each tensor's chunks are (a grid, or the
ranks holding them), not what they are. Before planning reads, a loader asks
for the chunks overlapping the boxes it needs: for a grid tensor the
overlapping shards and their writers come from integer arithmetic, and only
those writers' index files are read (each once, its size and digest checked
against the manifest before it is parsed). A same-layout load therefore reads
one or a few small index files per rank, at any world size.

Example::

    manifest = resolve(storage, manifest, {"model.w": [Box((0, 0), (4, 8))]}, storage.url)
    manifest.tensors["model.w"].chunks   # only the chunks overlapping that box
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

from ..errors import CorruptCheckpointError
from ..format.index import ChunkIndex, index_digest
from ..format.manifest import ChunkMeta, Manifest, TensorMeta
from ..format.strict import Limits
from ..geometry import Box
from ..storage.base import Storage

__all__ = ["IndexReader", "resolve", "resolve_all", "wanted_box"]


class IndexReader:
    """Reads and caches the index files of one manifest's ranks, checked against their digests."""

    def __init__(self, storage: Storage, manifest: Manifest, where: str):
        self.storage, self.manifest, self.where = storage, manifest, where
        self._cache: dict[int, ChunkIndex] = {}
        self._grid_cache: dict[tuple, list] = {}
        self.bytes_read = 0
        self._refs: dict[int, list[ChunkIndex]] = {}
        self._by_rank: dict[int, list] = {}
        for ref in manifest.refs:
            self._by_rank.setdefault(ref.rank, []).append(ref)

    def index(self, rank: int) -> ChunkIndex | None:
        """Rank ``rank``'s parsed index, or ``None`` when that rank wrote nothing."""
        got = self._cache.get(rank)
        if got is not None:
            return got
        entry = self.manifest.ranks[rank]
        if entry is None:
            return None
        got = self._parse(rank, entry.data, self.manifest.files[entry.data], entry.index, entry.digest)
        self._cache[rank] = got
        return got

    def indexes(self, rank: int) -> list[ChunkIndex]:
        """Every index of rank ``rank``: its own data file's, then those of the data files it references."""
        own = self.index(rank)
        refs = self._refs.get(rank)
        if refs is None:
            refs = self._refs[rank] = [
                self._parse(rank, ref.name, ref.size, ref.index, ref.digest) for ref in self._by_rank.get(rank, ())
            ]
        return ([own] if own is not None else []) + refs

    def _parse(self, rank: int, data_name: str, data_size: int, index_name: str, digest: str) -> ChunkIndex:
        """One index file, checked against its size and digest in the manifest, then parsed."""
        size = self.manifest.files[index_name]
        limit = Limits.from_env().index_bytes
        if size > limit:
            raise CorruptCheckpointError(
                f"{self.where}: the manifest says index file {index_name} of rank {rank} is {size} bytes, "
                f"over the limit of {limit} (SHARDPOINT_MAX_INDEX_BYTES)"
            )
        try:
            data = self.storage.get_limited(index_name, limit)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{self.where}: index file {index_name} of rank {rank} is missing; the checkpoint is damaged"
            ) from None
        self.bytes_read += len(data)
        if len(data) != size or index_digest(data) != digest:
            raise CorruptCheckpointError(
                f"{self.where}: index file {index_name} of rank {rank} does not match the manifest "
                f"({len(data)} bytes, expected {size}, or its digest differs); the checkpoint is corrupt"
            )
        got = ChunkIndex.parse(
            data, file=data_name, file_size=data_size, rank=rank,
            block=self.manifest.block_size, where=f"{self.where}: {index_name}",
        )
        if (got.version >= 3) != (self.manifest.format_version >= 3):
            raise CorruptCheckpointError(
                f"{self.where}: index file {index_name} of rank {rank} has index version {got.version}, "
                f"which a format-version-{self.manifest.format_version} manifest cannot name; the checkpoint is corrupt"
            )
        return got

    def chunks(self, fqn: str, boxes: Iterable[Box] | None = None) -> tuple[ChunkMeta, ...]:
        """The chunks of ``fqn`` overlapping any of ``boxes`` (all of them when ``None``)."""
        meta = self.manifest.tensors[fqn]
        what = f"{self.where}: tensor {fqn!r}"
        if meta.grid is None:
            out: list[ChunkMeta] = []
            for a, b in meta.holders or ():
                for r in range(a, b):
                    for idx in self.indexes(r):
                        out.extend(idx.chunks(fqn, meta.shape, meta.itemsize, what, meta.dtype))
            if boxes is not None:
                wanted = list(boxes)
                out = [c for c in out if any(_touches(c.box, w) for w in wanted)]
            return tuple(out)
        grid = meta.grid
        found: dict[tuple, ChunkMeta] = {}
        for box in [Box.full(meta.shape)] if boxes is None else boxes:
            for coord, rank, shard in self._shards(grid, tuple(meta.shape), meta.copy, box):
                if coord not in found:
                    found[coord] = self._shard_chunk(fqn, meta, rank, shard, what)
        return tuple(found[k] for k in sorted(found))

    def _shards(self, grid, shape: tuple, copy: int, box: Box) -> list[tuple[tuple, int, Box]]:
        """``(coord, writer rank, shard)`` of every shard of ``grid`` touching ``box``, memoised.

        Tensors of one shape on one grid (every layer's weights, and each of
        their optimizer states) ask the same question; the manifest shares
        one ``Grid`` object per distinct grid, so its id names it.
        """
        key = (id(grid), shape, copy, box)
        hit = self._grid_cache.get(key)
        if hit is None:
            hit = self._grid_cache[key] = [(c, grid.writer(c, copy), s) for c, s in grid.shards(shape, box)]
        return hit

    def _shard_chunk(self, fqn: str, meta: TensorMeta, rank: int, shard: Box, what: str) -> ChunkMeta:
        for idx in self.indexes(rank):
            for c in idx.chunks(fqn, meta.shape, meta.itemsize, what, meta.dtype):
                if c.flat is None and (c.box == shard or (c.box.numel == 0 and shard.numel == 0)):
                    return c
        raise CorruptCheckpointError(
            f"{what}: rank {rank}'s index has no chunk at offsets {list(shard.offsets)} sizes "
            f"{list(shard.sizes)}, where the manifest's grid puts one; the checkpoint is corrupt"
        )


def _touches(a: Box, b: Box) -> bool:
    r = a.intersect(b)
    return r is not None and r.numel > 0


def wanted_box(box: Box, flat: tuple[int, int] | None) -> Box:
    """The slab of ``box`` that a flat range of its row-major order lies in (whole rows of dim 0)."""
    if flat is None or not box.sizes or box.numel == 0 or flat[0] >= flat[1]:
        return box
    row = math.prod(box.sizes[1:])
    if row == 0:
        return box
    lo, hi = flat[0] // row, -(-flat[1] // row)
    return Box((box.offsets[0] + lo,) + box.offsets[1:], (hi - lo,) + box.sizes[1:])


def resolve(
    storage: Storage, manifest: Manifest, wants: Mapping[str, list[Box]], where: str, reader: IndexReader | None = None
) -> Manifest:
    """``manifest`` with the chunks of the named tensors resolved, for the boxes given.

    Version-1 manifests (and resolved ones) come back unchanged. Pass a
    ``reader`` to reuse its cache or to count the index bytes it read.
    """
    if manifest.format_version == 1:
        return manifest
    reader = reader or IndexReader(storage, manifest, where)
    tensors = dict(manifest.tensors)
    for fqn, boxes in wants.items():
        meta = tensors.get(fqn)
        if meta is None or meta.chunks is not None:
            continue
        tensors[fqn] = dataclasses.replace(meta, chunks=reader.chunks(fqn, boxes))
    return dataclasses.replace(manifest, tensors=tensors)


def resolve_all(storage: Storage, manifest: Manifest, where: str) -> Manifest:
    """``manifest`` with every chunk of every tensor listed (reads every index file)."""
    if manifest.format_version == 1:
        return manifest
    reader = IndexReader(storage, manifest, where)
    tensors = {
        fqn: meta if meta.chunks is not None else dataclasses.replace(meta, chunks=reader.chunks(fqn))
        for fqn, meta in manifest.tensors.items()
    }
    return dataclasses.replace(manifest, tensors=tensors)
