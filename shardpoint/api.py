"""The public entry points: :func:`save` and :func:`load`.

Thin glue: adapters flatten the state, the planners decide who writes and
what to read, the engine moves bytes, storage persists them. Every collective
goes through :class:`~shardpoint.dist.Comm`, which is a world of one when no
process group is initialised, so the same path runs everywhere.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, MutableMapping, Sequence

import torch
import xxhash
from torch import nn

from .adapters import AdapterContext, SaveTensor, WholeEntry, adapter_for, build_context, default_adapters, unwrap_module
from .dist import Comm, Outcome, raise_if_failed, run_guarded
from .engine.io import write_chunks
from .engine.indexes import IndexReader, resolve, resolve_all, wanted_box
from .engine.claim import CommitPolicy, SaveClaim, cleanup_after_commit
from .engine.load import execute_reads
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    KeyMismatchError,
    ShapeMismatchError,
    StateNotRestoredError,
    UnsupportedStateError,
)
from .items import LoadTarget, dtype_name, torch_dtype
from .adapters.reuse import PartCache
from .adapters.landing import entry_tensors, live_storages, unlanded
from .adapters.optimizer import own_protocol
from .adapters.megatron import is_megatron, megatron_global_shapes
from .geometry import Box
from .errors import StorageError
from .format.datafile import DEFAULT_BLOCK_SIZE
from .format.index import encode_index, fqn_key, index_digest
from .format.strict import Limits
from .format.values import check_optimizer_doc
from .format.manifest import DTYPE_SIZES, FORMAT_VERSION, MANIFEST_NAME, Manifest, RankFiles, TensorMeta, rank_runs
from .grid import Grid
from .planning.save_plan import ReplicaItem, assign_writers
from .layouts import LayoutView, Rule, apply_load, apply_reduce, apply_save, optimizer_doc_to_logical, optimizer_doc_to_physical
from .dcp_names import dcp_to_native, is_dcp_optimizer_doc
from .monitor import Recorder, format_summary
from .rank_local import rank_local_tensors
from .storage import Storage, storage_for

__all__ = [
    "save", "load", "read_tensor", "read_manifest", "SaveResult", "LoadResult", "CommitPolicy",
    # The save steps the asynchronous saver shares with save().
    "check_state", "check_block_size", "data_file_name", "mark_phase", "prepare_save", "finish_save",
]

log = logging.getLogger("shardpoint")


@dataclass
class SaveResult:
    """What a save did on this rank: phase timings (seconds) and bytes written."""

    path: str
    save_id: str
    bytes_written: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    recorder: Recorder | None = field(default=None, repr=False)
    plan_cached: bool = False


@dataclass
class LoadResult:
    """What a load did on this rank; ``missing``/``unexpected`` are filled under ``strict=False``.

    ``not_restored`` names tensors read from the checkpoint that did not reach
    the live state (a strict load raises :class:`StateNotRestoredError` instead).

    ``bytes_read`` counts tensor data; ``index_bytes`` the index files
    (format version 2) this rank read to find it. ``timings`` holds seconds
    per phase: ``manifest``, ``prepare`` (targets from the state), ``index``,
    ``plan``, ``read`` (the whole read phase), ``landing`` (proving that the
    state landed, after the objects installed it), and within ``read`` ``verify``,
    ``copy``, ``wait`` (the loading thread idle until a read lands) and
    ``communicate``; phases that run in reader threads add up over threads.
    """

    path: str = ""
    bytes_read: int = 0
    index_bytes: int = 0
    bytes_needed: int = 0
    bytes_received: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    not_restored: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    recorder: Recorder | None = field(default=None, repr=False)


def mark_phase(result, phase: str, start: float, nbytes: int = 0) -> None:
    """Record a phase that began at ``start`` (monotonic seconds) and ends now.

    Shared by :func:`save` and the asynchronous saver so both report the same phases.

    Example::

        t0 = time.monotonic(); ...; mark_phase(result, "prepare", t0)
    """
    end = time.monotonic()
    result.timings[phase] = result.timings.get(phase, 0.0) + (end - start)
    if result.recorder is not None:
        result.recorder.add(phase, start, end, nbytes)


def _context(state: MutableMapping[str, Any], comm: Comm, allow_pickle: bool, replicated_over: Any = None) -> AdapterContext:
    return build_context(state, comm.rank, comm.world, allow_pickle, replicated_over)


def check_state(state: Any) -> None:
    """Refuse a state that is not a dict of plain top-level names, before any collective.

    Example::

        check_state({"model": model, "optimizer": opt})
    """
    if not isinstance(state, MutableMapping):
        raise UnsupportedStateError(f"state must be a dict of name -> object, got {type(state).__name__}")
    for k in state:
        if not isinstance(k, str) or not k or "." in k:
            raise UnsupportedStateError(f"state keys must be non-empty strings without '.', got {k!r}")


def _merge(a: Any, b: Any) -> Any:
    """Union of two value documents from different ranks; the lower rank wins conflicts."""
    if isinstance(a, dict) and isinstance(b, dict) and "__sp__" not in a:
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge(a[k], v) if k in a else v
        return out
    return a


def save(
    path: str | Storage,
    state: MutableMapping[str, Any],
    *,
    process_group: Any = None,
    allow_pickle: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    layouts: Sequence[Rule] = (),
    trace_dir: str | None = None,
    on_metrics: Any = None,
    replicated_over: Any = None,
    collective_timeout: float | None = None,
    commit: CommitPolicy | None = None,
) -> SaveResult:
    """Save ``state`` to ``path``; a collective when a process group is initialised.

    ``state`` maps names to modules, optimizers, ``Stateful`` objects, tensors
    (DTensors included) and plain values. Each rank writes its own shards;
    replicated tensors are written once, balanced over the ranks holding them.
    The manifest is written last, so an interrupted save never looks like a
    checkpoint, and overwriting ``path`` switches atomically from the old
    checkpoint to the new one. Phase timings come back on the result; with
    ``trace_dir`` each rank also writes a Chrome trace there (see
    ``shardpoint trace``), and ``on_metrics`` receives a metrics dict.
    ``layouts`` lists rules (:mod:`shardpoint.layouts`) for fused or padded
    tensors, which are then stored as their logical tensors.
    Plain (non-DTensor) tensors are taken to be identical on every rank;
    where they are not, say which ranks hold the same copy as this one with
    ``replicated_over``: a process group, a device mesh or a list of global
    ranks, or a dict from state keys to those. Under pipeline parallelism
    each rank passes its stage's data-parallel group (``[rank]`` with no
    data parallelism), since other stages hold other layers.
    ``process_group`` limits the save to that group's ranks (the others take
    no part); :data:`~shardpoint.LOCAL` saves from the calling rank alone,
    with no collective (see :data:`~shardpoint.LOCAL`). Before any work the
    ranks check that they all entered the same save of the same path: ranks
    that disagree, or one that does not arrive within ``collective_timeout``
    seconds (default: ``SHARDPOINT_COLLECTIVE_TIMEOUT``, else 600), raise
    :class:`DistributedError` instead of hanging (see :mod:`shardpoint.handshake`).

    One save writes a path at a time: rank 0 claims it before any data is
    written, and a save to a path that another save is writing raises
    :class:`~shardpoint.errors.ConcurrentSaveError` without committing, so
    the path keeps a whole checkpoint (the other save's, or what it held).
    Files the new checkpoint no longer needs are removed after the commit,
    once no committed manifest lists them and they are older than a grace
    period. ``commit`` (a :class:`CommitPolicy`) sets the claim's lease and
    that grace period; :mod:`shardpoint.engine.claim` states the guarantee.

    Example::

        sp.save("ckpt/step_100", {"model": model, "optimizer": opt, "extra": {"step": 100}})
        sp.save("ckpt/pp", {"model": stage, "optimizer": opt}, replicated_over=dp_group)
        sp.save("ckpt/rank0", {"model": ddp.module}, process_group=sp.LOCAL)  # rank 0 only
    """
    check_state(state)
    check_block_size(block_size)
    comm = Comm.resolve(process_group)
    if comm.local and replicated_over is not None:
        raise ValueError("replicated_over has no meaning for a rank-local save (process_group=sp.LOCAL): one rank writes everything")
    storage = storage_for(path)
    where = storage.url
    comm.enter("save", where, collective_timeout)
    t0 = time.monotonic()
    # Each rank names its data file with its own id: no collective is needed to start.
    save_id = uuid.uuid4().hex
    result = SaveResult(where, save_id, recorder=Recorder("save", where, comm.rank))
    policy = commit or CommitPolicy()
    claims: list[SaveClaim] = []

    def local() -> dict:
        prep = prepare_save(state, comm, allow_pickle, where, result, layouts, replicated_over=replicated_over, rank_local=comm.local)
        if comm.rank == 0:  # before any data is written; its failure reaches every rank at the commit
            claims.append(SaveClaim.acquire(storage.primary, policy, where))
        tb = time.monotonic()
        records, files = [], {}
        if prep.mine:
            name = data_file_name(save_id, comm.rank)
            records, size = write_chunks(storage, name, prep.mine, comm.rank, block_size, result.recorder)
            files[name] = size
            result.bytes_written = size
        mark_phase(result, "data_file", tb)  # whole file incl. fsync; per-chunk spans are "write"
        local = prep.summary(storage, records, files, comm)
        result.bytes_written = sum(local.status["files"].values())
        return local

    out = run_guarded(local)
    if comm.world == 1 and not out.ok:
        for c in claims:
            c.release()
        raise out.exc
    finish_save(comm, storage, save_id, block_size, out, result, where, claims[0] if claims else None, policy)
    mark_phase(result, "total", t0)
    result.timings = result.recorder.summary()
    result.recorder.emit(trace_dir, on_metrics)
    log.info("rank %s saved %s bytes to %s: %s", comm.rank, result.bytes_written, where, format_summary(result.timings))
    return result


# Replicated tensors up to this size are written by copy 0 rather than balanced.
SMALL_REPLICA_BYTES = 4096


def check_block_size(block_size: int) -> None:
    """Refuse a checksum block size that is not a positive multiple of 16 bytes.

    Example::

        check_block_size(1 << 20)
    """
    if block_size < 16 or block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")


def data_file_name(save_id: str, rank: int) -> str:
    """The name of the data file ``rank`` writes in save ``save_id``; one place so all savers agree.

    Example::

        data_file_name("ab12", 3)  # 'data/ab12-r00003.bin'
    """
    return f"data/{save_id}-r{rank:05d}.bin"


@dataclass
class _Prepared:
    """The local half of a save: what this rank writes, plus its metadata.

    ``writers`` maps a replicated tensor's writer key to the copy index that
    writes it; ``ctx`` is the adapter context (replica groups of plain tensors).
    """

    tensors: list[SaveTensor]
    mine: list[SaveTensor]
    values: dict
    layout: dict
    lazy_ok: set
    writers: dict = field(default_factory=dict)
    ctx: Any = None
    described: Any = None  # (tensors doc, digest, listed coverage), reused by repeated saves

    def summary(self, storage: Storage, records, files: dict, comm: Comm) -> "_Local":
        """Write this rank's index file next to its data file; return what the commit needs.

        Runs after the data file is written (in the background for async saves).
        """
        ranks = None
        if files:
            (data, _size), = files.items()
            index = data[: -len(".bin")] + ".idx"
            blob = encode_index(records, {t.fqn: dtype_name(t.data.dtype) for t in self.mine})
            try:
                with storage.open_writer(index) as w:
                    w.write(blob)
            except OSError as e:
                raise StorageError(f"{storage.url}: writing {index} failed: {e}") from e
            files = {**files, index: len(blob)}
            ranks = (data, index, index_digest(blob))
        if self.described is None:
            self.described = _describe(self, comm)
        tdoc, tdig, listed = self.described
        mine_listed = {}
        for t in self.mine:
            if t.fqn in listed:
                mine_listed[t.fqn] = mine_listed.get(t.fqn, 0) + (t.box.numel if t.flat is None else t.flat[1] - t.flat[0])
        vdoc = {"values": self.values, "layout": self.layout}
        vdig = xxhash.xxh3_128_hexdigest(json.dumps(vdoc, separators=(",", ":"), default=repr).encode("utf-8"))
        status = {"files": files, "ranks": ranks, "tdig": tdig, "vdig": vdig, "cover": mine_listed}
        return _Local(status, tdoc, vdoc)


@dataclass
class _Local:
    """One rank's save outcome: a fixed-size ``status`` for the first gather, and the two
    descriptor documents, sent only when rank 0 asks (one rank per distinct digest)."""

    status: dict
    tensors_doc: dict
    values_doc: dict


def _describe(prep: _Prepared, comm: Comm) -> tuple[dict, str, set]:
    """This rank's tensor descriptor: what it holds, and each tensor's grid where one applies.

    Ranks with equal descriptors (every data-parallel rank of a stage, say)
    produce equal bytes, so the commit fetches one per distinct digest and the
    gather stays O(ranks + tensors) instead of O(ranks x tensors).
    """
    meshes: dict[tuple, int] = {}
    mesh_of: dict[tuple, tuple[int, tuple]] = {}  # (id(ranks), shape) -> (mesh index, ranks kept alive)
    memo: dict = {}
    held: dict[str, list] = {}
    mine = {id(t) for t in prep.mine}
    for t in prep.tensors:
        held.setdefault(t.fqn, []).append(t)
    entries: dict[str, list] = {}
    listed: set[str] = set()
    for fqn, ts in held.items():
        t = ts[0]
        dt = dtype_name(t.data.dtype)
        grid = _checked_grid(t, prep, comm, id(t) in mine, memo) if len(ts) == 1 else None
        if grid is None:
            listed.add(fqn)
            entries[fqn] = [dt, list(t.shape), t.layout, None, None, any(id(x) in mine for x in ts)]
            continue
        # Tuples do not cache their hash: hash each distinct rank tuple once, not per tensor.
        hit = mesh_of.get((id(grid.ranks), grid.mesh_shape))
        if hit is None:
            hit = mesh_of[(id(grid.ranks), grid.mesh_shape)] = (meshes.setdefault((grid.mesh_shape, grid.ranks), len(meshes)), grid.ranks)
        m = hit[0]
        copy = prep.writers.get(_wkey_of(prep, t), 0) if t.replica_count > 1 else 0
        entries[fqn] = [dt, list(t.shape), t.layout, m, [list(x) for x in grid.splits], copy]
    doc = {
        "meshes": [[list(k[0]), list(k[1])] for k in sorted(meshes, key=meshes.get)],
        "tensors": entries,
    }
    digest = xxhash.xxh3_128_hexdigest(json.dumps(doc, separators=(",", ":")).encode("utf-8"))
    return doc, digest, listed


def _wkey_of(prep: _Prepared, t: SaveTensor) -> str:
    return t.fqn if t.fqn in prep.writers else f"{t.fqn}@{t.box.offsets}"


def _group_grid(grid: Grid | None, comm: Comm) -> Grid | None:
    """The grid in this process group's ranks (DTensor meshes and ``replicated_over`` use global ranks)."""
    if grid is None or comm.group is None:
        return grid
    import torch.distributed as dist

    try:
        ranks = tuple(dist.get_group_rank(comm.group, r) for r in grid.ranks)
    except (ValueError, RuntimeError):
        return None  # a mesh reaching outside the group: list the chunks instead
    return Grid(grid.mesh_shape, ranks, grid.splits)


def _checked_grid(t: SaveTensor, prep: _Prepared, comm: Comm, picked: bool, memo: dict | None = None) -> Grid | None:
    """``t``'s grid, if it reproduces this rank's box, copy index and writer choice; else ``None``.

    A grid the loader would derive wrongly must never reach the manifest:
    any disagreement here makes the tensor's chunks listed instead.
    """
    if t.flat is not None:
        return None
    memo = {} if memo is None else memo  # grids are O(mesh) to build: one per mesh, not per tensor
    if t.grid is not None:
        key = ("group", id(t.grid))
        if key not in memo:
            memo[key] = (_group_grid(t.grid, comm), t.grid)
        grid = memo[key][0]
    elif t.layout in ("replicated", "local"):
        ranks = prep.ctx.replica_ranks(t.fqn) if prep.ctx is not None else None
        key = ("plain", id(ranks), len(t.shape))
        if key not in memo:
            if ranks is None:
                g = Grid((comm.world,), tuple(range(comm.world)), ((),) * len(t.shape))
            else:
                g = _group_grid(Grid((len(ranks),), tuple(sorted(ranks)), ((),) * len(t.shape)), comm)
            memo[key] = (g, ranks)
        grid = memo[key][0]
    else:
        return None
    if grid is None or grid.copies != max(1, t.replica_count) or len(grid.splits) != len(t.shape):
        return None
    coord = grid.coord_of(comm.rank)
    if coord is None or grid.replica_index(coord) != t.replica_index:
        return None
    box = grid.box(t.shape, coord)
    if box != t.box and not (box.numel == 0 and t.box.numel == 0):
        return None
    copy = prep.writers.get(_wkey_of(prep, t), 0) if t.replica_count > 1 else 0
    if picked != (t.replica_index == copy):
        return None
    return grid


def prepare_save(state, comm: Comm, allow_pickle: bool, where: str, result: SaveResult, rules=(), cache: dict | None = None, replicated_over: Any = None, rank_local: bool = False) -> _Prepared:
    """Describe this rank's part of ``state`` and choose writers: the blocking first step of every save.

    Shared by :func:`save` and the asynchronous saver (which passes a
    ``cache`` reused across saves).

    Example::

        prep = prepare_save(state, comm, False, "ckpt", SaveResult("ckpt", save_id))
    """
    ta = time.monotonic()
    # Repeated saves (AsyncSaver) reuse the context and the unchanged module and
    # optimizer parts; layout rules reduce across ranks, so they take the full path.
    parts: PartCache | None = None
    if cache is not None and not rules:
        parts = cache.setdefault("parts", PartCache())
    ctx = parts.context(state, comm.rank, comm.world, allow_pickle, replicated_over) if parts is not None else None
    if ctx is None:
        ctx = _context(state, comm, allow_pickle, replicated_over)
        if parts is not None:
            parts.remember_context(state, comm.rank, comm.world, allow_pickle, replicated_over, ctx)
    adapters = default_adapters()
    tensors: list[SaveTensor] = []
    values, layout = {}, {}
    lazy_ok: set[str] = set(ctx.param_names.values())
    opt_parts: list = []
    for key, obj in state.items():
        part = parts.get(key, obj, ctx) if parts is not None else None
        if part is None:
            adapter = adapter_for(obj, adapters)
            part = adapter.save(key, obj, ctx)
            if parts is not None:
                parts.put(key, obj, adapter, part, ctx)
        tensors.extend(part.tensors)
        values[key] = part.value
        layout[key] = part.framework
        if isinstance(obj, torch.optim.Optimizer) and not own_protocol(type(obj)):
            opt_parts.append(part)
            if rules:
                values[key] = optimizer_doc_to_logical(key, part.value, rules)
    prev = cache.get("checked") if cache is not None and not rules else None
    if prev is not None and len(prev[0]) == len(tensors) and all(a is b for a, b in zip(prev[0], tensors)):
        # The very SaveTensor objects checked and planned last time: nothing to redo.
        result.plan_cached = True
        prep = _Prepared(tensors, [tensors[i] for i in prev[1]], values, layout, prev[2], prev[3], ctx, prev[4].described)
        cache["checked"] = prev[:4] + (prep,)
        mark_phase(result, "plan", ta)
        return prep
    for part in opt_parts:
        # Optimizer state changes only inside step(): safe to copy lazily.
        lazy_ok.update(t.fqn for t in part.tensors if ".state." in t.fqn)
    if rank_local:  # process_group=LOCAL: one writer, so every tensor must be whole here
        tensors = rank_local_tensors(tensors, where)
    if rules:
        tensors = apply_reduce(tensors, rules, comm)
        logical: list[SaveTensor] = []
        lazy_logical: set[str] = set()
        for t in tensors:
            pieces = apply_save([t], rules)
            logical.extend(pieces)
            if t.fqn in lazy_ok:
                lazy_logical.update(x.fqn for x in pieces)
        tensors, lazy_ok = logical, lazy_ok | lazy_logical
    seen = set()
    for t in tensors:
        if dtype_name(t.data.dtype) not in DTYPE_SIZES:
            raise UnsupportedStateError(
                f"{where}: tensor {t.fqn!r} has dtype {t.data.dtype}, which format version "
                f"{FORMAT_VERSION} cannot store (supported: {', '.join(sorted(DTYPE_SIZES))}); cast it first"
            )
        key = (t.fqn, t.box, t.flat)
        if key in seen:
            raise UnsupportedStateError(f"{where}: tensor name {t.fqn!r} appears twice in the state")
        seen.add(key)

    # Plan cache: the same names, shapes, dtypes and geometry give the same writers.
    sig = tuple((t.fqn, t.shape, t.data.dtype, t.box, t.flat, t.replica_index, t.replica_count, t.replica_group) for t in tensors)
    hit = cache.get("plan") if cache is not None else None
    picked, writers = (hit[1], hit[2]) if hit is not None and hit[0] == sig else (None, None)
    if picked is None:
        picked, writers = choose_writers(tensors)
        if cache is not None:
            cache["plan"] = (sig, picked, writers)  # one layout: a changed layout never reuses stale choices
    else:
        result.plan_cached = True
    mine = [tensors[i] for i in picked]
    prep = _Prepared(tensors, mine, values, layout, lazy_ok, writers, ctx)
    if cache is not None and not rules:
        cache["checked"] = (tuple(tensors), picked, lazy_ok, writers, prep)
    mark_phase(result, "plan", ta)
    return prep


def choose_writers(tensors: Sequence[SaveTensor], assign=assign_writers) -> tuple[tuple[int, ...], dict[str, int]]:
    """Which of ``tensors`` this rank writes (indices), and the copy index writing each replicated one.

    Pure and local: every rank holding a replicated tensor computes the same
    choice. Writers are keyed by name, so every shard of a tensor is written
    by the same copy index and the manifest records that one index (format
    version 2); a name a rank holds several pieces of keeps one key per
    piece. Balancing runs within each replica group, whose ranks all list
    the same replicated tensors. Small tensors (optimizer steps, norms,
    biases) gain nothing from balancing: copy 0 writes them all, so a loader
    needs few index files to find them.
    """
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.fqn] = counts.get(t.fqn, 0) + 1

    def wkey(t: SaveTensor) -> str:
        return t.fqn if counts[t.fqn] == 1 else f"{t.fqn}@{t.box.offsets}"

    groups: dict[str, list[ReplicaItem]] = {}
    writers: dict[str, int] = {}
    for t in tensors:
        if t.replica_count > 1:
            if t.nbytes <= SMALL_REPLICA_BYTES:
                writers[wkey(t)] = 0
            else:
                groups.setdefault(t.replica_group, []).append(ReplicaItem(wkey(t), t.replica_count, t.cost))
    writers.update({k: w for items in groups.values() for k, w in assign(items).items()})
    picked = tuple(i for i, t in enumerate(tensors) if t.replica_count <= 1 or writers[wkey(t)] == t.replica_index)
    return picked, writers


