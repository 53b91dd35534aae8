"""Staging files and the commit of the file:// store.

Every write lands in a new file in ``.objckpt-staging/`` (its name records the kind, start time
and key, so uploads left by a crashed process can be listed), is sealed (CRC32C attribute,
unique mtime, fsync) and then gets its key's name: by hard link for CREATE, by ``replace``
under the key's stripe lock for OVERWRITE and ``update``. A mixin on
:class:`~objckpt.store._local_dirs._LocalDirs`.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import stat
import time
import uuid
from datetime import datetime, timezone

from ..errors import AlreadyExistsError, NotSupportedError, PreconditionFailedError, StoreError
from ._local_dirs import _LocalDirs
from ._local_util import (
    _KEY_SIDE_SUFFIX,
    _KIND_PUT,
    _KIND_UPLOAD,
    _MAX_NAME,
    _NO_LINK_ERRNOS,
    XATTR_CRC32C,
    _lstat_at,
    _token,
    _unique_ns,
)
from .base import PendingUpload, PutMode


class _LocalStaging(_LocalDirs):
    """Staging files, sealing and the atomic commit of :class:`~objckpt.store.local.LocalStore`
    (see the module doc)."""

    # ------------------------------------------------------------------ staging

    def _new_staging(self, kind: str, key: str, operation: str) -> tuple[str, str]:
        """Create an empty staging file for ``key``; returns (name, path).

        The name is ``<kind>.<start ns hex>.<uuid>.<base64url key>``, or ``...<uuid>~long`` with
        the key in a ``~key`` side file when that would exceed the filesystem's name limit.
        """
        upload_id = f"{kind}.{time.time_ns():x}.{uuid.uuid4().hex}"
        encoded = base64.urlsafe_b64encode(key.encode("utf-8")).decode("ascii").rstrip("=")
        name = f"{upload_id}.{encoded}"
        side = None
        if len(name) > _MAX_NAME:
            name = f"{upload_id}~long"
            side = os.path.join(self._staging, upload_id + _KEY_SIDE_SUFFIX)
        path = os.path.join(self._staging, name)
        self._private_dir(self._staging, key, operation)
        for tries in (1, 2):
            try:
                if side is not None:
                    with open(side, "xb") as f:
                        f.write(key.encode("utf-8"))
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                os.close(fd)
                return name, path
            except FileNotFoundError as exc:
                if tries == 2:
                    raise self._error(exc, key, operation) from exc
                self._ensure_dir(self._staging, key, operation)
            except OSError as exc:
                self._discard(name)
                raise self._error(exc, key, operation) from exc
        raise AssertionError("unreachable")

    def _discard(self, name: str) -> None:
        """Remove a staging file and its side file; absent is fine."""
        if "/" in name or not name.startswith((_KIND_PUT + ".", _KIND_UPLOAD + ".")):
            raise ValueError(f"not a staging upload id of {self.location}: {name!r}")
        paths = [os.path.join(self._staging, name)]
        if name.endswith("~long"):
            paths.append(os.path.join(self._staging, name[: -len("~long")] + _KEY_SIDE_SUFFIX))
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _parse_staging(self, name: str) -> PendingUpload | None:
        if name.endswith(_KEY_SIDE_SUFFIX):
            return None
        parts = name.split(".", 3)
        if len(parts) < 3 or parts[0] not in (_KIND_PUT, _KIND_UPLOAD):
            return None
        try:
            started = datetime.fromtimestamp(int(parts[1], 16) / 1e9, tz=timezone.utc)
            if name.endswith("~long"):
                side = os.path.join(self._staging, name[: -len("~long")] + _KEY_SIDE_SUFFIX)
                with open(side, "rb") as f:
                    key = f.read().decode("utf-8")
            else:
                encoded = parts[3]
                key = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
        except (ValueError, IndexError, OSError):
            return None  # not ours, or half-written: GC of the staging dir can remove it by age
        return PendingUpload(key=key, upload_id=name, initiated=started)

    def _seal(self, fd: int, crc32c: str) -> os.stat_result:
        """Record the CRC32C, stamp a unique mtime, fsync; returns the final stat."""
        if self._xattrs:
            try:
                os.setxattr(fd, XATTR_CRC32C, crc32c.encode("ascii"))
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self._xattrs = False  # filesystem without user xattrs: crc32c stays None
        stamp = _unique_ns()
        os.utime(fd, ns=(stamp, stamp))
        os.fsync(fd)
        return os.fstat(fd)

    def _commit(self, name: str, key: str, mode: PutMode, operation: str) -> None:
        """Give the sealed staging file ``name`` the key's name, honouring ``mode``, then fsync
        the directory. The staging name is removed (or left for the caller to discard on error)."""
        staging = os.path.join(self._staging, name)
        with self._parent_fd(key, operation, create=True, write=True) as dfd:
            assert dfd is not None
            target = key.rsplit("/", 1)[-1]  # relative to dfd: never through a symlinked directory
            try:
                if mode.kind == "create":
                    self._link_create(staging, dfd, target, key, operation)
                else:
                    with self._key_lock(key, operation):
                        if mode.kind == "update":
                            st = _lstat_at(dfd, target)
                            if st is None or not stat.S_ISREG(st.st_mode) or _token(st) != mode.version:
                                current = (
                                    _token(st) if st is not None and stat.S_ISREG(st.st_mode) else "absent"
                                )
                                raise PreconditionFailedError(
                                    f"version is {current}, expected {mode.version}",
                                    key=key,
                                    location=self.location,
                                    operation=operation,
                                )
                        self._replace(staging, dfd, target, key, operation)
            except StoreError:
                raise  # already mapped (AlreadyExistsError is also an OSError)
            except OSError as exc:
                raise self._error(exc, key, operation) from exc
            self._fsync_fd(dfd, key, operation)

    def _link_create(self, staging: str, dfd: int, target: str, key: str, operation: str) -> None:
        # create=lock (opted in): the key's lock makes link-or-check-and-replace one step among
        # objckpt writers, for filesystems that refuse hard links
        locked = self.create == "lock"
        with self._key_lock(key, operation) if locked else contextlib.nullcontext():
            try:
                os.link(staging, target, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                self._exists_error(dfd, target, key, operation)
            except OSError as exc:
                if exc.errno not in _NO_LINK_ERRNOS:
                    raise
                if not locked:
                    # Never degrade silently to check-then-write: that would let another
                    # program's write between the check and the replace be overwritten.
                    raise NotSupportedError(
                        f"the filesystem holding {self.root} refuses hard links "
                        f"({errno.errorcode.get(exc.errno or 0, exc.errno)}), which file:// needs to enforce "
                        "create-if-absent atomically; use a filesystem with hard links, or open the store "
                        f"with file://{self.root}?create=lock to check under objckpt's lock files instead "
                        "(atomic only among objckpt writers)",
                        key=key,
                        location=self.location,
                        operation=operation,
                    ) from exc
                if _lstat_at(dfd, target) is not None:
                    self._exists_error(dfd, target, key, operation)
                os.replace(staging, target, dst_dir_fd=dfd)
        # after a link the staging name still exists; the caller discards it

    def _exists_error(self, dfd: int, target: str, key: str, operation: str) -> None:
        st = _lstat_at(dfd, target)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise NotSupportedError(
                "a file:// store cannot hold both an object and keys below it "
                "(the key is a directory of other keys)",
                key=key,
                location=self.location,
                operation=operation,
            )
        raise AlreadyExistsError(
            "object already exists", key=key, location=self.location, operation=operation
        )

    def _replace(self, staging: str, dfd: int, target: str, key: str, operation: str) -> None:
        # a symbolic link at the target is replaced itself (rename never follows it)
        try:
            os.replace(staging, target, dst_dir_fd=dfd)
        except IsADirectoryError:
            raise NotSupportedError(
                "a file:// store cannot hold both an object and keys below it "
                "(the key is a directory of other keys)",
                key=key,
                location=self.location,
                operation=operation,
            ) from None
