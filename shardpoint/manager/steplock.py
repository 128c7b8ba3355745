"""The per-step lock: one save at a time writes a step folder.

Before writing, rank 0 creates ``step_x/.lock`` with the storage's exclusive
create (:meth:`~shardpoint.storage.Storage.create_exclusive`: a hard link on
filesystems, an atomic insert in memory, a conditional PUT on S3). The lock
holds its owner's host, pid, process start time and creation time, so a lock
left by a crashed save is told from a live one: it is broken when its owner
process is gone (same host), its pid was reused, or (another host) it is older
than ``stale_lock_s``. Where the storage's create is not atomic
(:attr:`~shardpoint.storage.Storage.atomic_create` is false) the lock is
best effort.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from ..engine.claim import claim_is_live
from ..errors import ConcurrentSaveError
from ..format.manifest import MANIFEST_NAME
from ..storage import Storage
from .folders import LOCK_NAME, step_folder

__all__ = ["StepLock", "process_start"]

log = logging.getLogger("shardpoint")


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch); ``None`` if it is gone, a zombie or hidden.

    Example::

        process_start(os.getpid())  # 1764000000.12
    """
    try:
        import psutil

        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except Exception:  # noqa: BLE001 - gone, or no permission to look
        return None


class StepLock:
    """Takes, checks and releases step locks for one owner (one manager instance).

    ``acquire`` returns a token (the lock's bytes); ``release`` deletes the
    lock only while it still holds that token, so a lock broken and retaken by
    another save is never removed by the first.

    Example::

        locks = StepLock(owner=uuid.uuid4().hex, stale_lock_s=3600)
        token = locks.acquire(run.child("step_00000100"), 100)   # ConcurrentSaveError if held
        ...
        locks.release(run.child("step_00000100"), token)
    """

    def __init__(self, owner: str, stale_lock_s: float):
        self.owner = owner
        self.stale_lock_s = stale_lock_s

    def body(self, step: int) -> bytes:
        """The lock's content for a save of ``step`` by this process."""
        pid = os.getpid()
        return json.dumps({
            "owner": self.owner, "host": socket.gethostname(), "pid": pid,
            "pid_start": process_start(pid), "created": time.time(), "step": step,
        }).encode()

    def acquire(self, st: Storage, step: int) -> bytes:
        """Lock the step folder ``st``, breaking a stale lock; raise :class:`ConcurrentSaveError` if it is held."""
        body = self.body(step)
        if self._create(st, body):
            return body
        info = self.read(st)
        why = self.stale(info)
        if why is None:
            raise ConcurrentSaveError(
                f"{st.url}: another save holds {LOCK_NAME} (owner pid {info.get('pid')} on "
                f"{info.get('host')!r}, since {time.ctime(info.get('created', 0))}): two saves raced to "
                f"{step_folder(step)}. Give each job its own run root; delete the lock only if no other job "
                "is writing there",
                st.url, f"pid {info.get('pid')} on {info.get('host')!r} since {time.ctime(info.get('created', 0))}",
            )
        log.warning("%s: breaking the lock of %s (%s)", st.url, step_folder(step), why)
        st.delete(LOCK_NAME)
        if self._create(st, body):
            return body
        raise ConcurrentSaveError(f"{st.url}: lost a race for {LOCK_NAME} of {step_folder(step)}", st.url)

    @staticmethod
    def read(st: Storage) -> dict:
        """The lock of the step folder ``st`` as written; ``{}`` when it is absent or unreadable."""
        try:
            return json.loads(st.get(LOCK_NAME))
        except (FileNotFoundError, ValueError):
            return {}

    def stale(self, info: dict) -> str | None:
        """Why the lock described by ``info`` is abandoned, or ``None`` if it may be live."""
        if not info:
            return "unreadable lock"
        if info.get("owner") == self.owner:
            return "left by this manager's own failed save"
        if info.get("host") == socket.gethostname():
            start = process_start(int(info.get("pid", -1)))
            if start is None:
                return f"owner pid {info.get('pid')} is gone"
            if info.get("pid_start") is not None and abs(start - float(info["pid_start"])) > 1.0:
                return f"owner pid {info.get('pid')} was reused"
            return None
        age = time.time() - float(info.get("created", 0))
        if age > self.stale_lock_s:
            return f"lock is {age:.0f}s old (stale_lock_s={self.stale_lock_s:g})"
        return None

    @staticmethod
    def _create(st: Storage, body: bytes) -> bool:
        """Create the lock object only if absent; ``True`` when this call created it."""
        if not st.atomic_create:
            log.warning("%s: no exclusive create on this storage; the step lock is best effort", st.url)
        return st.create_exclusive(LOCK_NAME, body)

    @staticmethod
    def release(st: Storage, token: bytes | None) -> None:
        """Delete the lock of ``st`` if it still holds ``token`` (a failure is logged: a leftover lock is harmless)."""
        if token is None:
            return
        try:
            if st.get(LOCK_NAME) == token:
                st.delete(LOCK_NAME)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - a leftover lock on a committed step is harmless
            log.warning("could not release %s/%s: %s", st.url, LOCK_NAME, e)

    def abandon(self, st: Storage, token: bytes | None) -> None:
        """After a failed save that held ``token``: drop its partial files, keep any committed manifest, unlock."""
        if token is None:
            return
        try:
            names = st.list("")
            if claim_is_live(st):
                log.warning("%s: another save is writing here; its files are left alone", st.url)
            elif MANIFEST_NAME not in names:
                for n in names:
                    if n != LOCK_NAME:
                        st.delete(n)
            self.release(st, token)
        except Exception as e:  # noqa: BLE001
            log.warning("could not clean up the failed save in %s: %s", st.url, e)
