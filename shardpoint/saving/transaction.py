"""One save, as a transaction with named phases.

:class:`SaveTransaction` runs ``enter`` (the arguments are checked and the
ranks agree on the call), ``prepare`` (adapters flatten the state, the
planners choose writers: :func:`~shardpoint.saving.prepare.prepare_save`,
with the ranks' agreement where groups or rules are declared),
``claim`` (rank 0 claims the path before any data is written), ``snapshot``
(the bytes to write are fixed), ``write`` (this rank's data and index files,
then the summary its commit needs) and ``commit`` (rank 0 commits from two
small gathers; the same error reaches every rank), then reports timings and
metrics. Every phase that can fail on one rank runs guarded and meets the
others in the commit, or, before the write of a save that declares groups
or rules, in the agreement (:mod:`shardpoint.saving.agree`), from which
every rank raises the same error at once.

:func:`shardpoint.save` runs the phases in order on the calling thread; its
snapshot is the write itself. :class:`~shardpoint.saving.background.BackgroundSave`
(used by :class:`~shardpoint.AsyncSaver`) runs the same phases, with the
snapshot copied into host staging memory and the claim, write and commit on
the saver's workers. Sync and async differ only in that scheduling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, MutableMapping

from ..dist import Comm, Outcome, run_guarded
from ..engine.claim import CommitPolicy, SaveClaim
from ..engine.io import write_chunks
from ..errors import UnsupportedStateError
from ..runtime.handshake import Ticket
from ..runtime.monitor import Recorder, format_summary
from ..planning.describe import RankReport
from ..planning.save_plan import SavePlan
from .reuse import SaveCache
from .incremental import reference_base
from .agree import AgreedFailure, unwrap
from .options import SaveOptions
from .prepare import prepare_save, summarize
from ..runtime.monitor import mark_phase
from .steps import SaveResult, check_block_size, data_file_name, finish_save
from ..storage import Storage, storage_for

__all__ = ["SaveTransaction", "SaveOptions", "SaveCall", "check_state"]

log = logging.getLogger("shardpoint")


def check_state(state: Any, op: str = "save") -> None:
    """Refuse a state that is not a dict of plain top-level names, before any collective.

    A path where the state belongs (DCP's order, ``save(state, path)``) gets
    the hint that the path comes first; ``op`` names the call in it.

    Example::

        check_state({"model": model, "optimizer": opt})
    """
    if isinstance(state, (str, os.PathLike, Storage)):
        raise UnsupportedStateError(
            f"sp.{op}(path, state): the path comes first (got {type(state).__name__} {str(state)!r} where the "
            f"state belongs; torch.distributed.checkpoint's order is the other way round)"
        )
    if not isinstance(state, MutableMapping):
        raise UnsupportedStateError(f"state must be a dict of name -> object, got {type(state).__name__}")
    for k in state:
        if not isinstance(k, str) or not k or "." in k:
            raise UnsupportedStateError(f"state keys must be non-empty strings without '.', got {k!r}")


@dataclass(frozen=True)
class SaveCall:
    """What the enter phase made for one save on one rank; the later phases read it.

    ``base``: the caller's ranks; ``comm``: the ranks' coordination (a
    private group for background saves); ``storage``: where it goes
    (``None`` for pre-warming, which writes nothing); ``where``: its URL;
    ``result``: what the save did, filled as it runs; ``started``: when it
    was entered (``time.monotonic()``); ``entry``: the ranks' agreement on
    the call, still to be awaited by a background save before its first
    exchange (already awaited for a save on the calling thread).

    Example::

        call = tx.enter(None); call.result.save_id
    """

    base: Comm
    comm: Comm
    storage: Storage | None
    where: str
    result: SaveResult
    started: float
    entry: Ticket = field(default_factory=Ticket)

    @property
    def save_id(self) -> str:
        """The id this rank names its data file with."""
        return self.result.save_id


class SaveTransaction:
    """One save of ``state`` to ``path`` on one rank; :meth:`run` runs its phases in order.

    ``op`` names the call in errors and in the ranks' agreement (``save`` or
    ``async_save``).

    Example::

        tx = SaveTransaction("ckpt/step_100", state, SaveOptions())
        tx.enter(None)
        result = tx.run()
    """

    background = False

    def __init__(self, path: Any, state: MutableMapping[str, Any], options: SaveOptions, op: str = "save"):
        self.path = path
        self.state = state
        self.options = options
        self.op = op
        self.policy = options.commit or CommitPolicy()
        self.call: SaveCall | None = None  # made by the enter phase
        self.prepared: Outcome | None = None  # the prepare phase's outcome: a SavePlan when it succeeded
        self.cache: SaveCache | None = None  # what repeated saves reuse (the saver's); the summary's description too
        self.claim: SaveClaim | None = None
        self.bar: Any = None
        self.refs: tuple[tuple, dict] = ((), {})  # an incremental save's references and their index files

    # The enter phase's values, by name.
    base = property(lambda self: self.call.base, doc="The caller's ranks.")
    comm = property(lambda self: self.call.comm, doc="The ranks' coordination (a private group for background saves).")
    storage = property(lambda self: self.call.storage, doc="Where the save goes.")
    where = property(lambda self: self.call.where, doc="The save's URL, for messages.")
    result = property(lambda self: self.call.result, doc="What the save did on this rank.")
    save_id = property(lambda self: self.call.save_id, doc="The id this rank names its data file with.")
    t0 = property(lambda self: self.call.started, doc="When the save was entered.")

    @property
    def plan(self) -> SavePlan:
        """The prepare phase's plan (it succeeded on this rank)."""
        return self.prepared.value

    # --- enter ------------------------------------------------------------------------------------

    def check(self) -> None:
        """The enter phase's local part: refuse bad arguments before any collective."""
        check_state(self.state, self.op)
        check_block_size(self.options.block_size)

    def enter(self, process_group: Any, coordinate: Any = None) -> SaveCall:
        """The enter phase: every rank agrees it entered this save of this path; return what the later phases read.

        ``coordinate(base, entry)`` maps the caller's ranks to the group the
        later phases talk on (a background save's private group); default:
        the same. A background save only posts its entry here (see
        :meth:`Comm.announce <shardpoint.dist.Comm.announce>`): nothing on
        the training thread waits for the other ranks.
        """
        base = Comm.resolve(process_group)
        if base.local and self.options.replicated_over is not None:
            raise ValueError("replicated_over has no meaning for a rank-local save (process_group=sp.LOCAL): one rank writes everything")
        storage = storage_for(self.path)
        where = storage.url
        # The ranks also agree on whether groups or rules are declared: that decides whether they
        # exchange before the write (see shardpoint.saving.agree), so all must decide alike.
        op = self.op if self.options.replicated_over is None else f"{self.op} with replicated_over"
        op = f"{op} with layouts" if self.options.layouts else op  # rules, too, make the ranks agree before the write
        entry = base.announce(op, where, self.options.collective_timeout, later=self.background)
        if not self.background:
            entry.wait()
        # A background save waits in its writer, or before its agreement's first exchange: not on the training thread.
        comm = base if coordinate is None else coordinate(base, entry)
        started = time.monotonic()
        save_id = uuid.uuid4().hex  # each rank names its data file with its own id: no collective is needed to start
        result = SaveResult(where, save_id, recorder=Recorder("save", where, comm.rank))
        self.call = SaveCall(base, comm, storage, where, result, started, entry)
        return self.call

    # --- prepare ----------------------------------------------------------------------------------

    def prepare(self, cache: SaveCache | None = None) -> SavePlan:
        """The prepare phase: this rank's tensors and documents, and who writes what."""
        self.cache = cache
        plan = prepare_save(self.state, self.comm, self.options, self.result, cache, rank_local=self.base.local,
                            entry=self.call.entry)
        self.prepared = Outcome(True, plan)
        return plan

    def rehearse(self, base: Comm, comm: Comm, cache: SaveCache) -> SavePlan:
        """Pre-warming's run of the prepare phase alone: no path, no agreement, the plan lands in ``cache``.

        Example::

            plan = SaveTransaction("prewarm", state, SaveOptions()).rehearse(base, comm, cache)
        """
        self.check()
        self.call = SaveCall(base, comm, None, "prewarm", SaveResult("prewarm", ""), time.monotonic())
        return self.prepare(cache)

    # --- claim ------------------------------------------------------------------------------------

    def claim_path(self) -> None:
        """The claim phase: rank 0 claims the path before any data is written.

        Its failure reaches every rank at the commit.
        """
        if self.comm.rank == 0:
            self.claim = SaveClaim.acquire(self.storage.primary, self.policy, self.where)

    # --- write ------------------------------------------------------------------------------------

    def write(self) -> RankReport:
        """The write phase of a save on the calling thread: its data file, read from the live state."""
        tb = time.monotonic()
        records, files = [], {}
        mine = self.plan.mine
        if self.options.base is not None:  # reference what equals the base; write the rest
            mine = reference_base(self, mine)
        if self.bar is not None:
            self.bar.set_total(sum(it.nbytes for it in mine))
        if mine:
            name = data_file_name(self.save_id, self.comm.rank)
            records, size = write_chunks(self.storage, name, list(mine), self.comm.rank, self.options.block_size, self.result.recorder)
            files[name] = size
            self.result.bytes_written = size
        return self.summarize(records, files, tb)

    def summarize(self, records: list, files: dict, started: float) -> RankReport:
        """The write phase's end: the index file, then the summary this rank's commit needs."""
        mark_phase(self.result, "data_file", started)  # whole file incl. fsync; per-chunk spans are "write"
        report = summarize(self.plan, self.storage, (records, files), self.comm, self.cache, self.refs)
        self.result.bytes_written = sum(report.status.files.values())
        return report

    def local_phases(self) -> RankReport:
        """Prepare, claim and write on this rank (the sync save runs them guarded, as one)."""
        plan = self.prepare()
        if plan.replicas is not None:  # the caller waits until the commit: digest alongside the write
            plan.replicas.start()
        self.claim_path()
        return self.write()

    # --- commit -----------------------------------------------------------------------------------

    def commit(self, out: Outcome) -> None:
        """The commit phase: rank 0 commits from every rank's outcome; the claim is released whatever happens."""
        finish_save(self.comm, self.storage, out, self.result, self.options.block_size, self.claim, self.policy)
    def report(self) -> SaveResult:
        """After the commit: total time, timings, trace and metrics, and the log line."""
        result = self.result
        mark_phase(result, "total", self.t0)
        result.timings = result.recorder.summary()
        result.recorder.emit(self.options.trace_dir, self.options.on_metrics)
        how = " in the background" if self.background else ""
        log.info("rank %s saved %s bytes to %s%s: %s", self.comm.rank, result.bytes_written, self.where, how, format_summary(result.timings))
        return result

    def abandon(self) -> None:
        """A save of one rank failed before its commit: release the claim and close the bar without a done line."""
        if self.claim is not None:
            self.claim.release()
        if self.bar is not None:
            self.bar.close(ok=False)

    def run(self, bar: Any = None) -> SaveResult:
        """Every phase after ``enter``, on the calling thread; ``bar`` shows the bytes written.

        Example::

            tx.enter(None); result = tx.run()
        """
        self.bar = bar
        out = run_guarded(self.local_phases)
        if not out.ok and (self.comm.world == 1 or isinstance(out.exc, AgreedFailure)):
            self.abandon()  # every rank raises it now: nothing was written, there is nothing to commit
            raise unwrap(out.exc)
        with bar or contextlib.nullcontext():  # a failed commit closes the bar without a "done" line
            self.commit(out)
        return self.report()
