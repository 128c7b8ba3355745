"""The S3 storage class: keys, whole-operation retries, ranged GETs and the primitives; see the package docs."""

from __future__ import annotations

import datetime
import logging
import random
import time
from concurrent.futures import wait
from typing import Any, Callable, Sequence

from ...errors import StorageError
from ..base import Storage, Writer, merged_options
from .client import Shared
from .options import S3Options, S3StorageError
from .planner import scatter_plan
from .retry import BodyShortError, error_code, is_not_found, is_transient, require_boto3
from .writer import S3Writer

__all__ = ["S3Storage"]

log = logging.getLogger("shardpoint.storage.s3")

_SCRATCH = 256 << 10  # bytes of a gap read at a time (the only memory merging adds)


class S3Storage(Storage):
    """A checkpoint location ``s3://bucket/prefix`` on S3 or an S3-compatible store.

    ``options`` is an :class:`S3Options`; keyword arguments override its
    fields (``S3Storage(url, endpoint_url=...)``). Children share the client,
    thread pool and :attr:`stats`. Call :meth:`close` (or use ``with``) to stop
    the thread pool early; it restarts on demand.

    Example::

        st = S3Storage("s3://bucket/run1", S3Options(endpoint_url="http://127.0.0.1:9000"))
        st.put_atomic("manifest.json", b"{}")
        st.child("step_2").list()
    """

    def __init__(self, url: str, options: S3Options | None = None, **overrides: Any):
        super().__init__()
        require_boto3()
        if not isinstance(url, str) or not url.startswith("s3://"):
            raise StorageError(f"S3Storage needs an s3://bucket/prefix URL, got {url!r}")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise StorageError(f"{url!r} names no bucket (expected s3://bucket/prefix)")
        prefix = prefix.strip("/")
        if ".." in prefix.split("/") or "//" in prefix:
            raise StorageError(f"refusing unsafe S3 prefix in {url!r}")
        opts = merged_options(options, overrides, S3Options(), "S3")
        self.bucket = bucket
        self.prefix = prefix
        self._root = f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        # Options, client, thread pool and read queue, shared with children (see :class:`Shared`).
        self.shared = Shared(opts)

    @property
    def options(self) -> S3Options:
        """The options this storage tree was made with (shared with children)."""
        return self.shared.options

    @property
    def read_threads(self) -> int:
        """How many chunk reads the load engine keeps in flight (object stores like many)."""
        return max(2, self.options.max_concurrency)

    @property
    def coalesce_bytes(self) -> int:
        """Gap below which the load engine reads nearby runs of one chunk as one range.

        The same trade as ``read_merge_gap`` (0 when merging is off): a
        request costs more than reading a gap of this size.
        """
        return self.options.read_merge_gap or 0

    @property
    def client(self):
        """The boto3 S3 client (shared with children; rebuilt after ``fork``)."""
        return self.shared.client

    # --- helpers --------------------------------------------------------------
    def key(self, name: str) -> str:
        """The object key of ``name``; unsafe names (absolute, ``..``) raise ``StorageError``.

        Example::

            S3Storage("s3://b/run").key("manifest.json")  # 'run/manifest.json'
        """
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise StorageError(f"{self.url}: refusing unsafe name {name!r}")
        return self._root + name

    def call(self, op: str, name: str, fn: Callable[[], Any], *, reading: bool = False, ok_codes=()) -> Any:
        """Run ``fn`` with whole-operation retries; map failures to typed errors.

        The one retry policy of the backend, used by the storage, its
        multipart writer and its read queue alike: transient failures are
        retried with full-jitter backoff, absent objects become
        ``FileNotFoundError`` when ``reading``, codes in ``ok_codes`` return
        ``None``, and the rest raise :class:`S3StorageError`.

        Example::

            st.call("HeadObject", name, lambda: st.client.head_object(Bucket=st.bucket, Key=st.key(name)), reading=True)
        """
        o = self.options
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001
                if isinstance(e, StorageError):
                    raise
                code, status = error_code(e)
                if code in ok_codes:
                    return None
                if reading and is_not_found(e):
                    raise FileNotFoundError(f"{self.url}: {name} does not exist ({code})") from None
                if attempt < o.retries and is_transient(e):
                    delay = random.uniform(0, min(o.backoff_max, o.backoff_base * (2**attempt)))
                    attempt += 1
                    log.warning("%s: %s of %s failed (%s: %s); retry %d/%d in %.2fs",
                                self.url, op, name, type(e).__name__, e, attempt, o.retries, delay)
                    time.sleep(delay)
                    continue
                raise self._wrap(op, name, e, attempt) from e

    def _wrap(self, op: str, name: str, e: BaseException, attempt: int) -> S3StorageError:
        code, status = error_code(e)
        hint = ""
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            hint = " (configure AWS credentials, or pass access_key_id/secret_access_key in S3Options)"
        elif code == "NoSuchBucket":
            hint = f" (bucket {self.bucket!r} does not exist)"
        elif code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            hint = " (check the credentials and the bucket policy)"
        tries = f" after {attempt + 1} attempts" if attempt else ""
        return S3StorageError(
            f"{self.url}: {op} of {name} failed{tries}: {type(e).__name__}: {e}{hint}", code or type(e).__name__, status
        )

    def _get_range(self, key: str, name: str, start: int, mv: memoryview) -> int:
        """Fill ``mv`` from ``start``; return the bytes the object had (less at its end)."""
        return self.get_scatter(key, name, start, start + len(mv), [(start, start + len(mv), mv)])

    def get_scatter(self, key: str, name: str, lo: int, hi: int, wants: Sequence[tuple[int, int, memoryview]]) -> int:
        """One ranged GET of ``[lo, hi)`` streamed into the ``(start, end, buffer)`` wants it covers.

        Returns the bytes the object had in the range (less at its end).
        Bytes no want covers go through a small scratch buffer; a retry
        streams the whole range again (it rewrites the same bytes). The read
        queue runs each planned GET through it.

        Example::

            got = st.get_scatter(st.key("data/a.bin"), "data/a.bin", 0, 8, [(0, 4, a), (6, 8, b)])
        """
        c = self.shared.client
        pieces = scatter_plan(lo, hi, wants)

        def once() -> int:
            try:
                r = c.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")
            except Exception as e:
                if error_code(e)[0] == "InvalidRange":  # starts at or past the end
                    return 0
                raise
            body = r["Body"]
            expect = min(hi - lo, int(r.get("ContentLength", hi - lo)))
            if r.get("ResponseMetadata", {}).get("HTTPStatusCode") == 200 and lo > 0:
                body.close()
                raise S3StorageError(f"{self.url}: the server ignored the Range header reading {name}")
            got = 0
            scratch = None
            try:
                for length, views in pieces:
                    take = min(length, expect - got)
                    if take <= 0:
                        break
                    if views:
                        dst, k = views[0][:take], 0
                        while k < take:
                            n = body.readinto(dst[k:])
                            if not n:
                                raise BodyShortError(f"body ended after {got + k} of {expect} bytes")
                            k += n
                        for v in views[1:]:  # overlapping reads of the same bytes
                            v[:take] = dst
                    else:
                        if scratch is None:
                            scratch = memoryview(bytearray(min(_SCRATCH, length)))
                        k = 0
                        while k < take:
                            n = body.readinto(scratch[: min(len(scratch), take - k)])
                            if not n:
                                raise BodyShortError(f"body ended after {got + k} of {expect} bytes")
                            k += n
                    got += take
            finally:
                body.close()
            return got

        return self.call("GetObject", name, once, reading=True)

    # --- primitives -------------------------------------------------------------
    def open_writer(self, name: str) -> Writer:
        self.key(name)
        return S3Writer(self, name)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        want = len(mv)
        key = self.key(name)
        if want == 0:
            self.size(name)  # absent names still raise FileNotFoundError
            self.stats.add_read(0)
            return
        if self.options.read_merge_gap is not None:
            got = self.shared.reads.read(self, key, name, offset, mv)
        else:
            got = self._read_alone(key, name, offset, mv)
        if got < want:
            raise self._short(name, offset, want, got)
        self.stats.add_read(want)

    def _read_alone(self, key: str, name: str, offset: int, mv: memoryview) -> int:
        """One read on its own (merging off): parallel GETs of at most ``read_part_size``."""
        want, step = len(mv), self.options.read_part_size
        if want <= step:
            self.shared.count_gets(1)
            return self._get_range(key, name, offset, mv)
        pool = self.shared.pool
        spans = [(lo, min(lo + step, want)) for lo in range(0, want, step)]
        self.shared.count_gets(len(spans))
        futs = [pool.submit(self._get_range, key, name, offset + lo, mv[lo:hi]) for lo, hi in spans]
        wait(futs)
        got = want
        for (lo, hi), f in zip(spans, futs):
            n = f.result()  # raises the first failure (in range order)
            if n < hi - lo:
                got = min(got, lo + n)
        return got

    @property
    def get_requests(self) -> int:
        """Ranged GETs that reads have started so far (shared with children; retries not counted)."""
        return self.shared.gets

    def put_atomic(self, name: str, data: bytes) -> None:
        key, c = self.key(name), self.shared.client
        body = bytes(data)
        self.call("PutObject", name, lambda: c.put_object(Bucket=self.bucket, Key=key, Body=body))
        self.stats.add_write(len(body))

    atomic_create = True  # a conditional PUT; a server without it is detected and falls back

    def _conditional_put(self, name: str, data: bytes, condition: dict) -> bool | None:
        """A PUT with an ``If-None-Match``/``If-Match`` condition: True, False (condition failed) or
        None (the server has no conditional writes). A lost response retried into a failed
        condition is recognised by reading the object back: the bytes are unique per caller."""
        key, c = self.key(name), self.shared.client
        body = bytes(data)
        failed = []

        def once() -> bool:
            try:
                c.put_object(Bucket=self.bucket, Key=key, Body=body, **condition)
                return True
            except Exception as e:
                code, status = error_code(e)
                if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                    return False
                if code == "NotImplemented" or status == 501:
                    failed.append(code)
                    return False
                raise

        done = self.call("PutObject", name, once)
        if failed:
            log.warning("%s: the server has no conditional PUT; claims on this path are best effort", self.url)
            return None
        if not done:
            try:
                return self.get(name) == body
            except FileNotFoundError:
                return False
        self.stats.add_write(len(body))
        return True

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """A conditional PUT with ``If-None-Match: *``: S3 creates the object only if it is absent."""
        done = self._conditional_put(name, data, {"IfNoneMatch": "*"})
        return super().create_exclusive(name, data) if done is None else done

    def replace_if(self, name: str, expected: bytes, data: bytes) -> bool:
        """A conditional PUT with ``If-Match`` on the ETag of the object that held ``expected``."""
        key, c = self.key(name), self.shared.client

        def once():
            r = c.get_object(Bucket=self.bucket, Key=key)
            try:
                return r["Body"].read(), r.get("ETag")
            finally:
                r["Body"].close()

        try:
            current, etag = self.call("GetObject", name, once, reading=True)
        except FileNotFoundError:
            return False
        if current != expected or not etag:
            return False
        done = self._conditional_put(name, data, {"IfMatch": etag})
        return super().replace_if(name, expected, data) if done is None else done

    def modified_times(self, prefix: str = "") -> dict[str, float | None]:
        """``LastModified`` from one listing (for a multipart upload S3 reports when it began)."""
        c = self.shared.client
        full = self._root + prefix
        n = len(self._root)

        def once() -> dict[str, float | None]:
            out: dict[str, float | None] = {}
            try:
                for page in c.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=full, PaginationConfig={"PageSize": self.options.list_page_size}
                ):
                    for obj in page.get("Contents", ()):
                        when = obj.get("LastModified")
                        out[obj["Key"][n:]] = when.timestamp() if isinstance(when, datetime.datetime) else None
            except Exception as e:
                if error_code(e)[0] == "NoSuchBucket":
                    return {}
                raise
            return out

        return self.call("ListObjectsV2", prefix or "/", once)

    def get(self, name: str) -> bytes:
        key, c = self.key(name), self.shared.client

        def once() -> bytes:
            body = c.get_object(Bucket=self.bucket, Key=key)["Body"]
            try:
                return body.read()
            finally:
                body.close()

        data = self.call("GetObject", name, once, reading=True)
        self.stats.add_read(len(data))
        return data

    def get_limited(self, name: str, limit: int) -> bytes:
        """``get`` of a metadata object: its size (HEAD) checked first, then one GET of at most ``limit + 1`` bytes."""
        n = self.size(name)
        if n > limit:
            raise self._too_large(name, n, limit)
        if n == 0:
            return self.get(name)
        key, c = self.key(name), self.shared.client

        def once() -> bytes:
            body = c.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{limit}")["Body"]
            try:
                return body.read(limit + 1)
            finally:
                body.close()

        data = self.call("GetObject", name, once, reading=True)
        if len(data) > limit:
            raise self._too_large(name, len(data), limit)
        self.stats.add_read(len(data))
        return data

    def size(self, name: str) -> int:
        key, c = self.key(name), self.shared.client
        head = self.call("HeadObject", name, lambda: c.head_object(Bucket=self.bucket, Key=key), reading=True)
        return int(head["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        c = self.shared.client
        full = self._root + prefix
        n = len(self._root)

        def once() -> list[str]:
            out = []
            try:
                for page in c.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=full, PaginationConfig={"PageSize": self.options.list_page_size}
                ):
                    out.extend(obj["Key"][n:] for obj in page.get("Contents", ()))
            except Exception as e:
                if error_code(e)[0] == "NoSuchBucket":
                    return []
                raise
            return out

        return sorted(self.call("ListObjectsV2", prefix or "/", once))

    def delete(self, name: str) -> None:
        key, c = self.key(name), self.shared.client
        self.call("DeleteObject", name, lambda: c.delete_object(Bucket=self.bucket, Key=key),
                   ok_codes=("NoSuchKey", "NoSuchBucket"))

    def delete_many(self, names: list[str]) -> None:
        """Delete in batches of 1,000 keys per request (absent names are ignored)."""
        c = self.shared.client
        keys = [self.key(n) for n in names]
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            resp = self.call(
                "DeleteObjects", f"{len(batch)} objects",
                lambda b=batch: c.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in b], "Quiet": True}
                ),
                ok_codes=("NoSuchBucket",),
            )
            errors = [e for e in (resp or {}).get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise S3StorageError(
                    f"{self.url}: deleting {len(errors)} objects failed, first {first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message')}", first.get("Code"),
                )

    def location_exists(self) -> bool:
        c = self.shared.client

        def once() -> bool:
            try:
                r = c.list_objects_v2(Bucket=self.bucket, Prefix=self._root, MaxKeys=1)
            except Exception as e:
                if error_code(e)[0] == "NoSuchBucket":
                    return False
                raise
            return bool(r.get("KeyCount") or r.get("Contents"))

        return self.call("ListObjectsV2", self._root or "/", once)

    def child(self, sub: str) -> "S3Storage":
        sub = sub.strip("/")
        if not sub or ".." in sub.split("/") or "//" in sub:
            raise StorageError(f"refusing unsafe sub-location {sub!r}")
        c = S3Storage.__new__(S3Storage)
        Storage.__init__(c)
        c.bucket, c.shared, c.stats = self.bucket, self.shared, self.stats
        c._place(f"{self._root}{sub}")
        return c

    def place(self) -> tuple[Any, str]:
        return (("s3", self.bucket), "/" + self.prefix)

    def at(self, path: str) -> "S3Storage":
        c = self.child("x")  # shares the client, pool and counters
        c._place(path.strip("/"))
        return c

    def _place(self, prefix: str) -> None:
        """Set the key prefix this storage reads and writes under (its ``url`` follows)."""
        self.prefix = prefix
        self._root = prefix + "/"
        self.url = f"s3://{self.bucket}/{prefix}"

    # --- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Stop the shared thread pool (it restarts if the storage is used again)."""
        self.shared.shutdown()

    def __enter__(self) -> "S3Storage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
