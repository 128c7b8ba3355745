"""Scale on paper: shardpoint's save, manifest and load planning for a 70B model at up to 16,384 ranks.

No processes and no data I/O: only the library's metadata path runs, on an
in-memory storage. For every rank of a layout this builds the ``SaveTensor``
list the adapters would hand to ``prepare_save`` (boxes, replica index/count,
cost, replica group, and the ``grid`` a DTensor gets from
``grid_of_placements``), runs ``prepare_save``'s writer choice (fqn-keyed
``assign_writers``), lays out chunk records as ``write_chunks`` does (fake
offsets and checksums), and runs the real ``PreparedSave.summary``: it encodes
and stores the rank's binary index (``encode_index``), describes the rank's
tensors (``planning.describe``) and returns the fixed-size status. Rank 0's side
follows ``finish_save``: gather every status, ask one rank per distinct
descriptor digest for its descriptor, and run the real ``commit_save``. Then
``Manifest.from_json`` parses the version-2 manifest, and sampled target
ranks plan their loads with the real ``resolve`` (``IndexReader``: only the
writers' index files) and ``plan_chunk_reads``, same layout and resharded.

Per-rank work is timed on sampled ranks (every rank runs the same code in
parallel); every rank's index and status are still built, so the commit,
manifest and indexes are full size. Pipeline layouts are saved as with
``replicated_over=<the stage's ranks>``; ``--pp-check`` shows what happens
without it. Format version 1's numbers (one JSON manifest listing every
chunk) are kept in ``docs/scale.md`` as they were measured; that code
path no longer exists.

Usage::

    python bench/scale_sim.py              # full run, writes docs/scale.md and docs/scale.png
    python bench/scale_sim.py --quick      # smaller world sizes, prints the tables
    python bench/scale_sim.py --pp-check   # only the pipeline-parallel writer check
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import io
import json
import math
import os
import pickle
import platform
import pstats
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch

from shardpoint.adapters.base import AdapterContext, Replicas, global_cost
from shardpoint.engine.commit import CommitDecision, CommitTarget, commit_save
from shardpoint.dist import Outcome
from shardpoint.engine.indexes import IndexReader, resolve, wanted_box
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.datafile import DEFAULT_BLOCK_SIZE, block_count, padding
from shardpoint.format.manifest import MANIFEST_NAME, ChunkMeta, Manifest
from shardpoint.format.values import VALUE_TAG
from shardpoint.geometry import Box, even_chunks
from shardpoint.adapters.tensors import describe_placements
from shardpoint.geometry.grid import Grid, grid_of_placements
from shardpoint.items import LoadTarget, SaveTensor
from shardpoint.planning import assign_writers, choose_writers
from shardpoint.planning import commit as planning_commit
from shardpoint.planning import describe as planning_describe
from shardpoint.planning.commit import Documents, representatives
from shardpoint.planning.describe import Description, GridEntry, RankReport, RankStatus
from shardpoint.planning.writers import WriterChoice
from shardpoint.planning.save_plan import SavePlan
from shardpoint.saving.prepare import describe_on, plan_of, summarize
from shardpoint.planning.reads import ReadTarget, plan_chunk_reads
from shardpoint.storage.memory import MemoryStorage

SAVE_ID = "5ca1ab1e" * 4  # 32 hex digits, like uuid4().hex
DTYPE, ITEMSIZE = "float32", 4  # FSDP2 keeps fp32 sharded params; AdamW state is fp32 too
WHERE = "sim://scale"
_DATA = torch.empty(0, dtype=torch.float32)  # the metadata path reads only dtype and element size


# ----------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelSpec:
    """A Llama-3-70B-style decoder (torchtitan parameter names)."""

    layers: int = 80
    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 28672
    vocab: int = 128256


class Param(NamedTuple):
    name: str  # module-relative name
    shape: tuple[int, ...]
    style: str  # TP style: "col" (TP Shard(0)), "row" (TP Shard(1)), "rep" (Replicate over TP)
    layer: int  # -1: embedding (first stage), -2: final norm and head (last stage)


def model_params(m: ModelSpec) -> list[Param]:
    """Parameters in ``named_parameters`` order."""
    h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    out = [Param("tok_embeddings.weight", (m.vocab, h), "col", -1)]  # RowwiseParallel on an Embedding shards dim 0
    for i in range(m.layers):
        p = f"layers.{i}."
        out += [
            Param(p + "attention.wq.weight", (q, h), "col", i),
            Param(p + "attention.wk.weight", (kv, h), "col", i),
            Param(p + "attention.wv.weight", (kv, h), "col", i),
            Param(p + "attention.wo.weight", (h, q), "row", i),
            Param(p + "feed_forward.w1.weight", (m.ffn, h), "col", i),
            Param(p + "feed_forward.w2.weight", (h, m.ffn), "row", i),
            Param(p + "feed_forward.w3.weight", (m.ffn, h), "col", i),
            Param(p + "attention_norm.weight", (h,), "rep", i),
            Param(p + "ffn_norm.weight", (h,), "rep", i),
        ]
    out += [Param("norm.weight", (h,), "rep", -2), Param("output.weight", (m.vocab, h), "col", -2)]
    return out


class TensorSpec(NamedTuple):
    """One saved tensor: a parameter or one of its AdamW states."""

    fqn: str
    shape: tuple[int, ...]
    style: str  # as Param.style, or "scalar" for the plain ``step`` tensor
    layer: int
    param: str  # the parameter's fqn


def state_tensors(m: ModelSpec) -> list[TensorSpec]:
    """Everything a ``{"model": model, "optim": AdamW}`` save stores, in save order."""
    params = model_params(m)
    out = [TensorSpec(f"model.{p.name}", p.shape, p.style, p.layer, f"model.{p.name}") for p in params]
    for p in params:  # AdamW state dict order: step, exp_avg, exp_avg_sq
        fq = f"model.{p.name}"
        out.append(TensorSpec(f"optim.state.{fq}.step", (), "scalar", p.layer, fq))
        out.append(TensorSpec(f"optim.state.{fq}.exp_avg", p.shape, p.style, p.layer, fq))
        out.append(TensorSpec(f"optim.state.{fq}.exp_avg_sq", p.shape, p.style, p.layer, fq))
    return out


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """TP x PP x DP on a (pp, dp, tp) mesh, tp innermost; FSDP2 shards dim 0 over dp.

    ``tp == pp == 1`` is plain FSDP2 over ``dp`` ranks.
    """

    tp: int
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        if self.tp == 1 and self.pp == 1:
            return f"FSDP2 {self.dp}"
        return f"TP{self.tp} PP{self.pp} DP{self.dp}"

    @property
    def mesh(self) -> tuple[int, ...]:
        """The stage's DTensor mesh: (dp, tp), or (dp,) without TP."""
        return (self.dp, self.tp) if self.tp > 1 else (self.dp,)

    def coords(self, rank: int) -> tuple[int, int, int]:
        p, rest = divmod(rank, self.dp * self.tp)
        d, t = divmod(rest, self.tp)
        return p, d, t

    def stage_ranks(self, p: int) -> range:
        n = self.dp * self.tp
        return range(p * n, (p + 1) * n)

    def stage(self, layer: int, layers: int) -> int:
        if layer == -1:
            return 0
        if layer == -2:
            return self.pp - 1
        return layer // (layers // self.pp)

    def placements(self, style: str) -> tuple[str, ...]:
        """DTensor placements on the (dp, tp) mesh, as FSDP2 over TP produces them."""
        if style == "scalar":
            return ()
        if self.tp == 1:
            return ("S0",)
        return {"col": ("SS0", "S0"), "row": ("S0", "S1"), "rep": ("S0", "R")}[style]


