"""S3 error translation: the tables and the one function that turn botocore's exceptions into
objckpt errors.

A server answer is looked up by its error code (:data:`S3_ERROR_CODES`), then its HTTP status
(:data:`S3_ERROR_STATUSES`); exceptions that are not answers (credentials, TLS, connections) by
:data:`S3_CLIENT_ERRORS`. :func:`map_s3_error` applies them; ``S3Store._mapped`` (in
``_s3_client.py``) applies it around every SDK call. Kept apart from the store so the whole
mapping reads in one place; ``objckpt.store.s3`` re-exports the public names.
"""

from __future__ import annotations

import botocore.exceptions as bexc
import urllib3

from ..errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientError,
)
from .base import PutMode

#: error codes that a retry can fix (throttling, server-side trouble)
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "InternalServerError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "OperationAborted",
        "500",
        "502",
        "503",
        "504",
        "429",
    }
)
PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidSecurity",
        "UnauthorizedAccess",
        "403",
        "401",
    }
)
#: the server refused the bytes because a checksum did not match what it received
CHECKSUM_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum"})
CONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})
#: codes that mean the object is absent (during an update: the expected version is gone)
_ABSENT_CODES = frozenset({"NoSuchKey", "404", "NotFound"})

_RETRYABLE = "server error, retryable"
_DENIED = "access denied by the server (check credentials and the bucket policy)"
_CHECKSUM = "server rejected the data: checksum mismatch; the bytes sent do not match their CRC32C"
_NO_SUCH_OBJECT = "no such object"
_NOT_IMPLEMENTED = "the server does not implement this request"

#: THE table: S3 error code -> (objckpt error class, what it means). ``{bucket}`` is filled in.
S3_ERROR_CODES: dict[str, tuple[type[Exception], str]] = {
    **dict.fromkeys(TRANSIENT_CODES, (TransientError, _RETRYABLE)),
    **dict.fromkeys(PERMISSION_CODES, (PermissionDeniedError, _DENIED)),
    **dict.fromkeys(CHECKSUM_CODES, (ChecksumMismatchError, _CHECKSUM)),
    **dict.fromkeys(_ABSENT_CODES, (NotFoundError, _NO_SUCH_OBJECT)),
    "NoSuchBucket": (BucketNotFoundError, "bucket {bucket!r} does not exist"),
    "NoSuchUpload": (NotFoundError, "multipart upload no longer exists (aborted, completed or expired)"),
    "NotImplemented": (NotSupportedError, _NOT_IMPLEMENTED),
    "501": (NotSupportedError, _NOT_IMPLEMENTED),
    "EntityTooSmall": (StoreError, "a multipart part is below S3's 5 MiB minimum (raise part_size)"),
    "InvalidRange": (StoreError, "byte range outside the object"),
}
#: for codes the table does not know, the HTTP status decides
S3_ERROR_STATUSES: dict[int, tuple[type[Exception], str]] = {
    401: (PermissionDeniedError, _DENIED),
    403: (PermissionDeniedError, _DENIED),
    404: (NotFoundError, _NO_SUCH_OBJECT),
    429: (TransientError, _RETRYABLE),
    501: (NotSupportedError, _NOT_IMPLEMENTED),
}

_CONNECTION_ERRORS = (
    bexc.ConnectTimeoutError,
    bexc.ReadTimeoutError,
    bexc.EndpointConnectionError,
    bexc.ConnectionClosedError,
    bexc.ResponseStreamingError,
    bexc.IncompleteReadError,
    bexc.ProxyConnectionError,
    bexc.HTTPClientError,  # base of the urllib3-level failures botocore wraps
    bexc.ConnectionError,
    ConnectionError,  # raw socket errors that escape urllib3
    TimeoutError,
    # A response cut short (ProtocolError, IncompleteRead) escapes botocore as urllib3's own
    # exception when the body is read outside botocore's parser: a retry heals it.
    urllib3.exceptions.HTTPError,
)
_CREDENTIAL_ERRORS = (
    bexc.NoCredentialsError,
    bexc.PartialCredentialsError,
    bexc.CredentialRetrievalError,
    bexc.NoAuthTokenError,
    bexc.TokenRetrievalError,
    bexc.UnknownCredentialError,
)
#: the table for exceptions that are not server answers, checked in order (first match wins)
S3_CLIENT_ERRORS: tuple[tuple[tuple[type[BaseException], ...], type[Exception], str], ...] = (
    (_CREDENTIAL_ERRORS, PermissionDeniedError, "no usable AWS credentials"),
    ((bexc.SSLError,), StoreError, "TLS error talking to the endpoint"),  # certificates do not heal
    (_CONNECTION_ERRORS, TransientError, "connection problem"),
    ((bexc.ParamValidationError, bexc.NoRegionError), ConfigError, "invalid S3 request"),
    ((bexc.BotoCoreError,), StoreError, "S3 client error"),
)
#: everything the SDK raises: what the one translation point catches (other errors are bugs
#: and propagate unchanged)
_SDK_ERRORS: tuple[type[BaseException], ...] = (
    bexc.BotoCoreError,
    bexc.ClientError,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    TimeoutError,
)


