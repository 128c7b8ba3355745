"""What the phases of the save transaction (:mod:`shardpoint.saving`) call.

:func:`prepare_save` (blocking): adapters flatten the state, the planners
choose writers. Then the data file is written (by the caller), and
:meth:`PreparedSave.summary` writes the rank's index file and describes the
rank. :func:`finish_save` commits through two small gathers to rank 0.
The decisions live in :mod:`shardpoint.planning`; the I/O in
:mod:`shardpoint.engine`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Sequence

from ..adapters import AdapterContext, SaveTensor, adapter_for, build_context, default_adapters
from ..items import dtype_name
from ..adapters.stepped import step_updates
from ..adapters.experts import deepspeed_expert_rules, place_experts
from ..adapters.reuse import PartCache
from ..dist import Comm, Outcome
from ..engine.claim import CommitPolicy, SaveClaim
from ..engine.commit import commit_gathered, write_index
from ..errors import UnsupportedStateError
from ..format.manifest import DTYPE_SIZES, FORMAT_VERSION
from ..geometry.grid import Grid
from ..layouts import apply_reduce, apply_save
from ..runtime.monitor import Recorder
from ..planning.describe import CandidateGrids, Description, RankReport, RankStatus, cover_of, describe, values_doc
from ..planning.writers import WriterChoice, WriterPlan, choose_writers, plan_signature
from ..runtime.rank_local import rank_local_tensors
from .replicas import Gate, PendingTable, check_replicas
from ..storage import Storage

__all__ = [
    "SaveResult", "mark_phase", "check_block_size", "data_file_name", "PreparedSave", "SaveCache", "CheckedSave",
    "prepare_save", "describe_prepared", "finish_save",
]


@dataclass
class SaveResult:
    """What a save did on this rank: phase timings (seconds) and bytes written."""

    path: str
    save_id: str
    bytes_written: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    recorder: Recorder | None = field(default=None, repr=False)
    plan_cached: bool = False


def mark_phase(result, phase: str, start: float, nbytes: int = 0) -> None:
    """Record a phase that began at ``start`` (monotonic seconds) and ends now.

    Shared by :func:`~shardpoint.save`, :func:`~shardpoint.load` and the
    asynchronous saver so all report phases the same way.

    Example::

        t0 = time.monotonic(); ...; mark_phase(result, "prepare", t0)
    """
    end = time.monotonic()
    result.timings[phase] = result.timings.get(phase, 0.0) + (end - start)
    if result.recorder is not None:
        result.recorder.add(phase, start, end, nbytes)


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
class PreparedSave:
    """The local half of a save: what this rank holds and writes, plus its documents.

    ``choice`` is the writer choice (:func:`~shardpoint.planning.writers.choose_writers`);
    ``ctx`` the adapter context (replica groups of plain tensors);
    ``described`` the rank's description, made by the first :meth:`summary`
    and reused by repeated saves of the same tensors; ``replicas`` the
    rank's replica table, compared at the commit
    (:func:`~shardpoint.saving.replicas.check_replicas`), which the summary
    waits for.
    """

    tensors: list[SaveTensor]
    mine: list[SaveTensor]
    values: dict
    layout: dict
    lazy_ok: AbstractSet[str]
    choice: WriterChoice = field(default_factory=lambda: WriterChoice((), {}))
    ctx: AdapterContext | None = None
    described: Description | None = None
    replicas: PendingTable | None = None

    def summary(self, storage: Storage, records, files: dict, comm: Comm) -> RankReport:
        """Write this rank's index file next to its data file; return what the commit needs.

        Runs after the data file is written (in the background for async saves).

        Example::

            report = prep.summary(storage, records, {name: size}, comm)
        """
        index = None
        if files:
            (data, _size), = files.items()
            index, size = write_index(storage, data, records, {t.fqn: dtype_name(t.data.dtype) for t in self.mine})
            files = {**files, index.index: size}
        if self.described is None:
            self.described = describe_prepared(self, comm)
        d = self.described
        vdoc, vdig = values_doc(self.values, self.layout)
        table = self.replicas.table() if self.replicas is not None else None
        status = RankStatus(files, index, d.digest, vdig, cover_of(self.mine, d.listed), table.digest() if table else "")
        return RankReport(status, d.doc, vdoc, table)


def describe_prepared(prep: PreparedSave, comm: Any) -> Description:
    """``prep``'s description on ``comm``'s rank (``comm`` needs ``rank``, ``world`` and ``group``).

    Example::

        d = describe_prepared(prep, comm); d.digest
    """
    ctx = prep.ctx
    replica_ranks = ctx.replica_ranks if ctx is not None else (lambda fqn: None)
    grids = CandidateGrids(comm.world, replica_ranks, None if comm.group is None else _group_translator(comm))
    return describe(prep.tensors, prep.mine, prep.choice, comm.rank, grids)


def _group_translator(comm: Comm):
    def to_group(grid: Grid) -> Grid | None:
        ranks = comm.group_ranks(grid.ranks)
        return None if ranks is None else Grid(grid.mesh_shape, ranks, grid.splits)  # a mesh reaching outside: listed

    return to_group


@dataclass(frozen=True)
class CheckedSave:
    """The tensors of the last save, already checked and planned, and what was made of them."""

    tensors: tuple[SaveTensor, ...]
    choice: WriterChoice
    lazy_ok: frozenset[str]
    prepared: PreparedSave


@dataclass
class SaveCache:
    """What one saver keeps across its saves (per process group): adapter parts, the last plan, the last checked tensors."""

    parts: PartCache = field(default_factory=PartCache)
    plan: WriterPlan | None = None
    checked: CheckedSave | None = None


def prepare_save(
    state, comm: Comm, allow_pickle: bool, where: str, result: SaveResult, rules=(), cache: SaveCache | None = None,
    replicated_over: Any = None, rank_local: bool = False,
) -> PreparedSave:
    """Describe this rank's part of ``state`` and choose writers: the blocking first step of every save.

    Shared by :func:`~shardpoint.save` and the asynchronous saver (which
    passes a ``cache`` reused across saves).

    Example::

        prep = prepare_save(state, comm, False, "ckpt", SaveResult("ckpt", save_id))
    """
    gate = Gate(comm)  # a rank that fails still joins the gathers of the checks, so none waits on it
    try:
        return _prepare(state, comm, allow_pickle, where, result, rules, cache, replicated_over, rank_local, gate)
    except Exception:
        with contextlib.suppress(Exception):  # the original error is the one to report
            gate.abstain()
        raise


def _prepare(state, comm: Comm, allow_pickle: bool, where: str, result: SaveResult, rules, cache: SaveCache | None,
             replicated_over: Any, rank_local: bool, gate: Gate) -> PreparedSave:
    ta = time.monotonic()
    rules = [*rules, *deepspeed_expert_rules(state)]  # DeepSpeed MoE experts: stored at their global index
    # Repeated saves (AsyncSaver) reuse the context and the unchanged module and
    # optimizer parts; layout rules reduce across ranks, so they take the full path.
    parts = cache.parts if cache is not None and not rules else None
    ctx = parts.context(state, comm.rank, comm.world, allow_pickle, replicated_over) if parts is not None else None
    if ctx is None:
        ctx = build_context(state, comm.rank, comm.world, allow_pickle, replicated_over)
        if parts is not None:
            parts.remember_context(state, comm.rank, comm.world, allow_pickle, replicated_over, ctx)
    adapters = default_adapters()
    tensors: list[SaveTensor] = []
    values, layout = {}, {}
    # Lazily copied: what an optimizer of the state changes in its step(), whose pre-hook fences the save.
    lazy_ok: set[str] = step_updates(state).names(ctx)
    for key, obj in state.items():
        part = parts.get(key, obj, ctx) if parts is not None else None
        if part is None:
            adapter = adapter_for(obj, adapters)
            part = adapter.save(key, obj, ctx)
            if parts is not None:
                parts.put(key, obj, adapter, part, ctx)
        tensors.extend(part.tensors)
        values[key] = adapter_for(obj, adapters).logical_value(key, part.value, rules) if rules else part.value
        layout[key] = part.framework
    prev = cache.checked if cache is not None and not rules else None
    if prev is not None and len(prev.tensors) == len(tensors) and all(a is b for a, b in zip(prev.tensors, tensors)):
        # The very SaveTensor objects checked and planned last time: only the values are checked again.
        _, table = check_replicas(list(prev.tensors), comm, where, gate, declared=replicated_over is not None)
        result.plan_cached = True
        mine = [tensors[i] for i in prev.choice.picked]
        prep = PreparedSave(tensors, mine, values, layout, prev.lazy_ok, prev.choice, ctx, prev.prepared.described, table)
        cache.checked = CheckedSave(prev.tensors, prev.choice, prev.lazy_ok, prep)
        mark_phase(result, "plan", ta)
        return prep
    lazy_ok.update(t.fqn for t in tensors if t.step_only)  # as each adapter declared it
    if rank_local:  # process_group=LOCAL: one writer, so every tensor must be whole here
        tensors = rank_local_tensors(tensors, where)
    if rules:
        tensors, lazy_ok = _logical(tensors, lazy_ok, rules, comm, gate)
    _check_tensors(tensors, where)
    # Declared groups compare before anything is written (copies per group get their own names); else at the commit.
    tensors, table = check_replicas(tensors, comm, where, gate, declared=replicated_over is not None or bool(rules))

    # Plan cache: the same names, shapes, dtypes and geometry give the same writers.
    sig = plan_signature(tensors)
    hit = cache.plan if cache is not None else None
    if hit is not None and hit.signature == sig:
        choice = hit.choice
        result.plan_cached = True
    else:
        choice = choose_writers(tensors)
        if cache is not None:
            cache.plan = WriterPlan(sig, choice)  # one layout: a changed layout never reuses stale choices
    mine = [tensors[i] for i in choice.picked]
    lazy = frozenset(lazy_ok)
    prep = PreparedSave(tensors, mine, values, layout, lazy, choice, ctx, replicas=table)
    if cache is not None and not rules:
        cache.checked = CheckedSave(tuple(tensors), choice, lazy, prep)
    mark_phase(result, "plan", ta)
    return prep


def _logical(tensors: list[SaveTensor], lazy_ok: set[str], rules, comm: Comm, gate: Gate) -> tuple[list[SaveTensor], set[str]]:
    """The tensors as the layout rules' logical tensors, and which of them may be copied lazily."""
    tensors = apply_reduce(tensors, rules, comm)
    logical: list[SaveTensor] = []
    lazy_logical: set[str] = set()
    for t in tensors:
        pieces = apply_save([t], rules)
        logical.extend(pieces)
        if t.fqn in lazy_ok:
            lazy_logical.update(x.fqn for x in pieces)
    logical = place_experts(logical, rules, gate)  # global experts: held by the ranks of one EP rank
    return logical, lazy_ok | lazy_logical


def _check_tensors(tensors: Sequence[SaveTensor], where: str) -> None:
    """Refuse dtypes the format cannot store and a name held twice with the same geometry."""
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


def finish_save(
    comm: Comm, storage: Storage, save_id: str, block_size: int, out: Outcome, result: SaveResult, where: str,
    claim: SaveClaim | None = None, policy: CommitPolicy | None = None,
) -> None:
    """Commit on rank 0 from two small gathers, and raise the same error everywhere.

    ``out`` is this rank's outcome (a :class:`RankReport` when it
    succeeded); see :func:`~shardpoint.engine.commit.commit_gathered`. Rank
    0's ``claim`` on the path is checked right before the commit and
    released at the end, whatever happens.

    Example::

        finish_save(comm, storage, save_id, 1 << 20, run_guarded(write), result, storage.url, claim)
    """
    tc = time.monotonic()
    try:
        result.save_id = commit_gathered(comm, storage, save_id, block_size, out, where, claim, policy or CommitPolicy())
    finally:
        mark_phase(result, "commit", tc)
        if claim is not None:
            claim.release()
