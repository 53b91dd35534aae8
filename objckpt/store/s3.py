"""``s3://bucket/prefix``: Amazon S3 and S3-compatible servers (LocalStack, moto, MinIO...).

:class:`S3Store` addresses a bucket; ``open_store`` puts the run root's prefix on it with a
:class:`~objckpt.store.wrappers.PrefixStore`. Everything objckpt needs maps onto single S3
requests, so each guarantee is the server's own:

* create-if-absent is ``If-None-Match: *`` on PutObject and on CompleteMultipartUpload;
  compare-and-swap is ``If-Match: <etag>`` on PutObject (and CompleteMultipartUpload); the
  version token is the ETag. There is never a check-then-write on the client.
* every PutObject / UploadPart carries ``x-amz-checksum-crc32c`` computed by the base class, so
  the server rejects corrupted bytes (:class:`ChecksumMismatchError`); multipart uploads are
  created with ``ChecksumType=FULL_OBJECT`` (by default) and completed with the whole object's
  CRC32C, so the server checks the assembled object too and ``head()`` reports the full-object
  CRC32C. A composite (``...-N``) checksum is never reported as a CRC32C.
* botocore's own retries are off (tenacity in :class:`~objckpt._retry.RetryPolicy` is the one
  retry layer) and its automatic extra checksums are limited to requests that require them,
  so S3-compatible servers that do not know the newer checksum headers keep working.

SDK exceptions are translated at this edge, by one table (:data:`S3_ERROR_CODES`, then the HTTP
status) and one function (:func:`map_s3_error`), applied by one context manager around every
SDK call; nothing above this module sees botocore.

Options: :attr:`S3Store.OPTIONS` (``objckpt.store.options_for("s3")`` lists them with the common
ones). The credentials (``access_key_id``, ``secret_access_key``, ``session_token``) are meant for
local test servers (prefer the environment, a profile or an instance role) and are never shown
in messages or ``repr``.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import io
import itertools
import re
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import boto3
import botocore.exceptions as bexc
import urllib3
from botocore.config import Config

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
from ._options import Option, boolean, choice, integer, seconds, size, text
from ._util import ViewReader
from .base import (
    DEFAULT_READ_CHUNK,
    Capabilities,
    MiB,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
)
from .wrappers import PrefixStore

if TYPE_CHECKING:
    from ._uri import ParsedURI

#: S3 rejects non-final parts below this size (EntityTooSmall) when the upload completes.
S3_MIN_PART_SIZE = 5 * MiB
S3_MAX_PARTS = 10_000

CONDITIONAL_WRITE_MODES = ("atomic", "unsafe", "none")
_MULTIPART_ETAG = re.compile(r"-\d+\"?$")
CHECKSUM_TYPES = ("full_object", "composite")

# ---------------------------------------------------------------------------- error mapping

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


# ---------------------------------------------------------------------------- helpers


#: bodies up to this size are sent as bytes (one small copy); larger ones through ViewReader.
#: botocore adds ``Expect: 100-continue`` to file-like bodies, which costs a round trip that
#: small writes (pointer, manifests) should not pay, and saves re-sending large ones when the
#: server rejects the request up front.
_SMALL_BODY = 1 * MiB


def _body(data: memoryview) -> bytes | ViewReader:
    return data.tobytes() if data.nbytes <= _SMALL_BODY else ViewReader(data)


def _body_of(buffers: list[memoryview], size: int) -> bytes | io.RawIOBase:
    if len(buffers) == 1:
        return _body(buffers[0])
    if size <= _SMALL_BODY:
        return b"".join(buffers)
    return _BuffersReader(buffers)


class _BuffersReader(io.RawIOBase):
    """A seekable, read-only file over consecutive memoryviews: a part that spans several
    tensors is sent without assembling it (botocore reads and seeks bodies, never sizes them
    by other means than ``ContentLength``)."""

    def __init__(self, buffers: list[memoryview]) -> None:
        super().__init__()
        self._buffers = [b for b in buffers if b.nbytes]
        self._starts = list(itertools.accumulate((b.nbytes for b in self._buffers), initial=0))
        self._size = self._starts[-1]
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        filled = 0
        while filled < out.nbytes and self._pos < self._size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            src = self._buffers[i][self._pos - self._starts[i] :]
            n = min(src.nbytes, out.nbytes - filled)
            out[filled : filled + n] = src[:n]
            filled += n
            self._pos += n
        return filled

    def read(self, size: int | None = -1) -> bytes:
        want = self._size - self._pos if size is None or size < 0 else size
        buf = bytearray(max(0, min(want, self._size - self._pos)))
        n = self.readinto(buf)
        return bytes(buf[:n])


def _quoted(etag: str | None) -> str:
    """ETags are compared as the server sends them: one canonical quoted form."""
    if not etag:
        return ""
    return etag if etag.startswith(('"', "W/")) else f'"{etag}"'


def _full_crc(value: str | None, checksum_type: str | None, etag: str | None = None) -> str | None:
    """The full-object CRC32C, or ``None`` when it may be a composite (checksum-of-checksums).

    A multipart object's checksum is only trusted when the server says FULL_OBJECT: some
    servers (moto 5.2.5) send a composite value without its ``-N`` suffix or a type.
    """
    kind = (checksum_type or "").upper()
    if not value or "-" in value or kind == "COMPOSITE":
        return None
    if _MULTIPART_ETAG.search(etag or "") and kind != "FULL_OBJECT":
        return None
    return value


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a multipart object: MD5 of the parts' binary MD5s, ``-<count>``."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(bytes.fromhex(etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(part_etags)}"'


# ---------------------------------------------------------------------------- the store


def _verify_option(value: Any) -> bool | str:
    """TLS verification: true/false, or the path of a CA bundle."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str) or not value:
        raise ValueError("must be true, false or the path of a CA bundle")
    try:
        return boolean(value)
    except ValueError:
        return value  # a CA bundle path


