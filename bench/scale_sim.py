"""Scale on paper: shardpoint's planners and manifest for a 70B model at up to 16,384 ranks.

No processes, no I/O besides the result files. For every rank of a layout this
builds what the adapters would hand to ``_prepare`` (fqn, global shape, box,
replica index/count, cost), runs the real writer assignment, turns what the
rank writes into real ``ChunkMeta`` records (fake offsets laid out like
``write_chunks`` does, fake fixed-size checksums), pickles the sampled
ranks' save summaries as ``gather_object`` would, feeds every rank's
outcome to the real
``shardpoint.api._commit`` (over an in-memory storage), parses the manifest
back with ``Manifest.from_json`` and runs the real load planner
(``shardpoint.engine.load.plan_chunk_reads``: ``SourceIndex`` + ``plan_reads``
+ coverage check) for sampled target ranks, same layout and resharded.

Per-rank save planning is timed on a sample of ranks (it is the same code on
every rank); every rank's chunk records are still generated, so the manifest
lists every chunk. Pipeline-parallel layouts are saved as with
``replicated_over=<the stage's ranks>`` (without it the adapters count other
stages as copies; ``--pp-check`` shows what that does). A prototype of the proposed format change ("implicit
geometry", see ``docs/scale.md``) runs on the same layouts and is checked
against the real manifest chunk by chunk.

Usage::

    python bench/scale_sim.py              # full run (about 5 min CPU, 4 GB), writes docs/scale.md and docs/scale.png
    python bench/scale_sim.py --quick      # under a minute, smaller world sizes, prints the tables
    python bench/scale_sim.py --pp-check   # only the pipeline-parallel writer check
"""

from __future__ import annotations

import argparse
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

from shardpoint.adapters.base import LoadTarget, global_cost
from shardpoint.api import _commit
from shardpoint.dist import Outcome
from shardpoint.engine.io import ALIGN, DEFAULT_BLOCK_SIZE
from shardpoint.engine.load import LoadStats, plan_chunk_reads
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.manifest import MANIFEST_NAME, ChunkMeta, Manifest
from shardpoint.format.values import _TAG
from shardpoint.geometry import Box, even_chunks
from shardpoint.planning import ReplicaItem, assign_writers
from shardpoint.storage.memory import MemoryStorage

SAVE_ID = "5ca1ab1e" * 4  # 32 hex digits, like uuid4().hex
DTYPE, ITEMSIZE = "float32", 4  # FSDP2 keeps fp32 sharded params; AdamW state is fp32 too


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

    def coords(self, rank: int) -> tuple[int, int, int]:
        p, rest = divmod(rank, self.dp * self.tp)
        d, t = divmod(rest, self.tp)
        return p, d, t

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
    equal boxes (a parameter and its AdamW states, equal layers) share one
    frozen ``Box``, which keeps building every rank's records cheap.
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


def torch_shard_box(shape: tuple[int, ...], style: str, lay: Layout, d: int, t: int) -> Box:
    """The same box from torch's own ``_compute_local_shape_and_global_offset`` (what the adapter calls)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if style == "scalar":
        return Box((), ())
    key = (lay.placements(style), lay.tp)
    pl = _TORCH_PLACEMENTS.get(key)
    if pl is None:
        make = {"S0": lambda: Shard(0), "S1": lambda: Shard(1), "R": Replicate, "SS0": lambda: _StridedShard(0, split_factor=lay.tp)}
        pl = _TORCH_PLACEMENTS[key] = [make[p]() for p in key[0]]
    mesh, coord = ((lay.dp, lay.tp), [d, t]) if lay.tp > 1 else ((lay.dp,), [d])
    sizes, offs = _compute_local_shape_and_global_offset(shape, mesh, coord, pl)
    return Box(tuple(int(o) for o in offs), tuple(int(s) for s in sizes))


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


class SimTensor(NamedTuple):
    """What ``save_tensor`` hands to ``_prepare`` for one local tensor (minus the data)."""

    fqn: str
    shape: tuple[int, ...]
    box: Box
    replica_index: int
    replica_count: int
    cost: float
    layout: str


def rank_tensors(specs: list[TensorSpec], m: ModelSpec, lay: Layout, rank: int, mode: str = "pp-aware", boxes: Callable = shard_box) -> list[SimTensor]:
    """The SaveTensor geometry of one rank.

    ``mode="adapters"`` reproduces today's adapters: a DTensor on the (dp, tp)
    sub-mesh of a (pp, dp, tp) mesh counts the pp dim as replicas
    (``_replication_outside``), and a plain tensor (AdamW ``step``) counts the
    whole world as replicas (``plain_replica``). ``mode="pp-aware"`` counts
    only the ranks that really hold the tensor: replicas over tp for norms,
    the stage's ranks for ``step``.
    """
    p, d, t = lay.coords(rank)
    out = []
    for fqn, shape, style, scalar, rep, cost, label in _templates(_SpecsKey(specs), m, lay, p, mode):
        box = boxes(shape, style, lay, d, t)
        if scalar:
            idx, cnt = (rank, lay.world) if mode == "adapters" else (d * lay.tp + t, lay.dp * lay.tp)
            out.append(SimTensor(fqn, shape, box, idx, cnt, cost, "replicated" if cnt > 1 else "local"))
            continue
        idx, cnt = (p, lay.pp) if mode == "adapters" and lay.pp > 1 else (0, 1)
        if rep:
            idx, cnt = idx * lay.tp + t, cnt * lay.tp
        out.append(SimTensor(fqn, shape, box, idx, cnt, cost, label))
    return out


@functools.lru_cache(maxsize=64)
def _templates(specs_key, m: ModelSpec, lay: Layout, p: int, mode: str) -> tuple:
    """Rank-independent facts of a stage's tensors: name, shape, style, replicated over tp, cost, label."""
    out = []
    for s in stage_specs(specs_key.specs, m, lay)[p]:
        if s.style == "scalar":
            out.append((s.fqn, s.shape, s.style, True, False, float(ITEMSIZE), ""))
            continue
        rep = s.style == "rep" and lay.tp > 1
        cnt = (lay.pp if mode == "adapters" and lay.pp > 1 else 1) * (lay.tp if rep else 1)
        cost = global_cost(s.shape, ITEMSIZE, cnt, lay.world)
        out.append((s.fqn, s.shape, s.style, False, rep, cost, "dtensor(" + ", ".join(lay.placements(s.style)) + ")"))
    return tuple(out)


def _wkey(t: SimTensor) -> str:
    return f"{t.fqn}@{t.box.offsets}"


def pick_mine(tensors: list[SimTensor], assign: Callable = assign_writers) -> list[SimTensor]:
    """What this rank writes: the selection in ``shardpoint.api._prepare``, verbatim."""
    writers = assign(ReplicaItem(_wkey(t), t.replica_count, t.cost) for t in tensors if t.replica_count > 1)
    return [t for t in tensors if t.replica_count <= 1 or writers[_wkey(t)] == t.replica_index]


