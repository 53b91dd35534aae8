"""GCS parallel composite uploads: the upload primitives of :class:`~objckpt.store.gcs.GCSStore`.

Each part is a temporary object under ``<private root>/.objckpt/parts/<upload id>/``;
completion composes them (a tree of at most 32-source composes) into a staged object, checks its
size and CRC32C, then publishes it onto the key with one conditional compose that stamps the
upload id into the object's metadata (so a retried completion recognises its own object). A
marker object under ``.objckpt/uploads/`` names the target key, so ``list_uploads`` finds
abandoned uploads for GC, and abort deletes the parts and the marker. A mixin on
:class:`~objckpt.store._gcs_client._GCSClient`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from .._crc import crc32c_b64
from ..errors import AlreadyExistsError, ChecksumMismatchError, PreconditionFailedError, StoreError
from ._gcs_client import _GCSClient
from ._gcs_errors import _SDK_ERRORS
from .base import ObjectMeta, PartResult, PendingUpload, PutMode, UploadHandle

#: one logger for the GCS store, whichever of its modules logs
log = logging.getLogger("objckpt.store.gcs")

#: GCS: at most 32 sources per compose request
MAX_COMPOSE_SOURCES = 32
#: GCS: a composite object has at most 1,024 components, however it was composed
MAX_COMPONENTS = 1024
_META_KEY = "objckpt-key"
_META_UPLOAD = "objckpt-upload"


class _GCSComposite(_GCSClient):
    """The composite upload primitives of :class:`~objckpt.store.gcs.GCSStore` (see the module
    doc)."""

    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle:
        self._generation_or_refuse(mode, key)
        upload_id = uuid.uuid4().hex
        marker = memoryview(upload_id.encode())
        with self._mapped("create_upload", key):
            # The marker names the target key, so GC can find and abort an abandoned upload.
            self._upload(
                self._uploads + upload_id,
                [marker],
                crc32c_b64(marker),
                if_generation_match=0,
                metadata={_META_KEY: key},
            )
        return UploadHandle(key=key, mode=mode, upload_id=upload_id)

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        return self._upload_part_buffers(handle, part_number, offset, [data], crc32c)

    def _upload_part_buffers(
        self, handle: UploadHandle, part_number: int, offset: int, buffers: list[memoryview], crc32c: str
    ) -> PartResult:
        """One part as its own object, its buffers sent as one body (no assembly copy)."""
        size = sum(b.nbytes for b in buffers)
        if part_number > MAX_COMPONENTS:
            raise StoreError(
                f"object needs more than {MAX_COMPONENTS} parts of {size} bytes; a GCS "
                f"composite object has at most {MAX_COMPONENTS} components: raise part_size",
                key=handle.key,
                location=self.location,
                operation="upload_part",
            )
        name = f"{self._parts}{handle.upload_id}/{part_number:05d}"
        with self._mapped("upload_part", handle.key):
            # Unconditional: the name is private to this upload, and a retry after a lost
            # response must be able to replace the part.
            blob = self._upload(name, buffers, crc32c, if_generation_match=None)
        self._reject_mismatch(blob, crc32c, handle.key, "upload_part")
        return PartResult(part_number, offset, size, crc32c, token=(name, blob.generation))

    def _compose(
        self,
        target: str,
        sources: list[tuple[str, int]],
        *,
        if_generation_match: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Any:
        bucket = self._bucket
        blob = bucket.blob(target)
        blob.content_type = "application/octet-stream"
        if metadata:
            blob.metadata = metadata
        # Each source is pinned to the generation we uploaded: a part replaced meanwhile is
        # a 404, never silently composed.
        blob.compose(
            [bucket.blob(name, generation=gen) for name, gen in sources],
            if_generation_match=if_generation_match,
            timeout=self.timeout,
            retry=None,
        )
        return blob

    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        """Compose the parts (a tree of <= 32-source composes) into a staged object, verify its
        size and CRC32C (:class:`ChecksumMismatchError`, nothing published), then publish it
        onto the key with one conditional compose."""
        key, uid = handle.key, handle.upload_id
        numbers = [p.part_number for p in parts]
        if numbers != list(range(1, len(parts) + 1)) or sum(p.size for p in parts) != size:
            raise StoreError(
                f"parts {numbers[:5]}... do not add up to {size} bytes",
                key=key,
                location=self.location,
                operation="complete_upload",
            )
        level: list[tuple[str, int]] = [p.token for p in parts]
        depth = 0
        with self._mapped("complete_upload", key):
            while len(level) > MAX_COMPOSE_SOURCES:
                groups = [
                    level[i : i + MAX_COMPOSE_SOURCES] for i in range(0, len(level), MAX_COMPOSE_SOURCES)
                ]
                names = [f"{self._parts}{uid}/c{depth}-{i:05d}" for i in range(len(groups))]
                blobs = list(self._aux_pool().map(self._compose, names, groups))
                level = [(b.name, b.generation) for b in blobs]
                depth += 1
            staged = self._compose(f"{self._parts}{uid}/whole", level)
        if int(staged.size or 0) != size or staged.crc32c != crc32c:
            raise ChecksumMismatchError(
                f"composed object does not match its parts: {staged.size} bytes, CRC32C "
                f"{staged.crc32c}; expected {size} bytes, CRC32C {crc32c}; nothing was published",
                key=key,
                location=self.location,
            )
        mode = handle.mode
        try:
            final = self._compose(
                key,
                [(staged.name, staged.generation)],
                if_generation_match=self._generation_match(mode),
                metadata={_META_UPLOAD: uid},
            )
        except _SDK_ERRORS as exc:
            mapped = self._map_error(exc, "complete_upload", key, mode)
            mine = (
                self._published_by(key, uid)
                if isinstance(mapped, (AlreadyExistsError, PreconditionFailedError))
                else None
            )
            if mine is None:
                if mapped is exc:
                    raise
                raise mapped from exc
            final = mine  # a retry after a lost response: our own compose already published it
        self._reject_mismatch(final, crc32c, key, "complete_upload")
        self._cleanup(uid)
        return self._meta(final, key)

    def _published_by(self, name: str, upload_id: str) -> Any:
        """The object at ``name`` if this upload's compose wrote it, else ``None``."""
        try:
            blob = self._bucket.get_blob(name, timeout=self.timeout, retry=None)
        except _SDK_ERRORS:
            return None  # cannot tell: the caller reports the conflict the server answered
        if blob is not None and (blob.metadata or {}).get(_META_UPLOAD) == upload_id:
            return blob
        return None

    def _cleanup(self, upload_id: str) -> None:
        """After a successful publish: retried like any request, but a failure is only logged
        (the object is published; leftovers are found by ``list_uploads``)."""

        def discard() -> None:
            with self._mapped("abort_upload", ""):
                self._discard(upload_id)

        try:
            # Through _call: this runs inside the publishing request's own retry, so it gets
            # what remains of that request's time budget, never a fresh one of its own.
            self._call(discard)
        except StoreError:
            log.warning("left temporary parts of upload %s for GC", upload_id, exc_info=True)

    def _discard(self, upload_id: str) -> None:
        # Parts before the marker: while any part exists, the marker that finds it does too.
        names = [b.name for b in self._list_names(f"{self._parts}{upload_id}/")]
        self._delete_names(names)
        self._delete_names([self._uploads + upload_id])

    def _abort_upload(self, handle: UploadHandle) -> None:
        """Delete the upload's parts and marker; needs only the upload id (GC rebuilds handles)."""
        with self._mapped("abort_upload", handle.key):
            self._discard(handle.upload_id)

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        with self._mapped("list_uploads", prefix):
            markers = list(self._list_names(self._uploads))
        found = []
        for blob in markers:
            key = (blob.metadata or {}).get(_META_KEY)
            if key is not None and key.startswith(prefix):
                found.append(PendingUpload(key, blob.name.rsplit("/", 1)[1], blob.time_created))
        return sorted(found, key=lambda u: (u.key, u.upload_id))


__all__ = ["MAX_COMPONENTS", "MAX_COMPOSE_SOURCES"]
