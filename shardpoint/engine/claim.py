"""Writers of one checkpoint path: an exclusive claim with a lease, and a cleanup that never robs.

The guarantee, for two or more saves to the same path (processes or hosts):

- **One writer at a time.** Before writing, a save (rank 0) creates the
  claim object ``.claim`` in the checkpoint folder with an exclusive create
  (a hard link on a filesystem, ``If-None-Match: *`` on S3, see
  :meth:`~shardpoint.storage.Storage.create_exclusive`). A save that finds a
  live claim raises :class:`~shardpoint.errors.ConcurrentSaveError` and
  commits nothing. The winner commits as usual: the manifest switches
  atomically from whatever the path held to the new checkpoint. So after
  any set of overlapping saves the path holds exactly one of them, whole,
  and every save that returned without error is the one the path held when
  it returned.
- **A crashed writer's claim is taken over.** A claim names its host (with
  the boot id), process id, process start time and the end of its lease.
  It is stale when its process is gone on this host, or when its lease has
  run out (another host). A stale claim is replaced with
  :meth:`~shardpoint.storage.Storage.replace_if` (S3 ``If-Match``), so of
  several savers taking it over at most one wins.
- **Checked before the commit.** Right before writing the manifest the
  owner reads its claim back and, when less than half the lease is left,
  renews it. A claim that was taken over (an owner that outlived its lease,
  say) makes the save raise ``ConcurrentSaveError`` instead of committing.
- **Cleanup keeps what is committed.** After its commit, and still holding
  the claim, a save deletes only data files that its own manifest does not
  list, that the manifest committed *at that moment* (read again right
  before deleting) does not list either, and that are older than the grace
  period; see :func:`~shardpoint.storage.base.remove_unreferenced`.

Limits: the lease is measured with wall clocks, so across hosts it assumes
clocks agree within a small fraction of ``lease_s``. On a backend whose
``atomic_create`` is false (an fsspec filesystem without exclusive writes)
the claim is best effort; the cleanup rule still never deletes a file the
committed manifest lists. On S3, ``LastModified`` of a multipart upload is
when it began, so there the grace period protects only writers younger than
it; the claim protects the rest.

Example::

    sp.save("ckpt/latest", state, commit=sp.CommitPolicy(lease_s=1800, cleanup_grace_s=60))
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from ..errors import ConcurrentSaveError, StorageError
from ..storage import Storage
from ..storage.base import committed_files, remove_unreferenced

__all__ = ["CommitPolicy", "SaveClaim", "CLAIM_NAME", "claim_stale_reason", "claim_is_live", "cleanup_after_commit", "host_id", "process_start"]

log = logging.getLogger("shardpoint")

CLAIM_NAME = ".claim"
"""The claim object a save holds in its checkpoint folder from before its first write until it has committed."""

_MAX_CLAIM_BYTES = 4096


@dataclass(frozen=True)
class CommitPolicy:
    """How a save shares its path with other writers.

    - ``lease_s``: how long a claim stays valid without its owner being
      seen (renewed before the commit when less than half is left). A
      claim from another host is taken over only after it runs out; on the
      same host a claim whose process is gone is taken over at once. Make
      it longer than a save takes.
    - ``cleanup_grace_s``: files a commit no longer needs are deleted only
      once they are this old, so writers still in flight and readers of the
      checkpoint being replaced keep theirs. 0 deletes at once.

    Example::

        sp.save(path, state, commit=sp.CommitPolicy(cleanup_grace_s=0))
    """

    lease_s: float = 900.0
    cleanup_grace_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.lease_s > 0:
            raise ValueError(f"CommitPolicy.lease_s must be positive, got {self.lease_s}")
        if not self.cleanup_grace_s >= 0:
            raise ValueError(f"CommitPolicy.cleanup_grace_s must be >= 0, got {self.cleanup_grace_s}")


def host_id() -> str:
    """This host's name and boot id: a claim from before a reboot is never mistaken for a live one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def process_start(pid: int) -> float | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux), 0.0 elsewhere if it exists, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return float(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        pass
    if os.path.isdir("/proc/self"):
        return None  # Linux, and no such process
    try:
        os.kill(pid, 0)
        return 0.0
    except ProcessLookupError:
        return None
    except OSError:
        return 0.0


def claim_stale_reason(info: dict, now: float | None = None) -> str | None:
    """Why the claim described by ``info`` may be taken over, or ``None`` while it is live."""
    now = time.time() if now is None else now
    if not isinstance(info, dict) or not isinstance(info.get("token"), str):
        return "unreadable claim"
    expires = info.get("expires")
    if not isinstance(expires, (int, float)):
        return "claim without a lease"
    if now >= expires:
        return f"its lease ran out {now - expires:.0f}s ago"
    if info.get("host") == host_id():
        pid = info.get("pid")
        start = process_start(pid) if isinstance(pid, int) and pid > 0 else None
        if start is None:
            return f"its process {pid} is gone"
        if info.get("pid_start") not in (None, start):
            return f"its process id {pid} now belongs to another process"
    return None


def _describe(info: dict) -> str:
    if not isinstance(info, dict):
        return "an unreadable claim"
    since = info.get("created")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"process {info.get('pid')} on {str(info.get('host', '?')).split('/')[0]!r} since {when}"


