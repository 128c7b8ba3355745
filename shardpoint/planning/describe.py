"""A rank's description of what it saved: the typed messages the commit gathers.

Ranks with equal descriptions (every data-parallel rank of a stage, say)
produce equal digests, so the commit fetches one description per distinct
digest and the gather stays O(ranks + tensors) instead of O(ranks x tensors).
A tensor whose layout a :class:`~shardpoint.geometry.grid.Grid` reproduces is
described by that grid; any other is *listed*: its chunks are found through
the ranks holding them. Pure: the caller supplies grids already translated
into the process group's ranks (:class:`CandidateGrids`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence, Union

import xxhash

from ..format.manifest import RankFiles
from ..geometry.grid import Grid
from .replicas import ReplicaTable
from .writers import HeldTensor, WriterChoice

__all__ = [
    "Mesh", "GridEntry", "ListedEntry", "TensorEntry", "TensorsDoc", "ValuesDoc", "Description", "RankStatus",
    "RankReport", "CandidateGrids", "checked_grid", "describe", "cover_of", "values_doc",
]


@dataclass(frozen=True)
class Mesh:
    """A mesh the described grids lie on: its shape and its ranks (in the process group)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GridEntry:
    """A tensor described by a grid: ``meshes[mesh]`` split by ``splits``, written by copy index ``copy``."""

    dtype: str
    shape: tuple[int, ...]
    placement: str
    mesh: int
    splits: tuple[tuple[int, ...], ...]
    copy: int

    def row(self) -> tuple:
        """The entry as plain JSON data, for the digest."""
        return (self.dtype, self.shape, self.placement, self.mesh, self.splits, self.copy)


@dataclass(frozen=True, slots=True)
class ListedEntry:
    """A tensor whose chunks are listed in the index files; ``wrote``: this rank wrote some of them."""

    dtype: str
    shape: tuple[int, ...]
    placement: str
    wrote: bool

    def row(self) -> tuple:
        """The entry as plain JSON data, for the digest."""
        return (self.dtype, self.shape, self.placement, None, None, self.wrote)


TensorEntry = Union[GridEntry, ListedEntry]


@dataclass(frozen=True)
class TensorsDoc:
    """What a rank holds: each tensor's entry, and the meshes its grid entries refer to by index."""

    meshes: tuple[Mesh, ...]
    tensors: Mapping[str, TensorEntry]

    def digest(self) -> str:
        """xxh3_128 of a canonical JSON form: equal on ranks that describe the same tensors the same way."""
        return _digest(self.meshes, {k: e.row() for k, e in self.tensors.items()})


def _digest(meshes: Sequence[Mesh], rows: Mapping[str, tuple]) -> str:
    doc = {"meshes": [[m.shape, m.ranks] for m in meshes], "tensors": rows}
    return xxhash.xxh3_128_hexdigest(json.dumps(doc, separators=(",", ":")).encode("utf-8"))


@dataclass(frozen=True)
class ValuesDoc:
    """A rank's value documents (``values``) and each entry's save-time framework (``frameworks``)."""

    values: Mapping[str, Any]
    frameworks: Mapping[str, Any]

    def digest(self) -> str:
        """xxh3_128 of the documents' JSON (``repr`` for anything JSON cannot encode)."""
        doc = {"values": self.values, "layout": self.frameworks}  # the manifest's name for it
        return xxhash.xxh3_128_hexdigest(json.dumps(doc, separators=(",", ":"), default=repr).encode("utf-8"))


@dataclass(frozen=True)
class Description:
    """A rank's tensor description, its digest, and the names it lists (held without a grid)."""

    doc: TensorsDoc
    digest: str
    listed: frozenset[str]


@dataclass(frozen=True)
class RankStatus:
    """The fixed-size part of a rank's save outcome that every rank sends to rank 0.

    ``files``: the files it wrote and their sizes; ``index``: its data and
    index file (``None`` when it wrote nothing); the digests of its two
    documents; ``cover``: elements it wrote of each listed tensor;
    ``replicas``: the digest of its replica table for the comparison at
    the commit (:meth:`~shardpoint.planning.replicas.ReplicaTable.digest`;
    empty when the ranks compared before writing); ``refs``: the data files
    of a base checkpoint whose chunks it references (an incremental save,
    :mod:`shardpoint.format.refs`).
    """

    files: Mapping[str, int]
    index: RankFiles | None
    tensors_digest: str
    values_digest: str
    cover: Mapping[str, int]
    replicas: str = ""
    refs: tuple = ()


@dataclass(frozen=True)
class RankReport:
    """One rank's save outcome: its status, and what is sent only when rank 0 asks for it.

    ``tensors`` and ``values``: its two documents; ``replicas``: its replica
    table (:class:`~shardpoint.planning.replicas.ReplicaTable`), or ``None``.
    """

    status: RankStatus
    tensors: TensorsDoc
    values: ValuesDoc
    replicas: ReplicaTable | None = None


