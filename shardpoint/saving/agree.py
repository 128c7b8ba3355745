"""The agreement phase of a save: every collective before the write, under one gate.

A save that declares groups (``replicated_over``) or layout rules needs
the ranks to talk before anything is written: :class:`~shardpoint.Reduced`
values are reduced across the group, :class:`~shardpoint.Experts` find
which ranks hold each global expert, and declared groups learn which
names each group stores as its own copy
(:func:`~shardpoint.saving.replicas.copy_name`). All of it runs here, in
one phase, after this rank's local preparation (adapters, rules, checks:
no collective) and before the write:

1. the first exchange carries each rank's status with what the later
   steps need (the experts' keys, else the replica rows), and a row per
   ``Reduced`` tensor (:mod:`shardpoint.saving.reduced`): ranks that hold
   them with other shapes or dtypes all raise the same error here;
2. only when every rank is known healthy: the reductions, the experts'
   placement, then the replica rows (when experts came first);
3. the names, only when the rows show a name held by several groups.

Every exchange goes through the :class:`Gate`. A rank that fails anywhere
before the write (an adapter's ``state_dict``, a check, a rule) still
joins the next exchange, with the failed marker: every rank then learns of
the failure at once, the ranks exchange their outcomes once more, and
every rank raises the same error from the save call
(:class:`~shardpoint.errors.DistributedError` naming the failing rank and
its cause, or the rank's own typed error, as the commit would report it),
without writing or committing anything. A collective outside the
agreement would instead leave the healthy ranks waiting in it for a rank
that never comes.

A plain save (no groups declared, no rules, no adapter that may imply
rules) makes no collective before the write at all: its failures surface
at the commit.

Example::

    gate = Gate(comm, "ckpt/step_100")
    agreed = agree_save(Proposal.of(tensors, lazy_ok, rules, comm.world), comm, gate)  # or AgreedFailure
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, NoReturn, Sequence

import torch

from ..adapters.experts import Experts, apply_placement, expert_keys
from ..dist import Comm, Outcome, raise_if_failed, run_guarded
from ..errors import CheckpointError, UnsupportedStateError
from ..items import SaveTensor
from ..layouts import Reduced, apply_save
from ..planning.replicas import copied_names, copy_name, encode_rows, suspicious
from ..runtime.handshake import Ticket
from .reduced import ReducedFact, fact_keys, fact_rows, facts_of, mismatch_error
from .replicas import PendingTable, pending_table, rows_of

__all__ = ["FAILED", "COLUMNS", "Rows", "Gate", "AgreedFailure", "unwrap", "Proposal", "Agreed", "agree_save", "reduce_values"]

FAILED = -(1 << 63)  # the first column of the marker row a failed rank sends
COLUMNS = 6  # int64 columns of every table exchanged: replica rows (encode_rows) and experts' keys alike


@dataclass(frozen=True)
class Rows:
    """One rank's message in an exchange of the agreement: an int64 ``[n, 6]`` table.

    A failed rank sends :meth:`failed` (one marker row) instead.

    Example::

        Rows.keys([17, 42]).table.shape  # (2, 6)
    """

    table: torch.Tensor

    def __post_init__(self) -> None:
        t = self.table
        if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != COLUMNS:
            raise ValueError(f"an agreement message is an int64 [n, {COLUMNS}] table, got {t.dtype} {tuple(t.shape)}")

    @staticmethod
    def failed() -> "Rows":
        """The marker a rank that failed sends."""
        return Rows(torch.full((1, COLUMNS), FAILED, dtype=torch.int64))

    @staticmethod
    def keys(keys: Sequence[int]) -> "Rows":
        """One row per key (in the first column; the others 0)."""
        table = torch.zeros((len(keys), COLUMNS), dtype=torch.int64)
        if keys:
            table[:, 0] = torch.tensor(list(keys), dtype=torch.int64)
        return Rows(table)

    @property
    def is_failed(self) -> bool:
        """Whether the sender failed."""
        return bool(self.table.numel()) and bool((self.table[:, 0] == FAILED).any())

    def first_column(self) -> list[int]:
        """The keys of :meth:`keys`."""
        return self.table[:, 0].tolist()

    def plus(self, rows: torch.Tensor) -> "Rows":
        """This message with more rows (an int64 ``[m, 6]`` table) after its own."""
        return self if not len(rows) else Rows(torch.cat([self.table, rows]))


class AgreedFailure(Exception):
    """Every rank of a save learned in its agreement that a rank failed; ``error`` is what each raises.

    The save's transaction raises ``error`` (the same on every rank) with
    no commit: nothing was written. It never reaches the caller itself.

    Example::

        except AgreedFailure as f: raise f.error from None
    """

    def __init__(self, error: CheckpointError):
        super().__init__(str(error))
        self.error = error


def unwrap(e: BaseException) -> BaseException:
    """The error to raise for ``e``: an :class:`AgreedFailure`'s error, else ``e`` itself.

    Example::

        raise unwrap(outcome.exc)
    """
    return e.error if isinstance(e, AgreedFailure) else e


def _raise(e: BaseException) -> NoReturn:
    raise e


class Gate:
    """The exchanges of one save's agreement, which a rank that fails before them still joins.

    Every rank calls :meth:`exchange` the same number of times while its
    preparation goes well. A rank that fails calls :meth:`abstain`, which
    joins the next exchange with the failed marker (:meth:`Rows.failed`);
    every rank then sees the marker, and all exchange their outcomes once
    more (the failing rank its error), so that every rank raises the same
    error (:class:`AgreedFailure`, naming the failing rank and its cause:
    see :func:`~shardpoint.dist.raise_if_failed`). :meth:`close` marks the
    last exchange done, after which a failure needs no marker: it reaches
    the other ranks at the commit.

    Example::

        gate = Gate(comm, "ckpt/step_100")
        tables = gate.exchange(Rows(encode_rows(rows)))  # raises AgreedFailure when a rank failed
    """

    def __init__(self, comm: Comm, where: str = "", entry: Ticket | None = None):
        self.comm = comm
        self.where = where
        self.entry = entry or Ticket()  # every rank entered the save: awaited before the first exchange
        # A stand-in without a process group (a simulation of many ranks in one process) exchanges nothing.
        self.active = bool(getattr(comm, "active", False)) and comm.world > 1
        self.failed = False
        self.closed = False

    @property
    def open(self) -> bool:
        """Whether exchanges are still to come (a failure must then join the next one)."""
        return self.active and not self.failed and not self.closed

    def exchange(self, rows: Rows) -> dict[int, Rows]:
        """Every rank's message by group rank; raises :class:`AgreedFailure` when a rank failed."""
        if not self.active:
            return {self.comm.rank: rows}
        if not self.open:
            raise RuntimeError("the agreement's exchanges are over")
        self.entry.wait()
        tables = self.comm.all_gather_rows(rows.table)
        got = {r: Rows(t) for r, t in enumerate(tables)}
        if any(m.is_failed for m in got.values()):
            self.failed = True
            self._causes(Outcome(True))
        return got

    def abstain(self, error: Exception) -> None:
        """This rank failed with ``error``: join the next exchange with the marker, then raise :class:`AgreedFailure`.

        Returns without a collective when the exchanges are over (or there are none).
        """
        if self.open:
            self.failed = True
            self.entry.wait()
            self.comm.all_gather_rows(Rows.failed().table)
            self._causes(run_guarded(lambda: _raise(error)))

    def close(self) -> None:
        """The last exchange is done."""
        self.closed = True

    def _causes(self, mine: Outcome) -> NoReturn:
        """Every rank's outcome, once; raise the error they make, the same on every rank."""
        outcomes = self.comm.all_gather(mine.sendable(with_value=False))
        try:
            raise_if_failed(outcomes, f"save to {self.where}")
        except CheckpointError as err:
            raise AgreedFailure(err) from None
        raise AgreedFailure(CheckpointError(f"save to {self.where}: a rank failed in the agreement but sent no cause"))


