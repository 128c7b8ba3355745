"""The prepare phase of a save: this rank's tensors, checked and planned, and the ranks' agreement.

:func:`prepare_save` runs the adapters (each entry's part reused while
its fingerprint holds, see :mod:`shardpoint.saving.reuse`), applies the
layout rules' local part, checks the tensors, then, when groups or rules
are declared, runs the agreement (:mod:`shardpoint.saving.agree`: every
collective before the write), and chooses the writers. The result is a
frozen :class:`~shardpoint.planning.save_plan.SavePlan`, the one value the
write and the commit take; :func:`summarize` runs after the write.

Example::

    plan = prepare_save(state, comm, SaveOptions(), SaveResult("ckpt", save_id))
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from ..adapters import AdapterContext, SaveTensor, StateFacts, adapter_for, default_adapters, gather_facts, implied_rules, may_imply_rules
from ..adapters.stepped import step_updates
from ..dist import Comm
from ..engine.commit import write_index
from ..errors import UnsupportedStateError
from ..format.manifest import DTYPE_SIZES, FORMAT_VERSION
from ..geometry.grid import Grid
from ..items import dtype_name
from ..planning.describe import Description, RankReport, RankStatus, cover_of, values_doc
from ..planning.save_plan import SavePlan, describe_plan
from ..planning.writers import choose_writers, plan_signature
from ..runtime.handshake import Ticket
from ..runtime.monitor import mark_phase
from ..runtime.rank_local import rank_local_tensors
from ..storage import Storage
from .agree import AgreedFailure, Gate, Proposal, agree_save
from .options import SaveOptions
from .replicas import PendingTable, pending_table, replica_checked
from .result import SaveResult
from .reuse import Same, SameItems, SaveCache

__all__ = ["prepare_save", "plan_of", "describe_on", "summarize"]

log = logging.getLogger("shardpoint")


def summarize(
    plan: SavePlan, storage: Storage, written: tuple[list, dict], comm: Comm, cache: SaveCache | None = None,
    refs: tuple[tuple, dict] = ((), {}),
) -> RankReport:
    """Write this rank's index file next to its data file; return what the commit needs.

    ``written`` is the data file's chunk records and ``{name: size}``. Runs
    after the data file is written (in the background for async saves); the
    description is reused from ``cache`` while the plan is the same.
    ``refs``: an incremental save's references and their index files
    (:func:`~shardpoint.saving.incremental.write_references`).

    Example::

        report = summarize(plan, storage, (records, {name: size}), comm, cache)
    """
    records, files = written
    index = None
    if files:
        (data, _size), = files.items()
        index, size = write_index(storage, data, records, {t.fqn: dtype_name(t.data.dtype) for t in plan.mine})
        files = {**files, index.index: size}
    d = describe_on(plan, comm, cache)
    vdoc, vdig = values_doc(plan.values, plan.frameworks)
    table = plan.replicas.table() if plan.replicas is not None else None
    files = {**files, **refs[1]}
    status = RankStatus(files, index, d.digest, vdig, cover_of(plan.mine, d.listed), table.digest() if table else "", refs[0])
    return RankReport(status, d.doc, vdoc, table)


def describe_on(plan: SavePlan, comm: Comm, cache: SaveCache | None = None) -> Description:
    """``plan``'s description on ``comm``'s rank, reused from ``cache`` for the same plan, rank and group.

    Example::

        d = describe_on(plan, comm); d.digest
    """
    to_group = None if comm.group is None else _group_translator(comm)
    make = lambda: describe_plan(plan, comm.rank, comm.world, to_group)  # noqa: E731
    if cache is None:
        return make()
    # The plan's tensors and writers by identity: the kept plan of a repeated save is the very same.
    fingerprint = (Same(plan.tensors), Same(plan.choice), comm.rank, comm.world, Same(comm.group))
    return cache.reuse("described", fingerprint, make)[0]


def _group_translator(comm: Comm):
    def to_group(grid: Grid) -> Grid | None:
        ranks = comm.group_ranks(grid.ranks)
        return None if ranks is None else Grid(grid.mesh_shape, ranks, grid.splits)  # a mesh reaching outside: listed

    return to_group


def prepare_save(
    state, comm: Comm, options: SaveOptions, result: SaveResult, cache: SaveCache | None = None, *,
    rank_local: bool = False, entry: Ticket | None = None,
) -> SavePlan:
    """Describe this rank's part of ``state`` and choose writers: the blocking first step of every save.

    Shared by :func:`~shardpoint.save` and the asynchronous saver (which
    passes a ``cache`` reused across saves, see :mod:`shardpoint.saving.reuse`).
    With groups or rules declared, the ranks agree before the write
    (:mod:`shardpoint.saving.agree`); a rank that fails here still takes
    part, so none waits for it, and every rank then raises
    :class:`~shardpoint.saving.agree.AgreedFailure` carrying the same error.
    Sets ``result.plan_cached`` (see :class:`~shardpoint.SaveResult`).
    ``entry`` is this rank's posted entry into the save, when the ranks'
    agreement on it is still to be awaited: before the first exchange.

    Example::

        plan = prepare_save(state, comm, SaveOptions(), SaveResult("ckpt", save_id))
    """
    where = result.path
    gate = Gate(comm, where, entry)  # a rank that fails still joins the agreement's exchanges, so none waits on it
    try:
        # Whether the ranks agree before the write, from what every rank shares: all decide alike, also a
        # rank whose implied rules then fail (it joins the agreement with the failed marker).
        declared = options.replicated_over is not None or bool(options.layouts) or may_imply_rules(state)
        if not declared:
            gate.close()  # no exchange before the write: a rank that fails reports at the commit
        rules = [*options.layouts, *implied_rules(state)]  # what the frameworks imply (MoE experts: at their global index)
        ta = time.monotonic()
        cache = cache or SaveCache()
        adapters = default_adapters()
        claimed = {key: adapter_for(obj, adapters) for key, obj in state.items()}
        ctx, known = _context(state, comm, options, adapters, claimed, cache)
        tensors, values, frameworks = _parts(state, ctx, rules, cache, claimed, known)
        job = _Job(state, ctx, rules, comm, gate, where, rank_local, declared)
        plan, table, result.plan_cached = _checked_plan(job, tensors, cache)
        mark_phase(result, "plan", ta)
        return plan.for_save(values, frameworks, replicas=table, context=ctx)
    except AgreedFailure:
        raise
    except Exception as e:
        try:
            gate.abstain(e)  # with exchanges to come: raises AgreedFailure on every rank
        except AgreedFailure:
            raise
        except Exception as lost:  # noqa: BLE001 - the original error is the one to report
            log.debug("could not tell the other ranks of a failure: %s", lost)
        raise


def _context(state, comm: Comm, options: SaveOptions, adapters: list, claimed: dict, cache: SaveCache) -> tuple[AdapterContext, dict]:
    """The save's adapter context, and the fingerprints of the entries whose adapters gave its facts.

    The facts (parameter names, views, shards) of the kept context are
    reused while they hold: the same registry, the same entries (objects,
    types and claiming adapters), and every entry that gave facts, given
    them by the adapter that claims it, with an unchanged fingerprint
    (:meth:`~shardpoint.adapters.Adapter.fingerprint` covers what
    :meth:`~shardpoint.adapters.Adapter.context_facts` reads). Replica facts
    come from this save's options.
    """
    def context_of(facts: StateFacts) -> AdapterContext:
        return facts.context(comm.rank, comm.world, options.allow_pickle, options.replicated_over, list(state))

    kept = cache.kept("facts")
    if kept is not None:
        facts, kept_fps = kept
        ctx = context_of(facts)
        fps = _facts_fingerprints(state, facts, claimed, ctx)
        if fps is not None and cache.holds("facts", _facts_fingerprint(state, adapters, claimed, fps)):
            # Equal to this save's: the kept ones, so that the parts' fingerprints compare them by identity.
            return ctx, kept_fps
    facts = gather_facts(state, adapters)
    ctx = context_of(facts)
    fps = _facts_fingerprints(state, facts, claimed, ctx)
    cache.keep("facts", None if fps is None else _facts_fingerprint(state, adapters, claimed, fps), (facts, fps))
    return ctx, fps or {}


def _facts_fingerprints(state, facts: StateFacts, claimed: dict, ctx: AdapterContext) -> dict | None:
    """The fingerprint of each entry that gave ``facts``; ``None`` where they cannot be kept.

    Facts given by an adapter other than the one claiming the entry, or by
    an entry without a fingerprint, are gathered again at every save.
    """
    fps = {}
    for key, obj in state.items():
        by = facts.answered.get(key)
        if by is None:
            continue
        if by is not claimed[key] or (fp := by.fingerprint(key, obj, ctx)) is None:
            return None
        fps[key] = fp
    return fps


def _facts_fingerprint(state, adapters: list, claimed: dict, fps: dict) -> tuple:
    objs = tuple(state.values())
    return (SameItems(adapters), tuple(state), SameItems(objs), tuple(map(type, objs)), SameItems(claimed.values()),
            tuple(fps.items()))


def _replica_facts(ctx: AdapterContext) -> tuple:
    return (ctx.rank, ctx.world, ctx.allow_pickle, tuple(sorted(ctx.replicas.items())), ctx.patterns)


def _parts(state, ctx: AdapterContext, rules, cache: SaveCache, claimed: dict, known: dict) -> tuple[list[SaveTensor], dict, dict]:
    """Every entry's tensors, values and framework names, each entry's part reused while its fingerprint holds.

    ``known``: fingerprints already made under ``ctx`` (by :func:`_context`).
    """
    tensors: list[SaveTensor] = []
    values, frameworks = {}, {}
    facts = _replica_facts(ctx)
    for key, obj in state.items():
        adapter = claimed[key]
        fp = known[key] if key in known else adapter.fingerprint(key, obj, ctx)
        part, hit = cache.reuse(("part", key), None if fp is None else (obj, adapter.name, facts, fp),
                                lambda: adapter.save(key, obj, ctx))
        if hit:
            part = adapter.refresh(key, obj, part, ctx)
        tensors.extend(part.tensors)
        values[key] = adapter.logical_value(key, part.value, rules) if rules else part.value
        frameworks[key] = part.framework
    return tensors, values, frameworks


@dataclass(frozen=True)
class _Job:
    """What checking and planning one save reads besides its tensors."""

    state: object
    ctx: AdapterContext
    rules: Sequence
    comm: Comm
    gate: Gate
    where: str
    rank_local: bool
    declared: bool  # groups, rules, or an adapter that may imply rules: the ranks agree before the write


def _checked_plan(job: _Job, tensors: list[SaveTensor], cache: SaveCache) -> tuple[SavePlan, PendingTable | None, bool]:
    """The plan of ``tensors`` (kept while they are the very ones of the kept plan), its replica table, and whether the writers were reused."""
    # Layout rules reduce across ranks, so a save under rules is checked in full.
    fingerprint = None if job.rules else (job.rank_local, job.declared, SameItems(tensors))
    made: list = []
    plan, hit = cache.reuse("checked", fingerprint, lambda: _check_and_plan(job, tensors, cache, made))
    if hit:
        return plan, _replicas_again(plan, job, cache), True
    if len(plan.tensors) != len(tensors) or any(a is not b for a, b in zip(plan.tensors, tensors)):
        cache.forget("checked")  # renamed or cut by the checks: made from more than the tensors
    table, writers_reused = made
    return plan, table, writers_reused


def _replicas_again(plan: SavePlan, job: _Job, cache: SaveCache) -> PendingTable | None:
    """The pending table of a reused plan; declared groups still run their agreement (every rank exchanges alike)."""
    if not job.declared:
        held = cache.reuse("held", Same(plan.tensors), lambda: replica_checked(plan.tensors))[0]
        return pending_table(held, job.comm, held=True)
    return agree_save(Proposal.of(plan.tensors, plan.lazy_ok, (), job.comm.world), job.comm, job.gate).replicas


def _check_and_plan(job: _Job, tensors: list[SaveTensor], cache: SaveCache, made: list) -> SavePlan:
    """The tensors checked (dtypes, names), agreed on where declared, and the writers chosen; which may be copied lazily.

    This call's replica table (of the values now: never kept) and whether
    the writer choice was reused go to ``made``.
    """
    ctx, where, comm = job.ctx, job.where, job.comm
    # Lazily copied: what an optimizer of the state changes in its step(), whose pre-hook fences the save.
    lazy_ok: set[str] = step_updates(job.state).names(ctx)
    lazy_ok.update(t.fqn for t in tensors if t.step_only)  # as each adapter declared it
    if job.rank_local:  # process_group=LOCAL: one writer, so every tensor must be whole here
        tensors = rank_local_tensors(tensors, where)
    if job.declared:
        proposal = Proposal.of(tensors, frozenset(lazy_ok), job.rules, comm.world)
        _check_tensors(proposal.logical(), where)  # refused before the agreement, so every rank learns of it there
        agreed = agree_save(proposal, comm, job.gate)
        tensors, lazy, table = list(agreed.tensors), agreed.lazy_ok, agreed.replicas
    else:
        _check_tensors(tensors, where)
        lazy, table = frozenset(lazy_ok), pending_table(tensors, comm)
    # The same names, shapes, dtypes and geometry give the same writers.
    choice, reused = cache.reuse("plan", plan_signature(tensors), lambda: choose_writers(tensors))
    made.extend((table, reused))
    return plan_of(tensors, choice, lazy, ctx)


def plan_of(tensors: Sequence[SaveTensor], choice, lazy_ok: frozenset[str], ctx: AdapterContext) -> SavePlan:
    """The :class:`SavePlan` of checked ``tensors`` and their writer ``choice``, with ``ctx``'s replica facts as plain data.

    Example::

        plan = plan_of(tensors, choose_writers(tensors), frozenset(), ctx)
    """
    ranks = {}
    if ctx.replicas or ctx.patterns:  # no declaration: every plain tensor is held by every rank
        ranks = {t.fqn: r for t in tensors if (r := ctx.replica_ranks(t.fqn)) is not None}
    return SavePlan.make(tensors, choice, lazy_ok, replica_ranks=ranks)


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