class CandidateGrids:
    """Each tensor's grid before it is checked, built once per mesh (grids are O(mesh) to build).

    ``replica_ranks(fqn)`` gives the global ranks holding a plain tensor's
    copies (``None``: every rank); ``to_group`` translates a grid of global
    ranks into the process group's ranks, or returns ``None`` when the mesh
    reaches outside the group (``None``: the group is the world). One
    instance serves one description: nothing is kept across saves.

    Example::

        grids = CandidateGrids(4, lambda fqn: None); grids.of(t)
    """

    def __init__(
        self, world: int, replica_ranks: Callable[[str], Collection[int] | None],
        to_group: Callable[[Grid], Grid | None] | None = None,
    ):
        self.world = world
        self.replica_ranks = replica_ranks
        self.to_group = to_group
        self._memo: dict = {}  # keyed by id(): values keep the keyed object alive

    def of(self, t: HeldTensor) -> Grid | None:
        """``t``'s grid in group ranks: a DTensor's own, or a plain tensor's replica grid; else ``None``."""
        if t.grid is not None:
            key = ("group", id(t.grid))
            if key not in self._memo:
                self._memo[key] = (t.grid if self.to_group is None else self.to_group(t.grid), t.grid)
            return self._memo[key][0]
        if t.placement not in ("replicated", "local"):
            return None
        ranks = self.replica_ranks(t.fqn)
        key = ("plain", id(ranks), len(t.shape))
        if key not in self._memo:
            flat = ((),) * len(t.shape)
            if ranks is None:
                g = Grid((self.world,), tuple(range(self.world)), flat)
            else:
                g = Grid((len(ranks),), tuple(sorted(ranks)), flat)
                g = g if self.to_group is None else self.to_group(g)
            self._memo[key] = (g, ranks)
        return self._memo[key][0]


def checked_grid(t: HeldTensor, grid: Grid | None, rank: int, picked: bool, copy: int) -> Grid | None:
    """``grid`` if it reproduces ``t``'s box, copy index and writer choice on ``rank``; else ``None``.

    A grid the loader would derive wrongly must never reach the manifest:
    any disagreement makes the tensor listed instead. ``picked``: this rank
    writes ``t``; ``copy``: the copy index chosen to write it.

    Example::

        checked_grid(t, grids.of(t), rank, picked=True, copy=0)
    """
    if t.flat is not None or grid is None:
        return None
    if grid.copies != max(1, t.replica_count) or len(grid.splits) != len(t.shape):
        return None
    coord = grid.coord_of(rank)
    if coord is None or grid.replica_index(coord) != t.replica_index:
        return None
    box = grid.box(t.shape, coord)
    if box != t.box and not (box.numel == 0 and t.box.numel == 0):
        return None
    if picked != (t.replica_index == copy):
        return None
    return grid


def _dtype(t: HeldTensor) -> str:
    return str(t.data.dtype).removeprefix("torch.")


def describe(tensors: Sequence[HeldTensor], mine: Sequence[HeldTensor], choice: WriterChoice, rank: int, grids: CandidateGrids) -> Description:
    """This rank's description of ``tensors``, of which it writes ``mine`` (chosen by ``choice``).

    A name held in one piece whose candidate grid checks out is described by
    the grid; anything else is listed.

    Example::

        d = describe(tensors, mine, choice, comm.rank, CandidateGrids(comm.world, lambda f: None))
    """
    meshes: dict[tuple, int] = {}
    mesh_of: dict[tuple, tuple[int, tuple]] = {}  # (id(ranks), shape) -> (mesh index, ranks kept alive)
    names: dict = {}  # dtype -> its name
    held: dict[str, list] = {}
    own = {id(t) for t in mine}
    for t in tensors:
        held.setdefault(t.fqn, []).append(t)
    entries: dict[str, TensorEntry] = {}
    rows: dict[str, tuple] = {}  # the entries as plain data, for the digest
    listed: set[str] = set()
    for fqn, ts in held.items():
        t = ts[0]
        dt = names.get(t.data.dtype)
        if dt is None:
            dt = names[t.data.dtype] = _dtype(t)
        shape = tuple(t.shape)
        grid = None
        if len(ts) == 1 and t.flat is None:
            copy = choice.copy_of(t) if t.replica_count > 1 else 0
            grid = checked_grid(t, grids.of(t), rank, id(t) in own, copy)
        if grid is None:
            listed.add(fqn)
            e = entries[fqn] = ListedEntry(dt, shape, t.placement, any(id(x) in own for x in ts))
            rows[fqn] = (dt, shape, t.placement, None, None, e.wrote)
            continue
        # Tuples do not cache their hash: hash each distinct rank tuple once, not per tensor.
        hit = mesh_of.get((id(grid.ranks), grid.mesh_shape))
        if hit is None:
            hit = mesh_of[(id(grid.ranks), grid.mesh_shape)] = (meshes.setdefault((grid.mesh_shape, grid.ranks), len(meshes)), grid.ranks)
        entries[fqn] = GridEntry(dt, shape, t.placement, hit[0], grid.splits, copy)
        rows[fqn] = (dt, shape, t.placement, hit[0], grid.splits, copy)
    mesh_list = tuple(Mesh(tuple(s), tuple(r)) for s, r in sorted(meshes, key=meshes.get))
    return Description(TensorsDoc(mesh_list, entries), _digest(mesh_list, rows), frozenset(listed))


def cover_of(mine: Sequence[HeldTensor], listed: Collection[str]) -> dict[str, int]:
    """Elements this rank wrote of each listed tensor, for the commit's coverage check.

    Example::

        cover_of(mine, description.listed)  # {"model.w": 4096}
    """
    out: dict[str, int] = {}
    for t in mine:
        if t.fqn in listed:
            out[t.fqn] = out.get(t.fqn, 0) + (t.box.numel if t.flat is None else t.flat[1] - t.flat[0])
    return out


def values_doc(values: Mapping[str, Any], frameworks: Mapping[str, Any]) -> tuple[ValuesDoc, str]:
    """A rank's value documents as a :class:`ValuesDoc`, with its digest.

    Example::

        doc, digest = values_doc({"extra": {"step": 3}}, {"extra": "values"})
    """
    doc = ValuesDoc(values, frameworks)
    return doc, doc.digest()
