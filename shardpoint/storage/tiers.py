"""Multi-level checkpointing: a fast tier first, slower tiers copied in the background.

A :class:`TieredStorage` stacks storages from fastest to slowest, for example
host memory (``/dev/shm``, which survives a crash of the training process),
local disk, then a remote object store. Saves write and commit on the first
tier only, so the training job waits for the fastest medium; committing a
manifest queues a background copy of that checkpoint to every slower tier
(data files first, the manifest last: each tier's copy is itself committed
atomically). Reads come from the fastest tier that has the bytes; anything
missing there, and any block whose checksum fails there, comes from the next
tier (the load engine asks :meth:`TieredStorage.alternatives`).

Durability is reported per tier (``wait(tier="remote")``), the fast tiers can
keep only the last ``k`` checkpoints, and after a restart
:meth:`resume_replication` finishes copies that a crash interrupted.

Example::

    tiers = TieredStorage(["/dev/shm/run42", "ckpt/run42", "s3://bucket/run42"],
                          names=("host", "local", "remote"), keep_last={"host": 2})
    sp.save(tiers.child("step_00000100"), state)      # returns once "host" is committed
    tiers.wait("remote")                              # durable everywhere
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from ..errors import StorageError
from ..format.manifest import Manifest
from ..format.strict import Limits
from .base import ShortReadError, Storage, Writer, committed_files, remove_unreferenced
from .locations import locate

__all__ = ["TieredStorage"]

log = logging.getLogger("shardpoint")

MANIFEST = "manifest.json"
_COPY_PIECE = 16 << 20


class _Replicator:
    """The background copier shared by a tiered root and all its children."""

    def __init__(self, threads: int = 1):
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="shardpoint-tier")
        self.lock = threading.Lock()
        self.pending: list[Future] = []
        self.errors: list[BaseException] = []

    def submit(self, fn, *args) -> Future:
        fut = self.pool.submit(fn, *args)
        with self.lock:
            self.pending.append(fut)
        return fut


def _copy_file(src: Storage, dst: Storage, name: str) -> None:
    size = src.size(name)
    buf = bytearray(min(_COPY_PIECE, max(size, 1)))
    with dst.open_writer(name) as w:
        pos = 0
        while pos < size:
            n = min(len(buf), size - pos)
            mv = memoryview(buf)[:n]
            src.readinto(name, pos, mv)
            w.write(mv)
            pos += n


def _at(storage: Storage, sub: str) -> Storage:
    return storage.child(sub) if sub else storage


def _copy_referenced(src: Storage, dst: Storage, manifest: Manifest) -> None:
    """Copy the data files an incremental checkpoint references to the same places on ``dst``, where missing.

    Their base was copied down by its own commit; this covers a base that
    was not (saved to the fast tier alone, or its copy still queued), so
    each tier's copy of a checkpoint loads on its own.
    """
    for ref in manifest.refs:
        if ref.base == ".":
            continue
        there = locate(dst, ref.base)
        try:
            if there.size(ref.data) == ref.size:
                continue
        except FileNotFoundError:
            pass
        _copy_file(locate(src, ref.base), there, ref.data)


def _checkpoint_names(storage: Storage) -> list[str]:
    """Child folders of ``storage`` that hold a committed manifest, sorted by name."""
    out = set()
    for name in storage.list(""):
        head, _, tail = name.rpartition("/")
        if tail == MANIFEST and head and "/" not in head:
            out.add(head)
    return sorted(out)


class TieredStorage(Storage):
    """Storages from fastest to slowest, seen as one; see the module documentation."""

    tiered = True
    # Reads go through :meth:`readinto`, which falls back tier by tier on each
    # call, so the single-tier fast paths (vectored reads, mapped ranges, read
    # tuning) keep the base class's defaults here: a mapped view of the fast
    # tier could not fall back to a slower one.

    def __init__(
        self,
        tiers: Sequence[Storage | str],
        names: Sequence[str] | None = None,
        keep_last: Mapping[str, int] | None = None,
        cleanup_grace_s: float = 300.0,
        _replicator: _Replicator | None = None,
        _root: "TieredStorage | None" = None,
        _sub: str = "",
    ):
        super().__init__()
        from . import storage_for

        if len(tiers) < 1:
            raise StorageError("TieredStorage needs at least one tier")
        self.tiers = [storage_for(t) for t in tiers]
        self.names = tuple(names) if names is not None else tuple(f"tier{i}" for i in range(len(self.tiers)))
        if len(self.names) != len(self.tiers):
            raise StorageError(f"{len(self.tiers)} tiers but {len(self.names)} names")
        self.keep_last = dict(keep_last or {})
        # A copy to a slower tier removes the files no committed manifest there lists,
        # once they are this old (readers of the copy it replaced may still need them).
        self.cleanup_grace_s = float(cleanup_grace_s)
        unknown = set(self.keep_last) - set(self.names)
        if unknown:
            raise StorageError(f"keep_last names unknown tiers {sorted(unknown)}; tiers are {list(self.names)}")
        self._rep = _replicator or _Replicator()
        self._root = _root or self
        self._sub = _sub
        self.url = "tiers(" + ", ".join(t.url for t in self.tiers) + ")"
        self._durable: dict[tuple[str, int], Future] = {} if _root is None else _root._durable
        self.stats = self.tiers[0].stats

    # ---------------------------------------------------------------- tiers
    def _index(self, tier: str | int) -> int:
        if isinstance(tier, int):
            return tier
        try:
            return self.names.index(tier)
        except ValueError:
            raise StorageError(f"no tier named {tier!r}; tiers are {list(self.names)}") from None

    def alternatives(self) -> list[Storage]:
        """Slower tiers to retry a missing or corrupt read from, in order."""
        return list(self.tiers[1:])

    # ------------------------------------------------------------- writing
    @property
    def primary(self) -> Storage:
        """The fastest tier: saves commit, claim and clean up there."""
        return self.tiers[0]

    @property
    def atomic_create(self) -> bool:  # type: ignore[override]
        return self.tiers[0].atomic_create

    def create_exclusive(self, name: str, data: bytes) -> bool:
        return self.tiers[0].create_exclusive(name, data)

    def replace_if(self, name: str, expected: bytes, data: bytes) -> bool:
        return self.tiers[0].replace_if(name, expected, data)

    def modified_times(self, prefix: str = "") -> dict[str, float | None]:
        return self.tiers[0].modified_times(prefix)

    def open_writer(self, name: str) -> Writer:
        return self.tiers[0].open_writer(name)

    def put_atomic(self, name: str, data: bytes) -> None:
        self.tiers[0].put_atomic(name, data)
        if name == MANIFEST and len(self.tiers) > 1:
            self._schedule(self._sub)

    def _schedule(self, sub: str) -> Future:
        root = self._root
        fut = root._rep.submit(root._replicate, sub)
        for i in range(1, len(root.tiers)):
            root._durable[(sub, i)] = fut
        return fut

    def _replicate(self, sub: str) -> None:
        """Copy checkpoint ``sub`` down the tiers: data files, then the manifest."""
        try:
            for i in range(1, len(self.tiers)):
                src, dst = _at(self.tiers[i - 1], sub), _at(self.tiers[i], sub)
                limit = Limits.from_env().manifest_bytes
                manifest = src.get_limited(MANIFEST, limit)
                try:
                    if dst.get_limited(MANIFEST, limit) == manifest:
                        continue  # already there (a resumed copy)
                except FileNotFoundError:
                    pass
                # Validated like any load would (digest, file names), so a damaged manifest is not spread.
                parsed = Manifest.from_json(manifest, src.url, Limits.from_env())
                files = sorted(parsed.files)
                for name in files:
                    _copy_file(src, dst, name)
                _copy_referenced(src, dst, parsed)
                dst.put_atomic(MANIFEST, manifest)
                remove_unreferenced(dst, files, lambda d=dst: committed_files(d), self.cleanup_grace_s)
                log.info("checkpoint %s durable on tier %s", sub or "<root>", self.names[i])
            self._retain()
        except BaseException as e:
            log.error("copying checkpoint %s to slower tiers failed: %s", sub, e)
            with self._rep.lock:
                self._rep.errors.append(e)
            raise

    def _retain(self) -> None:
        """Keep only the last k checkpoints on tiers with a limit, once the bottom tier has them."""
        if not self.keep_last:
            return
        bottom = set(_checkpoint_names(self.tiers[-1]))
        for tname, k in self.keep_last.items():
            i = self._index(tname)
            if i == len(self.tiers) - 1:
                continue
            names = _checkpoint_names(self.tiers[i])
            for old in names[: max(0, len(names) - k)]:
                if old not in bottom:
                    continue  # never drop the only copy
                st = self.tiers[i].child(old)
                st.delete(MANIFEST)  # no manifest first: a half-deleted folder is never complete
                for name in st.list(""):
                    st.delete(name)

    def wait(self, tier: str | int | None = None, timeout: float | None = None) -> None:
        """Block until every scheduled copy has reached ``tier`` (default: the slowest)."""
        i = len(self.tiers) - 1 if tier is None else self._index(tier)
        if i == 0:
            return
        with self._root._rep.lock:
            futs = [f for (sub, j), f in self._root._durable.items() if j == i and (not self._sub or sub == self._sub)]
        for f in futs:
            f.result(timeout)

    def durable_on(self, tier: str | int) -> bool:
        """Whether this checkpoint's manifest is committed on ``tier``."""
        st = self.tiers[self._index(tier)]
        return st.exists(MANIFEST)

    def resume_replication(self) -> list[str]:
        """Queue copies of every checkpoint that a slower tier lacks; returns their names.

        Call it on one rank after a restart: a crash between the fast commit
        and the end of the background copy leaves the slower tiers behind.
        """
        root = self._root
        subs = [self._sub] if self._sub else _checkpoint_names(root.tiers[0])
        queued = []
        for sub in subs:
            try:
                manifest = _at(root.tiers[0], sub).get(MANIFEST)
            except FileNotFoundError:
                continue
            for t in root.tiers[1:]:
                try:
                    same = _at(t, sub).get(MANIFEST) == manifest
                except FileNotFoundError:
                    same = False
                if not same:
                    root._schedule(sub)
                    queued.append(sub)
                    break
        return queued

    def close(self) -> None:
        """Finish pending copies and stop the copier threads."""
        self._root._rep.pool.shutdown(wait=True)

    # ------------------------------------------------------------- reading
    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        last: BaseException | None = None
        for t in self.tiers:
            try:
                t.readinto(name, offset, buf)
                return
            except (FileNotFoundError, ShortReadError) as e:
                last = e
        raise last if last is not None else FileNotFoundError(name)

    def get(self, name: str) -> bytes:
        for t in self.tiers:
            try:
                return t.get(name)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(name)

    def get_limited(self, name: str, limit: int) -> bytes:
        """``get_limited`` from the first tier that has ``name``."""
        for t in self.tiers:
            try:
                return t.get_limited(name, limit)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(name)

    def size(self, name: str) -> int:
        for t in self.tiers:
            try:
                return t.size(name)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(name)

    def list(self, prefix: str = "") -> list[str]:
        out = set()
        for t in self.tiers:
            out.update(t.list(prefix))
        return sorted(out)

    def delete(self, name: str) -> None:
        for t in self.tiers:
            t.delete(name)

    def location_exists(self) -> bool:
        return any(t.location_exists() for t in self.tiers)

    def place(self) -> tuple[Any, str] | None:
        """(the tiers' roots, this folder's path under them), or ``None`` when a tier cannot name its places.

        An incremental checkpoint saved here names its base relative to
        itself; the name resolves under the same roots (:meth:`at`), so a
        reference reads from the fastest tier that holds the base's data
        and falls back to slower tiers as every read does.
        """
        roots = tuple(t.place() for t in self._root.tiers)
        if any(r is None for r in roots):
            return None
        return (("tiers", roots), "/" + self._sub)

    def at(self, path: str) -> "TieredStorage":
        """The folder at ``path`` (absolute, under the roots) of these tiers, sharing the copier."""
        sub = path.strip("/")
        return self._root.child(sub) if sub else self._root

    def child(self, sub: str) -> "TieredStorage":
        sub = sub.strip("/")
        path = f"{self._sub}/{sub}" if self._sub else sub
        c = TieredStorage(
            [t.child(sub) for t in self.tiers], self.names, self.keep_last, self.cleanup_grace_s,
            _replicator=self._root._rep, _root=self._root, _sub=path,
        )
        return c
