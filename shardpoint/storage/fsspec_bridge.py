"""A bridge to any fsspec filesystem (gcs, hdfs, azure, ...), with shardpoint's commit rule.

``storage_for("gcs://bucket/run/step_100")`` builds one through fsspec's
registry; :class:`FsspecStorage` takes a filesystem instance directly.

The commit rule is the same as everywhere: data files are written and closed
first, and the manifest is written last as one object. How "one object" is
made depends on the filesystem:

- a local filesystem: data files are fsynced on close; the manifest is
  written to a temporary name, fsynced, renamed into place, and the folder is
  fsynced (as :class:`~shardpoint.storage.LocalStorage` does);
- every other filesystem (object stores above all): no ``fsync`` is ever
  called (it does not exist there, and DCP's fsspec writer crashes on S3
  calling it); files are flushed and closed, which uploads and finalises
  them, and the manifest is one ``pipe_file`` call, a single PUT, so a reader
  sees all of it or none of it. On object stores rename is a copy, never
  used for the commit.

Writers open files with ``autocommit=False`` where the filesystem supports it
(s3fs, gcsfs, adlfs: a multipart upload that ``abort()`` discards) and
otherwise write in place and delete on abort. Retries are the filesystem's own
(s3fs, gcsfs and adlfs retry throttling and 5xx); failures surface as
:class:`~shardpoint.errors.StorageError`.

Example::

    import fsspec
    from shardpoint.storage import FsspecStorage
    st = FsspecStorage(fsspec.filesystem("memory"), "/scratch/run1")
    sp.save(st.child("step_1"), {"model": model})
    sp.save("gcs://bucket/run1/step_1", state)  # needs gcsfs
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from ..errors import CheckpointError, StorageError
from .base import MissingDependencyError, Storage, Writer
from .durable import create_by_link, fsync_path
from .fsspec_writer import FsspecWriter
from .safe_open import open_inside, read_inside, size_inside

__all__ = ["FsspecStorage"]

log = logging.getLogger("shardpoint.storage.fsspec")

_LOCAL_PROTOCOLS = {"file", "local"}


def _is_local(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(_LOCAL_PROTOCOLS & set(protos))


def _mtime(info: dict) -> float | None:
    """Seconds since the epoch from an fsspec info dict, whichever key the filesystem uses."""
    for key in ("mtime", "LastModified", "last_modified", "created", "modified"):
        v = info.get(key)
        if isinstance(v, datetime.datetime):
            return (v if v.tzinfo else v.replace(tzinfo=datetime.timezone.utc)).timestamp()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


class FsspecStorage(Storage):
    """A location ``root`` on an fsspec filesystem ``fs``.

    ``max_concurrency`` bounds the threads that split large reads into
    parallel ranged reads of ``read_part_size`` bytes. Children share the
    filesystem, the thread pool and :attr:`stats`.

    Example::

        from fsspec.implementations.local import LocalFileSystem
        st = FsspecStorage(LocalFileSystem(), "/data/ckpt/run1")
        st.put_atomic("manifest.json", b"{}")
    """

    def __init__(self, fs, root: str, *, max_concurrency: int = 8, read_part_size: int = 16 << 20):
        super().__init__()
        if max_concurrency < 1 or read_part_size < 1:
            raise ValueError("max_concurrency and read_part_size must be positive")
        self.fs = fs
        stripped = fs._strip_protocol(root)
        if isinstance(stripped, list):  # pragma: no cover - defensive
            stripped = stripped[0]
        self.root = stripped.rstrip("/") or stripped
        if ".." in self.root.split("/"):
            raise StorageError(f"refusing unsafe root {root!r}")
        self.url = fs.unstrip_protocol(self.root)
        self._local = _is_local(fs)
        self._max_concurrency = max_concurrency
        self._read_part_size = read_part_size
        self._pool_box: list = [None, threading.Lock(), -1]  # shared with children

    @classmethod
    def from_url(cls, url: str, **storage_options: Any) -> "FsspecStorage":
        """Build from a URL through fsspec's registry (``gcs://``, ``hdfs://``, ``az://``, ...).

        Keyword arguments go to the filesystem (``token=...`` for gcsfs,
        ``account_name=...`` for adlfs); ``max_concurrency`` and
        ``read_part_size`` are taken by the bridge itself.

        Example::

            st = FsspecStorage.from_url("gcs://bucket/ckpt", token="cloud")
        """
        import fsspec.core

        own = {k: storage_options.pop(k) for k in ("max_concurrency", "read_part_size") if k in storage_options}
        scheme = url.split("://", 1)[0]
        try:
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as e:
            raise MissingDependencyError(
                f"the {scheme}:// backend needs an fsspec implementation that is not installed: {e}"
            ) from None
        except ValueError as e:
            if "Protocol not known" in str(e):
                raise StorageError(
                    f"no storage backend for scheme {scheme!r} in {url!r} "
                    "(supported: file, s3, and every fsspec protocol)"
                ) from None
            raise StorageError(f"{url}: cannot create the filesystem: {e}") from e
        return cls(fs, path, **own)

    # --- helpers --------------------------------------------------------------
    def _path(self, name: str) -> str:
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise StorageError(f"{self.url}: refusing unsafe name {name!r}")
        return f"{self.root}/{name}"

    def _wrap(self, op: str, name: str, e: BaseException) -> StorageError:
        if isinstance(e, StorageError):
            return e
        return StorageError(f"{self.url}: {op} of {name} failed: {type(e).__name__}: {e}")

    def __getstate__(self) -> dict:  # picklable when the filesystem is (fsspec filesystems are)
        d = dict(self.__dict__)
        d["_pool_box"] = None
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._pool_box = [None, threading.Lock(), -1]

    @property
    def _pool(self) -> ThreadPoolExecutor:
        box = self._pool_box
        with box[1]:
            if box[0] is None or box[2] != os.getpid():
                box[0] = ThreadPoolExecutor(self._max_concurrency, thread_name_prefix="shardpoint-fsspec")
                box[2] = os.getpid()
            return box[0]

    def _read_range(self, path: str, name: str, start: int, mv: memoryview) -> int:
        want = len(mv)
        try:
            if self._local:  # opened as untrusted, like LocalStorage: no links, regular files only
                got = 0
                fd = open_inside(self.root, name, self.url)
                try:
                    while got < want:
                        n = os.preadv(fd, [mv[got:]], start + got)
                        if not n:
                            break
                        got += n
                finally:
                    os.close(fd)
                return got
            data = self.fs.cat_file(path, start=start, end=start + want)
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as e:  # noqa: BLE001
            raise self._wrap("read", name, e) from e
        n = min(len(data), want)
        mv[:n] = data[:n]
        return n

    # --- primitives -------------------------------------------------------------
    def open_writer(self, name: str) -> Writer:
        return FsspecWriter(self, name, self._path(name), self._local, self._wrap)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        want = len(mv)
        path = self._path(name)
        if want == 0:
            self.size(name)
            self.stats.add_read(0)
            return
        step = self._read_part_size
        if want <= step:
            got = self._read_range(path, name, offset, mv)
        else:
            spans = [(lo, min(lo + step, want)) for lo in range(0, want, step)]
            futs = [self._pool.submit(self._read_range, path, name, offset + lo, mv[lo:hi]) for lo, hi in spans]
            wait(futs)
            got = want
            for (lo, hi), f in zip(spans, futs):
                n = f.result()
                if n < hi - lo:
                    got = min(got, lo + n)
        if got < want:
            raise self._short(name, offset, want, got)
        self.stats.add_read(want)

    def put_atomic(self, name: str, data: bytes) -> None:
        path = self._path(name)
        fs = self.fs
        try:
            if self._local:
                parent = fs._parent(path)
                fs.makedirs(parent, exist_ok=True)
                tmp = f"{parent}/.{path.rsplit('/', 1)[-1]}.{uuid.uuid4().hex}.tmp"
                try:
                    with fs.open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    fs.mv(tmp, path)
                except BaseException:
                    try:
                        fs.rm_file(tmp)
                    except Exception:  # noqa: BLE001
                        pass
                    raise
                fsync_path(parent)
            else:
                try:
                    fs.pipe_file(path, bytes(data))
                except FileNotFoundError:
                    fs.makedirs(fs._parent(path), exist_ok=True)
                    fs.pipe_file(path, bytes(data))
        except Exception as e:  # noqa: BLE001
            raise self._wrap("put", name, e) from e
        self.stats.add_write(len(data))

    def _local_whole(self, name: str, limit: int | None) -> bytes:
        data = read_inside(self.root, name, self.url, limit, lambda n: self._too_large(name, n, limit))
        self.stats.add_read(len(data))
        return data

    @property
    def atomic_create(self) -> bool:  # type: ignore[override]
        """Exclusive creates are atomic on a local filesystem (a hard link) and on s3fs (``If-None-Match``)."""
        protos = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return self._local or bool({"s3", "s3a"} & set(protos))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """A hard link of a private file on a local filesystem, else a check plus ``pipe_file(mode="create")``.

        s3fs turns the latter into a conditional PUT; other filesystems (and
        fsspec releases that ignore ``mode``) check and then write, which is
        best effort (see :attr:`atomic_create`).
        """
        path = self._path(name)
        fs = self.fs
        try:
            if self._local:
                parent = fs._parent(path)
                fs.makedirs(parent, exist_ok=True)
                if not create_by_link(path, data):
                    return False
            else:
                # Checked first as well: older fsspec releases accept mode= and ignore it, which
                # would turn the create into a silent overwrite of another save's claim.
                if fs.exists(path):
                    return False
                try:
                    fs.pipe_file(path, bytes(data), mode="create")
                except FileExistsError:
                    try:
                        return self.get(name) == bytes(data)  # a retried request that had succeeded
                    except FileNotFoundError:
                        return False
                except FileNotFoundError:
                    fs.makedirs(fs._parent(path), exist_ok=True)
                    return self.create_exclusive(name, data)
        except Exception as e:  # noqa: BLE001
            raise self._wrap("create", name, e) from e
        self.stats.add_write(len(data))
        return True

    def modified_times(self, prefix: str = "") -> dict[str, float | None]:
        """Modification times from one detailed listing (``mtime``, ``LastModified`` or ``created``)."""
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = f"{self.root}/{folder}" if folder else self.root
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:  # noqa: BLE001
            raise self._wrap("list", prefix or "/", e) from e
        n = len(self.root) + 1
        out: dict[str, float | None] = {}
        for p, info in found.items():
            p = self.fs._strip_protocol(p)
            if p.startswith(self.root + "/") and p[n:].startswith(prefix):
                out[p[n:]] = _mtime(info)
        return out

    def get(self, name: str) -> bytes:
        if self._local:
            return self._local_whole(name, None)
        try:
            data = self.fs.cat_file(self._path(name))
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(f"{self.url}: {name} does not exist") from None
        except Exception as e:  # noqa: BLE001
            raise self._wrap("get", name, e) from e
        self.stats.add_read(len(data))
        return data

    def get_limited(self, name: str, limit: int) -> bytes:
        """``get`` of a metadata file: its size and type checked first, then at most ``limit + 1`` bytes read."""
        if self._local:
            return self._local_whole(name, limit)
        n = self.size(name)  # a directory, FIFO or device is "not a file" here
        if n > limit:
            raise self._too_large(name, n, limit)
        try:
            data = self.fs.cat_file(self._path(name), start=0, end=limit + 1)
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(f"{self.url}: {name} does not exist") from None
        except Exception as e:  # noqa: BLE001
            raise self._wrap("get", name, e) from e
        if len(data) > limit:
            raise self._too_large(name, len(data), limit)
        self.stats.add_read(len(data))
        return data

    def size(self, name: str) -> int:
        if self._local:
            self._path(name)
            return size_inside(self.root, name, self.url)
        try:
            info = self.fs.info(self._path(name))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}: {name} does not exist") from None
        except Exception as e:  # noqa: BLE001
            raise self._wrap("stat", name, e) from e
        if info.get("type") not in ("file", None):
            raise FileNotFoundError(f"{self.url}: {name} is not a file")
        return int(info["size"])

    def list(self, prefix: str = "") -> list[str]:
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = f"{self.root}/{folder}" if folder else self.root
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise self._wrap("list", prefix or "/", e) from e
        n = len(self.root) + 1
        out = []
        for p in found:
            p = self.fs._strip_protocol(p)
            if p.startswith(self.root + "/"):
                name = p[n:]
                if name.startswith(prefix):
                    out.append(name)
        return sorted(out)

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            if self.fs.exists(self._path(name)):
                raise self._wrap("delete", name, e) from e

    def delete_many(self, names: list[str]) -> None:
        """One bulk ``rm`` (object stores batch it); absent names are ignored."""
        paths = [self._path(n) for n in names]
        if not paths:
            return
        try:
            self.fs.rm(paths)
        except Exception:  # noqa: BLE001 - some were absent: fall back to one by one
            for n in names:
                self.delete(n)

    def location_exists(self) -> bool:
        try:
            return bool(self.fs.exists(self.root))
        except Exception as e:  # noqa: BLE001
            raise self._wrap("exists", "/", e) from e

    def child(self, sub: str) -> "FsspecStorage":
        sub = sub.strip("/")
        if not sub or ".." in sub.split("/"):
            raise StorageError(f"refusing unsafe sub-location {sub!r}")
        c = FsspecStorage(self.fs, f"{self.root}/{sub}", max_concurrency=self._max_concurrency,
                          read_part_size=self._read_part_size)
        c.stats = self.stats
        c._share_pool(self._pool_box)
        return c

    def place(self) -> tuple[Any, str]:
        """(this filesystem, its absolute path): incremental checkpoints reference bases on the same filesystem.

        Filesystems compare as fsspec compares them (the same class and
        storage options). Example: ``FsspecStorage(fs, "/run/step_2").place()``
        is ``(("fsspec", fs), "/run/step_2")``.
        """
        return (("fsspec", self.fs), "/" + self.root.lstrip("/"))

    def at(self, path: str) -> "FsspecStorage":
        """The location at absolute ``path`` on the same filesystem, sharing the pool and counters."""
        root = path if self.root.startswith("/") else path.lstrip("/")  # object stores name "bucket/key", no slash
        c = FsspecStorage(self.fs, root, max_concurrency=self._max_concurrency, read_part_size=self._read_part_size)
        c.stats = self.stats
        c._share_pool(self._pool_box)
        return c

    def _share_pool(self, pool_box: Any) -> None:
        """Use the parent's thread pool instead of starting one per child."""
        self._pool_box = pool_box
