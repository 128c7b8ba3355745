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

Modules: :mod:`.options` (``S3Options``, size limits, ``S3StorageError``),
:mod:`.retry` (which failures are transient or mean "absent"),
:mod:`.planner` (the pure ranged-read planner), :mod:`.readqueue` (waiting
reads served by merged GETs), :mod:`.client` (what a storage tree shares),
:mod:`.writer` (multipart uploads) and :mod:`.storage` (``S3Storage``).
"""

from __future__ import annotations

from .options import S3Options, S3StorageError
from .planner import get_limit, merge_runs, run_gets, scatter_plan, split_run
from .storage import S3Storage

__all__ = ["S3Options", "S3Storage", "S3StorageError", "merge_runs", "get_limit", "split_run", "run_gets", "scatter_plan"]
