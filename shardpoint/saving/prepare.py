"""The prepare phase of a save: this rank's tensors, checked and planned, and the ranks' agreement.

:func:`prepare_save` runs the adapters (each entry's part reused while
its fingerprint holds, see :mod:`shardpoint.saving.reuse`), applies the
layout rules' local part, checks the tensors, then, when groups or rules
are declared, runs the agreement (:mod:`shardpoint.saving.agree`: every
collective before the write), and chooses the writers. The result is a
:class:`PreparedSave`; its :meth:`PreparedSave.summary` runs after the
write.

Example::

    prep = prepare_save(state, comm, False, "ckpt", SaveResult("ckpt", save_id))
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Sequence

from ..adapters import AdapterContext, SaveTensor, adapter_for, build_context, default_adapters, implied_rules
from ..adapters.stepped import step_updates
from ..dist import Comm
from ..engine.commit import write_index
from ..errors import UnsupportedStateError
from ..format.manifest import DTYPE_SIZES, FORMAT_VERSION
from ..geometry.grid import Grid
from ..items import dtype_name
from ..planning.describe import CandidateGrids, Description, RankReport, RankStatus, cover_of, describe, values_doc
from ..planning.writers import WriterChoice, choose_writers, plan_signature
from ..runtime.monitor import mark_phase
from ..runtime.rank_local import rank_local_tensors
from ..storage import Storage
from .agree import AgreedFailure, Gate, Proposal, agree_save
from .replicas import PendingTable, pending_table
from .result import SaveResult
from .reuse import SaveCache

__all__ = ["PreparedSave", "CheckedSave", "prepare_save", "describe_prepared"]

log = logging.getLogger("shardpoint")


@dataclass
class PreparedSave:
    """The local half of a save: what this rank holds and writes, plus its documents.

    ``choice`` is the writer choice (:func:`~shardpoint.planning.writers.choose_writers`);
    ``ctx`` the adapter context (replica groups of plain tensors);
    ``described`` the rank's description, made by the first :meth:`summary`
    and reused by repeated saves of the same tensors; ``replicas`` the
    rank's replica table, compared at the commit
    (:func:`~shardpoint.saving.replicas.pending_table`), which the summary
    waits for.

    Example::

        prep = prepare_save(state, comm, False, "ckpt", result); len(prep.mine)
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


def describe_prepared(prep: PreparedSave, comm: Comm) -> Description:
    """``prep``'s description on ``comm``'s rank.

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

    Example::

        checked = cache.reuse("checked", fingerprint, make)[0]; checked.choice
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
    With groups or rules declared, the ranks agree before the write
    (:mod:`shardpoint.saving.agree`); a rank that fails here still takes
    part, so none waits for it, and every rank then raises
    :class:`~shardpoint.saving.agree.AgreedFailure` carrying the same error.

    Example::

        prep = prepare_save(state, comm, False, "ckpt", SaveResult("ckpt", save_id))
    """
    gate = Gate(comm, where)  # a rank that fails still joins the agreement's exchanges, so none waits on it
    try:
        rules = [*rules, *implied_rules(state)]  # what the frameworks imply (MoE experts: at their global index)
        if replicated_over is None and not rules:
            gate.close()  # no exchange before the write: a rank that fails reports at the commit
        return _prepare(state, comm, allow_pickle, where, result, rules, cache or SaveCache(), replicated_over,
                        rank_local, gate)
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
        table = _replicas_again(checked, comm, gate, declared)
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


def _replicas_again(checked: CheckedSave, comm: Comm, gate: Gate, declared: bool) -> PendingTable | None:
    """The pending table of a reused check; declared groups still run their agreement (every rank exchanges alike)."""
    if not declared:
        return pending_table(checked.tensors, comm)
    return agree_save(Proposal.of(checked.tensors, checked.lazy_ok, (), comm.world), comm, gate).replicas


def _check_and_plan(state, tensors: list[SaveTensor], ctx: AdapterContext, rules, comm: Comm, where: str,
                    cache: SaveCache, result: SaveResult, flags: tuple[bool, bool], gate: Gate,
                    tables: list) -> CheckedSave:
    """The tensors checked (dtypes, names), agreed on where declared, and the writers chosen; which may be copied lazily.

    ``flags`` is (rank-local save, groups or rules declared); this call's replica table goes to ``tables``.
    """
    rank_local, declared = flags
    # Lazily copied: what an optimizer of the state changes in its step(), whose pre-hook fences the save.
    lazy_ok: set[str] = step_updates(state).names(ctx)
    lazy_ok.update(t.fqn for t in tensors if t.step_only)  # as each adapter declared it
    if rank_local:  # process_group=LOCAL: one writer, so every tensor must be whole here
        tensors = rank_local_tensors(tensors, where)
    if declared:
        proposal = Proposal.of(tensors, frozenset(lazy_ok), rules, comm.world)
        _check_tensors(proposal.logical(), where)  # refused before the agreement, so every rank learns of it there
        agreed = agree_save(proposal, comm, gate)
        tensors, lazy, table = list(agreed.tensors), agreed.lazy_ok, agreed.replicas
    else:
        _check_tensors(tensors, where)
        lazy, table = frozenset(lazy_ok), pending_table(tensors, comm)
    tables.append(table)  # of the values at this call: never kept
    # The same names, shapes, dtypes and geometry give the same writers.
    choice, result.plan_cached = cache.reuse("plan", plan_signature(tensors), lambda: choose_writers(tensors))
    return CheckedSave(tuple(tensors), choice, lazy, PreparedSave(tensors, [], {}, {}, lazy, choice, ctx))


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
