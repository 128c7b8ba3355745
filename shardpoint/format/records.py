"""The manifest's records and limits: chunks, tensors, ranks' files, dtype sizes and version numbers.

The pieces of a manifest that both its writer (:mod:`shardpoint.format.manifest`)
and its validating reader (:mod:`shardpoint.format.manifest_parse`) build, kept
apart from both so that neither imports the other's user. Everything here is
re-exported by :mod:`shardpoint.format.manifest`, where callers import it.
Example::

    t = TensorMeta("float32", (4, 4), (ChunkMeta(Box((0, 0), (4, 4)), "data/a.bin", 0, 64, ("0" * 16,)),))
    assert t.nbytes == 64
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import FormatError
from ..geometry import Box
from ..geometry.grid import Grid

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "READ_VERSIONS", "DIGEST_VERSION", "MANIFEST_NAME", "MAX_ELEMENTS", "MAX_NDIM",
    "DTYPE_SIZES", "check_file_name", "ChunkMeta", "TensorMeta", "RankFiles",
]

FORMAT_NAME = "shardpoint"
FORMAT_VERSION = 3  # what save writes
READ_VERSIONS = (1, 2, 3, 4)  # 4: a version-3 manifest with references (shardpoint.format.refs)
# The first version whose manifest carries its own digest and whose index keys bind the dtype.
DIGEST_VERSION = 3
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
