"""Rank 0's side of the commit, pure: rank descriptions in, a :class:`Manifest` out.

Work and memory are O(ranks + distinct descriptions x tensors): chunk
records stay in the ranks' index files, and ranks with equal descriptions
send one between them (:func:`representatives`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import CorruptCheckpointError, ShapeMismatchError, UnsupportedStateError
from ..format.index import fqn_key
from ..format.manifest import FORMAT_VERSION, Manifest, RankFiles, TensorMeta, rank_runs
from ..format.refs import REF_VERSION
from ..geometry.grid import Grid
from .describe import GridEntry, RankStatus, TensorsDoc, ValuesDoc

__all__ = ["AskFor", "Documents", "representatives", "merge_values", "assemble_manifest"]


@dataclass(frozen=True)
class AskFor:
    """Which ranks send their tensor description, and which their value documents: one per distinct digest."""

    tensors: frozenset[int]
    values: frozenset[int]


@dataclass(frozen=True)
class Documents:
    """What one rank sends in the second gather: each document only when rank 0 asked for it."""

    tensors: TensorsDoc | None = None
    values: ValuesDoc | None = None


def representatives(statuses: Sequence[RankStatus]) -> AskFor:
    """The lowest rank of each distinct tensor digest and of each distinct values digest.

    Example::

        ask = representatives(statuses); ask.tensors  # frozenset({0, 8})
    """
    want_t: dict[str, int] = {}
    want_v: dict[str, int] = {}
    for r, st in enumerate(statuses):
        want_t.setdefault(st.tensors_digest, r)
        want_v.setdefault(st.values_digest, r)
    return AskFor(frozenset(want_t.values()), frozenset(want_v.values()))


def merge_values(a: Any, b: Any) -> Any:
    """Union of two value documents from different ranks; the lower rank (``a``) wins conflicts.

    Example::

        merge_values({"x": 1, "y": 2}, {"y": 9, "z": 3})  # {"x": 1, "y": 2, "z": 3}
    """
    if isinstance(a, dict) and isinstance(b, dict) and "__sp__" not in a:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge_values(a[k], v) if k in a else v
        return out
    return a


def assemble_manifest(
    save_id: str, world: int, block: int, statuses: Sequence[RankStatus], docs: Sequence[Documents], where: str, created: float,
) -> Manifest:
    """Merge the ranks' statuses and the distinct descriptions into a manifest (current format version).

    ``docs[r]`` is what rank ``r`` sent: every distinct tensor digest among
    ``statuses`` must have its description in some rank's documents. A grid
    is accepted only when every rank of its mesh describes the tensor with
    it; a listed tensor's written elements must cover it exactly. Raises
    :class:`ShapeMismatchError`, :class:`CorruptCheckpointError` or
    :class:`UnsupportedStateError` naming the tensor otherwise.

    Example::

        manifest = assemble_manifest(save_id, comm.world, block, statuses, docs, where, time.time())
    """
    files: dict[str, int] = {}
    ranks: list[RankFiles | None] = []
    by_tdig: dict[str, list[int]] = {}
    for r, st in enumerate(statuses):
        files.update(st.files)
        ranks.append(st.index)
        by_tdig.setdefault(st.tensors_digest, []).append(r)
    meta: dict[str, tuple] = {}
    grids: dict[str, set] = {}
    holders: dict[str, set[int]] = {}
    mentions: dict[str, int] = {}  # ranks describing each tensor with a grid
    placements: dict[str, str] = {}
    made: dict[tuple, Grid] = {}  # one Grid per (mesh, splits): building one validates its ranks
    for members in by_tdig.values():
        doc = next(d.tensors for d in (docs[r] for r in members) if d.tensors is not None)
        for fqn, e in doc.tensors.items():
            prev = meta.setdefault(fqn, (e.dtype, e.shape))
            if prev != (e.dtype, e.shape):
                raise ShapeMismatchError(f"{where}: ranks disagree on tensor {fqn!r}: {prev} vs {(e.dtype, e.shape)}")
            placements.setdefault(fqn, e.placement)
            if not isinstance(e, GridEntry):
                grids.setdefault(fqn, set()).add(None)
                if e.wrote:
                    holders.setdefault(fqn, set()).update(members)
                continue
            mesh = doc.meshes[e.mesh]
            key = ((mesh.shape, mesh.ranks), e.splits)
            grid = made.get(key)
            if grid is None:
                grid = made[key] = Grid(mesh.shape, mesh.ranks, e.splits)
            grids.setdefault(fqn, set()).add((grid, e.copy))
            mentions[fqn] = mentions.get(fqn, 0) + len(members)
    values: dict[str, Any] = {}
    frameworks: dict[str, Any] = {}
    for d in docs:
        if d.values is not None:
            for k, vdoc in d.values.values.items():
                values[k] = merge_values(values[k], vdoc) if k in values else vdoc
            for k, fw in d.values.frameworks.items():
                frameworks.setdefault(k, fw)
    cover: dict[str, int] = {}
    for st in statuses:
        for fqn, n in st.cover.items():
            cover[fqn] = cover.get(fqn, 0) + n
    tensors: dict[str, TensorMeta] = {}
    keys: dict[int, str] = {}
    seen = _Seen(mentions, cover, holders)
    for fqn, (dt, shape) in meta.items():
        other = keys.setdefault(fqn_key(fqn, dt), fqn)
        if other != fqn:
            raise UnsupportedStateError(f"{where}: tensor names {other!r} and {fqn!r} share a 64-bit key; rename one")
        tensors[fqn] = _tensor_meta(fqn, dt, shape, grids[fqn], seen, where)
    return Manifest(
        save_id=save_id,
        world_size=world,
        block_size=block,
        tensors=tensors,
        values=values,
        files=files,
        layout={"world_size": world, "entries": frameworks, "placements": placements},
        created=created,
        format_version=REF_VERSION if any(st.refs for st in statuses) else FORMAT_VERSION,
        ranks=tuple(ranks), refs=tuple(ref for st in statuses for ref in st.refs),
    )


@dataclass(frozen=True)
class _Seen:
    """What the ranks' documents say of every tensor: ranks describing it with a grid, elements covered, writers."""

    mentions: Mapping[str, int]
    cover: Mapping[str, int]
    holders: Mapping[str, set]


