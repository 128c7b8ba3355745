"""The commit's I/O: each rank's index file, the two gathers to rank 0, the manifest written last, cleanup.

The gathers also carry the replica check's tables: each status the digest
of its rank's table, and one rank per distinct digest its table, which rank
0 compares before it writes anything (:mod:`shardpoint.planning.replicas`).

What goes into the manifest is decided by :mod:`shardpoint.planning.commit`;
this module moves it. Every collective goes through
:class:`~shardpoint.dist.Comm`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..dist import Comm, Outcome, raise_if_failed, run_guarded
from ..errors import StorageError
from ..format.index import encode_index, index_digest
from ..format.manifest import MANIFEST_NAME, RankFiles
from ..planning.commit import AskFor, Documents, assemble_manifest, representatives
from ..planning.describe import RankReport, RankStatus
from ..planning.replicas import ReplicaTable, commit_refusal, table_representatives
from ..storage import Storage
from .claim import CommitPolicy, SaveClaim, cleanup_after_commit

__all__ = ["write_index", "commit_manifest", "discard_files", "commit_save", "commit_all", "CommitTarget", "CommitDecision"]

log = logging.getLogger("shardpoint")


def write_index(storage: Storage, data: str, records, dtypes: Mapping[str, str], index: str | None = None) -> tuple[RankFiles, int]:
    """Write the index file of the data file ``data`` (its chunk ``records``); return its entry and size.

    ``index`` names the index file (default: ``data`` with ``.idx`` for ``.bin``).

    Example::

        entry, size = write_index(storage, "data/ab-r00000.bin", records, {"w": "float32"})
    """
    index = index or data[: -len(".bin")] + ".idx"
    blob = encode_index(records, dtypes)
    try:
        with storage.open_writer(index) as w:
            w.write(blob)
    except OSError as e:
        raise StorageError(f"{storage.url}: writing {index} failed: {e}") from e
    return RankFiles(data, index, index_digest(blob)), len(blob)


def commit_manifest(storage: Storage, data: bytes, files: Mapping[str, int], claim: SaveClaim | None, grace_s: float, where: str) -> None:
    """Write the manifest bytes ``data`` atomically (the commit), then remove what nothing lists.

    ``claim`` (the path's claim, when held) is confirmed right before the
    write; ``files`` are the new checkpoint's, kept by the cleanup along
    with every file a committed manifest lists or younger than ``grace_s``.

    Example::

        commit_manifest(storage, manifest.to_json(), manifest.files, claim, policy.cleanup_grace_s, storage.url)
    """
    if claim is not None:
        claim.confirm()
    try:
        storage.put_atomic(MANIFEST_NAME, data)
    except OSError as e:
        raise StorageError(f"{where}: committing {MANIFEST_NAME} failed: {e}") from e
    cleanup_after_commit(storage, files, data, grace_s, where)


def discard_files(storage: Storage, files: Sequence[str], rank: int) -> None:
    """Remove this rank's files of a save that will not commit; a later commit's cleanup removes leftovers.

    Example::

        discard_files(storage, ["data/ab-r00001.bin", "data/ab-r00001.idx"], 1)
    """
    try:
        storage.delete_many(sorted(files))
    except Exception as e:  # noqa: BLE001 - a later commit's cleanup removes them
        log.debug("rank %s: could not remove its files of the failed save: %s", rank, e)


@dataclass(frozen=True)
class CommitTarget:
    """The save a commit completes: its storage, id, block size, path for messages, claim and policy.

    Example::

        target = CommitTarget(storage, save_id, 1 << 20, storage.url)
        commit_save(target, 8, statuses, docs)
    """

    storage: Storage
    save_id: str
    block: int
    where: str
    claim: SaveClaim | None = None
    policy: CommitPolicy = field(default_factory=CommitPolicy)


def commit_save(target: CommitTarget, world: int, statuses: Sequence[RankStatus], docs: Sequence[Documents]) -> str:
    """Rank 0: assemble the manifest from the gathered statuses and documents, and commit it.

    Example::

        commit_save(CommitTarget(storage, save_id, 1 << 20, storage.url), 8, statuses, docs)
    """
    t = target
    manifest = assemble_manifest(t.save_id, world, t.block, statuses, docs, t.where, time.time())
    commit_manifest(t.storage, manifest.to_json(), manifest.files, t.claim, t.policy.cleanup_grace_s, t.where)
    return t.save_id


@dataclass(frozen=True)
class CommitDecision:
    """Rank 0's answer to the first gather: whom to ask for documents, or every rank's failure.

    ``replicas``: the ranks that send their replica tables, one per
    distinct table digest.
    """

    ask: AskFor | None
    failures: tuple[Outcome, ...] = ()
    replicas: frozenset[int] = frozenset()


def _decide(gathered: Sequence[Outcome]) -> CommitDecision:
    """Rank 0: the decision on every rank's first-gather outcome."""
    if not all(o.ok for o in gathered):
        return CommitDecision(None, tuple(o.sendable(with_value=False) for o in gathered))
    statuses = [o.value for o in gathered]
    return CommitDecision(representatives(statuses), replicas=table_representatives([s.replicas for s in statuses]))


def _refuse(digests: Sequence[str], tables: Mapping[int, ReplicaTable], where: str) -> None:
    """Rank 0: raise the replica comparison's verdict, if it refuses the save."""
    error = commit_refusal(digests, tables, where)
    if error is not None:
        raise error


def commit_all(comm: Comm, target: CommitTarget, out: Outcome) -> str:
    """Every rank: commit on rank 0 from two small gathers; return the manifest's save id or raise everywhere.

    First every rank's fixed-size :class:`RankStatus`; then only the ranks
    rank 0 asks for, one per distinct digest, send their documents and
    replica tables. Chunk records never travel: each rank wrote its own
    index file. Copies that should agree but differ fail the save on every
    rank with :class:`~shardpoint.errors.ReplicaMismatchError` before the
    manifest is written, and each rank removes its files. ``out`` is this
    rank's outcome, holding a :class:`RankReport` when it succeeded.

    Example::

        save_id = commit_all(comm, CommitTarget(storage, save_id, block, storage.url, claim), out)
    """
    storage, where = target.storage, target.where
    report: RankReport | None = out.value if out.ok else None
    status = Outcome(True, report.status) if report is not None else out.sendable(with_value=False)
    gathered = comm.gather(status)
    decision = _decide(gathered) if comm.rank == 0 else CommitDecision(None)
    decision = comm.broadcast(decision)
    if decision.ask is None:
        if report is not None:  # nothing will list this rank's files (unique to this save): remove them now
            discard_files(storage, list(report.status.files), comm.rank)
        raise_if_failed(list(decision.failures), f"save to {where}")
    assert report is not None and decision.ask is not None
    ask = decision.ask
    docs = comm.gather((Documents(
        report.tensors if comm.rank in ask.tensors else None,
        report.values if comm.rank in ask.values else None,
    ), report.replicas if comm.rank in decision.replicas else None))
    final: tuple[list[Outcome], bool] | None = None
    if comm.rank == 0:
        assert gathered is not None and docs is not None
        statuses = [o.value for o in gathered]
        tables = {r: t for r, (_, t) in enumerate(docs) if t is not None}
        refused = run_guarded(lambda: _refuse([s.replicas for s in statuses], tables, where))
        if not refused.ok:
            final = ([refused.sendable()], True)
        else:
            documents = [d for d, _ in docs]
            commit = run_guarded(lambda: commit_save(target, comm.world, statuses, documents))
            if comm.world == 1 and not commit.ok:
                raise commit.exc
            final = ([commit.sendable()], False)
    outcomes, discard = comm.broadcast(final)
    if discard:  # refused before the manifest: nothing lists this save's files
        discard_files(storage, list(report.status.files), comm.rank)
    raise_if_failed(outcomes, f"save to {where}")
    return outcomes[0].value  # the manifest's id (rank 0's)
