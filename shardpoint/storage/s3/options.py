"""What configures the S3 backend: :class:`S3Options`, its size limits, and :class:`S3StorageError`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ...errors import StorageError

__all__ = ["S3Options", "S3StorageError", "MiB", "MIN_PART", "MAX_PART", "MAX_PARTS", "GROW_EVERY"]

MiB = 1 << 20  # one mebibyte
MIN_PART = 5 * MiB  # S3's minimum for every part but the last
MAX_PART = 5 * 1024 * MiB
MAX_PARTS = 10_000
GROW_EVERY = 1000  # parts; the part size doubles after each such run, so 10,000 parts reach far


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
    part_size: int = 16 * MiB
    read_part_size: int = 16 * MiB
    read_merge_gap: int | None = 1 * MiB
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
        if not MIN_PART <= self.part_size <= MAX_PART:
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