def _tensor_meta(fqn: str, dt: str, shape: tuple, g: set, seen: _Seen, where: str) -> TensorMeta:
    mentions, cover, holders = seen.mentions, seen.cover, seen.holders
    if len(g) == 1 and None not in g:
        grid, copy = next(iter(g))
        # Every rank that describes it lies on its mesh (checked locally), so equal
        # counts mean every mesh rank holds it, the writer chosen for it included.
        if mentions[fqn] != len(grid.ranks):
            raise CorruptCheckpointError(
                f"{where}: tensor {fqn!r} is held by {mentions[fqn]} rank(s), but its layout spans "
                f"{len(grid.ranks)}; two ranks disagree on its sharding, or only some ranks hold it "
                "(pipeline stages: pass replicated_over to save)"
            )
        return TensorMeta(dt, shape, None, grid, copy)
    if len(g) > 1:
        # Without one layout rank 0 cannot check coverage, and a checkpoint that
        # commits must load: refuse, as version 1's coverage check would have.
        raise CorruptCheckpointError(
            f"{where}: ranks describe tensor {fqn!r} with {len(g)} different layouts; two ranks disagree "
            "on its sharding, or ranks hold different data under one name (pipeline stages: pass "
            "replicated_over to save)"
        )
    if cover.get(fqn, 0) != math.prod(shape):
        raise CorruptCheckpointError(
            f"{where}: saved chunks of {fqn!r} cover {cover.get(fqn, 0)} of {math.prod(shape)} elements; "
            "two ranks disagree on its sharding, or only some ranks hold it (pipeline stages: "
            "pass replicated_over to save)"
        )
    return TensorMeta(dt, shape, None, holders=rank_runs(holders.get(fqn, ())))
