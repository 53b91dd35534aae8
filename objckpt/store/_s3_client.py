"""The S3 store's configuration and its one path to the SDK: options, the botocore client, and
the context manager that translates every SDK call's exceptions.

:class:`_S3Client` is the base of :class:`~objckpt.store.s3.S3Store` and of its upload and read
mixins (``_s3_uploads.py``, ``_s3_reads.py``): the constructor (``S3Store``'s options, checked
here, none of them making a request), the botocore client built from them (its own retries off,
its automatic extra checksums limited to requests that require them), and ``_mapped`` /
``_request``, through which every SDK call goes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

from ..errors import ConfigError
from ._options import Option, boolean, choice, integer, seconds, size, text
from ._s3_errors import _SDK_ERRORS, map_s3_error
from ._s3_wire import _quoted
from .base import DEFAULT_READ_CHUNK, Capabilities, MiB, PutMode, Store

#: S3 rejects non-final parts below this size (EntityTooSmall) when the upload completes.
S3_MIN_PART_SIZE = 5 * MiB

CONDITIONAL_WRITE_MODES = ("atomic", "unsafe", "none")
CHECKSUM_TYPES = ("full_object", "composite")


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


class _S3Client(Store):
    """Configuration, client and SDK-call plumbing of :class:`~objckpt.store.s3.S3Store` (see
    the module doc); no primitive is implemented here."""

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


__all__ = ["CHECKSUM_TYPES", "CONDITIONAL_WRITE_MODES", "S3_MIN_PART_SIZE"]
