"""The replica check at save: ranks that are to hold the same copy of a tensor prove it.

A plain tensor is written once per replica group, so a rank whose copy
differs from the written one would lose its values in silence. At the call
each rank computes a small digest of every copy it holds, where the data
lives (so the digests are of the state at the call), and the ranks compare
them; a mismatch fails the save with :class:`ReplicaMismatchError` on every
rank and nothing is committed.

They compare at the commit: each rank's int64 table of digests travels in
the commit's first gather, with its status, and rank 0 compares them
(:func:`~shardpoint.planning.replicas.refusal`), so the check adds no
collective to a save. The digests are computed alongside the save's
other work (:class:`PendingTable`): a blocking save digests on a thread
while it writes, an asynchronous one while it copies, and a lazy one
digests what it copies lazily on its worker, before the optimizer's step.

When groups are declared (``replicated_over``, or layout rules, which
place experts), ranks of different groups may hold one name with different
values, and such tensors are stored as one copy per group, named
``<name>@ranks<r0>,<r1>,...`` (:func:`copy_name`); a load takes the copy
whose ranks include its own (:func:`shardpoint.loading.copies.copy_rule`). Which names those are
must be known before the write, so such a save exchanges, in its
agreement phase (:mod:`shardpoint.saving.agree`), which pieces each rank
holds in which group (no digests).

Digests (:mod:`shardpoint.saving.digest`) compare bit patterns: on the CPU an
``xxh3_64`` of the whole tensor up to 64 KiB, else of a strided sample that
always includes elements from every stretch of the tensor; on an accelerator,
torch ops on the device (a sample plus the exact sum of every bit pattern).
Copies that differ everywhere, such as per-rank expert weights, are always
caught. The tables are int64 only; names follow only when the tables show a
mismatch or a name held by several groups. The pure comparison lives in
:mod:`shardpoint.planning.replicas`.

Example::

    table = pending_table(tensors, comm)
"""

from __future__ import annotations

import threading
from typing import AbstractSet, Any, Iterable, Sequence

from .digest import HOST, check_mode, digest_all, digest_queued
from ..items import SaveTensor
from ..planning.replicas import (
    COPY_MARK, ReplicaTable, Row, copied_names, copy_name, encode_rows, mismatches, parse_copy_name,
    suspicious,
)

__all__ = [
    "COPY_MARK", "Row", "ReplicaTable", "rows_of", "table_of", "PendingTable", "mismatches", "copied_names", "encode_rows", "suspicious",
    "copy_name", "parse_copy_name", "pending_table", "replica_checked",
]


def _checked(t: SaveTensor) -> bool:
    # Copies compared: every replicated piece, and plain tensors a rank holds alone
    # (another group may hold the same name: see copied_names).
    return t.replica_count > 1 or t.placement == "local"


def replica_checked(tensors: Iterable[SaveTensor]) -> tuple[SaveTensor, ...]:
    """The tensors of ``tensors`` whose copies the replica check compares (a :class:`PendingTable` of them is the same).

    Example::

        held = replica_checked(plan.tensors)  # kept with the plan by a repeated save
    """
    return tuple(t for t in tensors if _checked(t))


def rows_of(tensors: Iterable[SaveTensor], digests: bool = True) -> list[Row]:
    """This rank's :class:`Row` for every tensor it holds that other ranks may hold too.

    ``digests=False`` leaves every digest equal (the check is off; the rows
    still find names held by several groups).

    Example::

        rows = rows_of(prep.tensors)
    """
    return [Row(*h) for h in _held(tensors, digests)]


def _held(tensors: Iterable[SaveTensor], digests: bool) -> list[tuple]:
    held = [t for t in tensors if _checked(t)]
    found = digest_all([t.data for t in held]) if digests else [(HOST, 0, 0, 0)] * len(held)
    return [_row(t, d) for t, d in zip(held, found)]


def _row(t: SaveTensor, digest: tuple) -> tuple:
    return (t.fqn, tuple(t.box.offsets), tuple(t.box.sizes), t.flat, t.replica_group, digest)


def table_of(tensors: Iterable[SaveTensor], digests: bool = True) -> ReplicaTable:
    """This rank's :class:`ReplicaTable`: the rows of :func:`rows_of`, encoded for the commit.

    Example::

        table_of(prep.tensors).encoded  # 48 bytes per row
    """
    return ReplicaTable.of(_held(tensors, digests))


