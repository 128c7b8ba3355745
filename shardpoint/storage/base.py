"""The storage interface: a few primitives every backend implements.

A :class:`Storage` is bound to one location (a checkpoint folder, or a run
folder that holds many). Names inside it are relative, ``/``-separated paths.
Backends implement the primitives; everything else (``read``, ``exists``,
``child``) is derived here so each backend stays small.

The commit rule is the same everywhere: data files are written and made
durable first; ``put_atomic`` of the manifest is the commit. On a filesystem it
is write-temp, fsync, rename, fsync-directory; on an object store it is the
single PUT of the manifest object.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from .. import errors
from ..errors import CheckpointError, StorageError, UnsafeCheckpointError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.strict import Limits

__all__ = ["Storage", "Writer", "IOStats", "ShortReadError", "MissingDependencyError", "committed_files", "remove_unreferenced"]

log = logging.getLogger("shardpoint")


class ShortReadError(StorageError):
    """An object ended before the requested byte range (truncated data)."""


class MissingDependencyError(errors.MissingDependencyError, StorageError):
    """A backend needs an optional package that is not installed; the message says what to install.

    Both a :class:`shardpoint.errors.MissingDependencyError` and a
    :class:`~shardpoint.errors.StorageError`, so storage code that handles
    backend failures sees it too.

    Example::

        try:
            storage_for("s3://bucket/ckpt")
        except MissingDependencyError as e:
            print(e)  # ... install it with: pip install 'shardpoint[s3]'
    """


@dataclass
class IOStats:
    """Bytes and calls through one storage instance (thread-safe counters)."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.reads += 1

    def add_write(self, n: int) -> None:
        with self._lock:
            self.bytes_written += n
            self.writes += 1

    def __getstate__(self) -> dict:  # picklable: the lock is per process
        d = dict(self.__dict__)
        d.pop("_lock", None)
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()