def _parse(raw: bytes) -> dict:
    try:
        info = json.loads(raw[:_MAX_CLAIM_BYTES].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


class SaveClaim:
    """Rank 0's claim on a checkpoint path for the length of one save.

    :meth:`acquire` takes it (or raises :class:`ConcurrentSaveError`),
    :meth:`confirm` checks it right before the commit, :meth:`release`
    drops it afterwards (only if it is still this save's).

    Example::

        claim = SaveClaim.acquire(storage.primary, CommitPolicy(), "ckpt/x")
        try:
            claim.confirm(); storage.put_atomic("manifest.json", data)
        finally:
            claim.release()
    """

    def __init__(self, storage: Storage, policy: CommitPolicy, where: str):
        self.storage, self.policy, self.where = storage, policy, where
        self.token = uuid.uuid4().hex
        self.body = self._make_body(self.token)
        self.released = False

    def _make_body(self, token: str) -> bytes:
        now = time.time()
        pid = os.getpid()
        return json.dumps({
            "token": token, "host": host_id(), "pid": pid, "pid_start": process_start(pid),
            "created": now, "expires": now + self.policy.lease_s,
        }, sort_keys=True).encode()

    @classmethod
    def acquire(cls, storage: Storage, policy: CommitPolicy, where: str) -> "SaveClaim":
        """Claim ``storage`` for one save; raise :class:`ConcurrentSaveError` if another save holds it."""
        claim = cls(storage, policy, where)
        try:
            for _ in range(3):
                if storage.create_exclusive(CLAIM_NAME, claim.body):
                    return claim
                try:
                    raw = storage.get(CLAIM_NAME)
                except FileNotFoundError:
                    continue  # released in between: try again
                info = _parse(raw)
                why = claim_stale_reason(info)
                if why is None:
                    raise ConcurrentSaveError(
                        f"{where}: another save is writing this checkpoint ({_describe(info)}); this save "
                        "stopped before committing and the path keeps what it held. Save to another path, or "
                        f"wait for that save; delete {CLAIM_NAME} there only if no save is running",
                        where, _describe(info),
                    )
                if storage.replace_if(CLAIM_NAME, raw, claim.body):
                    log.warning("%s: took over the claim of %s (%s)", where, _describe(info), why)
                    return claim
        except OSError as e:
            raise StorageError(f"{where}: claiming the checkpoint path failed: {e}") from e
        raise ConcurrentSaveError(f"{where}: lost the race for {CLAIM_NAME} to another save", where)

    def confirm(self) -> None:
        """Right before the commit: the claim must still be this save's; renew it when half its lease is gone."""
        try:
            raw = self.storage.get(CLAIM_NAME)
        except FileNotFoundError:
            raw = b""
        except OSError as e:
            raise StorageError(f"{self.where}: reading back {CLAIM_NAME} failed: {e}") from e
        info = _parse(raw)
        if info.get("token") != self.token:
            raise ConcurrentSaveError(
                f"{self.where}: this save's claim was taken over by another save ({_describe(info)}), "
                f"probably after its lease ran out (lease_s={self.policy.lease_s:g}); it did not commit. "
                "Raise CommitPolicy.lease_s above the time a save takes",
                self.where, _describe(info),
            )
        if info.get("expires", 0) - time.time() < self.policy.lease_s / 2:
            body = self._make_body(self.token)
            try:
                self.storage.put_atomic(CLAIM_NAME, body)  # still ours and within its lease: nobody may take it
            except OSError as e:
                raise StorageError(f"{self.where}: renewing {CLAIM_NAME} failed: {e}") from e
            self.body = body

    def release(self) -> None:
        """Drop the claim if it is still this save's; never raises (a leftover claim goes stale)."""
        if self.released:
            return
        self.released = True
        try:
            if _parse(self.storage.get(CLAIM_NAME)).get("token") == self.token:
                self.storage.delete(CLAIM_NAME)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - the claim then expires or its process is seen gone
            log.warning("%s: could not release %s: %s", self.where, CLAIM_NAME, e)


def claim_is_live(storage: Storage) -> bool:
    """Whether ``storage`` holds a claim of a save that may still be running."""
    try:
        raw = storage.get(CLAIM_NAME)
    except FileNotFoundError:
        return False
    return claim_stale_reason(_parse(raw)) is None


def cleanup_after_commit(storage: Storage, files, written: bytes, grace_s: float, where: str) -> list[str]:
    """After a commit: remove data files of replaced checkpoints and crashed saves that nothing lists.

    Runs on the storage the commit went to (its primary), while the save
    still holds its claim. The committed manifest is read again right before
    deleting: a file that it, or the manifest just written, lists is kept,
    and so is any file younger than ``grace_s``. A failure is logged, never
    raised: the checkpoint is committed either way.

    Example::

        cleanup_after_commit(storage, manifest.files, manifest_bytes, 300.0, storage.url)
    """
    st = storage.primary

    def committed() -> set[str] | None:
        return committed_files(st, where, known=(written, files))

    try:
        return remove_unreferenced(st, files, committed, grace_s)
    except Exception as e:  # noqa: BLE001
        log.warning("%s: cleanup after the commit failed (the checkpoint is committed): %s", where, e)
        return []
