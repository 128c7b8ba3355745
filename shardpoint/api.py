"""The public entry points: :func:`save` and :func:`load`.

Thin glue: adapters flatten the state, the planners decide who writes and
what to read, the engine moves bytes, storage persists them. Every collective
goes through :class:`~shardpoint.dist.Comm`, which is a world of one when no
process group is initialised, so the same path runs everywhere.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, MutableMapping, Sequence

import torch

from .adapters import WholeEntry, adapter_for, build_context, default_adapters
from .items import LoadTarget, torch_dtype
from .adapters.landing import entry_tensors, live_storages, unlanded
from .adapters.optimizer import own_protocol
from .dcp_names import dcp_to_native, is_dcp_optimizer_doc
from .dist import Comm, raise_if_failed, run_guarded
from .engine.claim import CommitPolicy, SaveClaim
from .engine.indexes import IndexReader, resolve, resolve_all, wanted_box
from .engine.io import write_chunks
from .format.datafile import DEFAULT_BLOCK_SIZE
from .engine.load import execute_reads
from .errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    KeyMismatchError,
    StateNotRestoredError,
    UnsupportedStateError,
)
from .format.manifest import MANIFEST_NAME, Manifest
from .format.strict import Limits
from .format.values import check_optimizer_doc
from .geometry import Box
from .load_steps import check_provided, entry_keys, entry_selected, materialize_meta, name_selected, param_names, physical_shapes
from .layouts import LayoutView, Rule, apply_load, optimizer_doc_to_physical
from .replicas import with_copies
from .adapters.experts import deepspeed_expert_rules
from .monitor import Recorder, format_summary
from .save_steps import SaveResult, check_block_size, data_file_name, finish_save, mark_phase, prepare_save
from .storage import Storage, storage_for

__all__ = ["save", "load", "read_tensor", "read_manifest", "SaveResult", "LoadResult", "CommitPolicy", "check_state"]

log = logging.getLogger("shardpoint")


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
    ranks, or a dict from state keys to those; keys with a dot or a glob
    character are patterns over tensor names (``{"model.experts.*":
    expert_group}``; also as a list of ``(pattern, group)`` pairs), and
    ranks of different groups holding one name are stored as one copy per
    group. Before writing, ranks that are to hold the same copy compare
    digests of it; copies that differ raise
    :class:`~shardpoint.errors.ReplicaMismatchError` on every rank and
    nothing is committed. Under pipeline parallelism
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

    def local():
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
        report = prep.summary(storage, records, files, comm)
        result.bytes_written = sum(report.status.files.values())
        return report

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
    check_provided(storage, manifest.tensors[name], name, box)
    dest = torch.empty(box.sizes, dtype=torch_dtype(meta.dtype))
    target = LoadTarget(name, dest, tuple(meta.shape), box)
    execute_reads(storage, manifest, [target], storage.url, verify)
    return dest


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
    replicated_over: Any = None,
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
    (:data:`~shardpoint.LOCAL`: this rank alone, no collective). Tensors
    that ranks of different replica groups saved as one copy per group
    (see :func:`save`'s ``replicated_over``) load from the copy of the group
    that holds this rank; ``replicated_over`` may be passed here as at save,
    and is checked the same way, but is not needed.

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
        fill, state = state, {k: WholeEntry() for k in entry_keys(manifest)}
    result = LoadResult(where, recorder=Recorder("load", where, comm.rank))
    mark_phase(result, "manifest", t0)

    # Names saved as one copy per replica group; DeepSpeed MoE experts at their global index.
    layouts = with_copies([*layouts, *deepspeed_expert_rules(state)], manifest.tensors)

    def prepare() -> dict:
        ctx = build_context(state, comm.rank, comm.world, allow_pickle, replicated_over)
        adapters = default_adapters()
        tensors = manifest.tensors
        view = None
        if layouts:
            phys = physical_shapes(state)
            view = tensors = LayoutView(manifest.tensors, layouts, phys)
        parts = {}
        missing: list[str] = []
        unexpected: list[str] = []
        consumed: set[str] = set()
        for key, obj in state.items():
            if selected is not None and not entry_selected(key, selected):
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
                doc = dcp_to_native(doc, param_names(obj, ctx), where)
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
            missing = [n for n in missing if name_selected(n, selected)]
            unexpected = [n for n in unexpected if name_selected(n, selected)]
            for p in parts.values():
                p.targets = [t for t in p.targets if name_selected(t.fqn, selected)]
        result.missing, result.unexpected = sorted(missing), sorted(unexpected)
        if missing and strict:
            _key_mismatch(where, missing, unexpected, strict)
        return parts

    selected = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
    materialize_meta(state)

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