def finish_save(
    comm: Comm, storage: Storage, save_id: str, block_size: int, out: Outcome, result: SaveResult, where: str,
    claim: SaveClaim | None = None, policy: CommitPolicy | None = None,
) -> None:
    """Commit on rank 0 from two small gathers, and raise the same error everywhere.

    First every rank's fixed-size status (its files, index digest and the
    digests of its two descriptors); then only the ranks rank 0 asks for, one
    per distinct descriptor, send it. Chunk records never travel: each rank
    wrote its own index file. Rank 0's ``claim`` on the path is checked
    right before the commit and released at the end, whatever happens.
    """
    try:
        _finish_claimed(comm, storage, save_id, block_size, out, result, where, claim, policy or CommitPolicy())
    finally:
        if claim is not None:
            claim.release()


def _finish_claimed(
    comm: Comm, storage: Storage, save_id: str, block_size: int, out: Outcome, result: SaveResult, where: str,
    claim: SaveClaim | None, policy: CommitPolicy,
) -> None:
    status = Outcome(True, out.value.status) if out.ok else out.sendable(with_value=False)
    gathered = comm.gather(status)
    tc = time.monotonic()
    decision: tuple = ()
    if comm.rank == 0:
        assert gathered is not None
        if all(o.ok for o in gathered):
            want_t: dict[str, int] = {}
            want_v: dict[str, int] = {}
            for r, o in enumerate(gathered):
                want_t.setdefault(o.value["tdig"], r)
                want_v.setdefault(o.value["vdig"], r)
            decision = ("ask", set(want_t.values()), set(want_v.values()))
        else:
            decision = ("failed", [o.sendable(with_value=False) for o in gathered])
    decision = comm.broadcast(decision)
    if decision[0] == "failed":
        mark_phase(result, "commit", tc)
        if out.ok:  # nothing will list this rank's files (unique to this save): remove them now
            try:
                storage.delete_many(sorted(out.value.status["files"]))
            except Exception as e:  # noqa: BLE001 - a later commit's cleanup removes them
                log.debug("rank %s: could not remove its files of the failed save: %s", comm.rank, e)
        raise_if_failed(decision[1], f"save to {where}")
    _, ask_t, ask_v = decision
    local: _Local = out.value
    docs = comm.gather((
        local.tensors_doc if comm.rank in ask_t else None,
        local.values_doc if comm.rank in ask_v else None,
    ))
    final: list[Outcome] | None = None
    if comm.rank == 0:
        assert gathered is not None and docs is not None
        statuses = [o.value for o in gathered]
        commit = run_guarded(lambda: _commit(storage, save_id, comm.world, block_size, statuses, docs, where, claim, policy))
        if comm.world == 1 and not commit.ok:
            raise commit.exc
        final = [commit.sendable()]
    final = comm.broadcast(final)
    mark_phase(result, "commit", tc)
    raise_if_failed(final, f"save to {where}")
    result.save_id = final[0].value  # the manifest's id (rank 0's)


