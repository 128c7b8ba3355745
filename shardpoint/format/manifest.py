"""The manifest: the versioned, JSON-encoded description of one checkpoint.

The manifest is the commit record. Version 1 lists every saved chunk in it.
Version 2 (what :func:`shardpoint.save` writes) keeps it O(tensors + ranks):
a tensor records its *grid* (how it is split over a mesh of ranks, see
:mod:`shardpoint.geometry.grid`) or the ranks *holding* its chunks, and each rank's
chunk records live in that rank's binary index file
(:mod:`shardpoint.format.index`), whose digest the manifest records.
``TensorMeta.chunks`` of a parsed version-2 manifest is ``None`` until the
loader resolves the chunks it needs (:mod:`shardpoint.engine.indexes`).

``Manifest.from_json`` treats its input as untrusted: every name, size,
offset, box, mesh and rank is validated before any read is planned from it
(:mod:`shardpoint.format.manifest_parse`), so a tampered manifest cannot
point outside the checkpoint or make the loader allocate absurd memory. See
``docs/format.md``.

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
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import xxhash

from ..errors import CorruptCheckpointError, FormatError
from .manifest_parse import manifest_fields
from .records import (
    DIGEST_VERSION, DTYPE_SIZES, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, MAX_ELEMENTS, MAX_NDIM, READ_VERSIONS,
    ChunkMeta, RankFiles, TensorMeta, check_file_name,
)
from .refs import RefFiles
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
    "MAX_NDIM",
    "seal",
    "unseal",
]

# The manifest's last member: ',"digest":"' + 32 hex digits + '"}' (45 bytes).
_SEAL_HEAD = b',"digest":"'
_SEAL_LEN = len(_SEAL_HEAD) + 32 + 2
_HEX32 = re.compile(rb"[0-9a-f]{32}")


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


@dataclass(frozen=True)
class Manifest:
    """The whole checkpoint description. Frozen: derive variants with ``dataclasses.replace``.

    ``ranks`` (version 2) has one entry per saving rank: its files, or
    ``None`` for a rank that wrote nothing. ``refs`` (version 4) lists the
    data files of other checkpoints whose chunks this one uses
    (:mod:`shardpoint.format.refs`).
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
    refs: tuple[RefFiles, ...] = ()

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
        if self.refs:  # version 4 only: a manifest without references is unchanged
            doc["refs"] = [r.to_json() for r in self.refs]
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
            m = Manifest(**manifest_fields(doc, where))
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