@dataclass(frozen=True)
class Proposal:
    """What this rank brings to the agreement, made locally (no collective).

    ``physical``: the tensors as the adapters made them; ``pieces``: each
    one's logical pieces under the layout rules (``apply_save``);
    ``reduced``: position in ``physical`` -> its :class:`Reduced` rule;
    ``experts``: the :class:`Experts` rules; ``lazy_ok``: the physical
    names that may be copied lazily; ``rules``: every rule of the save.

    Example::

        proposal = Proposal.of(tensors, lazy_ok, rules, comm.world)
    """

    physical: tuple[SaveTensor, ...]
    pieces: tuple[tuple[SaveTensor, ...], ...]
    reduced: Mapping[int, Reduced]
    experts: tuple[Experts, ...]
    lazy_ok: frozenset[str]
    rules: tuple = ()

    @staticmethod
    def of(tensors: Sequence[SaveTensor], lazy_ok: Sequence[str] | frozenset[str], rules: Sequence, world: int) -> "Proposal":
        """Check the rules against ``tensors`` and apply their pure part; raises what a rule refuses."""
        reds = [r for r in rules if isinstance(r, Reduced)]
        reduced: dict[int, Reduced] = {}
        for i, t in enumerate(tensors):
            rule = next((r for r in reds if r.matches(t.fqn)), None)
            if rule is None:
                continue
            if t.replica_count != world or t.flat is not None:
                raise UnsupportedStateError(f"{t.fqn}: Reduced applies to plain tensors held by every rank")
            reduced[i] = rule
        experts = tuple(r for r in rules if isinstance(r, Experts))
        for r in experts:
            r.offset()  # the EP degree must divide the experts
        pieces = tuple(tuple(apply_save([t], rules)) for t in tensors)
        return Proposal(tuple(tensors), pieces, reduced, experts, frozenset(lazy_ok), tuple(rules))

    def logical(self) -> list[SaveTensor]:
        """Every logical piece, in order."""
        return [p for ps in self.pieces for p in ps]


