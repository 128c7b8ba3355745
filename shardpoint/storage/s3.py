"""Amazon S3 (and S3-compatible) backend on boto3, with parallel multipart writes and ranged reads.

A location is ``s3://bucket/prefix``; names inside it become keys under
``prefix/``. Endpoint, credentials, region, retries and concurrency live in
:class:`S3Options`, never in the path. With no options (or fields left at
``None``) the client resolves everything the way boto3 does: ``AWS_ENDPOINT_URL``
(and ``AWS_ENDPOINT_URL_S3``), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared config and credentials
files, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_MAX_ATTEMPTS`` and
``AWS_RETRY_MODE``, instance and container roles.

The commit rule on object stores: S3 has no atomic rename, so the commit is
the single PUT of the manifest, written after every data object has been
completely uploaded. A multipart upload becomes visible only when it is
completed, so an interrupted save leaves at most invisible parts (aborted on
error) or complete data objects that no manifest references. A checkpoint
without its manifest is invisible to :func:`shardpoint.load`, and the next
successful save at that path deletes the orphans.

Writes: a :class:`~shardpoint.storage.base.Writer` buffers sequential writes
into parts of ``part_size`` bytes and uploads up to ``max_concurrency`` parts
at once from a thread pool shared by the storage instance (memory per writer
is at most ``(max_concurrency + 1) * part_size``). ``close()`` completes the
upload; ``abort()`` aborts it. Files smaller than one part are one PUT.

Reads: ``readinto`` calls wait in one queue per storage tree and are served
by up to ``max_concurrency`` ranged GETs at a time, streamed straight into the
callers' buffers. When a GET slot frees up, the oldest waiting read is taken
together with every other waiting read of the same object that lies within
``read_merge_gap`` bytes of it (the loader asks for the chunks of one data
object in file order, several at once), and that run of bytes is cut into the
fewest equal ranged GETs of at most 9/8 of ``read_part_size``, which run in
parallel. Small neighbours (biases, norms, checksum-block tails) therefore
ride along with a large read instead of costing a request each; bytes in
gaps are read into a small scratch buffer and dropped, so memory stays at
the callers' buffers plus at most 256 KiB per GET. With a slot free a read
is sent at once, except a small one (under 1/8 of ``read_part_size``) of an
object that already has GETs running: it waits for a larger neighbour to
arrive or for those GETs to end (see :class:`_ReadQueue`). A load takes its
reads in file order behind the larger reads in flight, so this costs it
almost nothing. ``read_merge_gap=None`` turns all this off (each read is
split on its own into GETs of at most ``read_part_size``).

Retries: botocore's ``standard`` retry mode (exponential backoff with jitter on
throttling such as ``SlowDown``/503, on 500/502/504 and on connection errors)
retries each request, up to ``max_attempts``. On top of that every whole
operation (one part upload including its body, one ranged GET including
reading its body, a PUT, the completion) is retried up to ``retries`` more
times with full-jitter exponential backoff, which also covers connections
reset while a response body streams, where botocore has already returned.
What still fails raises :class:`S3StorageError`, a
:class:`~shardpoint.errors.StorageError`.

Example::

    from shardpoint.storage import S3Options, S3Storage
    st = S3Storage("s3://my-bucket/runs/a/step_100",
                   S3Options(endpoint_url="http://127.0.0.1:9000", max_concurrency=16))
    sp.save(st, {"model": model})
    sp.load("s3://my-bucket/runs/a/step_100", state)  # options from the AWS environment
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Sequence

from ..errors import StorageError
from .base import MissingDependencyError, Storage, Writer, merged_options

__all__ = ["S3Options", "S3Storage", "S3StorageError"]

log = logging.getLogger("shardpoint.storage.s3")

_MiB = 1 << 20
_MIN_PART = 5 * _MiB  # S3's minimum for every part but the last
_MAX_PART = 5 * 1024 * _MiB
_MAX_PARTS = 10_000
_GROW_EVERY = 1000  # parts; the part size doubles after each such run, so 10,000 parts reach far

_NOT_FOUND = {"NoSuchKey", "404", "NotFound", "NoSuchBucket"}
_THROTTLE_OR_TRANSIENT = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
    "TooManyRequestsException", "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "PriorRequestNotComplete", "OperationAborted",
}


class S3StorageError(StorageError):
    """An S3 request failed after all retries (or could not be retried).

    ``code`` is the S3 error code (``"AccessDenied"``, ``"SlowDown"``, ...) or
    the exception class name for transport errors; ``status`` the HTTP status
    when there was a response.

    Example::

        try:
            sp.save(S3Storage("s3://bucket/ckpt"), state)
        except StorageError as e:  # S3StorageError, or a DistributedError naming it
            log.error("checkpoint not written: %s", e)
    """

    def __init__(self, message: str, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass(frozen=True)
class S3Options:
    """How to reach S3 and how hard to push it. ``None`` means "as boto3 would resolve it".

    - ``endpoint_url``, ``region``, ``profile``, ``access_key_id``,
      ``secret_access_key``, ``session_token``: connection and credentials.
      Left at ``None`` they come from the standard AWS environment and files.
    - ``part_size``: bytes per multipart part (at least 5 MiB). Files up to
      one part are a single PUT.
    - ``read_part_size``: reads larger than this are split into parallel
      ranged GETs of about this size (at most 9/8 of it when merging).
    - ``read_merge_gap``: waiting reads of one object at most this many bytes
      apart are served by the same GETs (the gap is read and dropped);
      ``None`` turns merging off. The default (1 MiB) costs about as much
      transfer time as one more request's first-byte latency on S3.
    - ``max_concurrency``: threads (and in-flight parts or ranges) per storage
      instance, shared by its children.
    - ``max_attempts``: botocore attempts per request (``None``:
      ``AWS_MAX_ATTEMPTS`` or the config file, else 5); ``retry_mode``
      likewise defaults to ``AWS_RETRY_MODE`` or ``"standard"``.
    - ``retries``, ``backoff_base``, ``backoff_max``: extra whole-operation
      attempts by shardpoint, with full-jitter exponential backoff in seconds.
    - ``connect_timeout``, ``read_timeout``: socket timeouts in seconds.
    - ``list_page_size``: keys per ListObjectsV2 page (S3 returns at most 1,000).
    - ``addressing_style``: ``"path"`` or ``"virtual"`` (``None``: botocore's choice).
    - ``checksum_calculation``: botocore's ``request_checksum_calculation``
      (``"when_supported"`` or ``"when_required"``; ``None``: environment or default).
    - ``client_config``: extra keyword arguments for ``botocore.config.Config``.

    Example::

        S3Options(endpoint_url="http://127.0.0.1:9000", access_key_id="k",
                  secret_access_key="s", region="us-east-1", part_size=32 << 20)
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    part_size: int = 16 * _MiB
    read_part_size: int = 16 * _MiB
    read_merge_gap: int | None = 1 * _MiB
    max_concurrency: int = 8
    max_attempts: int | None = None
    retry_mode: str | None = None
    retries: int = 4
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    list_page_size: int = 1000
    addressing_style: str | None = None
    checksum_calculation: str | None = None
    client_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _MIN_PART <= self.part_size <= _MAX_PART:
            raise ValueError(f"S3Options.part_size must be between 5 MiB and 5 GiB, got {self.part_size}")
        if self.read_part_size < 1:
            raise ValueError(f"S3Options.read_part_size must be positive, got {self.read_part_size}")
        if self.read_merge_gap is not None and self.read_merge_gap < 0:
            raise ValueError(f"S3Options.read_merge_gap must be >= 0 or None, got {self.read_merge_gap}")
        if self.max_concurrency < 1:
            raise ValueError(f"S3Options.max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.retries < 0 or (self.max_attempts is not None and self.max_attempts < 1):
            raise ValueError("S3Options.retries must be >= 0 and max_attempts >= 1")

    def __repr__(self) -> str:  # shows what differs from the defaults; never the secrets
        shown = []
        for f in fields(self):
            v = getattr(self, f.name)
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if v != default:
                secret = f.name in ("access_key_id", "secret_access_key", "session_token")
                shown.append(f"{f.name}={'***' if secret else repr(v)}")
        return f"S3Options({', '.join(shown)})"


def _require_boto3():
    try:
        import boto3  # noqa: F401
        import botocore  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"the s3:// backend needs boto3 ({e}); install it with: pip install 'shardpoint[s3]'"
        ) from None
    return boto3


def _error_code(e: BaseException) -> tuple[str | None, int | None]:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        code = (resp.get("Error") or {}).get("Code")
        status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return code, status
    return None, None


def _is_transient(e: BaseException) -> bool:
    """Throttling, 5xx, timeouts and broken connections: worth another try."""
    import botocore.exceptions as bx

    code, status = _error_code(e)
    if code is not None or status is not None:
        return (status is not None and status >= 500) or status == 429 or code in _THROTTLE_OR_TRANSIENT
    transport = (
        bx.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, timeouts
        bx.HTTPClientError,
        bx.ResponseStreamingError,
        bx.IncompleteReadError,
        _BodyShortError,
        ConnectionError,  # builtin: resets, broken pipes
        TimeoutError,
        socket.timeout,
    )
    if isinstance(e, transport):
        return True
    try:
        import urllib3.exceptions as ux

        return isinstance(e, (ux.ProtocolError, ux.ReadTimeoutError, ux.NewConnectionError))
    except ImportError:  # pragma: no cover
        return False


class _BodyShortError(Exception):
    """A response body ended before its Content-Length (retryable)."""


def _is_not_found(e: BaseException) -> bool:
    code, status = _error_code(e)
    return code in _NOT_FOUND or (status == 404 and code not in ("NoSuchUpload",))


_SCRATCH = 256 << 10  # bytes of a gap read at a time (the only memory merging adds)


def merge_runs(
    spans: Sequence[tuple[int, int]], gap: int, limit: int | None = None
) -> list[tuple[int, int, list[int]]]:
    """Group byte spans ``[start, end)`` of one object into runs; pure.

    Spans (in any order, possibly overlapping) join a run when they start at
    most ``gap`` bytes after the end of what the run covers so far and, with
    a ``limit`` (the largest GET), when joining needs no more GETs than
    keeping them apart (two limit-sized reads with a gap between them stay
    two runs). Returns ``(start, end, indices into spans)`` per run, in file
    order.

    Example::

        merge_runs([(100, 200), (0, 90), (500, 600)], gap=16)
        # [(0, 200, [1, 0]), (500, 600, [2])]
    """

    def gets(n: int) -> int:
        return 1 if limit is None else max(1, -(-n // limit))

    order = sorted(range(len(spans)), key=lambda i: spans[i])
    runs: list[tuple[int, int, list[int]]] = []
    for i in order:
        a, b = spans[i]
        if runs and a - runs[-1][1] <= gap:
            s0, e0, members = runs[-1]
            e1 = max(e0, b)
            if gets(e1 - s0) <= gets(e0 - s0) + gets(b - a):
                members.append(i)
                runs[-1] = (s0, e1, members)
                continue
        runs.append((a, b, [i]))
    return runs


def get_limit(part: int) -> int:
    """The largest ranged GET for ``read_part_size`` ``part``: 9/8 of it, so small neighbours ride along."""
    return part + part // 8


def split_run(start: int, end: int, part: int) -> list[tuple[int, int]]:
    """Cut ``[start, end)`` into the fewest equal ranges of at most ``part + part // 8`` bytes; pure.

    The 1/8 allowance lets a small neighbour ride along with a part-sized
    read (a 32 MiB weight and its bias: 2 GETs at 16 MiB parts, not 3).

    Example::

        split_run(0, 100, 40)   # [(0, 33), (33, 66), (66, 100)]
    """
    n = max(1, -(-(end - start) // get_limit(part)))
    cuts = [start + (end - start) * i // n for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


def run_gets(start: int, end: int, part: int, wants: Sequence[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """The GETs for a merged run: :func:`split_run`'s pieces with the wants each feeds; pure.

    A piece that lies wholly in a gap between wants feeds nothing and is
    dropped (equal cuts can land one there). Returns ``(lo, hi, indices into
    wants)`` per GET.

    Example::

        run_gets(0, 232, 69, [(0, 93), (174, 175), (231, 232)])
        # [(0, 58, [0]), (58, 116, [0]), (174, 232, [1, 2])]
    """
    out = []
    for lo, hi in split_run(start, end, part):
        fed = [i for i, (a, b) in enumerate(wants) if a < hi and b > lo]
        if fed:
            out.append((lo, hi, fed))
    return out


def scatter_plan(lo: int, hi: int, wants: Sequence[tuple[int, int, memoryview]]) -> list[tuple[int, list[memoryview]]]:
    """How the body of a GET of ``[lo, hi)`` lands in the waiting buffers; pure.

    ``wants`` are ``(start, end, buffer)`` with ``len(buffer) == end - start``.
    Returns consecutive ``(length, views)`` pieces covering ``[lo, hi)``:
    the slices of every buffer that wants those bytes, or no views for a gap.

    Example::

        a, b = memoryview(bytearray(4)), memoryview(bytearray(2))
        scatter_plan(0, 8, [(0, 4, a), (6, 8, b)])   # [(4, [a]), (2, []), (2, [b])]
    """
    points = {lo, hi}
    for s, e, _ in wants:
        points.update(p for p in (s, e) if lo < p < hi)
    cuts = sorted(points)
    out = []
    for p, q in zip(cuts, cuts[1:]):
        views = [mv[p - s : q - s] for s, e, mv in wants if s <= p and q <= e]
        out.append((q - p, views))
    return out


class _Want:
    """One waiting ``readinto``: a byte range of one object and the buffer it fills."""

    __slots__ = ("storage", "key", "name", "start", "end", "mv", "left", "avail", "error", "done")

    def __init__(self, storage: "S3Storage", key: str, name: str, start: int, mv: memoryview):
        self.storage, self.key, self.name = storage, key, name
        self.start, self.end, self.mv = start, start + len(mv), mv
        self.left = 0  # GETs still running for it
        self.avail = len(mv)  # bytes the object holds from start (less when a GET found its end)
        self.error: BaseException | None = None
        self.done = threading.Event()


class _ReadQueue:
    """Waiting reads of one storage tree, served by at most ``max_concurrency`` GETs at a time.

    When a GET slot is free, the oldest waiting read is taken with every
    waiting read of the same object within ``read_merge_gap`` of it, and the
    run is cut by :func:`split_run`. Reads wait only for a free slot, with
    one exception: a small read (under 1/8 of ``read_part_size``) of an
    object that already has GETs running does not start a GET of its own
    until a larger read of that object arrives (it joins that read's run
    when close) or the object's running GETs have all finished, so that it
    rides along with a neighbour instead of costing a request. A load
    consumes its reads in file order, behind the larger reads in flight, so
    this rarely delays what it waits for.
    """

    def __init__(self, shared: "_Shared"):
        self._shared = shared
        self._lock = threading.Lock()
        self._pending: list[_Want] = []
        self._in_flight = 0
        self._busy: dict[str, int] = {}  # object key -> GETs running

    def read(self, storage: "S3Storage", key: str, name: str, start: int, mv: memoryview) -> int:
        """Fill ``mv`` from ``start`` of ``key``; return how many bytes the object had there."""
        w = _Want(storage, key, name, start, mv)
        with self._lock:
            self._pending.append(w)
            jobs = self._take()
        self._submit(jobs)
        w.done.wait()
        if w.error is not None:
            raise w.error
        return min(len(mv), w.avail)

    def _take(self) -> list[tuple[int, int, list[_Want]]]:
        """Under the lock: the GETs to start now, each with the reads it feeds."""
        o = self._shared.options
        jobs = []
        small = o.read_part_size // 8
        while self._in_flight < o.max_concurrency:
            # The oldest read that may start a run. Held ones still join the run of a neighbour.
            head = next((w for w in self._pending if w.end - w.start >= small or not self._busy.get(w.key)), None)
            if head is None:
                break
            same = [w for w in self._pending if w.key == head.key]
            spans = [(w.start, w.end) for w in same]
            for start, end, idx in merge_runs(spans, o.read_merge_gap or 0, get_limit(o.read_part_size)):
                members = [same[i] for i in idx]
                if head in members:
                    break
            taken = set(map(id, members))
            self._pending = [w for w in self._pending if id(w) not in taken]
            gets = run_gets(start, end, o.read_part_size, [(w.start, w.end) for w in members])
            for lo, hi, idx in gets:
                fed = [members[i] for i in idx]
                for w in fed:
                    w.left += 1
                jobs.append((lo, hi, fed))
            self._in_flight += len(gets)
            self._busy[head.key] = self._busy.get(head.key, 0) + len(gets)
        return jobs

    def _submit(self, jobs: list[tuple[int, int, list[_Want]]]) -> None:
        for job in jobs:
            try:
                self._shared.pool.submit(self._run, job)
            except BaseException as e:  # noqa: BLE001 - a shut-down pool: fail the reads, never hang them
                self._finished(job, e, 0)

    def _run(self, job: tuple[int, int, list[_Want]]) -> None:
        lo, hi, fed = job
        head = fed[0]
        try:
            got = head.storage._get_scatter(head.key, head.name, lo, hi, [(w.start, w.end, w.mv) for w in fed])
        except BaseException as e:  # noqa: BLE001 - handed to every read this GET feeds
            self._finished(job, e, 0)
        else:
            self._finished(job, None, got)

    def _finished(self, job: tuple[int, int, list[_Want]], error: BaseException | None, got: int) -> None:
        lo, hi, fed = job
        done = []
        with self._lock:
            self._in_flight -= 1
            key = fed[0].key
            self._busy[key] -= 1
            if not self._busy[key]:
                del self._busy[key]
            self._shared.count_gets(1)
            for w in fed:
                if error is not None:
                    w.error = w.error or error
                elif got < hi - lo:  # the object ends at lo + got
                    w.avail = min(w.avail, max(0, lo + got - w.start))
                w.left -= 1
                if w.left == 0:
                    done.append(w)
            jobs = self._take()
        for w in done:
            w.done.set()
        self._submit(jobs)


class _Shared:
    """What a storage and its children share: options, client, thread pool, counters.

    Created lazily and recreated after ``fork`` (threads and sockets do not
    survive it), so a storage built in a parent process works in its children.
    """

    def __init__(self, options: S3Options):
        self.options = options
        self._lock = threading.Lock()
        self._pid = -1
        self._client = None
        self._pool: ThreadPoolExecutor | None = None
        self._reads: _ReadQueue | None = None
        self.gets = 0

    def count_gets(self, n: int) -> None:
        with self._lock:
            self.gets += n

    def __getstate__(self) -> dict:  # picklable: the client and threads are rebuilt on use
        return {"options": self.options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["options"])

    def _fresh(self) -> None:
        if self._pid != os.getpid():
            self._client, self._pool, self._reads, self._pid = None, None, None, os.getpid()

    @property
    def client(self):
        with self._lock:
            self._fresh()
            if self._client is None:
                self._client = self._make_client()
            return self._client

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            self._fresh()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.max_concurrency, thread_name_prefix="shardpoint-s3")
            return self._pool

    @property
    def reads(self) -> _ReadQueue:
        with self._lock:
            self._fresh()
            if self._reads is None:
                self._reads = _ReadQueue(self)
            return self._reads

    def _make_client(self):
        boto3 = _require_boto3()
        import botocore.session
        from botocore.config import Config

        o = self.options
        try:
            bc = botocore.session.Session(profile=o.profile)
            scoped = bc.get_scoped_config()
            mode = o.retry_mode or os.environ.get("AWS_RETRY_MODE") or scoped.get("retry_mode") or "standard"
            attempts = o.max_attempts or bc.get_config_variable("max_attempts") or 5
            cfg: dict[str, Any] = {
                "retries": {"mode": mode, "total_max_attempts": int(attempts)},
                "max_pool_connections": o.max_concurrency + 4,
                "connect_timeout": o.connect_timeout,
                "read_timeout": o.read_timeout,
                "user_agent_extra": "shardpoint",
            }
            if o.addressing_style:
                cfg["s3"] = {"addressing_style": o.addressing_style}
            if o.checksum_calculation:
                cfg["request_checksum_calculation"] = o.checksum_calculation
            cfg.update(o.client_config)
            session = boto3.session.Session(botocore_session=bc, region_name=o.region)
            return session.client(
                "s3",
                endpoint_url=o.endpoint_url,
                aws_access_key_id=o.access_key_id,
                aws_secret_access_key=o.secret_access_key,
                aws_session_token=o.session_token,
                config=Config(**cfg),
            )
        except MissingDependencyError:
            raise
        except Exception as e:  # noqa: BLE001 - profile not found, bad config, ...
            raise S3StorageError(f"cannot create an S3 client ({type(e).__name__}: {e}); check {o!r}") from e

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)


class _S3Writer(Writer):
    """Buffers sequential writes into parts; uploads them in parallel; completes on close."""

    def __init__(self, storage: "S3Storage", name: str):
        self._st = storage
        self._name = name
        self._key = storage._key(name)
        o = storage.options
        self._part_size = o.part_size
        self._slots = threading.Semaphore(o.max_concurrency)
        self._free: list[bytearray] = []
        self._free_lock = threading.Lock()
        self._buf: bytearray | None = None
        self._fill = 0
        self._upload_id: str | None = None
        self._next_part = 1
        self._futures: dict[int, Future] = {}
        self._total = 0
        self._state = "open"  # open -> closed | aborted
        self._checksum = None  # "CRC32" when botocore computes flexible checksums

    # --- buffers --------------------------------------------------------------
    def _take(self) -> bytearray:
        self._slots.acquire()
        with self._free_lock:
            while self._free:
                b = self._free.pop()
                if len(b) == self._part_size:
                    return b
        return bytearray(self._part_size)

    def _give(self, b: bytearray | None) -> None:
        if b is not None and len(b) == self._part_size:
            with self._free_lock:
                self._free.append(b)
        self._slots.release()

    # --- writing ----------------------------------------------------------------
    def write(self, data) -> None:
        if self._state != "open":
            raise StorageError(f"{self._st.url}: write to {self._name} after close or abort")
        self._raise_failed_part()
        mv = memoryview(data).cast("B")
        n, pos = len(mv), 0
        while pos < n:
            if self._buf is None:
                self._buf, self._fill = self._take(), 0
            k = min(len(self._buf) - self._fill, n - pos)
            self._buf[self._fill : self._fill + k] = mv[pos : pos + k]
            self._fill += k
            pos += k
            if self._fill == len(self._buf):
                self._submit(final=False)
        self._total += n
        self._st.stats.add_write(n)

    def _start_upload(self) -> None:
        c = self._st._shared.client
        if getattr(c.meta.config, "request_checksum_calculation", "when_required") == "when_supported":
            self._checksum = "CRC32"
        kw = {"ChecksumAlgorithm": self._checksum} if self._checksum else {}
        resp = self._st._call(
            "CreateMultipartUpload", self._name,
            lambda: c.create_multipart_upload(Bucket=self._st.bucket, Key=self._key, **kw),
        )
        self._upload_id = resp["UploadId"]

    def _submit(self, final: bool) -> None:
        buf, fill = self._buf, self._fill
        self._buf, self._fill = None, 0
        assert buf is not None
        if fill < len(buf):  # the last part: trim in place (no copy)
            del buf[fill:]
        if self._upload_id is None:
            try:
                self._start_upload()
            except BaseException:
                self._give(buf)
                raise
        pn = self._next_part
        if pn > _MAX_PARTS:
            self._give(buf)
            raise S3StorageError(f"{self._st.url}: {self._name} needs more than {_MAX_PARTS} parts; raise part_size")
        self._next_part += 1
        fut = self._st._shared.pool.submit(self._upload_part, pn, buf)
        fut.add_done_callback(lambda _f, b=buf: self._give(b))
        self._futures[pn] = fut
        if not final and pn % _GROW_EVERY == 0:
            self._part_size = min(self._part_size * 2, _MAX_PART)

    def _upload_part(self, pn: int, buf: bytearray) -> dict:
        c = self._st._shared.client
        kw = {"ChecksumAlgorithm": self._checksum} if self._checksum else {}
        resp = self._st._call(
            "UploadPart", self._name,
            lambda: c.upload_part(
                Bucket=self._st.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=pn, Body=buf, **kw
            ),
        )
        part = {"PartNumber": pn, "ETag": resp["ETag"]}
        if self._checksum and resp.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = resp["ChecksumCRC32"]
        return part

    def _raise_failed_part(self) -> None:
        for fut in self._futures.values():
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    def close(self) -> None:
        if self._state == "closed":
            return
        if self._state == "aborted":
            raise StorageError(f"{self._st.url}: close of {self._name} after abort")
        try:
            self._close()
        except BaseException:
            self.abort()  # never leave a half-made upload behind
            raise

    def _close(self) -> None:
        st = self._st
        c = st._shared.client
        if self._upload_id is None:
            # Small file: one PUT.
            body = self._buf if self._buf is not None else bytearray()
            if self._buf is not None:
                del body[self._fill :]
            try:
                st._call("PutObject", self._name, lambda: c.put_object(Bucket=st.bucket, Key=self._key, Body=body))
            finally:
                if self._buf is not None:
                    self._buf = None
                    self._slots.release()
            self._state = "closed"
            return
        if self._buf is not None and self._fill:
            self._submit(final=True)
        elif self._buf is not None:
            self._give(self._buf)
            self._buf = None
        wait(list(self._futures.values()))
        self._raise_failed_part()
        parts = [self._futures[pn].result() for pn in sorted(self._futures)]
        upload_id = self._upload_id

        def complete():
            try:
                return c.complete_multipart_upload(
                    Bucket=st.bucket, Key=self._key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
            except Exception as e:
                # A retried completion whose first try succeeded: the upload is gone, the object is there.
                if _error_code(e)[0] == "NoSuchUpload" and self._completed_already():
                    return {}
                raise

        st._call("CompleteMultipartUpload", self._name, complete)
        self._state = "closed"
        self._futures.clear()
        self._free.clear()

    def _completed_already(self) -> bool:
        try:
            head = self._st._shared.client.head_object(Bucket=self._st.bucket, Key=self._key)
        except Exception:  # noqa: BLE001
            return False
        return head.get("ContentLength") == self._total

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            for fut in self._futures.values():
                fut.cancel()
            wait(list(self._futures.values()))
            if self._buf is not None:
                self._buf = None
                self._slots.release()
            if self._upload_id is not None:
                st, uid = self._st, self._upload_id
                c = st._shared.client
                st._call(
                    "AbortMultipartUpload", self._name,
                    lambda: c.abort_multipart_upload(Bucket=st.bucket, Key=self._key, UploadId=uid),
                    ok_codes=("NoSuchUpload",),
                )
        except Exception as e:  # noqa: BLE001 - abort never raises
            log.warning("%s: aborting the upload of %s failed (%s); S3 lifecycle rules can clean it up",
                        self._st.url, self._name, e)
        finally:
            self._futures.clear()
            self._free.clear()


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
        _require_boto3()
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
        self._shared = _Shared(opts)

    @property
    def options(self) -> S3Options:
        return self._shared.options

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
        return self._shared.client

    # --- helpers --------------------------------------------------------------
    def _key(self, name: str) -> str:
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise StorageError(f"{self.url}: refusing unsafe name {name!r}")
        return self._root + name

    def _call(self, op: str, name: str, fn: Callable[[], Any], *, reading: bool = False, ok_codes=()) -> Any:
        """Run ``fn`` with whole-operation retries; map failures to typed errors."""
        o = self.options
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001
                if isinstance(e, StorageError):
                    raise
                code, status = _error_code(e)
                if code in ok_codes:
                    return None
                if reading and _is_not_found(e):
                    raise FileNotFoundError(f"{self.url}: {name} does not exist ({code})") from None
                if attempt < o.retries and _is_transient(e):
                    delay = random.uniform(0, min(o.backoff_max, o.backoff_base * (2**attempt)))
                    attempt += 1
                    log.warning("%s: %s of %s failed (%s: %s); retry %d/%d in %.2fs",
                                self.url, op, name, type(e).__name__, e, attempt, o.retries, delay)
                    time.sleep(delay)
                    continue
                raise self._wrap(op, name, e, attempt) from e

    def _wrap(self, op: str, name: str, e: BaseException, attempt: int) -> S3StorageError:
        code, status = _error_code(e)
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
        return self._get_scatter(key, name, start, start + len(mv), [(start, start + len(mv), mv)])

    def _get_scatter(self, key: str, name: str, lo: int, hi: int, wants: Sequence[tuple[int, int, memoryview]]) -> int:
        """One ranged GET of ``[lo, hi)`` streamed into the ``(start, end, buffer)`` wants it covers.

        Returns the bytes the object had in the range (less at its end).
        Bytes no want covers go through a small scratch buffer; a retry
        streams the whole range again (it rewrites the same bytes).
        """
        c = self._shared.client
        pieces = scatter_plan(lo, hi, wants)

        def once() -> int:
            try:
                r = c.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")
            except Exception as e:
                if _error_code(e)[0] == "InvalidRange":  # starts at or past the end
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
                                raise _BodyShortError(f"body ended after {got + k} of {expect} bytes")
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
                                raise _BodyShortError(f"body ended after {got + k} of {expect} bytes")
                            k += n
                    got += take
            finally:
                body.close()
            return got

        return self._call("GetObject", name, once, reading=True)

    # --- primitives -------------------------------------------------------------
    def open_writer(self, name: str) -> Writer:
        self._key(name)
        return _S3Writer(self, name)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        want = len(mv)
        key = self._key(name)
        if want == 0:
            self.size(name)  # absent names still raise FileNotFoundError
            self.stats.add_read(0)
            return
        if self.options.read_merge_gap is not None:
            got = self._shared.reads.read(self, key, name, offset, mv)
        else:
            got = self._read_alone(key, name, offset, mv)
        if got < want:
            raise self._short(name, offset, want, got)
        self.stats.add_read(want)

    def _read_alone(self, key: str, name: str, offset: int, mv: memoryview) -> int:
        """One read on its own (merging off): parallel GETs of at most ``read_part_size``."""
        want, step = len(mv), self.options.read_part_size
        if want <= step:
            self._shared.count_gets(1)
            return self._get_range(key, name, offset, mv)
        pool = self._shared.pool
        spans = [(lo, min(lo + step, want)) for lo in range(0, want, step)]
        self._shared.count_gets(len(spans))
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
        return self._shared.gets

    def put_atomic(self, name: str, data: bytes) -> None:
        key, c = self._key(name), self._shared.client
        body = bytes(data)
        self._call("PutObject", name, lambda: c.put_object(Bucket=self.bucket, Key=key, Body=body))
        self.stats.add_write(len(body))

    def get(self, name: str) -> bytes:
        key, c = self._key(name), self._shared.client

        def once() -> bytes:
            body = c.get_object(Bucket=self.bucket, Key=key)["Body"]
            try:
                return body.read()
            finally:
                body.close()

        data = self._call("GetObject", name, once, reading=True)
        self.stats.add_read(len(data))
        return data

    def get_limited(self, name: str, limit: int) -> bytes:
        """``get`` of a metadata object: its size (HEAD) checked first, then one GET of at most ``limit + 1`` bytes."""
        n = self.size(name)
        if n > limit:
            raise self._too_large(name, n, limit)
        if n == 0:
            return self.get(name)
        key, c = self._key(name), self._shared.client

        def once() -> bytes:
            body = c.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{limit}")["Body"]
            try:
                return body.read(limit + 1)
            finally:
                body.close()

        data = self._call("GetObject", name, once, reading=True)
        if len(data) > limit:
            raise self._too_large(name, len(data), limit)
        self.stats.add_read(len(data))
        return data

    def size(self, name: str) -> int:
        key, c = self._key(name), self._shared.client
        head = self._call("HeadObject", name, lambda: c.head_object(Bucket=self.bucket, Key=key), reading=True)
        return int(head["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        c = self._shared.client
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
                if _error_code(e)[0] == "NoSuchBucket":
                    return []
                raise
            return out

        return sorted(self._call("ListObjectsV2", prefix or "/", once))

    def delete(self, name: str) -> None:
        key, c = self._key(name), self._shared.client
        self._call("DeleteObject", name, lambda: c.delete_object(Bucket=self.bucket, Key=key),
                   ok_codes=("NoSuchKey", "NoSuchBucket"))

    def delete_many(self, names: list[str]) -> None:
        """Delete in batches of 1,000 keys per request (absent names are ignored)."""
        c = self._shared.client
        keys = [self._key(n) for n in names]
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            resp = self._call(
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
        c = self._shared.client

        def once() -> bool:
            try:
                r = c.list_objects_v2(Bucket=self.bucket, Prefix=self._root, MaxKeys=1)
            except Exception as e:
                if _error_code(e)[0] == "NoSuchBucket":
                    return False
                raise
            return bool(r.get("KeyCount") or r.get("Contents"))

        return self._call("ListObjectsV2", self._root or "/", once)

    def child(self, sub: str) -> "S3Storage":
        sub = sub.strip("/")
        if not sub or ".." in sub.split("/") or "//" in sub:
            raise StorageError(f"refusing unsafe sub-location {sub!r}")
        c = S3Storage.__new__(S3Storage)
        Storage.__init__(c)
        c.bucket, c._shared, c.stats = self.bucket, self._shared, self.stats
        c.prefix = f"{self._root}{sub}"
        c._root = c.prefix + "/"
        c.url = f"s3://{self.bucket}/{c.prefix}"
        return c

    # --- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Stop the shared thread pool (it restarts if the storage is used again)."""
        self._shared.shutdown()

    def __enter__(self) -> "S3Storage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
