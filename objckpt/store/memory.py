"""``memory://name``: an in-process store for tests and examples.

Every ``open_store("memory://...")`` makes a new, empty store: there is no global registry, so
tests cannot leak state into each other. Share a store between components by passing the object.
All conditional writes are decided under one lock, so they are atomic like a real server's.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from .._crc import crc32c_b64
from ..errors import AlreadyExistsError, ChecksumMismatchError, NotFoundError, PreconditionFailedError
from .base import (
    DEFAULT_READ_CHUNK,
    Capabilities,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
)

if TYPE_CHECKING:
    from ._uri import ParsedURI


@dataclass(frozen=True)
class _Object:
    data: bytes
    meta: ObjectMeta


class MemoryStore(Store):
    """A dict of immutable byte strings behind a lock. Conditional writes are decided under that
    lock, so every guarantee holds under races; bodies are checked against their CRC32C like a
    server would (:class:`ChecksumMismatchError`)."""

    scheme = "memory"
    capabilities = Capabilities.ALL

    def __init__(self, name: str = "", **options: object) -> None:
        super().__init__(location=f"memory://{name}", **options)  # type: ignore[arg-type]
        self._objects: dict[str, _Object] = {}
        self._uploads: dict[str, tuple[UploadHandle, dict[int, bytes], datetime]] = {}
        self._lock = threading.Lock()
        self._versions = itertools.count(1)

    @classmethod
    def from_uri(cls, parsed: ParsedURI, options: dict[str, object]) -> MemoryStore:
        return cls(parsed.bucket + ("/" + parsed.prefix if parsed.prefix else ""), **options)

    # -- writes

    def _commit(self, key: str, data: bytes, mode: PutMode, crc32c: str) -> ObjectMeta:
        with self._lock:  # the check and the write are one step: no check-then-write race
            current = self._objects.get(key)
            if mode.kind == "create" and current is not None:
                raise AlreadyExistsError(
                    "object already exists", key=key, location=self.location, operation="put"
                )
            if mode.kind == "update" and (current is None or current.meta.version != mode.version):
                raise PreconditionFailedError(
                    f"version is {current.meta.version if current else 'absent'}, expected {mode.version}",
                    key=key,
                    location=self.location,
                    operation="put",
                )
            meta = ObjectMeta(
                key=key,
                size=len(data),
                version=f"v{next(self._versions)}",
                crc32c=crc32c,
                last_modified=datetime.now(timezone.utc),
            )
            self._objects[key] = _Object(data, meta)
            return meta

    def _verify(self, key: str, data: memoryview, crc32c: str) -> None:
        # Behave like S3/GCS: the server rejects a body whose CRC32C is not the one announced.
        actual = crc32c_b64(data)
        if actual != crc32c:
            raise ChecksumMismatchError(
                f"CRC32C mismatch on upload: body has {actual}, request says {crc32c}",
                key=key,
                location=self.location,
            )

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        self._verify(key, data, crc32c)
        return self._commit(key, bytes(data), mode, crc32c)

    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle:
        handle = UploadHandle(key=key, mode=mode, upload_id=uuid.uuid4().hex)
        with self._lock:
            self._uploads[handle.upload_id] = (handle, {}, datetime.now(timezone.utc))
        return handle

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        self._verify(handle.key, data, crc32c)
        with self._lock:
            entry = self._uploads.get(handle.upload_id)
            if entry is None:
                raise NotFoundError("upload was aborted", key=handle.key, location=self.location)
            entry[1][part_number] = bytes(data)
        return PartResult(part_number, offset, data.nbytes, crc32c)

    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        with self._lock:
            entry = self._uploads.get(handle.upload_id)
        if entry is None:
            raise NotFoundError("upload was aborted", key=handle.key, location=self.location)
        data = b"".join(entry[1][p.part_number] for p in parts)
        meta = self._commit(handle.key, data, handle.mode, crc32c)
        with self._lock:
            self._uploads.pop(handle.upload_id, None)
        return meta

    def _abort_upload(self, handle: UploadHandle) -> None:
        with self._lock:
            self._uploads.pop(handle.upload_id, None)

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        with self._lock:
            return [
                PendingUpload(h.key, uid, started)
                for uid, (h, _, started) in self._uploads.items()
                if h.key.startswith(prefix)
            ]

    # -- reads

    def _lookup(self, key: str, operation: str) -> _Object:
        with self._lock:
            obj = self._objects.get(key)
        if obj is None:
            raise NotFoundError("no such object", key=key, location=self.location, operation=operation)
        return obj

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        data = self._lookup(key, "get").data  # looked up now, not at the first next()
        return _slices(data, start, len(data) if end is None else min(end, len(data)))

    def _head(self, key: str) -> ObjectMeta:
        return self._lookup(key, "head").meta

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        with self._lock:
            keys = sorted(
                k for k in self._objects if k.startswith(prefix) and (start_after is None or k > start_after)
            )
            page = [self._objects[k].meta for k in keys[:limit]]
        return page, len(keys) > limit

    def _list_prefixes(self, prefix: str) -> list[str]:
        with self._lock:
            keys = list(self._objects)
        found = set()
        for key in keys:
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                if "/" in rest:
                    found.add(prefix + rest.split("/", 1)[0] + "/")
        return sorted(found)

    def _delete_batch(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    # -- test helpers (not part of the Store contract)

    def corrupt(self, key: str, data: bytes) -> None:
        """Replace an object's bytes but keep its recorded metadata: simulates bit rot."""
        with self._lock:
            obj = self._objects[key]
            self._objects[key] = _Object(data, obj.meta)


def _slices(data: bytes, start: int, stop: int) -> Iterator[bytes]:
    # A slice covering all of ``data`` is ``data`` itself (CPython does not copy it).
    for pos in range(start, stop, DEFAULT_READ_CHUNK):
        yield data[pos : min(pos + DEFAULT_READ_CHUNK, stop)]
