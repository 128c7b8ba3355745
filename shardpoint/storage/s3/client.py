"""What an S3 storage and its children share: options, the boto3 client, the thread pool, the read queue."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..base import MissingDependencyError
from .options import S3Options, S3StorageError
from .readqueue import ReadQueue
from .retry import require_boto3

__all__ = ["Shared"]


class Shared:
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
        self._reads: ReadQueue | None = None
        self.gets = 0

    def count_gets(self, n: int) -> None:
        """Count ``n`` ranged GETs started (for :attr:`S3Storage.get_requests`)."""
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
        """The boto3 client, made on first use and again after ``fork``."""
        with self._lock:
            self._fresh()
            if self._client is None:
                self._client = self._make_client()
            return self._client

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The thread pool for part uploads and ranged GETs (``max_concurrency`` threads)."""
        with self._lock:
            self._fresh()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.max_concurrency, thread_name_prefix="shardpoint-s3")
            return self._pool

    @property
    def reads(self) -> ReadQueue:
        """The queue that merges and serves waiting reads of this storage tree."""
        with self._lock:
            self._fresh()
            if self._reads is None:
                self._reads = ReadQueue(self)
            return self._reads

    def _make_client(self):
        boto3 = require_boto3()
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
        """Stop the thread pool after its work; it is made again on demand."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)
