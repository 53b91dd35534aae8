"""S3 multipart uploads: the upload primitives of :class:`~objckpt.store.s3.S3Store`.

``put_stream`` (the base class) drives them: CreateMultipartUpload (``ChecksumType=FULL_OBJECT``
by default), one UploadPart per part with the CRC32C S3 verifies, CompleteMultipartUpload under
the write's condition with the whole object's CRC32C, AbortMultipartUpload on failure, and
ListMultipartUploads for GC. A completion retried after a lost answer recognises its own object
by its multipart ETag. A mixin on :class:`~objckpt.store._s3_client._S3Client`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    NotFoundError,
    PreconditionFailedError,
    StoreError,
)
from ._s3_client import _S3Client
from ._s3_wire import _body_of, _quoted, multipart_etag
from .base import MAX_PARTS, ObjectMeta, PartResult, PendingUpload, PutMode, UploadHandle


class _S3Uploads(_S3Client):
    """The multipart upload primitives of :class:`~objckpt.store.s3.S3Store` (see the module doc)."""

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
        if part_number > MAX_PARTS:
            raise StoreError(
                f"more than {MAX_PARTS} parts: raise part_size for objects this large",
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
