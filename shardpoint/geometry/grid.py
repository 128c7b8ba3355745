"""Grids: how a DTensor is split over a mesh of ranks, as pure integer arithmetic.

Format version 2 of the manifest records a sharded tensor's *grid* instead of
one entry per saved chunk. A grid is a mesh shape, the global rank at each
mesh coordinate, and for each tensor dim the mesh dims that split it,
outermost first. Each split is a ``torch.chunk`` split: an interval
``[lo, lo + n)`` cut into ``k`` pieces of ``ceil(n / k)`` (the last ones
shorter or empty); piece ``i`` is
``[lo + min(i * c, n), lo + min((i + 1) * c, n))``. Mesh dims that split no
tensor dim are *replicate* dims: ranks differing only there hold copies.

Empty shards: a piece past the end of its parent interval is reported at
that interval's end (the formula above), so its offset may differ from the
one torch reports (torch reports the global dim size); zero-element boxes
carry no data and should compare equal whatever their offsets.

Placements arrive as plain data, one :class:`DimPlacement` per mesh dim (the
adapters read them off DTensors). ``Shard(d)`` on mesh dim ``m`` puts ``m``
into ``splits[d]`` in mesh-dim order; ``_StridedShard(d, split_factor=sf)``
(2-D FSDP2 + TP, kind ``"strided"``) is the same
split applied *after* the later mesh dims that shard ``d``, and is accepted
only when ``sf`` is the product of their sizes. When such a dim does not
divide evenly, torch's own split (``distribute_tensor``, and its
``compute_local_shape_and_global_offset``) can give ranks non-contiguous rows
and disagree with this model, while FSDP2, which ``torch.chunk``s the TP-local
tensor, follows it. The disagreement need not show at every rank: with two
or more shards after the strided one, a rank can see torch's first offset
and size match the grid while its rows differ. Callers compare the grid with
torch over all coordinates (or agree across ranks) and fall back.

Nothing here starts processes or does I/O; lookups of overlapping shards cost
O(overlapping shards x ndim), not O(mesh size).

Example::

    >>> g = Grid((2, 2), (0, 1, 2, 3), ((1, 0),))   # dim 0: tp (mesh dim 1), then dp
    >>> g.box((8,), (1, 0))
    Box(offsets=(2,), sizes=(2,))
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..errors import FormatError
from . import Box

__all__ = ["Grid", "DimPlacement", "grid_of_placements"]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _piece(lo: int, n: int, k: int, i: int) -> tuple[int, int]:
    """(start, size) of torch.chunk piece ``i`` of ``k`` of ``[lo, lo + n)``."""
    c = -(-n // k) if n else 0
    a = min(i * c, n)
    return lo + a, min(a + c, n) - a


@dataclass(frozen=True)
class Grid:
    """A tensor's split over a mesh: ``mesh_shape``, the ``ranks`` at each coordinate, ``splits``.

    ``ranks`` lists global ranks in row-major mesh order; ``splits[d]`` lists
    the mesh dims splitting tensor dim ``d``, outermost first.
    """

    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]
    splits: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        mesh = tuple(self.mesh_shape)
        splits = tuple(tuple(s) for s in self.splits)
        if not all(_is_int(k) and k >= 1 for k in mesh):
            raise ValueError(f"grid mesh sizes must be positive ints, got {mesh}")
        size = math.prod(mesh)
        if len(self.ranks) != size:
            raise ValueError(f"grid mesh {mesh} has {size} coordinates but {len(self.ranks)} ranks")
        ranks = tuple(self.ranks)
        if not all(_is_int(r) and r >= 0 for r in ranks):
            raise ValueError("grid ranks must be non-negative ints")
        if len(set(ranks)) != len(ranks):
            raise ValueError("grid ranks must be distinct")
        used: set[int] = set()
        for d, dims in enumerate(splits):
            for m in dims:
                if not _is_int(m) or not 0 <= m < len(mesh):
                    raise ValueError(f"grid split of tensor dim {d} names mesh dim {m!r}, mesh has {len(mesh)} dims")
                if m in used:
                    raise ValueError(f"grid mesh dim {m} splits more than once")
                used.add(m)
        # Normalise lists to tuples so equality and hashing behave.
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "splits", splits)
        strides = [1] * len(mesh)
        for m in range(len(mesh) - 2, -1, -1):
            strides[m] = strides[m + 1] * mesh[m + 1]
        object.__setattr__(self, "_strides", tuple(strides))
        replicate = tuple(m for m in range(len(mesh)) if m not in used)
        object.__setattr__(self, "_replicate", replicate)
        object.__setattr__(self, "_copies", math.prod(mesh[m] for m in replicate))
        object.__setattr__(self, "_coords", None)  # rank -> coordinate, built on first use

    def __getstate__(self) -> dict:
        # The rank index is a cache (O(mesh) entries): rebuild it instead of pickling it.
        state = dict(self.__dict__)
        state["_coords"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def replicate_dims(self) -> tuple[int, ...]:
        """Mesh dims that split no tensor dim, ascending."""
        return self._replicate  # type: ignore[attr-defined]

    @property
    def copies(self) -> int:
        """How many ranks hold each shard: the product of replicate dim sizes."""
        return self._copies  # type: ignore[attr-defined]

    def _check_coord(self, coord: Sequence[int]) -> tuple[int, ...]:
        coord = tuple(coord)
        if len(coord) != len(self.mesh_shape) or not all(
            0 <= c < k for c, k in zip(coord, self.mesh_shape)
        ):
            raise ValueError(f"coordinate {coord} outside mesh {self.mesh_shape}")
        return coord

    def _rank_at(self, coord: Sequence[int]) -> int:
        return self.ranks[sum(c * s for c, s in zip(coord, self._strides))]  # type: ignore[attr-defined]

    def coord_of(self, rank: int) -> tuple[int, ...] | None:
        """The mesh coordinate of global ``rank``, or ``None`` if it is not in the mesh."""
        index = self._coords  # type: ignore[attr-defined]
        if index is None:
            mesh = self.mesh_shape
            coords = itertools.product(*(range(k) for k in mesh))
            index = dict(zip(self.ranks, coords))
            object.__setattr__(self, "_coords", index)
        return index.get(rank)

    def box(self, shape: Sequence[int], coord: Sequence[int]) -> Box:
        """The shard of a tensor of ``shape`` held at mesh ``coord`` (replicate coords ignored)."""
        self._check_shape(shape)
        coord = self._check_coord(coord)
        offs, sizes = [], []
        for n, dims in zip(shape, self.splits):
            lo = 0
            for m in dims:
                lo, n = _piece(lo, n, self.mesh_shape[m], coord[m])
            offs.append(lo)
            sizes.append(n)
        return Box(tuple(offs), tuple(sizes))

    def _check_shape(self, shape: Sequence[int]) -> None:
        if len(shape) != len(self.splits):
            raise ValueError(f"shape {tuple(shape)} has {len(shape)} dims, grid splits {len(self.splits)}")
        if any(n < 0 for n in shape):
            raise ValueError(f"negative shape {tuple(shape)}")

    def replica_index(self, coord: Sequence[int]) -> int:
        """Row-major index of ``coord`` over the replicate dims (0 when there are none)."""
        coord = self._check_coord(coord)
        index = 0
        for m in self._replicate:  # type: ignore[attr-defined]
            index = index * self.mesh_shape[m] + coord[m]
        return index

    def writer(self, coord: Sequence[int], copy: int) -> int:
        """Global rank holding the shard at ``coord`` in replica ``copy`` (row-major over replicate dims)."""
        coord = list(self._check_coord(coord))
        if not _is_int(copy) or not 0 <= copy < self.copies:
            raise ValueError(f"copy {copy!r} outside [0, {self.copies})")
        for m in reversed(self._replicate):  # type: ignore[attr-defined]
            copy, coord[m] = divmod(copy, self.mesh_shape[m])
        return self._rank_at(coord)

    def _dim_pieces(self, n: int, dims: tuple[int, ...], qlo: int, qhi: int) -> list[tuple[tuple[int, ...], int, int]]:
        # Nonempty pieces of [0, n) overlapping [qlo, qhi): (indices along dims, start, size).
        # Descends only into overlapping pieces, so the cost follows the output.
        out: list[tuple[tuple[int, ...], int, int]] = []
        mesh = self.mesh_shape

        def walk(level: int, lo: int, n: int, idx: tuple[int, ...]) -> None:
            if level == len(dims):
                if lo < qhi and qlo < lo + n:  # only needed when dims is empty
                    out.append((idx, lo, n))
                return
            k = mesh[dims[level]]
            c = -(-n // k)
            first = max(0, (qlo - lo) // c)
            last = min(k - 1, (qhi - 1 - lo) // c, (n - 1) // c)  # (n - 1) // c: last nonempty piece
            for i in range(first, last + 1):
                a = i * c
                walk(level + 1, lo + a, min(a + c, n) - a, idx + (i,))

        if n > 0 and qhi > qlo:
            walk(0, 0, n, ())
        return out

    def shards(self, shape: Sequence[int], box: Box) -> Iterator[tuple[tuple[int, ...], Box]]:
        """Every distinct nonempty shard sharing an element with ``box``: ``(coord, shard box)``.

        Replicate dims of ``coord`` are 0. A 0-d tensor has one shard.
        """
        self._check_shape(shape)
        if box.ndim != len(shape):
            raise ValueError(f"query box {box} does not match shape {tuple(shape)}")
        per_dim = []
        for n, dims, o, s in zip(shape, self.splits, box.offsets, box.sizes):
            pieces = self._dim_pieces(n, dims, o, o + s)
            if not pieces:
                return
            per_dim.append(pieces)
        base = [0] * len(self.mesh_shape)
        for combo in itertools.product(*per_dim):
            coord = list(base)
            offs, sizes = [], []
            for (idx, lo, n), dims in zip(combo, self.splits):
                for m, i in zip(dims, idx):
                    coord[m] = i
                offs.append(lo)
                sizes.append(n)
            yield tuple(coord), Box(tuple(offs), tuple(sizes))

    def to_json(self) -> dict:
        """A JSON-ready dict: ``{"shape": [...], "ranks": [...], "splits": [[...], ...]}``."""
        return {
            "shape": [int(k) for k in self.mesh_shape],
            "ranks": [int(r) for r in self.ranks],
            "splits": [[int(m) for m in dims] for dims in self.splits],
        }

    @staticmethod
    def from_json(doc: Any, world: int, ndim: int, where: str) -> "Grid":
        """Parse an untrusted :meth:`to_json` dict for a tensor of ``ndim`` dims in a ``world``-rank job.

        Raises :class:`FormatError` naming ``where`` and what is wrong.
        """

        def bad(msg: str) -> FormatError:
            return FormatError(f"{where}: grid {msg}")

        if not isinstance(doc, dict):
            raise bad(f"must be an object, got {type(doc).__name__}")
        if set(doc) != {"shape", "ranks", "splits"}:
            raise bad(f"must have keys shape, ranks, splits; got {sorted(map(str, doc))}")
        shape, ranks, splits = doc["shape"], doc["ranks"], doc["splits"]
        if not isinstance(shape, list):
            raise bad(f"shape must be a list, got {type(shape).__name__}")
        size = 1
        for k in shape:
            if not _is_int(k) or k < 1:
                raise bad(f"shape entries must be positive ints, got {k!r}")
            size *= k
            if size > world:  # stop early: never build anything mesh-sized from a bogus shape
                raise bad(f"shape {shape} has more coordinates than the {world} ranks")
        if not isinstance(ranks, list):
            raise bad(f"ranks must be a list, got {type(ranks).__name__}")
        if len(ranks) != size:
            raise bad(f"shape {shape} needs {size} ranks, got {len(ranks)}")
        seen: set[int] = set()
        for r in ranks:
            if not _is_int(r):
                raise bad(f"ranks must be ints, got {r!r}")
            if not 0 <= r < world:
                raise bad(f"rank {r} outside [0, {world})")
            if r in seen:
                raise bad(f"rank {r} appears twice")
            seen.add(r)
        if not isinstance(splits, list):
            raise bad(f"splits must be a list, got {type(splits).__name__}")
        if len(splits) != ndim:
            raise bad(f"has {len(splits)} splits for a {ndim}-d tensor")
        used: set[int] = set()
        for d, dims in enumerate(splits):
            if not isinstance(dims, list):
                raise bad(f"split of dim {d} must be a list, got {type(dims).__name__}")
            for m in dims:
                if not _is_int(m):
                    raise bad(f"split of dim {d} must list ints, got {m!r}")
                if not 0 <= m < len(shape):
                    raise bad(f"split of dim {d} names mesh dim {m}, mesh has {len(shape)} dims")
                if m in used:
                    raise bad(f"mesh dim {m} splits more than once")
                used.add(m)
        try:
            return Grid(tuple(shape), tuple(ranks), tuple(tuple(dims) for dims in splits))
        except ValueError as e:  # pragma: no cover - checked above
            raise bad(str(e)) from None


@dataclass(frozen=True)
class DimPlacement:
    """How one mesh dim places a tensor, as plain data: the geometry's view of a DTensor placement.

    ``kind`` is ``"shard"`` (``Shard(dim)``), ``"strided"`` (``_StridedShard(dim,
    split_factor)``; ``split_factor`` is ``None`` when torch holds it
    symbolically), ``"replicate"``, or ``"other"`` (``Partial`` and any type
    the grid cannot describe). ``dim`` is the tensor dim as torch gave it
    (it may be negative). :func:`shardpoint.adapters.tensors.describe_placements`
    builds these from a DTensor's placements.

    Example::

        (DimPlacement("shard", 0), DimPlacement("strided", 0, 2), DimPlacement("replicate"))
    """

    kind: str
    dim: int | None = None
    split_factor: int | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"placement kind must be one of {sorted(_KINDS)}, got {self.kind!r}")
        if (self.dim is None) == (self.kind in ("shard", "strided")):
            raise ValueError(f"a {self.kind!r} placement {'needs' if self.dim is None else 'takes no'} tensor dim")


_KINDS = frozenset({"shard", "strided", "replicate", "other"})


def grid_of_placements(
    mesh_shape: Sequence[int], ranks: Sequence[int], placements: Sequence[DimPlacement], ndim: int
) -> Grid | None:
    """The grid of a DTensor with ``placements`` on a mesh, or ``None`` when unsupported.

    Supported: ``Shard``, ``Replicate``, and ``_StridedShard`` whose split
    factor is the product of the sizes of the later mesh dims sharding the
    same tensor dim. ``Partial``, other split factors and unknown placement
    types give ``None``. ``ranks`` are global ranks in row-major mesh order.

    Example::

        >>> grid_of_placements((2, 2), range(4), (DimPlacement("shard", 0), DimPlacement("replicate")), 1).splits
        ((0,),)
    """
    mesh = tuple(int(k) for k in mesh_shape)
    if len(placements) != len(mesh):
        raise ValueError(f"{len(placements)} placements for a {len(mesh)}-d mesh")
    dims: list[int | None] = []
    for p in placements:
        if p.kind == "replicate":
            dims.append(None)
        elif p.kind in ("shard", "strided"):
            d = int(p.dim)
            if d < 0:
                d += ndim
            if not 0 <= d < ndim:
                raise ValueError(f"placement {p} shards dim {p.dim} of a {ndim}-d tensor")
            dims.append(d)
        else:
            return None
    splits: list[list[int]] = [[] for _ in range(ndim)]
    below = [1] * ndim  # product of sizes of the later mesh dims sharding each tensor dim
    # Right to left: a Shard is outside everything after it, a strided shard inside.
    for m in range(len(mesh) - 1, -1, -1):
        d, p = dims[m], placements[m]
        if d is None:
            continue
        if p.kind == "strided":
            if p.split_factor is None or p.split_factor != below[d]:  # a symbolic factor: cannot reason about it
                return None
            splits[d].append(m)
        else:
            splits[d].insert(0, m)
        below[d] *= mesh[m]
    return Grid(mesh, tuple(int(r) for r in ranks), tuple(tuple(s) for s in splits))
