"""The write primitives of the file:// store: ``_put``, streamed uploads (parts written at
their offsets into one staging file, completed like a put), ``_list_uploads`` and
``_delete_batch``. A mixin on :class:`~objckpt.store._local_staging._LocalStaging`.
"""

from __future__ import annotations

import errno
import os
import stat

from .._crc import crc32c_b64
from ..errors import ChecksumMismatchError, StoreError
from ._local_staging import _LocalStaging
from ._local_util import _KIND_PUT, _KIND_UPLOAD, _lstat_at, _write_all
from ._writeback import write_back
from .base import ObjectMeta, PartResult, PendingUpload, PutMode, UploadHandle


class _LocalWrites(_LocalStaging):
    """The write, upload and delete primitives of :class:`~objckpt.store.local.LocalStore`
    (see the module doc)."""

    # ------------------------------------------------------------------ writes

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        """Atomic create/overwrite/update of one object (see module doc).

        Raises AlreadyExistsError, PreconditionFailedError, ChecksumMismatchError (body does not
        match ``crc32c``), NotSupportedError (key clashes with a directory), InvalidKeyError, and
        the mapped filesystem errors; on any error no object is written or changed.
        """
        self._path(key, "put")
        if crc32c_b64(data) != crc32c:
            raise ChecksumMismatchError(
                f"body does not match its CRC32C {crc32c}", key=key, location=self.location
            )
        return self._put_buffers(key, [data], mode, crc32c)

    def _put_buffers(self, key: str, buffers: list[memoryview], mode: PutMode, crc32c: str) -> ObjectMeta:
        """``_put`` of buffers whose CRC32C the caller (``Store.put``/``put_stream``) computed
        from these very buffers: written with ``writev``, not hashed again."""
        self._path(key, "put")
        name, path = self._new_staging(_KIND_PUT, key, "put")
        try:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    _write_all(fd, buffers, None)
                    st = self._seal(fd, crc32c)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise self._error(exc, key, "put") from exc
            self._commit(name, key, mode, "put")
        except BaseException:
            self._discard(name)
            raise
        self._discard(name)  # replace/fallback consumed it already; link left it
        return self._meta(key, st, crc32c)

    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle:
        self._path(key, "create_upload")
        name, path = self._new_staging(_KIND_UPLOAD, key, "create_upload")
        return UploadHandle(key=key, mode=mode, upload_id=name, state={"path": path})

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        """Verify the part's CRC32C, then ``pwrite`` it at its offset (idempotent on retry).

        Raises ChecksumMismatchError for a corrupted part, NotFoundError if the upload was aborted.
        """
        if crc32c_b64(data) != crc32c:
            raise ChecksumMismatchError(
                f"part {part_number} does not match its CRC32C {crc32c}",
                key=handle.key,
                location=self.location,
            )
        return self._upload_part_buffers(handle, part_number, offset, [data], crc32c)

    def _upload_part_buffers(
        self, handle: UploadHandle, part_number: int, offset: int, buffers: list[memoryview], crc32c: str
    ) -> PartResult:
        """A part given as buffers ``put_stream`` hashed itself: ``pwritev`` at its offset, no
        assembly copy, no second hash (idempotent on retry); then its pages are written back
        from this thread (:mod:`._writeback`; the completion's fsync stays the durability point)."""
        try:
            # No O_CREAT: a part arriving after an abort must not resurrect the upload.
            fd = os.open(handle.state["path"], os.O_WRONLY | os.O_CLOEXEC)
            try:
                size = _write_all(fd, buffers, offset)
                # this part's disk write now, on this thread, not in the one fsync at the end
                write_back(fd, offset, size)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._error(exc, handle.key, "upload_part") from exc
        return PartResult(part_number, offset, size, crc32c)

    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        """Check the parts tile ``[0, size)``, fsync, and commit like ``_put`` (atomic)."""
        expected = 0
        for part in sorted(parts, key=lambda p: p.offset):
            if part.offset != expected:
                raise StoreError(
                    f"parts do not tile the object: gap or overlap at byte {expected}",
                    key=handle.key,
                    location=self.location,
                    operation="complete_upload",
                )
            expected += part.size
        if expected != size:
            raise StoreError(
                f"parts add up to {expected} bytes, expected {size}",
                key=handle.key,
                location=self.location,
                operation="complete_upload",
            )
        try:
            fd = os.open(handle.state["path"], os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, size)  # a retried larger earlier part cannot leave a tail
                st = self._seal(fd, crc32c)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._error(exc, handle.key, "complete_upload") from exc
        self._commit(handle.upload_id, handle.key, handle.mode, "complete_upload")
        self._discard(handle.upload_id)
        return self._meta(handle.key, st, crc32c)

    def _abort_upload(self, handle: UploadHandle) -> None:
        self._discard(handle.upload_id)

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        try:
            names = os.listdir(self._staging)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error(exc, prefix, "list_uploads") from exc
        found = []
        for name in sorted(names):
            upload = self._parse_staging(name)
            if upload is not None and upload.key.startswith(prefix):
                found.append(upload)
        return found

    def _delete_batch(self, keys: list[str]) -> None:
        """Unlink each key (absent ones ignored), then fsync each touched directory once, so a
        caller that deletes a manifest before its shards keeps that order across a crash."""
        touched: dict[str, str] = {}  # directory -> one key deleted there
        for key in keys:
            with self._parent_fd(key, "delete", create=False, write=True) as dfd:
                if dfd is None:
                    continue  # absent: nothing to lock (and nothing created on a missing root)
                name = key.rsplit("/", 1)[-1]
                st = _lstat_at(dfd, name)
                if st is None or stat.S_ISDIR(st.st_mode):
                    continue  # absent, or a "directory" of other keys, which is not an object
                try:
                    with self._key_lock(key, "delete"):
                        os.unlink(name, dir_fd=dfd)  # a symbolic link is removed, never followed
                except StoreError:
                    raise
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    continue
                except OSError as exc:
                    if exc.errno in (errno.EISDIR, errno.EPERM) and stat.S_ISDIR(
                        (_lstat_at(dfd, name) or st).st_mode
                    ):
                        continue
                    raise self._error(exc, key, "delete") from exc
                touched.setdefault(key.rpartition("/")[0], key)
        for _, key in sorted(touched.items()):
            with self._parent_fd(key, "delete", create=False, write=True) as dfd:
                if dfd is not None:
                    self._fsync_fd(dfd, key, "delete")
