"""The public entry points: :func:`save` and :func:`load`.

Thin glue: adapters flatten the state, the planners decide who writes and
what to read, the engine moves bytes, storage persists them. Every collective
goes through :class:`~shardpoint.dist.Comm`, which is a world of one when no
process group is initialised, so the same path runs everywhere.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, MutableMapping, Sequence

import torch

from .engine.claim import CommitPolicy
from .engine.indexes import resolve, resolve_all
from .engine.load import execute_reads
from .engine.references import open_references
from .errors import KeyMismatchError
from .format.datafile import DEFAULT_BLOCK_SIZE
from .format.manifest import Manifest
from .geometry import Box
from .items import LoadTarget, torch_dtype
from .layouts import Rule
from .loading import LoadOptions, LoadResult, LoadTransaction, manifest_bytes
from .loading.diagnose import check_provided
from .loading.names import close_names
from .runtime.progress import SAVE_PHASES, progress_for
from .saving.steps import SaveResult
from .saving import SaveOptions, SaveTransaction, check_state
from .storage import Storage, storage_for

__all__ = ["save", "load", "read_tensor", "read_manifest", "SaveResult", "LoadResult", "CommitPolicy", "check_state"]

log = logging.getLogger("shardpoint")


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
    progress: bool = False,
    base: str | Storage | None = None,
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
    :class:`DistributedError` instead of hanging (see :mod:`shardpoint.runtime.handshake`).

    One save writes a path at a time: rank 0 claims it before any data is
    written, and a save to a path that another save is writing raises
    :class:`~shardpoint.errors.ConcurrentSaveError` without committing, so
    the path keeps a whole checkpoint (the other save's, or what it held).
    Files the new checkpoint no longer needs are removed after the commit,
    once no committed manifest lists them and they are older than a grace
    period. ``commit`` (a :class:`CommitPolicy`) sets the claim's lease and
    that grace period; :mod:`shardpoint.engine.claim` states the guarantee.
    ``progress=True`` shows the bytes written and the rate on stderr, on
    rank 0 (see :mod:`shardpoint.runtime.progress`).

    ``base`` (a committed checkpoint beside ``path``) makes the save incremental:
    chunks whose bytes equal ``base``'s at the same place are referenced, not
    written (:mod:`shardpoint.saving.incremental`); keep ``base`` as long, or
    copy with :func:`~shardpoint.consolidate`.

    Example::

        sp.save("ckpt/step_100", {"model": model, "optimizer": opt, "extra": {"step": 100}})
        sp.save("ckpt/step_200", {"model": model}, base="ckpt/step_100")  # writes only what changed
        sp.save("ckpt/pp", {"model": stage, "optimizer": opt}, replicated_over=dp_group)
        sp.save("ckpt/rank0", {"model": ddp.module}, process_group=sp.LOCAL)  # rank 0 only
    """
    options = SaveOptions(
        allow_pickle=allow_pickle, block_size=block_size, layouts=layouts, replicated_over=replicated_over,
        collective_timeout=collective_timeout, commit=commit, trace_dir=trace_dir, on_metrics=on_metrics, base=base,
    )
    tx = SaveTransaction(path, state, options)
    tx.check()
    tx.enter(process_group)
    return tx.run(progress_for(progress, tx.comm.rank, f"save {tx.where}", SAVE_PHASES, tx.result.recorder))


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
    manifest = Manifest.from_json(manifest_bytes(storage), storage.url)
    meta = manifest.tensors.get(name)
    if meta is None:
        close = close_names(name, manifest.tensors) or [k for k in manifest.tensors if name.split(".")[-1] in k][:3]
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else " (sp.read_manifest(path).tensors lists them)"
        raise KeyMismatchError(f"{storage.url}: no tensor {name!r} in the checkpoint{hint}", [name], [])
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
    storage = open_references(storage, manifest, storage.url)
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
    manifest = Manifest.from_json(manifest_bytes(storage), storage.url)
    return resolve_all(storage, manifest, storage.url) if chunks else manifest


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
    progress: bool = False,
    return_result: bool = False,
    replicated_over: Any = None,
) -> Any:
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
    the *target* (see :mod:`shardpoint.layouts`). With ``return_result=True``
    the load returns a :class:`LoadResult` (timings, bytes, key lists, and
    the loaded mapping as ``.state``) instead of the state; ``report=``, an
    out-parameter filled the same way, is deprecated. ``progress=True`` shows
    the bytes read and the rate on stderr, on rank 0.
    An optimizer saved the way ``get_optimizer_state_dict`` keys it (state by
    the model's parameter names, ``param_groups``) loads too: its entries are
    matched to the optimizer's parameters by name (:mod:`shardpoint.adapters.dcp_names`).
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
        res = sp.load("ckpt/step_100", state, return_result=True); print(res.bytes_read)
    """
    check_state(state, "load")
    if report is not None:
        warnings.warn(
            "sp.load(report=...) is deprecated; use res = sp.load(..., return_result=True) and read res.bytes_read, "
            "res.timings, ...", DeprecationWarning, stacklevel=2,
        )
    options = LoadOptions(
        process_group=process_group, strict=strict, allow_pickle=allow_pickle, verify=verify,
        share_reads=share_reads, keys=keys, layouts=layouts, collective_timeout=collective_timeout,
        progress=progress, trace_dir=trace_dir, on_metrics=on_metrics, replicated_over=replicated_over,
    )
    result = LoadTransaction(path, state, options).run()
    if report is not None:
        for f in ("path", "bytes_read", "index_bytes", "bytes_needed", "bytes_received", "missing", "unexpected", "not_restored", "timings", "recorder", "state"):
            setattr(report, f, getattr(result, f))
    return result if return_result else result.state