@dataclass(frozen=True)
class Agreed:
    """What the agreement decided on this rank.

    ``tensors`` are the ones to write (reduced, placed, with copy names),
    ``lazy_ok`` the names of them that may be copied lazily, and
    ``replicas`` this rank's pending table for the commit (``None`` on a
    world of one).

    Example::

        agreed = agree_save(proposal, comm, gate); agreed.tensors
    """

    tensors: tuple[SaveTensor, ...] = ()
    lazy_ok: frozenset[str] = frozenset()
    replicas: PendingTable | None = field(default=None, compare=False)


def agree_save(proposal: Proposal, comm: Comm, gate: Gate) -> Agreed:
    """Run the agreement of a save with groups or rules declared; see the module documentation.

    A failure on this rank joins the next exchange with the marker; every
    rank then raises :class:`AgreedFailure` with the same error.

    Example::

        agreed = agree_save(Proposal.of(tensors, lazy_ok, rules, comm.world), comm, gate)
    """
    try:
        return _agree(proposal, comm, gate)
    except AgreedFailure:
        raise
    except Exception as e:
        gate.abstain(e)  # no peer waits in an exchange for this rank; raises AgreedFailure
        raise
    finally:
        gate.close()


def _agree(proposal: Proposal, comm: Comm, gate: Gate) -> Agreed:
    logical = proposal.logical()
    if proposal.experts:
        picked, keys = expert_keys(logical, proposal.experts)
        first = Rows.keys(keys)
    else:
        rows = rows_of(logical, digests=False)  # which piece in which group: the same before and after reducing
        first = Rows(encode_rows(rows))
    facts = facts_of(proposal.physical, proposal.reduced)  # reduced only where every rank holds the same
    got = _checked_facts(gate.exchange(first.plus(fact_rows(facts))), facts, comm, gate)
    # Every rank is healthy and holds the same Reduced tensors: the reductions may run.
    pieces = list(proposal.pieces)
    if proposal.reduced:
        physical = reduce_values(proposal.physical, proposal.reduced, comm)
        for i in proposal.reduced:
            pieces[i] = tuple(apply_save([physical[i]], proposal.rules))
        logical = [p for ps in pieces for p in ps]
    lazy = set(proposal.lazy_ok)
    for t, ps in zip(proposal.physical, pieces):
        if t.fqn in proposal.lazy_ok:
            lazy.update(p.fqn for p in ps)
    if proposal.experts:
        holders: dict[int, list[int]] = {}
        for rank, message in got.items():
            for k in message.first_column():
                holders.setdefault(k, []).append(_global(comm, gate, rank))
        logical = apply_placement(logical, picked, keys, holders, _global(comm, gate, comm.rank))
        rows = rows_of(logical, digests=False)
        got = gate.exchange(Rows(encode_rows(rows)))
    gate.close()
    tensors = _renamed(logical, rows, [m.table for m in got.values()], comm) if gate.active else logical
    return Agreed(tuple(tensors), frozenset(lazy), pending_table(tensors, comm))


