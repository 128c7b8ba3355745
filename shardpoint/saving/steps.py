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

from ..adapters import AdapterContext, SaveTensor, adapter_for, build_context, default_adapters, implied_rules
from ..items import dtype_name
from ..adapters.stepped import step_updates
from ..adapters.experts import place_experts
from ..dist import Comm, Outcome
from ..engine.claim import CommitPolicy, SaveClaim
from ..engine.commit import commit_gathered, write_index
from ..errors import UnsupportedStateError
from ..format.manifest import DTYPE_SIZES, FORMAT_VERSION
from ..geometry.grid import Grid
from ..layouts import apply_reduce, apply_save
from ..runtime.monitor import Recorder, mark_phase
from ..planning.describe import CandidateGrids, Description, RankReport, RankStatus, cover_of, describe, values_doc
from ..planning.writers import WriterChoice, choose_writers, plan_signature
from ..runtime.rank_local import rank_local_tensors
from .replicas import Gate, PendingTable, check_replicas
from .reuse import SaveCache
from ..storage import Storage

__all__ = [
    "SaveResult", "mark_phase", "check_block_size", "data_file_name", "PreparedSave", "CheckedSave",
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
    frameworks: dict
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
        vdoc, vdig = values_doc(self.values, self.frameworks)
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


@dataclass
class CheckedSave:
    """The tensors of the last save, already checked and planned, and what was made of them.

    ``prepared`` is the latest save prepared from them; its description,
    made once by :meth:`PreparedSave.summary`, is reused by the next.
    """

    tensors: tuple[SaveTensor, ...]
    choice: WriterChoice
    lazy_ok: frozenset[str]
    prepared: PreparedSave


def prepare_save(
    state, comm: Comm, allow_pickle: bool, where: str, result: SaveResult, rules=(), cache: SaveCache | None = None,
    replicated_over: Any = None, rank_local: bool = False,
) -> PreparedSave:
    """Describe this rank's part of ``state`` and choose writers: the blocking first step of every save.

    Shared by :func:`~shardpoint.save` and the asynchronous saver (which
    passes a ``cache`` reused across saves, see :mod:`shardpoint.saving.reuse`).

    Example::

        prep = prepare_save(state, comm, False, "ckpt", SaveResult("ckpt", save_id))
    """
    gate = Gate(comm)  # a rank that fails still joins the gathers of the checks, so none waits on it
    try:
        rules = [*rules, *implied_rules(state)]  # what the frameworks imply (MoE experts: at their global index)
        if replicated_over is None and not rules:
            gate.close()  # no gather before the write: a rank that fails reports at the commit
        return _prepare(state, comm, allow_pickle, where, result, rules, cache or SaveCache(), replicated_over,
                        rank_local, gate)
    except Exception:
        with contextlib.suppress(Exception):  # the original error is the one to report
            gate.abstain()
        raise


def _replica_facts(ctx: AdapterContext) -> tuple:
    return (ctx.rank, ctx.world, ctx.allow_pickle, tuple(sorted(ctx.replicas.items())), ctx.patterns)


def _parts(state, ctx: AdapterContext, rules, cache: SaveCache) -> tuple[list[SaveTensor], dict, dict]:
    """Every entry's tensors, values and framework names, each entry's part reused while its fingerprint holds."""
    adapters = default_adapters()
    tensors: list[SaveTensor] = []
    values, frameworks = {}, {}
    facts = _replica_facts(ctx)
    for key, obj in state.items():
        adapter = adapter_for(obj, adapters)
        fp = adapter.fingerprint(key, obj, ctx)
        part, hit = cache.reuse(("part", key), None if fp is None else (obj, adapter.name, facts, fp),
                                lambda: adapter.save(key, obj, ctx))
        if hit:
            part = adapter.refresh(key, obj, part, ctx)
        tensors.extend(part.tensors)
        values[key] = adapter.logical_value(key, part.value, rules) if rules else part.value
        frameworks[key] = part.framework
    return tensors, values, frameworks


def _prepare(state, comm: Comm, allow_pickle: bool, where: str, result: SaveResult, rules, cache: SaveCache,
             replicated_over: Any, rank_local: bool, gate: Gate) -> PreparedSave:
    ta = time.monotonic()
    ctx = build_context(state, comm.rank, comm.world, allow_pickle, replicated_over)
    tensors, values, frameworks = _parts(state, ctx, rules, cache)
    # The very SaveTensor objects checked last time (every part reused): only the values are checked again.
    # Layout rules reduce across ranks, so a save under rules is checked in full.
    declared = replicated_over is not None or bool(rules)
    same = None if rules else (rank_local, declared, tuple(map(id, tensors)))
    tables: list[PendingTable | None] = []
    checked, hit = cache.reuse("checked", same, lambda: _check_and_plan(
        state, tensors, ctx, rules, comm, where, cache, result, (rank_local, declared), gate, tables))
    if hit:
        _, table = check_replicas(list(checked.tensors), comm, gate, declared=declared)
        result.plan_cached = True
    else:
        table = tables[0]
        if len(checked.tensors) != len(tensors) or any(a is not b for a, b in zip(checked.tensors, tensors)):
            cache.forget("checked")  # renamed or cut by the checks: made from more than the tensors
    mine = [checked.tensors[i] for i in checked.choice.picked]
    prep = PreparedSave(list(checked.tensors), mine, values, frameworks, checked.lazy_ok, checked.choice, ctx,
                        checked.prepared.described if hit else None, table)
    checked.prepared = prep
    mark_phase(result, "plan", ta)
    return prep


def _check_and_plan(state, tensors: list[SaveTensor], ctx: AdapterContext, rules, comm: Comm, where: str,
                    cache: SaveCache, result: SaveResult, flags: tuple[bool, bool], gate: Gate,
                    tables: list) -> CheckedSave:
    """The tensors checked (dtypes, names, replicas) and the writers chosen; which may be copied lazily.

    ``flags`` is (rank-local save, replica groups declared); this call's replica table goes to ``tables``.
    """
    rank_local, declared = flags
    # Lazily copied: what an optimizer of the state changes in its step(), whose pre-hook fences the save.
    lazy_ok: set[str] = step_updates(state).names(ctx)
    lazy_ok.update(t.fqn for t in tensors if t.step_only)  # as each adapter declared it
    if rank_local:  # process_group=LOCAL: one writer, so every tensor must be whole here
        tensors = rank_local_tensors(tensors, where)
    if rules:
        tensors, lazy_ok = _logical(tensors, lazy_ok, rules, comm, gate)
    _check_tensors(tensors, where)
    # Declared groups learn their copy names before anything is written; digests are compared at the commit.
    tensors, table = check_replicas(tensors, comm, gate, declared=declared)
    tables.append(table)  # of the values at this call: never kept
    # The same names, shapes, dtypes and geometry give the same writers.
    choice, result.plan_cached = cache.reuse("plan", plan_signature(tensors), lambda: choose_writers(tensors))
    lazy = frozenset(lazy_ok)
    return CheckedSave(tuple(tensors), choice, lazy, PreparedSave(tensors, [], {}, {}, lazy, choice, ctx))


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
