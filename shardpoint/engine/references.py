"""Reading through references: the data files an incremental checkpoint uses from its bases.

A checkpoint of format version 4 names some chunks' data files as
``<base>/<data>`` (:mod:`shardpoint.format.refs`). :func:`open_references`
checks, before anything is loaded, that every referenced data file is where
the manifest says and as large as it says, and returns a storage that reads
those names from the base checkpoints: :class:`ReferencingStorage`. The
read engine is unchanged: it asks that storage for ``chunk.file`` as for any
data file and verifies every block against the checksums as always, so a
damaged shared chunk fails every load that reads it.

Example::

    storage = open_references(storage, manifest, storage.url)
    execute_reads(storage, manifest, targets, storage.url)
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import CorruptCheckpointError, MissingBaseError, StorageError
from ..format.manifest import Manifest
from ..storage.base import Storage, Writer
from ..storage.locations import locate

__all__ = ["ReferencingStorage", "open_references", "base_storages"]


def base_storages(storage: Storage, manifest: Manifest, where: str) -> dict[str, Storage]:
    """Each base location ``manifest`` references, opened relative to ``storage``.

    Example::

        {base: st.url for base, st in base_storages(storage, manifest, storage.url).items()}
    """
    out: dict[str, Storage] = {}
    for ref in manifest.refs:
        if ref.base not in out:
            try:
                out[ref.base] = locate(storage, ref.base)
            except StorageError as e:
                raise MissingBaseError(
                    f"{where}: the checkpoint references data in {ref.base}, which this storage cannot open ({e}); "
                    "load a consolidated copy (shardpoint consolidate)", ref.base,
                ) from None
    return out


def open_references(storage: Storage, manifest: Manifest, where: str) -> Storage:
    """``storage`` itself when ``manifest`` has no references; else one that reads them from their bases.

    Every referenced data file is checked first: a missing one raises
    :class:`~shardpoint.errors.MissingBaseError` naming the base location,
    one of another size :class:`~shardpoint.errors.CorruptCheckpointError`.

    Example::

        storage = open_references(storage, manifest, storage.url)
    """
    if not manifest.refs:
        return storage
    bases = base_storages(storage, manifest, where)
    routes: dict[str, tuple[Storage, str]] = {}
    for ref in manifest.refs:
        if ref.name in routes:
            continue
        base = bases[ref.base]
        try:
            size = base.size(ref.data)
        except FileNotFoundError:
            raise MissingBaseError(
                f"{where}: the checkpoint references {ref.data} in its base {ref.base} ({base.url}), which is missing; "
                f"restore {base.url}, or load an earlier self-contained checkpoint (the manager's retention keeps "
                "referenced data: remove checkpoints through it, and use shardpoint consolidate before moving one)",
                ref.base, base.url,
            ) from None
        if size != ref.size:
            raise CorruptCheckpointError(
                f"{where}: referenced data file {ref.data} in {base.url} is {size} bytes, the manifest says "
                f"{ref.size}; the base was changed or damaged"
            )
        routes[ref.name] = (base, ref.data)
    return ReferencingStorage(storage, routes)


class ReferencingStorage(Storage):
    """A checkpoint's storage whose referenced data file names read from their base checkpoints.

    ``routes`` maps each referenced name (``../step_100/data/x.bin``) to
    (the base's storage, the name there). Every other name, and every write,
    goes to ``inner``. Build it with :func:`open_references`.

    Example::

        st = ReferencingStorage(inner, {"../s1/data/ab-r00000.bin": (base, "data/ab-r00000.bin")})
        st.read("../s1/data/ab-r00000.bin", 0, 16)
    """

    def __init__(self, inner: Storage, routes: dict[str, tuple[Storage, str]]):
        super().__init__()
        self.inner, self.routes = inner, dict(routes)
        self.url, self.stats = inner.url, inner.stats
        self.page_cached = inner.page_cached
        self.read_threads, self.coalesce_bytes = inner.read_threads, inner.coalesce_bytes
        self.vectored_reads = inner.vectored_reads

    def _route(self, name: str) -> tuple[Storage, str]:
        return self.routes.get(name) or (self.inner, name)

    # Reads: routed.
    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        st, n = self._route(name)
        st.readinto(n, offset, buf)

    def readinto_many(self, name: str, parts: Iterable[tuple[int, memoryview]]) -> None:
        st, n = self._route(name)
        st.readinto_many(n, parts)

    def map_range(self, name: str, offset: int, length: int, count: int | None = None) -> memoryview | None:
        st, n = self._route(name)
        return st.map_range(n, offset, length, count)

    def populate(self, name: str, offset: int, length: int) -> bool:
        st, n = self._route(name)
        return st.populate(n, offset, length)

    def get(self, name: str) -> bytes:
        st, n = self._route(name)
        return st.get(n)

    def get_limited(self, name: str, limit: int) -> bytes:
        st, n = self._route(name)
        return st.get_limited(n, limit)

    def size(self, name: str) -> int:
        st, n = self._route(name)
        return st.size(n)

    # Everything else: the checkpoint's own storage.
    def open_writer(self, name: str) -> Writer:
        return self.inner.open_writer(name)

    def put_atomic(self, name: str, data: bytes) -> None:
        self.inner.put_atomic(name, data)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def location_exists(self) -> bool:
        return self.inner.location_exists()

    def child(self, sub: str) -> Storage:
        return self.inner.child(sub)

    def alternatives(self) -> list[Storage]:
        return self.inner.alternatives()

    def place(self) -> tuple[Any, str] | None:
        return self.inner.place()

    def at(self, path: str) -> Storage:
        return self.inner.at(path)

    @property
    def primary(self) -> Storage:
        return self.inner.primary