def _commit(
    storage: Storage, save_id: str, world: int, block: int, statuses: list[dict], docs: list[tuple], where: str,
    claim: SaveClaim | None = None, policy: CommitPolicy | None = None,
) -> str:
    """Rank 0: merge the distinct descriptors into a version-2 manifest and write it.

    Work and memory are O(ranks + distinct descriptors x tensors): chunk
    records stay in the ranks' index files.
    """
    files: dict[str, int] = {}
    ranks: list[RankFiles | None] = []
    by_tdig: dict[str, list[int]] = {}
    for r, st in enumerate(statuses):
        files.update(st["files"])
        ranks.append(None if st["ranks"] is None else RankFiles(*st["ranks"]))
        by_tdig.setdefault(st["tdig"], []).append(r)
    meta: dict[str, tuple] = {}
    grids: dict[str, set] = {}
    holders: dict[str, set[int]] = {}
    mentions: dict[str, int] = {}  # ranks describing each tensor with a grid
    placements: dict[str, str] = {}
    made: dict[tuple, Grid] = {}  # one Grid per (mesh, splits): building one validates its ranks
    for tdig, members in by_tdig.items():
        doc = next(d[0] for d in (docs[r] for r in members) if d[0] is not None)
        meshes = [(tuple(m[0]), tuple(m[1])) for m in doc["meshes"]]
        for fqn, (dt, shape, lay, mesh, splits, extra) in doc["tensors"].items():
            prev = meta.setdefault(fqn, (dt, tuple(shape)))
            if prev != (dt, tuple(shape)):
                raise ShapeMismatchError(f"{where}: ranks disagree on tensor {fqn!r}: {prev} vs {(dt, tuple(shape))}")
            placements.setdefault(fqn, lay)
            if mesh is None:
                grids.setdefault(fqn, set()).add(None)
                if extra:
                    holders.setdefault(fqn, set()).update(members)
            else:
                key = (meshes[mesh], tuple(tuple(x) for x in splits))
                grid = made.get(key)
                if grid is None:
                    grid = made[key] = Grid(key[0][0], key[0][1], key[1])
                grids.setdefault(fqn, set()).add((grid, extra))
                mentions[fqn] = mentions.get(fqn, 0) + len(members)
    values: dict[str, Any] = {}
    layout: dict[str, Any] = {}
    for r, d in enumerate(docs):
        if d[1] is not None:
            for k, doc in d[1]["values"].items():
                values[k] = _merge(values[k], doc) if k in values else doc
            for k, fw in d[1]["layout"].items():
                layout.setdefault(k, fw)
    cover: dict[str, int] = {}
    for st in statuses:
        for fqn, n in st["cover"].items():
            cover[fqn] = cover.get(fqn, 0) + n
    tensors: dict[str, TensorMeta] = {}
    keys: dict[int, str] = {}
    for fqn, (dt, shape) in meta.items():
        other = keys.setdefault(fqn_key(fqn, dt), fqn)
        if other != fqn:
            raise UnsupportedStateError(f"{where}: tensor names {other!r} and {fqn!r} share a 64-bit key; rename one")
        g = grids[fqn]
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
            tensors[fqn] = TensorMeta(dt, shape, None, grid, copy)
            continue
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
        tensors[fqn] = TensorMeta(dt, shape, None, holders=rank_runs(holders.get(fqn, ())))
    manifest = Manifest(
        save_id=save_id,
        world_size=world,
        block_size=block,
        tensors=tensors,
        values=values,
        files=files,
        layout={"world_size": world, "entries": layout, "placements": placements},
        created=time.time(),
        format_version=FORMAT_VERSION,
        ranks=tuple(ranks),
    )
    data = manifest.to_json()
    if claim is not None:
        claim.confirm()
    try:
        storage.put_atomic(MANIFEST_NAME, data)
    except OSError as e:
        raise StorageError(f"{where}: committing {MANIFEST_NAME} failed: {e}") from e
    cleanup_after_commit(storage, files, data, (policy or CommitPolicy()).cleanup_grace_s, where)
    return save_id


