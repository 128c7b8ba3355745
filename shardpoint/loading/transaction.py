"""One load, as a transaction with named phases.

:class:`LoadTransaction` runs ``enter`` (the ranks agree on the call),
``read_manifest`` (rank 0 reads it, every rank gets it), ``plan`` (targets
from the state and the chunks they need from the index files, checked
collectively so that the shared read starts on every rank or on none),
``agree`` (names unexpected on every rank), ``read`` (bytes, checksums), ``land`` (the objects install what
was read, and the load proves it reached the live state) and ``finish``
(the state is updated, timings and metrics are emitted). Every phase that
can fail on one rank runs guarded and meets the others in a collective.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, MutableMapping

from ..adapters import WholeEntry
from ..adapters.landing import entry_tensors, live_storages, unlanded
from ..adapters import implied_rules
from ..adapters.loading import materialize_meta
from ..dist import Comm, raise_if_failed, run_guarded
from ..engine.inflight import wait_for_saves
from ..engine.indexes import IndexReader, resolve, wanted_box
from ..engine.load import ReadTuning, execute_reads
from ..engine.references import open_references
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.strict import Limits
from ..geometry import Box
from ..runtime.monitor import Recorder, format_summary, mark_phase
from ..runtime.progress import LOAD_PHASES, progress_for
from ..storage import Storage, storage_for
from .copies import with_copies
from .diagnose import key_mismatch, missing_manifest_error, not_restored
from .entries import plan_entries
from .names import check_patterns, entry_keys
from .options import LoadOptions
from .result import LoadResult

__all__ = ["LoadTransaction", "manifest_bytes"]

log = logging.getLogger("shardpoint")


def manifest_bytes(storage: Storage) -> bytes:
    """The committed manifest's bytes, bounded; a path without one raises the error saying what it holds.

    Example::

        manifest = Manifest.from_json(manifest_bytes(storage_for("ckpt/step_100")), "ckpt/step_100")
    """
    wait_for_saves(storage.url)  # an asynchronous save of this path in this process commits first
    try:
        return storage.get_limited(MANIFEST_NAME, Limits.from_env().manifest_bytes)
    except (FileNotFoundError, NotADirectoryError):
        raise missing_manifest_error(storage) from None


class LoadTransaction:
    """One call of :func:`shardpoint.load` on one rank; :meth:`run` runs its phases in order.

    ``options`` carries what the keywords of :func:`shardpoint.load` say
    (:class:`LoadOptions`); the state has been checked by the caller.

    Example::

        result = LoadTransaction("ckpt/step_100", state, LoadOptions(strict=False)).run()
        print(result.bytes_read, result.state is state)
    """

    def __init__(self, path: str | Storage, state: MutableMapping[str, Any], options: LoadOptions | None = None) -> None:
        o = LoadOptions() if options is None else options
        self.path, self.state, self.options = path, state, o
        self.process_group, self.replicated_over = o.process_group, o.replicated_over
        self.strict, self.allow_pickle, self.verify, self.share_reads = o.strict, o.allow_pickle, o.verify, o.share_reads
        self.selected = o.selected
        self.layouts, self.collective_timeout, self.progress = o.layouts, o.collective_timeout, o.progress
        self.trace_dir, self.on_metrics = o.trace_dir, o.on_metrics
        self.fill: MutableMapping[str, Any] | None = None  # the caller's empty dict, under a non-strict load
        self.parts: dict = {}
        self.resolved: Any = None  # the chunks the targets need, resolved by plan()
        self.bar = None

    def run(self) -> LoadResult:
        """Run every phase; the result's ``state`` is what :func:`shardpoint.load` returns."""
        self.enter()
        self.read_manifest()
        self.plan()
        self.agree()
        self.bar = progress_for(self.progress, self.comm.rank, f"load {self.where}", LOAD_PHASES, self.result.recorder)
        with self.bar or contextlib.nullcontext():  # a failed read closes the bar without a "done" line
            values = self.comm.check(run_guarded(self.read_and_land), f"load of {self.where}")
        return self.finish(values)

    def enter(self) -> None:
        """Resolve the ranks and the storage; every rank agrees that it entered this load of this path."""
        self.comm = Comm.resolve(self.process_group)
        self.storage = storage_for(self.path)
        self.where = self.storage.url
        self.comm.enter("load", self.where, self.collective_timeout)
        self.t0 = time.monotonic()

    def read_manifest(self) -> None:
        """Rank 0 reads the manifest and sends it to all; an empty non-strict state asks for every entry."""
        comm, where = self.comm, self.where
        got = run_guarded(lambda: manifest_bytes(self.storage)) if comm.rank == 0 else None
        if comm.world == 1 and got is not None and not got.ok:
            raise got.exc
        got = comm.broadcast(got.sendable() if comm.rank == 0 else None)
        raise_if_failed([got], f"load of {where}")
        self.manifest = Manifest.from_json(got.value, where)
        if not self.state and not self.strict:  # nothing to restore into: return every entry as saved
            self.fill, self.state = self.state, {k: WholeEntry() for k in entry_keys(self.manifest)}
        self.result = LoadResult(where, recorder=Recorder("load", where, comm.rank))
        mark_phase(self.result, "manifest", self.t0)

    def plan(self) -> None:
        """Targets for every entry on this rank, checked collectively: the read starts on every rank or on none."""
        tp = time.monotonic()
        self.parts = self.comm.check(run_guarded(self.plan_local), f"load of {self.where}")
        mark_phase(self.result, "prepare", tp)

    def plan_local(self) -> dict:
        """This rank's part of :meth:`plan`; a missing name fails a strict load here.

        Everything here may fail on one rank only (the patterns of ``keys=``,
        a ``meta`` module given storage, an adapter's rules or targets), so
        all of it runs under the plan's check.
        """
        if self.selected is not None:
            check_patterns(self.where, self.selected, self.manifest, self.strict)
        materialize_meta(self.state)
        # Names saved as one copy per replica group; DeepSpeed MoE experts at their global index.
        layouts = with_copies([*self.layouts, *implied_rules(self.state)], self.manifest.tensors)
        plan = plan_entries(
            self.state, self.manifest, self.options, rank=self.comm.rank, world=self.comm.world, layouts=layouts, where=self.where,
        )
        self.result.missing, self.result.unexpected = sorted(plan.missing), sorted(plan.unexpected)
        if plan.missing and self.strict:
            key_mismatch(self.where, plan.missing, plan.unexpected, self.strict)
        # The index files are read here, under the plan's check: the read's sharing is collective,
        # so a rank that cannot resolve its chunks must fail before any rank starts it.
        self.resolved = self.resolve_chunks([t for p in plan.parts.values() for t in p.targets])
        return plan.parts

    def resolve_chunks(self, targets: list) -> Any:
        """The chunks that ``targets`` need, from the index files of the ranks that wrote them."""
        result = self.result
        wants: dict[str, list[Box]] = {}
        for t in targets:
            wants.setdefault(t.fqn, []).append(wanted_box(t.box, t.flat))
        ti = time.monotonic()
        # A checkpoint with references reads them from its bases: all there, or the load fails now.
        self.storage = open_references(self.storage, self.manifest, self.where)
        reader = IndexReader(self.storage, self.manifest, self.where)
        resolved = resolve(self.storage, self.manifest, wants, self.where, reader)
        result.index_bytes = reader.bytes_read
        mark_phase(result, "index", ti, reader.bytes_read)
        return resolved

    def agree(self) -> None:
        """Keep as unexpected only what no rank loads (each pipeline stage loads only its own layers)."""
        result = self.result
        result.unexpected = sorted(set.intersection(*(set(u) for u in self.comm.all_gather(result.unexpected))))
        if result.missing or result.unexpected:
            key_mismatch(self.where, result.missing, result.unexpected, self.strict)

    def read_and_land(self) -> dict:
        """:meth:`read`, then :meth:`land`: the new value of every loaded entry."""
        self.read()
        return self.land()

    def read(self) -> None:
        """Read, verify and copy the chunks the targets need (resolved by :meth:`plan`)."""
        result, storage, where = self.result, self.storage, self.where
        tr = time.monotonic()
        targets = [t for p in self.parts.values() for t in p.targets]
        if self.bar is not None:
            self.bar.set_total(sum(t.dest.numel() * t.dest.element_size() for t in targets))
        stats = execute_reads(
            storage, self.resolved, targets, where, self.verify, self.comm,
            ReadTuning(share=self.share_reads, recorder=result.recorder),
        )
        result.bytes_read, result.bytes_needed = stats.bytes_read, stats.bytes_needed
        result.bytes_received = stats.bytes_received
        mark_phase(result, "read", tr)

    def land(self) -> dict:
        """The objects install what was read; every target must then be live state (else not restored)."""
        values = {key: p.finish() for key, p in self.parts.items()}
        tl = time.monotonic()
        bad: list[str] = []
        for key, p in self.parts.items():
            if p.landed is not None:
                bad.extend(p.landed(p.targets))
            else:
                bad.extend(unlanded(p.targets, live_storages(entry_tensors(values[key]))))
        mark_phase(self.result, "landing", tl)
        self.result.not_restored = sorted(set(bad))
        if bad:
            not_restored(self.where, self.comm.rank, self.result.not_restored, self.strict)
        return values

    def finish(self, values: dict) -> LoadResult:
        """Put the new values into the state, then record and emit the timings."""
        state, result = self.state, self.result
        for key, value in values.items():
            state[key] = value
        if self.fill is not None:  # entries that keys= left out stay out
            self.fill.update({k: v for k, v in state.items() if not isinstance(v, WholeEntry)})
            state = self.fill
        mark_phase(result, "total", self.t0)
        result.timings = result.recorder.summary()
        result.recorder.emit(self.trace_dir, self.on_metrics)
        result.state = state
        log.info("rank %s read %s bytes from %s: %s", self.comm.rank, result.bytes_read, self.where, format_summary(result.timings))
        return result
