"""Which S3 failures are worth another try, which mean "absent", and how to read their codes; no I/O."""

from __future__ import annotations

import socket

from ..base import MissingDependencyError

__all__ = ["NOT_FOUND", "THROTTLE_OR_TRANSIENT", "BodyShortError", "require_boto3", "error_code", "is_transient", "is_not_found"]

NOT_FOUND = {"NoSuchKey", "404", "NotFound", "NoSuchBucket"}
THROTTLE_OR_TRANSIENT = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
    "TooManyRequestsException", "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "PriorRequestNotComplete", "OperationAborted",
}


def require_boto3():
    """boto3, or a :class:`MissingDependencyError` saying how to install it.

    Example::

        boto3 = require_boto3()
    """
    try:
        import boto3  # noqa: F401
        import botocore  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"the s3:// backend needs boto3 ({e}); install it with: pip install 'shardpoint[s3]'"
        ) from None
    return boto3


def error_code(e: BaseException) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status of a botocore error; ``(None, None)`` for transport errors.

    Example::

        code, status = error_code(e)  # ("SlowDown", 503)
    """
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        code = (resp.get("Error") or {}).get("Code")
        status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return code, status
    return None, None


def is_transient(e: BaseException) -> bool:
    """Throttling, 5xx, timeouts and broken connections: worth another try."""
    import botocore.exceptions as bx

    code, status = error_code(e)
    if code is not None or status is not None:
        return (status is not None and status >= 500) or status == 429 or code in THROTTLE_OR_TRANSIENT
    transport = (
        bx.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, timeouts
        bx.HTTPClientError,
        bx.ResponseStreamingError,
        bx.IncompleteReadError,
        BodyShortError,
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


class BodyShortError(Exception):
    """A response body ended before its Content-Length (retryable)."""


def is_not_found(e: BaseException) -> bool:
    """Whether ``e`` says the object (or bucket) is absent, so a read raises ``FileNotFoundError``.

    Example::

        if is_not_found(e): raise FileNotFoundError(name)
    """
    code, status = error_code(e)
    return code in NOT_FOUND or (status == 404 and code not in ("NoSuchUpload",))