def _entry_selected(key: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) or p.startswith(key + ".") or fnmatch.fnmatchcase(key + ".x", p) for p in patterns)


def _name_selected(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _entry_keys(manifest: Manifest) -> list[str]:
    """Every top-level key of the checkpoint: entries with values, and the tops of tensor names."""
    keys = dict.fromkeys(manifest.values)
    keys.update(dict.fromkeys(f.split(".", 1)[0] for f in manifest.tensors))
    return list(keys)


def _param_names(opt: torch.optim.Optimizer, ctx: AdapterContext) -> list[str]:
    """The state names of ``opt``'s parameters (those a module in the state owns)."""
    names = (ctx.param_names.get(id(p)) for g in opt.param_groups for p in g["params"])
    return [n for n in names if n is not None]


def _physical_shapes(state) -> dict[str, tuple]:
    shapes = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            if is_megatron(unwrap_module(obj)):  # local TP shards and stage-local layer names
                shapes.update(megatron_global_shapes(key, unwrap_module(obj)))
                continue
            for n, t in unwrap_module(obj).state_dict().items():
                if isinstance(t, torch.Tensor):
                    shapes[f"{key}.{n}"] = tuple(t.shape)
    return shapes


def _materialize_meta(state: MutableMapping[str, Any]) -> None:
    for obj in state.values():
        if isinstance(obj, nn.Module):
            m = unwrap_module(obj)
            if any(t.is_meta for t in m.parameters()) or any(t.is_meta for t in m.buffers()):
                m.to_empty(device=torch.device("cpu"))


def read_tensor(path: str | Storage, name: str, index: tuple | None = None, *, verify: bool = True) -> torch.Tensor:
    """Read one logical tensor (or a box of it) by name, with no process group.

    ``index`` is a tuple of slices (step 1) selecting a box; only the bytes
    covering that box are read. Never a collective: any one rank may call it
    while the others are elsewhere.

    Example::

        w = sp.read_tensor("ckpt/step_100", "model.layers.0.attn.wq.weight")
        rows = sp.read_tensor("ckpt/step_100", "model.tok.weight", (slice(0, 10),))
    """
    storage = storage_for(path)
    manifest = Manifest.from_json(_manifest_bytes(storage), storage.url)
    meta = manifest.tensors.get(name)
    if meta is None:
        close = [k for k in manifest.tensors if name.split(".")[-1] in k][:5]
        raise KeyMismatchError(f"{storage.url}: no tensor {name!r} in the checkpoint (similar: {close})", [name], [])
    box = Box.full(meta.shape)
    if index is not None:
        if not isinstance(index, tuple):
            index = (index,)
        offs, sizes = list(box.offsets), list(box.sizes)
        for d, sl in enumerate(index):
            if not isinstance(sl, slice) or sl.step not in (None, 1):
                raise ValueError(f"index must be a tuple of step-1 slices, got {index!r}")
            lo, hi, _ = sl.indices(meta.shape[d])
            offs[d], sizes[d] = lo, max(0, hi - lo)
        box = Box(tuple(offs), tuple(sizes))
    manifest = resolve(storage, manifest, {name: [box]}, storage.url)
    _check_provided(storage, manifest.tensors[name], name, box)
    dest = torch.empty(box.sizes, dtype=torch_dtype(meta.dtype))
    target = LoadTarget(name, dest, tuple(meta.shape), box)
    execute_reads(storage, manifest, [target], storage.url, verify)
    return dest


def _check_provided(storage: Storage, meta: TensorMeta, name: str, box: Box) -> None:
    """Before allocating: the chunks must hold ``numel x itemsize`` bytes of ``box``, in files that big.

    A crafted shape or file size then fails here as a typed error instead of
    in ``torch.empty`` or a short read.
    """
    chunks = meta.chunks or ()
    have = 0
    for c in chunks:
        inter = c.box.intersect(box) if c.flat is None else None
        have += inter.numel if inter is not None else 0
    need = box.numel
    flat = any(c.flat is not None for c in chunks)
    if not flat and have < need:
        raise CorruptCheckpointError(
            f"{storage.url}: tensor {name!r}: its chunks provide {have} of the {need} elements "
            f"({need * meta.itemsize} bytes) of the box {box.offsets}+{box.sizes}; the checkpoint is corrupt"
        )
    sizes: dict[str, int] = {}
    for c in chunks:
        if c.file not in sizes:
            try:
                sizes[c.file] = storage.size(c.file)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{storage.url}: data file {c.file} of tensor {name!r} is missing") from None
        if c.offset + c.nbytes > sizes[c.file]:
            raise CorruptCheckpointError(
                f"{storage.url}: data file {c.file} of tensor {name!r} is shorter than the manifest says "
                f"(truncated?): its chunk bytes [{c.offset}, {c.offset + c.nbytes}) run past its {sizes[c.file]} bytes"
            )


def read_manifest(path: str | Storage, *, chunks: bool = True) -> Manifest:
    """Read and validate the manifest of a committed checkpoint (no process group needed).

    With ``chunks=True`` every tensor's chunks are listed, which for a
    format-version-2 checkpoint reads every rank's index file (checked
    against the manifest's digests); ``chunks=False`` reads the manifest only.

    Example::

        m = sp.read_manifest("ckpt/step_100"); print(sorted(m.tensors))
    """
    storage = storage_for(path)
    manifest = Manifest.from_json(_manifest_bytes(storage), storage.url)
    return resolve_all(storage, manifest, storage.url) if chunks else manifest


def _manifest_bytes(storage: Storage) -> bytes:
    try:
        return storage.get_limited(MANIFEST_NAME, Limits.from_env().manifest_bytes)
    except FileNotFoundError:
        if not storage.location_exists():
            raise CheckpointNotFoundError(f"no checkpoint at {storage.url}: the path does not exist") from None
        raise IncompleteCheckpointError(
            f"{storage.url} holds no committed manifest: the save that wrote it was interrupted or is "
            "still running; load an earlier checkpoint"
        ) from None


def _key_mismatch(where: str, missing: list[str], unexpected: list[str], strict: bool) -> None:
    msg = (
        f"{where}: state and checkpoint differ: missing from the checkpoint "
        f"{sorted(missing)[:20]}{' ...' if len(missing) > 20 else ''}; unexpected in the checkpoint "
        f"{sorted(unexpected)[:20]}{' ...' if len(unexpected) > 20 else ''}"
    )
    if strict:
        raise KeyMismatchError(msg + " (pass strict=False to load the intersection)", missing, unexpected)
    log.warning("%s", msg)


def _not_restored(where: str, rank: int, names: list[str], strict: bool) -> None:
    """Report tensors that a load read but that did not reach the live state."""
    msg = (
        f"{where}: rank {rank}: {len(names)} tensor(s) read from the checkpoint did not reach the live state: "
        f"{names[:20]}{' ...' if len(names) > 20 else ''}. The object's load_state_dict (its hooks or a "
        "_load_from_state_dict override) did not install them, so training would resume from other values; "
        "fix how that object loads its state"
    )
    if strict:
        raise StateNotRestoredError(msg + " (pass strict=False to load anyway, keeping their current values)", names)
    log.warning("%s", msg)


def load(
    path: str | Storage,
    state: MutableMapping[str, Any],
    *,
    process_group: Any = None,
    strict: bool = True,
    allow_pickle: bool = False,
    verify: bool = True,
    share_reads: bool | str = "auto",
    keys: str | Sequence[str] | None = None,
    layouts: Sequence[Rule] = (),
    report: LoadResult | None = None,
    trace_dir: str | None = None,
    on_metrics: Any = None,
    collective_timeout: float | None = None,
) -> MutableMapping[str, Any]:
    """Load a checkpoint into ``state``, resharding to the current layout.

    Modules, optimizers and ``Stateful`` objects are restored in place (a fresh,
    never-stepped optimizer is fine). Plain values and plain tensors in
    ``state`` are replaced by the saved ones; the same dict is returned. With
    ``strict=True`` any key missing from or unexpected in the checkpoint raises
    :class:`KeyMismatchError`; with ``strict=False`` the intersection loads and
    the rest is logged. Checksums of everything read are verified. With
    ``share_reads=True`` bytes that several ranks need are read from storage
    once and sent to the others; ``False`` re-reads them on every rank, which
    is cheaper on a fast local disk. The default, ``"auto"``, shares unless
    every rank runs on one host and the storage is a local path or memory
    (there a second rank's read comes from the page cache). ``keys`` selects what to load with
    glob patterns over tensor names (``"model.*"`` loads the model and skips
    everything else; ``"model.layers.0.*"`` one layer); unselected tensors keep
    their values and are never reported missing. Modules on the ``meta``
    device are materialised on the CPU first (create the optimizer after
    loading in that case). ``layouts`` describes fused or padded tensors of
    the *target* (see :mod:`shardpoint.layouts`). Pass a
    :class:`LoadResult` as ``report`` to receive timings, bytes and key lists.
    An optimizer saved the way ``get_optimizer_state_dict`` keys it (state by
    the model's parameter names, ``param_groups``) loads too: its entries are
    matched to the optimizer's parameters by name (:mod:`shardpoint.dcp_names`).
    A non-strict load into an empty dict, ``sp.load(path, {}, strict=False)``,
    fills it with everything in the checkpoint: each entry as saved, tensors
    as plain full tensors on the CPU (a module or optimizer entry as the dict
    of its value document and tensors by name). ``process_group`` and
    ``collective_timeout`` mean what they mean for :func:`save`
    (:data:`~shardpoint.LOCAL`: this rank alone, no collective).

    Example::

        state = {"model": model, "optimizer": opt, "extra": {}}
        sp.load("ckpt/step_100", state); step = state["extra"]["step"]
        everything = sp.load("ckpt/step_100", {}, strict=False)
    """
    check_state(state)
    comm = Comm.resolve(process_group)
    storage = storage_for(path)
    where = storage.url
    comm.enter("load", where, collective_timeout)
    t0 = time.monotonic()
    got = run_guarded(lambda: _manifest_bytes(storage)) if comm.rank == 0 else None
    if comm.world == 1 and got is not None and not got.ok:
        raise got.exc
    got = comm.broadcast(got.sendable() if comm.rank == 0 else None)
    raise_if_failed([got], f"load of {where}")
    manifest = Manifest.from_json(got.value, where)
    fill = None
    if not state and not strict:  # nothing to restore into: return every entry as saved
        fill, state = state, {k: WholeEntry() for k in _entry_keys(manifest)}
    result = LoadResult(where, recorder=Recorder("load", where, comm.rank))
    mark_phase(result, "manifest", t0)

    def prepare() -> dict:
        ctx = _context(state, comm, allow_pickle)
        adapters = default_adapters()
        tensors = manifest.tensors
        view = None
        if layouts:
            phys = _physical_shapes(state)
            view = tensors = LayoutView(manifest.tensors, layouts, phys)
        parts = {}
        missing: list[str] = []
        unexpected: list[str] = []
        consumed: set[str] = set()
        for key, obj in state.items():
            if selected is not None and not _entry_selected(key, selected):
                continue
            prefix = key + "."
            has_tensors = any(f == key or f.startswith(prefix) for f in manifest.tensors)
            if key not in manifest.values and not has_tensors:
                missing.append(key)
                continue
            doc = manifest.values.get(key)
            native_optimizer = isinstance(obj, torch.optim.Optimizer) and not own_protocol(type(obj))
            if native_optimizer and is_dcp_optimizer_doc(doc):
                # Keyed the way get_optimizer_state_dict keys it: a naming view onto this optimizer.
                doc = dcp_to_native(doc, _param_names(obj, ctx), where)
            if layouts and native_optimizer:
                check_optimizer_doc(doc, f"{where}: entry {key!r}")
                doc = optimizer_doc_to_physical(key, doc, layouts, ctx.param_names.values())
            part = adapter_for(obj, adapters).load(key, obj, doc, tensors, ctx, where)
            if view is not None:
                part.targets = apply_load(part.targets, layouts)
                part.consumed = {n for f in part.consumed for n in view.logical_names(f)}
            parts[key] = part
            missing.extend(part.missing)
            unexpected.extend(part.unexpected)
            consumed |= part.consumed
        loaded = set(parts)
        for fqn in manifest.tensors:
            top = fqn.split(".", 1)[0]
            if top in loaded and fqn not in consumed:
                unexpected.append(fqn)
        for key in manifest.values:
            if key not in state:
                unexpected.append(key)
        if selected is not None:
            # Only the selected names are loaded, and only they can be missing or unexpected.
            missing = [n for n in missing if _name_selected(n, selected)]
            unexpected = [n for n in unexpected if _name_selected(n, selected)]
            for p in parts.values():
                p.targets = [t for t in p.targets if _name_selected(t.fqn, selected)]
        result.missing, result.unexpected = sorted(missing), sorted(unexpected)
        if missing and strict:
            _key_mismatch(where, missing, unexpected, strict)
        return parts

    selected = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
    _materialize_meta(state)

    # Phase 1 (local): targets and plans. Checked collectively, so that the shared read
    # below starts on every rank or on none.
    tp = time.monotonic()
    parts = comm.check(run_guarded(prepare), f"load of {where}")
    mark_phase(result, "prepare", tp)
    # Unexpected means no rank loads it (each pipeline stage loads only its own layers).
    result.unexpected = sorted(set.intersection(*(set(u) for u in comm.all_gather(result.unexpected))))
    if result.missing or result.unexpected:
        _key_mismatch(where, result.missing, result.unexpected, strict)

    def read() -> dict:
        tr = time.monotonic()
        targets = [t for p in parts.values() for t in p.targets]
        wants: dict[str, list[Box]] = {}
        for t in targets:
            wants.setdefault(t.fqn, []).append(wanted_box(t.box, t.flat))
        ti = time.monotonic()
        reader = IndexReader(storage, manifest, where)
        resolved = resolve(storage, manifest, wants, where, reader)
        result.index_bytes = reader.bytes_read
        mark_phase(result, "index", ti, reader.bytes_read)
        stats = execute_reads(storage, resolved, targets, where, verify, comm=comm, share=share_reads, recorder=result.recorder)
        result.bytes_read, result.bytes_needed = stats.bytes_read, stats.bytes_needed
        result.bytes_received = stats.bytes_received
        mark_phase(result, "read", tr)
        values = {key: p.finish() for key, p in parts.items()}
        tl = time.monotonic()
        bad: list[str] = []
        for key, p in parts.items():
            if p.landed is not None:
                bad.extend(p.landed(p.targets))
            else:
                bad.extend(unlanded(p.targets, live_storages(entry_tensors(values[key]))))
        mark_phase(result, "landing", tl)
        result.not_restored = sorted(set(bad))
        if bad:
            _not_restored(where, comm.rank, result.not_restored, strict)
        return values

    new = comm.check(run_guarded(read), f"load of {where}")
    for key, value in new.items():
        state[key] = value
    if fill is not None:  # entries that keys= left out stay out
        fill.update({k: v for k, v in state.items() if not isinstance(v, WholeEntry)})
        state = fill
    mark_phase(result, "total", t0)
    result.timings = result.recorder.summary()
    result.recorder.emit(trace_dir, on_metrics)
    if report is not None:
        for f in ("path", "bytes_read", "index_bytes", "bytes_needed", "bytes_received", "missing", "unexpected", "not_restored", "timings", "recorder"):
            setattr(report, f, getattr(result, f))
    log.info("rank %s read %s bytes from %s: %s", comm.rank, result.bytes_read, where, format_summary(result.timings))
    return state