class PendingTable:
    """This rank's :class:`ReplicaTable` for the commit, its digests computed when the save says.

    The digests must be of the state at the call. A save hands the work
    out in up to three parts:

    - :meth:`start` digests on a thread every CPU tensor not named in
      ``later`` (device tensors at once: their digests are queued on the
      device and read by :meth:`table`, so the call never waits for them), alongside what the save does next; a blocking save's caller
      cannot change the state before the commit, an asynchronous save
      joins the thread before its call returns;
    - :meth:`digest_later` digests the tensors named in ``later``: a lazy
      save's worker runs it before the optimizer's step may, and its guard
      proves at the fence that they did not change since the call;
    - :meth:`table` waits for both and assembles the table (computing
      everything now if nothing was started).

    Example::

        pending = PendingTable(prep.tensors); pending.start(); ...; pending.table().encoded
    """

    def __init__(self, tensors: Iterable[SaveTensor], digests: bool = True, held: bool = False):
        # held: ``tensors`` are already the ones replica_checked picks (a repeated save keeps them).
        self.tensors = list(tensors) if held else list(replica_checked(tensors))
        self.digests = digests
        self.found: list[tuple | None] = [None] * len(self.tensors)
        self.later: list[int] = []
        self.later_done = threading.Event()  # set once digest_later has run (at once when nothing is left for it)
        self.started = False
        self.thread: threading.Thread | None = None
        self.done: ReplicaTable | None = None
        self.error: BaseException | None = None
        self.queued: list[tuple[list[int], Any]] = []  # (positions, QueuedDigests) read by table()

    def digest(self, picked: Sequence[int]) -> None:
        """Digest the tensors at positions ``picked`` on the calling thread, keeping an error for :meth:`table`."""
        if not picked or self.error is not None:
            return
        try:
            data = [self.tensors[i].data for i in picked]
            found = digest_all(data) if self.digests else [(HOST, 0, 0, 0)] * len(data)
            for i, d in zip(picked, found):
                self.found[i] = d
        except BaseException as e:  # noqa: BLE001 - raised by table(), on the save's thread
            self.error = e

    def queue(self, picked: Sequence[int]) -> None:
        """Queue the digests of the device tensors at ``picked`` on their devices; :meth:`table` reads them."""
        if not picked or self.error is not None or not self.digests:
            return self.digest(picked)
        try:
            self.queued.append((list(picked), digest_queued([self.tensors[i].data for i in picked])))
        except BaseException as e:  # noqa: BLE001 - raised by table(), on the save's thread
            self.error = e

    def _collect(self) -> None:
        queued, self.queued = self.queued, []
        for picked, pending in queued:
            try:
                for i, d in zip(picked, pending.result()):
                    self.found[i] = d
            except BaseException as e:  # noqa: BLE001 - raised by table()
                self.error = e

    def start(self, later: AbstractSet[str] = frozenset()) -> None:
        """Digest every tensor not named in ``later`` (see the class documentation); runs once."""
        if self.started:
            return
        self.started = True
        host, device = [], []
        for i, t in enumerate(self.tensors):
            if not t.data.is_cpu:
                device.append(i)
            elif t.fqn in later:
                self.later.append(i)
            else:
                host.append(i)
        if not self.later:
            self.later_done.set()
        self.queue(device)  # read at the commit: no wait here
        if host:
            self.thread = threading.Thread(target=self.digest, args=(host,), name="shardpoint-replica-digests", daemon=True)
            self.thread.start()

    def join(self) -> None:
        """Wait for :meth:`start`'s thread."""
        if self.thread is not None:
            self.thread.join()

    def digest_later(self) -> None:
        """Digest the tensors :meth:`start` left for later, on the calling thread."""
        try:
            self.digest(self.later)
        finally:
            self.later_done.set()

    def table(self) -> ReplicaTable:
        """The table: waited for if started, else computed now; raises what computing it raised."""
        if self.done is None and self.error is None:
            if not self.started:  # nothing was handed out: all of it, on this thread
                self.started = True
                self.later_done.set()
                self.digest(range(len(self.tensors)))
            self.join()
            self.later_done.wait()  # the lazy worker's part
            self._collect()
        if self.error is not None:
            raise self.error
        if self.done is None:
            self.done = ReplicaTable.of([_row(t, d) for t, d in zip(self.tensors, self.found)])
        return self.done


def pending_table(tensors: Iterable[SaveTensor], comm: Any, held: bool = False) -> PendingTable | None:
    """This rank's :class:`PendingTable` for the commit; ``None`` on a world of one (nothing to compare).

    Not a collective: the digests are always compared at the commit, where
    rank 0 compares the tables (:func:`~shardpoint.planning.replicas.refusal`);
    the save says when they are computed. Copy names of declared groups are
    found before the write, by the save's agreement (:mod:`shardpoint.saving.agree`).
    ``held``: ``tensors`` are already those :func:`replica_checked` picks.

    Example::

        table = pending_table(prep.tensors, comm)
    """
    if not (bool(getattr(comm, "active", False)) and comm.world > 1):
        return None
    return PendingTable(tensors, check_mode() != "off", held)