def data_file(rank: int) -> str:
    return f"data/{SAVE_ID}-r{rank:05d}.bin"


def fake_records(rank: int, mine: list[SimTensor], block: int) -> tuple[list[tuple[str, ChunkMeta]], int]:
    """Chunk records as ``write_chunks`` makes them: 64-byte aligned offsets, one checksum per block."""
    name = data_file(rank)
    pos, recs = 0, []
    for k, t in enumerate(mine):
        nbytes = t.box.numel * ITEMSIZE
        if pos % ALIGN:
            pos += ALIGN - pos % ALIGN
        n = max(1, -(-nbytes // block))
        seed = (rank * 1_000_003 + k * 7919) & 0xFFFFFFFFFFFF
        sums = tuple(f"{seed:012x}{j & 0xFFFF:04x}" for j in range(n))
        recs.append((t.fqn, ChunkMeta(t.box, name, pos, nbytes, sums, None, rank)))
        pos += nbytes
    return recs, pos


def _ref(path: str) -> dict:
    return {_TAG: "tensor", "key": path}


def rank_summary(rank: int, tensors: list[SimTensor], mine: list[SimTensor], block: int) -> dict:
    """The dict ``_Prepared.summary`` returns: what each rank sends to rank 0."""
    records, files = [], {}
    if mine:
        records, size = fake_records(rank, mine, block)
        files[data_file(rank)] = size
    params = [t.fqn for t in tensors if t.fqn.startswith("model.")]
    hyper = {
        "lr": 3e-4, "betas": {_TAG: "tuple", "v": [0.9, 0.95]}, "eps": 1e-8, "weight_decay": 0.1,
        "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
        "differentiable": False, "fused": None, "decoupled_weight_decay": True,
    }
    state = {
        p: {k: _ref(f"optim.state.{p}.{k}") for k in ("step", "exp_avg", "exp_avg_sq")} for p in params
    }
    values = {"model": {}, "optim": {"groups": [hyper], "group_of": {p: 0 for p in params}, "state": state}}
    meta = {t.fqn: (DTYPE, t.shape, t.layout) for t in tensors}
    return {"records": records, "files": files, "values": values, "layout": {"model": "fsdp2", "optim": "optimizer:AdamW"}, "meta": meta}


# ----------------------------------------------------------------------------- measuring
@dataclass
class Cost:
    """CPU seconds (this process), wall seconds, and the tracemalloc peak above the start (bytes)."""

    cpu: float = 0.0
    wall: float = 0.0
    peak: int | None = None

    def __add__(self, o: Cost) -> Cost:
        peak = None if self.peak is None and o.peak is None else max(self.peak or 0, o.peak or 0)
        return Cost(self.cpu + o.cpu, self.wall + o.wall, peak)


def best_of(fn: Callable[[], Any], n: int = 3) -> tuple[Any, Cost]:
    """The fastest of ``n`` runs, for millisecond steps where one garbage collection would dominate."""
    runs = [measure(fn) for _ in range(n)]
    return runs[0][0], min((c for _, c in runs), key=lambda c: c.cpu)


def measure(fn: Callable[[], Any], trace: bool = False) -> tuple[Any, Cost]:
    """Run ``fn`` once; with ``trace`` also record its tracemalloc peak (slower).

    The garbage collector stays on while timing (the library pays for it too);
    a full collection first is only worth it before tracing (it costs seconds
    once a big manifest is alive).
    """
    if trace:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    c0, w0 = time.process_time(), time.perf_counter()
    try:
        out = fn()
    finally:
        c1, w1 = time.process_time(), time.perf_counter()
        peak = None
        if trace:
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
    return out, Cost(c1 - c0, w1 - w0, peak)


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


def _memo_assign(memo: dict) -> Callable:
    """``assign_writers`` memoised on its input: ranks of one replica group see the same items."""

    def assign(items):
        items = tuple(items)
        got = memo.get(items)
        if got is None:
            got = memo[items] = assign_writers(items)
        return got

    return assign


# ----------------------------------------------------------------------------- save side (v1, today's format)
_STAGE_DOCS: dict = {}


def _stage_docs(tensors: list[SimTensor], key: tuple) -> tuple[dict, dict]:
    """values and meta of a rank's summary; identical across a stage, so built once per stage.

    Rank 0 really holds one unpickled copy per rank; that memory is measured
    on sampled payloads and scaled, not by keeping 16,384 copies here.
    """
    got = _STAGE_DOCS.get(key)
    if got is None:
        full = rank_summary(0, tensors, [], DEFAULT_BLOCK_SIZE)
        got = _STAGE_DOCS[key] = (full["values"], full["meta"])
    return got


@dataclass
class SaveResult:
    layout: Layout
    sampled: list[int]
    tensors_per_rank: float = 0.0
    chunks_per_rank: float = 0.0
    geometry: list[Cost] = field(default_factory=list)  # per sampled rank: torch geometry, as the adapter runs it
    assign: list[Cost] = field(default_factory=list)  # writer assignment (real assign_writers + _prepare's selection)
    assign_default: list[Cost] = field(default_factory=list)  # the same without replicated_over (pp > 1 only)
    records: list[Cost] = field(default_factory=list)  # chunk records + summary dict
    plan_peak: int = 0  # tracemalloc peak of one rank's geometry + assignment (first sampled rank)
    payload: list[int] = field(default_factory=list)  # pickled summary bytes per sampled rank
    dumps: list[Cost] = field(default_factory=list)
    loads: list[Cost] = field(default_factory=list)  # rank 0 unpickling one payload (average of a batch, see _unpickle_many)
    loads_batch: int = 0
    unpickled: list[int] = field(default_factory=list)  # bytes one payload takes on rank 0
    chunks: int = 0
    tensors: int = 0
    files: int = 0
    bulk: Cost = field(default_factory=Cost)  # simulation overhead: building every rank's records
    commit: Cost = field(default_factory=Cost)  # real _commit (merge, sort, checks, Manifest, to_json, put)
    to_json: float = 0.0  # CPU seconds of Manifest.to_json inside the commit
    manifest_bytes: int = 0
    parse: Cost = field(default_factory=Cost)
    parsed_peak_live: int | None = None
    profiles: dict = field(default_factory=dict)

    def mean(self, xs: list) -> float:
        vals = [x.cpu if isinstance(x, Cost) else x for x in xs]
        return sum(vals) / len(vals) if vals else 0.0

    def worst(self, xs: list) -> float:
        vals = [x.cpu if isinstance(x, Cost) else x for x in xs]
        return max(vals) if vals else 0.0

    @property
    def plan_per_rank(self) -> list[float]:
        return [g.cpu + a.cpu for g, a in zip(self.geometry, self.assign)]

    @property
    def gather_bytes(self) -> float:
        """Extrapolated: mean sampled payload x world (every rank sends one)."""
        return self.mean(self.payload) * self.layout.world

    @property
    def gather_loads(self) -> float:
        """Extrapolated: rank 0 unpickles every payload in turn."""
        return self.mean(self.loads) * self.layout.world

    @property
    def gather_objects(self) -> float:
        return self.mean(self.unpickled) * self.layout.world


def run_save(specs, m: ModelSpec, lay: Layout, block: int, sample: list[int], trace: bool, profile: bool, v2: V2Store | None = None) -> tuple[SaveResult, bytes]:
    """Plan every rank, gather, commit with the real ``_commit``; returns the manifest bytes."""
    res = SaveResult(lay, sample)
    blobs: list[bytes] = []
    # 1. Sampled ranks: the per-rank work, timed and traced one rank at a time.
    for i, r in enumerate(sample):
        tensors, c_geo = measure(partial(rank_tensors, specs, m, lay, r, boxes=torch_shard_box))
        assert tensors == rank_tensors(specs, m, lay, r), f"fast geometry differs from torch's on rank {r}"
        mine, c_asg = measure(partial(pick_mine, tensors))
        if i == 0:
            _, c_peak = measure(partial(_plan_one, specs, m, lay, r), trace=True)
            res.plan_peak = c_peak.peak or 0
        if lay.pp > 1:
            dflt = rank_tensors(specs, m, lay, r, mode="adapters")
            res.assign_default.append(measure(partial(pick_mine, dflt))[1])
        summary, c_rec = measure(partial(rank_summary, r, tensors, mine, block))
        blob, c_dump = best_of(partial(pickle.dumps, Outcome(True, summary)))
        c_load = measure(partial(pickle.loads, blob), trace=True)[1]  # peak = one payload's objects on rank 0
        blobs.append(blob)
        res.geometry.append(c_geo)
        res.assign.append(c_asg)
        res.records.append(c_rec)
        res.payload.append(len(blob))
        res.dumps.append(c_dump)
        res.unpickled.append(c_load.peak or 0)
        res.tensors_per_rank += len(tensors) / len(sample)
        res.chunks_per_rank += len(mine) / len(sample)
    n = res.loads_batch = _unpickle_batch(res.mean(res.unpickled))
    batch = measure(partial(_unpickle_many, blobs, n))[1]
    res.loads = [Cost(batch.cpu / n, batch.wall / n)]

    # 2. Every rank's records (fast geometry, assign_writers memoised per replica group).
    def bulk() -> list[Outcome]:
        memo: dict = {}
        assign = _memo_assign(memo)
        gathered = []
        for r in range(lay.world):
            tensors = rank_tensors(specs, m, lay, r)
            mine = pick_mine(tensors, assign)
            records, files = [], {}
            if mine:
                records, size = fake_records(r, mine, block)
                files[data_file(r)] = size
                if v2 is not None:
                    v2.add_rank(r, records, size)
            values, meta = _stage_docs(tensors, (id(specs), lay, lay.coords(r)[0]))
            gathered.append(Outcome(True, {"records": records, "files": files, "values": values,
                                           "layout": {"model": "fsdp2", "optim": "optimizer:AdamW"}, "meta": meta}))
        return gathered

    _STAGE_DOCS.clear()
    gathered, res.bulk = measure(bulk)
    res.chunks = sum(len(o.value["records"]) for o in gathered)
    res.files = sum(len(o.value["files"]) for o in gathered)

    # 3. The coordinator: the real _commit, with Manifest.to_json timed inside it.
    storage = MemoryStorage()
    spent = [0.0]
    orig = Manifest.to_json

    def timed_to_json(self):
        c0 = time.process_time()
        try:
            return orig(self)
        finally:
            spent[0] += time.process_time() - c0

    Manifest.to_json = timed_to_json  # type: ignore[method-assign]
    try:
        run = partial(_commit, save_id=SAVE_ID, world=lay.world, block=block, gathered=gathered, where="sim://scale")
        if profile:
            _, res.profiles["commit"] = profile_top(partial(run, MemoryStorage()))
            spent[0] = 0.0
        _, res.commit = measure(partial(run, storage))
        res.to_json = spent[0]
        if trace:  # memory, in a second (slower) traced run
            res.commit.peak = measure(partial(run, MemoryStorage()), trace=True)[1].peak
    finally:
        Manifest.to_json = orig  # type: ignore[method-assign]
    data = storage.get(MANIFEST_NAME)
    res.manifest_bytes = len(data)
    _STAGE_DOCS.clear()
    return res, data


def _unpickle_batch(object_bytes: float) -> int:
    """How many payloads to unpickle in a row: enough to see the collector's work, at most ~64 MB of objects."""
    return max(16, min(512, int(64e6 // max(1.0, object_bytes))))


def _unpickle_many(blobs: list[bytes], n: int) -> list:
    """Rank 0's side of ``gather_object``: unpickle payloads one after another and keep them all.

    Timing a batch into a growing heap includes the garbage collector's
    passes, which a single ``loads`` misses (or, by bad luck, takes whole).
    """
    return [pickle.loads(blobs[k % len(blobs)]) for k in range(n)]


def _plan_one(specs, m: ModelSpec, lay: Layout, rank: int) -> list[SimTensor]:
    """One rank's save planning as the adapters and ``_prepare`` run it: torch geometry, then writers."""
    return pick_mine(rank_tensors(specs, m, lay, rank, boxes=torch_shard_box))


def parse_manifest(res: SaveResult, data: bytes, trace: bool, profile: bool) -> Manifest:
    if profile:
        _, res.profiles["parse"] = profile_top(lambda: Manifest.from_json(data))
    man, res.parse = measure(lambda: Manifest.from_json(data), trace=trace)
    res.tensors = len(man.tensors)
    assert sum(len(t.chunks) for t in man.tensors.values()) == res.chunks
    return man


# ----------------------------------------------------------------------------- load side (v1)
_DEST = {DTYPE: torch.empty(0, dtype=torch.float32)}  # plan_chunk_reads only looks at dest.dtype


def load_targets(specs, m: ModelSpec, lay: Layout, rank: int) -> list[LoadTarget]:
    p, d, t = lay.coords(rank)
    return [LoadTarget(s.fqn, _DEST[DTYPE], s.shape, shard_box(s.shape, s.style, lay, d, t)) for s in stage_specs(specs, m, lay)[p]]


@dataclass
class LoadResult:
    source: Layout
    target: Layout
    sampled: list[int]
    plan: list[Cost] = field(default_factory=list)  # real plan_chunk_reads for one rank
    targets: list[int] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)  # chunk spans (ChunkRead) per rank
    chunks_indexed: list[int] = field(default_factory=list)  # saved chunks the rank's SourceIndexes hold
    keys: list[int] = field(default_factory=list)  # pickled span keys each rank all_gathers (share_reads)
    v2_plan: list[Cost] = field(default_factory=list)
    v2_index_bytes: list[int] = field(default_factory=list)
    v2_index_files: list[int] = field(default_factory=list)
    v2_row_bytes: list[int] = field(default_factory=list)
    profiles: dict = field(default_factory=dict)

    @property
    def exchange_bytes(self) -> float:
        """Extrapolated: with share_reads every rank receives every rank's span keys."""
        return (sum(self.keys) / len(self.keys)) * self.target.world if self.keys else 0.0


def run_load(specs, m: ModelSpec, man: Manifest, src: Layout, tgt: Layout, sample: list[int], trace: bool, profile: bool, v2: V2Store | None) -> LoadResult:
    res = LoadResult(src, tgt, sample)
    for i, r in enumerate(sample):
        targets = load_targets(specs, m, tgt, r)
        run = partial(_plan_reads, man, targets)
        if profile and i == 0:
            _, res.profiles["load"] = profile_top(run)
        reads, cost = measure(run, trace=trace)
        res.plan.append(cost)
        res.targets.append(len(targets))
        res.reads.append(len(reads))
        res.chunks_indexed.append(sum(len(man.tensors[f].chunks) for f in {t.fqn for t in targets}))
        res.keys.append(len(pickle.dumps(sorted(r_.key for r_ in reads))))
        if v2 is not None:
            (ops, nbytes, nrows, nfiles), c2 = measure(partial(v2.plan, targets, tgt, r), trace=trace)
            res.v2_plan.append(c2)
            res.v2_index_bytes.append(nbytes)
            res.v2_row_bytes.append(nrows)
            res.v2_index_files.append(nfiles)
            v2.check_against(ops, reads)
    return res


def _plan_reads(man: Manifest, targets: list[LoadTarget]) -> list:
    """The real load planning of one rank: ``plan_chunk_reads`` with checksum verification on."""
    return plan_chunk_reads(man, targets, "sim://scale", True, LoadStats())


# ----------------------------------------------------------------------------- prototype: implicit geometry
_ROW = np.dtype([("tid", "<u4"), ("nsum", "<u4"), ("sum0", "<u8"), ("offset", "<u8"), ("nbytes", "<u8")])
_STYLE_OF = {("S0",): "col", ("SS0", "S0"): "col", ("S0", "S1"): "row", ("S0", "R"): "rep", (): "scalar"}
_PLACEMENTS = set(_STYLE_OF)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _overlap(lo: int, hi: int, size: int, parts: int) -> range:
    """Indices of ``torch.chunk``-style chunks of ``size`` elements that overlap ``[lo, hi)``."""
    if hi <= lo or size == 0:
        return range(0)
    return range(lo // size, min(parts - 1, (hi - 1) // size) + 1)


@dataclass
class _Fetched:
    """Index files a load has read (rank -> rows, checksums, bytes), and the bytes of the rows it used."""

    files: dict = field(default_factory=dict)
    row_bytes: int = 0


class V2Store:
    """The proposed format, prototyped: geometry instead of chunk records, per-rank binary indexes.

    * Manifest: per tensor (dtype, shape, placements on the (dp, tp) mesh,
      pipeline stage, and for replicated tensors the writer's copy index);
      the mesh; one size per data file. O(tensors + world), no chunk list.
    * Each rank writes ``<data file>.idx`` next to its data: a little-endian
      numpy table (tensor id, byte offset, nbytes, first checksum, checksum
      count) plus its xxh3 checksums as uint64. Nothing is pickled.
    * The commit gathers a fixed-size status per rank (file size, index size,
      index digest), and one geometry descriptor per stage.
    * A loader derives which saved shards overlap its target from the
      placements (integer arithmetic), then reads only the indexes of the
      ranks that wrote them.
    """

    def __init__(self, specs: list[TensorSpec], m: ModelSpec, lay: Layout, block: int):
        self.specs, self.m, self.lay, self.block = specs, m, lay, block
        self.tid = {s.fqn: i for i, s in enumerate(specs)}
        self.index: dict[int, bytes] = {}
        self.sizes = [0] * lay.world
        self.doc: dict | None = None
        self.man: dict | None = None

    # save side ------------------------------------------------------------
    def add_rank(self, rank: int, records: list[tuple[str, ChunkMeta]], size: int) -> None:
        """What rank ``rank`` writes next to its data file (built from its real chunk records)."""
        rows, sums = [], []
        for fqn, c in records:
            rows.append((self.tid[fqn], len(c.checksums), len(sums), c.offset, c.nbytes))
            sums.extend(int(x, 16) for x in c.checksums)
        table = np.array(rows, dtype=_ROW)
        self.index[rank] = np.array([len(rows)], "<u8").tobytes() + table.tobytes() + np.array(sums, "<u8").tobytes()
        self.sizes[rank] = size

    def commit(self) -> bytes:
        """Rank 0's work: writer table per stage (pure, keyed by name), geometry, file sizes."""
        lay, m = self.lay, self.m
        tensors = []
        for p, group in enumerate(stage_specs(self.specs, m, lay)):
            items = []
            for s in group:
                cnt = lay.dp * lay.tp if s.style == "scalar" else (lay.tp if s.style == "rep" else 1)
                if cnt > 1:
                    cost = float(ITEMSIZE) if s.style == "scalar" else global_cost(s.shape, ITEMSIZE, cnt, lay.world)
                    items.append(ReplicaItem(s.fqn, cnt, cost))
            writers = assign_writers(items)
            for s in group:
                tensors.append([s.fqn, DTYPE, list(s.shape), list(lay.placements(s.style)), p, writers.get(s.fqn, -1)])
        doc = {
            "format": "shardpoint", "format_version": "2-sketch", "save_id": SAVE_ID, "block_size": self.block,
            "mesh": {"names": ["pp", "dp", "tp"], "shape": [lay.pp, lay.dp, lay.tp]},
            "tensors": tensors, "files": {"pattern": f"data/{SAVE_ID}-r{{rank:05d}}.bin", "sizes": self.sizes},
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def parse(data: bytes) -> dict:
        """Parse and validate (types, ranges, known placements) as ``from_json`` would."""
        doc = json.loads(data)
        if doc.get("format") != "shardpoint" or doc.get("format_version") != "2-sketch":
            raise ValueError("not a v2 sketch manifest")
        pp, dp, tp = (int(x) for x in doc["mesh"]["shape"])
        world = pp * dp * tp
        sizes = doc["files"]["sizes"]
        if len(sizes) != world or not all(isinstance(x, int) and x >= 0 for x in sizes):
            raise ValueError("bad file sizes")
        tensors = {}
        for fqn, dtype, shape, pl, stage, writer in doc["tensors"]:
            if not isinstance(fqn, str) or dtype != DTYPE or tuple(pl) not in _PLACEMENTS:
                raise ValueError(f"bad tensor entry {fqn!r}")
            if not all(isinstance(x, int) and x >= 0 for x in shape) or not 0 <= stage < pp or not -1 <= writer < world:
                raise ValueError(f"bad tensor entry {fqn!r}")
            tensors[fqn] = (tuple(shape), tuple(pl), stage, writer)
        return {"layout": Layout(tp, pp, dp), "tensors": tensors, "sizes": sizes, "block": doc["block_size"]}

    # load side ------------------------------------------------------------
    def shards(self, fqn: str, box: Box):
        """(source rank, source box, region) for every saved shard of ``fqn`` overlapping ``box``."""
        shape, pl, p, writer = self.man["tensors"][fqn]
        lay: Layout = self.man["layout"]
        style = _STYLE_OF[pl]
        if not pl:
            yield p * lay.dp * lay.tp + writer, Box((), ()), Box((), ())
            return
        if box.numel == 0:
            return
        a, b = box.offsets[0], box.offsets[0] + box.sizes[0]
        if pl == ("SS0", "S0"):
            ct = _cdiv(shape[0], lay.tp)
            coords = []
            for t in _overlap(a, b, ct, lay.tp):
                lo1, n1 = _chunks(shape[0], lay.tp)[t]
                coords += [(d, t) for d in _overlap(max(a, lo1) - lo1, min(b, lo1 + n1) - lo1, _cdiv(n1, lay.dp), lay.dp)]
        elif pl == ("S0", "S1"):
            c, e = box.offsets[1], box.offsets[1] + box.sizes[1]
            coords = [(d, t) for d in _overlap(a, b, _cdiv(shape[0], lay.dp), lay.dp)
                      for t in _overlap(c, e, _cdiv(shape[1], lay.tp), lay.tp)]
        else:  # ("S0",) or ("S0", "R"): dim 0 over dp; a replicated copy is written by the writer's tp index
            t = writer if pl == ("S0", "R") else 0
            coords = [(d, t) for d in _overlap(a, b, _cdiv(shape[0], lay.dp), lay.dp)]
        for d, t in coords:
            src = shard_box(shape, style, lay, d, t)
            region = src.intersect(box)
            if region is not None and region.numel > 0:
                yield (p * lay.dp + d) * lay.tp + t, src, region

    def _lookup(self, cache: _Fetched, rank: int, tid: int) -> tuple[int, int, list[int]]:
        """Offset, nbytes and checksums of ``rank``'s chunk of tensor ``tid``, from its index."""
        got = cache.files.get(rank)
        if got is None:
            blob = self.index[rank]  # stands for one small read of <data file>.idx
            n = int(np.frombuffer(blob, "<u8", 1)[0])
            rows = np.frombuffer(blob, _ROW, n, 8)
            sums = np.frombuffer(blob, "<u8", offset=8 + n * _ROW.itemsize)
            got = cache.files[rank] = (rows, sums, len(blob))
        rows, sums, _ = got
        k = int(np.searchsorted(rows["tid"], tid))
        if k >= len(rows) or int(rows["tid"][k]) != tid:
            raise CorruptCheckpointError(f"rank {rank}'s index has no chunk of tensor {tid}")
        row = rows[k]
        s0, ns = int(row["sum0"]), int(row["nsum"])
        cache.row_bytes += _ROW.itemsize + 8 * ns
        return int(row["offset"]), int(row["nbytes"]), [int(x) for x in sums[s0:s0 + ns]]

    def plan(self, targets: list[LoadTarget], tgt: Layout, rank: int) -> tuple[list, int, int, int]:
        """Reads for one target rank: (fqn, source rank, byte offset, source box, region) per overlap.

        Also returns the index bytes read (whole index files), the bytes of
        the rows actually used (what ranged reads of the rows would fetch),
        and the number of index files touched.
        """
        cache = _Fetched()
        ops = []
        for tg in targets:
            tid = self.tid[tg.fqn]
            covered = 0
            for src_rank, src_box, region in self.shards(tg.fqn, tg.box):
                offset, _nbytes, _sums = self._lookup(cache, src_rank, tid)
                ops.append((tg.fqn, src_rank, offset, src_box, region))
                covered += region.numel
            if covered != tg.box.numel:
                raise CorruptCheckpointError(f"{tg.fqn}: derived shards cover {covered} of {tg.box.numel}")
        return ops, sum(v[2] for v in cache.files.values()), cache.row_bytes, len(cache.files)

    @staticmethod
    def check_against(ops: list, reads) -> None:
        """The prototype must find exactly the reads the real planner found."""
        want = {(r.fqn, r.chunk.rank, r.chunk.offset, r.chunk.box, op.region) for r in reads for _t, cops in r.jobs for op in cops}
        got = set(ops)
        if want != got:
            raise AssertionError(f"v2 reads differ from plan_chunk_reads: {len(want - got)} missing, {len(got - want)} extra")

    def check_manifest(self, man: Manifest, fqns: list[str]) -> int:
        """Every chunk of ``fqns`` in the real manifest is derived from geometry + indexes; returns chunks checked."""
        n = 0
        cache = _Fetched()
        for fqn in fqns:
            shape = self.man["tensors"][fqn][0]
            derived = []
            for src_rank, src_box, _region in self.shards(fqn, Box.full(shape)):
                offset, nbytes, sums = self._lookup(cache, src_rank, self.tid[fqn])
                derived.append((src_box, src_rank, offset, nbytes, tuple(f"{x:016x}" for x in sums)))
            real = [(c.box, c.rank, c.offset, c.nbytes, c.checksums) for c in man.tensors[fqn].chunks if c.numel > 0 or not shape]
            if sorted(derived, key=repr) != sorted(real, key=repr):
                raise AssertionError(f"{fqn}: derived chunks differ from the manifest")
            n += len(real)
        return n


# ----------------------------------------------------------------------------- pipeline-parallel writer check
def pp_check(specs, m: ModelSpec, lay: Layout) -> dict:
    """Save every rank of ``lay`` the way today's adapters describe it (no ``replicated_over``).

    A DTensor on a stage's (dp, tp) sub-mesh counts the pp dim as copies, and
    ``step`` counts the whole world, so the writer assignment picks copies on
    other stages, which hold other layers. Returns how many tensors end up
    with missing or doubled elements, and what the real ``_commit`` says.
    """
    memo: dict = {}
    assign = _memo_assign(memo)
    written: dict[str, int] = {}
    gathered = []
    for r in range(lay.world):
        tensors = rank_tensors(specs, m, lay, r, mode="adapters")
        mine = pick_mine(tensors, assign)
        for t in mine:
            written[t.fqn] = written.get(t.fqn, 0) + t.box.numel
        gathered.append(Outcome(True, rank_summary(r, tensors, mine, DEFAULT_BLOCK_SIZE)))
    short = sum(1 for s in specs if written.get(s.fqn, 0) < math.prod(s.shape))
    over = sum(1 for s in specs if written.get(s.fqn, 0) > math.prod(s.shape))
    try:
        _commit(MemoryStorage(), SAVE_ID, lay.world, DEFAULT_BLOCK_SIZE, gathered, "sim://pp-check")
        error = ""
    except CorruptCheckpointError as e:
        error = str(e)
    return {"layout": lay.name, "tensors": len(specs), "short": short, "doubled": over, "commit_error": error}


# ----------------------------------------------------------------------------- driver
@dataclass
class Config:
    growth: list[Layout]  # 3-D layouts for the growth curve (same TP and PP, rising DP)
    extra: list[Layout]  # other save layouts (smaller PP, FSDP2)
    reshard: list[tuple[Layout, Layout]]  # (saved under, loaded into)
    save_sample: int = 6
    load_sample: int = 3
    reshard_sample: int = 2
    trace_max_chunks: int = 50_000  # commit/parse memory is traced up to about this many chunks, then scaled
    expensive_load: int = 500_000  # saved chunks a target rank indexes above which one target rank is sampled
    profile_layout: Layout | None = None
    pp_check: Layout = Layout(8, 4, 2)
    manifest_check_chunks: int = 40_000  # prototype: re-derive about this many chunks and compare with the manifest
    model: ModelSpec = ModelSpec()


def full_config() -> Config:
    g = [Layout(8, 16, dp) for dp in (2, 8, 32, 128)]
    return Config(
        growth=g,
        extra=[Layout(8, 4, 8), Layout(1, 1, 128), Layout(1, 1, 1024)],
        reshard=[(Layout(8, 16, 128), Layout(1, 1, 1024)), (Layout(1, 1, 1024), Layout(8, 16, 128))],
        profile_layout=Layout(8, 16, 8),
    )


def quick_config() -> Config:
    g = [Layout(8, 16, dp) for dp in (1, 2, 4)]
    return Config(
        growth=g,
        extra=[Layout(1, 1, 32)],
        reshard=[(Layout(8, 16, 4), Layout(1, 1, 32)), (Layout(1, 1, 32), Layout(8, 16, 4))],
        save_sample=2, load_sample=2, reshard_sample=1, profile_layout=None,
        pp_check=Layout(2, 4, 2), manifest_check_chunks=10_000, trace_max_chunks=30_000,
    )


def _row(save: SaveResult, v2: dict, loads: list[LoadResult]) -> dict:
    plan = save.plan_per_rank
    out = {
        "layout": save.layout.name, "tp": save.layout.tp, "pp": save.layout.pp, "dp": save.layout.dp,
        "ranks": save.layout.world, "tensors": save.tensors, "chunks": save.chunks,
        "tensors_per_rank": save.tensors_per_rank, "chunks_per_rank": save.chunks_per_rank,
        "sampled_ranks": save.sampled,
        "plan_rank_mean_s": sum(plan) / len(plan), "plan_rank_max_s": max(plan),
        "geometry_mean_s": save.mean(save.geometry), "assign_mean_s": save.mean(save.assign),
        "assign_default_mean_s": save.mean(save.assign_default) if save.assign_default else None,
        "records_mean_s": save.mean(save.records), "dumps_mean_s": save.mean(save.dumps),
        "plan_peak_bytes": save.plan_peak,
        "payload_mean_bytes": save.mean(save.payload), "gather_bytes_est": save.gather_bytes,
        "gather_unpickle_s_est": save.gather_loads, "gather_objects_bytes_est": save.gather_objects,
        "commit_s": save.commit.cpu, "commit_wall_s": save.commit.wall, "to_json_s": save.to_json,
        "commit_peak_bytes": save.commit.peak, "manifest_bytes": save.manifest_bytes,
        "parse_s": save.parse.cpu, "parse_wall_s": save.parse.wall, "parse_peak_bytes": save.parse.peak,
        "bulk_sim_s": save.bulk.cpu, "profiles": save.profiles, "v2": v2, "loads": [],
    }
    for lr in loads:
        out["loads"].append({
            "source": lr.source.name, "target": lr.target.name, "target_ranks": lr.target.world,
            "sampled_ranks": lr.sampled, "targets_per_rank": sum(lr.targets) / len(lr.targets),
            "plan_mean_s": sum(c.cpu for c in lr.plan) / len(lr.plan), "plan_max_s": max(c.cpu for c in lr.plan),
            "plan_peak_bytes": max((c.peak or 0) for c in lr.plan) or None,
            "chunks_indexed": sum(lr.chunks_indexed) / len(lr.chunks_indexed),
            "spans_per_rank": sum(lr.reads) / len(lr.reads),
            "keys_bytes_per_rank": sum(lr.keys) / len(lr.keys), "exchange_bytes_est": lr.exchange_bytes,
            "v2_plan_mean_s": sum(c.cpu for c in lr.v2_plan) / len(lr.v2_plan) if lr.v2_plan else None,
            "v2_plan_max_s": max(c.cpu for c in lr.v2_plan) if lr.v2_plan else None,
            "v2_index_bytes": sum(lr.v2_index_bytes) / len(lr.v2_index_bytes) if lr.v2_index_bytes else None,
            "v2_index_files": sum(lr.v2_index_files) / len(lr.v2_index_files) if lr.v2_index_files else None,
            "v2_row_bytes": sum(lr.v2_row_bytes) / len(lr.v2_row_bytes) if lr.v2_row_bytes else None,
            "profiles": lr.profiles,
        })
    return out


def simulate_layout(cfg: Config, specs: list[TensorSpec], lay: Layout, rng: random.Random) -> dict:
    """Save under ``lay``, parse, load (same layout and the configured reshards), and the prototype."""
    m, block = cfg.model, DEFAULT_BLOCK_SIZE
    trace = len(specs) * lay.tp * lay.dp <= cfg.trace_max_chunks  # about the chunk count, from above
    profile = lay == cfg.profile_layout
    v2 = V2Store(specs, m, lay, block)
    per_rank = len(specs) // lay.pp
    sample = sample_ranks(lay, cfg.save_sample if per_rank < 1000 else 2, rng)
    save, data = run_save(specs, m, lay, block, sample, trace=trace, profile=profile, v2=v2)
    man = parse_manifest(save, data, trace=False, profile=profile)
    if trace:
        save.parse.peak = measure(partial(Manifest.from_json, data), trace=True)[1].peak
    data = b""
    # prototype: commit, parse, and the whole-manifest check
    b2, c_commit = best_of(v2.commit)
    v2.man, c_parse = best_of(partial(V2Store.parse, b2))
    every = max(1, (save.chunks * 3) // (cfg.manifest_check_chunks * 2))
    checked = v2.check_manifest(man, [s.fqn for s in specs][::every])
    v2row = {"manifest_bytes": len(b2), "commit_s": c_commit.cpu, "parse_s": c_parse.cpu,
             "gather_bytes": 24 * lay.world, "chunks_checked": checked,
             "index_bytes_total": sum(len(b) for b in v2.index.values())}
    pairs = [(lay, cfg.load_sample)] + [(tgt, cfg.reshard_sample) for src, tgt in cfg.reshard if src == lay]
    loads = []
    for tgt, n in pairs:
        n = n if save.chunks // tgt.pp < cfg.expensive_load else 1  # a target rank indexes its stage's chunks
        loads.append(run_load(specs, m, man, lay, tgt, sample_ranks(tgt, n, rng), False, profile, v2))
    for lr in loads:  # per-rank planning memory: one traced rerun of the first sampled rank
        if (lr.source.tp * lr.source.dp) * len(specs) <= 2 * cfg.trace_max_chunks:
            targets = load_targets(specs, m, lr.target, lr.sampled[0])
            lr.plan[0].peak = measure(partial(_plan_reads, man, targets), trace=True)[1].peak
    return _row(save, v2row, loads)


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
    log(f"pp check {check['layout']}: {check['short']} of {check['tensors']} tensors short without replicated_over ({c.cpu:.1f}s)")

    layouts = []
    for lay in cfg.growth + cfg.extra:
        if lay not in layouts:
            layouts.append(lay)
    for lay in layouts:
        t0 = time.process_time()
        row = simulate_layout(cfg, specs, lay, rng)
        out["rows"].append(row)
        gc.collect()
        v = row["v2"]
        log(
            f"{lay.name:>18}: {lay.world:6d} ranks {row['chunks']:8d} chunks | plan/rank {row['plan_rank_max_s']*1e3:6.0f} ms"
            f" | commit {row['commit_s']:6.2f}s | manifest {row['manifest_bytes']/1e6:7.1f} MB parse {row['parse_s']:6.2f}s"
            f" | v2 {v['manifest_bytes']/1e3:6.0f} KB parse {v['parse_s']*1e3:5.1f} ms | {time.process_time() - t0:5.1f}s CPU"
        )
        for ld in row["loads"]:
            log(f"{'':>20}load {ld['source']} -> {ld['target']}: plan/rank {ld['plan_max_s']:.3f}s (v2 {ld['v2_plan_max_s']:.3f}s),"
                f" spans {ld['spans_per_rank']:.0f}, share_reads exchange {ld['exchange_bytes_est']/1e6:.0f} MB/rank")
    return out


# ----------------------------------------------------------------------------- report
def _mb(b: float | None) -> str:
    return "-" if b is None else (f"{b / 1e6:,.1f}" if b < 1e10 else f"{b / 1e9:,.1f} G")


def _s(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _peak_per_chunk(rows: list[dict], key: str) -> float | None:
    """Bytes per chunk of the largest traced run, to scale the untraced ones."""
    traced = [r for r in rows if r.get(key)]
    if not traced:
        return None
    r = max(traced, key=lambda r: r["chunks"])
    return r[key] / r["chunks"]


def _peak(r: dict, key: str, per_chunk: float | None) -> str:
    if r.get(key):
        return _mb(r[key])
    return "~" + _mb(per_chunk * r["chunks"]) + "*" if per_chunk else "-"


def render_tables(res: dict) -> str:
    rows = res["rows"]
    ppc_commit = _peak_per_chunk(rows, "commit_peak_bytes")
    ppc_parse = _peak_per_chunk(rows, "parse_peak_bytes")
    L = []
    L.append("**Save, today's format.** Per-rank planning is measured on the sampled ranks (the same code runs on every "
             "rank, in parallel). Gather bytes and rank-0 unpickling are the sampled per-rank figures x ranks "
             "(extrapolated, marked e; unpickling is timed over a batch of up to 512 sampled payloads kept alive, "
             "so the collector's passes on a growing heap are included). Commit and parse are measured on the full manifest; "
             "memory marked * is scaled from the largest traced run by chunk count.\n")
    L.append("| layout | ranks | tensors | chunks | plan/rank mean / max (ms) | of which assign (ms) | gather to rank 0 (MB, e) | rank-0 unpickle (s, e) | rank-0 payload objects (MB, e) | commit (s) | of which to_json (s) | commit peak (MB) | manifest (MB) | parse (s) | parse peak (MB) |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        L.append(
            f"| {r['layout']} | {r['ranks']:,} | {r['tensors']:,} | {r['chunks']:,} | {r['plan_rank_mean_s']*1e3:.0f} / {r['plan_rank_max_s']*1e3:.0f} "
            f"| {r['assign_mean_s']*1e3:.1f} | {_mb(r['gather_bytes_est'])} | {_s(r['gather_unpickle_s_est'], 1)} | {_mb(r['gather_objects_bytes_est'])} "
            f"| {_s(r['commit_s'])} | {_s(r['to_json_s'])} | {_peak(r, 'commit_peak_bytes', ppc_commit)} | {_mb(r['manifest_bytes'])} "
            f"| {_s(r['parse_s'])} | {_peak(r, 'parse_peak_bytes', ppc_parse)} |"
        )
    L.append("")
    L.append("**Load planning for one rank** (real `plan_chunk_reads` on the parsed manifest; mean / max over the sampled "
             "target ranks; every rank first parses the whole manifest, see above). *Exchange* is what `share_reads` "
             "makes every rank receive: every rank's pickled span keys (`all_gather`), sampled size x ranks (e).\n")
    L.append("| saved under | loaded into | targets/rank | chunks indexed/rank | plan/rank mean / max (s) | plan peak (MB) | spans/rank | share_reads exchange per rank (MB, e) | prototype plan/rank max (s) | prototype index files/rank: whole (MB) / rows used (KB) |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        for ld in r["loads"]:
            L.append(
                f"| {ld['source']} | {ld['target']} | {ld['targets_per_rank']:.0f} | {ld['chunks_indexed']:,.0f} "
                f"| {_s(ld['plan_mean_s'], 3)} / {_s(ld['plan_max_s'], 3)} | {_mb(ld['plan_peak_bytes'])} | {ld['spans_per_rank']:,.0f} "
                f"| {_mb(ld['exchange_bytes_est'])} | {_s(ld['v2_plan_max_s'], 3)} | {ld['v2_index_files']:.0f}: {_mb(ld['v2_index_bytes'])} / {ld['v2_row_bytes']/1e3:,.0f} |"
            )
    L.append("")
    L.append("**Prototype (implicit geometry, per-rank binary indexes).** Same layouts; the manifest holds geometry, "
             "not chunks. *Checked*: chunks of a stride of tensors (all styles) re-derived from geometry "
             "+ indexes and compared field by field (box, writer rank, offset, nbytes, checksums) with the real "
             "manifest; every prototype load plan above was also compared read by read with `plan_chunk_reads`.\n")
    L.append("| layout | ranks | manifest (KB) | parse (ms) | coordinator (ms) | gather to rank 0 (KB) | per-rank indexes, all ranks (MB) | chunks checked |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        v = r["v2"]
        L.append(f"| {r['layout']} | {r['ranks']:,} | {v['manifest_bytes']/1e3:,.0f} | {v['parse_s']*1e3:.1f} | {v['commit_s']*1e3:.0f} "
                 f"| {v['gather_bytes']/1e3:,.0f} | {v['index_bytes_total']/1e6:,.1f} | {v['chunks_checked']:,} |")
    return "\n".join(L)


def render_profiles(res: dict) -> str:
    L = []
    for r in res["rows"]:
        profs = dict(r["profiles"])
        for ld in r["loads"]:
            for k, v in ld["profiles"].items():
                profs[f"{k}: {ld['source']} -> {ld['target']}"] = v
        for name, top in profs.items():
            L.append(f"**{name}** ({r['layout']}, {r['chunks']:,} chunks), top functions by own time under cProfile:\n")
            L.append("| function | own time (s) | calls |")
            L.append("|---|---:|---:|")
            for fn, tt, nc in top:
                L.append(f"| `{fn}` | {tt:.2f} | {nc:,} |")
            L.append("")
    return "\n".join(L)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r["tp"] > 1 and r["pp"] == max(x["pp"] for x in res["rows"])]
    rows.sort(key=lambda r: r["ranks"])
    fs = sorted([r for r in res["rows"] if r["tp"] == 1 and r["pp"] == 1], key=lambda r: r["ranks"])
    x = [r["ranks"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(17, 7))

    a = ax[0]
    a.plot(x, [r["plan_rank_max_s"] for r in rows], "o-", label="per-rank save planning (max of sample)")
    a.plot(x, [r["gather_unpickle_s_est"] + r["commit_s"] for r in rows], "s-", label="rank 0: unpickle gather (e) + _commit")
    a.plot(x, [r["commit_s"] for r in rows], "s:", label="rank 0: _commit alone")
    a.plot(x, [r["parse_s"] for r in rows], "^-", label="every rank: Manifest.from_json")
    a.plot(x, [r["v2"]["commit_s"] + r["v2"]["parse_s"] for r in rows], "o--", label="prototype: coordinator + parse")
    if fs:
        a.plot([r["ranks"] for r in fs], [r["gather_unpickle_s_est"] + r["commit_s"] for r in fs], "s", mfc="none", label="FSDP2: rank 0 gather + commit")
        a.plot([r["ranks"] for r in fs], [r["parse_s"] for r in fs], "^", mfc="none", label="FSDP2: parse")
    a.axhline(10, color="r", lw=0.8, ls="--")
    a.axhline(1, color="orange", lw=0.8, ls="--")
    a.set(xscale="log", yscale="log", xlabel="ranks (TP8 PP16, DP rising)", ylabel="CPU seconds", title="Save and manifest time")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)

    a = ax[1]
    same = [next(ld for ld in r["loads"] if ld["target"] == r["layout"]) for r in rows]
    a.plot(x, [ld["plan_max_s"] for ld in same], "o-", label="plan_chunk_reads, same layout (max of sample)")
    a.plot(x, [ld["v2_plan_max_s"] for ld in same], "o--", label="prototype, same layout")
    if fs:
        fsame = [next(ld for ld in r["loads"] if ld["target"] == r["layout"]) for r in fs]
        a.plot([r["ranks"] for r in fs], [ld["plan_max_s"] for ld in fsame], "s", mfc="none", label="FSDP2, same layout")
        a.plot([r["ranks"] for r in fs], [ld["v2_plan_max_s"] for ld in fsame], "x", label="prototype FSDP2, same layout")
    for r in res["rows"]:
        for ld in r["loads"]:
            if ld["target"] != r["layout"]:
                a.plot([ld["target_ranks"]], [ld["plan_max_s"]], "D", label=f"{ld['source']} -> {ld['target']}")
                a.plot([ld["target_ranks"]], [ld["v2_plan_max_s"]], "d", mfc="none", label=f"prototype {ld['source']} -> {ld['target']}")
    a.axhline(1, color="orange", lw=0.8, ls="--")
    a.set(xscale="log", yscale="log", xlabel="target ranks", ylabel="CPU seconds per rank", title="Load planning, one rank")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)

    a = ax[2]
    a.plot(x, [r["manifest_bytes"] / 1e6 for r in rows], "o-", label="manifest (JSON)")
    a.plot(x, [r["gather_bytes_est"] / 1e6 for r in rows], "s-", label="gathered to rank 0 at commit (e)")
    a.plot(x, [r["gather_objects_bytes_est"] / 1e6 for r in rows], "s:", label="rank-0 memory for gathered payloads (e)")
    a.plot(x, [same[i]["exchange_bytes_est"] / 1e6 for i in range(len(rows))], "v-", label="share_reads keys received per rank (e)")
    a.plot(x, [r["v2"]["manifest_bytes"] / 1e6 for r in rows], "o--", label="prototype manifest")
    a.plot(x, [r["v2"]["gather_bytes"] / 1e6 for r in rows], "s--", label="prototype gather")
    a.set(xscale="log", yscale="log", xlabel="ranks (TP8 PP16, DP rising)", ylabel="MB", title="Bytes")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ticks = sorted({r["ranks"] for r in res["rows"]} | {ld["target_ranks"] for r in res["rows"] for ld in r["loads"]})
    for a in ax:
        a.xaxis.set_major_locator(FixedLocator(ticks))
        a.xaxis.set_minor_locator(NullLocator())
        a.xaxis.set_major_formatter(ScalarFormatter())
        a.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle("shardpoint on paper: Llama-style 70B + AdamW (e = extrapolated from sampled ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BEGIN, END = "<!-- scale_sim:begin -->", "<!-- scale_sim:end -->"


def write_markdown(res: dict, path: str, command: str, png: str) -> None:
    """Replace the generated block of ``path`` (between the markers), keeping hand-written text around it."""
    import matplotlib

    pp = res["pp_check"]
    header = (
        f"Generated by `{command}` in {res['elapsed_cpu_s']:.0f} s CPU ({res['elapsed_wall_s']:.0f} s wall); "
        f"Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, matplotlib {matplotlib.__version__}; "
        f"{os.cpu_count()} CPUs, {res['load_note']}. Times are CPU seconds of this process (`time.process_time`), "
        "so other load on the machine inflates them less than wall time.\n"
    )
    model = (
        f"Model: {res['params']/1e9:.2f}B parameters, {res['tensors']:,} saved tensors (param, exp_avg, exp_avg_sq, step). "
        f"Pipeline check ({pp['layout']}, today's adapters without `replicated_over`): "
        f"{pp['short']:,} of {pp['tensors']:,} tensors left short; `_commit` says: \"{pp['commit_error'].split(';')[0]}\".\n"
    )
    profiles = render_profiles(res)
    block = [BEGIN, header, model, render_tables(res), "", f"![time and size vs ranks]({os.path.basename(png)})", ""]
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
    ap.add_argument("--quick", action="store_true", help="smaller world sizes (under a minute)")
    ap.add_argument("--pp-check", action="store_true", help="only run the pipeline-parallel writer check")
    ap.add_argument("--out", default=None, help="folder for scale.md and scale.png (default: docs; with --quick: print only)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args(argv)
    log = partial(print, flush=True)
    cfg = quick_config() if args.quick else full_config()
    if args.pp_check:
        print(json.dumps(pp_check(state_tensors(cfg.model), cfg.model, cfg.pp_check), indent=1))
        return 0
    c0, w0 = time.process_time(), time.perf_counter()
    res = simulate(cfg, log)
    res["elapsed_cpu_s"], res["elapsed_wall_s"] = time.process_time() - c0, time.perf_counter() - w0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    res["load_note"] = f"load average {load:.1f} at the end of the run"
    out = args.out if args.out is not None else (None if args.quick else "docs")
    if out is None:
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
