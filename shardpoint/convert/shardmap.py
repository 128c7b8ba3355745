"""Pictures and tables of how tensors are split among ranks.

:func:`chunk_table` lists one tensor's chunks (where each lies, which rank
wrote it, where its bytes are). :func:`plot_shard_map` draws a shard map: one
panel per tensor, showing the tensor as a rectangle of dim 0 (rows) by dim 1
(columns; all further dims are folded into the picture's depth and not drawn),
each chunk a box coloured by the rank that wrote it. A flat chunk (a
row-major element range, as FSDP1 and ZeRO store) is drawn as the rows it
covers. Needs ``matplotlib`` (``pip install 'shardpoint[plot]'``).

Example::

    plot_shard_map("ckpt/step_100", "shards.png", keys=["model.layers.0.*"])
"""

from __future__ import annotations

import fnmatch
from typing import Sequence

from ..errors import ConversionError
from ..runtime.extras import require
from ..format.manifest import ChunkMeta, Manifest, TensorMeta

__all__ = ["chunk_table", "plot_shard_map"]


def chunk_table(m: Manifest, name: str) -> list[dict]:
    """One row per chunk of tensor ``name``: geometry, writer rank, file, offset, bytes."""
    t = m.tensors.get(name)
    if t is None:
        close = [k for k in m.tensors if name.split(".")[-1] in k][:8]
        raise ConversionError(f"no tensor {name!r} in the checkpoint (similar: {close})")
    rows = []
    for i, c in enumerate(t.chunks):
        rows.append({
            "chunk": i,
            "offsets": list(c.box.offsets),
            "sizes": list(c.box.sizes),
            "flat": list(c.flat) if c.flat is not None else None,
            "rank": c.rank,
            "file": c.file,
            "offset": c.offset,
            "nbytes": c.nbytes,
            "blocks": len(c.checksums),
        })
    return rows


def _rects(t: TensorMeta, c: ChunkMeta) -> list[tuple[float, float, float, float]]:
    """(x, y, width, height) rectangles of a chunk in the tensor's (dim 1, dim 0) plane."""
    shape = list(t.shape) or [1]
    offs = list(c.box.offsets) or [0]
    sizes = list(c.box.sizes) or [1]
    if len(shape) == 1:
        shape, offs, sizes = [1] + shape, [0] + offs, [1] + sizes
    r0, nr, c0, nc = offs[0], sizes[0], offs[1], sizes[1]
    if c.flat is None:
        return [(c0, r0, nc, nr)]
    inner = max(1, c.box.numel // max(1, nr))  # elements per row of the box (dims >= 1)
    per_col = max(1, inner // max(1, nc))
    a, b = c.flat
    out = []
    row = a // inner
    while row * inner < b and row < nr:
        lo = max(a, row * inner) - row * inner
        hi = min(b, (row + 1) * inner) - row * inner
        out.append((c0 + lo / per_col, r0 + row, (hi - lo) / per_col, 1))
        row += 1
    return out


def plot_shard_map(
    m: Manifest,
    out: str,
    *,
    keys: Sequence[str] = (),
    max_tensors: int = 48,
    title: str = "",
) -> int:
    """Draw the shard map of the tensors of ``m`` (optionally filtered by globs) into ``out``.

    Returns the number of tensors drawn (the largest ``max_tensors`` first,
    then ordered by name).
    """
    matplotlib = require("matplotlib", "plot", "shard map plots (inspect --plot)")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "plot", "shard map plots (inspect --plot)")
    patches = require("matplotlib.patches", "plot", "shard map plots (inspect --plot)")
    Patch, Rectangle = patches.Patch, patches.Rectangle
    names = sorted(m.tensors)
    if keys:
        names = [n for n in names if any(fnmatch.fnmatchcase(n, k) for k in keys)]
    if not names:
        raise ConversionError("no tensor to plot")
    if len(names) > max_tensors:
        names = sorted(sorted(names, key=lambda n: -m.tensors[n].nbytes)[:max_tensors])
    ranks = sorted({c.rank for n in names for c in m.tensors[n].chunks})
    cmap = plt.get_cmap("tab20" if len(ranks) > 10 else "tab10")
    color = {r: cmap(i % cmap.N) for i, r in enumerate(ranks)}
    ncols = min(4, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.4 * nrows + 0.8), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        t = m.tensors[name]
        shape = list(t.shape) or [1]
        h, w = (shape[0], shape[1]) if len(shape) >= 2 else (1, shape[0])
        for c in t.chunks:
            for x, y, cw, ch in _rects(t, c):
                ax.add_patch(Rectangle((x, y), cw, ch, facecolor=color[c.rank], edgecolor="black", linewidth=0.6))
        ax.set_xlim(0, max(w, 1))
        ax.set_ylim(max(h, 1), 0)
        ax.set_xticks([])
        ax.set_yticks([])
        short = name if len(name) <= 38 else "..." + name[-35:]
        ax.set_title(f"{short}\n{t.dtype}{list(t.shape)}, {len(t.chunks)} chunk(s)", fontsize=7)
    handles = [Patch(facecolor=color[r], edgecolor="black", label=f"rank {r}") for r in ranks[:40]]
    fig.legend(handles=handles, loc="lower center", ncol=min(10, len(handles)), fontsize=7, frameon=False)
    fig.suptitle(title or f"shard map: {len(names)} of {len(m.tensors)} tensors, saved by {m.world_size} rank(s)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return len(names)
