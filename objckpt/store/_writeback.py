"""Start writing a streamed part's pages to disk as soon as the part is written (file://).

Why: the parts of one upload are ``pwrite``s into *one* staging file, and the completion's
``fsync`` then writes back the whole object from one thread; the kernel also serialises buffered
writes to one inode. Asking for the write-back of each part from the thread that wrote it
(Linux ``sync_file_range``) spreads that disk work over the part threads while later parts are
still being produced, so the final ``fsync`` finds little left to do. Measured on this project's
ext4 disk, 512 MiB in 16 MiB parts from 8 threads, fsync'd, median of 5: 0.61 s without, 0.46 s
with, 0.49 s for the same bytes written as 8 separate files.

This is not a durability point: ``sync_file_range`` writes no metadata and does not flush the
disk's cache. The upload's completion still ``fsync``s the file before it gets its name, exactly
as without it. Where the call does not exist (not Linux, no libc symbol) or the filesystem
refuses it, :func:`write_back` does nothing and says so by returning False.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["write_back"]

# <linux/fs.h>: wait for write-out already under way, start it for the range, wait for it
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4
_FLAGS = _WAIT_BEFORE | _WRITE | _WAIT_AFTER


def _load() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


#: ``sync_file_range(fd, offset, nbytes, flags)``, or None where it does not exist (a ctypes
#: call: it releases the GIL while the disk works)
_sync_file_range = _load()


def write_back(fd: int, offset: int, length: int) -> bool:
    """Write ``[offset, offset + length)`` of ``fd``'s dirty pages to disk and wait for them.

    Best effort and never raises: False where the call is missing or the filesystem refuses it
    (tmpfs, some FUSE and network filesystems); the caller's ``fsync`` is what makes the data
    durable either way."""
    fn = _sync_file_range
    if fn is None or length <= 0:
        return False
    return fn(fd, offset, length, _FLAGS) == 0