def _client_error_parts(exc: bexc.ClientError) -> tuple[str, int, str]:
    response = exc.response or {}
    error = response.get("Error", {}) or {}
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code = str(error.get("Code") or status or "Unknown")
    # Only the server's Message: the rest of an S3 error body can echo the access key id or the
    # string-to-sign, which do not belong in logs.
    message = str(error.get("Message") or "").strip()
    return code, status, message


def _make(cls: type[Exception], message: str, where: dict[str, str]) -> Exception:
    if issubclass(cls, StoreError):
        return cls(message, **where)
    if issubclass(cls, ChecksumMismatchError):  # an IntegrityError: no operation field
        return cls(message, key=where["key"], location=where["location"])
    return cls(f"{message} [{where['location'].rstrip('/')}/{where['key']}]")  # ConfigError


def map_s3_error(
    exc: BaseException,
    *,
    operation: str,
    key: str,
    location: str,
    bucket: str,
    mode: PutMode | None = None,
) -> BaseException:
    """Translate one SDK exception into the objckpt error a caller can act on.

    A server answer is looked up by its error code in :data:`S3_ERROR_CODES`, then by its HTTP
    status in :data:`S3_ERROR_STATUSES` (any other 5xx: :class:`TransientError`; any other
    status: :class:`StoreError`, permanent). Before the tables, two rules that depend on the
    write: a 412 / 409 ConditionalRequestConflict is :class:`AlreadyExistsError` (CREATE) or
    :class:`PreconditionFailedError` (update), and a missing key during an update (S3 answers
    ``If-Match`` on an absent key with 404) is :class:`PreconditionFailedError`. A 400 whose
    message speaks of a checksum (e.g. ``InvalidRequest`` for a CRC32C) is
    :class:`ChecksumMismatchError`, like ``BadDigest``. Exceptions that are not answers go
    through :data:`S3_CLIENT_ERRORS` (credentials, TLS, connections).

    Returns the new exception (the caller raises it ``from exc`` so ``__cause__`` is kept), or
    ``exc`` itself when it is not an SDK error. Messages carry the code, the status and the
    server's message, never credentials.
    """
    where = {"key": key, "location": location, "operation": operation}
    if isinstance(exc, (StoreError, ChecksumMismatchError, ConfigError)):
        return exc
    if isinstance(exc, bexc.ClientError):
        code, status, message = _client_error_parts(exc)
        detail = f"{code} (HTTP {status})" + (f": {message}" if message else "")
        if code in CONDITION_CODES or status == 412:
            if mode is not None and mode.kind == "update":
                return PreconditionFailedError(f"version changed, expected {mode.version}; {detail}", **where)
            if mode is not None and mode.kind == "create":
                return AlreadyExistsError(f"object already exists; {detail}", **where)
            return StoreError(f"precondition failed; {detail}", **where)
        row = S3_ERROR_CODES.get(code) or S3_ERROR_STATUSES.get(status)
        if row is None and status == 400 and ("checksum" in message.lower() or "crc32c" in message.lower()):
            row = (ChecksumMismatchError, _CHECKSUM)
        if row is None and status >= 500:
            row = (TransientError, _RETRYABLE)
        cls, meaning = row or (StoreError, "request rejected")
        if cls is NotFoundError and mode is not None and mode.kind == "update" and code != "NoSuchUpload":
            return PreconditionFailedError(
                f"object is absent, expected version {mode.version}; {detail}", **where
            )
        return _make(cls, f"{meaning.format(bucket=bucket)}; {detail}", where)
    for types, cls, meaning in S3_CLIENT_ERRORS:
        if isinstance(exc, types):
            # credential errors: only the type (their text can name the profile's key source)
            shown = type(exc).__name__ if cls is PermissionDeniedError else f"{type(exc).__name__}: {exc}"
            return _make(cls, f"{meaning}: {shown}", where)
    return exc


__all__ = [
    "CHECKSUM_CODES",
    "CONDITION_CODES",
    "PERMISSION_CODES",
    "S3_CLIENT_ERRORS",
    "S3_ERROR_CODES",
    "S3_ERROR_STATUSES",
    "TRANSIENT_CODES",
    "map_s3_error",
]
