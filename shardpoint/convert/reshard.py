"""Offline resharding: a copy of a checkpoint whose chunks match a target layout.

Any shardpoint checkpoint loads into any layout, so resharding is never
required. A pre-sharded copy helps when one fixed layout loads the checkpoint
many times (evaluation fleets, inference servers): each target rank then reads
exactly one contiguous chunk per tensor, with no partial-chunk reads.

The target layout is a small spec: comma-separated ``KIND:N`` parts over a
writer grid of ``N1 x N2 x ...`` ranks (rank numbers are row-major over the
parts, first part outermost). Parts split each tensor left to right, every
split with ``torch.chunk`` sizes (``ceil(n / N)``), as DTensor's ``Shard``
does:

- ``fsdp:N`` (alias ``shard:N``): dim 0 over N ranks, like FSDP2's ``fully_shard``;
- ``tp:N``: tensor parallel over N ranks, on the dim given by the first
  matching ``tp_rules`` entry ``GLOB=DIM`` (``GLOB=replicate`` keeps a copy);
  without a match, tensors of 2 or more dims split on dim 0 and smaller ones
  are replicated;
- ``dp:N`` (alias ``replicate:N``): N replicas; each tensor is written once,
  by a replica chosen to balance the bytes;
- ``single``: one rank, one chunk per tensor.

``fsdp:4`` matches FSDP2 on 4 ranks; ``tp:2 --tp-rule '*.wo.weight=1'
--tp-rule '*.w2.weight=1'`` matches a column/row-parallel transformer;
``tp:2,fsdp:2`` matches FSDP2 over TP (FSDP splits the TP shard further, as
2-D FSDP2 does); ``dp:2,fsdp:2`` matches HSDP.

Example::

    reshard("ckpt/step_100", "ckpt/step_100-fsdp8", "fsdp:8")
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import ConversionError
from ..geometry import Box
from .common import CheckpointReader, CheckpointWriter
from .options import prepare_output_dir, progress

__all__ = ["TargetLayout", "parse_layout", "reshard", "ReshardResult"]

_KINDS = {"fsdp": "fsdp", "shard": "fsdp", "tp": "tp", "dp": "dp", "replicate": "dp"}


@dataclass(frozen=True)
class TargetLayout:
    """A parsed layout spec: ``parts`` of (kind, size) and TP rules of (glob, dim or None)."""

    parts: tuple[tuple[str, int], ...]
    tp_rules: tuple[tuple[str, int | None], ...] = ()

    @property
    def world(self) -> int:
        return math.prod(n for _, n in self.parts)

    def spec(self) -> str:
        return ",".join(f"{k}:{n}" for k, n in self.parts) or "single"

    def split_dim(self, kind: str, name: str, ndim: int) -> int | None:
        """The dim a part of ``kind`` splits tensor ``name`` on (``None``: replicated)."""
        if kind == "dp" or ndim == 0:
            return None
        if kind == "fsdp":
            return 0
        for pat, dim in self.tp_rules:
            if fnmatch.fnmatchcase(name, pat):
                if dim is not None and not -ndim <= dim < ndim:
                    raise ConversionError(f"tp rule {pat}={dim}: tensor {name!r} has only {ndim} dims")
                return None if dim is None else dim % ndim
        return 0 if ndim >= 2 else None

    def boxes(self, name: str, shape: Sequence[int]) -> list[tuple[tuple[int, ...], Box]]:
        """(grid coordinate, box) of every piece; a replicated part leaves its coordinate 0."""
        pieces: list[tuple[tuple[int, ...], Box]] = [((), Box.full(shape))]
        for kind, n in self.parts:
            dim = self.split_dim(kind, name, len(shape))
            nxt = []
            for coord, box in pieces:
                if dim is None:
                    nxt.append((coord + (None,), box))
                    continue
                size = box.sizes[dim]
                step = -(-size // n) if size else 0
                for i in range(n):
                    lo = min(i * step, size)
                    hi = min(lo + step, size)
                    if hi <= lo and size:
                        continue  # torch.chunk leaves trailing ranks empty
                    offs, sizes = list(box.offsets), list(box.sizes)
                    offs[dim] += lo
                    sizes[dim] = hi - lo
                    nxt.append((coord + (i,), Box(tuple(offs), tuple(sizes))))
                    if not size:
                        break
            pieces = nxt
        return pieces

    def rank_of(self, coord: tuple, replica: int) -> int:
        """Row-major rank of a grid coordinate; ``None`` entries (replicated) take digits of ``replica``."""
        rank = 0
        for (kind, n), c in zip(self.parts, coord):
            if c is None:
                c, replica = replica % n, replica // n
            rank = rank * n + c
        return rank


def parse_layout(spec: str, tp_rules: Sequence[str] = ()) -> TargetLayout:
    """Parse ``"fsdp:4"``, ``"tp:2,fsdp:2"``, ``"single"`` and ``GLOB=DIM`` TP rules."""
    parts = []
    text = (spec or "").strip()
    if text not in ("", "single"):
        for item in text.split(","):
            kind, _, num = item.strip().partition(":")
            if kind not in _KINDS or not num.isdigit() or int(num) < 1:
                raise ConversionError(
                    f"bad layout part {item!r} in {spec!r}: write KIND:N with KIND one of "
                    f"{', '.join(sorted(_KINDS))} and N >= 1 (e.g. fsdp:4 or tp:2,fsdp:2)"
                )
            parts.append((_KINDS[kind], int(num)))
    rules = []
    for r in tp_rules:
        pat, sep, dim = r.rpartition("=")
        if not sep or not pat:
            raise ConversionError(f"tp rule {r!r} must look like GLOB=DIM or GLOB=replicate")
        if dim == "replicate":
            rules.append((pat, None))
        else:
            try:
                rules.append((pat, int(dim)))
            except ValueError:
                raise ConversionError(f"tp rule {r!r}: {dim!r} is not a dim number or 'replicate'") from None
    layout = TargetLayout(tuple(parts), tuple(rules))
    if layout.world > 1 << 16:
        raise ConversionError(f"layout {spec!r} has {layout.world} ranks; at most 65536 are supported")
    return layout


@dataclass
class ReshardResult:
    """What a reshard wrote: the target spec, its ranks, chunks and bytes."""

    path: str
    spec: str
    world: int
    chunks: int = 0
    bytes: int = 0
    per_rank_bytes: dict[int, int] = field(default_factory=dict)


def reshard(
    path: str,
    out: str,
    layout: str | TargetLayout,
    *,
    tp_rules: Sequence[str] = (),
    block_size: int | None = None,
    force: bool = False,
    quiet: bool = True,
    verify: bool = True,
) -> ReshardResult:
    """Copy the checkpoint ``path`` to ``out`` with one chunk per target rank and tensor piece.

    Values (optimizer hyper-parameters, step counters, ...) and tensor names
    are kept, so ``out`` loads exactly like ``path``. Reads and writes go one
    piece at a time: peak memory is near the largest piece.
    """
    target = layout if isinstance(layout, TargetLayout) else parse_layout(layout, tp_rules)
    reader = CheckpointReader(path, verify=verify)
    m = reader.manifest
    if "://" not in out:
        prepare_output_dir(out, force)
    entries = dict(m.layout.get("entries", {})) if isinstance(m.layout, dict) else {}
    result = ReshardResult(out, target.spec(), target.world)
    load = [0] * target.world
    with CheckpointWriter(out, block_size=block_size or m.block_size, world_size=target.world,
                          layout={"offline_layout": target.spec()}) as w, progress(m.total_bytes, "reshard", quiet) as bar:
        for name in reader.names():
            meta = reader.meta(name)
            pieces = target.boxes(name, meta.shape)
            # A replicated piece has several candidate ranks: take the least loaded one.
            for coord, box in pieces:
                nrep = math.prod(n for (_, n), c in zip(target.parts, coord) if c is None)
                cands = [target.rank_of(coord, r) for r in range(nrep)]
                rank = min(cands, key=lambda r: (load[r], r))
                data = reader.read(name, box)
                nbytes = data.numel() * data.element_size()
                w.add(name, data, shape=meta.shape, box=box, rank=rank, placement=_placement(target, name, len(meta.shape)))
                load[rank] += nbytes
                result.chunks += 1
                result.bytes += nbytes
                bar.update(nbytes)
                del data
        for key, doc in m.values.items():
            w.set_value(key, doc, kind=entries.get(key, "values"))
        w.commit()
    result.per_rank_bytes = {r: b for r, b in enumerate(load)}
    return result


def _placement(target: TargetLayout, name: str, ndim: int) -> str:
    out = []
    for kind, n in target.parts:
        dim = target.split_dim(kind, name, ndim)
        out.append(f"{kind}:{n}=" + ("Replicate" if dim is None else f"Shard({dim})"))
    return ",".join(out) or "single"
