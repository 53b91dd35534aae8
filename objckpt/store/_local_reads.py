"""The read primitives of the file:// store: ``_open`` (``pread`` chunks), ``_read_into``
(``preadv`` straight into the caller's buffers), ``_head``, and the listings (a walk in key
order that never follows a symbolic link). A mixin on
:class:`~objckpt.store._local_dirs._LocalDirs`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

from ..errors import NotFoundError
from ._local_dirs import _LocalDirs
from ._local_util import _IOV_MAX, RESERVED_PREFIX
from .base import DEFAULT_READ_CHUNK, ObjectMeta, advance


class _LocalReads(_LocalDirs):
    """The read and list primitives of :class:`~objckpt.store.local.LocalStore` (see the
    module doc)."""

    # ------------------------------------------------------------------ reads

    def _open_read(self, key: str, operation: str = "get") -> int:
        """The object's file, opened without following a symbolic link anywhere below the root."""
        with self._parent_fd(key, operation, create=False, write=False) as dfd:
            if dfd is None:
                raise NotFoundError("no such object", key=key, location=self.location, operation=operation)
            name = key.rsplit("/", 1)[-1]
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._symlink_error(key, key, operation, write=False) from None
                raise self._error(exc, key, operation) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a "directory" of other keys is not an object
            os.close(fd)
            raise NotFoundError("no such object", key=key, location=self.location, operation=operation)
        return fd

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        # A generator throughout: the file is opened at the first next() and closed when the
        # stream ends or is closed, so an abandoned stream never leaks a descriptor.
        fd = self._open_read(key)
        try:
            pos = start
            while end is None or pos < end:
                want = DEFAULT_READ_CHUNK if end is None else min(end - pos, DEFAULT_READ_CHUNK)
                try:
                    chunk = os.pread(fd, want, pos)
                except OSError as exc:
                    raise self._error(exc, key, "get") from exc
                if not chunk:
                    return  # past the end: ranges are clamped, like HTTP range requests
                pos += len(chunk)
                yield chunk
        finally:
            os.close(fd)

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        # preadv: the kernel copies the page cache straight into the destination (a tensor's
        # memory), with the GIL released; no chunk is allocated on the way.
        fd = self._open_read(key)
        try:
            pending, pos, filled = buffers, start, 0
            while pending:
                try:
                    n = os.preadv(fd, pending[:_IOV_MAX], pos)
                except OSError as exc:
                    raise self._error(exc, key, "get") from exc
                if not n:
                    break  # the object ends first: like a clamped range
                pos, filled = pos + n, filled + n
                pending = advance(pending, n)
            return filled
        finally:
            os.close(fd)

    def _head(self, key: str) -> ObjectMeta:
        fd = self._open_read(key, "head")
        try:
            return self._meta(key, os.fstat(fd), self._read_crc(fd))
        finally:
            os.close(fd)

    def _start_dir(self, prefix: str) -> tuple[str, str] | None:
        """(directory to walk, key prefix of its entries) for ``prefix``; ``None`` when no valid
        key can start with ``prefix``."""
        dirs = prefix.split("/")[:-1]  # the last segment is a partial name, used as a filter
        if any(seg in ("", ".", "..") or "\x00" in seg for seg in dirs):
            return None
        if dirs and dirs[0].startswith(RESERVED_PREFIX):
            return None
        path = self.root
        for seg in dirs:  # a symlinked directory holds no objects (listings never follow links)
            path = os.path.join(path, seg)
            if os.path.islink(path):
                return None
        return path, "".join(seg + "/" for seg in dirs)

    def _walk(
        self, directory: str, key_prefix: str, prefix: str, start_after: str | None
    ) -> Iterator[tuple[str, str]]:
        """(key, path) of every file below ``directory`` whose key starts with ``prefix`` and is
        greater than ``start_after``, in plain string order (as S3 lists), not directory order.

        A directory ``d`` sorts as ``"d/"``: every key below it starts with that, so ordering
        siblings that way and descending in order yields keys sorted. Subtrees entirely before
        ``start_after`` or outside ``prefix`` are skipped without being read.
        """
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        items = []
        for entry in entries:
            name = entry.name
            if not key_prefix and name.startswith(RESERVED_PREFIX):
                continue  # staging and lock files are not objects
            try:
                if entry.is_dir(follow_symlinks=False):
                    items.append((key_prefix + name + "/", entry.path, True))
                elif entry.is_file(follow_symlinks=False):
                    items.append((key_prefix + name, entry.path, False))
            except OSError:
                continue  # vanished while listing
        items.sort()
        for key, path, is_dir in items:
            if is_dir:
                if not (key.startswith(prefix) or prefix.startswith(key)):
                    continue
                if start_after is not None and key < start_after and not start_after.startswith(key):
                    continue  # every key below is < start_after
                yield from self._walk(path, key, prefix, start_after)
            elif key.startswith(prefix) and (start_after is None or key > start_after):
                yield key, path

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        start = self._start_dir(prefix)
        if start is None:
            return [], False
        page: list[ObjectMeta] = []
        try:
            for key, path in self._walk(start[0], start[1], prefix, start_after):
                if len(page) == limit:
                    return page, True
                try:
                    st = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted since the directory was read
                page.append(self._meta(key, st, self._read_crc(path)))
        except OSError as exc:
            raise self._error(exc, prefix, "list") from exc
        return page, False

    def _list_prefixes(self, prefix: str) -> list[str]:
        """Subdirectories directly below ``prefix`` that hold at least one object (like S3, an
        empty directory left behind by deletes is not a prefix)."""
        start = self._start_dir(prefix)
        if start is None:
            return []
        directory, key_prefix = start
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise self._error(exc, prefix, "list") from exc
        found = []
        for entry in entries:
            key = key_prefix + entry.name + "/"
            if not key_prefix and entry.name.startswith(RESERVED_PREFIX):
                continue
            if key.startswith(prefix) and entry.is_dir(follow_symlinks=False):
                if next(self._walk(entry.path, key, key, None), None) is not None:
                    found.append(key)
        return sorted(found)
