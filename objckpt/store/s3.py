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

This module holds :class:`S3Store` itself (single-object writes, HEAD, LIST, DELETE); the rest
lives in private modules, each one concern: ``_s3_client.py`` (options, the botocore client,
the SDK-call plumbing: the base class), ``_s3_uploads.py`` (multipart uploads) and
``_s3_reads.py`` (GETs, ranged and parallel), two mixins on it; ``_s3_errors.py`` (the error
tables and :func:`map_s3_error`) and ``_s3_wire.py`` (request bodies, ETags and checksums).
The names objckpt and its users import (``__all__``) are imported from here as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import botocore.exceptions as bexc

from ..errors import BucketNotFoundError, NotFoundError, StoreError, TransientError
from ._s3_client import S3_MIN_PART_SIZE
from ._s3_errors import S3_ERROR_CODES, S3_ERROR_STATUSES, map_s3_error
from ._s3_reads import _S3Reads
from ._s3_uploads import _S3Uploads
from ._s3_wire import _body_of, _full_crc, _quoted, multipart_etag
from .base import ObjectMeta, PutMode, Store
from .wrappers import PrefixStore

if TYPE_CHECKING:
    from ._uri import ParsedURI


class S3Store(_S3Uploads, _S3Reads):
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

    @classmethod
    def from_uri(cls, parsed: ParsedURI, options: dict[str, Any]) -> Store:
        """``s3://bucket/prefix?...``: the bucket's store, inside a :class:`PrefixStore` for the
        prefix (``options`` converted by ``open_store`` against :attr:`OPTIONS`)."""
        store = cls(parsed.bucket, **options)
        return PrefixStore(store, parsed.prefix) if parsed.prefix else store

    # ------------------------------------------------------------------ writes

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        """PutObject with the CRC32C the server verifies; atomic; conditional per ``mode``."""
        return self._put_buffers(key, [data], mode, crc32c)

    def _put_buffers(self, key: str, buffers: list[memoryview], mode: PutMode, crc32c: str) -> ObjectMeta:
        """PutObject of consecutive buffers as one streamed body (never joined: no copy), with
        the CRC32C the server verifies; atomic; conditional per ``mode``."""
        size = sum(b.nbytes for b in buffers)
        resp = self._request(
            "put",
            key,
            self._client.put_object,
            mode=mode,
            Key=key,
            Body=_body_of(buffers, size),
            ContentLength=size,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc32c,
            **self._conditions(mode),
        )
        return ObjectMeta(key=key, size=size, version=_quoted(resp.get("ETag")), crc32c=crc32c)

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

    # ------------------------------------------------------------------ reads (GETs: _s3_reads.py)

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
        cause (a missing bucket is a configuration problem, never a missing checkpoint).
        ``_bucket_checked`` is read and written under ``_bucket_lock``, held across the probe,
        so threads that meet their first 404 together make one HeadBucket, not one each."""
        with self._bucket_lock:
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


__all__ = [
    "S3Store",
    "S3_ERROR_CODES",
    "S3_ERROR_STATUSES",
    "S3_MIN_PART_SIZE",
    "map_s3_error",
    "multipart_etag",
]
