"""Directories below a file:// run root, never through a symbolic link.

A key's directory is opened one segment at a time from the root with ``O_NOFOLLOW``
(``openat``), creating missing directories and fsync'ing each parent that got an entry; plus
directory fsync and the 256 striped ``flock`` lock files that overwrite, ``update`` and delete
take. A mixin on :class:`~objckpt.store._local_base._LocalBase`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import NotSupportedError, StoreError
from ._local_base import _LocalBase
from ._local_util import LOCK_STRIPES


class _LocalDirs(_LocalBase):
    """Directory walking, creation, fsync and key locks of
    :class:`~objckpt.store.local.LocalStore` (see the module doc)."""

    @contextmanager
    def _parent_fd(self, key: str, operation: str, *, create: bool, write: bool) -> Iterator[int | None]:
        """A descriptor of ``key``'s directory, opened one segment at a time from the root with
        ``O_NOFOLLOW`` (never through a symbolic link); ``None`` when a directory is missing and
        ``create`` is false. ``create`` makes missing directories, fsync'ing each parent that got
        an entry. A symlinked directory raises (see :meth:`_symlink_error`); a segment that is an
        object yields ``None`` for reads and raises :class:`NotSupportedError` for writes."""
        self.check_key(key, operation)
        dirs = key.split("/")[:-1]
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            fd = os.open(self.root, flags)
        except FileNotFoundError:
            if not create:
                yield None
                return
            self._ensure_dir(self.root, key, operation)
            try:
                fd = os.open(self.root, flags)
            except OSError as exc:
                raise self._error(exc, key, operation) from exc
        except OSError as exc:
            raise self._error(exc, key, operation) from exc
        try:
            for i, seg in enumerate(dirs):
                nfd = self._open_dir(fd, seg, "/".join(dirs[: i + 1]), key, operation, create, write)
                os.close(fd)
                fd = nfd
                if fd < 0:
                    yield None
                    return
            yield fd
        finally:
            if fd >= 0:
                os.close(fd)

    def _open_dir(
        self, dfd: int, seg: str, shown: str, key: str, operation: str, create: bool, write: bool
    ) -> int:
        """Open directory ``seg`` below ``dfd`` without following a link; -1 when absent (or an
        object) and not ``create``."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(2):
            try:
                return os.open(seg, flags, dir_fd=dfd)
            except FileNotFoundError:
                if not create:
                    return -1
                try:
                    os.mkdir(seg, 0o777, dir_fd=dfd)
                except FileExistsError:
                    pass  # a concurrent writer made it (or it is not a directory: checked next)
                except OSError as exc:
                    raise self._error(exc, key, operation) from exc
                else:
                    self._fsync_fd(dfd, key, operation)
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise self._error(exc, key, operation) from exc
                try:
                    st = os.stat(seg, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # vanished meanwhile: try again
                except OSError as exc2:
                    raise self._error(exc2, key, operation) from exc2
                if stat.S_ISLNK(st.st_mode):
                    raise self._symlink_error(shown, key, operation, write=write) from None
                if not write:
                    return -1  # an object where a directory would be: nothing below it
                raise NotSupportedError(
                    f"a file:// store cannot hold both an object and keys below it ({shown!r} is an object)",
                    key=key,
                    location=self.location,
                    operation=operation,
                ) from None
        raise self._error(OSError(errno.ENOENT, "directory vanished while being created"), key, operation)

    def _fsync_fd(self, fd: int, key: str, operation: str) -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # some filesystems refuse dir fsync
                raise self._error(exc, key, operation) from exc

    def _private_dir(self, path: str, key: str, operation: str) -> None:
        """The staging and lock directories must not be symbolic links either."""
        if os.path.islink(path):
            raise self._symlink_error(os.path.basename(path), key, operation, write=True)

    # ------------------------------------------------------------------ directories, locks

    def _ensure_dir(self, path: str, key: str, operation: str) -> None:
        """Create ``path`` and missing parents up to the root, fsync'ing each parent that got a
        new entry so the object's name survives a crash."""
        missing = []
        probe = path
        while not os.path.isdir(probe):
            missing.append(probe)
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise NotSupportedError(
                        "a file:// store cannot hold both an object and keys below it "
                        f"({os.path.relpath(directory, self.root)!r} is an object)",
                        key=key,
                        location=self.location,
                        operation=operation,
                    ) from None
                continue  # a concurrent writer made it
            except OSError as exc:
                raise self._error(exc, key, operation) from exc
            self._fsync_dir(os.path.dirname(directory), key, operation)

    def _fsync_dir(self, path: str, key: str, operation: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise self._error(exc, key, operation) from exc
        try:
            self._fsync_fd(fd, key, operation)
        finally:
            os.close(fd)

    @contextmanager
    def _key_lock(self, key: str, operation: str) -> Iterator[None]:
        """Exclusive lock for ``key``'s stripe. Striped (256 files) rather than one file per key
        so lock files stay bounded although overwrite and delete take them too."""
        stripe = zlib.crc32(key.encode("utf-8", "surrogateescape")) % LOCK_STRIPES
        path = os.path.join(self._locks, f"{stripe:02x}")
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        self._private_dir(self._locks, key, operation)
        try:
            try:
                fd = os.open(path, flags, 0o666)
            except FileNotFoundError:
                self._ensure_dir(self._locks, key, operation)
                fd = os.open(path, flags, 0o666)
        except StoreError:
            raise
        except OSError as exc:
            raise self._error(exc, key, operation) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh open file description per call: threads too
            yield
        finally:
            os.close(fd)  # releases the lock