class Writer(abc.ABC):
    """A sequential writer of one data file. ``close()`` makes it durable.

    ``positional`` writers also take :meth:`write_at` from several threads at
    once, each at its own offset (the file's bytes are then written in
    parallel); the others take only :meth:`write`, in order.
    """

    positional: bool = False

    @abc.abstractmethod
    def write(self, data: memoryview | bytes) -> None: ...

    def write_at(self, offset: int, data: memoryview | bytes) -> None:
        """Write ``data`` at byte ``offset`` (``positional`` writers only; safe from several threads)."""
        raise NotImplementedError(f"{type(self).__name__} writes in order only")

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and make durable (fsync or upload complete)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard what was written; never raises."""

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is None:
            self.close()
        else:
            self.abort()


class Storage(abc.ABC):
    """A checkpoint location. Subclasses implement the abstract primitives."""

    url: str
    # Whether a second read of the same bytes on one host is a memory copy (local
    # files through the page cache, memory): loads then re-read instead of sharing.
    page_cached: bool = False

    def __init__(self) -> None:
        self.stats = IOStats()

    # --- primitives -------------------------------------------------------
    @abc.abstractmethod
    def open_writer(self, name: str) -> Writer:
        """A writer that creates or replaces ``name``."""

    @abc.abstractmethod
    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with ``len(buf)`` bytes of ``name`` from ``offset``; short reads raise."""

    @abc.abstractmethod
    def put_atomic(self, name: str, data: bytes) -> None:
        """Write a small object so that readers see all of it or none of it."""

    @abc.abstractmethod
    def get(self, name: str) -> bytes:
        """The whole content of a (small) object; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def size(self, name: str) -> int:
        """Byte size of ``name``; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All names under ``prefix`` (recursive), sorted."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; absent names are ignored."""

    @abc.abstractmethod
    def location_exists(self) -> bool:
        """Whether the location itself exists (a folder, or any object under the prefix)."""

    @abc.abstractmethod
    def child(self, sub: str) -> "Storage":
        """A storage bound to the sub-location ``sub``."""

    # --- writer coordination (defaults are best effort; backends override) --
    # Whether create_exclusive is atomic against other processes writing the same
    # location (an O_EXCL create, a conditional PUT). The defaults below only check
    # and then write, which narrows a race without closing it.
    atomic_create: bool = False

    @property
    def primary(self) -> "Storage":
        """The storage that saves commit to, claim and clean up: this one.

        A tiered storage answers with its fastest tier, where saves commit;
        its slower tiers receive copies and are cleaned by those copies.
        """
        return self

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` only if it is absent; ``True`` when this call created it.

        Saves claim their path with it (see :mod:`shardpoint.engine.claim`).
        The object appears whole or not at all. This default checks, writes
        and reads back (best effort); backends with an atomic primitive set
        :attr:`atomic_create` and override it.

        Example::

            if not storage.create_exclusive(".claim", body):
                ...  # someone else holds it
        """
        if self.exists(name):
            return False
        self.put_atomic(name, data)
        try:
            return self.get(name) == data
        except FileNotFoundError:
            return False

    def replace_if(self, name: str, expected: bytes, data: bytes) -> bool:
        """Replace ``name`` by ``data`` only if it holds exactly ``expected``; ``True`` on success.

        Used to take over a claim whose owner is gone: of several processes
        replacing the same stale object, at most one succeeds where the
        backend has a conditional write (S3 ``If-Match``). This default
        compares, deletes and re-creates with :meth:`create_exclusive`; a
        racing replacement can then remove the winner's object, which the
        winner notices when it checks its claim before committing.
        """
        try:
            if self.get(name) != expected:
                return False
        except FileNotFoundError:
            return False
        self.delete(name)
        return self.create_exclusive(name, data)

    def modified_times(self, prefix: str = "") -> dict[str, float | None]:
        """Each name under ``prefix`` with its last-modified time (seconds since the epoch).

        ``None`` means unknown: a cleanup treats such a file as new and never
        deletes it. Backends override this with one listing call where they can.
        """
        return {n: None for n in self.list(prefix)}

    def sync_deletes(self) -> None:
        """Make the deletions done so far at this location durable before later ones.

        Retention deletes a checkpoint's manifest first and calls this before
        deleting its data, so a crash never leaves data without a manifest
        counted as complete. This default does nothing: where a delete is
        durable when it returns (object stores, memory) there is nothing to
        wait for. The local backend fsyncs its folder, best effort.

        Example::

            storage.delete("manifest.json")
            storage.sync_deletes()
        """

    def remove_empty_folders(self) -> None:
        """Remove the folders left empty at this location (itself included), best effort.

        This default does nothing, for stores whose folders are only name
        prefixes that vanish with their last object. The local backend
        removes empty directories, deepest first, and leaves any that is not
        empty.

        Example::

            for name in storage.list(""):
                storage.delete(name)
            storage.remove_empty_folders()
        """

    # --- optional abilities ----------------------------------------------
    # Every ability beyond the primitives is declared here with a default that is
    # always safe to call, so callers read a flag or call the method, and never
    # probe with hasattr/getattr. Backends that have the ability override both.

    # Whether :meth:`readinto_many` is one cheaper call than a loop of
    # :meth:`readinto` (local files: one name check and descriptor lookup).
    # The load engine gathers strided runs with it only when this is set.
    vectored_reads: bool = False

    # How many chunk reads the load engine keeps in flight at least; 0 leaves
    # its default. Object stores, where each request waits on the network, ask for more.
    read_threads: int = 0

    # Gap in bytes below which the load engine reads nearby runs of one chunk as
    # one range; ``None`` leaves the engine's default.
    coalesce_bytes: int | None = None

    # Whether this storage copies checkpoints down slower tiers in the
    # background, so that :meth:`wait` for a tier means something.
    tiered: bool = False

    def readinto_many(self, name: str, parts: Iterable[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, buffer)`` of ``parts`` from ``name``; short reads raise.

        This default reads the pieces one by one; backends that do it in one
        cheaper call override it and set :attr:`vectored_reads`.

        Example::

            storage.readinto_many("data/0.bin", [(0, mv[:4096]), (8192, mv[4096:])])
        """
        for offset, buf in parts:
            self.readinto(name, offset, buf)

    def map_range(self, name: str, offset: int, length: int, count: int | None = None) -> memoryview | None:
        """Bytes ``[offset, offset + length)`` of ``name`` as a view of a memory mapping, or ``None``.

        ``None`` means "read it instead"; this default always answers so.
        Backends over a page cache (local files) override it, so that a load
        that narrows or hashes the bytes skips one copy of each. ``count``
        is how many of the bytes the caller needs.

        Example::

            view = storage.map_range("data/0.bin", 0, 1 << 20)
            if view is None:
                ...  # read into a buffer instead
        """
        return None

    def populate(self, name: str, offset: int, length: int) -> bool:
        """Bring a range mapped by :meth:`map_range` into memory now; ``True`` if it did.

        This default does nothing and answers ``False``: the page faults of
        whoever touches the mapping bring the pages in instead.

        Example::

            storage.populate("data/0.bin", 0, 1 << 20)
        """
        return False

    def alternatives(self) -> list["Storage"]:
        """Other storages holding the same checkpoint, to retry a missing or corrupt read from, in order.

        None by default; a tiered storage answers with its slower tiers.

        Example::

            for alt in storage.alternatives():
                ...
        """
        return []

    def wait(self, tier: str | int | None = None, timeout: float | None = None) -> None:
        """Block until background copies have reached ``tier``; only where :attr:`tiered` is set.

        Plain storages have no background copies; this default raises
        ``NotImplementedError`` so that a wait for a tier is never silently
        empty. Check :attr:`tiered` first.

        Example::

            if storage.tiered:
                storage.wait("remote")
        """
        raise NotImplementedError(f"{self.url} is not tiered storage; wait(tier=...) needs a TieredStorage")

    # --- locations (incremental checkpoints name their base relative to themselves) ---
    def place(self) -> tuple[Any, str] | None:
        """(namespace, absolute POSIX path) of this location, or ``None`` (then no base can be referenced).

        Example: ``LocalStorage("/ckpt/step_1").place()`` is ``('file', '/ckpt/step_1')``.
        """
        return None

    def at(self, path: str) -> "Storage":
        """A storage of this kind and namespace at absolute POSIX ``path``. Example: ``st.at("/ckpt/step_1")``."""
        raise StorageError(f"{self.url}: {type(self).__name__} cannot open another location of its tree")

    # --- derived ----------------------------------------------------------
    def read(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from ``offset``."""
        buf = bytearray(length)
        self.readinto(name, offset, memoryview(buf))
        return bytes(buf)

    def get_limited(self, name: str, limit: int) -> bytes:
        """The whole content of a metadata object, refused unread when larger than ``limit`` bytes.

        The size is checked before reading (a manifest linked to
        ``/dev/zero``, or a huge object, is never read into memory), and the
        read itself takes at most ``limit`` bytes. Raises
        :class:`~shardpoint.errors.UnsafeCheckpointError` naming the object,
        or ``FileNotFoundError``. Backends override it to check and read
        through one handle (local files) or a bounded ranged GET (S3).

        Example::

            data = storage.get_limited("manifest.json", Limits.from_env().manifest_bytes)
        """
        n = self.size(name)
        if n > limit:
            raise self._too_large(name, n, limit)
        data = self.get(name)
        if len(data) > limit:
            raise self._too_large(name, len(data), limit)
        return data

    def _too_large(self, name: str, size: int, limit: int) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self.url}: {name} is {size} bytes, over the format's limit of {limit} for metadata; "
            "refusing to read it (raise the SHARDPOINT_MAX_* limit only for a trusted checkpoint)"
        )

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
            return True
        except FileNotFoundError:
            return False

    def delete_many(self, names: list[str]) -> None:
        for n in names:
            self.delete(n)

    def _short(self, name: str, offset: int, want: int, got: int) -> StorageError:
        return ShortReadError(f"{self.url}: short read of {name} at {offset}: wanted {want} bytes, got {got}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def committed_files(storage: "Storage", where: str = "", known: tuple[bytes, Iterable[str]] | None = None) -> set[str] | None:
    """The files the manifest committed in ``storage`` lists now, or ``None`` when none can be read or parsed.

    The manifest is read bounded and parsed strictly, like any load reads
    it. ``known`` is (manifest bytes, their files) of a manifest the caller
    just wrote: if the committed one is still those bytes it is not parsed
    again. This is what :func:`remove_unreferenced` asks right before it
    deletes anything.

    Example::

        remove_unreferenced(st, manifest.files, lambda: committed_files(st), grace_s=300.0)
    """
    try:
        now = storage.get_limited(MANIFEST_NAME, Limits.from_env().manifest_bytes)
    except FileNotFoundError:
        return None
    except CheckpointError as e:
        log.warning("%s: the committed manifest cannot be read (%s)", where or storage.url, e)
        return None
    if known is not None and now == known[0]:
        return set(known[1])
    try:
        return set(Manifest.from_json(now, where or storage.url).files)
    except Exception as e:  # noqa: BLE001 - unreadable: the caller deletes nothing
        log.warning("%s: the committed manifest does not parse (%s)", where or storage.url, e)
        return None


def remove_unreferenced(
    storage: Storage,
    keep: Iterable[str],
    committed: Callable[[], set[str] | None],
    grace_s: float,
    prefix: str = "data/",
    now: float | None = None,
) -> list[str]:
    """After a commit: delete files under ``prefix`` that no committed manifest references; return them.

    A file is deleted only if it is not in ``keep`` (the files of the
    manifest just written), was last modified at least ``grace_s`` seconds
    ago, and is not referenced by the manifest committed *now*: ``committed``
    re-reads it right before the deletion and returns its file names, or
    ``None`` when it cannot be read or parsed, and then nothing is deleted.
    So a save that committed after this one keeps its files, and the grace
    period spares the files of writers still in flight and of readers of
    the checkpoint just replaced. Files of unknown age are kept.

    Example::

        remove_unreferenced(st, manifest.files, lambda: committed_files(st), grace_s=300.0)
    """
    keep = set(keep)
    now = time.time() if now is None else now
    old = sorted(
        n for n, t in storage.modified_times(prefix).items()
        if n not in keep and t is not None and now - t >= grace_s
    )
    if not old:
        return []
    referenced = committed()
    if referenced is None:
        log.warning("%s: the committed manifest could not be read back; no files cleaned up", storage.url)
        return []
    doomed = [n for n in old if n not in referenced]
    if doomed:
        storage.delete_many(doomed)
    return doomed


def merged_options(options: Any, overrides: dict, default: Any, what: str) -> Any:
    """``options`` (or ``default``) with keyword ``overrides`` applied; unknown names raise TypeError."""
    opts = options or default
    if overrides:
        try:
            opts = replace(opts, **overrides)
        except TypeError as e:
            raise TypeError(f"unknown {what} option: {e}; see shardpoint.storage.{type(opts).__name__}") from None
    return opts
