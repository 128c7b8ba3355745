"""What the phases of the save transaction (:mod:`shardpoint.saving`) call, besides the prepare phase.

The prepare phase and the ranks' agreement live in
:mod:`shardpoint.saving.prepare` and :mod:`shardpoint.saving.agree`. Then
the data file is written (by the caller), and
:func:`~shardpoint.saving.prepare.summarize` writes the rank's index file
and describes the rank. :func:`finish_save` commits through two
small gathers to rank 0. The decisions live in :mod:`shardpoint.planning`;
the I/O in :mod:`shardpoint.engine`.
"""

from __future__ import annotations

import time

from ..dist import Comm, Outcome
from ..engine.claim import CommitPolicy, SaveClaim
from ..engine.commit import CommitTarget, commit_all
from ..runtime.monitor import mark_phase
from ..storage import Storage
from .result import SaveResult

__all__ = ["SaveResult", "check_block_size", "data_file_name", "finish_save"]


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


def finish_save(
    comm: Comm, storage: Storage, out: Outcome, result: SaveResult, block_size: int,
    claim: SaveClaim | None = None, policy: CommitPolicy | None = None,
) -> None:
    """Commit on rank 0 from two small gathers, and raise the same error everywhere.

    ``out`` is this rank's outcome (a :class:`RankReport` when it
    succeeded); see :func:`~shardpoint.engine.commit.commit_all`. The
    save is ``result``'s (its path and this rank's save id). Rank 0's
    ``claim`` on the path is checked right before the commit and released
    at the end, whatever happens.

    Example::

        finish_save(comm, storage, run_guarded(write), result, 1 << 20, claim)
    """
    tc = time.monotonic()
    try:
        target = CommitTarget(storage, result.save_id, block_size, result.path, claim, policy or CommitPolicy())
        result.save_id = commit_all(comm, target, out)
    finally:
        mark_phase(result, "commit", tc)
        if claim is not None:
            claim.release()