def _checked_facts(got: dict[int, Rows], facts: list[ReducedFact], comm: Comm, gate: Gate) -> dict[int, Rows]:
    """The first exchange's messages without their Reduced rows, once every rank sent the same ones.

    Every rank sees the same tables, so every rank refuses alike: the ranks
    gather their facts by name once and each raises the same error.
    """
    split = {r: fact_keys(m.table) for r, m in got.items()}
    if len({tuple(keys) for _, keys in split.values()}) > 1:
        gate.close()  # the last exchange: the failure is known to every rank
        raise AgreedFailure(mismatch_error(gate.where, comm.all_gather(facts)))
    return {r: Rows(table) for r, (table, _) in split.items()}


def _global(comm: Comm, gate: Gate, rank: int) -> int:
    """Replica groups name global ranks; a stand-in without a process group is its own rank."""
    return comm.global_rank(rank) if gate.active else rank


def _renamed(tensors: list[SaveTensor], rows: list, tables: list[torch.Tensor], comm: Comm) -> list[SaveTensor]:
    """``tensors`` with each name several declared groups hold renamed to its group's copy.

    The last exchange: every rank sees the same tables, so all send their
    ``rows`` (named, made before the exchange: nothing is left to fail) or none.
    """
    if not suspicious(tables):
        return tensors  # no name in two groups
    copies = copied_names(comm.all_gather(rows))
    if not copies:
        return tensors
    return [replace(t, fqn=copy_name(t.fqn, t.replica_group)) if t.fqn in copies else t for t in tensors]


def reduce_values(tensors: Sequence[SaveTensor], reduced: Mapping[int, Reduced], comm: Comm) -> list[SaveTensor]:
    """``tensors`` with those at the positions of ``reduced`` reduced across the group, in the order of their names.

    Runs only inside the agreement, once every rank is known healthy and
    to hold the same Reduced tensors (:mod:`shardpoint.saving.reduced`).

    Example::

        tensors = reduce_values(tensors, {3: Reduced("extra.ema")}, comm)
    """
    out = list(tensors)
    for i in sorted(reduced, key=lambda i: out[i].fqn):  # by name: the ranks reduce the same tensors in the same order
        t, rule = out[i], reduced[i]
        data = t.data.detach().clone()
        if comm.active and comm.world > 1:
            comm.all_reduce(data)
            if rule.op == "mean":
                data = data / comm.world if data.is_floating_point() else data // comm.world
        out[i] = replace(t, data=data, placement=f"reduced:{rule.op}")
    return out
