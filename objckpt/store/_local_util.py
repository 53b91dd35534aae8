"""Helpers of the file:// store that hold no store state: the reserved names below the run
root, the errno tables an ``OSError`` is mapped by, the per-process strictly increasing clock
every write's mtime (and so its version token) is stamped with, ``lstat`` relative to a
directory descriptor, and vectored writes that resume after short writes.

Used by :class:`~objckpt.store.local.LocalStore` and its private modules (``_local_*.py``).
"""

from __future__ import annotations

import errno
import os
import threading
import time

from .base import advance

STAGING_DIR = ".objckpt-staging"
#: buffers one preadv/pwritev call takes (Linux IOV_MAX)
_IOV_MAX = 1024
LOCKS_DIR = ".objckpt-locks"
RESERVED_PREFIX = ".objckpt-"
XATTR_CRC32C = "user.objckpt.crc32c"
LOCK_STRIPES = 256

_KIND_PUT = "put"
_KIND_UPLOAD = "up"
_KEY_SIDE_SUFFIX = "~key"  # '~' is not in the base64url alphabet, so it never ends a data name
_MAX_NAME = 255

_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.EINTR}
_PERMISSION_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}

_clock_lock = threading.Lock()
_last_ns = 0


def _unique_ns() -> int:
    """Wall-clock nanoseconds, strictly increasing within this process (see module doc)."""
    global _last_ns
    with _clock_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def _lstat_at(dfd: int, name: str) -> os.stat_result | None:
    """``lstat`` of ``name`` in directory ``dfd``; ``None`` when absent."""
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _token(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _write_all(fd: int, buffers: list[memoryview], offset: int | None) -> int:
    """Write ``buffers`` in order (``writev``, or ``pwritev`` at ``offset``), resuming after
    short writes; returns the bytes written."""
    pending = [b for b in buffers if b.nbytes]
    total = 0
    while pending:
        if len(pending) == 1:  # the plain calls for one buffer
            n = os.write(fd, pending[0]) if offset is None else os.pwrite(fd, pending[0], offset + total)
        else:
            batch = pending[:_IOV_MAX]
            n = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + total)
        total += n
        pending = advance(pending, n)
    return total