class S3Store(Store):
    """Objects in ``s3://bucket`` (keys are full S3 keys; ``open_store`` wraps the store in a
    :class:`PrefixStore` for a run root below the bucket). Thread-safe (one botocore client).

    Atomicity: a ``put`` is one PutObject; a ``put_stream`` becomes visible only when
    CompleteMultipartUpload succeeds, whole. Conditional modes are enforced by the server
    (``If-None-Match`` / ``If-Match``); with ``conditional_writes=none`` they raise
    :class:`NotSupportedError` instead of degrading.

    Raises (from every method): :class:`TransientError` (retried by the store's policy),
    :class:`PermissionDeniedError`, :class:`NotFoundError` (key or upload missing),
    :class:`BucketNotFoundError` (the bucket is missing), :class:`AlreadyExistsError` /
    :class:`PreconditionFailedError` (conditional write lost), :class:`ChecksumMismatchError`
    (the server refused a body's CRC32C), :class:`StoreError` (any other rejection),
    :class:`InvalidKeyError` (the key rule; no request made).
    """

    scheme = "s3"
    OPTIONS = (
        Option("endpoint_url", text, None, "S3-compatible endpoint, e.g. http://127.0.0.1:4566"),
        Option("region", text, None, "signing region (default: the profile's, else us-east-1)"),
        Option("profile", text, None, "a named profile from the AWS config files"),
        Option(
            "path_style",
            boolean,
            None,
            "true: http://host/bucket/key addressing (default with an endpoint_url); false: virtual-hosted",
        ),
        Option(
            "conditional_writes",
            choice(*CONDITIONAL_WRITE_MODES),
            "atomic",
            "atomic (AWS); unsafe: the server honours If-None-Match/If-Match but not atomically under "
            "races (moto); none: it ignores them, so CREATE/update writes raise NotSupportedError",
        ),
        Option(
            "checksum_type",
            choice(*CHECKSUM_TYPES),
            "full_object",
            "multipart checksum: full_object, or composite for servers without FULL_OBJECT (head then "
            "reports no CRC32C for multipart objects)",
        ),
        Option("connect_timeout", seconds, 10.0, "seconds to connect"),
        Option("read_timeout", seconds, 60.0, "seconds without a byte from the server"),
        Option(
            "max_pool_connections", integer(1), None, "HTTP connections kept (default max(2 x in flight, 16))"
        ),
        Option("verify", _verify_option, None, "false to skip TLS verification, or a CA bundle path"),
        Option(
            "payload_signing",
            boolean,
            False,
            "true: SHA-256-sign every body (bodies already carry a CRC32C the server verifies)",
        ),
        Option(
            "read_concurrency",
            integer(1),
            None,
            "ranged GETs in flight for reads larger than part_size (default max_in_flight; 1: one "
            "streaming GetObject, for servers where a ranged GET costs a whole-object read, e.g. moto)",
        ),
        Option(
            "min_part_size",
            size,
            "5MiB",
            "the smallest non-final part the server accepts (S3, LocalStack, MinIO: 5 MiB): a smaller "
            "part_size is refused when the store is opened; lower it only for a server that accepts "
            "smaller parts (moto with S3_UPLOAD_PART_MIN_SIZE)",
        ),
        Option("access_key_id", text, None, "explicit credentials (local test servers)", secret=True),
        Option("secret_access_key", text, None, "explicit credentials (local test servers)", secret=True),
        Option("session_token", text, None, "explicit credentials (local test servers)", secret=True),
    )

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        path_style: bool | None = None,
        conditional_writes: str = "atomic",
        checksum_type: str = "full_object",
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        max_pool_connections: int | None = None,
        verify: bool | str | None = None,
        payload_signing: bool | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        read_concurrency: int | None = None,
        read_chunk: int = DEFAULT_READ_CHUNK,
        min_part_size: int = S3_MIN_PART_SIZE,
        client: Any = None,
        **store_kwargs: Any,
    ) -> None:
        """Open ``s3://bucket``. No request is made here (:meth:`check` makes one).

        ``client`` injects a ready botocore S3 client (tests with ``botocore.stub.Stubber``);
        it must have retries disabled like the one built here.

        Raises:
            ConfigError: an invalid option, an unknown profile, only half of a key pair, or a
                ``part_size`` below ``min_part_size`` (S3 would refuse such an upload only when
                it completes, after every part was sent).
        """
        if conditional_writes not in CONDITIONAL_WRITE_MODES:
            raise ConfigError(
                f"conditional_writes must be one of {CONDITIONAL_WRITE_MODES}, got {conditional_writes!r}"
            )
        if checksum_type not in CHECKSUM_TYPES:
            raise ConfigError(f"checksum_type must be one of {CHECKSUM_TYPES}, got {checksum_type!r}")
        # Declared from what the server was said to enforce (there is no way to probe it safely).
        store_kwargs.setdefault(
            "capabilities",
            Capabilities(
                create_if_absent=conditional_writes != "none",
                compare_and_swap=conditional_writes != "none",
                atomic_conditionals=conditional_writes == "atomic",
            ),
        )
        self.bucket = bucket
        super().__init__(location=f"s3://{bucket}", **store_kwargs)
        if min_part_size < 1:
            raise ConfigError(f"min_part_size must be positive, got {min_part_size}")
        # S3 refuses a non-final part below 5 MiB only when the upload completes (EntityTooSmall),
        # after every part was sent: refuse the configuration now, naming the bucket. A server
        # that accepts smaller parts (moto with S3_UPLOAD_PART_MIN_SIZE) is declared so.
        self.min_part_size = min_part_size
        self._check_part_size(self.part_size, "")
        self.conditional_writes = conditional_writes
        self.checksum_type = checksum_type
        self.endpoint_url = endpoint_url
        self.read_chunk = read_chunk
        self.read_concurrency = self.max_in_flight if read_concurrency is None else read_concurrency
        if self.read_concurrency < 1:
            raise ConfigError(f"read_concurrency must be >= 1, got {read_concurrency}")
        self._bucket_checked = False
        self._bucket_lock = threading.Lock()
        self._read_pool: ThreadPoolExecutor | None = None
        self._read_pool_lock = threading.Lock()
        if client is not None:
            self._client = client
            return
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError("access_key_id and secret_access_key must be given together")
        try:
            session = boto3.session.Session(
                profile_name=profile,
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key,
                aws_session_token=session_token,
            )
        except bexc.ProfileNotFound as exc:
            raise ConfigError(f"AWS profile {profile!r} not found (for {self.location})") from exc
        region = region or session.region_name or "us-east-1"
        if path_style is None:
            path_style = endpoint_url is not None  # custom servers rarely have wildcard DNS
        s3_config: dict[str, Any] = {"addressing_style": "path" if path_style else "virtual"}
        # Unsigned payloads: integrity comes from the server-verified CRC32C on every body.
        s3_config["payload_signing_enabled"] = bool(payload_signing)
        pool = max_pool_connections or max(2 * max(self.max_in_flight, self.read_concurrency), 16)
        if pool < self.max_in_flight:
            raise ConfigError(
                f"max_pool_connections ({pool}) must be >= max_in_flight ({self.max_in_flight})"
            )
        config = Config(
            region_name=region,
            signature_version="s3v4",
            s3=s3_config,
            # tenacity (RetryPolicy) is the one retry layer; botocore must try exactly once.
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=pool,
            tcp_keepalive=True,
            # botocore >= 1.36 adds CRC32 checksums (and aws-chunked trailers over https) to
            # every request by default; many S3-compatible servers reject those. We send our own
            # CRC32C where it matters and validate downloads ourselves.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            self._client = session.client("s3", endpoint_url=endpoint_url, config=config, verify=verify)
        except (bexc.BotoCoreError, ValueError) as exc:
            raise ConfigError(f"cannot create an S3 client for {self.location}: {exc}") from exc

    @classmethod
    def from_uri(cls, parsed: ParsedURI, options: dict[str, Any]) -> Store:
        """``s3://bucket/prefix?...``: the bucket's store, inside a :class:`PrefixStore` for the
        prefix (``options`` converted by ``open_store`` against :attr:`OPTIONS`)."""
        store = cls(parsed.bucket, **options)
        return PrefixStore(store, parsed.prefix) if parsed.prefix else store

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def _mapped(self, operation: str, key: str, mode: PutMode | None = None) -> Iterator[None]:
        """THE translation point: an SDK exception raised inside becomes its objckpt error
        (:func:`map_s3_error`), ``__cause__`` kept. Exactly once: no retry here."""
        try:
            yield
        except _SDK_ERRORS as exc:
            mapped = map_s3_error(
                exc, operation=operation, key=key, location=self.location, bucket=self.bucket, mode=mode
            )
            if mapped is exc:
                raise
            raise mapped from exc

    def _request(
        self, operation: str, key: str, fn: Callable[..., Any], *, mode: PutMode | None = None, **kwargs: Any
    ) -> Any:
        """One SDK call on the bucket, its exceptions translated."""
        with self._mapped(operation, key, mode):
            return fn(Bucket=self.bucket, **kwargs)

    @staticmethod
    def _conditions(mode: PutMode) -> dict[str, str]:
        if mode.kind == "create":
            return {"IfNoneMatch": "*"}
        if mode.kind == "update":
            return {"IfMatch": _quoted(mode.version)}
        return {}

    # ------------------------------------------------------------------ writes

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        """PutObject with the CRC32C the server verifies; atomic; conditional per ``mode``."""
        resp = self._request(
            "put",
            key,
            self._client.put_object,
            mode=mode,
            Key=key,
            Body=_body(data),
            ContentLength=data.nbytes,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc32c,
            **self._conditions(mode),
        )
        return ObjectMeta(key=key, size=data.nbytes, version=_quoted(resp.get("ETag")), crc32c=crc32c)

    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle:
        extra: dict[str, Any] = {"ChecksumAlgorithm": "CRC32C"}
        if self.checksum_type == "full_object":
            extra["ChecksumType"] = "FULL_OBJECT"
        resp = self._request("create_upload", key, self._client.create_multipart_upload, Key=key, **extra)
        return UploadHandle(key=key, mode=mode, upload_id=resp["UploadId"])

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        return self._upload_part_buffers(handle, part_number, offset, [data], crc32c)

    def _upload_part_buffers(
        self, handle: UploadHandle, part_number: int, offset: int, buffers: list[memoryview], crc32c: str
    ) -> PartResult:
        """UploadPart with the CRC32C S3 verifies; a part spanning buffers is sent as one
        streamed body over them (no assembly copy)."""
        if part_number > S3_MAX_PARTS:
            raise StoreError(
                f"more than {S3_MAX_PARTS} parts: raise part_size for objects this large",
                key=handle.key,
                location=self.location,
                operation="upload_part",
            )
        size = sum(b.nbytes for b in buffers)
        resp = self._request(
            "upload_part",
            handle.key,
            self._client.upload_part,
            Key=handle.key,
            UploadId=handle.upload_id,
            PartNumber=part_number,
            Body=_body_of(buffers, size),
            ContentLength=size,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc32c,
        )
        return PartResult(part_number, offset, size, crc32c, token=_quoted(resp.get("ETag")))

    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        """CompleteMultipartUpload under ``handle.mode``'s condition, atomically.

        A retried completion whose first response was lost finds the object already there (412)
        or the upload gone (NoSuchUpload); if the object's ETag is the one these parts produce,
        the earlier try succeeded and this returns its meta instead of failing.
        """
        attempts = handle.state["complete_attempts"] = handle.state.get("complete_attempts", 0) + 1
        extra: dict[str, Any] = dict(self._conditions(handle.mode))
        if self.checksum_type == "full_object":
            extra.update(ChecksumType="FULL_OBJECT", ChecksumCRC32C=crc32c, MpuObjectSize=size)
        body = {
            "Parts": [
                {"PartNumber": p.part_number, "ETag": p.token, "ChecksumCRC32C": p.crc32c} for p in parts
            ]
        }
        try:
            resp = self._request(
                "complete_upload",
                handle.key,
                self._client.complete_multipart_upload,
                mode=handle.mode,
                Key=handle.key,
                UploadId=handle.upload_id,
                MultipartUpload=body,
                **extra,
            )
        except (AlreadyExistsError, PreconditionFailedError, NotFoundError):
            if attempts > 1:
                meta = self._completed_earlier(handle, parts)
                if meta is not None:
                    return dataclasses.replace(meta, size=size, crc32c=crc32c)
            raise
        return ObjectMeta(key=handle.key, size=size, version=_quoted(resp.get("ETag")), crc32c=crc32c)

    def _completed_earlier(self, handle: UploadHandle, parts: list[PartResult]) -> ObjectMeta | None:
        try:
            meta = self._head(handle.key)
        except StoreError:
            return None
        if meta.version == multipart_etag([str(p.token) for p in parts]):
            return meta
        return None

    def _abort_upload(self, handle: UploadHandle) -> None:
        """AbortMultipartUpload; needs only the key and the upload id (GC rebuilds handles)."""
        try:
            self._request(
                "abort_upload",
                handle.key,
                self._client.abort_multipart_upload,
                Key=handle.key,
                UploadId=handle.upload_id,
            )
        except BucketNotFoundError:
            raise
        except NotFoundError:
            pass  # already aborted or completed: abort is idempotent

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        """ListMultipartUploads, every page, with each upload's initiation time."""
        found: list[PendingUpload] = []
        kwargs: dict[str, Any] = {"Prefix": prefix}
        while True:
            resp = self._request("list_uploads", prefix, self._client.list_multipart_uploads, **kwargs)
            for upload in resp.get("Uploads", []) or []:
                found.append(PendingUpload(upload["Key"], upload["UploadId"], upload.get("Initiated")))
            if not resp.get("IsTruncated"):
                return found
            key_marker = resp.get("NextKeyMarker")
            upload_marker = resp.get("NextUploadIdMarker")
            if not key_marker and not upload_marker:
                return found
            kwargs["KeyMarker"] = key_marker or ""
            kwargs["UploadIdMarker"] = upload_marker or ""

    def _delete_batch(self, keys: list[str]) -> None:
        """DeleteObjects (Quiet); a per-key failure raises the mapped error for that key."""
        resp = self._request(
            "delete",
            keys[0] if len(keys) == 1 else "",
            self._client.delete_objects,
            Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
        )
        errors = [e for e in resp.get("Errors", []) or [] if e.get("Code") != "NoSuchKey"]
        if not errors:
            return
        first = errors[0]
        code = first.get("Code", "Unknown")
        # A per-key error is an answer like any other: the same table maps it.
        fake = bexc.ClientError(
            {
                "Error": {"Code": code, "Message": first.get("Message", "")},
                "ResponseMetadata": {"HTTPStatusCode": 200},
            },
            "DeleteObjects",
        )
        mapped = map_s3_error(
            fake, operation="delete", key=first.get("Key", ""), location=self.location, bucket=self.bucket
        )
        if isinstance(mapped, StoreError) and len(errors) > 1:
            # same class (transient stays retryable), message counts every key that failed
            mapped = type(mapped)(
                f"{len(errors)} of {len(keys)} key(s) not deleted; first: {code}: {first.get('Message', '')}",
                key=mapped.key,
                location=self.location,
                operation="delete",
            )
        raise mapped

    # ------------------------------------------------------------------ reads

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` (``end=None``: to the end), streamed.

        Reads larger than ``part_size`` fan out into parallel ranged GETs
        (:meth:`_read_parallel`) unless ``read_concurrency`` is 1; otherwise one GetObject (with
        a Range header unless the whole object is read), yielded in ``read_chunk`` pieces. The
        first request is made at the first ``next()``. A read that fails mid-body raises
        :class:`TransientError`; ``get`` retries, ``get_stream`` resumes from its offset.
        """
        if self.read_concurrency > 1 and (end is None or end - start > self.part_size):
            yield from self._read_parallel(key, start, end)
            return
        kwargs: dict[str, Any] = {"Key": key}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            resp = self._request("get", key, self._client.get_object, **kwargs)
        except StoreError as exc:
            if _is_invalid_range(exc):
                return  # starts at or past the end: nothing there, like a slice
            raise
        # A bounded range (only get() asks for one: it returns the bytes whole anyway) or a body
        # no larger than part_size (the memory unit the store budgets per range) comes as one
        # chunk, so get() returns it without joining pieces: a copy that costs as much as the
        # read itself on a fast server.
        whole = end is not None or int(resp.get("ContentLength") or 0) <= self.part_size
        yield from self._iter_body(resp["Body"], key, whole=whole)

    def _iter_body(self, body: Any, key: str, *, whole: bool = False) -> Iterator[bytes]:
        try:
            while True:
                with self._mapped("get", key):
                    chunk = body.read() if whole else body.read(self.read_chunk)
                if not chunk:
                    return
                yield chunk
                if whole:
                    return
        finally:
            body.close()

    def _read_body(self, body: Any, key: str) -> bytes:
        try:
            with self._mapped("get", key):
                data: bytes = body.read()
                return data
        finally:
            body.close()

    def _read_parallel(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` as ``part_size`` ranged GETs, ``read_concurrency`` at a time.

        One connection's GET is far slower than several in parallel (S3's own advice; measured
        2x on LocalStack), so large reads fan out like uploads do. The first range is streamed
        and tells the object's size and ETag; later ranges carry ``If-Match: <etag>``, so an
        object replaced mid-read fails (TransientError, the caller re-reads) instead of mixing
        versions. Memory: at most ``read_concurrency + 1`` ranges of ``part_size``.
        """
        size = self.part_size
        first_stop = start + size if end is None else min(end, start + size)
        try:
            resp = self._request(
                "get", key, self._client.get_object, Key=key, Range=f"bytes={start}-{first_stop - 1}"
            )
        except StoreError as exc:
            if _is_invalid_range(exc):
                return  # start at or past the end (or an empty object)
            raise
        total = _object_size(resp, start)
        etag = resp.get("ETag")
        yield from self._iter_body(resp["Body"], key)
        stop = total if end is None else min(end, total)
        pos = first_stop
        if pos >= stop:
            return
        pool = self._read_executor()
        pending: deque[Future[bytes]] = deque()
        try:
            while pending or pos < stop:
                while pos < stop and len(pending) < self.read_concurrency:
                    n = min(size, stop - pos)
                    pending.append(pool.submit(self._get_range, key, pos, pos + n, etag))
                    pos += n
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()

    def _read_executor(self) -> ThreadPoolExecutor:
        # Reads get their own threads: a task on the upload pool never waits for one here, and
        # a put_stream fed by a get_stream of the same store cannot starve either side.
        with self._read_pool_lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(
                    max_workers=self.read_concurrency, thread_name_prefix="objckpt-s3-read"
                )
            return self._read_pool

    def _get_range(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        kwargs: dict[str, Any] = {"Key": key, "Range": f"bytes={start}-{end - 1}"}
        if etag:
            kwargs["IfMatch"] = etag
        try:
            resp = self._request("get", key, self._client.get_object, **kwargs)
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, bexc.ClientError) and _client_error_parts(cause)[1] == 412:
                raise TransientError(
                    "object was replaced while being read", key=key, location=self.location, operation="get"
                ) from exc
            raise
        data = self._read_body(resp["Body"], key)
        if len(data) != end - start:
            raise TransientError(
                f"short ranged read: {len(data)} of {end - start} bytes at {start}",
                key=key,
                location=self.location,
                operation="get",
            )
        return data

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        # One ranged GET whose body the socket reads straight into the buffers (readinto): no
        # bytes object per chunk, no join.
        total = sum(b.nbytes for b in buffers)
        try:
            resp = self._request(
                "get", key, self._client.get_object, Key=key, Range=f"bytes={start}-{start + total - 1}"
            )
        except StoreError as exc:
            if _is_invalid_range(exc):
                return 0  # starts at or past the end
            raise
        body = resp["Body"]
        filled = 0
        try:
            for buf in buffers:
                pos = 0
                while pos < buf.nbytes:
                    with self._mapped("get", key):
                        n = body.readinto(buf[pos:])
                    if not n:
                        return filled
                    pos += n
                    filled += n
            return filled
        finally:
            body.close()

    def _head(self, key: str) -> ObjectMeta:
        """HeadObject with checksum mode on; ``crc32c`` is the full-object value or ``None``."""
        try:
            resp = self._request("head", key, self._client.head_object, Key=key, ChecksumMode="ENABLED")
        except BucketNotFoundError:
            raise
        except NotFoundError as exc:
            # HEAD responses have no body, so a missing bucket looks like a missing key.
            self._check_bucket(key, exc)
            raise
        if not resp.get("ETag") or "ContentLength" not in resp:
            # A response cut between header lines parses as a 200 without them; treating that
            # as a real answer would report a wrong version and reject a good checkpoint.
            raise TransientError(
                "HEAD response lacks ETag or Content-Length (cut short?)",
                key=key,
                location=self.location,
                operation="head",
            )
        return ObjectMeta(
            key=key,
            size=int(resp["ContentLength"]),
            version=_quoted(resp.get("ETag")),
            crc32c=_full_crc(resp.get("ChecksumCRC32C"), resp.get("ChecksumType"), resp.get("ETag")),
            last_modified=resp.get("LastModified"),
        )

    def _check_bucket(self, key: str, original: NotFoundError) -> None:
        """Once per store: turn a HEAD 404 into :class:`BucketNotFoundError` when that is the
        cause (a missing bucket is a configuration problem, never a missing checkpoint)."""
        if self._bucket_checked:
            return
        try:
            self._request("head", key, self._client.head_bucket)
        except NotFoundError as exc:
            raise BucketNotFoundError(
                f"bucket {self.bucket!r} does not exist",
                key=key,
                location=self.location,
                operation="head",
            ) from exc
        except StoreError:
            return  # cannot tell (e.g. no ListBucket permission); keep the original error
        with self._bucket_lock:
            self._bucket_checked = True

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        """ListObjectsV2 with StartAfter/MaxKeys. ``crc32c`` is ``None``: LIST has no values."""
        kwargs: dict[str, Any] = {"Prefix": prefix, "MaxKeys": limit}
        if start_after is not None:
            kwargs["StartAfter"] = start_after
        resp = self._request("list", prefix, self._client.list_objects_v2, **kwargs)
        page = [
            ObjectMeta(
                key=obj["Key"],
                size=int(obj.get("Size", 0)),
                version=_quoted(obj.get("ETag")),
                crc32c=None,
                last_modified=obj.get("LastModified"),
            )
            for obj in resp.get("Contents", []) or []
        ]
        return page, bool(resp.get("IsTruncated"))

    def _list_prefixes(self, prefix: str) -> list[str]:
        """ListObjectsV2 with Delimiter='/', every page."""
        found: list[str] = []
        kwargs: dict[str, Any] = {"Prefix": prefix, "Delimiter": "/"}
        while True:
            resp = self._request("list", prefix, self._client.list_objects_v2, **kwargs)
            found.extend(p["Prefix"] for p in resp.get("CommonPrefixes", []) or [])
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return found
            kwargs["ContinuationToken"] = token

    def _close(self) -> None:
        with self._read_pool_lock:
            if self._read_pool is not None:
                self._read_pool.shutdown(wait=True)
                self._read_pool = None
        close = getattr(self._client, "close", None)
        if close is not None:
            close()


def _object_size(resp: dict[str, Any], start: int) -> int:
    """Total size from ``Content-Range: bytes a-b/total`` (or a server that sent it all)."""
    content_range = resp.get("ContentRange") or ""
    total = content_range.rpartition("/")[2]
    if total.isdigit():
        return int(total)
    return start + int(resp.get("ContentLength", 0))


def _is_invalid_range(exc: StoreError) -> bool:
    cause = exc.__cause__
    if isinstance(cause, bexc.ClientError):
        code, status, _ = _client_error_parts(cause)
        return code == "InvalidRange" or status == 416
    return False


__all__ = ["S3Store", "S3_MIN_PART_SIZE", "map_s3_error", "multipart_etag"]