@functools.cache
def _chunks(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    return tuple(even_chunks(n, parts))


@functools.lru_cache(maxsize=1 << 16)
def shard_box(shape: tuple[int, ...], style: str, lay: Layout, d: int, t: int) -> Box:
    """The box of the (dp=d, tp=t) shard, like ``compute_local_shape_and_global_offset``.

    Empty shards sit at offset ``shape[dim]``, as torch reports them. Cached:
    equal boxes share one frozen ``Box``.
    """
    if style == "scalar":
        return Box((), ())
    if style == "row" and lay.tp > 1:
        lo0, n0 = _chunks(shape[0], lay.dp)[d]
        lo1, n1 = _chunks(shape[1], lay.tp)[t]
        return Box((lo0 if n0 else shape[0], lo1 if n1 else shape[1]), (n0, n1))
    if style == "col" and lay.tp > 1:
        lo1, n1 = _chunks(shape[0], lay.tp)[t]
        lo0, n0 = _chunks(n1, lay.dp)[d]
        off = lo1 + lo0 if n0 else shape[0]
    else:  # dim-0 over dp only ("rep" is replicated over tp)
        lo0, n0 = _chunks(shape[0], lay.dp)[d]
        off = lo0 if n0 else shape[0]
    return Box((off,) + (0,) * (len(shape) - 1), (n0,) + tuple(shape[1:]))


_TORCH_PLACEMENTS: dict = {}


def torch_placements(lay: Layout, style: str) -> list:
    """Real torch placement objects for ``style`` (cached)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    key = (lay.placements(style), lay.tp)
    pl = _TORCH_PLACEMENTS.get(key)
    if pl is None:
        make = {"S0": lambda: Shard(0), "S1": lambda: Shard(1), "R": Replicate, "SS0": lambda: _StridedShard(0, split_factor=lay.tp)}
        pl = _TORCH_PLACEMENTS[key] = [make[p]() for p in key[0]]
    return pl


def torch_shard_box(shape: tuple[int, ...], style: str, lay: Layout, d: int, t: int) -> Box:
    """The same box from torch's own ``compute_local_shape_and_global_offset`` (what the adapter calls)."""
    from shardpoint.runtime.torchcompat import local_shape_and_offset

    if style == "scalar":
        return Box((), ())
    coord = [d, t] if lay.tp > 1 else [d]
    sizes, offs = local_shape_and_offset(shape, lay.mesh, coord, torch_placements(lay, style))
    return Box(tuple(int(o) for o in offs), tuple(int(s) for s in sizes))


_SPLITS = {"col": ((1, 0),), "row": ((0,), (1,)), "rep": ((0,),)}  # tensor dim -> mesh dims, outermost first


@functools.lru_cache(maxsize=4096)
def stage_grid(lay: Layout, p: int, style: str, ndim: int) -> Grid:
    """Closed form of ``grid_of_placements`` for a stage's DTensors (one shared ``Grid`` per stage and style)."""
    base = ((0,),) if lay.tp == 1 else _SPLITS[style]
    return Grid(lay.mesh, _stage_tuple(lay, p), base + ((),) * (ndim - len(base)))


def torch_grid(lay: Layout, p: int, style: str, ndim: int) -> Grid | None:
    """The grid the adapter builds: ``grid_of_placements`` over real torch placement objects."""
    return grid_of_placements(lay.mesh, tuple(lay.stage_ranks(p)), describe_placements(torch_placements(lay, style)), ndim)


@functools.lru_cache(maxsize=256)
def _stage_tuple(lay: Layout, p: int) -> tuple[int, ...]:
    return tuple(lay.stage_ranks(p))


@functools.lru_cache(maxsize=256)
def _stage_set(lay: Layout, p: int) -> frozenset[int]:
    return frozenset(lay.stage_ranks(p))


def stage_specs(specs: list[TensorSpec], m: ModelSpec, lay: Layout) -> list[list[TensorSpec]]:
    """The tensors of each pipeline stage, in save order (cached per layout)."""
    key = (_SpecsKey(specs), m, lay.pp)
    got = _STAGE_CACHE.get(key)
    if got is None:
        got = [[] for _ in range(lay.pp)]
        for s in specs:
            got[lay.stage(s.layer, m.layers)].append(s)
        _STAGE_CACHE.clear()
        _STAGE_CACHE[key] = got
    return got


_STAGE_CACHE: dict = {}


class _SpecsKey:
    """Hashes a spec list by identity, for caches keyed on it."""

    __slots__ = ("specs",)

    def __init__(self, specs: list[TensorSpec]):
        self.specs = specs

    def __hash__(self) -> int:
        return id(self.specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SpecsKey) and other.specs is self.specs


# ----------------------------------------------------------------------------- one rank's save
def _replicated_over(lay: Layout, mode: str) -> bool:
    """``mode="pp-aware"``: pipeline layouts pass ``replicated_over=<stage ranks>``; ``"adapters"``: nothing."""
    return mode == "pp-aware" and lay.pp > 1


def rank_context(lay: Layout, rank: int, mode: str) -> AdapterContext:
    """The real ``AdapterContext``, as ``build_context`` makes it from ``replicated_over``."""
    replicas = {}
    if _replicated_over(lay, mode):
        p, d, t = lay.coords(rank)
        r = Replicas(d * lay.tp + t, lay.dp * lay.tp, _stage_set(lay, p))
        replicas = {"model": r, "optim": r}
    return AdapterContext(rank, lay.world, {}, replicas=replicas)


@functools.lru_cache(maxsize=64)
def _templates(specs_key, m: ModelSpec, lay: Layout, p: int, mode: str) -> tuple:
    """Rank-independent facts of a stage's tensors: fqn, shape, style, is scalar, replicated over tp, cost, label, grid."""
    out = []
    outside = lay.pp if mode == "adapters" and lay.pp > 1 else 1  # _replication_outside's count
    for s in stage_specs(specs_key.specs, m, lay)[p]:
        if s.style == "scalar":
            out.append((s.fqn, s.shape, s.style, True, False, float(ITEMSIZE), "", None))
            continue
        rep = s.style == "rep" and lay.tp > 1
        cost = global_cost(s.shape, ITEMSIZE, outside * (lay.tp if rep else 1), lay.world)
        label = f"dtensor{tuple(torch_placements(lay, s.style))}"
        grid = stage_grid(lay, p, s.style, len(s.shape)) if outside == 1 else None  # adapter: no grid with copies outside the mesh
        out.append((s.fqn, s.shape, s.style, False, rep, cost, label, grid))
    return tuple(out)


def rank_tensors(specs, m: ModelSpec, lay: Layout, rank: int, mode: str = "pp-aware", exact: bool = False) -> list[SaveTensor]:
    """The ``SaveTensor`` list of one rank, as the adapters build it (``data`` is an empty stand-in).

    ``exact=True`` does what the adapter does: torch's box and the grid from
    ``grid_of_placements`` over real placements (once per placements and
    shape, as its geometry cache does), and the context's ``replica_group`` /
    ``plain_replica`` per tensor; otherwise closed forms, cached.
    ``mode="adapters"``: no ``replicated_over``, so a DTensor on a stage's
    sub-mesh counts the pp dim as copies (``_replication_outside``) and gets no
    grid, and ``step`` counts the whole world as copies.
    """
    p, d, t = lay.coords(rank)
    rep_over = _replicated_over(lay, mode)
    ctx = rank_context(lay, rank, mode) if exact else None
    group = ",".join(map(str, _stage_tuple(lay, p))) if rep_over else ""
    geo: dict = {}  # the adapter's geometry cache: one torch computation per (placements, shape) on a rank
    out = []
    for fqn, shape, style, scalar, rep, cost, label, grid in _templates(_SpecsKey(specs), m, lay, p, mode):
        if exact:
            group = ctx.replica_group(fqn)
        if scalar:
            idx, cnt = ctx.plain_replica(fqn) if exact else ((d * lay.tp + t, lay.dp * lay.tp) if rep_over else (rank, lay.world))
            out.append(SaveTensor(fqn, _DATA, shape, Box((), ()), None, idx, cnt, cost, "replicated" if cnt > 1 else "local", group))
            continue
        idx, cnt = (p, lay.pp) if mode == "adapters" and lay.pp > 1 else (0, 1)
        if rep:
            idx, cnt = idx * lay.tp + t, cnt * lay.tp
        if exact:
            hit = geo.get((style, shape))
            if hit is None:
                g = torch_grid(lay, p, style, len(shape)) if grid is not None else None
                hit = geo[(style, shape)] = (torch_shard_box(shape, style, lay, d, t), g)
            box, grid = hit
        else:
            box = shard_box(shape, style, lay, d, t)
        out.append(SaveTensor(fqn, _DATA, shape, box, None, idx, cnt, cost, label, group, grid))
    return out


def same_tensors(a: list[SaveTensor], b: list[SaveTensor]) -> bool:
    """Field by field, ignoring the data stand-in."""
    key = lambda t: (t.fqn, t.shape, t.box, t.flat, t.replica_index, t.replica_count, t.cost, t.placement, t.replica_group, t.grid)
    return [key(t) for t in a] == [key(t) for t in b]


def pick_mine(tensors: list[SaveTensor], assign: Callable = assign_writers) -> tuple[list[SaveTensor], WriterChoice]:
    """``prepare_save``'s writer choice: the library's own ``choose_writers``."""
    choice = choose_writers(tensors, assign)
    return [tensors[i] for i in choice.picked], choice


def _memo_assign(memo: dict) -> Callable:
    """``assign_writers`` memoised on its input: ranks of one replica group see the same items."""

    def assign(items):
        items = tuple(items)
        got = memo.get(items)
        if got is None:
            got = memo[items] = assign_writers(items)
        return got

    return assign


class _GridMemo:
    """Stands in for the planners' ``Grid`` in the bulk: equal arguments give one shared (immutable) ``Grid``.

    ``CandidateGrids`` builds a new replica grid per plain tensor, O(group size)
    each; sampled ranks are timed without this, every other rank with it.
    """

    def __init__(self):
        self.cache: dict = {}

    def __call__(self, mesh_shape, ranks, splits):
        key = (tuple(mesh_shape), tuple(ranks), tuple(splits))
        g = self.cache.get(key)
        if g is None:
            g = self.cache[key] = Grid(mesh_shape, ranks, splits)
        return g


@contextlib.contextmanager
def memo_grids():
    memo = _GridMemo()
    orig = planning_describe.Grid, planning_commit.Grid
    planning_describe.Grid = planning_commit.Grid = memo
    try:
        yield
    finally:
        planning_describe.Grid, planning_commit.Grid = orig


def data_file(rank: int) -> str:
    return f"data/{SAVE_ID}-r{rank:05d}.bin"


def fake_records(rank: int, mine: list[SaveTensor], block: int) -> tuple[list[tuple[str, ChunkMeta]], int]:
    """Chunk records as ``write_chunks`` makes them: 64-byte aligned offsets, one fake checksum per block."""
    name = data_file(rank)
    pos, recs = 0, []
    for k, t in enumerate(mine):
        nbytes = t.box.numel * ITEMSIZE
        pos += padding(pos)
        n = block_count(nbytes, block)
        seed = (rank * 1_000_003 + k * 7919) & 0xFFFFFFFFFFFF
        sums = tuple(f"{seed:012x}{j & 0xFFFF:04x}" for j in range(n))
        recs.append((t.fqn, ChunkMeta(t.box, name, pos, nbytes, sums, None, rank)))
        pos += nbytes
    return recs, pos


def _ref(path: str) -> dict:
    return {VALUE_TAG: "tensor", "key": path}


_VALUES: dict = {}


def stage_values(specs, m: ModelSpec, lay: Layout, p: int) -> tuple[dict, dict]:
    """The values and layout documents of a stage's ranks (AdamW's state_dict skeleton), built once per stage."""
    key = (id(specs), m, lay, p)
    got = _VALUES.get(key)
    if got is None:
        params = [s.fqn for s in stage_specs(specs, m, lay)[p] if s.fqn.startswith("model.")]
        hyper = {
            "lr": 3e-4, "betas": {VALUE_TAG: "tuple", "v": [0.9, 0.95]}, "eps": 1e-8, "weight_decay": 0.1,
            "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": True,
        }
        state = {q: {k: _ref(f"optim.state.{q}.{k}") for k in ("step", "exp_avg", "exp_avg_sq")} for q in params}
        values = {"model": {}, "optim": {"groups": [hyper], "group_of": {q: 0 for q in params}, "state": state}}
        got = (values, {"model": "fsdp2", "optim": "optimizer:AdamW"})
        if len(_VALUES) > 64:
            _VALUES.clear()
        _VALUES[key] = got
    return got


class SimComm:
    """What ``describe_on`` and ``summarize`` read from a ``Comm``: rank, world, group (``None``: global ranks)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.group = rank, world, None


def plan_rank(specs, m: ModelSpec, lay: Layout, rank: int, mode: str = "pp-aware", assign: Callable = assign_writers,
              exact: bool = False) -> SavePlan:
    """One rank's ``prepare_save``: its tensors, what it writes, and its documents."""
    tensors = rank_tensors(specs, m, lay, rank, mode, exact)
    mine, choice = pick_mine(tensors, assign)
    values, layout = stage_values(specs, m, lay, lay.coords(rank)[0])
    return _plan(tensors, mine, choice, (values, layout), rank_context(lay, rank, mode))


def _plan(tensors, mine, choice, docs, ctx) -> SavePlan:
    """The real ``SavePlan`` of a simulated rank; ``mine`` is what ``choice`` picks."""
    plan = plan_of(tensors, choice, frozenset(), ctx).for_save(*docs, context=ctx)
    assert len(plan.mine) == len(mine) and all(a is b for a, b in zip(plan.mine, mine))
    return plan


def finish_rank(storage, prep: SavePlan, rank: int, world: int, block: int) -> tuple[RankReport, list]:
    """After the (simulated) data file: the real ``summary`` writes the index and describes the rank."""
    records, files = [], {}
    if prep.mine:
        records, size = fake_records(rank, prep.mine, block)
        files[data_file(rank)] = size
    return summarize(prep, storage, (records, files), SimComm(rank, world)), records


# ----------------------------------------------------------------------------- measuring
@dataclass
class Cost:
    """CPU seconds (this process), wall seconds, and the tracemalloc peak above the start (bytes)."""

    cpu: float = 0.0
    wall: float = 0.0
    peak: int | None = None


def measure(fn: Callable[[], Any], trace: bool = False, gc_paused: bool = False) -> tuple[Any, Cost]:
    """Run ``fn`` once; with ``trace`` also record its tracemalloc peak (slower).

    ``gc_paused`` runs it with automatic garbage collection off, as the
    engine's ``execute_reads`` runs load planning: in this simulation's large
    heap a full collection landing inside the step would otherwise dominate it.
    """
    was = gc.isenabled()
    if gc_paused:
        gc.disable()
    if trace:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    c0, w0 = time.process_time(), time.perf_counter()
    try:
        out = fn()
    finally:
        c1, w1 = time.process_time(), time.perf_counter()
        if gc_paused and was:
            gc.enable()
        peak = None
        if trace:
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
    return out, Cost(c1 - c0, w1 - w0, peak)


def best_of(fn: Callable[[], Any], n: int = 3) -> tuple[Any, Cost]:
    """The fastest of ``n`` runs, for millisecond steps where one garbage collection would dominate."""
    runs = [measure(fn) for _ in range(n)]
    return runs[0][0], min((c for _, c in runs), key=lambda c: c.cpu)


def profile_top(fn: Callable[[], Any], n: int = 8) -> tuple[Any, list[tuple[str, float, int]]]:
    """Run ``fn`` under cProfile; the ``n`` functions with the most own time (name, seconds, calls)."""
    prof = cProfile.Profile()
    out = prof.runcall(fn)
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (cc, nc, tt, ct, callers) in st.stats.items():  # type: ignore[attr-defined]
        where = file.replace("\\", "/")
        for marker in ("shardpoint/", "bench/", "json/"):
            if marker in where:
                where = where[where.index(marker):]
                break
        else:
            where = os.path.basename(where)
        rows.append((f"{name} ({where}:{line})" if line else name, tt, nc))
    rows.sort(key=lambda r: -r[1])
    return out, rows[:n]


def sample_ranks(lay: Layout, n: int, rng: random.Random) -> list[int]:
    """First, middle and last pipeline stages (embedding and head live at the ends), random dp/tp."""
    stages = sorted({0, lay.pp // 2, lay.pp - 1})
    out = []
    for k in range(n):
        p = stages[k % len(stages)]
        d, t = rng.randrange(lay.dp), rng.randrange(lay.tp)
        out.append((p * lay.dp + d) * lay.tp + t)
    return sorted(set(out))


def _mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# ----------------------------------------------------------------------------- save
@dataclass
class Saved:
    """Everything rank 0 holds after the gathers, and what the simulation keeps for checks."""

    storage: MemoryStorage
    statuses: list[RankStatus]
    docs: list[Documents]
    status_blobs: list[bytes]
    doc_blobs: list[bytes]
    chunks: int = 0
    index_bytes: int = 0
    index_max: int = 0
    tdigs: int = 0
    vdigs: int = 0
    written: dict = field(default_factory=dict)  # fqn -> elements written, over all ranks
    records: dict = field(default_factory=dict)  # fqn -> its v1 records, for the checked tensors


def save_all(specs, m: ModelSpec, lay: Layout, block: int, mode: str = "pp-aware", check: set[str] | frozenset = frozenset(),
             storage: MemoryStorage | None = None) -> Saved:
    """Every rank: plan, records, real ``summary``; then rank 0's two gathers as ``finish_save`` runs them."""
    storage = MemoryStorage() if storage is None else storage
    assign = _memo_assign({})
    out = Saved(storage, [], [], [], [])
    want_t: dict[str, int] = {}
    want_v: dict[str, int] = {}
    with memo_grids():  # simulation speed only; see _GridMemo
        for r in range(lay.world):
            prep = plan_rank(specs, m, lay, r, mode, assign)
            local, records = finish_rank(storage, prep, r, lay.world, block)
            st = local.status
            out.statuses.append(st)
            out.status_blobs.append(pickle.dumps(Outcome(True, st)))
            first_t = want_t.setdefault(st.tensors_digest, r) == r
            first_v = want_v.setdefault(st.values_digest, r) == r
            doc = Documents(local.tensors if first_t else None, local.values if first_v else None)
            out.docs.append(doc)
            out.doc_blobs.append(pickle.dumps(doc))
            out.chunks += len(records)
            if st.index is not None:
                n = st.files[st.index.index]
                out.index_bytes += n
                out.index_max = max(out.index_max, n)
            for t in prep.mine:
                out.written[t.fqn] = out.written.get(t.fqn, 0) + t.box.numel
            for fqn, c in records:
                if fqn in check:
                    out.records.setdefault(fqn, []).append(c)
    out.tdigs, out.vdigs = len(want_t), len(want_v)
    return out


def decision_blob(saved: Saved) -> bytes:
    """What rank 0 broadcasts between the gathers: which ranks send their descriptors."""
    return pickle.dumps(CommitDecision(representatives(saved.statuses)))


def rank0_unpickle(saved: Saved) -> None:
    """Rank 0's side of the two ``gather_object`` calls."""
    for b in saved.status_blobs:
        pickle.loads(b)
    for b in saved.doc_blobs:
        pickle.loads(b)


def commit(saved: Saved, lay: Layout, block: int, storage=None, where: str = WHERE) -> str:
    target = CommitTarget(saved.storage if storage is None else storage, SAVE_ID, block, where)
    return commit_save(target, lay.world, saved.statuses, saved.docs)


@dataclass
class SaveResult:
    layout: Layout
    sampled: list[int]
    tensors_per_rank: float = 0.0
    chunks_per_rank: float = 0.0
    geometry: list[Cost] = field(default_factory=list)  # per sampled rank: torch boxes and grids, as the adapter computes them
    assign: list[Cost] = field(default_factory=list)  # prepare_save's writer choice
    summary: list[Cost] = field(default_factory=list)  # real summary: encode_index + store + describe + digests
    describe: list[Cost] = field(default_factory=list)  # of which describe
    describe_fixed: list[Cost] = field(default_factory=list)  # describe with replica grids built once (_GridMemo)
    bulk: Cost = field(default_factory=Cost)  # simulation: every rank's plan + summary
    saved: Saved | None = None
    gather_bytes: int = 0  # statuses + descriptors, pickled, over all ranks
    status_bytes: int = 0
    doc_bytes: int = 0
    decision_bytes: int = 0
    unpickle: Cost = field(default_factory=Cost)
    commit: Cost = field(default_factory=Cost)
    manifest_bytes: int = 0
    parse: Cost = field(default_factory=Cost)
    tensors: int = 0
    grids: int = 0
    chunks_checked: int = 0
    profiles: dict = field(default_factory=dict)


def time_rank(specs, m: ModelSpec, lay: Layout, r: int, block: int) -> tuple[dict, list, list]:
    """One rank's save work, timed step by step: adapter geometry, writer choice, ``describe``, the whole ``summary``."""
    tensors, c_geo = measure(partial(rank_tensors, specs, m, lay, r, "pp-aware", True))
    assert same_tensors(tensors, rank_tensors(specs, m, lay, r)), f"closed-form geometry differs from torch's on rank {r}"
    (mine, choice), c_asg = measure(partial(pick_mine, tensors))
    values, layout = stage_values(specs, m, lay, lay.coords(r)[0])
    prep = _plan(tensors, mine, choice, (values, layout), rank_context(lay, r, "pp-aware"))
    desc, c_desc = best_of(partial(describe_on, prep, SimComm(r, lay.world)))
    desc2, c_fix = best_of(partial(_describe_memo, prep, SimComm(r, lay.world)))
    assert desc.digest == desc2.digest, "the grid memo changed a descriptor"
    records, size = fake_records(r, mine, block)  # write_chunks' records, outside the timing
    _, c_sum = best_of(partial(_fresh_summary, prep, records, {data_file(r): size} if mine else {}, SimComm(r, lay.world)))
    costs = {"geometry": c_geo, "assign": c_asg, "describe": c_desc, "describe_fixed": c_fix, "summary": c_sum}
    return costs, tensors, mine


def _fresh_summary(prep: SavePlan, records: list, files: dict, comm: SimComm) -> RankReport:
    return summarize(prep, MemoryStorage(), (records, files), comm)  # no cache: a first save's description


def probe(specs, m: ModelSpec, lay: Layout, rng: random.Random) -> dict:
    """Per-rank save work only (no bulk, commit or load), for world sizes too big to build every rank of."""
    r = sample_ranks(lay, 1, rng)[0]
    c, tensors, mine = time_rank(specs, m, lay, r, DEFAULT_BLOCK_SIZE)
    return {"layout": lay.name, "ranks": lay.world, "rank": r, "tensors_per_rank": len(tensors), "chunks_per_rank": len(mine),
            **{f"{k}_s": v.cpu for k, v in c.items()}}


def run_save(specs, m: ModelSpec, lay: Layout, block: int, sample: list[int], check: set[str], profile: bool) -> tuple[SaveResult, Manifest]:
    """Sampled ranks timed, every rank built, then the real commit and parse (timed and traced)."""
    res = SaveResult(lay, sample)
    # 1. Sampled ranks: the per-rank work, timed one rank at a time.
    for r in sample:
        c, tensors, mine = time_rank(specs, m, lay, r, block)
        res.geometry.append(c["geometry"])
        res.assign.append(c["assign"])
        res.describe.append(c["describe"])
        res.describe_fixed.append(c["describe_fixed"])
        res.summary.append(c["summary"])
        res.tensors_per_rank += len(tensors) / len(sample)
        res.chunks_per_rank += len(mine) / len(sample)

    # 2. Every rank (closed-form geometry, assign_writers memoised per replica group).
    saved, res.bulk = measure(partial(save_all, specs, m, lay, block, "pp-aware", check))
    res.saved = saved
    want = {s.fqn: math.prod(s.shape) for s in specs}
    assert saved.written == want, "some tensor is not written exactly once"
    res.status_bytes = sum(map(len, saved.status_blobs))
    res.doc_bytes = sum(map(len, saved.doc_blobs))
    res.decision_bytes = len(decision_blob(saved))
    res.gather_bytes = res.status_bytes + res.doc_bytes
    _, res.unpickle = best_of(partial(rank0_unpickle, saved))

    # 3. The coordinator: the real commit_save (on the storage holding every index, so its cleanup lists them all).
    if profile:
        _, res.profiles["commit"] = profile_top(partial(commit, saved, lay, block, MemoryStorage()))
    _, res.commit = best_of(partial(commit, saved, lay, block))
    res.commit.peak = measure(partial(commit, saved, lay, block, MemoryStorage()), trace=True)[1].peak
    data = saved.storage.get(MANIFEST_NAME)
    res.manifest_bytes = len(data)

    # 4. Every rank parses the manifest.
    if profile:
        _, res.profiles["parse"] = profile_top(lambda: Manifest.from_json(data))
    man, res.parse = best_of(lambda: Manifest.from_json(data))
    res.parse.peak = measure(lambda: Manifest.from_json(data), trace=True)[1].peak
    res.tensors = len(man.tensors)
    res.grids = sum(1 for t in man.tensors.values() if t.grid is not None)

    # 5. v2 chunks, resolved from the indexes, equal the records the ranks wrote (format version 1's chunk list).
    reader = IndexReader(saved.storage, man, WHERE)
    for fqn in sorted(check):
        shape = man.tensors[fqn].shape
        got = sorted(reader.chunks(fqn), key=_chunk_key)
        want_c = sorted((c for c in saved.records[fqn] if c.numel > 0 or not shape), key=_chunk_key)
        if got != want_c:
            raise AssertionError(f"{fqn}: chunks resolved from the indexes differ from the written records")
        res.chunks_checked += len(got)
    return res, man


def _describe_memo(prep: SavePlan, comm: SimComm) -> Description:
    with memo_grids():  # a fresh memo: what a per-process cache would cost on a first save
        return describe_on(prep, comm)


def _chunk_key(c: ChunkMeta) -> tuple:
    return (c.box.offsets, c.box.sizes, c.rank, c.offset)


# ----------------------------------------------------------------------------- load
def load_targets(specs, m: ModelSpec, lay: Layout, rank: int) -> list[ReadTarget]:
    p, d, t = lay.coords(rank)
    return [ReadTarget(s.fqn, DTYPE, s.shape, shard_box(s.shape, s.style, lay, d, t)) for s in stage_specs(specs, m, lay)[p]]


class CountingStorage:
    """Forwards the metadata reads ``IndexReader`` makes and counts the index files and bytes read."""

    def __init__(self, base):
        self.base, self.files, self.bytes = base, 0, 0

    def _count(self, data: bytes) -> bytes:
        self.files += 1
        self.bytes += len(data)
        return data

    def get(self, name: str) -> bytes:
        return self._count(self.base.get(name))

    def get_limited(self, name: str, limit: int) -> bytes:
        return self._count(self.base.get_limited(name, limit))


def plan_load(storage, man: Manifest, targets: list[ReadTarget]) -> tuple[Manifest, list, CountingStorage]:
    """One rank's load planning, as ``load``'s read step runs it: ``resolve`` then ``plan_chunk_reads``."""
    wants: dict[str, list[Box]] = {}
    for t in targets:
        wants.setdefault(t.fqn, []).append(wanted_box(t.box, t.flat))
    cs = CountingStorage(storage)
    resolved = resolve(cs, man, wants, WHERE)
    reads = plan_chunk_reads(resolved, targets, WHERE, True)
    return resolved, reads, cs


@dataclass
class LoadResult:
    source: Layout
    target: Layout
    sampled: list[int]
    resolve: list[Cost] = field(default_factory=list)  # real resolve (index reads, parse, lookups)
    plan: list[Cost] = field(default_factory=list)  # real plan_chunk_reads on the resolved manifest
    peak: int | None = None
    targets: list[int] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)  # chunk spans (ChunkRead) per rank
    chunks: list[int] = field(default_factory=list)  # chunks resolved per rank
    index_files: list[int] = field(default_factory=list)
    index_bytes: list[int] = field(default_factory=list)
    checked: int = 0
    profiles: dict = field(default_factory=dict)


def run_load(specs, m: ModelSpec, saved: Saved, man: Manifest, src: Layout, tgt: Layout, sample: list[int], profile: bool) -> LoadResult:
    res = LoadResult(src, tgt, sample)
    for i, r in enumerate(sample):
        targets = load_targets(specs, m, tgt, r)
        if profile and i == 0:
            _, res.profiles["load"] = profile_top(partial(plan_load, saved.storage, man, targets))
        wants: dict[str, list[Box]] = {}
        for t in targets:
            wants.setdefault(t.fqn, []).append(wanted_box(t.box, t.flat))
        cs = CountingStorage(saved.storage)
        resolved, c_res = measure(partial(resolve, cs, man, wants, WHERE))
        reads, c_plan = measure(partial(plan_chunk_reads, resolved, targets, WHERE, True), gc_paused=True)
        res.resolve.append(c_res)
        res.plan.append(c_plan)
        res.targets.append(len(targets))
        res.reads.append(len(reads))
        res.chunks.append(sum(len(resolved.tensors[f].chunks) for f in wants))
        res.index_files.append(cs.files)
        res.index_bytes.append(cs.bytes)
        for fqn, boxes in wants.items():  # the resolved chunks are exactly the written ones touching the target
            if fqn in saved.records:
                want = [c for c in saved.records[fqn] if any(_touches(c.box, b) for b in boxes)]
                if sorted(resolved.tensors[fqn].chunks, key=_chunk_key) != sorted(want, key=_chunk_key):
                    raise AssertionError(f"{fqn}: resolved chunks differ from the written ones on target rank {r}")
                res.checked += len(want)
    targets = load_targets(specs, m, tgt, sample[0])
    res.peak = measure(partial(plan_load, saved.storage, man, targets), trace=True)[1].peak
    return res


def _touches(a: Box, b: Box) -> bool:
    r = a.intersect(b)
    return r is not None and r.numel > 0


# ----------------------------------------------------------------------------- pipeline-parallel writer check
def pp_check(specs, m: ModelSpec, lay: Layout) -> dict:
    """Save every rank of ``lay`` as the adapters describe it without ``replicated_over``.

    A DTensor on a stage's (dp, tp) sub-mesh counts the pp dim as copies, so
    it gets no grid and its chunks are listed by holder; ``step`` counts the
    whole world as copies and gets a world-sized grid. The writer choice then
    picks copies on stages that hold other layers. Returns how many tensors
    end up short, how they were described, and what the real ``commit_save`` says.
    """
    saved = save_all(specs, m, lay, DEFAULT_BLOCK_SIZE, mode="adapters")
    short = [s for s in specs if saved.written.get(s.fqn, 0) < math.prod(s.shape)]
    over = sum(1 for s in specs if saved.written.get(s.fqn, 0) > math.prod(s.shape))
    # How each tensor was described (the representatives' descriptors), and whether its grid's writer wrote it.
    gridded: dict[str, tuple] = {}
    listed: set[str] = set()
    for d in saved.docs:
        if d.tensors is None:
            continue
        meshes = d.tensors.meshes
        for fqn, e in d.tensors.tensors.items():
            if not isinstance(e, GridEntry):
                listed.add(fqn)
            else:
                gridded[fqn] = (Grid(meshes[e.mesh].shape, meshes[e.mesh].ranks, e.splits), e.copy, e.shape)
    short_names = {s.fqn for s in short}
    grid_lost = sorted(f for f in gridded if f in short_names)
    try:
        commit(saved, lay, DEFAULT_BLOCK_SIZE, where="sim://pp-check")
        error = ""
    except CorruptCheckpointError as e:
        error = str(e)
    return {"layout": lay.name, "tensors": len(specs), "short": len(short), "doubled": over,
            "short_listed": len(short_names & listed), "short_gridded": len(grid_lost),
            "gridded": len(gridded), "listed": len(listed), "commit_error": error,
            "grid_lost_example": grid_lost[0] if grid_lost else ""}


def plain_pp_check() -> dict:
    """Two pipeline stages holding different plain tensors, no ``replicated_over``: the real ``prepare_save`` to ``commit_save``.

    Each rank claims two copies of its tensors; the writer choice gives one
    of them to the other stage's rank, which does not hold it.
    """
    from shardpoint.saving.options import SaveOptions
    from shardpoint.saving.prepare import prepare_save
    from shardpoint.saving.result import SaveResult as ApiSaveResult
    from shardpoint.engine.indexes import resolve_all
    from shardpoint.engine.io import write_chunks

    storage, world, block = MemoryStorage(), 2, 1 << 20
    states = [{"model": {"a": torch.ones(4)}}, {"model": {"b": torch.full((4,), 2.0)}}]
    locals_, written = [], {}
    for r in range(world):
        comm = SimComm(r, world)
        prep = prepare_save(states[r], comm, SaveOptions(), ApiSaveResult("sim://plain-pp", SAVE_ID))
        records, files = [], {}
        if prep.mine:
            records, size = write_chunks(storage, data_file(r), list(prep.mine), r, block)
            files[data_file(r)] = size
        written[r] = [t.fqn for t in prep.mine]
        locals_.append(summarize(prep, storage, (records, files), comm))
    statuses = [x.status for x in locals_]
    ask = representatives(statuses)
    docs = [Documents(x.tensors if r in ask.tensors else None, x.values if r in ask.values else None) for r, x in enumerate(locals_)]
    out = {"written": written}
    try:
        commit_save(CommitTarget(storage, SAVE_ID, block, "sim://plain-pp"), world, statuses, docs)
        out["commit"] = "accepted"
    except CorruptCheckpointError as e:
        out["commit"] = f"refused: {e}"
        return out
    man = Manifest.from_json(storage.get(MANIFEST_NAME))
    try:
        resolve_all(storage, man, "sim://plain-pp")
        out["load"] = "ok"
    except CorruptCheckpointError as e:
        out["load"] = f"{type(e).__name__}: {e}"
    return out


# ----------------------------------------------------------------------------- driver
@dataclass
class Config:
    growth: list[Layout]  # 3-D layouts for the growth curve (same TP and PP, rising DP)
    extra: list[Layout]  # other save layouts (smaller PP, FSDP2)
    reshard: list[tuple[Layout, Layout]]  # (saved under, loaded into)
    save_sample: int = 6
    load_sample: int = 3
    reshard_sample: int = 2
    check_tensors: int = 200  # v1 records kept and compared field by field for about this many tensors
    profile_layout: Layout | None = None
    pp_check: Layout = Layout(8, 4, 2)
    probes: list[Layout] = field(default_factory=list)  # per-rank save work only, at world sizes not built in full
    model: ModelSpec = ModelSpec()


def full_config() -> Config:
    g = [Layout(8, 16, dp) for dp in (2, 8, 32, 128)]
    return Config(
        growth=g,
        extra=[Layout(8, 4, 8), Layout(1, 1, 128), Layout(1, 1, 1024)],
        reshard=[(Layout(8, 16, 128), Layout(1, 1, 1024)), (Layout(1, 1, 1024), Layout(8, 16, 128))],
        profile_layout=Layout(8, 16, 128), probes=[Layout(1, 1, 4096), Layout(1, 1, 16384)],
    )


def quick_config() -> Config:
    g = [Layout(8, 16, dp) for dp in (1, 2, 4)]
    return Config(
        growth=g,
        extra=[Layout(1, 1, 32)],
        reshard=[(Layout(8, 16, 4), Layout(1, 1, 32)), (Layout(1, 1, 32), Layout(8, 16, 4))],
        save_sample=2, load_sample=2, reshard_sample=1, profile_layout=None,
        pp_check=Layout(2, 4, 2), check_tensors=60, probes=[Layout(1, 1, 256)],
    )


def _row(save: SaveResult, loads: list[LoadResult]) -> dict:
    plan = [g.cpu + a.cpu for g, a in zip(save.geometry, save.assign)]
    summ = [c.cpu for c in save.summary]
    per = [p + s for p, s in zip(plan, summ)]
    sv = save.saved
    out = {
        "layout": save.layout.name, "tp": save.layout.tp, "pp": save.layout.pp, "dp": save.layout.dp,
        "ranks": save.layout.world, "tensors": save.tensors, "grids": save.grids, "chunks": sv.chunks,
        "tensors_per_rank": save.tensors_per_rank, "chunks_per_rank": save.chunks_per_rank,
        "sampled_ranks": save.sampled,
        "plan_rank_mean_s": _mean(plan), "plan_rank_max_s": max(plan),
        "geometry_mean_s": _mean([c.cpu for c in save.geometry]), "assign_mean_s": _mean([c.cpu for c in save.assign]),
        "summary_mean_s": _mean(summ), "summary_max_s": max(summ),
        "describe_mean_s": _mean([c.cpu for c in save.describe]),
        "describe_fixed_mean_s": _mean([c.cpu for c in save.describe_fixed]),
        "rank_total_max_s": max(per),
        "index_bytes_total": sv.index_bytes, "index_bytes_max": sv.index_max,
        "descriptors": sv.tdigs, "value_docs": sv.vdigs,
        "status_bytes": save.status_bytes, "doc_bytes": save.doc_bytes, "gather_bytes": save.gather_bytes,
        "decision_bytes": save.decision_bytes, "unpickle_s": save.unpickle.cpu,
        "commit_s": save.commit.cpu, "commit_wall_s": save.commit.wall, "commit_peak_bytes": save.commit.peak,
        "manifest_bytes": save.manifest_bytes,
        "parse_s": save.parse.cpu, "parse_wall_s": save.parse.wall, "parse_peak_bytes": save.parse.peak,
        "chunks_checked": save.chunks_checked, "bulk_sim_s": save.bulk.cpu, "profiles": save.profiles, "loads": [],
    }
    for lr in loads:
        tot = [a.cpu + b.cpu for a, b in zip(lr.resolve, lr.plan)]
        out["loads"].append({
            "source": lr.source.name, "target": lr.target.name, "target_ranks": lr.target.world,
            "sampled_ranks": lr.sampled, "targets_per_rank": _mean(lr.targets),
            "resolve_mean_s": _mean([c.cpu for c in lr.resolve]), "plan_only_mean_s": _mean([c.cpu for c in lr.plan]),
            "plan_mean_s": _mean(tot), "plan_max_s": max(tot), "plan_peak_bytes": lr.peak,
            "chunks_per_rank": _mean(lr.chunks), "spans_per_rank": _mean(lr.reads),
            "index_files": _mean(lr.index_files), "index_bytes": _mean(lr.index_bytes),
            # route_sharing: 8 bytes per rank of host ids, this rank's 32-byte span rows to their
            # owners, about as many rows back as owner (span ids hash uniformly), and at most one
            # 48-byte reply row per span (more only for spans several ranks need).
            "exchange_bytes_est": 8 * lr.target.world + (32 + 32 + 48) * _mean(lr.reads),
            "exchange_allgather_bytes_est": 32 * (_mean(lr.reads) + 1) * lr.target.world,
            "chunks_checked": lr.checked, "profiles": lr.profiles,
        })
    return out


def simulate_layout(cfg: Config, specs: list[TensorSpec], lay: Layout, rng: random.Random) -> dict:
    """Save under ``lay``, parse, and load (same layout and the configured reshards)."""
    m, block = cfg.model, DEFAULT_BLOCK_SIZE
    profile = lay == cfg.profile_layout
    per_rank = len(specs) // lay.pp
    sample = sample_ranks(lay, cfg.save_sample if per_rank < 1000 else 2, rng)
    every = max(1, len(specs) // cfg.check_tensors)
    check = {s.fqn for s in specs[::every]}
    save, man = run_save(specs, m, lay, block, sample, check, profile)
    pairs = [(lay, cfg.load_sample)] + [(tgt, cfg.reshard_sample) for src, tgt in cfg.reshard if src == lay]
    loads = [run_load(specs, m, save.saved, man, lay, tgt, sample_ranks(tgt, n, rng), profile) for tgt, n in pairs]
    row = _row(save, loads)
    save.saved = None
    return row


def simulate(cfg: Config, log: Callable[[str], None]) -> dict:
    m = cfg.model
    specs = state_tensors(m)
    rng = random.Random(20240611)
    torch_shard_box((8, 8), "col", Layout(2, 1, 2), 0, 0)  # import torch.distributed.tensor before timing
    shard_box.cache_clear()
    out: dict[str, Any] = {"model": m.__dict__, "tensors": len(specs),
                           "params": sum(math.prod(s.shape) for s in specs if s.fqn.startswith("model.")), "rows": []}
    log(f"model: {out['params'] / 1e9:.2f}B parameters, {len(specs)} saved tensors")

    check, c = measure(lambda: pp_check(specs, m, cfg.pp_check))
    out["pp_check"] = check
    out["plain_pp_check"] = plain_pp_check()
    log(f"pp check {check['layout']}: {check['short']} of {check['tensors']} tensors short without replicated_over "
        f"({check['short_listed']} listed, {check['short_gridded']} with a grid; {c.cpu:.1f}s)")
    log(f"plain pp check: commit {out['plain_pp_check']['commit']}; load: {out['plain_pp_check'].get('load')}")

    out["probes"] = [probe(specs, m, lay, rng) for lay in cfg.probes]
    for pr in out["probes"]:
        log(f"probe {pr['layout']}: plan {(pr['geometry_s'] + pr['assign_s'])*1e3:.0f} ms, summary {pr['summary_s']*1e3:.0f} ms,"
            f" describe {pr['describe_s']*1e3:.0f} ms ({pr['describe_fixed_s']*1e3:.0f} ms with replica grids cached)")

    layouts = []
    for lay in cfg.growth + cfg.extra:
        if lay not in layouts:
            layouts.append(lay)
    for lay in layouts:
        t0 = time.process_time()
        row = simulate_layout(cfg, specs, lay, rng)
        out["rows"].append(row)
        gc.collect()
        log(
            f"{lay.name:>16}: {lay.world:6d} ranks {row['chunks']:8d} chunks | rank {row['rank_total_max_s']*1e3:5.0f} ms"
            f" | gather {row['gather_bytes']/1e6:6.2f} MB | commit {row['commit_s']:6.3f}s | manifest {row['manifest_bytes']/1e3:7.0f} KB"
            f" parse {row['parse_s']*1e3:6.1f} ms | {time.process_time() - t0:5.1f}s CPU"
        )
        for ld in row["loads"]:
            log(f"{'':>18}load -> {ld['target']}: {ld['plan_max_s']*1e3:.1f} ms/rank, {ld['index_files']:.0f} index files,"
                f" {ld['index_bytes']/1e6:.2f} MB")
    return out


# ----------------------------------------------------------------------------- report
# Format version 1, as measured (docs/scale.md keeps the full tables): that code path is gone.
# layout -> (ranks, gather MB (e), rank-0 unpickle s (e), commit s, manifest MB, parse s)
V1_SAVE = {
    "TP8 PP16 DP2": (256, 13.7, 0.3, 0.48, 9.3, 0.69),
    "TP8 PP16 DP8": (1024, 42.2, 2.0, 1.57, 23.6, 2.78),
    "TP8 PP16 DP32": (4096, 156.0, 6.4, 4.68, 80.5, 6.43),
    "TP8 PP16 DP128": (16384, 620.6, 25.3, 21.53, 315.9, 25.82),
    "TP8 PP4 DP8": (256, 40.9, 2.0, 1.43, 23.6, 2.21),
    "FSDP2 128": (128, 81.2, 5.5, 3.47, 51.1, 4.22),
    "FSDP2 1024": (1024, 632.1, 43.4, 25.87, 383.6, 32.25),
}
# (saved under, loaded into) -> plan_chunk_reads per rank, max of the sample (s)
V1_LOAD = {
    ("TP8 PP16 DP2", "TP8 PP16 DP2"): 0.013, ("TP8 PP16 DP8", "TP8 PP16 DP8"): 0.018,
    ("TP8 PP16 DP32", "TP8 PP16 DP32"): 0.055, ("TP8 PP16 DP128", "TP8 PP16 DP128"): 0.205,
    ("TP8 PP16 DP128", "FSDP2 1024"): 6.508, ("TP8 PP4 DP8", "TP8 PP4 DP8"): 0.322,
    ("FSDP2 128", "FSDP2 128"): 1.498, ("FSDP2 1024", "FSDP2 1024"): 7.876,
    ("FSDP2 1024", "TP8 PP16 DP128"): 0.300,
}


def _kb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e3:,.0f}" if b >= 1e4 else f"{b / 1e3:,.1f}"


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:,.1f}" if b >= 1e6 else f"{b / 1e6:,.2f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}" if x >= 0.0995 else f"{x * 1e3:,.1f}"


def render_tables(res: dict) -> str:
    rows = res["rows"]
    L = []
    L.append("**Save, format version 2.** *Per rank* is measured on the sampled ranks (every rank runs the same code in "
             "parallel): *plan* is the adapter's geometry (torch boxes, `grid_of_placements`) plus `prepare_save`'s writer "
             "choice; *summary* is the real `saving/prepare.summarize` (`encode_index`, storing the index, `describe`, "
             "digests). Everything else is measured on every rank's real status and index: *gather* is what "
             "`finish_save` sends to rank 0, pickled (statuses + the asked descriptors); the commit, manifest and parse "
             "are full size; peaks are tracemalloc's. *Checked*: chunks of a stride of tensors resolved from the indexes "
             "and compared field by field with the records the ranks wrote.\n")
    L.append("| layout | ranks | chunks | plan/rank mean / max (ms) | summary/rank mean / max (ms) | of which `describe`: as landed / replica grids cached (ms) "
             "| index/rank max (KB) | indexes, all ranks (MB) | descriptors fetched | gather to rank 0: statuses + descriptors (MB) "
             "| rank-0 unpickle (ms) | commit (ms) | commit peak (MB) | manifest (KB) | parse (ms) | parse peak (MB) | chunks checked |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        L.append(
            f"| {r['layout']} | {r['ranks']:,} | {r['chunks']:,} | {_ms(r['plan_rank_mean_s'])} / {_ms(r['plan_rank_max_s'])} "
            f"| {_ms(r['summary_mean_s'])} / {_ms(r['summary_max_s'])} | {_ms(r['describe_mean_s'])} / {_ms(r['describe_fixed_mean_s'])} "
            f"| {_kb(r['index_bytes_max'])} | {_mb(r['index_bytes_total'])} | {r['descriptors']} + {r['value_docs']} "
            f"| {_mb(r['status_bytes'])} + {_mb(r['doc_bytes'])} | {_ms(r['unpickle_s'])} | {_ms(r['commit_s'])} "
            f"| {_mb(r['commit_peak_bytes'])} | {_kb(r['manifest_bytes'])} | {_ms(r['parse_s'])} | {_mb(r['parse_peak_bytes'])} "
            f"| {r['chunks_checked']:,} |"
        )
    if res.get("probes"):
        L.append("")
        L.append("**Per-rank save work at larger FSDP2 worlds** (one sampled rank each, nothing else built; same columns as above).\n")
        L.append("| layout | ranks | tensors/rank | plan (ms) | summary (ms) | of which `describe`: as landed / replica grids cached (ms) |")
        L.append("|---|---:|---:|---:|---:|---:|")
        for p in res["probes"]:
            L.append(f"| {p['layout']} | {p['ranks']:,} | {p['tensors_per_rank']:,} | {_ms(p['geometry_s'] + p['assign_s'])} "
                     f"| {_ms(p['summary_s'])} | {_ms(p['describe_s'])} / {_ms(p['describe_fixed_s'])} |")
    L.append("")
    L.append("**Load planning for one rank, format version 2** (mean / max over the sampled target ranks). `resolve` reads "
             "and parses only the index files of the ranks that wrote an overlapping shard, then `plan_chunk_reads` plans "
             "on the resolved chunks; *index files* and *index MB* are what `resolve` read. *Exchange* is what "
             "`share_reads` makes every rank receive when ranks span hosts, estimated (e) from the sampled spans: "
             "`route_sharing` (owners plan each span; 8 bytes per rank of host ids, about 112 bytes per own span), "
             "and the all-gather it replaced (32 bytes per span of every rank). Resolved chunks of the checked tensors "
             "were compared with the written records.\n")
    L.append("| saved under | loaded into | targets/rank | resolve + plan/rank mean / max (ms) | of which resolve (ms) "
             "| index files/rank | index MB/rank | chunks resolved/rank | spans/rank | plan peak (MB) | exchange per rank, routed (MB, e) | all-gather it replaced (MB, e) |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        for ld in r["loads"]:
            L.append(
                f"| {ld['source']} | {ld['target']} | {ld['targets_per_rank']:,.0f} | {_ms(ld['plan_mean_s'])} / {_ms(ld['plan_max_s'])} "
                f"| {_ms(ld['resolve_mean_s'])} | {ld['index_files']:,.0f} | {_mb(ld['index_bytes'])} | {ld['chunks_per_rank']:,.0f} "
                f"| {ld['spans_per_rank']:,.0f} | {_mb(ld['plan_peak_bytes'])} | {_mb(ld['exchange_bytes_est'])} "
                f"| {_mb(ld['exchange_allgather_bytes_est'])} |"
            )
    return "\n".join(L)


def render_profiles(res: dict) -> str:
    L = []
    for r in res["rows"]:
        profs = dict(r["profiles"])
        for ld in r["loads"]:
            for k, v in ld["profiles"].items():
                profs[f"{k}: {ld['source']} -> {ld['target']}"] = v
        for name, top in profs.items():
            L.append(f"**{name}** ({r['layout']}), top functions by own time under cProfile:\n")
            L.append("| function | own time (ms) | calls |")
            L.append("|---|---:|---:|")
            for fn, tt, nc in top:
                L.append(f"| `{fn}` | {tt * 1e3:,.1f} | {nc:,} |")
            L.append("")
    return "\n".join(L)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    pp = max(x["pp"] for x in res["rows"])
    rows = sorted([r for r in res["rows"] if r["tp"] > 1 and r["pp"] == pp], key=lambda r: r["ranks"])
    fs = sorted([r for r in res["rows"] if r["tp"] == 1 and r["pp"] == 1], key=lambda r: r["ranks"])
    x = [r["ranks"] for r in rows]
    v1 = [V1_SAVE.get(r["layout"]) for r in rows]
    v1x = [xx for xx, v in zip(x, v1) if v]
    v1 = [v for v in v1 if v]
    fig, ax = plt.subplots(1, 3, figsize=(17, 7))

    a = ax[0]
    if v1:
        a.plot(v1x, [v[2] + v[3] for v in v1], "s-", color="C3", label="v1 rank 0: unpickle (e) + commit_save")
        a.plot(v1x, [v[5] for v in v1], "^-", color="C1", label="v1 every rank: parse")
    a.plot(x, [r["unpickle_s"] + r["commit_s"] for r in rows], "s--", color="C3", label="v2 rank 0: unpickle + commit_save")
    a.plot(x, [r["parse_s"] for r in rows], "^--", color="C1", label="v2 every rank: parse")
    a.plot(x, [r["rank_total_max_s"] for r in rows], "o--", color="C0", label="v2 per rank: plan + summary (max of sample)")
    v1f = [(r["ranks"], V1_SAVE[r["layout"]]) for r in fs if r["layout"] in V1_SAVE]
    if v1f:
        a.plot([p[0] for p in v1f], [p[1][2] + p[1][3] for p in v1f], "s", color="C3", mfc="none", label="v1 FSDP2 rank 0")
    if fs:
        a.plot([r["ranks"] for r in fs], [r["unpickle_s"] + r["commit_s"] for r in fs], "x", color="C3", label="v2 FSDP2 rank 0")
    fper = sorted([(r["ranks"], r["rank_total_max_s"]) for r in fs]
                  + [(p["ranks"], p["geometry_s"] + p["assign_s"] + p["summary_s"]) for p in res.get("probes", [])])
    if fper:
        a.plot([p[0] for p in fper], [p[1] for p in fper], "x:", color="C0", label="v2 FSDP2 per rank: plan + summary")
    a.axhline(10, color="r", lw=0.8, ls="--")
    a.axhline(1, color="orange", lw=0.8, ls="--")
    a.set(xscale="log", yscale="log", xlabel="ranks (TP8 PP16, DP rising; FSDP2 marked)", ylabel="CPU seconds",
          title="Save and manifest time")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)

    a = ax[1]
    same = [next(ld for ld in r["loads"] if ld["target"] == r["layout"]) for r in rows]
    v1l = [(xx, V1_LOAD.get((r["layout"], r["layout"]))) for xx, r in zip(x, rows)]
    v1l = [(xx, v) for xx, v in v1l if v]
    if v1l:
        a.plot([p[0] for p in v1l], [p[1] for p in v1l], "o-", color="C0", label="v1 plan_chunk_reads, same layout")
    a.plot(x, [ld["plan_max_s"] for ld in same], "o--", color="C0", label="v2 resolve + plan, same layout")
    k = 1
    for r in res["rows"]:
        for ld in r["loads"]:
            if ld["target"] == r["layout"] and r["tp"] > 1 and r["pp"] == pp:
                continue
            k += 1
            v = V1_LOAD.get((ld["source"], ld["target"]))
            if v:
                a.plot([ld["target_ranks"]], [v], "D", color=f"C{k}", mfc="none", label=f"v1 {ld['source']} -> {ld['target']}")
            a.plot([ld["target_ranks"]], [ld["plan_max_s"]], "D", color=f"C{k}", label=f"v2 {ld['source']} -> {ld['target']}")
    a.axhline(1, color="orange", lw=0.8, ls="--")
    a.set(xscale="log", yscale="log", xlabel="target ranks", ylabel="CPU seconds per rank", title="Load planning, one rank")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)

    a = ax[2]
    if v1:
        a.plot(v1x, [v[4] for v in v1], "o-", color="C0", label="v1 manifest")
        a.plot(v1x, [v[1] for v in v1], "s-", color="C3", label="v1 gathered to rank 0 (e)")
    a.plot(x, [r["manifest_bytes"] / 1e6 for r in rows], "o--", color="C0", label="v2 manifest")
    a.plot(x, [r["gather_bytes"] / 1e6 for r in rows], "s--", color="C3", label="v2 gathered to rank 0")
    a.plot(x, [ld["index_bytes"] / 1e6 for ld in same], "v--", color="C2", label="v2 index bytes read per rank, same layout")
    a.plot(x, [r["index_bytes_total"] / 1e6 for r in rows], "d:", color="C4", label="v2 index files, all ranks (never gathered)")
    fl = [(r["ranks"], next(ld for ld in r["loads"] if ld["target"] == r["layout"])["index_bytes"]) for r in fs]
    if fl:
        a.plot([p[0] for p in fl], [p[1] / 1e6 for p in fl], "v", color="C2", mfc="none", label="v2 FSDP2 index bytes read per rank, same layout")
    a.set(xscale="log", yscale="log", xlabel="ranks (TP8 PP16, DP rising; FSDP2 marked)", ylabel="MB", title="Bytes")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)

    ticks = sorted({r["ranks"] for r in res["rows"]} | {ld["target_ranks"] for r in res["rows"] for ld in r["loads"]}
                   | {p["ranks"] for p in res.get("probes", [])})
    for a in ax:
        a.xaxis.set_major_locator(FixedLocator(ticks))
        a.xaxis.set_minor_locator(NullLocator())
        a.xaxis.set_major_formatter(ScalarFormatter())
        a.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle("shardpoint on paper: Llama-style 70B + AdamW, format version 1 (solid) vs 2 (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BEGIN, END = "<!-- scale_sim:begin -->", "<!-- scale_sim:end -->"


def render_checks(res: dict) -> str:
    pp, pl = res["pp_check"], res["plain_pp_check"]
    err = pp["commit_error"].split(";")[0] if pp["commit_error"] else "nothing (accepted)"
    return (
        f"Pipeline check ({pp['layout']}, adapters without `replicated_over`): {pp['short']:,} of {pp['tensors']:,} "
        f"tensors left short ({pp['short_listed']:,} described by holders, {pp['short_gridded']:,} with a grid); "
        f"`commit_save` says: \"{err}\". "
        f"Plain tensors on two stages, real `prepare_save` to `commit_save` (rank 0 holds `a`, rank 1 `b`): writers "
        f"{pl['written']}; commit {pl['commit'].split(':')[0]}; resolving the chunks: "
        f"\"{pl.get('load', '-')}\".\n"
    )


def write_markdown(res: dict, path: str, command: str, png: str) -> None:
    """Replace the generated block of ``path`` (between the markers), keeping hand-written text around it."""
    import matplotlib

    header = (
        f"Generated by `{command}` in {res['elapsed_cpu_s']:.0f} s CPU ({res['elapsed_wall_s']:.0f} s wall); "
        f"Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, matplotlib {matplotlib.__version__}; "
        f"{os.cpu_count()} CPUs, {res['load_note']}. Times are CPU seconds of this process (`time.process_time`), "
        "so other load on the machine inflates them less than wall time.\n"
    )
    model = f"Model: {res['params']/1e9:.2f}B parameters, {res['tensors']:,} saved tensors (param, exp_avg, exp_avg_sq, step).\n"
    profiles = render_profiles(res)
    block = [BEGIN, header, model, render_checks(res), render_tables(res), "", f"![time and size vs ranks]({os.path.basename(png)})", ""]
    if profiles:
        block += ["<details><summary>Profiles</summary>\n", profiles, "</details>"]
    block.append(END)
    text = f"# Scale on paper\n\n{BEGIN}\n{END}\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as f:
        f.write(head + "\n".join(block) + tail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller world sizes")
    ap.add_argument("--pp-check", action="store_true", help="only run the pipeline-parallel writer checks")
    ap.add_argument("--out", default=None, help="folder for scale.md and scale.png (default: docs; with --quick: print only)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args(argv)
    log = partial(print, flush=True)
    cfg = quick_config() if args.quick else full_config()
    if args.pp_check:
        out = {"pp_check": pp_check(state_tensors(cfg.model), cfg.model, cfg.pp_check), "plain_pp_check": plain_pp_check()}
        print(json.dumps(out, indent=1))
        return 0
    c0, w0 = time.process_time(), time.perf_counter()
    res = simulate(cfg, log)
    res["elapsed_cpu_s"], res["elapsed_wall_s"] = time.process_time() - c0, time.perf_counter() - w0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    res["load_note"] = f"load average {load:.1f} at the end of the run"
    out = args.out if args.out is not None else (None if args.quick else "docs")
    if out is None:
        print(render_checks(res))
        print(render_tables(res))
    else:
        os.makedirs(out, exist_ok=True)
        png = os.path.join(out, "scale.png")
        plot(res, png)
        cmd = "python bench/scale_sim.py" + (" --quick" if args.quick else "")
        write_markdown(res, os.path.join(out, "scale.md"), cmd, png)
        log(f"wrote {png} and {os.path.join(out, 'scale.md')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    log(f"done in {res['elapsed_cpu_s']:.0f}s CPU / {res['elapsed_wall_s']:.0f}s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
